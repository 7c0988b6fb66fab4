// W12 GEMM v4 at 65-128 tokens on unsplit row-tile-pair grids, without a CTA-wide barrier per
// record (NB, session 37). Same CTA as v4's split ring (gemm_w12_wgmma_sm90.cu, session 18): four
// warpgroups, warpgroup w on m-tile w & 1 of row tile w >> 1, records bulk-copied per row-tile pair,
// one 128-token activation tile per step; the same decode, the same four m64n128k16 wgmma per
// record in the same order, the same epilogue, so the same bits.
//
// Why (docs/perf-notes.md, session 37, benchmarks/probes/probe_wgmma_issue.cu): a wgmma blocks its
// warpgroup at issue while the tensor pipe holds other warpgroups' wgmma (~415 of 1024 cycles per
// step at four warpgroups). With a __syncthreads per record every warpgroup decodes at the same
// time, so the tensor pipe idles through the decodes: v4's step measured 1.30-1.45x the tensor
// time in shared memory alone, 1.00-1.02x with no CTA barrier. Here each ring slot has a full
// mbarrier, and the warpgroups drift apart, so that one decodes while another's wgmma run.
//
// - Records: one bulk copy per record and row tile into RSL = 5 slots; activation tiles: one TMA
//   load of a 64-column x 128-row box per step (128-byte swizzle, the tile v4 builds with
//   cp.async; rows >= M come back zero from the tensor map's bounds) into XS = 6 slots.
// - A warp is done with record i's slot once it has decoded it, with tile i's once wgmma.wait_group
//   1 at step i + 2 has retired its wgmma; it arrives on the slot's empty barrier. Thread 0 refills
//   freed slots (record i + 5, tile i + 6) without ever waiting for one (pump, below).
// - The deep loop: record i - 1's wgmma stay in flight while record i is decoded into the other A
//   buffer (wait_group 1), as the probe's fastest form.
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

constexpr int kNbThreads = 4 * kThreads;
constexpr int kNbWarps = kNbThreads / 32;         // releases per phase of a slot (a power of two)
constexpr int kNbRecSlots = 5;                    // RSL
constexpr int kNbXSlots = 6;                      // XS
constexpr int kNbT = kWgmmaMaxTokens;             // 128 token rows per activation tile
constexpr int kNbX = kNbT * 128;                  // its bytes (64 BF16 columns a row)
constexpr int kNbRecStride = 2 * kRec;            // a record slot holds the pair's two records
constexpr int kNbXBase = kNbRecSlots * kNbRecStride;
constexpr int kNbSmem = kNbXBase + kNbXSlots * kNbX;  // 216 KB
static_assert(epilogue_smem_bytes(16, 2) <= kNbSmem, "the epilogue reuses the ring");

