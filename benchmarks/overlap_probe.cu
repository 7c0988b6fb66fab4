// Do the tensor pipe (wgmma) and the W12 decode's integer instructions overlap on an SM?
// (docs/perf-notes.md, session 13, item 12.) Standalone, no torch: nvcc -std=c++17 -O3
// -gencode arch=compute_90a,code=sm_90a -I kernels_sm120 benchmarks/overlap_probe.cu -o probe
//
// Usage: probe [CTAS_PER_SM, default 2] [ITERS, default 20000] (session 13 ran 1, 2 and 3 CTAs per
// SM; benchmarks/results/overlap_probe_h200_s13*.txt, the first file from modes 0-4 only;
// overlap_probe_h200_s14.txt all 20 modes at 1 and 2 CTAs per SM).
// Every mode runs CTAS_PER_SM x SMs CTAs of two warpgroups for ITERS iterations ("records") and
// prints the time per iteration. Per iteration and warpgroup, a "record" is 4 wgmma
// m64nNk16 (register A, B from shared memory) and/or 2 decode16 (the real decode), as in v4 at N
// tokens:
//   0 wgmma only      1 decode only
//   2 decode, wait for the previous wgmma, issue (v4's plain loop, no barrier, no copies)
//   3 issue, then decode the next record while it runs, then wait (v4's overlap loop)
//   4 roles split: warpgroup 0 issues both warpgroups' wgmma (8 per iteration), warpgroup 1
//     decodes both warpgroups' records (4 decode16), no coupling between them
//   5 / 6 as 4 with warpgroup 1 doing only the decode's integer work / only its shared-memory
//     loads; 7 / 8 the same without warpgroup 0's wgmma; 9 / 10: 5 with shared-memory A (SS)
//     wgmma instead of register A, and that SS stream alone
//   11 / 12 / 13: 1 / 2 / 3 with the split-plane decode (decode16_split, layout 3; session 14)
//   14 / 15: 5 / 7 with the split-plane decode's integer work; 16 / 17: the same with 136 IMAD
//     per iteration instead, 18 / 19 with 136 FFMA (which pipe the work beside wgmma runs on)
// If 2 or 3 take about t0 + t1 the decode and the wgmma serialise; about max(t0, t1), they overlap.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "smxx_w12_decode.cuh"

namespace {

__device__ __forceinline__ uint64_t desc_sw128(uint32_t saddr) {
  return (uint64_t)((saddr >> 4) & 0x3FFFu) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Accumulators re-defined after the wait, as v4 does (pin), so that ptxas orders no read before it.
__device__ __forceinline__ void retire(float (&acc)[32]) {
  wait0();
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// The 32 accumulator operands of an m64n64k16 wgmma (both forms below).
#define W12_ACC32_REGS                                                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define W12_ACC32(d)                                                                                              \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),      \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),     \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

__device__ __forceinline__ void mma64(float (&d)[32], const uint32_t* a, uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      W12_ACC32_REGS "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : W12_ACC32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc)
      : "memory");
}

// The record's 16 A registers from two decode16 of shared-memory bytes that change with it.
template <bool SPLIT = false>
__device__ __forceinline__ void decode_record(const uint8_t* s, int it, uint32_t (&a)[16]) {
  const int off = (it & 7) * 64 + (threadIdx.x & 127) * 16;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const uint4 h = *reinterpret_cast<const uint4*>(s + ((off + q * 4096) & 16383));
    const uint2 l = *reinterpret_cast<const uint2*>(s + 16384 + ((off / 2 + q * 2048) & 8191));
    if constexpr (SPLIT) w12::decode16_split(h, l, a + 8 * q, w12::opaque_k38(static_cast<uint32_t>(it) >> 30));
    else w12::decode16(h, l, a + 8 * q, w12::opaque_k38(static_cast<uint32_t>(it) >> 30));
  }
}

__device__ __forceinline__ void mma64ss(float (&d)[32], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      W12_ACC32_REGS "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : W12_ACC32(d)
      : "l"(da), "l"(db)
      : "memory");
}

// The decode's integer work without its shared-memory loads (inputs made from the iteration).
// KIND 0: decode16, 1: decode16_split, 2: 136 IMAD (the FMA pipe's integer ops), 3: 136 FFMA.
template <int KIND = 0>
__device__ __forceinline__ void decode_regs(int it, uint32_t (&a)[16]) {
  const uint32_t v = static_cast<uint32_t>(it) * 2654435761u + threadIdx.x;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const uint4 h = make_uint4(v ^ q, v + 3u, v * 5u, v ^ 0x5555u);
    const uint2 l = make_uint2(v >> 3, v ^ 0xAAAAu);
    if constexpr (KIND == 0) w12::decode16(h, l, a + 8 * q, w12::opaque_k38(static_cast<uint32_t>(it) >> 30));
    if constexpr (KIND == 1) w12::decode16_split(h, l, a + 8 * q, w12::opaque_k38(static_cast<uint32_t>(it) >> 30));
    if constexpr (KIND >= 2) {
#pragma unroll
      for (int i = 0; i < 8; ++i) a[8 * q + i] = v + 7u * i + q;
    }
  }
  if constexpr (KIND == 2) {
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
      for (int i = 0; i < 16; ++i) a[i] = a[i] * (2654435761u + 2u * r) + static_cast<uint32_t>(i);
  }
  if constexpr (KIND == 3) {
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
      for (int i = 0; i < 16; ++i) a[i] = __float_as_uint(fmaf(__uint_as_float(a[i]), 1.0001f, 0.5f * r));
  }
}

