// The byte floor of a back-to-back launch sequence: a kernel that only reads (and discards) a
// contiguous buffer, with the grid shape of a GEMM, for benchmarks/bench_read_floor.py. It says
// what any kernel streaming those bytes in that launch order can reach on this GPU, so the
// W12 GEMM's time splits into "bytes and launches" and "everything the GEMM adds".
// Session 21 added probes of the GEMM's copy pattern (ring_kernel: v4's cp.async ring with the
// GEMM's work taken out or stood in for) and of an L2 prefetch of the next launch's bytes.
// Built on the device by the benchmark (nvcc -shared), loaded with ctypes; not part of libw12.
#include <cuda_runtime.h>
#include <stdint.h>

#include "../kernels_sm120/smxx_pipe.cuh"
#include "../kernels_sm120/smxx_w12_decode.cuh"

namespace {

constexpr int kUnroll = 8;  // 16-byte loads in flight per thread per step

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Reads 16-byte words [b, e) with U loads in flight per thread; their XOR keeps every load alive.
template <int U>
__device__ __forceinline__ uint32_t read_range(const uint4* __restrict__ src, size_t b, size_t e) {
  uint32_t acc = 0;
  for (size_t i = b + threadIdx.x; i < e; i += (size_t)blockDim.x * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t j = i + (size_t)u * blockDim.x;
      v[u] = j < e ? ld_stream(src + j) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  return acc;
}

// CTA b reads 16-byte words [b * per, min((b + 1) * per, n)) (U = 8: kUnroll; 16: twice the bytes
// in flight per thread); the XOR is stored only if it hits a value the data never produces in
// practice (no write traffic).
// kMaxThreads: 256 for the GEMM-shaped grids, 1024 for grids of fewer, larger CTAs (one per SM on
// part of the SMs, as a GEMM whose CTAs own whole 64-row tiles would be).
template <int kMaxThreads, int U = kUnroll>
__global__ void __launch_bounds__(kMaxThreads) read_kernel(const uint4* __restrict__ src, size_t n, size_t per,
                                                           unsigned* sink, int pdl) {
  if (pdl) w12::pdl_wait();
  const size_t b = (size_t)blockIdx.x * per;
  const uint32_t acc = read_range<U>(src, b, b + per < n ? b + per : n);
  if (acc == 0x9E3779B9u) sink[blockIdx.x & 1023] = acc;
}

// The same reads with the chunks of `chunk` 16-byte words dealt round-robin: CTA b reads chunks
// b, b + G, b + 2G, ... (G = gridDim.x), so that at any moment the grid's loads fall in one
// window of the buffer instead of G separate streams (a GEMM's records stored k-major across its
// row tiles would read this way).
template <int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads) read_chunks_kernel(const uint4* __restrict__ src, size_t n,
                                                                  uint32_t chunk, unsigned* sink, int pdl) {
  if (pdl) w12::pdl_wait();
  const size_t nchunks = (n + chunk - 1) / chunk, G = gridDim.x;
  const size_t mine = blockIdx.x < nchunks ? (nchunks - blockIdx.x + G - 1) / G : 0;
  const size_t words = mine * chunk;
  // The thread's place (local chunk j, word w) advances by blockDim.x words per load: kept as a
  // running pair, since a division per load made this loop issue-bound (it is a memory probe).
  const uint32_t dj = blockDim.x / chunk, dw = blockDim.x % chunk;
  uint32_t j = threadIdx.x / chunk, w = threadIdx.x % chunk;
  uint32_t acc = 0;
  for (size_t f = threadIdx.x; f < words; f += (size_t)blockDim.x * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t g = ((size_t)j * G + blockIdx.x) * chunk + w;
      v[u] = f + (size_t)u * blockDim.x < words && g < n ? ld_stream(src + g) : make_uint4(0, 0, 0, 0);
      j += dj;
      w += dw;
      if (w >= chunk) {
        w -= chunk;
        ++j;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9E3779B9u) sink[blockIdx.x & 1023] = acc;
}

// The read kernel of a decode-step chain that, once a CTA has read its range, prefetches into L2
// the first `pf` words of the range that CTA b of the *next* launch will read (next buffer of
// `nn` words, same grid): whether the DRAM time lost between back-to-back kernels (each one's
// drain, the next one's first-byte latency) can be filled from the tail of the one before.
// Lanes of warp 0 issue one bulk L2 prefetch of at most 4 KB each.
template <int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads) read_pf_kernel(const uint4* __restrict__ src, size_t n, size_t per,
                                                              const uint4* nxt, size_t nn, size_t pf,
                                                              unsigned* sink, int pdl) {
  if (pdl) w12::pdl_wait();
  const size_t b = (size_t)blockIdx.x * per;
  const uint32_t acc = read_range<kUnroll>(src, b, b + per < n ? b + per : n);
  if (nxt != nullptr && pf > 0 && threadIdx.x < 32) {
    const size_t per_n = (nn + gridDim.x - 1) / gridDim.x;
    const size_t nb = (size_t)blockIdx.x * per_n;
    size_t ne = nb + (pf < per_n ? pf : per_n);
    if (ne > nn) ne = nn;
    for (size_t w = nb + (size_t)threadIdx.x * 256; w < ne; w += 32 * 256) {
      const uint32_t bytes = (uint32_t)((ne - w < 256 ? ne - w : 256) * 16);
      w12::bulk_prefetch_l2(nxt + w, bytes);
    }
  }
  if (acc == 0x9E3779B9u) sink[blockIdx.x & 1023] = acc;
}

constexpr int kRingRec = 12288;  // one W12 record

// Stands for a GEMM's per-record work: spin > 0 cycles busy, spin < 0 (-spin) ns asleep (no issue).
__device__ __forceinline__ void delay(int spin) {
  if (spin > 0) {
    const long long t0 = clock64();
    while (clock64() - t0 < spin) {
    }
  } else if (spin < 0) {
    __nanosleep(-spin);
  }
}

// The GEMM's copy pattern without its work: CTA b streams its contiguous share of 12 KB records
// through a D-slot shared-memory ring, one barrier per record, and reads one word of each.
// kBulk = false: every thread copies its 16-byte pieces with cp.async (v4's records), D - 1
// records in flight; kBulk = true: thread 0 copies each record with one bulk copy onto the slot's
// mbarrier, D in flight. It says whether the copy mechanism, the ring depth or the CTAs per SM
// set how fast a GEMM-shaped grid can stream (ld.global in read_kernel reaches more at 4 CTAs per
// SM than at 2).

template <int D, bool kBulk>
__global__ void __launch_bounds__(256) ring_kernel(const uint8_t* __restrict__ src, size_t nrec_all, size_t per,
                                                   unsigned* sink, int pdl, int spin, int gemm_copies,
                                                   int early, int extra, const uint8_t* xsrc, int kt) {
  extern __shared__ __align__(128) uint8_t rsm[];
  if (pdl) w12::pdl_wait();
  const int tid = threadIdx.x, nth = blockDim.x;
  const size_t r0 = (size_t)blockIdx.x * per;
  const size_t nrec = r0 >= nrec_all ? 0 : (r0 + per < nrec_all ? per : nrec_all - r0);
  const uint32_t base = w12::smem_u32(rsm), bars = base + D * kRingRec;
  const uint8_t* g = src + r0 * kRingRec;
  uint32_t acc = 0;
  if constexpr (kBulk) {
#if __CUDA_ARCH__ >= 900  // (the bulk-copy wrappers exist in the sm_90 device pass only)
    if (tid == 0) {
      for (int s = 0; s < D; ++s) w12::mbar_init(bars + 8 * s, 1);
      w12::mbar_fence_init();
    }
    __syncthreads();
    if (tid == 0)
      for (int s = 0; s < D && s < (int)nrec; ++s) {
        w12::mbar_arrive_expect_tx(bars + 8 * s, kRingRec);
        w12::bulk_copy_g2s(base + s * kRingRec, g + (size_t)s * kRingRec, kRingRec, bars + 8 * s);
      }
    for (size_t r = 0; r < nrec; ++r) {
      const int slot = (int)(r % D);
      w12::mbar_wait(bars + 8 * slot, (uint32_t)(r / D) & 1);
      acc ^= *reinterpret_cast<const uint32_t*>(rsm + slot * kRingRec + (tid & 511) * 16);
      // early: the slot is refilled as soon as every thread has read it, before the work (as a
      // producer warp waiting on an "empty" barrier would); otherwise after it (v4's order).
      if (!early) delay(spin);
      __syncthreads();
      if (tid == 0 && r + D < nrec) {
        w12::mbar_arrive_expect_tx(bars + 8 * slot, kRingRec);
        w12::bulk_copy_g2s(base + slot * kRingRec, g + (r + D) * kRingRec, kRingRec, bars + 8 * slot);
      }
      if (early) delay(spin);
    }
#endif
  } else {
    // gemm_copies: v4's pieces (two-warpgroup CTA): warp w's two 16-byte hi pieces and two
    // 8-byte lo pieces (through L1, as v4 copies them) of its 32 rows' fragments.
    // extra & 8 (with gemm_copies and kt = records per 128-row tile): v4's balanced grid (BAL):
    // warp w of CTA b copies 16-row slice b * total / G + w of the weight, all kt of its records,
    // or nothing past the CTA's share; nrec and per are then ignored.
    int quarter = (tid >> 5) & 3, mt0 = (tid >> 7) & 1;
    const int lane = tid & 31;
    // extra & 32 (with 8): the records stored slice-major instead: each 16-row slice's 1.5 KB of a
    // record (its 1 KB of hi bytes, then its 512 B of lo bytes) contiguous with the slice's next
    // record's, so that a warp streams one contiguous range (the same bytes land in the same places).
    const uint8_t* gsrc = g;
    size_t nsteps = nrec;
    bool mine = true, slice_major = false;
    // extra & 256 (without 8): records dealt round-robin, CTA b's r-th being record b + r G (one
    // moving window over the weight instead of G separate streams).
    const bool rr = (extra & 256) && !(extra & 8);
    size_t rstride = kRingRec;
    if (rr) {
      const size_t G = gridDim.x;
      nsteps = blockIdx.x < nrec_all ? (nrec_all - blockIdx.x + G - 1) / G : 0;
      gsrc = src + (size_t)blockIdx.x * kRingRec;
      rstride = G * kRingRec;
    }
    if ((extra & 8) && gemm_copies && kt > 0) {
      const unsigned total = (unsigned)(nrec_all / kt) * 8u, G = gridDim.x;
      const unsigned sl = blockIdx.x * total / G + (tid >> 5);
      mine = sl < (blockIdx.x + 1) * total / G;
      quarter = (sl >> 1) & 3, mt0 = sl & 1;
      slice_major = (extra & 32) != 0;
      gsrc = slice_major ? src + (size_t)(mine ? sl : 0) * kt * 1536 : src + (size_t)(mine ? sl >> 3 : 0) * kt * kRingRec;
      nsteps = kt;
    }
    // extra & 16: two records per step (slots of 24 KB, one wait and one barrier per two records).
    const int rps = (extra & 16) ? 2 : 1;
    const uint32_t slot_bytes = rps * kRingRec;
    const size_t nrecs = nsteps;
    nsteps = (nsteps + rps - 1) / rps;
    const uint32_t hi_off = quarter * 2048 + lane * 16 + mt0 * 1024, lo_off = 8192 + quarter * 1024 + lane * 8 + mt0 * 512;
    auto issue = [&](size_t r) {
      for (int j = 0; j < rps; ++j) {
        const size_t rec = r * rps + j;
        if (rec >= nrecs) return;
        const uint32_t dst = base + (uint32_t)(r % D) * slot_bytes + j * kRingRec;
        const uint8_t* gr = gsrc + rec * rstride;
        if (slice_major) {
          if (!mine) return;
          const uint8_t* gs = gsrc + rec * 1536;
          for (int q = 0; q < 2; ++q) w12::cp_async16(dst + hi_off + q * 512, gs + lane * 16 + q * 512);
          for (int q = 0; q < 2; ++q) w12::cp_async8(dst + lo_off + q * 256, gs + 1024 + lane * 8 + q * 256);
        } else if (gemm_copies) {
          if (!mine) return;
          for (int q = 0; q < 2; ++q) w12::cp_async16(dst + hi_off + q * 512, gr + hi_off + q * 512);
          for (int q = 0; q < 2; ++q) w12::cp_async8(dst + lo_off + q * 256, gr + lo_off + q * 256);
        } else {
          for (int i = tid; i < kRingRec / 16; i += nth) w12::cp_async16(dst + i * 16, gr + i * 16);
        }
      }
    };
    if (early) {
      // Each thread refills its own pieces of the slot it just used, before the barrier: D records
      // in flight, and no other warp's arrival in the chain from a record landing to the copy
      // of the one D later.
      for (int s = 0; s < D; ++s) {
        if (s < (int)nsteps) issue(s);
        w12::cp_async_commit();
      }
      for (size_t r = 0; r < nsteps; ++r) {
        w12::cp_async_wait<D - 1>();
        const uint32_t v = *reinterpret_cast<const uint32_t*>(rsm + (r % D) * slot_bytes + (gemm_copies ? hi_off : tid * 16));
        acc ^= v;
        // early == 2: the refill leaves as soon as the piece is read (its address depends on the
        // value, so the read has returned before the copy can overwrite it), before the work.
        if (early == 2 && r + D < nsteps) {
          uint32_t z;
          asm volatile("and.b32 %0, %1, 0;" : "=r"(z) : "r"(v));
          issue(r + D + z);
        }
        delay(spin);
        if (early == 1 && r + D < nsteps) issue(r + D);
        w12::cp_async_commit();
        // extra & 64: no barrier (each thread reads only its own pieces here), so no thread's
        // step waits for another's.
        if (!(extra & 64)) __syncthreads();
      }
      if (acc == 0x9E3779B9u) sink[blockIdx.x & 1023] = acc;
      return;
    }
    for (int s = 0; s < D - 1; ++s) {
      if (s < (int)nsteps) issue(s);
      w12::cp_async_commit();
    }
    // v4's order: wait for this thread's pieces, use the record (spin: cycles standing for the
    // decode), barrier, refill the slot the previous step used. extra (v4's other per-record work,
    // one bit each): 1 all of the thread's pieces read (v4's four loads, gemm_copies), 2 v4's proxy
    // fence, 4 an activation row (threads 0-7, 16 bytes through L1 from xsrc) into a 128-byte
    // area per slot after the records.
    const uint32_t xdst = base + D * slot_bytes + 128 + 16 * (tid & 7);  // (past the 128 B of barriers)
    for (size_t r = 0; r < nsteps; ++r) {
      w12::cp_async_wait<D - 2>();
      if (extra & 2) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      if ((extra & 1) && gemm_copies) {
        const uint8_t* st = rsm + (r % D) * slot_bytes;
        const uint4 h0 = *reinterpret_cast<const uint4*>(st + hi_off), h1 = *reinterpret_cast<const uint4*>(st + hi_off + 512);
        const uint2 l0 = *reinterpret_cast<const uint2*>(st + lo_off), l1 = *reinterpret_cast<const uint2*>(st + lo_off + 256);
        acc ^= h0.x ^ h0.y ^ h0.z ^ h0.w ^ h1.x ^ h1.y ^ h1.z ^ h1.w ^ l0.x ^ l0.y ^ l1.x ^ l1.y;
      }
      acc ^= *reinterpret_cast<const uint32_t*>(rsm + (r % D) * slot_bytes + (tid & 511) * 16);
      // extra & 128: each CTA's delay for record r drawn uniformly from [0, 2 SPIN) (same mean),
      // so that CTAs do not step in time with each other.
      if (extra & 128) {
        const uint32_t h = (blockIdx.x * 0x9E3779B1u) ^ ((uint32_t)r * 0x85EBCA77u);
        const uint32_t hh = (h ^ (h >> 15)) * 0x2C1B3C6Du;
        delay((int)(((unsigned long long)(2 * spin) * ((hh ^ (hh >> 12)) & 0xFFFF)) >> 16));
      } else {
        delay(spin);
      }
      __syncthreads();
      if (r + D - 1 < nsteps) {
        issue(r + D - 1);
        if ((extra & 4) && tid < 8) w12::cp_async16_ca(xdst + 128 * ((r + D - 1) % D), xsrc + 128 * ((r + D - 1) & 31) + 16 * tid);
      }
      w12::cp_async_commit();
    }
  }
  if (acc == 0x9E3779B9u) sink[blockIdx.x & 1023] = acc;
}

// A stand-in for a split-K reduce kernel: `ctas` CTAs each read 4 KB and write 256 B.
__global__ void __launch_bounds__(128) tail_kernel(const uint4* __restrict__ src, uint4* dst, int pdl) {
  if (pdl) w12::pdl_wait();
  const uint4 v = ld_stream(src + (size_t)blockIdx.x * 256 + threadIdx.x);
  const uint4 w = ld_stream(src + (size_t)blockIdx.x * 256 + 128 + threadIdx.x);
  if (threadIdx.x < 16) dst[blockIdx.x * 16 + threadIdx.x] = make_uint4(v.x ^ w.x, v.y ^ w.y, v.z ^ w.z, v.w ^ w.w);
}

cudaError_t launch(void (*kern)(), void** args, int grid, int threads, int pdl, cudaStream_t s, size_t smem = 0) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelExC(&cfg, reinterpret_cast<const void*>(kern), args);
}

}  // namespace

