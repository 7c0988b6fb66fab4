// W12 GEMM v4, whole-K clusters for 1..16 tokens (sm_90a): the split grid's work without its
// reduce kernel, and the same bits.
//
// Why (docs/perf-notes.md, session 15): v4 cuts K into S slices on weights with few 128-row tiles
// (qkv, o, down) so that every SM streams, and a second, PDL-launched kernel adds the S partials.
// That kernel boundary cost 2-2.8 us per projection at 1-16 tokens (qkv 12.7 -> 10.8 us, o 10.4 ->
// 7.9 without it), and every cross-CTA replacement measured (ticket, cluster of S CTAs, in-grid
// reducers) paid more in its handshake.
//
// Here the S slices of a 64-row m-tile run in one thread-block cluster: unit u = r * W + w
// (warpgroup w of rank r, W per CTA) streams slice u % S of the cluster's m-tile u / S (kper
// records from there, the split grid's slice) through its own ring of half records (the 6 KB of the
// m-tile's fragments) and its own activation tile, and decodes and multiplies them exactly as the
// split grid's warpgroup for that m-tile does (same bytes per thread, decode16_split, the same
// four m64nTk16 wgmma per record), so each accumulator holds the split grid's partial bit for bit.
// Every unit writes its partial into the shared memory of the rank that owns its m-tile (rank j
// owns m-tile j, through distributed shared memory for the others); after one cluster barrier each
// owner adds the S of them in add_slice's order with the
// reduce kernel's operations and runs its epilogue (scale, escapes in list order, bias, BF16), its
// row data and escapes (true values and activations) staged in shared memory during the main loop
// as the reduce kernel stages them before its wait: the same bits as split grid + reduce kernel,
// at every M. Warpgroups share nothing but the final sum, so each synchronises with a named
// barrier of its own.
//
// What was measured on the way (calls 2-8): one CTA of S warpgroups per m-tile (64 CTAs for o) is
// issue-bound per SM at half the SMs; two CTAs per SM with the first loop form cost more
// instructions per record than the split grid's (whose slot and descriptor arithmetic is uniform
// across its CTA, unlike per-warpgroup slices: hence the running pointers below); without staging,
// the escapes' dependent loads after the loop cost what the reduce kernel costs.
//
// Two packings (wholek_form): one m-tile per cluster of two CTAs of W = S / 2 warpgroups (session
// 15; an even S where 4 CTAs per 128-row tile fit one per SM: down [4096, 14336]), and (session
// 43) P = C W / S m-tiles per cluster of C CTAs of W warpgroups, by default only W = 4 with C = 1:
// S = 4 weights such as Llama-70B o [8192, 8192] and down [8192, 28672], one CTA per m-tile, 1-3 %
// faster at 1-8 tokens. Clusters are exact (C = S / gcd(S, W): every warpgroup holds a unit):
// a cluster of four CTAs with a warpgroup idle ran 6-8 % slower than the split grid at 4-16
// tokens (session 43, call 5), and its support was removed in session 44.
// Every slice must hold >= 16 records (down: 28): o [4096, 4096] (8 per slice) measured level at
// 1-4 tokens and slower at 16, so it keeps the split grid. At 32-64 tokens each warpgroup's own
// activation tile (4-8 KB per stage) leaves too little shared memory for the ring.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gemm_w12_mma.cuh"
#include "smxx_gemm_common.cuh"
#include "smxx_launch.cuh"
#include "smxx_pipe.cuh"
#include "smxx_w12_decode.cuh"
#include "smxx_wgmma.cuh"

namespace cg = cooperative_groups;

