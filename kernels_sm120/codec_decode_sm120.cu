// W12 decoder on the GPU: layout-0 records + bases + CSR escapes -> BF16 [mats, N, K], exact
// (or the approximate 8-bit view of format §3), bit-identical to w12/reference.py.
//
// Decoding is a pure streaming op (1.5 bytes in, 2 bytes out an element), so the kernel is built
// around the memory system: one thread owns 16 consecutive columns of one output row, reads 16 hi
// bytes + 8 lo bytes with two vector loads, and writes 32 contiguous output bytes, so a warp
// stores 1 KB of one row in full sectors. Escapes are applied in registers before the store
// (a binary search in the row's sorted escape columns), so every output element is written once,
// by one thread, with no second kernel and no ordering between writers.
// Portable sm_80+ code (the file name follows the project's kernel-folder convention).
#include "smxx_codec.cuh"

namespace w12codec {
namespace {

constexpr int kThreads = 256;

// kVecOut: output rows are 16-byte aligned (K % 8 == 0, aligned base), so stores are 16 bytes wide.
template <bool kVecOut, bool kEight>
__global__ void __launch_bounds__(kThreads)
    decode_kernel(const uint8_t* __restrict__ records, const uint8_t* __restrict__ base,
                  const int32_t* __restrict__ esc_ptr, const int32_t* __restrict__ esc_col,
                  const int16_t* __restrict__ esc_val, int32_t nnz, uint32_t row0, uint32_t work, uint32_t chunks,
                  uint32_t n, int k, int nt, int kt, uint16_t* __restrict__ out) {
  const uint32_t idx = blockIdx.x * kThreads + threadIdx.x;
  if (idx >= work) return;
  // 32-bit index math: the launcher splits the work so that every index here fits.
  const uint32_t rl = idx / chunks;
  const int c0 = int(idx - rl * chunks) * 16;
  const uint32_t row = row0 + rl;
  const uint32_t mat = row / n;
  const int nn = int(row - mat * n);
  const int r = nn & (kTileN - 1);
  const uint8_t* rec = records + ((int64_t(mat) * nt + (nn >> 7)) * kt + (c0 >> 6)) * kRecordBytes;
  const int cc = c0 & (kTileK - 1);

  const uint4 h = __ldg(reinterpret_cast<const uint4*>(rec + r * kTileK + cc));
  uint2 l = make_uint2(0u, 0u);
  if (!kEight) l = __ldg(reinterpret_cast<const uint2*>(rec + kHiBytes + r * (kTileK / 2) + cc / 2));
  const uint32_t b7 = uint32_t(__ldg(base + row)) << 7;
  const uint32_t b7x2 = b7 | (b7 << 16);
  int32_t p0 = __ldg(esc_ptr + row), p1 = __ldg(esc_ptr + row + 1);

  const uint32_t hw[4] = {h.x, h.y, h.z, h.w};
  const uint32_t lw[2] = {l.x, l.y};
  uint32_t o[8];  // output word p = elements 2p (low half) and 2p+1
#pragma unroll
  for (int p = 0; p < 8; ++p) {
    // hi bytes 2p, 2p+1 -> bits 0..7 and 16..23
    const uint32_t hp = __byte_perm(hw[p >> 1], 0u, (p & 1) ? 0x4342u : 0x4140u);
    if (kEight) {
      o[p] = decode_pair_8bit(hp, b7x2);
    } else {
      // lo byte p holds nibbles of elements 2p (low) and 2p+1 (high): copy it to bytes 0 and 2,
      // keep the low nibble in byte 0 and move byte 2's high nibble down into bits 16..19.
      const uint32_t lb = __byte_perm(lw[p >> 2], 0u, 0x4040u + 0x0101u * uint32_t(p & 3));
      const uint32_t lp = (lb & 0xFu) | ((lb >> 4) & 0x000F0000u);
      o[p] = decode_pair((hp << 4) | lp, b7x2);
    }
  }

  // Clamp the row's escape range to the list, so a malformed esc_ptr cannot read out of bounds.
  p0 = p0 < 0 ? 0 : (p0 > nnz ? nnz : p0);
  p1 = p1 < p0 ? p0 : (p1 > nnz ? nnz : p1);
  if (p0 < p1) {
    int lo = p0, hi = p1;  // first escape of the row with column >= c0
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (__ldg(esc_col + mid) < c0)
        lo = mid + 1;
      else
        hi = mid;
    }
    int end = lo;  // escapes of this thread's 16 columns: [lo, end)
    while (end < p1 && __ldg(esc_col + end) - c0 < 16) ++end;
    // The word index is a compile-time constant in each unrolled step: indexing o[] with the
    // column directly would send the whole array to local memory on every path, escapes or not.
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      for (int i = lo; i < end; ++i) {
        const int c = __ldg(esc_col + i) - c0;
        if ((c >> 1) == q) {
          const int sh = (c & 1) * 16;
          o[q] = (o[q] & ~(0xFFFFu << sh)) | (uint32_t(uint16_t(__ldg(esc_val + i))) << sh);
        }
      }
    }
  }

