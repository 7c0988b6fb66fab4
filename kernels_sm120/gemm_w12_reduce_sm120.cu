// Split-K reduction of the W12 GEMMs on sm_90+ (v1's and v4's K slices), as its own kernel
// launched with programmatic dependent launch behind the GEMM: one CTA per (row tile, 8-token
// chunk) adds the slices' partials in add_slice's order (smxx_gemm_common.cuh: the order every
// path uses, so the bits do not depend on which path or M) and runs the epilogue. Everything that
// does not depend on the GEMM (row data, the escapes and the activations they multiply) is loaded
// before griddepcontrol.wait, so after it only the partials are a memory round trip.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gemm_w12_mma.cuh"
#include "smxx_gemm_common.cuh"
#include "smxx_gemm_epilogue.cuh"
#include "smxx_launch.cuh"
#include "smxx_pipe.cuh"
#include "smxx_w12_decode.cuh"

namespace w12 {
namespace {

// Escapes of one reduce CTA's 128 rows, staged in shared memory before griddepcontrol.wait: the
// true value of escape e (as float) and x[8j + 0..7][col_e] for the CTA's token chunk j. After the
// wait they are read at shared-memory latency; without staging, each escape past a row's first
// (and at > 8 tokens the first too) is a dependent esc_col -> x[col] round trip after the wait,
// which cost down [4096, 14336] (0.93 escapes per row) 4-10 us per reduce (session 11). Escapes
// past kStagedEscapes are read from global memory as before (same adds, same order).
constexpr int kStagedEscapes = 256;
struct StagedEscapes {
  float w[kStagedEscapes];
  float x[kStagedEscapes][8];
};

// Stages the CTA's first min(count, kStagedEscapes) escapes, all loads independent across
// threads, and returns the index of its first escape. x is complete before the GEMM started (the
// GEMM triggers this grid after its own wait), so this may run before this grid's wait.
__device__ __forceinline__ int stage_escapes(StagedEscapes& se, int rowtile, int j, int nthreads, const KParams& p) {
  const int r0 = min(rowtile * 128, p.N), r1 = min(rowtile * 128 + 128, p.N);
  const int eb = __ldg(p.esc_ptr + r0), n = min(__ldg(p.esc_ptr + r1) - eb, kStagedEscapes);
  for (int e = threadIdx.x; e < n; e += nthreads) {
    const int col = __ldg(p.esc_col + eb + e);
    se.w[e] = bf16_bits_to_float(static_cast<uint16_t>(__ldg(p.esc_val + eb + e)));
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int m = 8 * j + u;
      se.x[e][u] = m < p.M ? bf16_bits_to_float(p.x[(int64_t)m * p.ldx + col]) : 0.f;
    }
  }
  return eb;
}

// Escape e's weight and its activations for tokens m0 and (ok1) m0 + 1: from the staged table
// (eb: the CTA's first escape; x zero past M there) or, past kStagedEscapes, from global memory.
__device__ __forceinline__ void staged_escape(const StagedEscapes& se, int eb, int e, int t, int m0, bool ok1,
                                              const KParams& p, float& wv, float& xv0, float& xv1) {
  const int k = e - eb;
  if (k < kStagedEscapes) {
    const float2 xx = *reinterpret_cast<const float2*>(&se.x[k][2 * t]);
    wv = se.w[k], xv0 = xx.x, xv1 = xx.y;
  } else {
    const int col = __ldg(p.esc_col + e);
    wv = bf16_bits_to_float(static_cast<uint16_t>(__ldg(p.esc_val + e)));
    xv0 = bf16_bits_to_float(p.x[(int64_t)m0 * p.ldx + col]);
    xv1 = ok1 ? bf16_bits_to_float(p.x[(int64_t)(m0 + 1) * p.ldx + col]) : 0.f;
  }
}

// store_fragment with the escapes from the staged table (eb: the CTA's first escape): the same
// operations in the same order as fix_escapes (smxx_gemm_common.cuh), so the same bits.
template <int NCH, int MTW>
__device__ __forceinline__ void store_fragment_staged(const float (&v)[4], int nbase, int mtl, int j, const RowData& rd,
                                                      const StagedEscapes& se, int eb, const KParams& p) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int m0 = 8 * j + 2 * t;  // the thread's tokens m0, m0 + 1
  if (m0 >= p.M) return;
  const bool ok1 = m0 + 1 < p.M;
  // Per row, both tokens at once: each escape's value and activations read once for the two
  // (the per-output form walked every row's escapes twice from 2 tokens up; session 12).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 2 * mtl + h, n = nbase + g + 8 * h;
    if (n >= p.N) continue;
    float x0 = v[2 * h] * pick4(rd.scale, r), x1 = v[2 * h + 1] * pick4(rd.scale, r);
    const float slot = pick4(rd.scale, r) * 0x1p-15f;
    for (int e = pick4(rd.e0, r); e < pick4(rd.e1, r); ++e) {
      float wv, xv0, xv1;
      staged_escape(se, eb, e, t, m0, ok1, p, wv, xv0, xv1);
      escape_pair(x0, x1, wv, xv0, xv1, slot);
    }
    store_pair(x0, x1, rd, r, m0, ok1, n, p);
  }
}