extern "C" int rf_read(const void* src, size_t bytes, int ctas, void* sink, int pdl, void* stream) {
  const size_t n = bytes / 16;
  size_t per = (n + ctas - 1) / ctas;
  const uint4* p = static_cast<const uint4*>(src);
  unsigned* k = static_cast<unsigned*>(sink);
  void* args[] = {&p, const_cast<size_t*>(&n), &per, &k, &pdl};
  return launch(reinterpret_cast<void (*)()>(read_kernel<256>), args, ctas, 256, pdl, static_cast<cudaStream_t>(stream));
}

extern "C" int rf_read_grid(const void* src, size_t bytes, int ctas, int threads, void* sink, int pdl,
                            void* stream) {
  if (threads < 32 || threads > 1024 || threads % 32) return static_cast<int>(cudaErrorInvalidValue);
  const size_t n = bytes / 16;
  size_t per = (n + ctas - 1) / ctas;
  const uint4* p = static_cast<const uint4*>(src);
  unsigned* k = static_cast<unsigned*>(sink);
  void* args[] = {&p, const_cast<size_t*>(&n), &per, &k, &pdl};
  return launch(reinterpret_cast<void (*)()>(read_kernel<1024>), args, ctas, threads, pdl,
                static_cast<cudaStream_t>(stream));
}

