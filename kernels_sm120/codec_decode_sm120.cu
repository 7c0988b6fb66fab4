// W12 decoder on the GPU: layout-0 records + bases + CSR escapes -> BF16 [mats, N, K], exact
// (or the approximate 8-bit view of format §3), bit-identical to w12/reference.py.
//
// Decoding is a pure streaming op (1.5 bytes in, 2 bytes out an element), so the kernel is built
// around the memory system: a thread owns 16 columns of one output row (two variants of which 16,
// see decode_kernel), reads their hi bytes and lo nibbles with vector loads straight from the
// records and writes 32 output bytes with 16-byte stores. Escapes are applied in registers before
// the store (a binary search in the row's sorted escape columns), so every output element is
// written once, by one thread, with no second kernel and no ordering between writers.
// Portable sm_80+ code (the file name follows the project's kernel-folder convention).
#include "smxx_codec.cuh"
#include "smxx_w12_decode.cuh"

namespace w12codec {
namespace {

constexpr int kThreads = 256;

// Four output words (8 BF16 values) from 8 hi bytes (h0, h1) and 8 lo nibbles (lw).
template <bool kEight>
__device__ __forceinline__ void decode8(uint32_t h0, uint32_t h1, uint32_t lw, uint32_t b7x2, uint32_t* o) {
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    // hi bytes 2p, 2p+1 -> bits 0..7 and 16..23
    const uint32_t hp = __byte_perm(p < 2 ? h0 : h1, 0u, (p & 1) ? 0x4342u : 0x4140u);
    if (kEight) {
      o[p] = decode_pair_8bit(hp, b7x2);
    } else {
      // lo byte p holds the nibbles of elements 2p (low) and 2p+1 (high): copy it to bytes 0 and
      // 2, keep the low nibble in byte 0 and move byte 2's high nibble down into bits 16..19.
      const uint32_t lb = __byte_perm(lw, 0u, 0x4040u + 0x0101u * uint32_t(p));
      const uint32_t lp = (lb & 0xFu) | ((lb >> 4) & 0x000F0000u);
      o[p] = decode_pair((hp << 4) | lp, b7x2);
    }
  }
}

// The first escape of [p0, p1) (a row's slice, columns ascending) whose column is >= c0.
__device__ __forceinline__ int first_escape_from(const int32_t* __restrict__ esc_col, int p0, int p1, int c0) {
  int lo = p0, hi = p1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (__ldg(esc_col + mid) < c0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// Row `row`'s slice [p0, p1) of the escape list, clamped to it, so that a malformed esc_ptr
// cannot read out of bounds.
__device__ __forceinline__ void row_escapes(const int32_t* __restrict__ esc_ptr, int64_t row, int32_t nnz, int& p0,
                                            int& p1) {
  p0 = __ldg(esc_ptr + row);
  p1 = __ldg(esc_ptr + row + 1);
  p0 = p0 < 0 ? 0 : (p0 > nnz ? nnz : p0);
  p1 = p1 < p0 ? p0 : (p1 > nnz ? nnz : p1);
}

// Overwrites the escaped elements among columns [c0, c0 + 2 * kWords) of o (word q = columns
// c0 + 2q, c0 + 2q + 1). [p0, p1) is the row's slice of the escape list, columns ascending.
template <int kWords>
__device__ __forceinline__ void apply_escapes(uint32_t* o, int c0, int p0, int p1, const int32_t* __restrict__ esc_col,
                                              const int16_t* __restrict__ esc_val) {
  const int lo = first_escape_from(esc_col, p0, p1, c0);
  int end = lo;
  while (end < p1 && __ldg(esc_col + end) - c0 < 2 * kWords) ++end;
  // The word index is a compile-time constant in each unrolled step: indexing o[] with the
  // column directly would send the whole array to local memory on every path, escapes or not.
#pragma unroll
  for (int q = 0; q < kWords; ++q) {
    for (int i = lo; i < end; ++i) {
      const int c = __ldg(esc_col + i) - c0;
      if ((c >> 1) == q) {
        const int sh = (c & 1) * 16;
        o[q] = (o[q] & ~(0xFFFFu << sh)) | (uint32_t(uint16_t(__ldg(esc_val + i))) << sh);
      }
    }
  }
}

// Variant 0: a thread owns 16 consecutive columns (one 16-byte hi load, one 8-byte lo load, two
// 16-byte stores; a warp's store instruction then covers 1 KB with 16-byte holes).
// Variant 1: a thread owns two 8-column octets 256 columns apart (lane l of a 64-octet group
// takes octets l and l + 32), so each store instruction of a warp writes 512 contiguous bytes and
// each load instruction reads whole 32-byte sectors. The bench times both.
// kVecOut: output rows are 16-byte aligned (K % 8 == 0, aligned base), so stores are 16 bytes wide.
template <int kVariant, bool kVecOut, bool kEight>
__global__ void __launch_bounds__(kThreads)
    decode_kernel(const uint8_t* __restrict__ records, const uint8_t* __restrict__ base,
                  const int32_t* __restrict__ esc_ptr, const int32_t* __restrict__ esc_col,
                  const int16_t* __restrict__ esc_val, int32_t nnz, uint32_t row0, uint32_t work, uint32_t per_row,
                  uint32_t n, int k, int nt, int kt, uint16_t* __restrict__ out) {
  const uint32_t idx = blockIdx.x * kThreads + threadIdx.x;
  if (idx >= work) return;
  // 32-bit index math: the launcher splits the work so that every index here fits.
  const uint32_t rl = idx / per_row;
  const uint32_t j = idx - rl * per_row;
  const uint32_t row = row0 + rl;
  const uint32_t mat = row / n;
  const int nn = int(row - mat * n);
  const int r = nn & (kTileN - 1);
  const uint8_t* rec_row = records + (int64_t(mat) * nt + (nn >> 7)) * kt * int64_t(kRecordBytes);
  // Column of each 8-column part of this thread.
  int c[2];
  if (kVariant == 0) {
    c[0] = int(j) * 16;
    c[1] = c[0] + 8;
  } else {
    c[0] = int((j & ~31u) * 16u + (j & 31u) * 8u);
    c[1] = c[0] + 256;
  }

  uint32_t h[2][2] = {{0u, 0u}, {0u, 0u}}, l[2] = {0u, 0u};
  if (kVariant == 0) {
    const uint8_t* rec = rec_row + int64_t(c[0] >> 6) * kRecordBytes;
    const int cc = c[0] & (kTileK - 1);
    const uint4 hv = __ldg(reinterpret_cast<const uint4*>(rec + r * kTileK + cc));
    h[0][0] = hv.x, h[0][1] = hv.y, h[1][0] = hv.z, h[1][1] = hv.w;
    if (!kEight) {
      const uint2 lv = __ldg(reinterpret_cast<const uint2*>(rec + kHiBytes + r * (kTileK / 2) + cc / 2));
      l[0] = lv.x, l[1] = lv.y;
    }
  } else {
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      if (c[part] < k) {
        const uint8_t* rec = rec_row + int64_t(c[part] >> 6) * kRecordBytes;
        const int cc = c[part] & (kTileK - 1);
        const uint2 hv = __ldg(reinterpret_cast<const uint2*>(rec + r * kTileK + cc));
        h[part][0] = hv.x, h[part][1] = hv.y;
        if (!kEight) l[part] = __ldg(reinterpret_cast<const uint32_t*>(rec + kHiBytes + r * (kTileK / 2) + cc / 2));
      }
    }
  }
  const uint32_t b7 = uint32_t(__ldg(base + row)) << 7;
  const uint32_t b7x2 = b7 | (b7 << 16);
  int32_t p0 = __ldg(esc_ptr + row), p1 = __ldg(esc_ptr + row + 1);

  uint32_t o[2][4];
  decode8<kEight>(h[0][0], h[0][1], l[0], b7x2, o[0]);
  decode8<kEight>(h[1][0], h[1][1], l[1], b7x2, o[1]);

  // Clamp the row's escape range to the list, so a malformed esc_ptr cannot read out of bounds.
  p0 = p0 < 0 ? 0 : (p0 > nnz ? nnz : p0);
  p1 = p1 < p0 ? p0 : (p1 > nnz ? nnz : p1);
  if (p0 < p1) {
    apply_escapes<4>(o[0], c[0], p0, p1, esc_col, esc_val);
    apply_escapes<4>(o[1], c[1], p0, p1, esc_col, esc_val);
  }

  uint16_t* dst = out + int64_t(row) * k;
#pragma unroll
  for (int part = 0; part < 2; ++part) {
    if (kVecOut) {
      // K % 8 == 0, so an 8-column part is wholly inside or wholly outside the row.
      if (c[part] < k)
        *reinterpret_cast<uint4*>(dst + c[part]) = make_uint4(o[part][0], o[part][1], o[part][2], o[part][3]);
    } else {
#pragma unroll
      for (int q = 0; q < 8; ++q)
        if (c[part] + q < k) dst[c[part] + q] = uint16_t(o[part][q >> 1] >> ((q & 1) * 16));
    }
  }
}

// Threads per output row of each variant.
uint32_t threads_per_row(int variant, int k) {
  if (variant == 0) return uint32_t((k + 15) / 16);
  const int octets = (k + 7) / 8;
  return uint32_t(32 * ((octets + 63) / 64));
}

// The GEMM's fragment of one split record (layouts 3 and 4 store the same bytes per thread; only
// the columns each register stands for differ): warp w's lane decodes its four hi / lo vectors
// into 32 registers exactly as the GEMM kernels do (fixed exponent offset E0).
__device__ __forceinline__ void decode_fragment(const uint8_t* src, int w, int lane, int n, uint32_t (&a)[32]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint4 h = __ldg(reinterpret_cast<const uint4*>(src + 2048 * w + 512 * q + 16 * lane));
    const uint2 l = __ldg(reinterpret_cast<const uint2*>(src + kHiBytes + 1024 * w + 256 * q + 8 * lane));
    w12::decode16_split(h, l, a + 8 * q, w12::opaque_k38(static_cast<uint32_t>(n) >> 31));  // see decode16
  }
}

// The per-half addend that moves a fixed-offset exponent (c + E0) to the row base b's (c + b):
// c + b <= 254, so no carry leaves a half.
__device__ __forceinline__ uint32_t base_shift2(uint32_t b) {
  const uint32_t d = ((b - uint32_t(w12::kDecodeE0)) << 7) & 0xFFFFu;
  return d | (d << 16);
}

// Records in a GEMM kernel's split layout (3: Hopper, 4: mma.sync) straight to BF16, for the
// prefill fallback of w12.linear (decode + cuBLAS): no permutation back to layout 0 first, which
// was a second full read and write of the records per call. A CTA of 128 threads takes one
// record and decodes it exactly as the GEMM does (warp w, lane 4g + t: rows 32w + 16mt + g (+8);
// the columns of register R = 16mt + 4ks + r, two per register, are 16ks + 8(r >> 1) + 2t in
// layout 3 and 16t + 4ks + 2(r >> 1) in layout 4, layouts.py), moves each half-word's exponent
// from c + E0 to the row base's (base_shift2), and stages the words in a 128 x 64 shared tile
// whose rows are padded to 36 words (layout 3: a register's 32 words land in 32 banks; layout 4:
// two-way conflicts). The thread of each row then writes the row's escapes into the tile, and
// the rows leave as 16-byte stores, 8 threads per 128-byte row. Layout 4's earlier kernel stored
// straight from registers, 32 bytes per thread and row: 2.3-3.3 TB/s at 16 MB-1 GB, against
// 3.2-3.97 through this tile (bench_codec.py, docs/perf-notes.md session 19), as fast as layout 0's.
constexpr int kTilePitch = 36;  // words per shared-tile row (64 columns = 32 words, + 4)
template <int kLayout, bool kVecOut>
__global__ void __launch_bounds__(128)
    decode_split_kernel(const uint8_t* __restrict__ records, const uint8_t* __restrict__ base,
                        const int32_t* __restrict__ esc_ptr, const int32_t* __restrict__ esc_col,
                        const int16_t* __restrict__ esc_val, int32_t nnz, int n, int k, int nt, int kt,
                        uint16_t* __restrict__ out) {
  __shared__ __align__(16) uint32_t tile[kTileN * kTilePitch];
  const int64_t rec = blockIdx.x;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int64_t mat = rec / (int64_t(nt) * kt);
  const int rt = int((rec / kt) % nt), ktile = int(rec % kt);
  const uint8_t* src = records + rec * kRecordBytes;
  uint32_t a[32];
  decode_fragment(src, w, lane, n, a);
#pragma unroll
  for (int part = 0; part < 4; ++part) {  // part = 2 mt + rb: row 32w + 16mt + g + 8rb of the tile
    const int mt = part >> 1, rb = part & 1;
    const int rl = 32 * w + 16 * mt + g + 8 * rb, row = rt * kTileN + rl;
    const uint32_t d2 = base_shift2(row < n ? uint32_t(__ldg(base + mat * n + row)) : uint32_t(w12::kDecodeE0));
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {  // register r = rb + 2 hi
        const int word = kLayout == 3 ? 8 * ks + 4 * hi + t : 8 * t + 2 * ks + hi;
        tile[rl * kTilePitch + word] = __vadd2(a[16 * mt + 4 * ks + rb + 2 * hi], d2);
      }
  }
  __syncthreads();
  // Thread tid's row: its escapes in this record's 64 columns (the list is sorted by column).
  const int c0 = ktile * kTileK, row = rt * kTileN + tid;
  if (row < n) {
    const int64_t grow = mat * n + row;
    int p0, p1;
    row_escapes(esc_ptr, grow, nnz, p0, p1);
    uint16_t* trow = reinterpret_cast<uint16_t*>(tile + tid * kTilePitch);
    for (int e = first_escape_from(esc_col, p0, p1, c0); e < p1; ++e) {
      const int c = __ldg(esc_col + e) - c0;
      if (c >= kTileK) break;
      trow[c] = uint16_t(__ldg(esc_val + e));
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // 16-byte piece tid + 128 i: row (tid >> 3) + 16 i, columns 8 (tid & 7) ..
    const int rl = (tid >> 3) + 16 * i, c = c0 + 8 * (tid & 7), grow_r = rt * kTileN + rl;
    if (grow_r >= n || c >= k) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(tile + rl * kTilePitch + 4 * (tid & 7));
    uint16_t* dst = out + (mat * n + grow_r) * int64_t(k) + c;
    if (kVecOut) {
      *reinterpret_cast<uint4*>(dst) = v;  // K % 8 == 0: the piece is wholly inside the row
    } else {
      const uint32_t vw[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 8; ++q)
        if (c + q < k) dst[q] = uint16_t(vw[q >> 1] >> ((q & 1) * 16));
    }
  }
}

}  // namespace

// The host-emulation test build compiles the kernels alone, without these launchers.
#ifndef W12_CODEC_HOST_EMULATION
cudaError_t launch_decode(const uint8_t* records, const uint8_t* base, const int32_t* esc_ptr, const int32_t* esc_col,
                          const int16_t* esc_val, int64_t nnz, int64_t mats, int n, int k, bool eight_bit,
                          uint16_t* out, cudaStream_t stream, int variant) {
  if (mats <= 0 || n <= 0 || k <= 0 || nnz < 0 || nnz > 0x7FFFFFFF) return cudaErrorInvalidValue;
  if (variant < 0) variant = kDefaultDecodeVariant;
  if (variant > 1) return cudaErrorInvalidValue;
  const int64_t rows = mats * n;
  if (rows >= 0x7FFFFFFF) return cudaErrorInvalidValue;  // rows index esc_ptr (int32) anyway
  const int nt = (n + kTileN - 1) / kTileN, kt = (k + kTileK - 1) / kTileK;
  const uint32_t per_row = threads_per_row(variant, k);
  const bool vec = (k % 8 == 0) && (reinterpret_cast<uintptr_t>(out) % 16 == 0);
  // Rows per launch so that rows * per_row (the thread index) stays below 2^31.
  const int64_t step = ((int64_t(1) << 31) - kThreads) / per_row;
  for (int64_t row0 = 0; row0 < rows; row0 += step) {
    const int64_t nrows = rows - row0 < step ? rows - row0 : step;
    const uint32_t work = uint32_t(nrows * per_row);
    const unsigned blocks = (work + kThreads - 1) / kThreads;
#define W12_DECODE_ARGS                                                                                        \
  records, base, esc_ptr, esc_col, esc_val, int32_t(nnz), uint32_t(row0), work, per_row, uint32_t(n), k, nt, kt, \
      out
#define W12_DECODE_LAUNCH(V)                                                                    \
  if (vec && eight_bit)                                                                         \
    decode_kernel<V, true, true><<<blocks, kThreads, 0, stream>>>(W12_DECODE_ARGS);             \
  else if (vec)                                                                                 \
    decode_kernel<V, true, false><<<blocks, kThreads, 0, stream>>>(W12_DECODE_ARGS);            \
  else if (eight_bit)                                                                           \
    decode_kernel<V, false, true><<<blocks, kThreads, 0, stream>>>(W12_DECODE_ARGS);            \
  else                                                                                          \
    decode_kernel<V, false, false><<<blocks, kThreads, 0, stream>>>(W12_DECODE_ARGS);
    if (variant == 0) {
      W12_DECODE_LAUNCH(0)
    } else {
      W12_DECODE_LAUNCH(1)
    }
#undef W12_DECODE_LAUNCH
#undef W12_DECODE_ARGS
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t launch_decode_split_layout(int layout, const uint8_t* records, const uint8_t* base,
                                       const int32_t* esc_ptr, const int32_t* esc_col, const int16_t* esc_val,
                                       int64_t nnz, int64_t mats, int n, int k, uint16_t* out, cudaStream_t stream) {
  if ((layout != 3 && layout != 4) || mats <= 0 || n <= 0 || k <= 0 || nnz < 0 || nnz > 0x7FFFFFFF ||
      mats * n >= 0x7FFFFFFF)
    return cudaErrorInvalidValue;
  const int nt = (n + kTileN - 1) / kTileN, kt = (k + kTileK - 1) / kTileK;
  const int64_t num_records = mats * nt * kt;
  if (num_records > 0x7FFFFFFF) return cudaErrorInvalidValue;  // one CTA per record
  const bool vec = (k % 8 == 0) && (reinterpret_cast<uintptr_t>(out) % 16 == 0);
  const unsigned grid = unsigned(num_records);
  const int32_t nz = int32_t(nnz);
#define W12_SPLIT_DECODE(L, V) \
  decode_split_kernel<L, V><<<grid, 128, 0, stream>>>(records, base, esc_ptr, esc_col, esc_val, nz, n, k, nt, kt, out)
  if (layout == 4 && vec)
    W12_SPLIT_DECODE(4, true);
  else if (layout == 4)
    W12_SPLIT_DECODE(4, false);
  else if (vec)
    W12_SPLIT_DECODE(3, true);
  else
    W12_SPLIT_DECODE(3, false);
#undef W12_SPLIT_DECODE
  return cudaGetLastError();
}

#endif  // W12_CODEC_HOST_EMULATION

}  // namespace w12codec
