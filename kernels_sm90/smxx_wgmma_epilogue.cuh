// The epilogues of v4's unsplit grids (gemm_w12_wgmma_sm90.cu): per-row escapes in registers up to
// 32 tokens (store_rows, its stores through a small tile per warp), through shared memory with the whole CTA applying the escapes at 33-128
// tokens (store_rows_smem), and the XT helpers that transpose x for the latter. Split grids park
// partials instead and v1's reduce kernel runs their epilogue (gemm_w12_reduce_sm120.cu).
// In an anonymous namespace like smxx_wgmma.cuh, for the same reason: each translation unit keeps
// its own copy and the kernels' symbols keep their names.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "gemm_w12_mma.cuh"
#include "smxx_gemm_common.cuh"
#include "smxx_wgmma.cuh"

namespace w12 {
namespace {

constexpr int kThreads = 128;  // one warpgroup: v4's CTAs are 1, 2 or 4 of them

// One escape (true value wv; xv(j, u): its activation at token 8j + 2t + u) of row h of m-tile mt,
// applied to each of its tokens < M as fix_escapes does.
template <int NCH, int MTW, typename X>
__device__ __forceinline__ void escape_row_with(float (&a)[MTW][4 * NCH], int mt, int h, int t, const X& xv, float wv,
                                                float slot, int M) {
#pragma unroll
  for (int j = 0; j < NCH; ++j)
#pragma unroll
    for (int u = 0; u < 2; ++u)
      if (8 * j + 2 * t + u < M) {
        const float x = xv(j, u);
        float& y = a[mt][4 * j + 2 * h + u];
        y = __fadd_rn(y, __fmul_rn(wv, x));
        y = __fsub_rn(y, __fmul_rn(slot, x));
      }
}

// The same for the escape at column col, each activation loaded where it is used.
template <int NCH, int MTW>
__device__ __forceinline__ void escape_row(float (&a)[MTW][4 * NCH], int mt, int h, int t, int col, float wv, float slot,
                                           const WParams& p) {
  auto xv = [&](int j, int u) { return bf16_bits_to_float(p.x[(int64_t)(8 * j + 2 * t + u) * p.ldx + col]); };
  escape_row_with<NCH, MTW>(a, mt, h, t, xv, wv, slot, p.M);
}

// Bytes of store_rows' output tile per warp (16 * MTW rows + 4 of padding, 8 * NCH tokens, BF16).
constexpr int store_rows_tile_bytes(int nch, int mtw) { return 8 * nch * (16 * mtw + 4) * 2; }

// The epilogue of unsplit grids (S = 1) for the thread's 2 * MTW rows (rows nbase + 16 (mt0 + r / 2)
// + g + 8 (r % 2); tokens 8j + 2t (+1) of chunk j): each row's data and escapes
// once for all its tokens. The rows' data first (one round trip), then their first escapes (one
// more), then the rare further escapes, the stores last, 8 bytes wide through a tile per warp in
// shared memory (smem: the ring, whose record slot 0 is free by then). The kernel takes it up to 32 tokens and
// store_rows_smem (below) at 64 and 128, where this one spills the accumulators even one row at a
// time. The per-output form (diagnostic 2) reloads the row data and walks the escape chain per
// token, each output behind the previous one's store (session 12, docs/perf-notes.md). Per output
// the same operations in the same order as fix_escapes, so the same bits.
template <int NCH, int MTW>
__device__ __forceinline__ void store_rows(float (&a)[MTW][4 * NCH], int nbase, int mt0, int g, int t, uint8_t* smem,
                                           const WParams& p) {
  constexpr int R = 2 * MTW;
  int rn[R], re0[R], re1[R], rc[R];
  float rsc[R], rb[R], rw[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    rn[r] = nbase + 16 * (mt0 + (r >> 1)) + g + 8 * (r & 1);
    const bool ok = rn[r] < p.N;
    rsc[r] = ok ? row_scale(__ldg(p.base + rn[r])) : 0.f;
    re0[r] = ok ? __ldg(p.esc_ptr + rn[r]) : 0;
    re1[r] = ok ? __ldg(p.esc_ptr + rn[r] + 1) : 0;
    rb[r] = (ok && p.bias) ? __ldg(p.bias + rn[r]) : 0.f;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const bool has = re0[r] < re1[r];
    rc[r] = has ? __ldg(p.esc_col + re0[r]) : 0;
    rw[r] = has ? bf16_bits_to_float(static_cast<uint16_t>(__ldg(p.esc_val + re0[r]))) : 0.f;
  }
  // Up to 16 tokens every row's first-escape activations are loaded before any is applied:
  // behind a per-row branch each row's loads waited for the previous row's adds, one L2 round
  // trip per row with an escape (session 32, docs/perf-notes.md: gate_up [28672, 4096] -0.3..0.6
  // us at 1-16 tokens, the multi-wave grids level within noise). At 17-32 tokens (16 registers
  // more) it measured slower (gate_up +0.7, lm_head +1.2 us), so there each row loads its own.
  constexpr bool kAhead = NCH <= 2;
  float rx[R][NCH][2];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < NCH; ++j)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int m = 8 * j + 2 * t + u;
        if constexpr (kAhead)
          rx[r][j][u] = re0[r] < re1[r] && m < p.M ? bf16_bits_to_float(p.x[(int64_t)m * p.ldx + rc[r]]) : 0.f;
      }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int mt = r >> 1, h = r & 1;
    const float slot = rsc[r] * 0x1p-15f;
#pragma unroll
    for (int j = 0; j < NCH; ++j)
#pragma unroll
      for (int u = 0; u < 2; ++u) a[mt][4 * j + 2 * h + u] = a[mt][4 * j + 2 * h + u] * rsc[r];
    if (re0[r] < re1[r]) {
      if constexpr (kAhead) {
        const auto& xr = rx[r];  // the preloaded activations
        escape_row_with<NCH, MTW>(a, mt, h, t, [&](int j, int u) { return xr[j][u]; }, rw[r], slot, p.M);
      } else {
        escape_row<NCH, MTW>(a, mt, h, t, rc[r], rw[r], slot, p);
      }
      for (int e = re0[r] + 1; e < re1[r]; ++e)
        escape_row<NCH, MTW>(a, mt, h, t, __ldg(p.esc_col + e),
                             bf16_bits_to_float(static_cast<uint16_t>(__ldg(p.esc_val + e))), slot, p);
    }
  }
  // The stores (session 29, docs/perf-notes.md): a lane holds rows g and g + 8 of two tokens, so
  // its own 2-byte stores put four half sectors in each warp instruction (lm_head's stores cost
  // 4.6 us of 187 at 16 tokens that way; this form took ~1 us of it off). Instead the warp's BF16 outputs go through a tile of its own, [token][row], in
  // record slot 0 (every record was decoded before the loop's last barrier; the activation tiles
  // that wgmma may still read lie elsewhere), and each lane stores 4 rows of one token (8 bytes),
  // a warp instruction 8 whole sectors. The same values, so the same bits.
  constexpr int RW = 16 * MTW, T = 8 * NCH, RWP = RW + 4;  // + 4: the write pass's lanes spread over banks
  static_assert(T * RWP * 2 == store_rows_tile_bytes(NCH, MTW), "the tile's size as the kernel checks it");
  uint16_t* tile = reinterpret_cast<uint16_t*>(smem) + (threadIdx.x >> 5) * (T * RWP);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int mt = r >> 1, h = r & 1;