  uint16_t* dst = out + int64_t(row) * k + c0;
  if (kVecOut) {
    reinterpret_cast<uint4*>(dst)[0] = make_uint4(o[0], o[1], o[2], o[3]);
    if (c0 + 16 <= k) reinterpret_cast<uint4*>(dst)[1] = make_uint4(o[4], o[5], o[6], o[7]);
  } else {
#pragma unroll
    for (int q = 0; q < 16; ++q)
      if (c0 + q < k) dst[q] = uint16_t(o[q >> 1] >> ((q & 1) * 16));
  }
}

}  // namespace

// The host-emulation test build compiles the kernels alone, without these launchers.
#ifndef W12_CODEC_HOST_EMULATION
cudaError_t launch_decode(const uint8_t* records, const uint8_t* base, const int32_t* esc_ptr, const int32_t* esc_col,
                          const int16_t* esc_val, int64_t nnz, int64_t mats, int n, int k, bool eight_bit,
                          uint16_t* out, cudaStream_t stream) {
  if (mats <= 0 || n <= 0 || k <= 0 || nnz < 0 || nnz > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const int64_t rows = mats * n;
  if (rows >= 0x7FFFFFFF) return cudaErrorInvalidValue;  // rows index esc_ptr (int32) anyway
  const int nt = (n + kTileN - 1) / kTileN, kt = (k + kTileK - 1) / kTileK;
  const uint32_t chunks = uint32_t((k + 15) / 16);
  const bool vec = (k % 8 == 0) && (reinterpret_cast<uintptr_t>(out) % 16 == 0);
  // Rows per launch so that rows * chunks (the thread index) stays below 2^31.
  const int64_t step = ((int64_t(1) << 31) - kThreads) / chunks;
  for (int64_t row0 = 0; row0 < rows; row0 += step) {
    const int64_t nrows = rows - row0 < step ? rows - row0 : step;
    const uint32_t work = uint32_t(nrows * chunks);
    const unsigned blocks = (work + kThreads - 1) / kThreads;
#define W12_DECODE_ARGS                                                                                      \
  records, base, esc_ptr, esc_col, esc_val, int32_t(nnz), uint32_t(row0), work, chunks, uint32_t(n), k, nt, kt, \
      out
    if (vec && eight_bit)
      decode_kernel<true, true><<<blocks, kThreads, 0, stream>>>(W12_DECODE_ARGS);
    else if (vec)
      decode_kernel<true, false><<<blocks, kThreads, 0, stream>>>(W12_DECODE_ARGS);
    else if (eight_bit)
      decode_kernel<false, true><<<blocks, kThreads, 0, stream>>>(W12_DECODE_ARGS);
    else
      decode_kernel<false, false><<<blocks, kThreads, 0, stream>>>(W12_DECODE_ARGS);
#undef W12_DECODE_ARGS
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

#endif  // W12_CODEC_HOST_EMULATION

}  // namespace w12codec