extern "C" int rf_read_chunks(const void* src, size_t bytes, int ctas, int threads, size_t chunk_bytes, void* sink,
                              int pdl, void* stream) {
  if (threads < 32 || threads > 1024 || threads % 32 || chunk_bytes < 16 || chunk_bytes % 16)
    return static_cast<int>(cudaErrorInvalidValue);
  size_t n = bytes / 16;
  uint32_t chunk = static_cast<uint32_t>(chunk_bytes / 16);
  const uint4* p = static_cast<const uint4*>(src);
  unsigned* k = static_cast<unsigned*>(sink);
  void* args[] = {&p, &n, &chunk, &k, &pdl};
  return launch(reinterpret_cast<void (*)()>(read_chunks_kernel<1024>), args, ctas, threads, pdl,
                static_cast<cudaStream_t>(stream));
}

extern "C" int rf_tail(const void* src, void* dst, int ctas, int pdl, void* stream) {
  const uint4* p = static_cast<const uint4*>(src);
  uint4* d = static_cast<uint4*>(dst);
  void* args[] = {&p, &d, &pdl};
  return launch(reinterpret_cast<void (*)()>(tail_kernel), args, ctas, 128, pdl, static_cast<cudaStream_t>(stream));
}

extern "C" int rf_read_pf(const void* src, size_t bytes, const void* nxt, size_t nxt_bytes, size_t pf_bytes, int ctas,
                          void* sink, int pdl, void* stream) {
  size_t n = bytes / 16, nn = nxt_bytes / 16, pf = pf_bytes / 16;
  size_t per = (n + ctas - 1) / ctas;
  const uint4* p = static_cast<const uint4*>(src);
  const uint4* q = static_cast<const uint4*>(nxt);
  unsigned* k = static_cast<unsigned*>(sink);
  void* args[] = {&p, &n, &per, &q, &nn, &pf, &k, &pdl};
  return launch(reinterpret_cast<void (*)()>(read_pf_kernel<256>), args, ctas, 256, pdl,
                static_cast<cudaStream_t>(stream));
}

