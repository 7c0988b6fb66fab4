// Certified LM head, pass 2: exact rescoring of the survivors with the BF16 weights.
//
// Block (segment s, hidden row n) scans the upper bounds U[n][v] of its HEAD_SEG tokens, keeps those
// with U >= Lmax[n] in a shared-memory list (HEAD_SEG slots: it cannot overflow, so a survivor set
// of any size, up to the whole vocabulary, is rescored on the device with no host branch), and its
// warps (or, for <= 4 survivors, the whole block per survivor) compute the exact scores. The best (score, lowest id) is folded into a
// 64-bit key with atomicMax, which makes the result independent of block and list order; the last
// block to finish writes the ids and survivor counts.
//
// The exact routine (the definition the argmax is exact for) is described at exact_dot_warp: FP32
// FMA chains over fixed k groups, a fixed reduction tree, -0 as +0. It depends only on
// (h', w_v, Kpad), never on which tokens survived or how many.
#include "head_common.cuh"
#include "smxx_pipe.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlockModeMax = 4;  // up to this many survivors in a block: one block-wide dot each

__device__ __forceinline__ float bf_lo(unsigned x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf_hi(unsigned x) { return __uint_as_float(x & 0xffff0000u); }

// 8 FMAs of one 16-byte group of weights (k0 .. k0+7, in k order) into acc.
__device__ __forceinline__ float fma8(const uint16_t* __restrict__ wrow, const float* __restrict__ hrow, int k0,
                                      float acc) {
  const uint4 w = __ldg(reinterpret_cast<const uint4*>(wrow + k0));
  const float4 a = __ldg(reinterpret_cast<const float4*>(hrow + k0));
  const float4 b = __ldg(reinterpret_cast<const float4*>(hrow + k0 + 4));
  acc = __fmaf_rn(a.x, bf_lo(w.x), acc);
  acc = __fmaf_rn(a.y, bf_hi(w.x), acc);
  acc = __fmaf_rn(a.z, bf_lo(w.y), acc);
  acc = __fmaf_rn(a.w, bf_hi(w.y), acc);
  acc = __fmaf_rn(b.x, bf_lo(w.z), acc);
  acc = __fmaf_rn(b.y, bf_hi(w.z), acc);
  acc = __fmaf_rn(b.z, bf_lo(w.w), acc);
  acc = __fmaf_rn(b.w, bf_hi(w.w), acc);
  return acc;
}

__device__ __forceinline__ float butterfly(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float canon(float s) { return s == 0.f ? 0.f : s; }  // -0 -> +0

// The exact routine, as 256 virtual lanes: virtual lane t = 32 j + l accumulates the groups
// k0 = 8 t + 2048 i (i = 0, 1, ...); each virtual warp j is reduced by the xor butterfly; the eight
// sums are added in order j = 0..7. Two executions give the same bits:
//  - warp mode (many survivors): one warp, lane l keeps the accumulators of virtual lanes 32 j + l;
//  - block mode (few survivors): the whole 256-thread block, one virtual lane per thread, so a lone
//    survivor costs one memory round trip instead of K/256.
__device__ __forceinline__ float exact_dot_warp(const uint16_t* __restrict__ wrow, const float* __restrict__ hrow,
                                                int kpad, int lane) {
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.f;
  for (int base = 0; base < kpad; base += 2048) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int k0 = base + 8 * (32 * j + lane);
      if (k0 < kpad) acc[j] = fma8(wrow, hrow, k0, acc[j]);
    }
  }
  float s = butterfly(acc[0]);
#pragma unroll
  for (int j = 1; j < 8; ++j) s = __fadd_rn(s, butterfly(acc[j]));
  return canon(s);
}

// Block mode; every thread must call it; red holds 8 floats. Returns the score in every thread.
__device__ __forceinline__ float exact_dot_block(const uint16_t* __restrict__ wrow, const float* __restrict__ hrow,
                                                 int kpad, float* red) {
  float acc = 0.f;
  for (int k0 = 8 * threadIdx.x; k0 < kpad; k0 += 2048) acc = fma8(wrow, hrow, k0, acc);
  acc = butterfly(acc);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = acc;
  __syncthreads();
  float s = red[0];
#pragma unroll
  for (int j = 1; j < 8; ++j) s = __fadd_rn(s, red[j]);
  __syncthreads();  // red is reused by the next call
  return canon(s);
}

