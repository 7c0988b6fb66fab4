// Pieces shared by the persistent W12 GEMM kernels (v2 stream-K, v3 row slabs): the exact escape
// correction of the epilogue and the cached device properties their launchers size grids from.
// Torch-free, header-only.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "smxx_w12_decode.cuh"

namespace w12 {

// The device pointers every W12 GEMM kernel reads (weight tensors, activations, output); each
// kernel's params struct extends it with its own sizes and scratch.
struct GemmOperands {
  const uint16_t* x;       // [M, ldx] BF16 activations
  const uint8_t* records;  // [NT, KT, 12288] layout-1 records
  const uint8_t* base;     // [N]
  const int32_t* esc_ptr;  // [N+1]
  const int32_t* esc_col;  // [nnz]
  const int16_t* esc_val;  // [nnz]
  const float* bias;       // [N] or nullptr
  uint16_t* y;             // [M, ldy] BF16 out
};

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

struct DevInfo {
  int sms = 0, smem_sm = 0, smem_optin = 0, major = 0;
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
  cache[dev] = d;
  return cudaSuccess;
}

}  // namespace w12