#pragma unroll
    for (int j = 0; j < NCH; ++j)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        float y = a[mt][4 * j + 2 * h + u];
        if (p.bias) y = __fadd_rn(y, rb[r]);
        tile[(8 * j + 2 * t + u) * RWP + 16 * mt + g + 8 * h] = __bfloat16_as_ushort(__float2bfloat16_rn(y));
      }
  }
  __syncwarp();
  const int lane = threadIdx.x & 31, n0 = nbase + 16 * mt0;  // the warp's first row
  // 8-byte stores need y and ldy 8-byte aligned (a column slice of a wider y may not be).
  const bool wide = ((reinterpret_cast<uintptr_t>(p.y) | (static_cast<uintptr_t>(p.ldy) << 1)) & 7) == 0;
#pragma unroll
  for (int k = 0; k < (RW / 4) * T / 32; ++k) {
    const int it = lane + 32 * k, q = it % (RW / 4), m = it / (RW / 4), n = n0 + 4 * q;
    if (m < p.M && n < p.N) {
      const uint2 v = *reinterpret_cast<const uint2*>(tile + m * RWP + 4 * q);
      uint16_t* yp = p.y + (int64_t)m * p.ldy + n;
      if (wide && n + 3 < p.N) {
        *reinterpret_cast<uint2*>(yp) = v;
      } else {
        const uint16_t e[4] = {static_cast<uint16_t>(v.x), static_cast<uint16_t>(v.x >> 16), static_cast<uint16_t>(v.y),
                               static_cast<uint16_t>(v.y >> 16)};
        for (int i = 0; i < 4 && n + i < p.N; ++i) yp[i] = e[i];
      }
    }
  }
}

