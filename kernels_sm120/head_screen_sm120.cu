// Certified LM head, pass 1: hidden-state preparation and the INT8 screening GEMV/GEMM (M <= 32).
//
// prep   : per hidden row, h' = 2^-e h (max|h'| in [1/2, 1)), the 16-bit integers p = rint(2^15 h')
//          as two INT8 digits, ||h'|| and ||h' - 2^-15 p|| rounded up; resets the control words.
// screen : streams the INT8 head once (16-byte loads, L1 bypassed), J_v = sum_k p_k q_vk exactly on
//          the integer tensor cores (mma m16n8k32 s8, two digits of p), then per (row, token) the
//          cheap score c = fl(fl(a_v fl(J)) 2^-15) and the half-width B of docs/certified_head.md,
//          with directed rounding. Writes U = c + B (rounded up) and raises Lmax = max (c - B)
//          (rounded down) through an atomic max on an order-preserving encoding.
// Only the upper bounds (4 bytes per token and row, < 1 % of the INT8 bytes at M = 1) leave the
// kernel; the rescore pass filters them against the final Lmax.
//
// With programmatic dependent launch (sm_90+), the screen's CTAs start while prep runs: each warp
// pulls the first 512 bytes of its first tile's 16 rows into L2 (weights do not depend on prep),
// then waits for prep's results. prep -> screen -> rescore would otherwise pay two launch ramps
// with HBM idle, a few microseconds on a ~150 us pass.
#include "head_common.cuh"
#include "smxx_pipe.cuh"

#include <math.h>

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load_h(const void* h, int bf16, long long idx) {
  if (bf16) {
    unsigned short b = static_cast<const unsigned short*>(h)[idx];
    return __uint_as_float(static_cast<unsigned>(b) << 16);
  }
  return static_cast<const float*>(h)[idx];
}

template <typename T, typename Op>
__device__ T block_reduce(T x, Op op, T* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  __syncthreads();
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  T r = smem[0];
  for (int i = 1; i < (kThreads >> 5); ++i) r = op(r, smem[i]);
  return r;
}

__global__ void __launch_bounds__(kThreads) head_prep_kernel(const void* __restrict__ h, int bf16, int m,
                                                             long long ldh, int k, int kpad, HeadWs ws) {
  w12::pdl_launch_dependents();  // the screen only prefetches weights until this grid completes
  __shared__ float sf[kThreads / 32];
  __shared__ double sd[kThreads / 32];
  const int n = blockIdx.x;
  const bool live = n < m;
  float amax = 0.f;
  if (live)
    for (int i = threadIdx.x; i < k; i += kThreads) amax = fmaxf(amax, fabsf(load_h(h, bf16, n * ldh + i)));
  amax = block_reduce(amax, [](float a, float b) { return fmaxf(a, b); }, sf);
  int e = 0;
  if (amax > 0.f) frexpf(amax, &e);
  const double sc = ldexp(1.0, -e);  // exact; h * sc is exact in FP64, then one rounding to FP32
  double ss = 0.0, rr = 0.0;
  float* hp = ws.hp + static_cast<size_t>(n) * kpad;
  int8_t* phi = ws.phi + static_cast<size_t>(n) * kpad;
  int8_t* plo = ws.plo + static_cast<size_t>(n) * kpad;
  for (int i = threadIdx.x; i < kpad; i += kThreads) {
    const float x = (live && i < k) ? static_cast<float>(static_cast<double>(load_h(h, bf16, n * ldh + i)) * sc) : 0.f;
    double p = rint(static_cast<double>(x) * 32768.0);
    p = fmin(fmax(p, -32639.0), 32639.0);
    const int pi = static_cast<int>(p);
    const int hi = (pi + 128) >> 8;  // floor: the low digit lands in [-128, 127]
    hp[i] = x;
    phi[i] = static_cast<int8_t>(hi);
    plo[i] = static_cast<int8_t>(pi - 256 * hi);
    const double xd = x, d = xd - p * (1.0 / 32768.0);  // exact in FP64
    ss += xd * xd;
    rr += d * d;
  }
  ss = block_reduce(ss, [](double a, double b) { return a + b; }, sd);
  rr = block_reduce(rr, [](double a, double b) { return a + b; }, sd);
  if (threadIdx.x == 0) {
    // FP64 sums of kpad squares: relative error <= (kpad + 1) 2^-53; sqrt adds 2^-53.
    const double grow = 1.0 + (kpad + 4) * 0x1p-52;
    ws.hn[n] = __double2float_ru(sqrt(ss * grow) * (1.0 + 0x1p-50));
    ws.rh[n] = __double2float_ru(sqrt(rr * grow) * (1.0 + 0x1p-50));
    ws.lmax[n] = 0u;  // below the encoding of every float
    ws.key[n] = 0ull;
    ws.count[n] = 0;
    if (n == 0) *ws.done = 0u;
  }
}