// The staged escapes' adds of the thread's rows, prepared before griddepcontrol.wait (session 32,
// docs/perf-notes.md items 3-4: applied after the wait, each escape a shared-memory read and four
// dependent operations in a divergent loop per row, they held qkv's and o's reduce 0.35-0.45 us
// longer than a weight without escapes; reading them ahead behind per-escape branches measured
// slower, item 5). Per row its first kSlotEscapes escapes as the two exact products fix_escapes
// adds (w * x and slot * x) for the thread's two tokens, zero where the row has fewer; after the
// wait only a predicated add chain is left. The same products and adds in the same order.
// Session 33 (docs/perf-notes.md), same call, A/B: o -0.55 us and 32B [10240, 5120] -0.6 at 1-16
// tokens, but qkv +0.15..0.3 at 4-16 and at 33-128 tokens slower (down +2.6, o +1.7 us at 128).
// Taken by v4 at <= 32 tokens behind GEMM grids of <= 2 CTAs per SM (gemm_reduce_launch): the
// slot forms' 102-148 registers no longer fit beside three (qkv's 384 CTAs at 1-16 tokens) where
// the plain staged form's 72-108 do (held to 128 registers, they spilled and were slower still).
constexpr int kSlotEscapes = 2;
template <int MTW>
struct EscapeSlots {
  float w[MTW][2][kSlotEscapes][2], s[MTW][2][kSlotEscapes][2];  // [m-tile][h][escape][token]
};

// After stage_escapes and a barrier: every slot from the staged table (or, past kStagedEscapes,
// from global memory; x was complete before the GEMM started). staged_escape's reads are written
// out here: through it, ptxas scheduled the slot forms differently from the measured build.
template <int MTW>
__device__ __forceinline__ void fill_slots(EscapeSlots<MTW>& es, const RowData& rd, const StagedEscapes& se, int eb,
                                           int j, const KParams& p) {
  const int t = threadIdx.x & 3, m0 = 8 * j + 2 * t;
  const bool ok0 = m0 < p.M, ok1 = m0 + 1 < p.M;
#pragma unroll
  for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 2 * mt + h;
      const float slot = rd.scale[r] * 0x1p-15f;
#pragma unroll
      for (int e = 0; e < kSlotEscapes; ++e) {
        float wv = 0.f, x0 = 0.f, x1 = 0.f;
        const int ei = rd.e0[r] + e, k = ei - eb;
        if (ok0 && ei < rd.e1[r]) {
          if (k < kStagedEscapes) {
            const float2 xx = *reinterpret_cast<const float2*>(&se.x[k][2 * t]);  // zero past M
            wv = se.w[k], x0 = xx.x, x1 = xx.y;
          } else {
            const int col = __ldg(p.esc_col + ei);
            wv = bf16_bits_to_float(static_cast<uint16_t>(__ldg(p.esc_val + ei)));
            x0 = bf16_bits_to_float(p.x[(int64_t)m0 * p.ldx + col]);
            x1 = ok1 ? bf16_bits_to_float(p.x[(int64_t)(m0 + 1) * p.ldx + col]) : 0.f;
          }
        }
        es.w[mt][h][e][0] = __fmul_rn(wv, x0), es.w[mt][h][e][1] = __fmul_rn(wv, x1);
        es.s[mt][h][e][0] = __fmul_rn(slot, x0), es.s[mt][h][e][1] = __fmul_rn(slot, x1);
      }
    }
}