#if W12_WGMMA
// mbarrier.test_wait: whether the phase of `parity` has completed, without waiting (try_wait may
// suspend the thread for a while).
__device__ __forceinline__ bool mbar_test_now(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{ .reg .pred p; mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}

// 2-D tensor copy of the box at (c0, c1) (column, token) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
#endif

__global__ void __launch_bounds__(kNbThreads, 1) gemm_w12_nobar_kernel(const WParams p, const __grid_constant__ CUtensorMap tmx) {
#if W12_WGMMA
  extern __shared__ __align__(1024) uint8_t smem[];
  // XT helpers first, as in v4's unsplit grids at 33-128 tokens: transpose x for the epilogue, exit.
  if (blockIdx.x < p.xth) {
    if (p.pdl) pdl_wait();
    xt_blocks(p.x, p.ldx, p.M, p.KT, p.ws, p.xth);
    return;
  }
  const int tid = threadIdx.x, lane = tid & 31, quarter = (tid >> 5) & 3, mt0 = (tid >> 7) & 1, rtl = tid >> 8;
  // K split (p.S > 1, e.g. down): CTA bid runs slice bid % S of row-tile pair bid / S and parks
  // its partial for v1's reduce kernel, as v4's split grids do.
  const int bid = blockIdx.x - p.xth, pt = bid / p.S, split = bid % p.S, row0 = pt * 256;
  const int kt0 = split * p.kper;
  // An odd last row tile leaves the second of the pair empty: its warpgroups decode whatever the
  // slot holds and keep every barrier; the epilogue stores no row >= N.
  const int nrt = row0 + 128 < p.N ? 2 : 1, nrec = min(p.KT - kt0, p.kper);
  // Full and empty barriers of the record slots, then of the activation-tile slots.
  __shared__ __align__(8) uint64_t bars[2 * (kNbRecSlots + kNbXSlots)];
  const uint32_t full_r = smem_u32(&bars[0]), empty_r = full_r + 8 * kNbRecSlots;
  const uint32_t full_x = empty_r + 8 * kNbRecSlots, empty_x = full_x + 8 * kNbXSlots;
  const uint32_t sbase = smem_u32(smem);
  const uint8_t* recb = p.records + ((size_t)(2 * pt) * p.KT + kt0) * kRec;
  auto load_rec = [&](int slot, int i) {
    const uint32_t bar = full_r + 8 * slot;
    mbar_arrive_expect_tx(bar, nrt * kRec);
    for (int r = 0; r < nrt; ++r)
      bulk_copy_g2s(sbase + slot * kNbRecStride + r * kRec, recb + ((size_t)r * p.KT + i) * kRec, kRec, bar);
  };
  auto load_x = [&](int xs, int i) {
    const uint32_t bar = full_x + 8 * xs;
    mbar_arrive_expect_tx(bar, kNbX);
    tma_load_2d(sbase + kNbXBase + xs * kNbX, &tmx, (kt0 + i) * 64, 0, bar);
  };
  // A warp done with a slot arrives on its empty barrier (lane 0, after the warp's reads; nothing
  // waits on the arrival). Session 37's second form counted the releases with a shared-memory
  // atomic whose result the warp waited for: ~430 cycles a release, two a step (nb_prof).
  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  // Thread 0's refills, never waiting: the next record (tile) goes into its slot once that slot's
  // empty barrier shows every warp's release of the record (tile) RSL (XS) before it. Thread 0
  // pumps at two places a step and inside its own waits on full barriers, so a refill that the
  // slowest warp makes possible is issued within about half a step, and never missed while thread
  // 0 itself waits for it. Copies land in order, so thread 0 passing its last step's full barriers
  // means every refill has been issued.
  int next_r = kNbRecSlots, next_x = kNbXSlots, pr_r = 0, pr_x = 0;
  uint32_t pe_r = 0, pe_x = 0;
  auto pump = [&]() {
    if (next_r < nrec && mbar_test_now(empty_r + 8 * pr_r, pe_r)) {
      fence_proxy_async_smem();  // the warps' generic reads of the slot before the copy's writes
      load_rec(pr_r, next_r++);
      pe_r ^= pr_r == kNbRecSlots - 1 ? 1u : 0u;
      pr_r = pr_r == kNbRecSlots - 1 ? 0 : pr_r + 1;
    }
    if (next_x < nrec && mbar_test_now(empty_x + 8 * pr_x, pe_x)) {
      load_x(pr_x, next_x++);
      pe_x ^= pr_x == kNbXSlots - 1 ? 1u : 0u;
      pr_x = pr_x == kNbXSlots - 1 ? 0 : pr_x + 1;
    }
  };
  auto wait_full = [&](uint32_t bar, uint32_t parity) {
    while (!mbar_test(bar, parity))
      if (tid == 0) pump();
  };
  // With PDL nothing the previous kernel may write is read before the wait.
  if (p.pdl) pdl_wait();
  // The reduce kernel (S > 1) only waits for this grid's completion: let its CTAs be placed now.
  if (p.S > 1) pdl_launch_dependents();
  if (tid == 0) {
    for (int s = 0; s < kNbRecSlots; ++s) {
      mbar_init(full_r + 8 * s, 1);
      mbar_init(empty_r + 8 * s, kNbWarps);
    }
    for (int s = 0; s < kNbXSlots; ++s) {
      mbar_init(full_x + 8 * s, 1);
      mbar_init(empty_x + 8 * s, kNbWarps);
    }
    mbar_fence_init();
    for (int s = 0; s < kNbRecSlots && s < nrec; ++s) load_rec(s, s);
    for (int s = 0; s < kNbXSlots && s < nrec; ++s) load_x(s, s);
  }
  __syncthreads();  // the barriers' initialisation before any thread waits on them

  constexpr int ND = kNbT / 2;
  float acc[1][ND];
#pragma unroll
  for (int k = 0; k < ND; ++k) acc[0][k] = 0.f;
  const uint32_t hi_off = quarter * 2048 + lane * 16 + mt0 * 1024, lo_off = 8192 + quarter * 1024 + lane * 8 + mt0 * 512;
  const uint32_t k38 = opaque_k38(static_cast<uint32_t>(p.M) >> 30);
  // The slot (and its phase parity) of the next record / tile to read, and of the next tile to release.
  int rd_r = 0, rd_x = 0, rel_x = 0;
  uint32_t ph_r = 0, ph_x = 0;
  auto step = [&](int i, uint32_t(&buf)[16]) {
    wgmma_wait1();  // this warpgroup's wgmma of record i - 2 retired: buf and tile i - 2's slot are free
#pragma unroll
    for (int k = 0; k < ND; ++k) pin(acc[0][k]);
    if (i >= 2) {
      release(empty_x + 8 * rel_x);
      rel_x = rel_x == kNbXSlots - 1 ? 0 : rel_x + 1;
    }
    wait_full(full_r + 8 * rd_r, ph_r);
    const uint8_t* st = smem + rd_r * kNbRecStride + rtl * kRec;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint4 h = *reinterpret_cast<const uint4*>(st + hi_off + q * 512);
      const uint2 l = *reinterpret_cast<const uint2*>(st + lo_off + q * 256);
      decode16_split(h, l, buf + 8 * q, k38);
    }
    release(empty_r + 8 * rd_r);
    if (tid == 0) pump();
    ph_r ^= rd_r == kNbRecSlots - 1 ? 1u : 0u;
    rd_r = rd_r == kNbRecSlots - 1 ? 0 : rd_r + 1;
    wait_full(full_x + 8 * rd_x, ph_x);
    const uint32_t xb = sbase + kNbXBase + rd_x * kNbX;
    ph_x ^= rd_x == kNbXSlots - 1 ? 1u : 0u;
    rd_x = rd_x == kNbXSlots - 1 ? 0 : rd_x + 1;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) Wgmma<kNbT>::run(acc[0], buf + 4 * ks, smem_desc_sw128(xb + 32 * ks));
    wgmma_commit();
    if (tid == 0) pump();
  };
  // Both buffers through an unrolled pair of steps (no control path may decode into a buffer whose
  // wgmma is still in flight: see v4's DEEP loop).
  uint32_t a0[16], a1[16];
  int i = 0;
  for (; i + 1 < nrec; i += 2) {
    step(i, a0);
    step(i + 1, a1);
  }
  if (i < nrec) step(i, a0);
  wgmma_wait0();
