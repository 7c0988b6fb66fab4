// What the portable W12 GEMM (gemm_w12_mma_sm120.cu) and its split-K reduce kernel
// (gemm_w12_reduce_sm120.cu) share: the kernel parameters, the launcher's flag bits and the
// epilogue (row scale, exact escapes, bias, BF16 rounding). Torch-free, header-only.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "gemm_w12_mma.cuh"
#include "smxx_w12_decode.cuh"

namespace w12 {

// Slices one thread-block cluster sums (v1's cluster path), and the reduce kernel's largest batch
// of slices loaded at once.
constexpr int kMaxClusterSplits = 8;
// KParams::flags bit set by the launcher (above the diagnostic bits): the slices only store their
// partials and gemm_w12_reduce_kernel, launched behind the GEMM with PDL, sums them. A flag rather
// than a field: a larger KParams tipped the 64-token instantiation into spilling.
constexpr int kReduceKernel = 1 << 20;
// Set by the launcher when the kernel is launched with programmatic dependent launch (sm_90+): it
// may start while the previous kernel in the stream still runs. Before griddepcontrol.wait it only
// pulls its first records into L2 (always safe, see bulk_prefetch_l2); everything else follows
// the wait.
constexpr int kPdl = 1 << 21;
// Set by the launcher: 8-warp CTAs (MTW = 1) for this launch (gemm_launch says when).
constexpr int kWide = 1 << 22;
// The reduce kernel's partials are one per pair of K slices, each pair already added (v4's pair
// grid at 17..64 tokens); without it, one per slice.
constexpr int kPairsParked = 1 << 23;

struct KParams : GemmOperands {
  float4* ws;
  int* counters;
  int M, N, KT, S, kper;
  int64_t ldx, ldy;
  int flags;    // GemmArgs::flags (diagnostics) | kReduceKernel | kPdl | prefetch count << 12
  int cluster;  // 1: the S slices of a row tile form one thread-block cluster (sm_90+)
};

// Per-row epilogue data of the rows a thread writes (index 2*mtl + h: its local m-tile and the
// g / g+8 half of the fragment), loaded at kernel start so their (cold, HBM) latency hides
// behind the main loop instead of adding dependent round trips after it.
struct RowData {
  float scale[4];
  int e0[4], e1[4];
  float bias[4];
  // The row's first escape (column, true value), valid when e0 < e1, also loaded at kernel start:
  // 27 % of 4096-wide rows of a trained-like weight hold an escape, so nearly every warp's
  // epilogue met one, each a cold esc_col round trip plus the dependent x[col] load.
  int ecol[4];
  float eval[4];
  // x[token][ecol] for the thread's two tokens at M <= 8 (one token chunk), loaded after the main
  // loop so the L2 round trip overlaps the reduction's instead of following it.
  float ex[2][4];
};

// Row data of the 2*MTW rows a thread writes (rows nbase + 16 (r/2) + g + 8 (r&1)).
// FIRST_ESCAPE false: scale, escape range and bias only (the reduce kernel stages its escapes).
template <int MTW, bool FIRST_ESCAPE = true>
__device__ __forceinline__ void load_row_data(RowData& rd, int nbase, int g, const KParams& p) {
#pragma unroll
  for (int r = 0; r < 2 * MTW; ++r) {
    const int n = nbase + (r >> 1) * 16 + g + 8 * (r & 1);
    const bool ok = n < p.N;
    rd.scale[r] = ok ? row_scale(__ldg(p.base + n)) : 0.f;
    rd.e0[r] = ok ? __ldg(p.esc_ptr + n) : 0;
    rd.e1[r] = ok ? __ldg(p.esc_ptr + n + 1) : 0;
    rd.bias[r] = (ok && p.bias) ? __ldg(p.bias + n) : 0.f;
  }
#pragma unroll
  for (int r = 0; r < 2 * MTW; ++r) {
    const bool has = FIRST_ESCAPE && rd.e0[r] < rd.e1[r];
    rd.ecol[r] = has ? __ldg(p.esc_col + rd.e0[r]) : 0;
    rd.eval[r] = has ? bf16_bits_to_float(static_cast<uint16_t>(__ldg(p.esc_val + rd.e0[r]))) : 0.f;
  }
#pragma unroll
  for (int r = 2 * MTW; r < 4; ++r)
    rd.scale[r] = 0.f, rd.e0[r] = rd.e1[r] = 0, rd.bias[r] = 0.f, rd.ecol[r] = 0, rd.eval[r] = 0.f;
}

// x[token][first escape column] for the two tokens 2t, 2t+1 of a one-chunk (M <= 8) fragment.
template <int MTW>
__device__ __forceinline__ void load_escape_x(RowData& rd, int t, const KParams& p) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int m = 2 * t + h;
      rd.ex[h][r] = (r < 2 * MTW && rd.e0[r] < rd.e1[r] && m < p.M)
                        ? bf16_bits_to_float(p.x[(int64_t)m * p.ldx + rd.ecol[r]])
                        : 0.f;
    }
}

