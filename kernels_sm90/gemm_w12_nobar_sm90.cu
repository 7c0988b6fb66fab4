// W12 GEMM v4 at 33-128 tokens on row-tile-pair grids, without a CTA-wide barrier per
// record (NB; session 37 built it with in-loop hand-offs, session 38 with a producer warpgroup).
// Same consumers as v4's split ring (gemm_w12_wgmma_sm90.cu, session 18): four warpgroups,
// warpgroup w on m-tile w & 1 of row tile w >> 1, records bulk-copied per row-tile pair, one
// activation tile per step (128 tokens at 65-128, 64 at 33-64); the same decode, the same four
// m64nTk16 wgmma per record in the same order, the same epilogues, so the same bits. Where: the
// split ring's grids at 65-128 tokens and unsplit weights of >= 2 row tiles per SM at 33-64
// (the launcher, gemm_w12_wgmma_sm90.cu).
//
// Why (docs/perf-notes.md, sessions 37-38, benchmarks/probes/probe_wgmma_issue.cu): a wgmma blocks
// its warpgroup at issue while the tensor pipe holds other warpgroups' wgmma (~415 of 1024 cycles
// per step at four warpgroups). With a __syncthreads per record every warpgroup decodes at the
// same time, so the tensor pipe idles through the decodes: v4's step measured 1.30-1.45x the
// tensor time in shared memory alone, 1.00-1.02x with no CTA barrier. Session 37's forms without
// the barrier lost more to their hand-offs (200-450 cycles a warp and step: a shared atomic whose
// result was awaited, an arrival per warp, refills waiting for thread 0's schedule) than the
// barrier costs. Here the hand-offs are the ones Hopper's warp-specialised GEMMs use:
// - a fifth warpgroup produces (setmaxnreg: 24 registers, the consumers 112): one thread waits for
//   a stage's empty barrier and refills it;
// - a stage holds a record pair and its activation tile (one TMA box of 64 columns x T tokens,
//   128-byte swizzle, rows >= M zero from the tensor map's bounds) behind one full barrier;
// - one thread per consumer warpgroup releases stage i once a wgmma.wait_group at step i + 1 has
//   retired the warpgroup's wgmma of step i: they read the tile and, through their register
//   operand, every value the warpgroup's four warps loaded from the records, so no warp needs to
//   say more (four arrivals a stage, none awaited).
// - Half a record's wgmma stay in flight while the next half is decoded (the loop, below).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gemm_w12_mma.cuh"
#include "smxx_gemm_common.cuh"
#include "smxx_launch.cuh"
#include "smxx_pipe.cuh"
#include "smxx_w12_decode.cuh"
#include "smxx_wgmma.cuh"
#include "smxx_wgmma_epilogue.cuh"

