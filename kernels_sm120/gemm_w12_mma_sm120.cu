// W12 GEMM, portable mma.sync version (sm_80, sm_90, sm_120a): y[M, N] = x[M, K] W[N, K]^T.
//
// Shape of the computation (see docs/perf-notes.md for the measurements behind each choice):
// - y^T = W x^T: a 128x64 weight record is the A operand of mma.m16n8k16 (row-major, from
//   registers), the tokens are the MMA's n (8 per MMA), so 1..64 token rows waste little.
// - One CTA = 4 warps = one 128-row tile and a fixed slice of its K tiles. Each warp decodes its
//   32 rows of a record straight into A fragments (layout 1, smxx_w12_decode.cuh): no shared
//   memory round trip for decoded weights.
// - Records and the activation tile of each K step stream through a STAGES-deep cp.async ring.
//   Every thread copies exactly the record bytes it later decodes, so the weights need no
//   barrier; one __syncthreads per step covers the shared activation tile.
// - K-split: gemm_splits() fixes the number of K slices from (N, K, target CTAs) only. Partial
//   sums go to a workspace and the last CTA of a row tile to arrive (atomic ticket) adds the
//   slices in slice order. Every output element is therefore summed in one fixed order that does
//   not depend on M or on which CTA finishes last: results are deterministic and row i of y has
//   the same bits whatever M is.
// - Epilogue (once per element, in the reducing CTA): multiply by 2^(b - E0), fix escapes with
//   (w_true - w_slot) x[col] in escape-list order, add bias, round to BF16.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gemm_w12_mma.cuh"
#include "smxx_w12_decode.cuh"

namespace w12 {
namespace {

constexpr int kThreads = 128;
constexpr int kRecordBytes = 12288;
constexpr int kMaxTokens = 64;  // per launch; longer M is cut into 64-token chunks

struct KParams {
  const uint16_t* x;
  const uint8_t* records;
  const uint8_t* base;
  const int32_t* esc_ptr;
  const int32_t* esc_col;
  const int16_t* esc_val;
  const float* bias;
  uint16_t* y;
  float4* ws;
  int* counters;
  int M, N, KT, S, kper;
  int64_t ldx, ldy;
};

template <int NCH>
struct MinBlocks {
  // Register budget per thread: 4 CTAs/SM (<= 128 regs) while the accumulators are small,
  // fewer once 64 tokens need 64 FP32 accumulators per thread.
  static constexpr int value = NCH <= 2 ? 4 : (NCH == 4 ? 3 : 2);
};

__device__ __forceinline__ float finish(float v, int n, int m, const KParams& p) {
  const uint32_t b = p.base[n];
  v *= row_scale(b);
  const int e0 = p.esc_ptr[n], e1 = p.esc_ptr[n + 1];
  if (e0 < e1) {
    // The slot of an escape decoded as code 0 = 2^(b-127); replace that product by the true
    // weight's. Both products are exact in FP32 (8-bit x 8-bit mantissas); an inf/NaN weight
    // makes the result inf/NaN exactly as multiplying by the decoded weight would.
    const float slot = escape_slot_value(b);
    const uint16_t* xr = p.x + (int64_t)m * p.ldx;
    for (int e = e0; e < e1; ++e) {
      const float xv = bf16_bits_to_float(xr[p.esc_col[e]]);
      const float wv = bf16_bits_to_float(static_cast<uint16_t>(p.esc_val[e]));
      v = __fadd_rn(v, __fmul_rn(wv, xv));
      v = __fsub_rn(v, __fmul_rn(slot, xv));
    }
  }
  if (p.bias) v = __fadd_rn(v, p.bias[n]);
  return v;
}

template <int NCH, int STAGES>
__global__ void __launch_bounds__(kThreads, MinBlocks<NCH>::value) gemm_w12_mma_kernel(const KParams p) {
  constexpr int kXBytes = NCH * 8 * 128;  // 8*NCH tokens x 64 BF16
  constexpr int kStage = kRecordBytes + kXBytes;
  extern __shared__ __align__(128) uint8_t smem[];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rowtile = blockIdx.x / p.S, split = blockIdx.x % p.S;
  const int kt0 = split * p.kper;
  const int nrec = min(p.KT - kt0, p.kper);
  const uint8_t* rec0 = p.records + ((size_t)rowtile * p.KT + kt0) * kRecordBytes;
  const uint32_t sbase = smem_u32(smem);
  const uint32_t hi_off = warp * 2048 + lane * 16;
  const uint32_t lo_off = 8192 + warp * 1024 + lane * 8;

  auto load_stage = [&](int slot, int i) {
    const uint8_t* src = rec0 + (size_t)i * kRecordBytes;
    const uint32_t dst = sbase + slot * kStage;
#pragma unroll
    for (int q = 0; q < 4; ++q) cp_async16(dst + hi_off + q * 512, src + hi_off + q * 512);
#pragma unroll
    for (int q = 0; q < 4; ++q) cp_async8(dst + lo_off + q * 256, src + lo_off + q * 256);
    // Activation tile [8*NCH tokens][64 columns], 16-byte chunk c of token r stored at chunk
    // c ^ (r & 7): the fragment reads below (8 lanes = 2 tokens x 4 t) then hit 8 distinct
    // 16-byte bank groups. Tokens >= M are zero-filled.
    const int64_t kcol = (int64_t)(kt0 + i) * 64;
#pragma unroll
    for (int c = tid; c < NCH * 64; c += kThreads) {
      const int r = c >> 3, ch = c & 7;
      const bool valid = r < p.M;
      const uint16_t* xs = p.x + (valid ? (int64_t)r * p.ldx : 0) + kcol + ch * 8;
      cp_async16_zfill(dst + kRecordBytes + r * 128 + ((ch ^ (r & 7)) << 4), xs, valid);
    }
  };

  float acc[2][NCH][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int j = 0; j < NCH; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][j][i] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nrec) load_stage(s, s);
    cp_async_commit();
  }