namespace w12 {
namespace {

constexpr int kHalf = kRec / 2;  // one m-tile's fragment bytes of a record
constexpr int kMaxSlices = 8;    // K slices per cluster (two CTAs of up to 4 warpgroups)
constexpr int kMaxWarpgroups = kMaxSlices / 2;
constexpr int kRowsPad = 68;     // floats per token row of the partial table: 64 rows + 4 (banks)

// A cluster of C CTAs of W warpgroups holds the S units (m-tile, slice) of P = C W / S m-tiles.
// wholek_exact: the fewest CTAs with no warpgroup idle (C = P S / W with P = W / gcd(S, W)), the
// only clusters the kernel runs (it gives every warpgroup a unit); W = S / 2 gives P = 1, C = 2.
__host__ __device__ constexpr int wholek_mtiles(int S, int W, int C) { return C * W / S; }
__host__ __device__ constexpr int wholek_exact(int S, int W) {
  int a = S, b = W;
  while (b) {
    const int r = a % b;
    a = b;
    b = r;
  }
  return S / a;
}

__host__ __device__ constexpr int wholek_stage_bytes(int nch) { return kHalf + nch * 8 * 128; }

// Shared memory beyond the ring (an owner's epilogue tables, kept apart from the ring so that the
// other ranks can write their partials while it still streams): the S partials
// P[slice][token][row] (rows padded to kRowsPad floats; room for at least 2 * warpgroups), and the
// staged escapes of the m-tile's 64 rows: per row up to 2 * warpgroups of them (one per token
// group of 64 threads: the true value EW[slot][row] and x at each token X[slot][token][row]).
__host__ __device__ constexpr int wholek_slices_room(int S, int wgs) { return S > 2 * wgs ? S : 2 * wgs; }
__host__ __device__ constexpr int wholek_table_bytes(int nch, int wgs, int S) {
  return wholek_slices_room(S, wgs) * 8 * nch * kRowsPad * 4 + (2 * wgs) * (8 * nch + 1) * 64 * 4;
}

// An owner's per-thread epilogue data: its row (of the m-tile's 64) and one escape slot of that row
// (slot = the thread's token group), loaded in steps spread over the main loop so that the
// dependent chain esc_ptr -> esc_col -> x is never exposed after it (the reduce kernel stages the
// same before its griddepcontrol.wait): each step consumes registers loaded records earlier.
template <int T>
struct EpilogueStage {
  uint32_t braw = 0;
  int e0 = 0, e1 = 0, ecol = 0;
  float bias = 0.f, eval = 0.f;
  float xv[T];
  __device__ __forceinline__ void rows(int n, const WParams& p) {
    if (n < p.N) {
      braw = __ldg(p.base + n);
      e0 = __ldg(p.esc_ptr + n);
      e1 = __ldg(p.esc_ptr + n + 1);
      bias = p.bias ? __ldg(p.bias + n) : 0.f;
    }
  }
  __device__ __forceinline__ void escape(int slot, const WParams& p) {
    if (e0 + slot < e1) {
      ecol = __ldg(p.esc_col + e0 + slot);
      eval = bf16_bits_to_float(static_cast<uint16_t>(__ldg(p.esc_val + e0 + slot)));
    }
  }
  __device__ __forceinline__ void x_load(int slot, const WParams& p) {
    if (e0 + slot < e1)
#pragma unroll
      for (int m = 0; m < T; ++m) xv[m] = m < p.M ? bf16_bits_to_float(p.x[(int64_t)m * p.ldx + ecol]) : 0.f;
  }
  __device__ __forceinline__ void x_store(int slot, int rl, float* X, float* EW) {
    if (e0 + slot < e1) {
      EW[slot * 64 + rl] = eval;
#pragma unroll
      for (int m = 0; m < T; ++m) X[(slot * T + m) * 64 + rl] = xv[m];
    }
  }
};

template <int NCH, int STAGES>
__global__ void __launch_bounds__(128 * kMaxWarpgroups, 1) gemm_w12_wholek_kernel(const WParams p) {
#if W12_WGMMA
  constexpr int T = 8 * NCH;               // token rows of the B tile
  constexpr int kStage = wholek_stage_bytes(NCH);  // half record + B tile, a multiple of 1024
  constexpr int ND = T / 2;                // accumulator floats per thread
  extern __shared__ __align__(1024) uint8_t smem[];

  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, nthreads = blockDim.x, wgs = nthreads >> 7, w = tid >> 7, wt = tid & 127;
  const int lane = tid & 31, g = lane >> 2, t = lane & 3, quarter = wt >> 5;
  const int rank = static_cast<int>(cluster.block_rank()), cs = static_cast<int>(cluster.num_blocks());
  const int pm = wholek_mtiles(p.S, wgs, cs), mtiles = 2 * ((p.N + 127) >> 7);
  const int mt0 = blockIdx.x / cs * pm;  // the cluster's first m-tile
  // This warpgroup's unit: m-tile um (records of row tile um / 2, fragments of half um & 1), slice
  // us. Units past the last m-tile (in the grid's last cluster) stream nothing (nrec = 0) and take
  // part in the barriers only.
  const int u = rank * wgs + w, um = mt0 + u / p.S, us = u % p.S;
  const int rowtile = um >> 1, mt = um & 1;
  const int kt0 = us * p.kper, nrec = um < mtiles ? min(p.KT - kt0, p.kper) : 0;
  const bool owner = rank < pm;  // rank j runs the epilogue of the cluster's m-tile j
  if (p.pdl) pdl_wait();
  // Let a PDL-launched next kernel be placed as SMs free up (its CTAs wait for this grid's end):
  // a split grid's CTA fits beside this one (diagnostic 2048: no early trigger).
  if (!(p.diag & 2048)) pdl_launch_dependents();
  const uint8_t* rec0 = p.records + ((size_t)rowtile * p.KT + kt0) * kRec;
  uint8_t* ring = smem + w * STAGES * kStage;
  const uint32_t rbase = smem_u32(ring);
  // The split grid's warpgroup for m-tile mt reads, per record, hi bytes at quarter * 2048 +
  // mt * 1024 + lane * 16 (+512) and lo bytes at 8192 + quarter * 1024 + mt * 512 + lane * 8
  // (+256); here they land packed in a 6 KB slot. The warp's 512 lo bytes are copied as one
  // block, 16 bytes per lane, so that every copy is an L1-bypassing 16-byte cp.async: with the
  // ring taking ~228 KB of the SM's 256, L1 keeps ~28 KB, and the 8-byte copies (which must go
  // through L1) of eight warpgroups' rings did not fit in it (session 15, call 2).
  const uint32_t hi_src = quarter * 2048 + mt * 1024 + lane * 16, lo_src = 8192 + quarter * 1024 + mt * 512;
  const uint32_t hi_dst = quarter * 1024 + lane * 16, lo_dst = 4096 + quarter * 512;
  // B tile as in v4: T rows of 128 B in the 128-byte swizzle, one 16-byte piece per thread.
  const int xr = wt >> 3, xc = wt & 7;
  const bool x_mine = xr < T;
  const uint32_t xdst = kHalf + xr * 128 + ((xc ^ (xr & 7)) << 4);
  const int xoff = xr * (int)p.ldx + 8 * xc;

  // Everything the loop advances is a running pointer or address, wrapped at the ring's end: the
  // slices differ per warpgroup, so none of it is uniform across the CTA (the split grid keeps
  // its slot and descriptor arithmetic in uniform registers), and recomputing it per record took
  // ~40 of the first version's ~170 instructions per record.
  const uint8_t* src = rec0;                           // next record to copy
  const uint16_t* xsrc = p.x + (int64_t)kt0 * 64 + xoff;  // its activation piece
  const bool x_copy = x_mine && xr < p.M;
  uint32_t wr = rbase;                                 // stage the next copy lands in
  auto load_next = [&]() {
#pragma unroll
    for (int q = 0; q < 2; ++q) cp_async16(wr + hi_dst + q * 512, src + hi_src + q * 512);
    cp_async16(wr + lo_dst + lane * 16, src + lo_src + lane * 16);
    if (x_copy) cp_async16(wr + xdst, xsrc);
    src += kRec;
    xsrc += 64;
    wr = wr + kStage == rbase + STAGES * kStage ? rbase : wr + kStage;
  };
  if (x_mine && xr >= p.M)
#pragma unroll
    for (int sl = 0; sl < STAGES; ++sl) *reinterpret_cast<uint4*>(ring + sl * kStage + xdst) = make_uint4(0u, 0u, 0u, 0u);

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nrec) load_next();
    cp_async_commit();
  }
  // An owner's epilogue: the thread's row (of its m-tile's 64) and token group tg (tokens tg,
  // tg + 2 wgs, ...; also its escape slot); its row data is in flight from here.
  const int om = mt0 + rank, rl = tid & 63, tg = tid >> 6;
  const int n = (om >> 1) * 128 + (rl >> 4) * 32 + (om & 1) * 16 + (rl & 15);
  float* P = reinterpret_cast<float*>(smem + STAGES * wgs * kStage);
  float* X = P + wholek_slices_room(p.S, wgs) * T * kRowsPad;
  float* EW = X + 2 * wgs * T * 64;
  EpilogueStage<T> es;
  if (owner) es.rows(n, p);
  // The other ranks write into an owner's shared memory after their loops: it must have started
  // by then (this arrive, and the wait before those writes).
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");