namespace w12 {
namespace {

constexpr int kNbConsumers = 4 * kThreads;       // the four consumer warpgroups
constexpr int kNbThreads = kNbConsumers + kThreads;  // + the producer warpgroup
constexpr int kNbRecBytes = 2 * kRec;             // the pair's two records
// Per 8-token chunk count NCH (16: 65-128 tokens, 8: 33-64): the activation tile's bytes (NCH * 8
// token rows of 64 BF16 columns), a stage's (a multiple of 1024: the tiles stay swizzle-aligned),
// the stages (200 and 192 KB).
constexpr int nb_x_bytes(int nch) { return nch * 8 * 128; }
constexpr int nb_stage_bytes(int nch) { return kNbRecBytes + nb_x_bytes(nch); }
constexpr int nb_stages(int nch) { return nch == 16 ? 5 : 6; }
constexpr int nb_smem_bytes(int nch) { return nb_stages(nch) * nb_stage_bytes(nch); }
// setmaxnreg moves registers within the CTA's own allocation (ptxas gives each of the 640 threads
// 65536 / 640 rounded down to a multiple of 8 at launch): what the consumers take beyond it, the
// producer must have given back, or their setmaxnreg.inc waits forever.
constexpr int kNbLaunchRegs = 65536 / kNbThreads / 8 * 8;
constexpr int kNbConsumerRegs = 112, kNbProducerRegs = 24;
static_assert(kNbConsumers * kNbConsumerRegs + kThreads * kNbProducerRegs <= kNbThreads * kNbLaunchRegs,
              "the CTA's registers");
static_assert(nb_stage_bytes(8) % 1024 == 0 && nb_stage_bytes(16) % 1024 == 0, "128-byte swizzle atoms");
static_assert(epilogue_smem_bytes(8, 2) <= nb_smem_bytes(8) && epilogue_smem_bytes(16, 2) <= nb_smem_bytes(16),
              "the epilogue reuses the ring");

#if W12_WGMMA
// 2-D tensor copy of the box at (c0, c1) (column, token) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
template <int R>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}
#endif

template <int NCH>
__global__ void __launch_bounds__(kNbThreads, 1) gemm_w12_nobar_kernel(const WParams p, const __grid_constant__ CUtensorMap tmx) {
#if W12_WGMMA
  constexpr int T = 8 * NCH, kNbX = nb_x_bytes(NCH), kNbStage = nb_stage_bytes(NCH), kNbStages = nb_stages(NCH);
  extern __shared__ __align__(1024) uint8_t smem[];
  // XT helpers first, as in v4's unsplit grids at 33-128 tokens: transpose x for the epilogue, exit.
  if (blockIdx.x < p.xth) {
    if (p.pdl) pdl_wait();
    xt_blocks(p.x, p.ldx, p.M, p.KT, p.ws, p.xth);
    return;
  }
  const int tid = threadIdx.x;
  // K split (p.S > 1, e.g. down): CTA bid runs slice bid % S of row-tile pair bid / S and parks
  // its partial for v1's reduce kernel, as v4's split grids do.
  const int bid = blockIdx.x - p.xth, pt = bid / p.S, split = bid % p.S, row0 = pt * 256;
  const int kt0 = split * p.kper;
  // An odd last row tile leaves the second of the pair empty: its warpgroups decode whatever the
  // stage holds and keep every barrier; the epilogue stores no row >= N.
  const int nrt = row0 + 128 < p.N ? 2 : 1, nrec = min(p.KT - kt0, p.kper);
  __shared__ __align__(8) uint64_t bars[2 * kNbStages];
  const uint32_t full = smem_u32(&bars[0]), empty = full + 8 * kNbStages;
  const uint32_t sbase = smem_u32(smem);
  // With PDL nothing the previous kernel may write is read before the wait.
  if (p.pdl) pdl_wait();
  // The reduce kernel (S > 1) only waits for this grid's completion: let its CTAs be placed now.
  if (p.S > 1) pdl_launch_dependents();
  if (tid == 0) {
    for (int s = 0; s < kNbStages; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, 4);
    }
    mbar_fence_init();
  }
  __syncthreads();  // the barriers' initialisation before any thread waits on them (the last CTA-wide barrier)

  if (tid >= kNbConsumers) {
    regs_dec<kNbProducerRegs>();
    if (tid != kNbConsumers) return;
    const uint8_t* recb = p.records + ((size_t)(2 * pt) * p.KT + kt0) * kRec;
    for (int i = 0, s = 0; i < nrec; ++i) {
      // Stage s last held step i - kNbStages; its release completed phase (i / kNbStages - 1) & 1.
      if (i >= kNbStages) {
        mbar_wait(empty + 8 * s, ((i / kNbStages) - 1) & 1);
        fence_proxy_async_smem();  // the consumers' generic reads of the records before the copy's writes
      }
      const uint32_t bar = full + 8 * s, dst = sbase + s * kNbStage;
      mbar_arrive_expect_tx(bar, nrt * kRec + kNbX);
      for (int r = 0; r < nrt; ++r) bulk_copy_g2s(dst + r * kRec, recb + ((size_t)r * p.KT + i) * kRec, kRec, bar);
      tma_load_2d(dst + kNbRecBytes, &tmx, (kt0 + i) * 64, 0, bar);
      s = s == kNbStages - 1 ? 0 : s + 1;
    }
    return;
  }
  regs_inc<kNbConsumerRegs>();
  const int lane = tid & 31, quarter = (tid >> 5) & 3, mt0 = (tid >> 7) & 1, rtl = tid >> 8;
  const bool signals = (tid & (kThreads - 1)) == 0;  // the warpgroup's releasing thread

  constexpr int ND = T / 2;
  float acc[1][ND];
#pragma unroll
  for (int k = 0; k < ND; ++k) acc[0][k] = 0.f;
  const uint32_t hi_off = quarter * 2048 + lane * 16 + mt0 * 1024, lo_off = 8192 + quarter * 1024 + lane * 8 + mt0 * 512;
  const uint32_t k38 = opaque_k38(static_cast<uint32_t>(p.M) >> 30);
  // The stage of the next step and its phase parity.
  int rd = 0, prev = 0;
  uint32_t ph = 0;
  uint32_t buf[16];
  // Half a record at a time, one A buffer (the deep loop's two need 127 registers; the consumers
  // have 112): each half's two wgmma are a group of their own, so the wait before decoding a half
  // into its part of the buffer retires only the same half of the previous record, and that
  // record's other half stays in flight through the decode. The same wgmma in the same order.
  for (int i = 0; i < nrec; ++i) {
    mbar_wait(full + 8 * rd, ph);
    const uint8_t* st = smem + rd * kNbStage + rtl * kRec;
    const uint32_t xb = sbase + rd * kNbStage + kNbRecBytes;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      wgmma_wait1();  // this warpgroup's wgmma of half q of record i - 1 retired
#pragma unroll
      for (int k = 0; k < ND; ++k) pin(acc[0][k]);
      // After half 1's wait every wgmma of step i - 1 has retired: its stage is free.
      if (q == 1 && i > 0 && signals) mbar_arrive(empty + 8 * prev);
      const uint4 h = *reinterpret_cast<const uint4*>(st + hi_off + q * 512);
      const uint2 l = *reinterpret_cast<const uint2*>(st + lo_off + q * 256);
      decode16_split(h, l, buf + 8 * q, k38);
      wgmma_fence();
#pragma unroll
      for (int ks = 2 * q; ks < 2 * q + 2; ++ks) Wgmma<T>::run(acc[0], buf + 4 * ks, smem_desc_sw128(xb + 32 * ks));
      wgmma_commit();
    }
    prev = rd;
    ph ^= rd == kNbStages - 1 ? 1u : 0u;
    rd = rd == kNbStages - 1 ? 0 : rd + 1;
  }
  wgmma_wait0();