  for (int i = 0; i < nrec; ++i) {
    cp_async_wait<STAGES - 2>();
    // Everyone has finished step i-1, so its slot (the one refilled next) is free.
    __syncthreads();
    if (i + STAGES - 1 < nrec) load_stage((i + STAGES - 1) % STAGES, i + STAGES - 1);
    cp_async_commit();

    const uint8_t* st = smem + (i % STAGES) * kStage;
    uint32_t a[32];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint4 h = *reinterpret_cast<const uint4*>(st + hi_off + q * 512);
      const uint2 l = *reinterpret_cast<const uint2*>(st + lo_off + q * 256);
      decode16(h, l, a + 8 * q);
    }
#pragma unroll
    for (int j = 0; j < NCH; ++j) {
      const uint8_t* xr = st + kRecordBytes + (8 * j + g) * 128;
      const uint4 b0 = *reinterpret_cast<const uint4*>(xr + (((2 * t) ^ g) << 4));
      const uint4 b1 = *reinterpret_cast<const uint4*>(xr + (((2 * t + 1) ^ g) << 4));
      const uint32_t bw[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const uint32_t af[4] = {a[16 * mt + 4 * ks + 0], a[16 * mt + 4 * ks + 1], a[16 * mt + 4 * ks + 2],
                                  a[16 * mt + 4 * ks + 3]};
          mma_bf16_16816(acc[mt][j], af, bw[2 * ks], bw[2 * ks + 1]);
        }
    }
  }
  cp_async_wait<0>();

  if (p.S > 1) {
    // Partial sums in fragment order: thread tid's float4 of (mt, j) at [tile][split][mt][j][tid],
    // so both the stores here and the reducing loads below are coalesced 16-byte accesses.
    float4* mine = p.ws + ((size_t)rowtile * p.S + split) * (2 * NCH * kThreads) + tid;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int j = 0; j < NCH; ++j)
        mine[(mt * NCH + j) * kThreads] = make_float4(acc[mt][j][0], acc[mt][j][1], acc[mt][j][2], acc[mt][j][3]);
    __threadfence();
    __syncthreads();
    __shared__ int s_last;
    if (tid == 0) {
      const int ticket = atomicAdd(&p.counters[rowtile], 1);
      s_last = ticket == p.S - 1;
      if (s_last) p.counters[rowtile] = 0;  // every slice has arrived: ready for the next launch
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const float4* tile = p.ws + (size_t)rowtile * p.S * (2 * NCH * kThreads) + tid;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int j = 0; j < NCH; ++j) {
        const int off = (mt * NCH + j) * kThreads;
        // Fixed order: slice 0 + slice 1 + ... whatever CTA reduces.
        float4 sum = split == 0 ? make_float4(acc[mt][j][0], acc[mt][j][1], acc[mt][j][2], acc[mt][j][3])
                                : __ldcg(tile + off);
        for (int s = 1; s < p.S; ++s) {
          const float4 v = s == split ? make_float4(acc[mt][j][0], acc[mt][j][1], acc[mt][j][2], acc[mt][j][3])
                                      : __ldcg(tile + (size_t)s * (2 * NCH * kThreads) + off);
          sum.x = __fadd_rn(sum.x, v.x);
          sum.y = __fadd_rn(sum.y, v.y);
          sum.z = __fadd_rn(sum.z, v.z);
          sum.w = __fadd_rn(sum.w, v.w);
        }
        acc[mt][j][0] = sum.x;
        acc[mt][j][1] = sum.y;
        acc[mt][j][2] = sum.z;
        acc[mt][j][3] = sum.w;
      }
  }

