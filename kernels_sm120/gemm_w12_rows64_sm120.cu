// W12 GEMM, portable mma.sync kernel with 64 weight rows per warp (R64), for 33-64 tokens.
//
// Why (docs/perf-notes.md, session 23): at 64 tokens v1's warps own 32 rows each, so every warp
// reads the whole activation tile (64 tokens x 64 columns, 8 KB) from shared memory per record:
// 32 KB per 12 KB record for a 4-warp CTA. Making each warp read only half of it (a probe with wrong
// output) took gate_up and lm_head 7 % faster at 64 tokens. Here a warp owns 64 rows (four m-tiles,
// two layout-1 quarters of a record), which halves those reads per weight; 128 FP32 accumulators
// per thread leave no room to decode the whole record at once, so each record runs as two halves
// (k-steps 0-1, then 2-3), each decoding four vectors and reading one 16-byte activation chunk per
// 8 tokens.
//
// A CTA is four warps on two consecutive 128-row tiles (kRT), so each activation tile copied from
// L2 serves twice the weight rows of v1's CTA. One tile per CTA (two warps, v1's grid) was slower
// everywhere (session 23: 2-warp CTAs leave an SM 6 warps), so the 256-row CTA is the only form;
// the launcher takes it where its grid still fills the SMs (gemm_launch).
//
// Bits: each accumulator takes the same mma.sync instructions as in v1's kernel (k-steps 0, 1, 2,
// 3 of every record, records in order); split grids park the partials in v1's 4-warp fragment map
// for its reduce kernel, unsplit ones run an epilogue with v1's operations per output in its
// order: the same bits as v1 for every output.
// Runs on sm_90+ only where the reduce kernel sums the slices (or the weight is unsplit); the
// launcher (gemm_w12_mma_sm120.cu) says when.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gemm_w12_mma.cuh"
#include "smxx_gemm_common.cuh"
#include "smxx_gemm_epilogue.cuh"
#include "smxx_launch.cuh"
#include "smxx_pipe.cuh"
#include "smxx_w12_decode.cuh"

namespace w12 {
namespace {

constexpr int kRecordBytes = 12288;
constexpr int kRT = 2;      // row tiles per CTA
constexpr int kStages = 3;  // 96 KB of ring: two CTAs per SM

template <int NCH>
__global__ void __launch_bounds__(64 * kRT, 2) gemm_w12_r64_kernel(const KParams p) {
#if __CUDA_ARCH__ >= 900  // records by bulk copy (sm_90+); the launcher runs R64 nowhere else
  constexpr int RT = kRT, STAGES = kStages, kT = 64 * RT;
  constexpr int kStage = RT * kRecordBytes + NCH * 1024;
  static_assert(STAGES * kStage >= RT * 128 * (8 * NCH + 1) * 4, "the unsplit epilogue reuses the ring");
  extern __shared__ __align__(128) uint8_t smem[];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rtl = warp >> 1, half = warp & 1;  // this warp: rows 64 half .. +63 of the CTA's tile rtl
  const int tile0 = (blockIdx.x / p.S) * RT, split = blockIdx.x % p.S;
  const int ntiles = (p.N + 127) / 128;
  const int nrt = min(RT, ntiles - tile0);  // the last CTA of an odd tile count holds one
  const bool live = rtl < nrt;
  const int rowtile = tile0 + rtl;
  const int kt0 = split * p.kper;
  const int nrec = min(p.KT - kt0, p.kper);
  const uint8_t* rec0 = p.records + ((size_t)tile0 * p.KT + kt0) * kRecordBytes;
  if (p.flags & kPdl) pdl_wait();
  if (p.flags & kReduceKernel) pdl_launch_dependents();
  if (p.S == 1 && live && lane < 8) {
    // The epilogue's row data (read after the loop) into L2 now: lanes 0-7 touch rows 8 apart,
    // so every line of the warp's 64 rows in each array.
    const int n = min(rowtile * 128 + half * 64 + lane * 8, p.N - 1);
    prefetch_l2(p.base + n);
    prefetch_l2(p.esc_ptr + n);
    if (p.bias) prefetch_l2(p.bias + n);
  }
  const uint32_t sbase = smem_u32(smem);
  // Vector Q = 2 mtl + e (m-tile mtl = 0..3 of the warp's 64 rows, k-steps 2e, 2e + 1) in layout 1:
  // hi at 4096 half + 512 Q + 16 lane, lo at 8192 + 2048 half + 256 Q + 8 lane (v1's quarter
  // 2 half + mtl / 2, its vector 2 (mtl & 1) + e).
  const uint32_t hi_off = rtl * kRecordBytes + half * 4096 + lane * 16;
  const uint32_t lo_off = rtl * kRecordBytes + 8192 + half * 2048 + lane * 8;

  // Activation tile as v1's: token r's 16-byte chunk ch at r * 128 + ((ch ^ (r & 7)) << 4), rows
  // past M zero-filled; thread tid copies chunk tid & 7 of tokens tid / 8 + u * kT / 8.
  constexpr int kXPer = NCH * 64 / kT;
  const int xr0 = tid >> 3, xch = tid & 7;
  const int xoff0 = xr0 * (int)p.ldx + xch * 8;
  const uint32_t xdst0 = RT * kRecordBytes + xr0 * 128 + ((xch ^ (xr0 & 7)) << 4);

  __shared__ __align__(8) uint64_t full_bar[STAGES];
  const uint32_t bar0 = smem_u32(&full_bar[0]);
  if (tid == 0) init_ring_barriers<STAGES>(bar0);

  // Records: one bulk copy per row tile, issued by thread 0, completing on the slot's mbarrier (as
  // v1's above 16 tokens); the activation tile by per-thread cp.async.
  auto load_stage = [&](int slot, int i) {
    const uint32_t dst = sbase + slot * kStage;
    if (tid == 0) {
      mbar_arrive_expect_tx(bar0 + 8 * slot, nrt * kRecordBytes);
#pragma unroll
      for (int r = 0; r < RT; ++r)
        if (r < nrt)
          bulk_copy_g2s(dst + r * kRecordBytes, rec0 + ((size_t)r * p.KT + i) * kRecordBytes, kRecordBytes,
                        bar0 + 8 * slot);
    }
    const uint16_t* xs = p.x + (int64_t)(kt0 + i) * 64;
#pragma unroll
    for (int u = 0; u < kXPer; ++u) {
      const bool valid = xr0 + u * (kT / 8) < p.M;
      cp_async16_zfill(dst + xdst0 + u * (kT / 8) * 128, xs + (valid ? xoff0 + u * (kT / 8) * (int)p.ldx : xch * 8),
                       valid);
    }
  };

  float acc[4][NCH][4];
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int j = 0; j < NCH; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][j][i] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nrec) load_stage(s, s);
    cp_async_commit();
  }

  const uint32_t k38 = opaque_k38(static_cast<uint32_t>(p.M) >> 30);
  RingSlots<STAGES> ring;
  for (int i = 0; i < nrec; ++i) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // step i-1 is done everywhere: its slot may be refilled
    const int wslot = ring.take_write();
    if (i + STAGES - 1 < nrec) load_stage(wslot, i + STAGES - 1);
    cp_async_commit();
    const int slot = ring.take_read(true, bar0);
    if (!live) continue;

    const uint8_t* st = smem + slot * kStage;
    const uint8_t* xt = st + RT * kRecordBytes;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      uint32_t a[4][8];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const uint4 h = *reinterpret_cast<const uint4*>(st + hi_off + (2 * m + e) * 512);
        const uint2 l = *reinterpret_cast<const uint2*>(st + lo_off + (2 * m + e) * 256);
        decode16_split(h, l, a[m], k38);
      }
      // Chunk 2t + e of token 8j + g: v1's b0 (e = 0) or b1 (e = 1), i.e. k-steps 2e and 2e + 1.
      uint4 b[NCH];