// The escape lists of store_rows_smem, after the rows' sums: per row with listed escapes {row, first
// listed escape, count, slot}, then the listed escapes {column, value}.
struct EscRow {
  int rl, first, count;
  float slot;
};
// XT (session 25, docs/perf-notes.md): at 33-128 tokens on unsplit grids the epilogue's escapes read
// x transposed, x^T[c][m] at c * 128 + m, so that a warp's 32 tokens of one column are 64
// contiguous bytes instead of 32 rows' sectors. Scratch: the stream's XT buffer (zero between
// launches, w12_gemm_xt_buffer), two counts in its first ints and x^T from byte kXtHeader on. The
// grid's first p.xth CTAs are helpers: after their wait for the previous kernel they transpose
// x's 64-column blocks (helper h: blocks h, h + xth, ...), count them (cnt[0]) and exit; an
// epilogue reads x^T only if every block is counted and x otherwise (the same values), so no CTA
// ever waits for another; the last row-tile CTA past its epilogue (cnt[1]) zeroes both counts for
// the next launch (this relies on every block being counted before the last epilogue ends: the
// transposes start first and take microseconds, the grid tens to hundreds). SK's persistent lanes
// run no helpers: their producer warpgroups' idle warps transpose x instead (xt_blocks_spare),
// from the lane's start. (A transpose kernel before the GEMM cost ~2 us: the GEMM waited at its
// start for a copy it needs only at its end. Session 26: the first row-tile CTAs transposing a
// block each before their main loop held ~4 % of gate_up's samples at 128 tokens and made it
// 1.8 us slower at 48; helpers run on SMs the row tiles leave idle where the grid is one wave.)
constexpr int kXtBlocksPerHelper = 4;
constexpr int kXtBatch = 8;  // items per thread loaded before any of their stores
__device__ __forceinline__ uint16_t* xt_of(void* scratch) {
  return reinterpret_cast<uint16_t*>(static_cast<uint8_t*>(scratch) + kXtHeader);
}
// One item of x^T: token m's columns c..c+7 (one 16-byte load of x, v) as eight two-byte stores, each
// 64 contiguous bytes across a warp of consecutive tokens.
__device__ __forceinline__ void xt_store8(uint16_t* xt, int c, int m, uint4 v) {
  uint16_t* d = xt + (size_t)c * kWgmmaMaxTokens + m;
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    d[(2 * i) * kWgmmaMaxTokens] = static_cast<uint16_t>(w[i] & 0xffffu);
    d[(2 * i + 1) * kWgmmaMaxTokens] = static_cast<uint16_t>(w[i] >> 16);
  }
}
// Helper blockIdx.x of `helpers`: x's 64-column blocks blockIdx.x, + helpers, ... as items (block,
// chunk of 8 columns, token m), consecutive lanes on consecutive tokens so that each of an item's
// 8 two-byte stores is 64 contiguous bytes per warp; kXtBatch items' loads in flight per thread
// (a load round trip per block cost a helper of 8 blocks ~10 us in session 26's call 7); one fence,
// barrier and count for all of the helper's blocks.
__device__ __noinline__ void xt_blocks(const uint16_t* x, int64_t ldx, int M, int KT, void* scratch, int helpers) {
  constexpr int kPerBlock = 8 * kWgmmaMaxTokens;
  int* cnt = static_cast<int*>(scratch);
  uint16_t* xt = xt_of(scratch);
  const int nblk = blockIdx.x < KT ? (KT - 1 - (int)blockIdx.x) / helpers + 1 : 0;
  const int items = nblk * kPerBlock, step = blockDim.x;
  for (int i0 = threadIdx.x; i0 < items; i0 += kXtBatch * step) {
    uint4 v[kXtBatch];
#pragma unroll
    for (int j = 0; j < kXtBatch; ++j) {
      const int it = i0 + j * step, r = it % kPerBlock, m = r % kWgmmaMaxTokens;
      const int c = (blockIdx.x + (it / kPerBlock) * helpers) * 64 + (r / kWgmmaMaxTokens) * 8;
      v[j] = it < items && m < M ? __ldg(reinterpret_cast<const uint4*>(x + (int64_t)m * ldx + c)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kXtBatch; ++j) {
      const int it = i0 + j * step, r = it % kPerBlock, m = r % kWgmmaMaxTokens;
      const int c = (blockIdx.x + (it / kPerBlock) * helpers) * 64 + (r / kWgmmaMaxTokens) * 8;
      if (it < items && m < M) xt_store8(xt, c, m, v[j]);
    }
  }
  __threadfence();  // this thread's stores visible GPU-wide before the blocks are counted
  __syncthreads();
  if (threadIdx.x == 0 && nblk > 0) atomicAdd(cnt, nblk);
}

// XT by a CTA's spare threads instead of helper CTAs (SK's persistent lanes, gemm_w12_nobar_sm90.cu:
// helper CTAs would hold SMs that lanes need at the start, and those lanes would start 8-38 us
// late): threads t of nthr (the producer warpgroup's idle warps, 24 registers each) transpose x's
// 64-column blocks b0, b0 + step, ... one 8-column item at a time, then, after a barrier among
// them (named barrier `bar`), the first one counts the blocks. Same x^T as xt_blocks.
__device__ __noinline__ void xt_blocks_spare(const uint16_t* x, int64_t ldx, int M, int KT, void* scratch, int b0,
                                             int step, int t, int nthr, int bar) {
  constexpr int kPerBlock = 8 * kWgmmaMaxTokens;
  uint16_t* xt = xt_of(scratch);
  int nblk = 0;
  for (int b = b0; b < KT; b += step, ++nblk)
    for (int r = t; r < kPerBlock; r += nthr) {
      const int m = r % kWgmmaMaxTokens, c = b * 64 + (r / kWgmmaMaxTokens) * 8;
      if (m >= M) continue;
      xt_store8(xt, c, m, __ldg(reinterpret_cast<const uint4*>(x + (int64_t)m * ldx + c)));
    }
  __threadfence();  // this thread's stores visible GPU-wide before the blocks are counted
  asm volatile("bar.sync %0, %1;" ::"r"(bar), "r"(nthr) : "memory");
  if (t == 0 && nblk > 0) atomicAdd(static_cast<int*>(scratch), nblk);
}

constexpr int kEscListed = 512;  // escapes listed per CTA (the rest: each row's own threads)
// store_rows_smem's shared memory: the CTA's rows x tokens FP32 sums (yidx's order), at
// esc_rows_offset the listed rows (32 slots per warp of listing threads), then the listed escapes,
// at esc_count_offset those warps' counts.
constexpr int esc_rows_offset(int nch, int rt) { return 128 * rt * 8 * nch * 4; }
constexpr int esc_count_offset(int nch, int rt) {
  return esc_rows_offset(nch, rt) + 128 * rt * (int)sizeof(EscRow) + kEscListed * 8;
}
constexpr int epilogue_smem_bytes(int nch, int rt) { return esc_count_offset(nch, rt) + 4 * rt * 4; }

// Where row r's sum for token m sits among the CTA's sums (T tokens a row, T a multiple of 32):
// the row's 4-token chunks in an order swizzled by r, so that the sums' 8-byte stores (8 rows x 4
// token pairs a warp), the store pass's 16-byte loads (8 consecutive rows a quarter warp) and the
// escape pass's 32 tokens of one row each take the fewest wavefronts (no bank twice in one).
// (Session 27: rows padded to T + 1 floats made the sums' 4-byte stores 4-way conflicts.)
template <int T>
__device__ __forceinline__ int yidx(int r, int m) {
  static_assert(T % 32 == 0, "the swizzle permutes 4-token chunks within 32 tokens");
  const int f = ((r & 3) << 1) | ((r >> 2) & 1);
  return r * T + ((((m >> 2) ^ f) << 2) | (m & 3));
}

// Row rl's BF16 outputs for tokens mlo..mhi-1 (mlo a multiple of 4) from its sums in yidx's order
// (f: the row's swizzle, 4 x the chunks' XOR), through yp = y + mlo * ldy + the row: 16 tokens at a
// time without per-token tests, the bias added only where there is one (adding 0 would turn -0 into
// +0). (Session 27: with a test per token and the bias pointer tested per token, the same pass took
// ~4 us per CTA at 128 tokens before any store, against ~1.5 us straight.)
template <int T, bool BIAS>
__device__ __forceinline__ void store_row_swz(const float* Y, int rl, int f, int mlo, int mhi, float b, uint16_t* yp,
                                              int64_t ldy) {
  int m0 = mlo;
  for (; m0 + 16 <= mhi; m0 += 16, yp += 16 * ldy) {
    float4 v[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = *reinterpret_cast<const float4*>(Y + rl * T + ((m0 + 4 * c) ^ f));
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float w[4] = {v[c].x, v[c].y, v[c].z, v[c].w};
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float yv = BIAS ? __fadd_rn(w[u], b) : w[u];
        yp[(4 * c + u) * ldy] = __bfloat16_as_ushort(__float2bfloat16_rn(yv));
      }
    }
  }
  for (; m0 < mhi; ++m0, yp += ldy) {
    const float yv = BIAS ? __fadd_rn(Y[yidx<T>(rl, m0)], b) : Y[yidx<T>(rl, m0)];
    *yp = __bfloat16_as_ushort(__float2bfloat16_rn(yv));
  }
}