template <bool L2_256B>
__device__ __forceinline__ int4 ld_stream(const int8_t* p) {
  int4 r;
  if (L2_256B)
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
  else
    asm("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
  return r;
}

__device__ __forceinline__ void mma_s8(int (&c)[4], int a0, int a1, int a2, int a3, int b0, int b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 64-wide K chunk of one 16-row tile. Each lane holds 16 bytes of row g and of row g+8 at
// K offset 16t; the k order inside the chunk is permuted identically for weights and h (a dot
// product does not care), so both operands come from one 16-byte load per row.
template <int NT>
__device__ __forceinline__ void chunk_mma(int (&ahi)[NT][4], int (&alo)[NT][4], const int4& wa, const int4& wb,
                                          const int8_t* const (&hhi)[NT], const int8_t* const (&hlo)[NT], int off) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int4 x = __ldg(reinterpret_cast<const int4*>(hhi[nt] + off));
    const int4 y = __ldg(reinterpret_cast<const int4*>(hlo[nt] + off));
    mma_s8(ahi[nt], wa.x, wb.x, wa.y, wb.y, x.x, x.y);
    mma_s8(ahi[nt], wa.z, wb.z, wa.w, wb.w, x.z, x.w);
    mma_s8(alo[nt], wa.x, wb.x, wa.y, wb.y, y.x, y.y);
    mma_s8(alo[nt], wa.z, wb.z, wa.w, wb.w, y.z, y.w);
  }
}

template <int NT, int UNROLL, bool L2_256B>
__global__ void __launch_bounds__(kThreads, 2) head_screen_kernel(const int8_t* __restrict__ q,
                                                               const float4* __restrict__ rowp, int v, int vpad,
                                                               int kpad, int m, HeadWs ws) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int warps_total = gridDim.x * (kThreads / 32);
  const int ntiles = vpad / HEAD_TILE_ROWS, nchunks = kpad / HEAD_KQ;
  const float two_m15 = __int_as_float((127 - 15) << 23), four_u = __int_as_float((127 - 22) << 23);
  const float delta = __int_as_float((127 - 100) << 23);
  {
    const int tile = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
    if (tile < ntiles) {
      const int8_t* row = q + static_cast<size_t>(tile * HEAD_TILE_ROWS + g) * kpad + 128 * t;
      if (128 * t < kpad) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(row));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(row + static_cast<size_t>(8) * kpad));
      }
    }
  }
  w12::pdl_wait();
  float hn[NT][2], rh[NT][2], run[NT][2];
  const int8_t* hhi[NT];
  const int8_t* hlo[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int n = nt * 8 + 2 * t + j;
      hn[nt][j] = ws.hn[n];
      rh[nt][j] = ws.rh[n];
      run[nt][j] = -INFINITY;
    }
    hhi[nt] = ws.phi + static_cast<size_t>(nt * 8 + g) * kpad + 16 * t;
    hlo[nt] = ws.plo + static_cast<size_t>(nt * 8 + g) * kpad + 16 * t;
  }
  for (int tile = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5); tile < ntiles; tile += warps_total) {
    const int r0 = tile * HEAD_TILE_ROWS;
    const int8_t* qa = q + static_cast<size_t>(r0 + g) * kpad + 16 * t;
    const int8_t* qb = qa + static_cast<size_t>(8) * kpad;
    int ahi[NT][4], alo[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) ahi[nt][i] = alo[nt][i] = 0;
    int c = 0;
    for (; c + UNROLL <= nchunks; c += UNROLL) {
      int4 wa[UNROLL], wb[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {  // all weight loads of the group in flight before any mma
        wa[u] = ld_stream<L2_256B>(qa + (c + u) * HEAD_KQ);
        wb[u] = ld_stream<L2_256B>(qb + (c + u) * HEAD_KQ);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) chunk_mma<NT>(ahi, alo, wa[u], wb[u], hhi, hlo, (c + u) * HEAD_KQ);
    }
    for (; c < nchunks; ++c) {
      const int4 wa = ld_stream<L2_256B>(qa + c * HEAD_KQ), wb = ld_stream<L2_256B>(qb + c * HEAD_KQ);
      chunk_mma<NT>(ahi, alo, wa, wb, hhi, hlo, c * HEAD_KQ);
    }
    // Epilogue: accumulator i holds row g (i < 2) or g+8, column 2t + (i & 1) of each n-tile.
    const float4 pa = __ldg(rowp + r0 + g), pb = __ldg(rowp + r0 + g + 8);
    const bool va = r0 + g < v, vb = r0 + g + 8 < v;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float lo_col[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = i & 1, row = r0 + g + (i < 2 ? 0 : 8), n = nt * 8 + 2 * t + j;
        const float4 p = i < 2 ? pa : pb;
        const long long jj = static_cast<long long>(ahi[nt][i]) * 256 + alo[nt][i];  // exact integer
        const float chat = __fmul_rn(__fmul_rn(p.x, __ll2float_rn(jj)), two_m15);
        const float b = __fmaf_ru(hn[nt][j], p.y, __fmaf_ru(rh[nt][j], p.z, __fmaf_ru(four_u, fabsf(chat), delta)));
        const bool ok = i < 2 ? va : vb;
        const float up = ok ? __fadd_ru(chat, b) : -INFINITY;
        const float lw = ok ? __fsub_rd(chat, b) : -INFINITY;
        if (n < m) ws.upper[static_cast<size_t>(n) * vpad + row] = up;
        lo_col[j] = fmaxf(lo_col[j], lw);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float x = lo_col[j];
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
        // The warp's running maximum skips the atomic unless this tile improved on it.
        if (x > run[nt][j]) {
          run[nt][j] = x;
          const int n = nt * 8 + 2 * t + j;
          if (g == 0 && n < m) atomicMax(ws.lmax + n, head_enc(x));
        }
      }
    }
  }
  w12::pdl_launch_dependents();  // the rescore's CTAs may take this warp's slot and wait there
}