// The decode's shared-memory loads without its integer work.
__device__ __forceinline__ uint32_t loads_only(const uint8_t* s, int it) {
  const int off = (it & 7) * 64 + (threadIdx.x & 127) * 16;
  uint32_t r = 0;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const uint4 h = *reinterpret_cast<const uint4*>(s + ((off + q * 4096) & 16383));
    const uint2 l = *reinterpret_cast<const uint2*>(s + 16384 + ((off / 2 + q * 2048) & 8191));
    r ^= h.x ^ h.y ^ h.z ^ h.w ^ l.x ^ l.y;
  }
  return r;
}

// Four SS wgmma: A from the 8 KB tile at the start of shared memory, B as issue4's.
__device__ __forceinline__ void issue4ss(float (&acc)[32], uint32_t ab, uint32_t xb) {
  fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) mma64ss(acc, desc_sw128(ab + 32 * ks), desc_sw128(xb + 32 * ks));
  commit();
}

__device__ __forceinline__ void issue4(float (&acc)[32], const uint32_t (&a)[16], uint32_t xb) {
  fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) mma64(acc, a + 4 * ks, desc_sw128(xb + 32 * ks));
  commit();
}

// Both warpgroups' record work issued by one warpgroup, then retired (the roles-split modes).
__device__ __forceinline__ void issue8(float (&acc)[32], const uint32_t (&a)[16], uint32_t xb) {
  issue4(acc, a, xb);
  issue4(acc, a, xb);
  retire(acc);
}

template <int MODE>
__global__ void __launch_bounds__(256) probe(int iters, float* out) {
  __shared__ __align__(1024) uint8_t s[32768];
  for (int i = threadIdx.x; i < 32768 / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(s)[i] = i * 2654435761u;
  __syncthreads();
  const uint32_t xb = static_cast<uint32_t>(__cvta_generic_to_shared(s)) + 16384 + 8192;
  const uint32_t ab = static_cast<uint32_t>(__cvta_generic_to_shared(s));
  const int wg = threadIdx.x >> 7;
  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  uint32_t a0[16], a1[16], sink = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) a0[i] = a1[i] = 0x3c003c00u;
  for (int it = 0; it < iters; ++it) {
    // 11-13 are 1-3 with the split-plane decode; 14-19 are 5 / 7 with other integer work.
    constexpr bool split = MODE >= 11 && MODE <= 13;
    if constexpr (MODE == 0) {
      issue4(acc, a0, xb);
      retire(acc);
    } else if constexpr (MODE == 1 || MODE == 11) {
      decode_record<split>(s, it, a0);
#pragma unroll
      for (int i = 0; i < 16; ++i) sink ^= a0[i];
    } else if constexpr (MODE == 2 || MODE == 12) {
      retire(acc);
      decode_record<split>(s, it, a0);
      issue4(acc, a0, xb);
    } else if constexpr (MODE == 3 || MODE == 13) {
      // Two buffers as v4's overlap loop: decode record it into the buffer the previous wgmma is
      // not reading, then wait for that wgmma, then issue.
      if (it & 1) {
        decode_record<split>(s, it, a1);
        retire(acc);
        issue4(acc, a1, xb);
      } else {
        decode_record<split>(s, it, a0);
        retire(acc);
        issue4(acc, a0, xb);
      }
    } else if constexpr (MODE == 4) {
      if (wg == 0) {
        issue8(acc, a0, xb);
      } else {
        decode_record(s, 2 * it, a0);
        decode_record(s, 2 * it + 1, a1);
#pragma unroll
        for (int i = 0; i < 16; ++i) sink ^= a0[i] ^ a1[i];
      }
    } else if constexpr (MODE == 5 || MODE == 7 || (MODE >= 14 && MODE <= 19)) {
      // Integer (or FMA) work in warpgroup 1, beside warpgroup 0's wgmma (5, 14, 16, 18) or with
      // warpgroup 0 idle (7, 15, 17, 19): decode16's, decode16_split's, 136 IMAD, 136 FFMA.
      constexpr int kind = MODE <= 7 ? 0 : MODE <= 15 ? 1 : MODE <= 17 ? 2 : 3;
      constexpr bool beside = MODE == 5 || (MODE >= 14 && (MODE & 1) == 0);
      if (beside && wg == 0) {
        issue8(acc, a0, xb);
      } else if (wg == 1) {
        decode_regs<kind>(2 * it, a0);
        decode_regs<kind>(2 * it + 1, a1);
#pragma unroll
        for (int i = 0; i < 16; ++i) sink ^= a0[i] ^ a1[i];
      }
    } else if constexpr (MODE == 9 || MODE == 10) {  // SS wgmma (10: alone; 9: beside the ALU work)
      if (wg == 0) {
        issue4ss(acc, ab, xb);
        issue4ss(acc, ab, xb);
        retire(acc);
      } else if (MODE == 9) {
        decode_regs(2 * it, a0);
        decode_regs(2 * it + 1, a1);
#pragma unroll
        for (int i = 0; i < 16; ++i) sink ^= a0[i] ^ a1[i];
      }
    } else {  // 6, 8: shared-memory loads only (6: beside wgmma)
      if (MODE == 6 && wg == 0) {
        issue8(acc, a0, xb);
      } else if (MODE == 6 || wg == 1) {
        sink ^= loads_only(s, 2 * it) ^ loads_only(s, 2 * it + 1);
      }
    }
  }
  retire(acc);
  float r = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) r += acc[i];
  if (r == 1234.5f || sink == 0x12345678u) out[blockIdx.x] = r + sink;
}