// The epilogue of unsplit grids at 64 and 128 tokens (store_rows spills there): the accumulators
// go to shared memory, scaled by their rows' scales (the ring is free once every warp is past the
// main loop); each thread takes one row (or half of one row's tokens) and lists the row's escapes;
// then the whole CTA applies the listed escapes, a row per warp and its tokens across the lanes;
// then each thread adds its row's bias and stores. Consecutive lanes hold consecutive rows, so the
// BF16 stores of one token are contiguous.
// Why the escapes go to the whole CTA (session 24, docs/perf-notes.md): each needs x[m][col] of every
// token, one L2 sector each; walked by the row's own thread, four loads per round trip, the CTA
// waited for its rows with the most escapes, and skipping escapes altogether (a wrong-output probe)
// took gate_up from 81 to 62.6 us and lm_head from 338 to 279 at 128 tokens.
// The thread's row data are loaded by the inlined part (issued with the rows' scales, after the
// first barrier in the SASS), and the listing needs no shared counter (session 27: three barriers,
// not four). The store pass is straight code (store_row_swz: ~2.4 us less per CTA at 128 tokens).
// Per output the same operations in the same order as fix_escapes (scale, each escape in list
// order, bias), so the same bits. Must be reached by every thread of the CTA (three barriers), or
// by its first BAR threads where BAR > 0 (epilogue_sync).
// row0: the CTA's first row.
template <int NCH, int WG, int BAR>
__device__ __noinline__ void rows_epilogue(uint8_t* smem, int row0, int M, int N, const uint16_t* x, int64_t ldx,
                                           const int32_t* esc_col, const int16_t* esc_val, const float* bias,
                                           uint16_t* y, int64_t ldy, void* scratch, int KT, int ctas, int e0,
                                           int e1, int cta_e0, float sc, float b);