#pragma unroll
      for (int j = 0; j < NCH; ++j)
        b[j] = *reinterpret_cast<const uint4*>(xt + (8 * j + g) * 128 + (((2 * t + e) ^ g) << 4));
      // k-step outer: an accumulator's next MMA is 4 NCH MMAs behind its last one.
#pragma unroll
      for (int k2 = 0; k2 < 2; ++k2)
#pragma unroll
        for (int j = 0; j < NCH; ++j)
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            const uint32_t af[4] = {a[m][4 * k2], a[m][4 * k2 + 1], a[m][4 * k2 + 2], a[m][4 * k2 + 3]};
            mma_bf16_16816(acc[m][j], af, k2 ? b[j].z : b[j].x, k2 ? b[j].w : b[j].y);
          }
    }
  }
  cp_async_wait<0>();

  // Rows of m-tile m: v1's quarter 2 half + m / 2, its m-tile m & 1.
  if (p.S > 1) {
    if (!live) return;
    // v1's 4-warp partial map for the reduce kernel: fragment (m & 1) * NCH + j of v1 thread
    // 32 (2 half + m / 2) + lane.
    float4* mine = p.ws + ((size_t)rowtile * p.S + split) * (2 * NCH * 128) + half * 64 + lane;
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int j = 0; j < NCH; ++j)
        mine[((m & 1) * NCH + j) * 128 + (m >> 1) * 32] =
            make_float4(acc[m][j][0], acc[m][j][1], acc[m][j][2], acc[m][j][3]);
    return;
  }
  // Unsplit: the sums go through shared memory (the ring is free once every warp is past the
  // loop), one row per thread at a time, as v4's store_rows_smem. Measured (session 23): v1's
  // per-fragment epilogue here, inlined 32 times with its row data loaded after the loop, cost
  // lm_head ~10 % at 64 tokens (instruction-cache and load stalls). Rows padded to 8 NCH + 1
  // floats: a token's column of consecutive rows spans all banks.
  constexpr int TP = 8 * NCH + 1;
  float* Y = reinterpret_cast<float*>(smem);
  __syncthreads();
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int j = 0; j < NCH; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        Y[(rtl * 128 + half * 64 + 16 * m + g + 8 * (i >> 1)) * TP + 8 * j + 2 * t + (i & 1)] = acc[m][j][i];
  __syncthreads();
#pragma unroll 1
  for (int r = tid; r < RT * 128; r += kT)
    if (tile0 * 128 + r < p.N) epilogue_row_smem(Y + r * TP, tile0 * 128 + r, 0, p.M, p);
#endif
}

}  // namespace

cudaError_t gemm_r64_launch(const KParams& p, int smem_min, int dev, cudaStream_t stream) {
  if (p.M > 64 || p.M <= 32 || p.cluster || (p.S > 1 && !(p.flags & kReduceKernel))) return cudaErrorInvalidValue;
  constexpr int NCH = 8;
  const int smem = max(kStages * (kRT * kRecordBytes + NCH * 1024), smem_min);
  constexpr auto kern = gemm_w12_r64_kernel<NCH>;
  if (const cudaError_t err = set_smem_limit_once<kern>(dev, smem); err != cudaSuccess) return err;
  const int grid = ((p.N + 127) / 128 + kRT - 1) / kRT * p.S;
  return launch_ex(kern, dim3(grid), dim3(64 * kRT), smem, stream, 1, (p.flags & kPdl) != 0, p);
}

}  // namespace w12
