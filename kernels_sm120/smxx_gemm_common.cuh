// Pieces shared by the W12 GEMM kernels: the exact escape correction of the epilogue (and the
// per-row pass of the shared-memory epilogues) and the cached device properties their launchers
// size grids from.
// Torch-free, header-only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "gemm_w12_mma.cuh"
#include "smxx_w12_decode.cuh"

namespace w12 {

// Escapes replace the slot's product 2^(b-127) x by the true weight's, in escape-list order (the
// same adds in every kernel; both products are exact in FP32, inf/NaN weights propagate exactly as
// multiplying by the decoded weight would). P: any params struct with x, ldx, esc_col, esc_val.
template <typename P>
__device__ __forceinline__ float fix_escapes(float v, float scale, int e0, int e1, int m, const P& p) {
  const float slot = scale * 0x1p-15f;
  const uint16_t* xr = p.x + (int64_t)m * p.ldx;
  for (int e = e0; e < e1; ++e) {
    const float xv = bf16_bits_to_float(xr[__ldg(p.esc_col + e)]);
    const float wv = bf16_bits_to_float(static_cast<uint16_t>(__ldg(p.esc_val + e)));
    v = __fadd_rn(v, __fmul_rn(wv, xv));
    v = __fsub_rn(v, __fmul_rn(slot, xv));
  }
  return v;
}

// Token m's sum at yr[m]: the row-contiguous layout of escapes_row_smem's callers but v4's.
struct RowContiguous {
  __device__ __forceinline__ int operator()(int m) const { return m; }
};

// Escapes e0..e1-1 of one row for tokens mlo..mhi-1 of its FP32 sums at yr[at(mlo)..] (already
// scaled): fix_escapes' operations in its order, each escape's column and value loaded once for
// all tokens. slot: the row's scale x 2^-15. at: where token m's sum sits (v4: its swizzle).
template <typename P, typename At = RowContiguous>
__device__ __forceinline__ void escapes_row_smem(float* yr, int mlo, int mhi, int e0, int e1, float slot, const P& p,
                                                 At at = {}) {
  for (int e = e0; e < e1; ++e) {
    const int col = __ldg(p.esc_col + e);
    const float wv = bf16_bits_to_float(static_cast<uint16_t>(__ldg(p.esc_val + e)));
#pragma unroll 4
    for (int m = mlo; m < mhi; ++m) {
      const float xv = bf16_bits_to_float(p.x[(int64_t)m * p.ldx + col]);
      float y = yr[at(m)];
      y = __fadd_rn(y, __fmul_rn(wv, xv));
      yr[at(m)] = __fsub_rn(y, __fmul_rn(slot, xv));
    }
  }
}

// Row n's bias b (when p has one) and BF16 stores for tokens mlo..mhi-1 of its sums at yr[mlo..].
template <typename P>
__device__ __forceinline__ void store_row_smem(const float* yr, int n, int mlo, int mhi, float b, const P& p) {
#pragma unroll 4
  for (int m = mlo; m < mhi; ++m) {
    float y = yr[m];
    if (p.bias) y = __fadd_rn(y, b);
    p.y[(int64_t)m * p.ldy + n] = __bfloat16_as_ushort(__float2bfloat16_rn(y));
  }
}

// The per-row half of the shared-memory epilogues (v1's R64 kernel; v4's before session 24): row
// n's FP32 sums for tokens mlo..mhi-1 at yr[mlo..]: scale, escapes, bias, BF16 stores. The caller
// puts consecutive rows in consecutive lanes, so one token's stores are contiguous.
template <typename P>
__device__ __forceinline__ void epilogue_row_smem(float* yr, int n, int mlo, int mhi, const P& p) {
  const float sc = row_scale(__ldg(p.base + n)), slot = sc * 0x1p-15f;
  const int e0 = __ldg(p.esc_ptr + n), e1 = __ldg(p.esc_ptr + n + 1);
  const float b = p.bias ? __ldg(p.bias + n) : 0.f;
#pragma unroll 4
  for (int m = mlo; m < mhi; ++m) yr[m] = yr[m] * sc;
  escapes_row_smem(yr, mlo, mhi, e0, e1, slot, p);
  store_row_smem(yr, n, mlo, mhi, b, p);
}

// The MMAs of one decoded record share: a[16*MT] A fragments (MT m-tiles of 16 rows, layout 4)
// times the activation tile at `xt` (token rows of kXRowPitch bytes, 64 BF16 columns each) into
// acc[MT][NCH][4]. Tokens are the MMA's n in chunks of 8; `xrows_ok` false zeroes this lane's
// token row (rows past M that the stage does not hold, NCH = 1 only). k-step outer, so consecutive
// MMAs go to MT*JG different accumulators and one accumulator's latency chain is covered.
template <int NCH, int MT, int kXRowPitch>
__device__ __forceinline__ void mma_record(float (&acc)[MT][NCH][4], const uint32_t* a, const uint8_t* xt, int g, int t,
                                           bool xrows_ok) {
  constexpr int JG = NCH < 4 ? NCH : 4;  // token chunks whose B fragments are held at once
#pragma unroll
  for (int j0 = 0; j0 < NCH; j0 += JG) {
    uint32_t bw[JG][8];
#pragma unroll
    for (int jj = 0; jj < JG; ++jj) {
      uint4 b0 = make_uint4(0, 0, 0, 0), b1 = make_uint4(0, 0, 0, 0);
      if (NCH > 1 || xrows_ok) {
        const uint8_t* xr = xt + (8 * (j0 + jj) + g) * kXRowPitch + 32 * t;
        b0 = *reinterpret_cast<const uint4*>(xr);
        b1 = *reinterpret_cast<const uint4*>(xr + 16);
      }
      bw[jj][0] = b0.x, bw[jj][1] = b0.y, bw[jj][2] = b0.z, bw[jj][3] = b0.w;
      bw[jj][4] = b1.x, bw[jj][5] = b1.y, bw[jj][6] = b1.z, bw[jj][7] = b1.w;
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int jj = 0; jj < JG; ++jj)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint32_t af[4] = {a[16 * mt + 4 * ks], a[16 * mt + 4 * ks + 1], a[16 * mt + 4 * ks + 2],
                                  a[16 * mt + 4 * ks + 3]};
          mma_bf16_16816(acc[mt][j0 + jj], af, bw[jj][2 * ks], bw[jj][2 * ks + 1]);
        }
  }
}