template <int NT, int UNROLL, bool L2_256B>
cudaError_t launch_screen_nt(const int8_t* q, const float4* rowp, int v, int vpad, int kpad, int m, const HeadWs& ws,
                             bool pdl, cudaStream_t st) {
  static int resident[64] = {0};  // blocks per SM x SMs, per device (queried once; no stream work)
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
  if (resident[dev] == 0) {
    int sms = 0, per_sm = 0;
    if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return err;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, head_screen_kernel<NT, UNROLL, L2_256B>, kThreads, 0);
    if (err != cudaSuccess) return err;
    resident[dev] = sms * (per_sm > 0 ? per_sm : 1);
  }
  const int ntiles = vpad / HEAD_TILE_ROWS;
  int blocks = (ntiles + kThreads / 32 - 1) / (kThreads / 32);
  if (blocks > resident[dev]) blocks = resident[dev];
  return head_launch(head_screen_kernel<NT, UNROLL, L2_256B>, dim3(blocks), kThreads, pdl, st, q, rowp, v, vpad, kpad,
                     m, ws);
}

}  // namespace

cudaError_t w12h_launch_prep(const void* h, int h_bf16, int m, long long ldh, int k, int kpad, const HeadWs& ws,
                             cudaStream_t st) {
  const int rows = (m + 7) / 8 * 8;  // the screen reads whole 8-row n-tiles: padded rows are zeroed
  head_prep_kernel<<<rows, kThreads, 0, st>>>(h, h_bf16, m, ldh, k, kpad, ws);
  return cudaGetLastError();
}

cudaError_t w12h_launch_screen(const int8_t* q, const float4* rowp, int v, int vpad, int kpad, int m,
                               const HeadWs& ws, int flags, bool pdl, cudaStream_t st) {
  const bool hint = (flags & HEAD_FLAG_L2_256B) != 0;
  switch ((m + 7) / 8) {
    case 1:
      return hint ? launch_screen_nt<1, 8, true>(q, rowp, v, vpad, kpad, m, ws, pdl, st)
                  : launch_screen_nt<1, 8, false>(q, rowp, v, vpad, kpad, m, ws, pdl, st);
    case 2:
      return hint ? launch_screen_nt<2, 8, true>(q, rowp, v, vpad, kpad, m, ws, pdl, st)
                  : launch_screen_nt<2, 8, false>(q, rowp, v, vpad, kpad, m, ws, pdl, st);
    case 3:
      return hint ? launch_screen_nt<3, 4, true>(q, rowp, v, vpad, kpad, m, ws, pdl, st)
                  : launch_screen_nt<3, 4, false>(q, rowp, v, vpad, kpad, m, ws, pdl, st);
    case 4:
      return hint ? launch_screen_nt<4, 4, true>(q, rowp, v, vpad, kpad, m, ws, pdl, st)
                  : launch_screen_nt<4, 4, false>(q, rowp, v, vpad, kpad, m, ws, pdl, st);
    default:
      return cudaErrorInvalidValue;
  }
}