template <typename T>
__device__ __forceinline__ T pick4(const T (&a)[4], int r) {
  // Selects instead of a run-time register-array index (which would move `a` to local memory).
  return r == 0 ? a[0] : r == 1 ? a[1] : r == 2 ? a[2] : a[3];
}

// One escape of a row applied to the thread's two tokens: the product the escape's slot (decoded
// as code 0) contributed is replaced by the true weight's, in fix_escapes' order.
__device__ __forceinline__ void escape_pair(float& y0, float& y1, float wv, float xv0, float xv1, float slot) {
  y0 = __fadd_rn(y0, __fmul_rn(wv, xv0));
  y0 = __fsub_rn(y0, __fmul_rn(slot, xv0));
  y1 = __fadd_rn(y1, __fmul_rn(wv, xv1));
  y1 = __fsub_rn(y1, __fmul_rn(slot, xv1));
}

// Bias, BF16 rounding and the stores of row r's (rd's index) outputs for tokens m0 and (ok1) m0 + 1.
__device__ __forceinline__ void store_pair(float y0, float y1, const RowData& rd, int r, int m0, bool ok1, int n,
                                           const KParams& p) {
  if (p.bias) y0 = __fadd_rn(y0, pick4(rd.bias, r)), y1 = __fadd_rn(y1, pick4(rd.bias, r));
  p.y[(int64_t)m0 * p.ldy + n] = __bfloat16_as_ushort(__float2bfloat16_rn(y0));
  if (ok1) p.y[(int64_t)(m0 + 1) * p.ldy + n] = __bfloat16_as_ushort(__float2bfloat16_rn(y1));
}

// Epilogue of one accumulator fragment: rows nbase + g (+8), tokens 8j + 2t (+1); rd row index
// 2*mtl + h. Scale by 2^(b-E0), escapes, bias, round to BF16. Per row, both of the thread's tokens
// at once: each escape's column and value are loaded once for the two, and the activations the two
// tokens need are loaded before either output is stored (the per-output form, session 11 and
// before, loaded them behind the previous output's store; session 12 measured the same change on
// v4's epilogue and the reduce kernel's staged one). The same operations per output in the same
// order as fix_escapes (smxx_gemm_common.cuh), so the same bits.
template <int NCH, int MTW>
__device__ __forceinline__ void store_fragment(const float (&v)[4], int nbase, int mtl, int j, const RowData& rd,
                                               const KParams& p) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int m0 = 8 * j + 2 * t;  // the thread's tokens m0, m0 + 1
  if (m0 >= p.M) return;
  const bool ok1 = m0 + 1 < p.M;
  const uint16_t* x0r = p.x + (int64_t)m0 * p.ldx;
  const uint16_t* x1r = x0r + p.ldx;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 2 * mtl + h, n = nbase + g + 8 * h;
    if (n >= p.N) continue;
    // slot: the product an escape decoded as code 0 (2^(b-127) after scaling) contributed; it is
    // replaced by the true weight's. Both products are exact in FP32 (8-bit x 8-bit mantissas).
    const float sc = pick4(rd.scale, r), slot = sc * 0x1p-15f;
    float y0 = v[2 * h] * sc, y1 = v[2 * h + 1] * sc;
    if (pick4(rd.e0, r) < pick4(rd.e1, r)) {
      const int c = pick4(rd.ecol, r);
      const float w = pick4(rd.eval, r);
      const float xv0 = NCH == 1 ? pick4(rd.ex[0], r) : bf16_bits_to_float(x0r[c]);
      const float xv1 = NCH == 1 ? pick4(rd.ex[1], r) : (ok1 ? bf16_bits_to_float(x1r[c]) : 0.f);
      escape_pair(y0, y1, w, xv0, xv1, slot);
      for (int e = pick4(rd.e0, r) + 1; e < pick4(rd.e1, r); ++e) {
        const int col = __ldg(p.esc_col + e);
        const float wv = bf16_bits_to_float(static_cast<uint16_t>(__ldg(p.esc_val + e)));
        const float a0 = bf16_bits_to_float(x0r[col]);
        const float a1 = ok1 ? bf16_bits_to_float(x1r[col]) : 0.f;
        escape_pair(y0, y1, wv, a0, a1, slot);
      }
    }
    store_pair(y0, y1, rd, r, m0, ok1, n, p);
  }
}

// The reduce kernel for the partials of tokens 0..tokens-1 that a GEMM parked in p.ws (p.S
// slices, tiles row tiles), launched with programmatic dependent launch behind it
// (gemm_w12_reduce_sm120.cu). slots: the escape-slot forms where they exist (v4's map, <= 32 tokens).
cudaError_t launch_reduce_for(const KParams& p, int tiles, int tokens, cudaStream_t stream, bool slots = false);

// v1's 33-64-token kernel with 64 rows per warp (R64, gemm_w12_rows64_sm120.cu), on sm_90+ where p is
// unsplit or has kReduceKernel; smem_min as launch_one's.
cudaError_t gemm_r64_launch(const KParams& p, int smem_min, int dev, cudaStream_t stream);

}  // namespace w12
