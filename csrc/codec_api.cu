// C ABI of the W12 codec kernels, loaded by w12/cuda_codec.py through ctypes.
//
// Every function takes device pointers, sizes and a cudaStream_t passed as void* (the caller's
// current torch stream), enqueues its work and returns a cudaError_t value (0 = success) without
// synchronising. Argument checks that need tensor metadata (dtype, device, contiguity) are done
// in Python, where the messages can name the tensors.
#include <cuda_runtime.h>
#include <stdint.h>

#include "smxx_codec.cuh"

extern "C" {

// Version of this ABI; w12/cuda_codec.py refuses a library whose version it does not know.
// 3 (session 14): w12_decode_layout4 replaces w12_decode_layout1; w12_permute_records takes split.
// 4 (session 19): w12_decode_layout3.
int w12_codec_abi_version(void) { return 4; }

// Pass 1 of the encoder: per row of w ([rows, k] BF16 bit patterns) the base (uint8) and the
// number of escapes (int32).
int w12_encode_count(const void* w, int64_t rows, int k, void* base, void* count, void* stream) {
  return int(w12codec::launch_encode_count(static_cast<const uint16_t*>(w), rows, k, static_cast<uint8_t*>(base),
                                           static_cast<int32_t*>(count), static_cast<cudaStream_t>(stream)));
}

// Pass 2 of the encoder: records ([mats, ceil(n/128), ceil(k/64), 12288], every byte written)
// and the escapes at esc_ptr[row] .. esc_ptr[row+1] (esc_ptr = exclusive scan of pass 1's counts).
int w12_encode_write(const void* w, int64_t mats, int n, int k, const void* base, const void* esc_ptr, void* records,
                     void* esc_col, void* esc_val, void* stream) {
  return int(w12codec::launch_encode_write(static_cast<const uint16_t*>(w), mats, n, k,
                                           static_cast<const uint8_t*>(base), static_cast<const int32_t*>(esc_ptr),
                                           static_cast<uint8_t*>(records), static_cast<int32_t*>(esc_col),
                                           static_cast<int16_t*>(esc_val), static_cast<cudaStream_t>(stream)));
}

// Layout-0 records -> BF16 [mats, n, k] (exact, or the 8-bit view when eight_bit != 0).
// variant < 0 picks the default kernel variant; 0 and 1 force one (for benchmarking).
int w12_decode(const void* records, const void* base, const void* esc_ptr, const void* esc_col, const void* esc_val,
               int64_t nnz, int64_t mats, int n, int k, int eight_bit, void* out, void* stream, int variant) {
  return int(w12codec::launch_decode(
      static_cast<const uint8_t*>(records), static_cast<const uint8_t*>(base), static_cast<const int32_t*>(esc_ptr),
      static_cast<const int32_t*>(esc_col), static_cast<const int16_t*>(esc_val), nnz, mats, n, k, eight_bit != 0,
      static_cast<uint16_t*>(out), static_cast<cudaStream_t>(stream), variant));
}

// Layout-4 records (the portable GEMM's fragment order, split) -> BF16 [mats, n, k], exact.
int w12_decode_layout4(const void* records, const void* base, const void* esc_ptr, const void* esc_col,
                       const void* esc_val, int64_t nnz, int64_t mats, int n, int k, void* out, void* stream) {
  return int(w12codec::launch_decode_split_layout(
      4, static_cast<const uint8_t*>(records), static_cast<const uint8_t*>(base), static_cast<const int32_t*>(esc_ptr),
      static_cast<const int32_t*>(esc_col), static_cast<const int16_t*>(esc_val), nnz, mats, n, k,
      static_cast<uint16_t*>(out), static_cast<cudaStream_t>(stream)));
}

// Layout-3 records (the Hopper GEMM's fragment order, split) -> BF16 [mats, n, k], exact.
int w12_decode_layout3(const void* records, const void* base, const void* esc_ptr, const void* esc_col,
                       const void* esc_val, int64_t nnz, int64_t mats, int n, int k, void* out, void* stream) {
  return int(w12codec::launch_decode_split_layout(
      3, static_cast<const uint8_t*>(records), static_cast<const uint8_t*>(base), static_cast<const int32_t*>(esc_ptr),
      static_cast<const int32_t*>(esc_col), static_cast<const int16_t*>(esc_val), nnz, mats, n, k,
      static_cast<uint16_t*>(out), static_cast<cudaStream_t>(stream)));
}

// dst record i slot s = src record i slot gather[s] (both planes), for num_records records.
// split: bit 0 = the source is in split form, bit 1 = write the split form (w12.format.Layout.split).
int w12_permute_records(const void* src, void* dst, int64_t num_records, const void* gather, int split,
                        void* stream) {
  return int(w12codec::launch_permute_records(static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst),
                                              num_records, static_cast<const int16_t*>(gather), (split & 1) != 0,
                                              (split & 2) != 0, static_cast<cudaStream_t>(stream)));
}

// Name of a cudaError_t value, for error messages raised in Python.
const char* w12_codec_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