  float acc[ND];
#pragma unroll
  for (int k = 0; k < ND; ++k) acc[k] = 0.f;
  uint32_t a[16];
  // The B tile's descriptor: its start address field (bits 0-13, in 16-byte units) moves by
  // kStage / 16 per slot and by 2 per 16-column k-step (32 bytes); shared addresses stay below
  // 256 KB, so the field never carries.
  const uint64_t desc_first = smem_desc_sw128(rbase + kHalf);
  const uint64_t desc_last = desc_first + (STAGES - 1) * (kStage >> 4);
  uint64_t drd = desc_first;
  const uint8_t* rd = ring;  // stage the next record is read from
  const uint32_t k38 = opaque_k38(static_cast<uint32_t>(p.M) >> 30);  // see decode16
  auto step = [&](int i) {
    cp_async_wait<STAGES - 2>();
    __syncwarp();  // the warp's lo block came from all its lanes' copies
    fence_proxy_async_smem();
    wgmma_wait0();
#pragma unroll
    for (int k = 0; k < ND; ++k) pin(acc[k]);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint4 h = *reinterpret_cast<const uint4*>(rd + hi_dst + q * 512);
      const uint2 l = *reinterpret_cast<const uint2*>(rd + lo_dst + q * 256 + lane * 8);
      decode16_split(h, l, a + 8 * q, k38);
    }
    named_bar_sync(1 + w, 128);  // this warpgroup's copies of stage i landed, its reads of i-1 done
    if (i + STAGES - 1 < nrec) load_next();
    cp_async_commit();
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) Wgmma<T>::run(acc, a + 4 * ks, drd + 2 * ks);
    wgmma_commit();
    rd = drd == desc_last ? ring : rd + kStage;
    drd = drd == desc_last ? desc_first : drd + (kStage >> 4);
  };
  // The epilogue data's dependent loads after records 2, 4 and 5 (after the loop for short
  // slices), each consuming registers loaded at least one record earlier.
  int i = 0;
  for (; i < min(nrec, 3); ++i) step(i);
  if (nrec > 3 && owner) es.escape(tg, p);
  for (; i < min(nrec, 5); ++i) step(i);
  if (nrec > 5 && owner) es.x_load(tg, p);
  for (; i < min(nrec, 6); ++i) step(i);
  if (nrec > 6 && owner) es.x_store(tg, rl, X, EW);
  for (; i < nrec; ++i) step(i);
  wgmma_wait0();