#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int j = 0; j < NCH; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = rowtile * 128 + warp * 32 + mt * 16 + g + 8 * (i >> 1);
        const int m = 8 * j + 2 * t + (i & 1);
        if (n < p.N && m < p.M) {
          const float v = finish(acc[mt][j][i], n, m, p);
          p.y[(int64_t)m * p.ldy + n] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
        }
      }
}

template <int NCH, int STAGES>
cudaError_t launch_one(const KParams& p, int grid, cudaStream_t stream) {
  constexpr int smem = STAGES * (kRecordBytes + NCH * 1024);
  auto kern = gemm_w12_mma_kernel<NCH, STAGES>;
  // Raising the dynamic shared-memory limit is per device; once per (instantiation, device).
  static int configured[64] = {0};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 64 && !configured[dev]) {
    err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    configured[dev] = 1;
  }
  kern<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int STAGES>
cudaError_t launch_stages(const KParams& p, int grid, int tokens, cudaStream_t stream) {
  if (tokens <= 8) return launch_one<1, STAGES>(p, grid, stream);
  if (tokens <= 16) return launch_one<2, STAGES>(p, grid, stream);
  if (tokens <= 32) return launch_one<4, STAGES>(p, grid, stream);
  return launch_one<8, STAGES>(p, grid, stream);
}

int nchunks_for(int tokens) { return tokens <= 8 ? 1 : tokens <= 16 ? 2 : tokens <= 32 ? 4 : 8; }

}  // namespace

int gemm_splits(int N, int K, int target_ctas) {
  const int nt = (N + 127) / 128, kt = (K + 63) / 64;
  if (target_ctas < 1) target_ctas = 1;
  int s = (target_ctas + nt - 1) / nt;
  s = s < 1 ? 1 : (s > kt ? kt : s);
  const int kper = (kt + s - 1) / s;
  return (kt + kper - 1) / kper;  // no empty slices
}

size_t gemm_workspace_bytes(int M, int N, int K, int target_ctas) {
  const int s = gemm_splits(N, K, target_ctas);
  if (s <= 1 || M <= 0) return 0;
  const int tokens = M < kMaxTokens ? M : kMaxTokens;
  const size_t nt = (N + 127) / 128;
  return nt * s * 2 * nchunks_for(tokens) * kThreads * sizeof(float4);
}

cudaError_t gemm_launch(const GemmArgs& a, cudaStream_t stream) {
  if (a.M < 0 || a.N <= 0 || a.K <= 0) return cudaErrorInvalidValue;
  if (a.M == 0) return cudaSuccess;
  const int nt = (a.N + 127) / 128, kt = (a.K + 63) / 64;
  if (a.ldx < (int64_t)kt * 64 || (a.ldx & 7) || a.ldy < a.N) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(a.x) & 15) || (reinterpret_cast<uintptr_t>(a.records) & 15))
    return cudaErrorMisalignedAddress;
  const int s = gemm_splits(a.N, a.K, a.target_ctas);
  const int kper = (kt + s - 1) / s;
  if (s > 1 && (a.workspace == nullptr || a.counters == nullptr)) return cudaErrorInvalidValue;
  KParams p{a.x, a.records, a.base, a.esc_ptr, a.esc_col, a.esc_val, a.bias, a.y,
            static_cast<float4*>(a.workspace), a.counters, 0, a.N, kt, s, kper, a.ldx, a.ldy};
  // M > 64: 64-token chunks, one launch each; the chunks share the workspace (stream order).
  for (int m0 = 0; m0 < a.M; m0 += kMaxTokens) {
    const int tokens = (a.M - m0) < kMaxTokens ? (a.M - m0) : kMaxTokens;
    p.x = a.x + (int64_t)m0 * a.ldx;
    p.y = a.y + (int64_t)m0 * a.ldy;
    p.M = tokens;
    const cudaError_t err = a.stages == 6 ? launch_stages<6>(p, nt * s, tokens, stream)
                                          : launch_stages<4>(p, nt * s, tokens, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t gemm_check_device() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, gemm_w12_mma_kernel<1, 4>);
}

}  // namespace w12
