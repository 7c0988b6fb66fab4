// W12 encoder on the GPU: BF16 [mats, N, K] -> layout-0 records, per-row bases and the CSR
// escape list, bit-identical to w12/reference.py (format: shared/W12_FORMAT.md).
//
// The escape list has a data-dependent size, so encoding is two kernels around a scan:
//   pass 1 (encode_count_kernel): one warp per row builds the row's exponent histogram in shared
//     memory, picks the base that maximises the in-window count (ties -> larger b), and writes the
//     base and the row's escape count (K minus the best in-window count: no second look needed);
//   the caller scans the counts into esc_ptr on the device and reads nnz once (the only host sync);
//   pass 2 (encode_write_kernel): one warp per *padded* row re-reads the row, writes its codes into
//     every record it touches (padding slots included, so records need no memset) and compacts its
//     escapes in ascending column order with a warp scan.
// Portable sm_80+ code (the file name follows the project's kernel-folder convention).
#include "smxx_codec.cuh"

namespace w12codec {
namespace {

constexpr int kWarps = 8;  // rows per 256-thread block
constexpr unsigned kFull = 0xFFFFFFFFu;

__device__ __forceinline__ void hist_add_word(uint32_t* hist, uint32_t word) {
  // Shared-memory atomics: a row's exponents cluster in a few bins, so lanes collide, but the
  // collisions cost well under a cycle per element, far below this pass's memory time.
  atomicAdd(&hist[(word >> 7) & 0xFFu], 1u);
  atomicAdd(&hist[(word >> 23) & 0xFFu], 1u);
}

__device__ __forceinline__ void hist_add_vec(uint32_t* hist, const uint4& v) {
  hist_add_word(hist, v.x);
  hist_add_word(hist, v.y);
  hist_add_word(hist, v.z);
  hist_add_word(hist, v.w);
}

// kVec: rows are 16-byte aligned and K % 8 == 0, so each lane reads 8 elements at once.
template <bool kVec>
__global__ void __launch_bounds__(kWarps * 32)
    encode_count_kernel(const uint16_t* __restrict__ w, int64_t rows, int k, uint8_t* __restrict__ base,
                        int32_t* __restrict__ count) {
  // 257 counters: after the scan, slot j holds #elements with exponent < j, j = 0..256.
  __shared__ uint32_t hist_all[kWarps][257];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarps + warp;
  if (row >= rows) return;  // whole warps leave; only warp-level sync follows
  uint32_t* hist = hist_all[warp];
  for (int i = lane; i < 257; i += 32) hist[i] = 0;
  __syncwarp();

  const uint16_t* src = w + row * int64_t(k);
  if (kVec) {
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    const int n4 = k >> 3;
    int j = lane;
    // Two independent 16-byte loads in flight per lane before the atomics that consume them.
    for (; j + 32 < n4; j += 64) {
      const uint4 a = __ldg(s4 + j);
      const uint4 b = __ldg(s4 + j + 32);
      hist_add_vec(hist, a);
      hist_add_vec(hist, b);
    }
    if (j < n4) hist_add_vec(hist, __ldg(s4 + j));
  } else {
    for (int c = lane; c < k; c += 32) atomicAdd(&hist[(uint32_t(__ldg(src + c)) >> 7) & 0xFFu], 1u);
  }
  __syncwarp();

  // Exclusive prefix over the 256 bins: lane l owns bins 8l..8l+7.
  uint32_t excl[8];
  uint32_t own = 0;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    excl[q] = own;
    own += hist[lane * 8 + q];
  }
  uint32_t inc = own;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t v = __shfl_up_sync(kFull, inc, d);
    if (lane >= d) inc += v;
  }
  const uint32_t before = inc - own;
  __syncwarp();
#pragma unroll
  for (int q = 0; q < 8; ++q) hist[lane * 8 + q] = before + excl[q];
  if (lane == 31) hist[256] = inc;
  __syncwarp();

  // in-window count of base b = cs[b+16] - cs[b]; the key (count, b) makes the maximum the
  // largest count and, among equal counts, the larger b, as the format requires.
  uint64_t best = 0;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const int b = lane * 8 + q;
    if (b >= kBaseMin && b <= kBaseMax) {
      const uint64_t key = (uint64_t(hist[b + kWindow] - hist[b]) << 8) | uint64_t(b);
      best = key > best ? key : best;
    }
  }
