// Permutes W12 records from one in-record layout to another on the GPU, without decoding
// (format §4: a layout is a fixed permutation of the 8192 element slots of a record; the hi byte
// and the lo nibble of an element move together).
//
// gather[i] (int16, 8192 entries, on the device) is the source slot of destination slot i. Each
// thread owns 16 consecutive destination slots, keeps their 16 source indices for the whole
// launch, and writes 16 hi bytes + 8 lo bytes with two vector stores; a block stages one source
// record (12 KB) in shared memory, so the random-order reads hit shared memory, not DRAM.
// Blocks loop over records so the table is read once a block, not once a record.
// Split layouts (w12.format.split_record_bits, session 14) regroup each element's 12 bits per 8
// slots after the permutation; a thread's 16 slots are exactly two such groups, stored where its 16
// hi bytes and 8 lo bytes are, so the regrouping is a per-thread word transform: undone on the
// staged source record (SRC_SPLIT) before the gather, applied to the gathered words (DST_SPLIT).
// Portable sm_80+ code (the file name follows the project's kernel-folder convention).
#include "smxx_codec.cuh"

namespace w12codec {
namespace {

constexpr int kThreads = 512;  // 512 threads x 16 slots = 8192 slots

__device__ __forceinline__ uint32_t rotr8(uint32_t v) { return (v >> 8) | (v << 24); }
__device__ __forceinline__ uint32_t rotl8(uint32_t v) { return (v << 8) | (v >> 24); }
// 4 nibbles (bits 4k..4k+3) -> the low nibbles of 4 bytes, and back.
__device__ __forceinline__ uint32_t spread_nibbles(uint32_t n) {
  return (n & 0xFu) | ((n & 0xF0u) << 4) | ((n & 0xF00u) << 8) | ((n & 0xF000u) << 12);
}
__device__ __forceinline__ uint32_t pack_nibbles(uint32_t x) {
  return (x & 0xFu) | ((x >> 4) & 0xF0u) | ((x >> 8) & 0xF00u) | ((x >> 12) & 0xF000u);
}

// 16 slots as planes (hi words h[4], nibble words l[2]) -> split form (L words, N words), in
// place. Group G = slots 8G..8G+7: A = its hi word 2G (slots 8G..8G+3), B = hi word 2G+1. N byte i
// = s(A_i) << 7 | c(B_(i+1)) << 4 | s(B_i) << 3 | c(A_i), c = c3c2c1 = hi bits 6..4.
__device__ __forceinline__ void split_chunk(uint32_t (&h)[4], uint32_t (&l)[2]) {
#pragma unroll
  for (int g = 0; g < 2; ++g) {
    const uint32_t a = h[2 * g], b = h[2 * g + 1], nib = l[g];
    l[g] = (a & 0x80808080u) | ((a >> 4) & 0x07070707u) | ((b >> 4) & 0x08080808u) | (rotr8(b) & 0x70707070u);
    h[2 * g] = ((a & 0x0F0F0F0Fu) << 4) | spread_nibbles(nib & 0xFFFFu);
    h[2 * g + 1] = ((b & 0x0F0F0F0Fu) << 4) | spread_nibbles(nib >> 16);
  }
}

// The inverse of split_chunk.
__device__ __forceinline__ void join_chunk(uint32_t (&h)[4], uint32_t (&l)[2]) {
#pragma unroll
  for (int g = 0; g < 2; ++g) {
    const uint32_t la = h[2 * g], lb = h[2 * g + 1], n = l[g];
    h[2 * g] = (n & 0x80808080u) | ((n & 0x07070707u) << 4) | ((la >> 4) & 0x0F0F0F0Fu);
    h[2 * g + 1] = ((n & 0x08080808u) << 4) | (rotl8(n) & 0x70707070u) | ((lb >> 4) & 0x0F0F0F0Fu);
    l[g] = pack_nibbles(la & 0x0F0F0F0Fu) | (pack_nibbles(lb & 0x0F0F0F0Fu) << 16);
  }
}

template <bool SRC_SPLIT, bool DST_SPLIT>
__global__ void __launch_bounds__(kThreads, 4)
    permute_records_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, int64_t num_records,
                           const int16_t* __restrict__ gather) {
  __shared__ __align__(16) uint8_t rec[kRecordBytes];
  // Each thread's 16 table entries live in shared memory rather than registers: 4 blocks of 512
  // threads fill an SM only at <= 32 registers a thread, and 8 more live registers spilled.
  // A thread reads back only what it wrote itself, so no barrier is needed for the table.
  __shared__ __align__(16) int16_t table[kHiBytes];
  const int t = threadIdx.x;
  reinterpret_cast<uint4*>(table)[2 * t] = __ldg(reinterpret_cast<const uint4*>(gather) + 2 * t);
  reinterpret_cast<uint4*>(table)[2 * t + 1] = __ldg(reinterpret_cast<const uint4*>(gather) + 2 * t + 1);
  constexpr int kVecs = kRecordBytes / 16;  // 768 uint4 per record

  for (int64_t ri = blockIdx.x; ri < num_records; ri += gridDim.x) {
    const uint4* s = reinterpret_cast<const uint4*>(src + ri * kRecordBytes);
    const uint4 a = __ldcs(s + t);  // each record is read once: stream it past the caches
    uint4 b = make_uint4(0u, 0u, 0u, 0u);
    if (t + kThreads < kVecs) b = __ldcs(s + t + kThreads);
    __syncthreads();  // the previous record's gathers are done before it is overwritten
    reinterpret_cast<uint4*>(rec)[t] = a;
    if (t + kThreads < kVecs) reinterpret_cast<uint4*>(rec)[t + kThreads] = b;
    __syncthreads();
    if constexpr (SRC_SPLIT) {  // back to planes, each thread its own 16 slots, before any gather
      const uint4 hv = reinterpret_cast<const uint4*>(rec)[t];
      const uint2 lv = reinterpret_cast<const uint2*>(rec + kHiBytes)[t];
      uint32_t h[4] = {hv.x, hv.y, hv.z, hv.w}, l[2] = {lv.x, lv.y};
      join_chunk(h, l);
      reinterpret_cast<uint4*>(rec)[t] = make_uint4(h[0], h[1], h[2], h[3]);
      reinterpret_cast<uint2*>(rec + kHiBytes)[t] = make_uint2(l[0], l[1]);
      __syncthreads();
    }

    uint32_t hw[4] = {0u, 0u, 0u, 0u}, lw[2] = {0u, 0u};
    const uint4 ga = reinterpret_cast<const uint4*>(table)[2 * t];
    const uint4 gb = reinterpret_cast<const uint4*>(table)[2 * t + 1];
    const uint32_t g[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
#pragma unroll
    for (int q = 0; q < 16; ++q) {
      const uint32_t sl = (g[q >> 1] >> ((q & 1) * 16)) & 0x1FFFu;
      hw[q >> 2] |= uint32_t(rec[sl]) << ((q & 3) * 8);
      const uint32_t nib = (uint32_t(rec[kHiBytes + (sl >> 1)]) >> ((sl & 1u) * 4)) & 0xFu;
      lw[q >> 3] |= nib << ((q & 7) * 4);
    }
    if constexpr (DST_SPLIT) split_chunk(hw, lw);
    uint8_t* d = dst + ri * kRecordBytes;
    reinterpret_cast<uint4*>(d)[t] = make_uint4(hw[0], hw[1], hw[2], hw[3]);
    reinterpret_cast<uint2*>(d + kHiBytes)[t] = make_uint2(lw[0], lw[1]);
  }
}

int sm_count() {
  // Looked up per call (cheap attribute query) so a multi-GPU process uses the current device.
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 132;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) return 132;
  return sms;
}

}  // namespace