// The epilogue's barriers: the whole CTA (BAR = 0), or its first BAR threads where the CTA has
// more (NB's producer warpgroup, gemm_w12_nobar_sm90.cu, has left by then).
template <int BAR>
__device__ __forceinline__ void epilogue_sync() {
  if constexpr (BAR == 0)
    __syncthreads();
  else
    asm volatile("bar.sync 1, %0;" ::"n"(BAR) : "memory");
}
template <int NCH, int MTW, int WG, int BAR = 0>
__device__ __forceinline__ void store_rows_smem(const float (&a)[MTW][4 * NCH], uint8_t* smem, int row0,
                                                const WParams& p) {
  constexpr int RT = WG == 4 ? 2 : 1, R = 128 * RT, T = 8 * NCH, PER_ROW = kThreads * WG / R;
  float* Y = reinterpret_cast<float*>(smem);
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int quarter = (tid >> 5) & 3, mt0 = WG == 1 ? 0 : (tid >> 7) & 1, rtl = WG == 4 ? tid >> 8 : 0;
  // The rows' scales multiply the sums on their way to shared memory (the same FMUL per output as
  // a pass over the rows afterwards; session 25: that pass read and wrote every sum once more).
  float sc[MTW][2];
#pragma unroll
  for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = row0 + rtl * 128 + quarter * 32 + 16 * (mt0 + mt) + g + 8 * h;
      sc[mt][h] = n < p.N ? row_scale(__ldg(p.base + n)) : 0.f;
    }
  // The data of the row this thread lists and stores (row tid % R, tokens mlo.. of it).
  const int n = row0 + tid % R, mlo = (tid / R) * (T / PER_ROW);
  const bool mine = n < p.N && mlo < p.M;
  const int cta_e0 = __ldg(p.esc_ptr + row0);
  const int e0 = mine ? __ldg(p.esc_ptr + n) : 0, e1 = mine ? __ldg(p.esc_ptr + n + 1) : 0;
  const float rsc = mine ? row_scale(__ldg(p.base + n)) : 0.f, b = mine && p.bias ? __ldg(p.bias + n) : 0.f;
  epilogue_sync<BAR>();  // every warp is past the main loop (its wgmma retired, its copies landed)