// store_fragment_staged with each row's first kSlotEscapes escapes from the slots (escape_pair's
// adds on its products), the rest, rare, from the staged table as there. Its own copy of that
// loop: one function for both (the slot adds passed in) changed the SASS of every staged form.
template <int NCH, int MTW>
__device__ __forceinline__ void store_fragment_slots(const float (&v)[4], int nbase, int mtl, int j, const RowData& rd,
                                                     const float (&ws)[2][kSlotEscapes][2],
                                                     const float (&ss)[2][kSlotEscapes][2], const StagedEscapes& se,
                                                     int eb, const KParams& p) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int m0 = 8 * j + 2 * t;
  if (m0 >= p.M) return;
  const bool ok1 = m0 + 1 < p.M;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 2 * mtl + h, n = nbase + g + 8 * h;
    if (n >= p.N) continue;
    float x0 = v[2 * h] * pick4(rd.scale, r), x1 = v[2 * h + 1] * pick4(rd.scale, r);
    const int e0 = pick4(rd.e0, r), e1 = pick4(rd.e1, r);
#pragma unroll
    for (int e = 0; e < kSlotEscapes; ++e)
      if (e0 + e < e1) {
        x0 = __fsub_rn(__fadd_rn(x0, ws[h][e][0]), ss[h][e][0]);
        x1 = __fsub_rn(__fadd_rn(x1, ws[h][e][1]), ss[h][e][1]);
      }
    const float slot = pick4(rd.scale, r) * 0x1p-15f;
    for (int e = e0 + kSlotEscapes; e < e1; ++e) {
      float wv, xv0, xv1;
      staged_escape(se, eb, e, t, m0, ok1, p, wv, xv0, xv1);
      escape_pair(x0, x1, wv, xv0, xv1, slot);
    }
    store_pair(x0, x1, rd, r, m0, ok1, n, p);
  }
}