#pragma unroll
  for (int k = 0; k < ND; ++k) pin(acc[k]);
  cp_async_wait<0>();
  if (nrec <= 3 && owner) es.escape(tg, p);
  if (nrec <= 5 && owner) es.x_load(tg, p);
  if (nrec <= 6 && owner) es.x_store(tg, rl, X, EW);

  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
  if (p.diag & 4) return;  // diagnostic (wrong output): the loops alone, no sum or epilogue
  // Slice us's partial: rows 16 quarter + g (+8) of the m-tile's 64, tokens 8j + 2t (+1), into
  // its owner's table (another rank's through distributed shared memory; the 4 lanes t of a row
  // fall in different banks). The cluster barrier then orders them before the owner's reads.
  const int own = u / p.S;
  float* dst = own == rank ? P : cluster.map_shared_rank(P, own);
  const int sl = us;
#pragma unroll
  for (int j = 0; j < NCH; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      dst[(sl * T + 8 * j + 2 * t + (i & 1)) * kRowsPad + quarter * 16 + g + 8 * (i >> 1)] = acc[4 * j + i];
  cluster.sync();
  if (!owner || n >= p.N) return;
  // The reduce kernel's operations per output: the slices in add_slice's order, then scale,
  // escapes in list order (staged slots first), bias.
  const int S = p.S, groups = 2 * wgs, ne = es.e1 - es.e0, staged = min(ne, groups);
  const float sc = row_scale(es.braw), slot = sc * 0x1p-15f;
  for (int m = tg; m < p.M; m += groups) {
    float y = 0.f, pend = 0.f;
    for (int s = 0; s < S; ++s) add_slice(y, pend, P[(s * T + m) * kRowsPad + rl], s, S);
    y = y * sc;
    // The staged escapes' operands all read before the first add: a fixed trip count, so that no
    // read waits for the previous escape's adds (session 32, docs/perf-notes.md: down [4096,
    // 14336] -0.45..1.0 us at 1-16 tokens; the same change in the reduce kernel's staged
    // epilogue, whose escapes sit behind per-escape branches, measured +0.3 us and was dropped).
    float ew[kMaxSlices], ex[kMaxSlices];
#pragma unroll
    for (int j = 0; j < kMaxSlices; ++j)
      if (j < staged) ew[j] = EW[j * 64 + rl], ex[j] = X[(j * T + m) * 64 + rl];
#pragma unroll
    for (int j = 0; j < kMaxSlices; ++j)
      if (j < staged) {
        y = __fadd_rn(y, __fmul_rn(ew[j], ex[j]));
        y = __fsub_rn(y, __fmul_rn(slot, ex[j]));
      }
    for (int e = es.e0 + staged; e < es.e1; ++e) {
      const float xe = bf16_bits_to_float(p.x[(int64_t)m * p.ldx + __ldg(p.esc_col + e)]);
      const float we = bf16_bits_to_float(static_cast<uint16_t>(__ldg(p.esc_val + e)));
      y = __fadd_rn(y, __fmul_rn(we, xe));
      y = __fsub_rn(y, __fmul_rn(slot, xe));
    }
    if (p.bias) y = __fadd_rn(y, es.bias);
    p.y[(int64_t)m * p.ldy + n] = __bfloat16_as_ushort(__float2bfloat16_rn(y));
  }
#endif
}