#pragma unroll
  for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
    for (int j = 0; j < NCH; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rl = rtl * 128 + quarter * 32 + 16 * (mt0 + mt) + g + 8 * h;
        *reinterpret_cast<float2*>(Y + yidx<T>(rl, 8 * j + 2 * t)) =
            make_float2(a[mt][4 * j + 2 * h] * sc[mt][h], a[mt][4 * j + 2 * h + 1] * sc[mt][h]);
      }
  rows_epilogue<NCH, WG, BAR>(smem, row0, p.M, p.N, p.x, p.ldx, p.esc_col, p.esc_val, p.bias, p.y, p.ldy,
                              p.S == 1 ? static_cast<void*>(p.ws) : nullptr, p.KT, p.epis ? p.epis : (int)gridDim.x - p.xth, e0, e1,
                              cta_e0, rsc, b);
}

// store_rows_smem's part after the rows' sums are stored. Not inlined, so that its registers do not
// change the main loop's allocation (inlined, the 64-token loop grew from 148 to 172 instructions).
template <int NCH, int WG, int BAR>
__device__ __noinline__ void rows_epilogue(uint8_t* smem, int row0, int M, int N, const uint16_t* x, int64_t ldx,
                                           const int32_t* esc_col, const int16_t* esc_val, const float* bias,
                                           uint16_t* y, int64_t ldy, void* scratch, int KT, int ctas, int e0,
                                           int e1, int cta_e0, float sc, float b) {
  constexpr int RT = WG == 4 ? 2 : 1, R = 128 * RT, T = 8 * NCH, NTH = 128 * WG;
  constexpr int PER_ROW = NTH / R;  // threads per row: 1 (WG = 1) or 2
  constexpr int NS = R / 32;        // warps of listing threads (the rows' first threads)
  float* Y = reinterpret_cast<float*>(smem);
  EscRow* erows = reinterpret_cast<EscRow*>(smem + esc_rows_offset(NCH, RT));
  uint2* escs = reinterpret_cast<uint2*>(erows + R);
  int* wcnt = reinterpret_cast<int*>(smem + esc_count_offset(NCH, RT));
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rl = tid % R, n = row0 + rl;
  const int mlo = (tid / R) * (T / PER_ROW), mhi = min(mlo + T / PER_ROW, M);
  const bool mine = n < N && mlo < mhi;
  // The row's first thread lists the row and its escapes if they are among the CTA's first
  // kEscListed (escape e at e - the CTA's first, so both threads of a row know whether it is
  // listed); listing warp w's rows go to slots 32w.., in row order, its count to wcnt[w].
  const bool lists = mine && mlo == 0 && e0 < e1 && e1 - cta_e0 <= kEscListed;
  if (lists)
    for (int e = e0; e < e1; ++e)
      escs[e - cta_e0] = make_uint2(static_cast<uint32_t>(__ldg(esc_col + e)),
                                    __float_as_uint(bf16_bits_to_float(static_cast<uint16_t>(__ldg(esc_val + e)))));
  if (tid < R) {  // whole warps (R is a multiple of 32)
    const unsigned listed = __ballot_sync(0xffffffffu, lists);
    if (lists) erows[32 * warp + __popc(listed & ((1u << lane) - 1))] = EscRow{rl, e0 - cta_e0, e1 - e0, sc * 0x1p-15f};
    if (lane == 0) wcnt[warp] = __popc(listed);
  }
  // XT: x^T where every block of it is done (each thread asks; either source gives the same values),
  // asked before the barrier so that the answer's round trip runs beside it.
  int* cnt = static_cast<int*>(scratch);
  const uint16_t* xt = cnt != nullptr && ld_acquire_gpu(cnt) >= KT ? xt_of(scratch) : nullptr;
  epilogue_sync<BAR>();
  // The listed escapes: warp w takes listed rows w, w + NW, ..., two at a time; lane l takes the
  // row's tokens l, l + 32, ... (< M), each token's escapes in list order; both rows' first two
  // escapes' activations are loaded before any add. (Session 25: one (row, token) unit per thread
  // cost two runtime divisions per unit and a branch per escape, 15 % of gate_up's instructions at
  // 128 tokens.)
  constexpr int NW = NTH / 32, TPL = T / 32;
  int pre[NS + 1];  // listed rows before slot group s
  pre[0] = 0;
#pragma unroll
  for (int s = 0; s < NS; ++s) pre[s + 1] = pre[s] + wcnt[s];
  const int nr = pre[NS];
  auto row_at = [&](int i) {  // (selects, not pre[] indexed at run time: that would be a stack array)
    int at = i;
#pragma unroll
    for (int u = 1; u < NS; ++u)
      if (i >= pre[u]) at = 32 * u + i - pre[u];
    return erows[at];
  };
  // (x^T is written during this grid: L2 loads, never the read-only path.)
  auto xat = [&](uint32_t col, int m) {
    return bf16_bits_to_float(xt ? __ldcg(xt + (size_t)col * kWgmmaMaxTokens + m) : __ldg(x + (int64_t)m * ldx + col));
  };
  auto load_x = [&](const EscRow& er, int c, float (&xv)[TPL]) {
    const uint32_t col = escs[er.first + c].x;
#pragma unroll
    for (int j = 0; j < TPL; ++j) xv[j] = xat(col, min(lane + 32 * j, M - 1));
  };
  auto apply = [&](const EscRow& er, const float (&x0)[TPL], const float (&x1)[TPL]) {
    float v[TPL];
#pragma unroll
    for (int j = 0; j < TPL; ++j) v[j] = Y[yidx<T>(er.rl, min(lane + 32 * j, M - 1))];
    for (int c = 0; c < er.count; ++c) {
      const float wv = __uint_as_float(escs[er.first + c].y);
      float xv[TPL];
      if (c > 1) load_x(er, c, xv);
#pragma unroll
      for (int j = 0; j < TPL; ++j) {
        const float xj = c == 0 ? x0[j] : c == 1 ? x1[j] : xv[j];
        v[j] = __fadd_rn(v[j], __fmul_rn(wv, xj));
        v[j] = __fsub_rn(v[j], __fmul_rn(er.slot, xj));
      }
    }
#pragma unroll
    for (int j = 0; j < TPL; ++j)
      if (lane + 32 * j < M) Y[yidx<T>(er.rl, lane + 32 * j)] = v[j];
  };
  for (int i0 = warp; i0 < nr; i0 += 2 * NW) {
    const bool two = i0 + NW < nr;
    const EscRow ea = row_at(i0), eb = row_at(two ? i0 + NW : i0);
    float xa[TPL], xa1[TPL], xb[TPL], xb1[TPL];
    load_x(ea, 0, xa);
    load_x(eb, 0, xb);
    if (ea.count > 1) load_x(ea, 1, xa1);
    if (eb.count > 1) load_x(eb, 1, xb1);
    apply(ea, xa, xa1);
    if (two) apply(eb, xb, xb1);
  }
  epilogue_sync<BAR>();
  // (By the last warp: warp 0 holds the first rows' stores, and the ticket's round trips would
  // come before them.)
  if (cnt != nullptr && tid == NTH - 32) {
    // Every read of this CTA's x^T and counts is behind the barrier above.
    __threadfence();  // this CTA's count of its transposed blocks before its ticket
    if (atomicAdd(cnt + 1, 1) == ctas - 1) {
      __threadfence();
      cnt[0] = 0;
      cnt[1] = 0;
    }
  }
  if (!mine) return;
  const int f = yidx<T>(rl, 0) - rl * T;  // this row's swizzle: 4 x the chunks' XOR
  // Not listed: this thread's tokens, as before session 24.
  if (e0 < e1 && e1 - cta_e0 > kEscListed) {
    struct {
      const int32_t* esc_col;
      const int16_t* esc_val;
      const uint16_t* x;
      int64_t ldx;
    } const ops{esc_col, esc_val, x, ldx};
    escapes_row_smem(Y, mlo, mhi, e0, e1, sc * 0x1p-15f, ops, [rl](int m) { return yidx<T>(rl, m); });
  }
  uint16_t* yp = y + (int64_t)mlo * ldy + n;
  if (bias)
    store_row_swz<T, true>(Y, rl, f, mlo, mhi, b, yp, ldy);
  else
    store_row_swz<T, false>(Y, rl, f, mlo, mhi, b, yp, ldy);
}

}  // namespace
}  // namespace w12