// The cross-CTA reduction as its own kernel (sm_90+, every M unless diagnostic 65536 asks for the
// cluster path above 8 tokens): one CTA per (row tile, 8-token chunk) with the GEMM CTA's thread
// -> fragment map, launched with programmatic dependent launch behind the GEMM. Row data and the
// escapes' activations (STAGE: all staged escapes; else each row's first escape at <= 8 tokens)
// are loaded before griddepcontrol.wait (they do not depend on the GEMM); after it, the slices'
// partials are fetched 8 at a time (an even count: pairs never straddle two fetches) and summed in
// add_slice's order, the same adds as every other path, so the bits are the same. This takes the
// in-kernel chain (fence, ticket, 1-2 partial round trips, epilogue loads) or the cluster barriers
// off the critical tail, and lifts the
// cluster's limit of 8 slices. STAGE needs sizeof(StagedEscapes) of dynamic shared memory. B:
// slices fetched per batch (the loads in flight per thread), the smallest of 2, 4, 8 that covers
// S up to 8: the registers for 8 would hold an S = 2 grid (gate_up) to 4 CTAs per SM (and 4 at
// 65..128 tokens where 8 would not fit the grid at once; launch_reduce).
// MINB: the CTAs an SM must hold (registers capped to match); 6 for the one-wave form below.
// SLOTS (with STAGE): the staged escapes through EscapeSlots.
template <int NCH, int MTW, bool STAGE, int B, int MINB = 1, bool SLOTS = false>
__global__ void __launch_bounds__(256 / MTW, MINB) gemm_w12_reduce_kernel(const KParams p) {
  constexpr int kT = 256 / MTW, kFrag = MTW * NCH;
  extern __shared__ __align__(16) uint8_t rsmem[];
  StagedEscapes& se = *reinterpret_cast<StagedEscapes*>(rsmem);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rowq = MTW == 2 ? warp : warp >> 1, mt0 = MTW == 2 ? 0 : warp & 1;
  const int rowtile = blockIdx.x, j = blockIdx.y;  // token chunk j: tokens 8j .. 8j+7
  const int nbase = rowtile * 128 + rowq * 32 + mt0 * 16;
  // Lanes whose two tokens are both past M skip their partials: at M <= 4 that is every other
  // 32-byte sector of the tile (their outputs are never written).
  const bool live = 8 * j + 2 * t < p.M;
  RowData rd;
  load_row_data<MTW, !STAGE>(rd, nbase, g, p);
  int eb = 0;
  constexpr bool kSlots = STAGE && SLOTS;
  EscapeSlots<MTW> es;
  if constexpr (STAGE) eb = stage_escapes(se, rowtile, j, kT, p);
  else if (NCH == 1) load_escape_x<MTW>(rd, t, p);  // x was complete before the GEMM started
  if constexpr (kSlots) {
    __syncthreads();  // the staged escapes are complete
    fill_slots<MTW>(es, rd, se, eb, j, p);
  }
  pdl_wait();
  // Only now may the next GEMM start (it prefetches its first records into L2 and waits for this
  // grid). Triggering at kernel start launched it while this GEMM was still streaming, and its
  // prefetched lines were evicted again before use (measured: o 13.0 -> 14.7 us at M = 1).
  pdl_launch_dependents();
  const float4* tile = p.ws + (size_t)rowtile * p.S * (kFrag * kT) + tid;
  // Read once: evict_first (v4 parks them evict_last, so that they wait in L2 for this kernel).
  const uint64_t once = l2_policy_evict_first();
  // The slices in add_slice's order, spelled out with B even so that a pair never straddles two
  // fetches: q = p_s (+ p_{s+1} where slice s+1 exists), acc = q, then acc + q. kPairsParked: the
  // GEMM parked one partial per pair, already added, so those are added left to right. (Through
  // add_slice's per-element branches the kernel took ~0.5 us longer at M = 1 on qkv and o.)
  const bool pairs_parked = (p.flags & kPairsParked) != 0;
  float acc[MTW][4];
#pragma unroll 1
  for (int s0 = 0; s0 < p.S; s0 += B) {
    float4 v[B][MTW];
#pragma unroll
    for (int s = 0; s < B; ++s)
#pragma unroll
      for (int mt = 0; mt < MTW; ++mt)
        v[s][mt] = (live && s0 + s < p.S) ? ld_cg_policy(tile + (size_t)(s0 + s) * (kFrag * kT) + (mt * NCH + j) * kT, once)
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
    auto fold = [&](float (&a)[4], const float4& q4, bool first) {
      const float q[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = first ? q[i] : __fadd_rn(a[i], q[i]);
    };
    if (pairs_parked) {
#pragma unroll
      for (int s = 0; s < B; ++s)
#pragma unroll
        for (int mt = 0; mt < MTW; ++mt)
          if (s0 + s < p.S) fold(acc[mt], v[s][mt], s0 + s == 0);
    } else {
#pragma unroll
      for (int s = 0; s < B; s += 2)
#pragma unroll
        for (int mt = 0; mt < MTW; ++mt)
          if (s0 + s < p.S) {
            const float4 a = v[s][mt], b = v[s + 1][mt];
            const bool two = s0 + s + 1 < p.S;
            const float4 q =
                two ? make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w)) : a;
            fold(acc[mt], q, s0 + s == 0);
          }
    }
  }
  if constexpr (kSlots) {
#pragma unroll
    for (int mt = 0; mt < MTW; ++mt)
      store_fragment_slots<NCH, MTW>(acc[mt], nbase + 16 * mt, mt, j, rd, es.w[mt], es.s[mt], se, eb, p);
  } else if constexpr (STAGE) {
    __syncthreads();  // the staged escapes are complete
#pragma unroll
    for (int mt = 0; mt < MTW; ++mt) store_fragment_staged<NCH, MTW>(acc[mt], nbase + 16 * mt, mt, j, rd, se, eb, p);
  } else {
#pragma unroll
    for (int mt = 0; mt < MTW; ++mt) store_fragment<NCH, MTW>(acc[mt], nbase + 16 * mt, mt, j, rd, p);
  }
}