// mode 0: read_kernel with 16 loads in flight per thread; 1: a ring of per-thread cp.async; 2: a
// ring of bulk copies; 3: mode 1 with v4's pieces (256 threads, or any with extra & 8); 4 / 5: modes
// 1 / 3 with each thread refilling its own pieces before the barrier; 6 / 7: the same, the refill
// issued before the per-record work instead of after it; 8: mode 2 refilling each slot before the
// per-record work. depth: 3, 4, 6 or 8; spin: ring_kernel's
// delay per record; extra: see ring_kernel (modes 1 and 3); xsrc: 4 KB the activation copies
// read; kt: records per 128-row tile (extra & 8).
extern "C" int rf_ring(const void* src, size_t bytes, int ctas, int threads, int mode, int depth, int spin, int extra,
                       const void* xsrc, int kt, void* sink, int pdl, void* stream) {
  // v4's pieces need its 8-warp CTA, or (balanced grid) at most one slice per warp.
  if ((mode == 3 || mode == 5 || mode == 7) && threads != 256 && !((extra & 8) && threads % 32 == 0))
    return static_cast<int>(cudaErrorInvalidValue);
  int gemm_copies = mode == 3 || mode == 5 || mode == 7 ? 1 : 0, early = mode == 8 ? 1 : mode >= 6 ? 2 : mode >= 4 ? 1 : 0;
  if (mode == 8) mode = 2;
  if (mode >= 3) mode = 1;
  if (threads < 32 || threads > 256 || threads % 32) return static_cast<int>(cudaErrorInvalidValue);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  unsigned* k = static_cast<unsigned*>(sink);
  if (mode == 0) {
    size_t n = bytes / 16, per = (n + ctas - 1) / ctas;
    const uint4* p = static_cast<const uint4*>(src);
    void* args[] = {&p, &n, &per, &k, &pdl};
    return launch(reinterpret_cast<void (*)()>(read_kernel<256, 16>), args, ctas, threads, pdl, s);
  }
  size_t nrec = bytes / kRingRec, per = (nrec + ctas - 1) / ctas;
  const uint8_t* p = static_cast<const uint8_t*>(src);
  const uint8_t* xs = static_cast<const uint8_t*>(xsrc);
  void* args[] = {&p, &nrec, &per, &k, &pdl, &spin, &gemm_copies, &early, &extra, &xs, &kt};
  void (*kern)() = nullptr;
  const bool bulk = mode == 2;
  switch (depth) {
    case 3: kern = bulk ? reinterpret_cast<void (*)()>(ring_kernel<3, true>) : reinterpret_cast<void (*)()>(ring_kernel<3, false>); break;
    case 4: kern = bulk ? reinterpret_cast<void (*)()>(ring_kernel<4, true>) : reinterpret_cast<void (*)()>(ring_kernel<4, false>); break;
    case 6: kern = bulk ? reinterpret_cast<void (*)()>(ring_kernel<6, true>) : reinterpret_cast<void (*)()>(ring_kernel<6, false>); break;
    case 8: kern = bulk ? reinterpret_cast<void (*)()>(ring_kernel<8, true>) : reinterpret_cast<void (*)()>(ring_kernel<8, false>); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  const int smem = depth * kRingRec * ((extra & 16) ? 2 : 1) + 128 + 128 * depth;
  if (cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void*>(kern), cudaFuncAttributeMaxDynamicSharedMemorySize, smem); e != cudaSuccess)
    return static_cast<int>(e);
  return static_cast<int>(launch(kern, args, ctas, threads, pdl, s, smem));
}