__device__ __forceinline__ unsigned long long make_key(float s, int v) {
  return (static_cast<unsigned long long>(head_enc(s)) << 32) | (0xffffffffu - static_cast<unsigned>(v));
}

__global__ void __launch_bounds__(kThreads) head_rescore_kernel(const uint16_t* __restrict__ w, int v, int vpad,
                                                                int kpad, int m, int rescore_all, HeadWs ws,
                                                                long long* __restrict__ out_ids,
                                                                int* __restrict__ out_count) {
  __shared__ int list[HEAD_SEG];
  __shared__ int cnt;
  __shared__ unsigned long long best[kWarps];
  __shared__ bool last;
  __shared__ float red[kWarps];
  const int n = blockIdx.y, seg0 = blockIdx.x * HEAD_SEG;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) cnt = 0;
  w12::pdl_wait();  // everything below reads what screen (or prep) wrote
  __syncthreads();
  const unsigned enc = ws.lmax[n];
  const float thr = enc == 0u ? -INFINITY : head_dec(enc);
  const float* up = ws.upper + static_cast<size_t>(n) * vpad;
  for (int i = threadIdx.x; i < HEAD_SEG; i += kThreads) {
    const int vv = seg0 + i;
    if (vv < v && (rescore_all || up[vv] >= thr)) list[atomicAdd(&cnt, 1)] = vv;
  }
  __syncthreads();
  const int total = cnt;
  unsigned long long mine = 0ull;
  const float* hrow = ws.hp + static_cast<size_t>(n) * kpad;
  if (total <= kBlockModeMax) {
    for (int it = 0; it < total; ++it) {
      const int vv = list[it];
      const float s = exact_dot_block(w + static_cast<size_t>(vv) * kpad, hrow, kpad, red);
      const unsigned long long key = make_key(s, vv);
      mine = key > mine ? key : mine;
    }
  } else {
    for (int it = warp; it < total; it += kWarps) {
      const int vv = list[it];
      const float s = exact_dot_warp(w + static_cast<size_t>(vv) * kpad, hrow, kpad, lane);
      const unsigned long long key = make_key(s, vv);
      mine = key > mine ? key : mine;
    }
  }
  if (lane == 0) best[warp] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long b = best[0];
    for (int i = 1; i < kWarps; ++i) b = best[i] > b ? best[i] : b;
    if (total > 0) {
      atomicMax(ws.key + n, b);
      atomicAdd(ws.count + n, total);
    }
    __threadfence();  // our key is visible before the ticket says we are done
    const unsigned ticket = atomicAdd(ws.done, 1u);
    last = ticket == gridDim.x * gridDim.y - 1;
  }
  __syncthreads();
  if (last) {
    __threadfence();
    for (int r = threadIdx.x; r < m; r += kThreads) {
      const unsigned long long k = atomicAdd(ws.key + r, 0ull);  // coherent read through L2
      out_ids[r] = static_cast<long long>(0xffffffffu - static_cast<unsigned>(k & 0xffffffffull));
      if (out_count) out_count[r] = atomicAdd(ws.count + r, 0);
    }
  }
}

__global__ void __launch_bounds__(kThreads) head_exact_all_kernel(const uint16_t* __restrict__ w, int v, int kpad,
                                                                  HeadWs ws, float* __restrict__ out) {
  const int n = blockIdx.y, lane = threadIdx.x & 31;
  const int vv = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (vv >= v) return;
  const float s = exact_dot_warp(w + static_cast<size_t>(vv) * kpad, ws.hp + static_cast<size_t>(n) * kpad, kpad, lane);
  if (lane == 0) out[static_cast<size_t>(n) * v + vv] = s;
}

}  // namespace

cudaError_t w12h_launch_rescore(const uint16_t* w, int v, int vpad, int kpad, int m, int rescore_all,
                                const HeadWs& ws, long long* out_ids, int* out_count, bool pdl, cudaStream_t st) {
  const dim3 grid((v + HEAD_SEG - 1) / HEAD_SEG, m);
  return head_launch(head_rescore_kernel, grid, kThreads, pdl, st, w, v, vpad, kpad, m, rescore_all, ws, out_ids,
                     out_count);
}

cudaError_t w12h_launch_exact_all(const uint16_t* w, int v, int kpad, int m, const HeadWs& ws, float* out,
                                  cudaStream_t st) {
  const dim3 grid((v + kWarps - 1) / kWarps, m);
  head_exact_all_kernel<<<grid, kThreads, 0, st>>>(w, v, kpad, ws, out);
  return cudaGetLastError();
}
