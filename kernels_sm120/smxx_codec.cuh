// Shared pieces of the W12 codec kernels (encode, decode, record-layout permutation).
//
// Everything here follows shared/W12_FORMAT.md to the bit; the CPU reference (w12/reference.py)
// is the definition the GPU tests compare against. The kernels are plain CUDA C++ (sm_80+), take
// raw pointers and sizes, and know nothing about torch.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace w12codec {

constexpr int kTileN = 128;
constexpr int kTileK = 64;
constexpr int kHiBytes = kTileN * kTileK;  // 8192: one byte an element
constexpr int kLoBytes = kHiBytes / 2;     // 4096: one nibble an element
constexpr int kRecordBytes = kHiBytes + kLoBytes;
constexpr int kBaseMin = 1;
constexpr int kBaseMax = 239;
constexpr int kWindow = 16;

// 12-bit code of one BF16 bit pattern for a row base b, or 0 with *escape set when the exponent is
// outside [b, b+15]. One subtraction tests both window ends: (u & 0x7FFF) - (b << 7) is
// (e-b)<<7 | m, which lies in [0, 2048) exactly when 0 <= e-b < 16.
__host__ __device__ __forceinline__ uint32_t encode_code(uint32_t u, int b, bool* escape) {
  const int t = int(u & 0x7FFFu) - (b << 7);
  const bool in = (unsigned)t < 2048u;
  *escape = !in;
  return in ? (uint32_t(t) | ((u >> 4) & 0x800u)) : 0u;
}

// Two codes, c0 in bits 0..11 and c1 in bits 16..27, to two BF16 patterns in one 32-bit word.
// Exponent + base never carries into the other half: (c & 0x7FF) + (b << 7) <= 2047 + 239*128 <
// 32768, and the sign is OR-ed in afterwards.
__host__ __device__ __forceinline__ uint32_t decode_pair(uint32_t cp, uint32_t b7x2) {
  return ((cp & 0x07FF07FFu) + b7x2) | ((cp & 0x08000800u) << 4);
}

// 8-bit view (format §3) of two hi bytes (bits 0..7 and 16..23): dropped mantissa bits at their
// midpoint. (h & 0x7F) << 4 + (b << 7) <= 2032 + 30592 < 32768, so again no carry between halves,
// and bit 3 is always clear before the OR.
__host__ __device__ __forceinline__ uint32_t decode_pair_8bit(uint32_t hp, uint32_t b7x2) {
  return (((hp & 0x007F007Fu) << 4) + b7x2) | ((hp & 0x00800080u) << 8) | 0x00080008u;
}

// Host-side launchers (each defined next to its kernels; C ABI wrappers in csrc/codec_api.cu).
// Records in a GEMM kernel's split layout (3: Hopper, 4: mma.sync) straight to BF16.
cudaError_t launch_decode_split_layout(int layout, const uint8_t* records, const uint8_t* base,
                                       const int32_t* esc_ptr, const int32_t* esc_col, const int16_t* esc_val,
                                       int64_t nnz, int64_t mats, int n, int k, uint16_t* out, cudaStream_t stream);
// All return a cudaError_t value; none synchronises.
cudaError_t launch_encode_count(const uint16_t* w, int64_t rows, int k, uint8_t* base, int32_t* count,
                                cudaStream_t stream);
cudaError_t launch_encode_write(const uint16_t* w, int64_t mats, int n, int k, const uint8_t* base,
                                const int32_t* esc_ptr, uint8_t* records, int32_t* esc_col, int16_t* esc_val,
                                cudaStream_t stream);
cudaError_t launch_decode(const uint8_t* records, const uint8_t* base, const int32_t* esc_ptr, const int32_t* esc_col,
                          const int16_t* esc_val, int64_t nnz, int64_t mats, int n, int k, bool eight_bit,
                          uint16_t* out, cudaStream_t stream, int variant = -1);
// Decode kernel variant used when the caller passes variant < 0 (codec_decode_sm120.cu says what
// each variant is; the bench times both).
constexpr int kDefaultDecodeVariant = 1;
cudaError_t launch_permute_records(const uint8_t* src, uint8_t* dst, int64_t num_records, const int16_t* gather,
                                   bool src_split, bool dst_split, cudaStream_t stream);

}  // namespace w12codec