template <int NCH, int STAGES>
cudaError_t launch_wholek(const WParams& p, int wgs, int cs, int nt, cudaStream_t stream) {
  constexpr auto kern = gemm_w12_wholek_kernel<NCH, STAGES>;
  const int smem = STAGES * wgs * wholek_stage_bytes(NCH) + wholek_table_bytes(NCH, wgs, p.S);
  const int pm = wholek_mtiles(p.S, wgs, cs);
  if (pm * p.S != cs * wgs) return cudaErrorInvalidValue;  // the kernel gives every warpgroup a unit
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if ((e = set_smem_limit_once<kern>(dev, smem)) != cudaSuccess) return e;
  return launch_ex(kern, dim3((2 * nt + pm - 1) / pm * cs), dim3(128 * wgs), smem, stream, cs, p.pdl != 0, p);
}

template <int NCH>
cudaError_t launch_wholek_stages(const WParams& p, int wgs, int cs, int nt, int stages, cudaStream_t stream) {
  if (stages == 4) return launch_wholek<NCH, 4>(p, wgs, cs, nt, stream);
  return launch_wholek<NCH, 3>(p, wgs, cs, nt, stream);
}

struct WholekForm {
  int wgs = 0, stages = 0, cluster = 0;
};

// The whole-K clusters' form for an [N, K] weight in S slices at `tokens` (docs above
// wholek_stages in gemm_w12_mma.cuh), or {}. Two CTAs of S / 2 warpgroups per m-tile for an even
// S where 4 CTAs per 128-row tile fit one per SM (session 15). Else, where the split grid puts two
// CTAs (2 kper records) on some SM, m-tiles packed into clusters of C = S / gcd(S, W) CTAs of W = 4
// warpgroups, one CTA per SM (every SM then streams four units of kper half records, what the
// split grid's busiest SMs stream, without its reduce kernel), taken by default only where C <= 2:
// S = 4, one CTA per m-tile (session 43: Llama-70B o [8192, 8192] -3 % at 1-4 tokens, down [8192,
// 28672] -0.7..1 %). Larger clusters (qkv [6144, 4096]: five CTAs of four m-tiles) are not all
// resident at once on the H200 (cudaOccupancyMaxActiveClusters; forced, the last ones ran as a
// second wave, 12.5 -> 20-23 us), and a resident cluster of four CTAs with a warpgroup idle ran
// 6-8 % slower than the split grid at 4-16 tokens ([5665, 5000]); diagnostic 2097152 takes every
// packing (W = 4, else two warpgroups per CTA and two CTAs per SM; W <= S, since each m-tile's
// owner must be a rank of its cluster) whatever the driver holds at once, 1048576 none.
static WholekForm wholek_form(int N, int K, int S, int tokens, int sms, int smem_sm, int smem_optin, int stages,
                              int flags) {
  const int nt = (N + 127) / 128, nch = tokens <= 8 ? 1 : 2, kt = (K + 63) / 64;
  if ((flags & kWholekOff) || tokens < 1 || tokens > 16 || S < 2 || S > kMaxSlices) return {};
  // Slices of >= 16 records (session 15, call 8): down [4096, 14336] (28 per slice) ran 24.3
  // against 25.5 us at M = 1 and 26.1 against 27.1 at 16; o [4096, 4096] (8 per slice) level at
  // 1-4 tokens and 0.9 us slower at 16. A short slice cannot hide the deeper ring's prologue and
  // the epilogue data's three loading steps, whose last one lands after record 5.
  if ((kt + S - 1) / S < 16 && !(flags & kWholekShortSlices)) return {};
  // A ring as deep as the CTA's shared memory allows beside the epilogue tables, up to 4; 3 at
  // least. Five stages (the cap until session 42, where they fit: 1-8 tokens) ran down [4096,
  // 14336] 0.4-0.6 us slower than four at 1-8 tokens in both orders of an interleaved run, and
  // [3584, 18944] level (docs/perf-notes.md, session 42); three are no faster than four.
  auto depth = [&](int wgs, int limit) {
    int fit = (limit - wholek_table_bytes(nch, wgs, S)) / (wgs * wholek_stage_bytes(nch));
    fit = fit > 4 ? 4 : fit;
    if (fit < 3) return 0;
    return (stages == 3 || stages == 4) && stages <= fit ? stages : fit;
  };
  if (!(S & 1) && 4 * nt <= sms) {
    const int st = depth(S / 2, smem_optin);
    return st ? WholekForm{S / 2, st, 2} : WholekForm{};
  }
  if ((flags & kWholekNoPack) || nt * S <= sms) return {};
  const bool every = (flags & kWholekEveryPacking) != 0;
  for (int wgs = kMaxWarpgroups; wgs >= 2; wgs >>= 1) {
    const int cs = wholek_exact(S, wgs), pm = wholek_mtiles(S, wgs, cs), per_sm = kMaxWarpgroups / wgs;
    if (wgs > S || (!every && (wgs < kMaxWarpgroups || cs > 2))) continue;
    if ((2 * nt + pm - 1) / pm * cs > per_sm * sms) continue;
    const int limit = per_sm == 1 ? smem_optin : smem_sm / per_sm - kSmemReservedPerCta;
    const int st = depth(wgs, limit < smem_optin ? limit : smem_optin);
    if (st) return {wgs, st, cs};
  }
  return {};
}

}  // namespace