// CTAs of `kern` (launched with `smem` bytes of dynamic shared memory) an SM holds, per device.
template <auto kern>
cudaError_t resident_ctas(int dev, int threads, int smem, int& n) {
  static int cache[64] = {0};
  if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
  if (cache[dev] == 0) {
    int v = 0;
    const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kern, threads, smem);
    if (e != cudaSuccess) return e;
    cache[dev] = v > 0 ? v : 1;
  }
  n = cache[dev];
  return cudaSuccess;
}

// Staging pays where the reduce grid is one wave: its CTAs are placed while the GEMM runs and the
// staging hides behind it. In a grid of several waves the later CTAs are placed after the GEMM has
// finished and the staging chain (esc_ptr -> esc_col -> x) is exposed once per wave: session 11
// measured gate_up [28672, 4096] at 64 tokens (224 x 8 = 1792 CTAs, 4 per SM) 72.0 -> 75.5 us
// with it, against down at 64 tokens (256 CTAs) 38.4 -> 34.3.
// Whether a grid of `ctas` CTAs of `kern` (threads, smem) fits on the device at once.
template <auto kern>
cudaError_t fits_at_once(long ctas, int threads, int smem, bool& fits) {
  DevInfo di;
  int dev = 0, per_sm = 0;
  if (cudaError_t e = dev_info(di, dev); e != cudaSuccess) return e;
  if (cudaError_t e = resident_ctas<kern>(dev, threads, smem, per_sm); e != cudaSuccess) return e;
  fits = ctas <= (long)per_sm * di.sms;
  return cudaSuccess;
}

template <int NCH, int MTW, int B, int MINB = 1, bool SLOTS = false>
cudaError_t launch_reduce_b(const KParams& p, int tiles, cudaStream_t stream) {
  constexpr auto staged = gemm_w12_reduce_kernel<NCH, MTW, true, B, MINB, SLOTS>;
  constexpr int threads = 256 / MTW, smem = sizeof(StagedEscapes);
  // The reduce grid's y extent: the chunks the GEMM parked (chunks_parked). A chunk of padding
  // tokens only (M = 65: 7 of 16) would be a CTA that stores nothing (session 47).
  const int chunks = chunks_parked(NCH, p.M, p.flags);
  bool fits = false;
  if (cudaError_t e = fits_at_once<staged>((long)tiles * chunks, threads, smem, fits); e != cudaSuccess) return e;
  if (fits) return launch_ex(staged, dim3(tiles, chunks), dim3(threads), smem, stream, 1, true, p);
  return launch_ex(gemm_w12_reduce_kernel<NCH, MTW, false, B, MINB>, dim3(tiles, chunks), dim3(threads), 0, stream, 1,
                   true, p);
}