template <int MODE>
float run(int ctas, int iters, float* out) {
  probe<MODE><<<ctas, 256>>>(iters, out);  // warm-up
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    cudaEventRecord(e0);
    probe<MODE><<<ctas, 256>>>(iters, out);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, e0, e1);
    best = ms < best ? ms : best;
  }
  if (cudaGetLastError() != cudaSuccess) {
    std::fprintf(stderr, "mode %d failed: %s\n", MODE, cudaGetErrorString(cudaGetLastError()));
    std::exit(1);
  }
  return best * 1e3f / iters;  // us per iteration
}

}  // namespace

int main(int argc, char** argv) {
  const int per_sm = argc > 1 ? std::atoi(argv[1]) : 2;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 20000;
  int sms = 0, clk = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  float* out = nullptr;
  cudaMalloc(&out, 4096 * sizeof(float));
  const int ctas = per_sm * sms;
  constexpr int kModes = 20;
  const float t[kModes] = {run<0>(ctas, iters, out),  run<1>(ctas, iters, out),  run<2>(ctas, iters, out),
                           run<3>(ctas, iters, out),  run<4>(ctas, iters, out),  run<5>(ctas, iters, out),
                           run<6>(ctas, iters, out),  run<7>(ctas, iters, out),  run<8>(ctas, iters, out),
                           run<9>(ctas, iters, out),  run<10>(ctas, iters, out), run<11>(ctas, iters, out),
                           run<12>(ctas, iters, out), run<13>(ctas, iters, out), run<14>(ctas, iters, out),
                           run<15>(ctas, iters, out), run<16>(ctas, iters, out), run<17>(ctas, iters, out),
                           run<18>(ctas, iters, out), run<19>(ctas, iters, out)};
  const char* name[kModes] = {"wgmma only", "decode only", "plain (decode, wait, issue)", "overlap (issue, decode next, wait)",
                         "roles split (wg0 wgmma x2, wg1 decode x2)", "split, wg1 decode ALU only (no loads)",
                         "split, wg1 decode loads only (no ALU)", "wg1 decode ALU only, no wgmma",
                         "wg1 decode loads only, no wgmma", "split, SS wgmma beside decode ALU only",
                         "SS wgmma only (wg0 x2)", "split-plane decode only", "split-plane plain",
                         "split-plane overlap", "split, wg1 split-plane ALU only", "wg1 split-plane ALU only, no wgmma",
                         "split, wg1 136 IMAD", "wg1 136 IMAD, no wgmma", "split, wg1 136 FFMA", "wg1 136 FFMA, no wgmma"};
  std::printf("%d CTAs (%d per SM) x 256 threads, %d iterations, N = 64 tokens; ns per iteration per CTA "
              "(cycles at %.2f GHz max clock):\n", ctas, per_sm, iters, clk / 1e6);
  for (int m = 0; m < kModes; ++m) std::printf("  mode %d %-44s %8.1f ns  %7.0f cycles\n", m, name[m], t[m] * 1e3f, t[m] * 1e-6f * clk * 1e3f);
  std::printf("  sum of 0 and 1: %.1f ns, max: %.1f ns\n", (t[0] + t[1]) * 1e3f, (t[0] > t[1] ? t[0] : t[1]) * 1e3f);
  return 0;
}
