// Permutes W12 records from one in-record layout to another on the GPU, without decoding
// (format §4: a layout is a fixed permutation of the 8192 element slots of a record; the hi byte
// and the lo nibble of an element move together).
//
// gather[i] (int16, 8192 entries, on the device) is the source slot of destination slot i. Each
// thread owns 16 consecutive destination slots, keeps their 16 source indices for the whole
// launch, and writes 16 hi bytes + 8 lo bytes with two vector stores; a block stages one source
// record (12 KB) in shared memory, so the random-order reads hit shared memory, not DRAM.
// Blocks loop over records so the table is read once a block, not once a record.
// Portable sm_80+ code (the file name follows the project's kernel-folder convention).
#include "smxx_codec.cuh"

namespace w12codec {
namespace {

constexpr int kThreads = 512;  // 512 threads x 16 slots = 8192 slots

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
                                   cudaStream_t stream) {
  if (num_records < 0) return cudaErrorInvalidValue;
  if (num_records == 0) return cudaSuccess;
  if (reinterpret_cast<uintptr_t>(src) % 16 || reinterpret_cast<uintptr_t>(dst) % 16 ||
      reinterpret_cast<uintptr_t>(gather) % 16)
    return cudaErrorMisalignedAddress;
  // 4 blocks of 512 threads fill an SM's 2048 thread slots; more blocks would only re-read the table.
  const int64_t cap = int64_t(sm_count()) * 4;
  const unsigned blocks = unsigned(num_records < cap ? num_records : cap);
  permute_records_kernel<<<blocks, kThreads, 0, stream>>>(src, dst, num_records, gather);
  return cudaGetLastError();
}

#endif  // W12_CODEC_HOST_EMULATION

}  // namespace w12codec