int wholek_stages(int N, int K, int S, int tokens, int sms, int smem_sm, int smem_optin, int stages, int flags) {
  return wholek_form(N, K, S, tokens, sms, smem_sm, smem_optin, stages, flags).stages;
}

int wholek_warpgroups(int N, int K, int S, int tokens, int sms, int smem_sm, int smem_optin, int stages, int flags) {
  return wholek_form(N, K, S, tokens, sms, smem_sm, smem_optin, stages, flags).wgs;
}

int wholek_cluster_ctas(int N, int K, int S, int tokens, int sms, int smem_sm, int smem_optin, int stages, int flags) {
  return wholek_form(N, K, S, tokens, sms, smem_sm, smem_optin, stages, flags).cluster;
}

cudaError_t gemm_wholek_launch(const GemmArgs& a, int m0, int tokens, int S, int stages, bool pdl,
                               cudaStream_t stream) {
  DevInfo di;
  int dev = 0;
  cudaError_t e = dev_info(di, dev);
  if (e != cudaSuccess) return e;
  const WholekForm f = wholek_form(a.N, a.K, S, tokens, di.sms, di.smem_sm, di.smem_optin, stages, a.flags);
  if (!f.wgs || f.stages != stages) return cudaErrorInvalidValue;
  WParams p{};
  set_split_pass(p, a, m0, tokens, S);
  p.pdl = pdl ? 1 : 0;
  p.diag = a.flags & (4 | 2048);
  const int nt = (a.N + 127) / 128;
  return tokens <= 8 ? launch_wholek_stages<1>(p, f.wgs, f.cluster, nt, stages, stream)
                     : launch_wholek_stages<2>(p, f.wgs, f.cluster, nt, stages, stream);
}

}  // namespace w12