// The one order in which every W12 GEMM path (v1's in-kernel and cluster reductions, the reduce
// kernel, v4's whole-K clusters) adds the K slices' partials p_0 .. p_{S-1} of an output: in
// pairs, then the pairs left to right, y = ((p0 + p1) + (p2 + p3)) + (p4 + p5) ..., an odd last
// slice on its own (session 17; slice order 0..S-1 before). A CTA that runs slices 2j and 2j+1
// can add its pair itself and park one partial for the two, which halves what the reduction reads
// without changing a bit. Call with s = 0 .. S-1 in order; pend carries a pair's first slice.
__device__ __forceinline__ void add_slice(float& acc, float& pend, float v, int s, int S) {
  if (s & 1) {
    const float q = __fadd_rn(pend, v);
    acc = s == 1 ? q : __fadd_rn(acc, q);
  } else if (s + 1 == S) {
    acc = s == 0 ? v : __fadd_rn(acc, v);
  } else {
    pend = v;
  }
}

struct DevInfo {
  int sms = 0, smem_sm = 0, smem_optin = 0, major = 0, minor = 0;
};

// Properties of the current device (cached per device index, which is returned in `dev`).
inline cudaError_t dev_info(DevInfo& d, int& dev) {
  static DevInfo cache[64];
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev >= 64) return cudaErrorInvalidDevice;
  if (cache[dev].sms) {
    d = cache[dev];
    return cudaSuccess;
  }
  if ((e = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return e;
  if ((e = cudaDeviceGetAttribute(&d.smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev)) != cudaSuccess)
    return e;
  if ((e = cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess)
    return e;
  if ((e = cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev)) != cudaSuccess) return e;
  if ((e = cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, dev)) != cudaSuccess) return e;
  cache[dev] = d;
  return cudaSuccess;
}

// Ring depth (3 or 4 stages) for a grid of `grid` CTAs whose 3-stage ring takes `ring3` bytes of
// shared memory per CTA (the 1 KB reservation included). 4 where every CTA is resident at once
// anyway (<= 2 per SM: o, down at the K-split's 2 x SMs target); with `tail`, also where 3 stages
// would leave the last wave under 70 % full: the deeper ring fits fewer CTAs per SM and so
// spreads the grid over fuller waves (gate_up at 64 tokens, 448 CTAs: 3 CTAs per SM = 396 + 52,
// 2 per SM = 264 + 184). Measured in session 9 (docs/perf-notes.md): v4 gate_up 77.7 -> 72.4 us,
// v1 82.6 -> 77.7 at 64 tokens; lm_head (1002 CTAs, last wave 53 % full) keeps 3. Timing only.
inline int wave_stages(long grid, const DevInfo& di, int ring3, bool tail) {
  if (grid <= 2L * di.sms) return 4;
  if (!tail) return 3;
  const long slots = (long)di.sms * (di.smem_sm / ring3);
  if (slots <= 0) return 3;
  const long waves = (grid + slots - 1) / slots;
  return grid * 10 < waves * slots * 7 ? 4 : 3;
}

// The fields every K-split launch's parameters (KParams, WParams) take from the call: operands,
// sizes, and the token pass m0 .. m0 + tokens - 1 of x and y, for S slices of K.
template <typename P>
inline void set_split_pass(P& p, const GemmArgs& a, int m0, int tokens, int S) {
  static_cast<GemmOperands&>(p) = a;
  p.x = a.x + (int64_t)m0 * a.ldx;
  p.y = a.y + (int64_t)m0 * a.ldy;
  p.M = tokens;
  p.N = a.N;
  p.KT = (a.K + 63) / 64;
  p.S = S;
  p.kper = (p.KT + S - 1) / S;
  p.ldx = a.ldx;
  p.ldy = a.ldy;
}

}  // namespace w12