#pragma unroll
  for (int k = 0; k < ND; ++k) pin(acc[0][k]);
  // Every copy issued was waited for by every warp, so none is in flight over the ring that the
  // epilogue (after its own __syncthreads) takes over.
  if (p.S == 1) {
    store_rows_smem<16, 1, 4>(acc, smem, row0, p);
    return;
  }
  // Parked evict_last in v1's order, as v4's split grids park theirs (gemm_w12_wgmma_sm90.cu).
  const int rowtile = 2 * pt + rtl;
  if (rowtile * 128 >= p.N) return;
  float4* mine = p.ws + ((size_t)rowtile * p.S + split) * (2 * 16 * kThreads) + (tid & (kThreads - 1));
  const uint64_t keep = l2_policy_evict_last();
#pragma unroll
  for (int j = 0; j < 16; ++j)
    st_global_policy(mine + (mt0 * 16 + j) * kThreads,
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
  if (tokens <= 64 || tokens > kNbT || S < 1 || (S > 1 && xth != 0)) return cudaErrorInvalidValue;
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
  // columns K..KT*64 zero); boxes of 64 columns x 128 tokens, rows past `tokens` filled with zeros.
  CUtensorMap map;
  const cuuint64_t dims[2] = {(cuuint64_t)kt * 64, (cuuint64_t)tokens};
  const cuuint64_t strides[1] = {(cuuint64_t)a.ldx * 2};
  const cuuint32_t box[2] = {64, (cuuint32_t)kNbT}, estr[2] = {1, 1};
  if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<uint16_t*>(p.x), dims, strides, box, estr,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;
  const int smem = max(kNbSmem, smem_min);
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if ((e = set_smem_limit_once<gemm_w12_nobar_kernel>(dev, smem)) != cudaSuccess) return e;
  return launch_ex(gemm_w12_nobar_kernel, dim3(grid), dim3(kNbThreads), smem, stream, 1, pdl, p, map);
}

}  // namespace w12