// The host-emulation test build compiles the kernels alone, without these launchers.
#ifndef W12_CODEC_HOST_EMULATION
cudaError_t launch_permute_records(const uint8_t* src, uint8_t* dst, int64_t num_records, const int16_t* gather,
                                   bool src_split, bool dst_split, cudaStream_t stream) {
  if (num_records < 0) return cudaErrorInvalidValue;
  if (num_records == 0) return cudaSuccess;
  if (reinterpret_cast<uintptr_t>(src) % 16 || reinterpret_cast<uintptr_t>(dst) % 16 ||
      reinterpret_cast<uintptr_t>(gather) % 16)
    return cudaErrorMisalignedAddress;
  // 4 blocks of 512 threads fill an SM's 2048 thread slots; more blocks would only re-read the table.
  const int64_t cap = int64_t(sm_count()) * 4;
  const unsigned blocks = unsigned(num_records < cap ? num_records : cap);
  if (src_split && dst_split)
    permute_records_kernel<true, true><<<blocks, kThreads, 0, stream>>>(src, dst, num_records, gather);
  else if (src_split)
    permute_records_kernel<true, false><<<blocks, kThreads, 0, stream>>>(src, dst, num_records, gather);
  else if (dst_split)
    permute_records_kernel<false, true><<<blocks, kThreads, 0, stream>>>(src, dst, num_records, gather);
  else
    permute_records_kernel<false, false><<<blocks, kThreads, 0, stream>>>(src, dst, num_records, gather);
  return cudaGetLastError();
}

#endif  // W12_CODEC_HOST_EMULATION

}  // namespace w12codec