#pragma unroll
  for (int k = 0; k < ND; ++k) pin(acc[0][k]);
  // Every copy issued was waited for by every consumer, so none is in flight over the ring that the
  // epilogue (after its own barrier among the consumers) takes over.
  if (p.S == 1) {
    store_rows_smem<NCH, 1, 4, kNbConsumers>(acc, smem, row0, p);
    return;
  }
  // Parked evict_last in v1's order, as v4's split grids park theirs (gemm_w12_wgmma_sm90.cu).
  const int rowtile = 2 * pt + rtl;
  if (rowtile * 128 >= p.N) return;
  float4* mine = p.ws + ((size_t)rowtile * p.S + split) * (2 * NCH * kThreads) + (tid & (kThreads - 1));
  const uint64_t keep = l2_policy_evict_last();
#pragma unroll
  for (int j = 0; j < NCH; ++j)
    st_global_policy(mine + (mt0 * NCH + j) * kThreads,
                     make_float4(acc[0][4 * j], acc[0][4 * j + 1], acc[0][4 * j + 2], acc[0][4 * j + 3]), keep);
#endif
}

// cuTensorMapEncodeTiled from the driver the runtime loaded (no link against libcuda).
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (fn == nullptr) {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }
  return fn;
}

}  // namespace

cudaError_t gemm_nobar_launch(const GemmArgs& a, int m0, int tokens, int S, int kper, void* ws, int xth, bool pdl,
                              int grid, int smem_min, cudaStream_t stream) {
  // 33-64 tokens in 64-token tiles, 65-128 in 128-token tiles.
  const int nch = tokens > 64 ? 16 : 8;
  if (tokens <= 32 || tokens > kWgmmaMaxTokens || S < 1 || (S > 1 && xth != 0)) return cudaErrorInvalidValue;
  WParams p{};
  static_cast<GemmOperands&>(p) = a;
  const int kt = (a.K + 63) / 64;
  p.x = a.x + (int64_t)m0 * a.ldx;
  p.y = a.y + (int64_t)m0 * a.ldy;
  p.M = tokens;
  p.N = a.N;
  p.KT = kt;
  p.S = S;
  p.kper = kper;
  p.pdl = pdl ? 1 : 0;
  p.ldx = a.ldx;
  p.ldy = a.ldy;
  p.ws = static_cast<float4*>(ws);  // S > 1: the partials; S = 1: the XT scratch (or none)
  p.xth = xth;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  // x as [tokens, KT * 64] BF16 rows ldx apart (gemm_check_args: 16-byte aligned, ldx % 8 == 0,
  // columns K..KT*64 zero); boxes of 64 columns x 8 * nch tokens, rows past `tokens` filled with zeros.
  CUtensorMap map;
  const cuuint64_t dims[2] = {(cuuint64_t)kt * 64, (cuuint64_t)tokens};
  const cuuint64_t strides[1] = {(cuuint64_t)a.ldx * 2};
  const cuuint32_t box[2] = {64, (cuuint32_t)(8 * nch)}, estr[2] = {1, 1};
  if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<uint16_t*>(p.x), dims, strides, box, estr,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;
  const int smem = max(nb_smem_bytes(nch), smem_min);
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (nch == 8) {
    if ((e = set_smem_limit_once<gemm_w12_nobar_kernel<8>>(dev, smem)) != cudaSuccess) return e;
    return launch_ex(gemm_w12_nobar_kernel<8>, dim3(grid), dim3(kNbThreads), smem, stream, 1, pdl, p, map);
  }
  if ((e = set_smem_limit_once<gemm_w12_nobar_kernel<16>>(dev, smem)) != cudaSuccess) return e;
  return launch_ex(gemm_w12_nobar_kernel<16>, dim3(grid), dim3(kNbThreads), smem, stream, 1, pdl, p, map);
}

}  // namespace w12