#pragma unroll
  for (int d = 16; d >= 1; d >>= 1) {
    const uint64_t o = __shfl_xor_sync(kFull, best, d);
    best = o > best ? o : best;
  }
  if (lane == 0) {
    base[row] = uint8_t(best & 0xFFu);
    count[row] = int32_t(int64_t(k) - int64_t(best >> 8));
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kWarps * 32)
    encode_write_kernel(const uint16_t* __restrict__ w, int64_t prows, int n, int k, int nt, int kt,
                        const uint8_t* __restrict__ base, const int32_t* __restrict__ esc_ptr,
                        uint8_t* __restrict__ records, int32_t* __restrict__ esc_col, int16_t* __restrict__ esc_val) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t prow = int64_t(blockIdx.x) * kWarps + warp;
  if (prow >= prows) return;
  const int64_t per_mat = int64_t(nt) * kTileN;
  const int64_t mat = prow / per_mat;
  const int pr = int(prow - mat * per_mat);  // padded row inside the matrix
  const int r = pr & (kTileN - 1);
  const bool real = pr < n;  // warp-uniform: padding rows get all-zero codes and no escapes
  const int64_t row = mat * n + pr;
  uint8_t* rec_row = records + (mat * nt + (pr >> 7)) * int64_t(kt) * kRecordBytes;
  const int b = real ? int(base[row]) : 0;
  int32_t pos = real ? esc_ptr[row] : 0;
  const uint16_t* src = w + row * int64_t(k);

  const int chunks = kt * (kTileK / 8);  // 8-element chunks of the padded row
  for (int j0 = 0; j0 < chunks; j0 += 32) {
    const int j = j0 + lane;
    const int c0 = j * 8;
    uint32_t x[4] = {0u, 0u, 0u, 0u};  // BF16 patterns, two a word
    if (real && j < chunks) {
      if (kVec && c0 + 8 <= k) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(src + c0));
        x[0] = v.x;
        x[1] = v.y;
        x[2] = v.z;
        x[3] = v.w;
      } else {
#pragma unroll
        for (int q = 0; q < 8; ++q)
          if (c0 + q < k) x[q >> 1] |= uint32_t(__ldg(src + c0 + q)) << ((q & 1) * 16);
      }
    }
    uint32_t hi[2] = {0u, 0u}, lo = 0u, emask = 0u;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const uint32_t u = (x[q >> 1] >> ((q & 1) * 16)) & 0xFFFFu;
      bool esc;
      const uint32_t code = encode_code(u, b, &esc);  // padding: u = 0 gives code 0
      hi[q >> 2] |= (code >> 4) << ((q & 3) * 8);
      lo |= (code & 0xFu) << (q * 4);
      if (esc && real && c0 + q < k) emask |= 1u << q;
    }
    if (j < chunks) {
      uint8_t* rec = rec_row + int64_t(c0 >> 6) * kRecordBytes;
      const int cc = c0 & (kTileK - 1);
      *reinterpret_cast<uint2*>(rec + r * kTileK + cc) = make_uint2(hi[0], hi[1]);
      *reinterpret_cast<uint32_t*>(rec + kHiBytes + r * (kTileK / 2) + cc / 2) = lo;
    }
    // Escapes are rare: one ballot per 256 columns decides whether the warp scan runs at all.
    if (real && __any_sync(kFull, emask != 0u)) {
      const int cnt = __popc(emask);
      int incl = cnt;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(kFull, incl, d);
        if (lane >= d) incl += v;
      }
      const int total = __shfl_sync(kFull, incl, 31);
      int p = pos + incl - cnt;  // lanes hold ascending columns, so lane order is column order
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        if (emask & (1u << q)) {
          esc_col[p] = c0 + q;
          esc_val[p] = int16_t((x[q >> 1] >> ((q & 1) * 16)) & 0xFFFFu);
          ++p;
        }
      }
      pos += total;
    }
  }
}

}  // namespace

// The host-emulation test build compiles the kernels alone, without these launchers.
#ifndef W12_CODEC_HOST_EMULATION
cudaError_t launch_encode_count(const uint16_t* w, int64_t rows, int k, uint8_t* base, int32_t* count,
                                cudaStream_t stream) {
  if (rows <= 0 || k <= 0) return cudaErrorInvalidValue;
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const bool vec = (k % 8 == 0) && (reinterpret_cast<uintptr_t>(w) % 16 == 0);
  if (vec)
    encode_count_kernel<true><<<unsigned(blocks), kWarps * 32, 0, stream>>>(w, rows, k, base, count);
  else
    encode_count_kernel<false><<<unsigned(blocks), kWarps * 32, 0, stream>>>(w, rows, k, base, count);
  return cudaGetLastError();
}

cudaError_t launch_encode_write(const uint16_t* w, int64_t mats, int n, int k, const uint8_t* base,
                                const int32_t* esc_ptr, uint8_t* records, int32_t* esc_col, int16_t* esc_val,
                                cudaStream_t stream) {
  if (mats <= 0 || n <= 0 || k <= 0) return cudaErrorInvalidValue;
  const int nt = (n + kTileN - 1) / kTileN, kt = (k + kTileK - 1) / kTileK;
  const int64_t prows = mats * nt * kTileN;
  const int64_t blocks = (prows + kWarps - 1) / kWarps;
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const bool vec = (k % 8 == 0) && (reinterpret_cast<uintptr_t>(w) % 16 == 0);
  if (vec)
    encode_write_kernel<true><<<unsigned(blocks), kWarps * 32, 0, stream>>>(w, prows, n, k, nt, kt, base, esc_ptr,
                                                                          records, esc_col, esc_val);
  else
    encode_write_kernel<false><<<unsigned(blocks), kWarps * 32, 0, stream>>>(w, prows, n, k, nt, kt, base, esc_ptr,
                                                                           records, esc_col, esc_val);
  return cudaGetLastError();
}

#endif  // W12_CODEC_HOST_EMULATION

}  // namespace w12codec