template <int NCH, int MTW>
cudaError_t launch_reduce(const KParams& p, int tiles, cudaStream_t stream, bool slots) {
  // Slot forms for v4's 4-warp map at <= 32 tokens only (EscapeSlots).
  if constexpr (NCH <= 4 && MTW == 2) {
    if (slots) {
      if (p.S <= 2) return launch_reduce_b<NCH, MTW, 2, 1, true>(p, tiles, stream);
      if (p.S <= 4) return launch_reduce_b<NCH, MTW, 4, 1, true>(p, tiles, stream);
      return launch_reduce_b<NCH, MTW, kMaxClusterSplits, 1, true>(p, tiles, stream);
    }
  }
  if (p.S <= 2) return launch_reduce_b<NCH, MTW, 2>(p, tiles, stream);
  if (p.S <= 4) return launch_reduce_b<NCH, MTW, 4>(p, tiles, stream);
  if constexpr (NCH == 16) {
    // 65..128 tokens on many row tiles (qkv [6144, 4096]: 48 x 16 = 768 CTAs): the 8-slice form
    // (119 registers) holds 4 CTAs per SM, so the grid ran in two batches, the second placed only
    // as the first finished (session 28, docs/perf-notes.md: released at 26 and ~30.5 us of a
    // 33.5 us launch). Where it would not fit at once, slices four at a time at 6 CTAs per SM: two
    // round trips per CTA, one batch. The same adds in the same order (B only cuts the fetches).
    constexpr auto plain8 = gemm_w12_reduce_kernel<NCH, MTW, false, kMaxClusterSplits>;
    bool fits = false;
    const long ctas = (long)tiles * chunks_parked(NCH, p.M, p.flags);
    if (cudaError_t e = fits_at_once<plain8>(ctas, 256 / MTW, 0, fits); e != cudaSuccess) return e;
    if (!fits) return launch_reduce_b<NCH, MTW, 4, 6>(p, tiles, stream);
  }
  return launch_reduce_b<NCH, MTW, kMaxClusterSplits>(p, tiles, stream);
}

}  // namespace

// The reduce kernel runs with the GEMM's CTA shape (kWide): each thread reads the partials the
// same-numbered GEMM thread parked.
cudaError_t launch_reduce_for(const KParams& p, int tiles, int tokens, cudaStream_t stream, bool slots) {
  const bool wide = (p.flags & kWide) != 0;
  if (tokens <= 8) return wide ? launch_reduce<1, 1>(p, tiles, stream, slots) : launch_reduce<1, 2>(p, tiles, stream, slots);
  if (tokens <= 16) return wide ? launch_reduce<2, 1>(p, tiles, stream, slots) : launch_reduce<2, 2>(p, tiles, stream, slots);
  if (tokens <= 32) return wide ? launch_reduce<4, 1>(p, tiles, stream, slots) : launch_reduce<4, 2>(p, tiles, stream, slots);
  if (tokens <= 64) return wide ? launch_reduce<8, 1>(p, tiles, stream, slots) : launch_reduce<8, 2>(p, tiles, stream, slots);
  // 65..128 tokens in one pass: v4 only (4-warp partial map; v1 never launches more than 64).
  return wide ? cudaErrorInvalidValue : launch_reduce<16, 2>(p, tiles, stream, slots);
}

cudaError_t gemm_reduce_launch(const GemmArgs& a, int m0, int tokens, int S, cudaStream_t stream, bool pairs_parked,
                               bool slots) {
  KParams p{};
  set_split_pass(p, a, m0, tokens, S);
  p.ws = static_cast<float4*>(a.workspace);
  // v4 parks partials in the 4-warp map: no kWide here, whatever diagnostics a.flags carries.
  p.flags = (a.flags & ~(kReduceKernel | kPdl | kWide | kPairsParked)) | kReduceKernel | kPdl |
            (pairs_parked ? kPairsParked : 0);
  return launch_reduce_for(p, (a.N + 127) / 128, tokens, stream, slots);
}

}  // namespace w12
