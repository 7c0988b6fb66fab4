// W12 GEMM v4 for Hopper (sm_90a): the decoded record is the register A operand of wgmma.
// y[M, N] = x[M, K] W[N, K]^T as y^T = W x^T, weights the MMA's M side (64 rows per wgmma), tokens
// its N (8, 16, 32, 64 or 128 per launch), activations the shared-memory B operand.
//
// Why (docs/perf-notes.md): on the mma.sync kernels the M = 1 decode is instruction-latency bound
// and from M = 16 up the HMMA count per record (16-64 per warp) dominates. Here each of the two
// warpgroups of a CTA issues 4 wgmma per 128x64 record (its 64-row m-tile) whatever the token
// count, and they run asynchronously with the copies of the following records.
//
// STATUS: `auto` on sm_90 since session 10 (v1 elsewhere); the per-session history is in
// docs/perf-notes.md. Variants, all with the same bits per output: the PAIR grid (session 17,
// qkv-like weights at 17-32 tokens), the DEEP loop (session 16; on request only since session 42), PDL
// on unsplit grids at <= 16 tokens (16), whole-K clusters for down-like weights at 1-16 tokens (15,
// gemm_w12_wholek_sm90.cu), the split ring of row-tile-pair grids at 65-128 tokens (18), the
// balanced unsplit grid at <= 32 tokens (BAL, 20), bulk-copied records where BAL would run at 1-2
// tokens (BULK, 22), m-tile x pair CTAs for qkv-like weights at 1-16 tokens (KW, 34), BAL's
// CTAs as the last round of a multi-round unsplit grid at <= 32 tokens (BALT, 35), the row-tile
// pairs fed by a producer warpgroup without a CTA barrier at 33-128 tokens (NB, 38,
// gemm_w12_nobar_sm90.cu: where the split ring ran, and unsplit weights of >= 2 tiles per SM at
// 33-64). The unsplit
// grids' shared-memory epilogue at 33-128 tokens applies the escapes with the whole CTA (24,
// store_rows_smem). Its bits differ from v1's (about 2-4e-4 of the
// outputs: wgmma and mma.sync round the k16 products differently), so `auto` takes it for every M
// or for none.
//
// - Records in layout 3 (w12/layouts.py: layout 2 split, decoded by decode16_split in 7
//   instructions per 8 weights instead of 17; session 14). Layout 2 is layout 1's slots and
//   decode with MMA k in column order:
//   m-tile mt of quarter q (rows 32q + 16mt + 0..15) is the 16-row slice that warp q of a
//   warpgroup gives the wgmma for mt, so the two wgmma of a k-step cover rows {32q + 0..15} and
//   {32q + 16..31} (q = 0..3); warpgroup mt of a 2-warpgroup CTA issues the one for mt, a
//   1-warpgroup CTA both. k-step ks covers columns 16ks..16ks+15. The activation tile is K-major
//   in the 128-byte swizzle: one 128-byte row of x per token (v1's tile), copied whole rows at a
//   time (session 8; the no-swizzle [chunk][token] tile before it cost 8x the ideal
//   shared-memory wavefronts in its copies).
//   Session 7 moved v4 from layout 1, whose column permutation made every 16-byte core-matrix row
//   a gather of four 4-byte pairs (ncu at 64 tokens: L1/TEX 79 % busy).
// - K-split like v1: gemm_splits() slices (a function of N, K and the SM count, never of M; v4
//   leaves a few more weights unsplit than v1, see there); the
//   slices park partials that v1's PDL reduce kernel adds in add_slice's order (pairs, then the
//   pairs in order), so the bits are the same for every M; at 17..32 tokens one CTA runs each pair
//   of slices and parks their sum (PAIR). Where whole-K clusters run (wholek_stages), they add the
//   same partials in the same order inside the cluster instead.
// - Each thread streams its own fragment bytes of every record (v1's per-thread cp.async ring,
//   STAGES deep); fence.proxy.async makes the activation tile visible to wgmma. Row-tile pairs
//   at 65-128 tokens and BULK split the ring (XS > 0): records by one bulk copy each on per-slot
//   mbarriers, activation tiles by cp.async in slots of their own.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gemm_w12_mma.cuh"
#include "smxx_gemm_common.cuh"
#include "smxx_launch.cuh"
#include "smxx_pipe.cuh"
#include "smxx_w12_decode.cuh"
#include "smxx_wgmma.cuh"
#include "smxx_wgmma_epilogue.cuh"

namespace w12 {
namespace {

constexpr int kMaxTokens = kWgmmaMaxTokens;  // 128: one pass for 65..128 tokens (NCH = 16)
constexpr int kOneWarpgroup = 1 << 19;  // diagnostic 524288 (v1's "never 8-warp CTAs"): WG = 1
constexpr int kRowPairs = 1 << 18;      // diagnostic 262144: WG = 4, two row tiles per CTA
constexpr int kNoRowPairs = 8;          // diagnostic 8: one row tile per CTA at 33..128 tokens too
// Bits 20+ of GemmArgs::flags are the launchers' own (smxx_gemm_epilogue.cuh), so v4's later
// diagnostics reuse bits that only v1 reads (v1: with W12_GEMM_PDL=1, 256 and 1024).
constexpr int kDeep = 256;              // diagnostic 256: the DEEP loop at every grid up to 16 tokens; at 33-128 the
                                        // row-tile pairs' loops with a CTA barrier instead of NB (the split ring at
                                        // 65-128; gemm_w12_nobar_sm90.cu)
constexpr int kNoDeep = 1024;           // diagnostic 1024: never the DEEP loop
constexpr int kDeepStages = 6;          // its ring (4 records in flight); launch_pick's "stages" for it
constexpr int kNoPairs = 128;           // diagnostic 128: never the pair grid (PAIR)
constexpr int kPairsAll = 512;          // diagnostic 512: the pair grid on every split grid (S >= 2, <= 64 tokens)
constexpr int kNoBalance = 8192;        // diagnostic 8192: never the balanced unsplit grid (BAL)
constexpr int kNoBulkRecords = 16384;   // diagnostic 16384: never bulk-copied records at 1-2 tokens (BULK)
constexpr int kNoXt = 32768;            // diagnostic 32768: the epilogue's escapes read x, never its transpose (XT)
constexpr int kNoTriples = 1024;        // diagnostic 1024 at 33-128 tokens: never NB's triples (nobar_consumers)
constexpr int kTriplesAll = 16384;      // diagnostic 16384 at 33-128 tokens: NB's triples on every split weight

// The unsplit grids' epilogues (store_rows, store_rows_smem) and the XT helpers: smxx_wgmma_epilogue.cuh.

// WG = warpgroups per CTA. WG = 1: each warp decodes both m-tiles of its 32-row quarter and the
// warpgroup issues 8 wgmma per record. WG = 2 (session 9): warpgroup mt decodes and multiplies
// m-tile mt only (warp w: quarter w & 3), 4 wgmma per record each, so a record's decode chain per
// thread is half as long and an SM holds 8 warps per CTA. Every output element still sees the
// same wgmma k-steps in the same order: the bits are those of WG = 1. WG = 4 (session 10): two
// row tiles per CTA (2 pair + 0/1), warpgroup w on m-tile w & 1 of row tile w >> 1, so the
// activation tile each stage copies from L2 serves twice the weight rows (at 128 tokens it is
// 16 KB per 12 KB record). Same wgmma per output element: same bits.
template <int WG, int NCH>
struct V4Blocks {
  static constexpr int value = WG == 4 ? 1 : WG == 2 ? (NCH <= 4 ? 4 : NCH <= 8 ? 3 : 2) : 2;
};
// DEEP (session 16): record i-1's wgmma stays in flight while record i is decoded into the other
// of two A buffers (wgmma.wait_group 1), so neither the wgmma's latency nor the decode is on the
// other's path; the stage refilled is record i-2's (its B tile may still be read by record i-1's
// wgmma until then), so the copy distance is STAGES - 2. The same wgmma in the same order: the
// same bits. Taken by gemm_wgmma_launch for short K slices at 9..16 tokens (below).
// PAIR (session 17): each CTA of a split grid runs two consecutive K slices (2j, 2j+1) one after
// the other, each from zero, adds the pair (add_slice's order) and parks one partial for the two:
// half the CTAs, half the partials written and read, the same bits. Plain loop, WG <= 2 only.
// KW (session 34): the two warpgroups of a CTA hold the same 64-row m-tile over the two slices of
// a pair (warpgroup w: slice 2j + w), each with its own activation tile per stage, and add the
// pair through shared memory before parking it: the split grid's CTAs, bytes and warps per CTA
// (qkv [6144, 4096] in 8 slices, its split until session 41: 384 CTAs of 8 records) with half its
// partials, the same bits. Plain loop, WG = 2, slices of equal length only; taken at <= 16 tokens
// (the launcher says where and why).
template <int NCH, int STAGES, bool OVERLAP, int WG, bool DEEP = false, bool PAIR = false, int XS = 0, bool KW = false>
__global__ void __launch_bounds__(kThreads * WG, (DEEP || PAIR) ? 2 : V4Blocks<WG, NCH>::value)
    gemm_w12_wgmma_kernel(const WParams p) {
#if W12_WGMMA
  static_assert(!KW || (WG == 2 && !OVERLAP && !DEEP && !PAIR && XS == 0), "KW: the plain two-warpgroup loop");
  constexpr int NTH = kThreads * WG;    // threads per CTA
  constexpr int MTW = WG == 1 ? 2 : 1;  // m-tiles per thread
  constexpr int RT = WG == 4 ? 2 : 1;   // row tiles per CTA
  constexpr int T = 8 * NCH;            // token rows of the B tile
  constexpr int kX = T * 128;           // B tile bytes (T rows of 128 B, 128-byte swizzle)
  // XS > 0 (split ring): STAGES record slots and XS activation-tile slots, each ring at its own
  // distance: a record slot is free once the record is decoded (the wgmma reads A from
  // registers), an activation slot only once its wgmma has retired. The records come as one bulk
  // copy per record and row tile, completing on the slot's mbarrier, so that their distance is
  // not tied to the activation tiles' cp.async groups (a thread's groups complete in order: a
  // record in the same group queue as a nearer activation tile would have to land with it).
  // XS = 0: one ring of STAGES slots holding both, per-thread cp.async for both.
  constexpr bool kSplit = XS > 0;
  static_assert(!(kSplit && DEEP), "the deep loop keeps one ring");
  constexpr int kXT = KW ? 2 : 1;  // activation tiles per stage (KW: one per warpgroup)
  constexpr int kStage = kSplit ? RT * kRec : RT * kRec + kXT * kX;  // record-ring stride
  constexpr int kXDist = kSplit ? XS - 1 : STAGES - 1;  // activation tiles in flight after a refill
  constexpr int kXBase = STAGES * kStage;                // split ring: the activation slots
  constexpr int ND = T / 2;             // accumulator floats per m-tile per thread
  // 1024-byte aligned: the swizzled B tiles (kRec and kX are multiples of 1024, so every stage's
  // tile is too).
  extern __shared__ __align__(1024) uint8_t smem[];

  // XT helpers (the grid's first p.xth CTAs; unsplit grids at 33-128 tokens only): transpose, exit.
  if constexpr (NCH >= 8) {
    if (blockIdx.x < p.xth) {
      if (p.pdl) pdl_wait();
      xt_blocks(p.x, p.ldx, p.M, p.KT, p.ws, p.xth);
      return;
    }
  }
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
  // BAL (p.bal, session 20): an unsplit grid of 2 x SMs CTAs that deals the weight's 16-row
  // slices out evenly (6-7 per CTA for gate_up's 1792) instead of 8 per CTA, so that no SM streams
  // more than its share; warp w of CTA b holds slice b * total / G + w wherever it lies (its tile,
  // quarter and m-tile), the same bytes, decode and wgmma as the 128-row CTA's warp for that slice,
  // so the same bits (wgmma's rows are independent of their place in the 64-row tile). Warps past
  // the CTA's share copy nothing, multiply whatever their ring holds and store nothing.
  constexpr bool kBalForm = WG == 2 && NCH <= 4 && !OVERLAP && !DEEP && !PAIR && XS == 0 && !KW;
  // This CTA among the row-tile CTAs (after the XT helpers; below 33 tokens there are none).
  const unsigned bid = NCH >= 8 ? blockIdx.x - p.xth : blockIdx.x, nbid = NCH >= 8 ? gridDim.x - p.xth : gridDim.x;
  // BALT (session 35): the CTAs from bal0 = p.bal - 1 on deal out the slices of tiles bal0.. (the
  // last round of a multi-round grid), the first bal0 CTAs are 128-row CTAs on tiles 0..bal0-1.
  const unsigned bal0 = p.bal - 1u;
  const bool bal = kBalForm && p.bal && bid >= bal0;
  // The balanced CTA b's slices: [first(b), first(b + 1)). (32-bit: the launcher keeps slices x
  // balanced CTAs below 2^32; no division otherwise.)
  auto bal_first = [&](unsigned b, unsigned nb) {
    const unsigned f = 8u * bal0;
    return f + (b - bal0) * (((unsigned)(p.N + 15) >> 4) - f) / (nb - bal0);
  };
  const unsigned bal_sl = bal ? bal_first(bid, nbid) + (tid >> 5) : 0u;
  const bool bal_ok = bal && bal_sl < bal_first(bid + 1, nbid);
  // mt0: this thread's first m-tile
  const int quarter = bal ? (bal_sl >> 1) & 3 : (tid >> 5) & 3, mt0 = bal ? bal_sl & 1 : WG == 1 ? 0 : (tid >> 7) & 1;
  const int rtl = WG == 4 ? tid >> 8 : 0;  // this thread's row tile within the CTA
  const int SP = (PAIR || KW) ? (p.S + 1) / 2 : p.S;  // parked partials per row tile
  const int CPT = KW ? 2 * SP : SP;                    // CTAs per row tile (KW: one per m-tile and pair)
  const int rowtile = bal ? (bal_ok ? (int)(bal_sl >> 3) : 0) : (bid / CPT) * RT + rtl,
            split = bal ? 0 : KW ? (bid % CPT) % SP : bid % SP;
  // KW: the CTA's m-tile (as the record and the partial map hold it); its warpgroup w's own
  // shared-memory places are m-tile w's, as in the two-warpgroup CTA.
  const int wkw = KW ? tid >> 7 : 0, mtg = KW ? (int)((bid % CPT) / SP) : mt0;
  // An odd last row tile leaves the second of its pair empty: those warpgroups copy nothing,
  // multiply whatever their ring holds and store nothing, but keep every barrier.
  const bool rt_ok = bal ? bal_ok : RT == 1 || rowtile * 128 < p.N;
  const int kt0 = ((PAIR || KW) ? 2 * split : split) * p.kper;
  const int nrec1 = min(p.KT - kt0, p.kper);                   // the (first) slice's records
  const int nrec = PAIR ? min(p.KT - kt0, 2 * p.kper) : nrec1;  // PAIR: both slices'
  const int ktw = kt0 + wkw * p.kper;                          // this warpgroup's slice (KW)
  const uint8_t* rec0 = p.records + ((size_t)(rt_ok ? rowtile : 0) * p.KT + ktw) * kRec;
  // With PDL this grid may start while the previous kernel still runs: nothing it reads may be
  // touched before the wait (records included: a kernel before this one may have written them).
  if (p.pdl) pdl_wait();
  // The reduce kernel (S > 1) only waits for this grid's completion: let its CTAs be placed now.
  if (p.S > 1) pdl_launch_dependents();
  const uint32_t sbase = smem_u32(smem);
  // Fragment bytes of m-tile mt: hi q = 2mt, 2mt + 1 (512 B apart), lo likewise (256 B apart).
  // (In the record; in the stage the record of row tile rtl starts at rtl * kRec.)
  const uint32_t hi_off = quarter * 2048 + lane * 16 + mt0 * 1024, lo_off = 8192 + quarter * 1024 + lane * 8 + mt0 * 512;
  // ...and in the record in global memory (KW: the CTA's m-tile mtg, not the warpgroup's).
  const uint32_t hi_g = KW ? hi_off + (mtg - mt0) * 1024 : hi_off, lo_g = KW ? lo_off + (mtg - mt0) * 512 : lo_off;

  // B tile (layout 2: x in column order) as T rows of 128 B, one per token, in the 128-byte
  // swizzle: chunk ch (columns 8ch..8ch+7) of token r at r * 128 + ((ch ^ (r & 7)) << 4), i.e.
  // v1's activation tile. Piece tid + NTH u is token (tid >> 3) + kXRows u, chunk tid & 7: each warp
  // copies four whole 128-byte rows of x per instruction (four cache lines) into four
  // conflict-free 128-byte rows. Session 8 (ncu source view): the no-swizzle tile's copies of 8
  // tokens x 4 chunks per warp through L1 cost 32 shared-memory wavefronts per instruction
  // instead of 4 (7.3 M for gate_up at 64 tokens, 61 % of all) and left v4 MIO-bound.
  // Rows >= M are zeroed once below and never copied.
  // KW: each warpgroup copies its own tile (its slice's columns) with its 128 threads.
  constexpr int kXN = KW ? kThreads : NTH;      // threads copying one tile
  constexpr int kXU = (T * 8 + kXN - 1) / kXN;  // pieces per thread (T = 8: 64 pieces)
  constexpr int kXRows = kXN / 8;               // token rows between a thread's pieces (16, 32, 64)
  const int xtid = KW ? tid & (kThreads - 1) : tid, xr0 = xtid >> 3, xc0 = xtid & 7;
  const bool x_mine = xr0 < T;  // T = 8: threads 0..63
  const uint32_t xdst0 = RT * kRec + wkw * kX + xr0 * 128 + ((xc0 ^ (xr0 & 7)) << 4);
  const int xoff0 = xr0 * (int)p.ldx + 8 * xc0;  // ldx < 2^24 (gemm_check_args)
  // Piece u: kXRows * u rows further down, same chunk and the same swizzle (kXRows % 8 == 0).
  auto xrow = [](int u) { return kXRows * u; };
  const uint8_t* hi_src = rec0 + hi_g;
  const uint8_t* lo_src = rec0 + lo_g;

  // The split ring's record barriers (one per slot, one arrival: thread 0's expect_tx).
  __shared__ __align__(8) uint64_t full_bar[kSplit ? STAGES : 1];
  const uint32_t bar0 = smem_u32(&full_bar[0]);
  const int nrt = RT == 2 && (rowtile | 1) * 128 >= p.N ? 1 : RT;  // row tiles this CTA holds
  const uint8_t* recb = p.records + ((size_t)(rowtile - rtl) * p.KT + kt0) * kRec;  // the CTA's first row tile
  auto load_rec_bulk = [&](int slot, int i) {
    const uint32_t bar = bar0 + 8 * slot;
    mbar_arrive_expect_tx(bar, nrt * kRec);
    for (int r = 0; r < nrt; ++r)
      bulk_copy_g2s(sbase + slot * kStage + r * kRec, recb + ((size_t)r * p.KT + i) * kRec, kRec, bar);
  };
  auto load_stage = [&](int slot, int i) {
    const uint8_t* hs = hi_src + (size_t)i * kRec;
    const uint8_t* ls = lo_src + (size_t)i * kRec;
    const uint32_t dst = sbase + slot * kStage;
    if (rt_ok) {
#pragma unroll
      for (int q = 0; q < 2 * MTW; ++q) cp_async16(dst + rtl * kRec + hi_off + q * 512, hs + q * 512);
#pragma unroll
      for (int q = 0; q < 2 * MTW; ++q) cp_async8(dst + rtl * kRec + lo_off + q * 256, ls + q * 256);
    }
    const uint16_t* xs = p.x + (int64_t)(ktw + i) * 64;
#pragma unroll
    for (int u = 0; u < kXU; ++u)
      if (x_mine && xr0 + xrow(u) < p.M && !((p.diag & 1) && i >= STAGES))
        cp_async16_ca(dst + xdst0 + xrow(u) * 128, xs + xoff0 + xrow(u) * (int)p.ldx);
  };
  // Split ring: activation tile i into activation slot xslot.
  auto load_x = [&](int xslot, int i) {
    const uint16_t* xs = p.x + (int64_t)(kt0 + i) * 64;
    const uint32_t dst = sbase + kXBase + xslot * kX - RT * kRec + xdst0;
#pragma unroll
    for (int u = 0; u < kXU; ++u)
      if (x_mine && xr0 + xrow(u) < p.M && !((p.diag & 1) && i >= XS))
        cp_async16_ca(dst + xrow(u) * 128, xs + xoff0 + xrow(u) * (int)p.ldx);
  };
  // Rows >= M of every stage's B tile: zero once (the copies never write them); the first
  // __syncthreads of the loop orders these stores before any wgmma reads them.
#pragma unroll
  for (int u = 0; u < kXU; ++u)
    if (x_mine && xr0 + xrow(u) >= p.M)
#pragma unroll
      for (int sl = 0; sl < (kSplit ? XS : STAGES); ++sl)
        *reinterpret_cast<uint4*>(smem + (kSplit ? kXBase + sl * kX - RT * kRec : sl * kStage) + xdst0 + xrow(u) * 128) =
            make_uint4(0u, 0u, 0u, 0u);

  float acc[MTW][ND];
#pragma unroll
  for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[mt][i] = 0.f;

  constexpr int kAhead = DEEP ? STAGES - 2 : kSplit ? STAGES : STAGES - 1;  // records in flight after a refill
  if constexpr (kSplit) {
    // Records: thread 0's bulk copies; activation tiles: one cp.async group per tile.
    if (tid == 0) {
      for (int s = 0; s < STAGES; ++s) mbar_init(bar0 + 8 * s, 1);
      mbar_fence_init();
      for (int s = 0; s < STAGES; ++s)
        if (s < nrec) load_rec_bulk(s, s);
    }
#pragma unroll
    for (int s = 0; s < kXDist; ++s) {
      if (s < nrec) load_x(s, s);
      cp_async_commit();
    }
    __syncthreads();  // the barriers' initialisation before any thread waits on them
  } else {
#pragma unroll
    for (int s = 0; s < kAhead; ++s) {
      if (s < nrec) load_stage(s, s);
      cp_async_commit();
    }
  }

  // Per record: retire the previous record's wgmma (its stage and the A registers become free),
  // decode this record into registers, refill the freed stage, issue this record's 8 wgmma and
  // let them run while the next record's copies land. OVERLAP instead decodes record i into one
  // of two A buffers *before* retiring record i-1's wgmma, so decode and tensor cores overlap
  // (W12_GEMM_DIAG bit 64; identical bits either way). Measured in session 7 with ptxas no longer
  // serialising it (see the loop below): within 1-2 % of the plain form either way, so the
  // wgmma wait is not what limits this kernel.
  // Ring slots as running indices (i % STAGES cost a multiply-shift sequence, three per step).
  int rd_slot = 0, wr_slot = kAhead, rd_x = 0, wr_x = kXDist;
  uint32_t rd_phase = 0;  // split ring: parity of the phase record slot rd_slot completes next
  auto step = [&](int i, uint32_t(&buf)[16 * MTW]) {
    // Split ring: step i's activation tile is the group committed kXDist groups ago.
    cp_async_wait<kSplit ? kXDist - 1 : kAhead - 1>();
    fence_proxy_async_smem();
    const int slot = rd_slot;
    if constexpr (kSplit) {
      mbar_wait(bar0 + 8 * slot, rd_phase);
      rd_phase ^= slot == STAGES - 1 ? 1u : 0u;
    }
    rd_slot = rd_slot == STAGES - 1 ? 0 : rd_slot + 1;
    const int xslot = kSplit ? rd_x : slot;
    if constexpr (kSplit) rd_x = rd_x == XS - 1 ? 0 : rd_x + 1;
    const uint8_t* st = smem + slot * kStage + rtl * kRec;
    auto decode = [&]() {
#pragma unroll
      for (int q = 0; q < 2 * MTW; ++q) {
        const uint4 h = *reinterpret_cast<const uint4*>(st + hi_off + q * 512);
        const uint2 l = *reinterpret_cast<const uint2*>(st + lo_off + q * 256);
        decode16_split(h, l, buf + 8 * q, opaque_k38(static_cast<uint32_t>(p.M) >> 30));  // see decode16
      }
    };
    if constexpr (DEEP) {
      wgmma_wait1();  // record i-2's wgmma (this A buffer, the stage refilled below) retired
      decode();
    } else {
      if constexpr (OVERLAP) decode();
      wgmma_wait0();
#pragma unroll
      for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
        for (int k = 0; k < ND; ++k) pin(acc[mt][k]);
      if constexpr (!OVERLAP) decode();
    }
    __syncthreads();  // every thread's copies of stage i landed; every read of the refilled stage done
    if constexpr (kSplit) {
      // Record i's slot (decoded by every thread before the barrier) takes record i + STAGES
      // (the proxy fence orders those generic reads before the bulk copy's writes); record i-1's
      // activation slot (its wgmma retired above) takes tile i + kXDist.
      if (tid == 0 && i + kAhead < nrec) {
        fence_proxy_async_smem();
        load_rec_bulk(slot, i + kAhead);
      }
      if (i + kXDist < nrec) load_x(wr_x, i + kXDist);
      wr_x = wr_x == XS - 1 ? 0 : wr_x + 1;
    } else if (i + kAhead < nrec) {
      load_stage(wr_slot, i + kAhead);
    }
    cp_async_commit();
    wr_slot = wr_slot == STAGES - 1 ? 0 : wr_slot + 1;
    wgmma_fence();
    const uint32_t xb = sbase + (kSplit ? kXBase + xslot * kX : slot * kStage + RT * kRec + wkw * kX);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint64_t desc = smem_desc_sw128(xb + 32 * ks);
#pragma unroll
      for (int mt = 0; mt < MTW; ++mt) Wgmma<T>::run(acc[mt], buf + 16 * mt + 4 * ks, desc);
    }
    wgmma_commit();
  };
  if constexpr (OVERLAP || DEEP) {
    // No control-flow path may reach a decode into a buffer whose wgmma has not been retired:
    // ptxas cannot tell that a conditional second step is never followed by another pass, and
    // with `if (i + 1 < nrec) step(i + 1, a1)` inside the loop it serialised every wgmma (C7513).
    uint32_t a0[16 * MTW], a1[16 * MTW];
    int i = 0;
    for (; i + 1 < nrec; i += 2) {
      step(i, a0);
      step(i + 1, a1);
    }
    if (i < nrec) step(i, a0);
  } else if constexpr (PAIR) {
    // Slice 2j into acc, then (if the pair has a second slice) slice 2j+1 from zero; both loops
    // unconditional and no branch around the accumulator copies (ptxas serialises every wgmma of
    // a kernel that writes accumulators under a branch next to them, C7515).
    uint32_t a[16 * MTW];
    int i = 0;
    for (; i < nrec1; ++i) step(i, a);
    wgmma_wait0();
    float first[MTW][ND];
#pragma unroll
    for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
      for (int k = 0; k < ND; ++k) {
        pin(acc[mt][k]);
        first[mt][k] = acc[mt][k];
        acc[mt][k] = 0.f;
      }
    for (; i < nrec; ++i) step(i, a);
    wgmma_wait0();
    const bool two = nrec > nrec1;
#pragma unroll
    for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
      for (int k = 0; k < ND; ++k) {
        pin(acc[mt][k]);
        acc[mt][k] = two ? __fadd_rn(first[mt][k], acc[mt][k]) : first[mt][k];
      }
  } else {
    uint32_t a[16 * MTW];
    for (int i = 0; i < nrec; ++i) step(i, a);
  }
  wgmma_wait0();
#pragma unroll
  for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
    for (int k = 0; k < ND; ++k) pin(acc[mt][k]);
  cp_async_wait<0>();
  if constexpr (KW) {
    // The pair's sum, p_2j + p_2j+1 (add_slice's first add), in warpgroup 0; warpgroup 1 hands
    // its partial over through stage 0 (every wgmma of both retired, every copy landed).
    float* xch = reinterpret_cast<float*>(smem) + (tid & (kThreads - 1));
    __syncthreads();
    if (wkw == 1) {
#pragma unroll
      for (int k = 0; k < ND; ++k) xch[k * kThreads] = acc[0][k];
    }
    __syncthreads();
    if (wkw == 1) return;
#pragma unroll
    for (int k = 0; k < ND; ++k) acc[0][k] = __fadd_rn(acc[0][k], xch[k * kThreads]);
  }

  // Epilogue of fragment (mt, j): rows nbase + 16mt + g (+8), tokens 8j + 2t (+1).
  const int nbase = rowtile * 128 + quarter * 32;
  auto store = [&](const float (&v)[4], int mt, int j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int n = nbase + 16 * mt + g + 8 * (i >> 1);
      const int m = 8 * j + 2 * t + (i & 1);
      if (n < p.N && m < p.M) {
        const uint32_t b = __ldg(p.base + n);
        const float sc = row_scale(b);
        float y = v[i] * sc;
        const int e0 = __ldg(p.esc_ptr + n), e1 = __ldg(p.esc_ptr + n + 1);
        if (e0 < e1) y = fix_escapes(y, sc, e0, e1, m, p);
        if (p.bias) y = __fadd_rn(y, __ldg(p.bias + n));
        p.y[(int64_t)m * p.ldy + n] = __bfloat16_as_ushort(__float2bfloat16_rn(y));
      }
    }
  };
  if (bal && !rt_ok) return;  // no barrier after this point on the balanced form (NCH <= 4)
  if (p.S == 1) {
    if (!(p.diag & 2)) {
      if constexpr (NCH <= 4) {
        static_assert(NTH / 32 * store_rows_tile_bytes(NCH, MTW) <= RT * kRec, "store_rows' tiles in record slot 0");
        store_rows<NCH, MTW>(acc, nbase, mt0, g, t, smem, p);
      } else {
        store_rows_smem<NCH, MTW, WG>(acc, smem, (bid / p.S) * RT * 128, p);
      }
      return;
    }
#pragma unroll
    for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
      for (int j = 0; j < NCH; ++j) {
        const float v[4] = {acc[mt][4 * j], acc[mt][4 * j + 1], acc[mt][4 * j + 2], acc[mt][4 * j + 3]};
        store(v, mt0 + mt, j);
      }
    return;
  }
  // K split: park the partial in v1's order ([tile][slice][fragment][thread], fragment mt*NCH + j
  // holding rows 16mt + g (+8), tokens 8j + 2t (+1): the same map as v1's 4-warp CTA), and v1's
  // PDL reduce kernel sums the slices in add_slice's order and runs the epilogue. This replaced a
  // thread-block cluster per row tile, which v1 measured slower at every M (docs/perf-notes.md).
  if (!rt_ok) return;
  // Parked evict_last: the weights streaming behind them would otherwise push them out of L2, and
  // the reduce kernel would wait on their write-back and refetch (session 28: down -1.9 us at 64
  // tokens, the decode-step graph set -1.7 %; docs/perf-notes.md). The reduce kernel reads them
  // evict_first, which hands their lines back. Chunks of padding tokens only (8j >= M) are not
  // parked (diagnostic 131072: they are): the reduce kernel has no CTA for them (chunks_parked).
  float4* mine = p.ws + ((size_t)rowtile * SP + split) * (2 * NCH * kThreads) + (tid & (kThreads - 1));
  const uint64_t keep = l2_policy_evict_last();
#pragma unroll
  for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
    for (int j = 0; j < NCH; ++j)
      if (chunk_parked(j, p.M, p.diag))
        st_global_policy(mine + ((mtg + mt) * NCH + j) * kThreads,
                         make_float4(acc[mt][4 * j], acc[mt][4 * j + 1], acc[mt][4 * j + 2], acc[mt][4 * j + 3]), keep);
#endif
}

// smem_min: shared memory asked for beyond the ring, to cap the CTAs an SM holds (PDL, below).
template <int NCH, int STAGES, bool OVERLAP, int WG, bool DEEP = false, bool PAIR = false, int XS = 0, bool KW = false>
cudaError_t launch_w(const WParams& p, int grid, int smem_min, cudaStream_t stream) {
  constexpr int rt = WG == 4 ? 2 : 1;
  int smem = max(XS ? STAGES * rt * kRec + XS * NCH * 8 * 128 : STAGES * (rt * kRec + (KW ? 2 : 1) * NCH * 8 * 128), smem_min);
  if (NCH >= 8 && p.S == 1) smem = max(smem, epilogue_smem_bytes(NCH, rt));
  constexpr auto kern = gemm_w12_wgmma_kernel<NCH, STAGES, OVERLAP, WG, DEEP, PAIR, XS, KW>;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if ((e = set_smem_limit_once<kern>(dev, smem)) != cudaSuccess) return e;
  return launch_ex(kern, dim3(grid), dim3(kThreads * WG), smem, stream, 1, p.pdl != 0, p);
}

// The overlap form exists with 3 stages only. wg: warpgroups per CTA (4 = row-tile pairs, from
// 32 tokens up only); 65..128 tokens take 2 or 4 (one warpgroup would need 128 accumulators per
// thread).
template <int NCH>
cudaError_t launch_pick(int stages, bool overlap, int wg, const WParams& p, int grid, int smem_min,
                        cudaStream_t stream, bool pair = false, bool split_ring = false, bool kw = false) {
  // (kw: NCH <= 2 only.)
  if constexpr (NCH == 1) {
    // Bulk-copied records at 1-2 tokens (BULK below): the split ring, 4 record slots, 3
    // activation-tile slots.
    if (split_ring) return launch_w<1, 4, false, 2, false, false, 3>(p, grid, smem_min, stream);
  }
  if constexpr (NCH == 16) {
    // The split ring: 3 record slots (72 KB), 6 activation-tile slots (96 KB).
    if (split_ring) return launch_w<16, 3, true, 4, false, false, 6>(p, grid, smem_min, stream);
  }
  if constexpr (NCH <= 2) {
    if (kw)
      return stages == 3 ? launch_w<NCH, 3, false, 2, false, false, 0, true>(p, grid, smem_min, stream)
                         : launch_w<NCH, 4, false, 2, false, false, 0, true>(p, grid, smem_min, stream);
  }
  if constexpr (NCH <= 8) {
    if (pair)
      return stages == 3 ? launch_w<NCH, 3, false, 2, false, true>(p, grid, smem_min, stream)
                         : launch_w<NCH, 4, false, 2, false, true>(p, grid, smem_min, stream);
  }
  if constexpr (NCH >= 4) {
    if (wg == 4) {
      if (overlap) return launch_w<NCH, 3, true, 4>(p, grid, smem_min, stream);
      return stages == 3 ? launch_w<NCH, 3, false, 4>(p, grid, smem_min, stream)
                         : launch_w<NCH, 4, false, 4>(p, grid, smem_min, stream);
    }
  }
  if constexpr (NCH == 16) {
    if (overlap) return launch_w<16, 3, true, 2>(p, grid, smem_min, stream);
    return stages == 3 ? launch_w<16, 3, false, 2>(p, grid, smem_min, stream)
                       : launch_w<16, 4, false, 2>(p, grid, smem_min, stream);
  } else {
    const bool two_wg = wg == 2;
    if constexpr (NCH <= 2) {
      if (stages == kDeepStages && two_wg && !overlap) return launch_w<NCH, kDeepStages, false, 2, true>(p, grid, smem_min, stream);
    }
    if (overlap)
      return two_wg ? launch_w<NCH, 3, true, 2>(p, grid, smem_min, stream) : launch_w<NCH, 3, true, 1>(p, grid, smem_min, stream);
    if (stages == 3)
      return two_wg ? launch_w<NCH, 3, false, 2>(p, grid, smem_min, stream) : launch_w<NCH, 3, false, 1>(p, grid, smem_min, stream);
    return two_wg ? launch_w<NCH, 4, false, 2>(p, grid, smem_min, stream) : launch_w<NCH, 4, false, 1>(p, grid, smem_min, stream);
  }
}

// Shared memory per CTA (ring, 1 KB reserved per CTA) at `stages` deep for 8*nch tokens and rt
// row tiles per CTA; xt activation tiles per stage (KW: 2).
static int ring_bytes(int stages, int nch, int rt = 1, int xt = 1) {
  return stages * (rt * kRec + xt * nch * 8 * 128) + kSmemReservedPerCta;
}

// Self-test of the wgmma building blocks above, independent of the W12 decode: D[64x16] = A B^T
// for A [64][16] and B [16 tokens][16] BF16 row-major, A through the register fragment layout
// the GEMM relies on, B through the no-swizzle K-major descriptor (LBO = 16 tokens x 16 B = 256,
// SBO = 128: distinct, so a swap shows), D read back through the accumulator layout.
__global__ void __launch_bounds__(kThreads) wgmma_selftest_kernel(const uint16_t* A, const uint16_t* B, float* D) {
#if W12_WGMMA
  __shared__ __align__(128) uint8_t sb[16 * 16 * 2];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  for (int e = tid; e < 256; e += kThreads) {
    const int n = e >> 4, kappa = e & 15;  // B[n][kappa]
    const int off = (kappa >> 3) * 256 + (n >> 3) * 128 + (n & 7) * 16 + (kappa & 7) * 2;
    *reinterpret_cast<uint16_t*>(sb + off) = B[e];
  }
  auto pair = [&](int row, int col) {
    return static_cast<uint32_t>(A[row * 16 + col]) | (static_cast<uint32_t>(A[row * 16 + col + 1]) << 16);
  };
  const int r0 = 16 * warp + g;
  const uint32_t a[4] = {pair(r0, 2 * t), pair(r0 + 8, 2 * t), pair(r0, 2 * t + 8), pair(r0 + 8, 2 * t + 8)};
  float d[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  fence_proxy_async_smem();
  __syncthreads();
  wgmma_fence();
  Wgmma<16>::run(d, a, smem_desc(smem_u32(sb), 256, 128));
  wgmma_commit();
  wgmma_wait0();
#pragma unroll
  for (int k = 0; k < 8; ++k) pin(d[k]);
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) D[(r0 + 8 * (i >> 1)) * 16 + 8 * j + 2 * t + (i & 1)] = d[4 * j + i];
#endif
}

}  // namespace

// cudaSuccess on an sm_90 device (the only one with wgmma), else the reason; `dev` and `di`: the
// current device and its cached properties (no driver query per launch after the first).
static cudaError_t require_sm90(DevInfo& di, int& dev) {
  if (cudaError_t e = dev_info(di, dev); e != cudaSuccess) return e;
  return (di.major == 9 && di.minor == 0) ? cudaSuccess : cudaErrorNoKernelImageForDevice;
}

// cudaSuccess when this library holds real sm_90a code for the kernels here. A library whose only
// code for sm_90 is PTX of an older architecture (JIT-compiled at load) would run these kernels
// with their bodies compiled out (W12_WGMMA is 0 there) and write nothing: csrc/build.py used to
// give this file nvcc's default target (compute_75 PTX) in builds without 90a, and no longer does
// (gencode_for). An sm_80-only cubin does not load on sm_90 at all (session 9 checked: "no kernel
// image"). Checked once per device.
static cudaError_t require_sm90a_image(int dev) {
  static int state[64] = {0};  // 0 unknown, 1 real sm_90a code, -1 not
  if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
  if (state[dev] == 0) {
    cudaFuncAttributes fa;
    const cudaError_t e = cudaFuncGetAttributes(&fa, gemm_w12_wgmma_kernel<1, 3, false, 2>);
    if (e != cudaSuccess) return e;
    state[dev] = fa.binaryVersion == 90 ? 1 : -1;
  }
  return state[dev] == 1 ? cudaSuccess : cudaErrorNoKernelImageForDevice;
}

cudaError_t wgmma_image_check() {
  DevInfo di;
  int dev = 0;
  if (cudaError_t e = require_sm90(di, dev); e != cudaSuccess) return e;
  return require_sm90a_image(dev);
}

cudaError_t wgmma_selftest_launch(const uint16_t* A, const uint16_t* B, float* D, cudaStream_t stream) {
  DevInfo di;
  int dev = 0;
  if (cudaError_t e = require_sm90(di, dev); e != cudaSuccess) return e;
  if (cudaError_t e = require_sm90a_image(dev); e != cudaSuccess) return e;
  wgmma_selftest_kernel<<<1, kThreads, 0, stream>>>(A, B, D);
  return cudaGetLastError();
}

// PAIR's rule for a two-warpgroup CTA (see the launcher): nt 128-row tiles cut into S slices.
// Not where the pair grid would load its busiest SM with more than 1.5x the plain grid's records:
// qkv [6144, 4096] in 8 slices (192 pair CTAs: 2 x 16 records on the busiest SM against 3 x 8)
// gains with pairs, in 5 slices (144 pair CTAs: 2 x 26 on 12 SMs against 2 x 13) it lost a third
// (session 41: 19.7 against 15.0 us at 32 tokens).
static bool pair_grid(int nt, int S, int tokens, int sms, int flags) {
  if (S < 2 || tokens > 64 || (flags & 64) || (flags & kNoPairs)) return false;  // NCH <= 8 only
  if (flags & kPairsAll) return true;
  const long pair_ctas = (long)nt * ((S + 1) / 2), plain_ctas = (long)nt * S;
  return S >= 4 && tokens > 16 && tokens <= 32 && pair_ctas >= sms &&
         4 * ((pair_ctas + sms - 1) / sms) <= 3 * ((plain_ctas + sms - 1) / sms);
}

// Row-tile pairs (four warpgroups, two 128-row tiles per CTA) for nch token chunks, nt row tiles
// in S K slices of kper records, on sms SMs; see the launcher.
static int wgmma_warpgroups(int nch, int nt, int S, int kper, int sms, int flags) {
  int wg = (flags & kOneWarpgroup) && nch <= 8 ? 1 : 2;
  const bool pairs = nch == 16 ? kper >= 16 : nch == 8 && S == 1 && nt >= 2 * sms;
  if (((flags & kRowPairs) && nch >= 4) || (pairs && !(flags & kNoRowPairs))) wg = 4;
  return wg;
}

// The split ring (session 18) and, within it, NB (sessions 37-38): see the launcher.
static bool split_ring(int nch, int wg, bool ov, int flags) { return nch == 16 && wg == 4 && ov && !(flags & 4096); }
static bool nobar_form(int nch, int wg, bool sr, int flags) {
  return (nch == 16 ? sr : nch == 8 && wg == 4 && !(flags & 4096)) && !(flags & (kDeep | 3));
}
// NB's consumer warpgroups for a pass at 33..128 tokens (0: not NB). Triples (3, session 39) on a
// split weight at 65..128 tokens where m-tile triples load the busiest SM with fewer m-tile slices
// than pairs (four m-tiles) would: qkv [6144, 4096] in 8 slices (its split until session 41; 5
// since, where this rule declines triples) 128 units of three m-tiles and a slice pair
// (6 m-tile slices a CTA) against 192 pair units (8 on the busiest SMs), where v4's
// single-row-tile grid runs 384 CTAs of 2 m-tiles at two per SM with a CTA barrier per record:
// 25.8 -> 23.3 us at 128 tokens, 24.5 -> 22.9 at 65 (docs/perf-notes.md; o, down and every weight
// at 33-64 tokens slower with them). Diagnostic 1024 (the DEEP loop's "never", inert above 16
// tokens): never triples; 16384 (BULK's "never", inert above 2 tokens): triples on every split
// weight at 33..128 tokens. Then pairs where nobar_form says.
static int nobar_consumers(int nch, int nt, int S, int wg, bool sr, int sms, int flags) {
  if (nch >= 8 && S > 1 && !(flags & (kDeep | 3 | kNoTriples))) {
    // m-tile slices on the busiest SM: a triple unit holds 3 m-tiles x a slice pair, a pair unit
    // 4 m-tiles x one slice.
    const long u3 = nb_units(3, nt, S), u2 = nb_units(4, nt, S);
    if ((flags & kTriplesAll) || (nch == 16 && 3 * 2 * ((u3 + sms - 1) / sms) < 4 * ((u2 + sms - 1) / sms)))
      return 3;
  }
  return nobar_form(nch, wg, sr, flags) ? 4 : 0;
}

int wgmma_nobar(int N, int K, int tokens, int target_ctas, int sms, int flags) {
  if (tokens <= 32 || tokens > kMaxTokens) return 0;
  const int nch = tokens > 64 ? 16 : 8, nt = (N + 127) / 128;
  const int kt = (K + 63) / 64, S = gemm_splits(N, K, target_ctas, sms, 4), kper = (kt + S - 1) / S;
  const bool ov = ((flags & 64) != 0) != (nch == 16);  // as the launcher's
  const int wg = wgmma_warpgroups(nch, nt, S, kper, sms, flags);
  return nobar_consumers(nch, nt, S, wg, split_ring(nch, wg, ov, flags), sms, flags);
}

int wgmma_sk_lanes(int N, int K, int tokens, int target_ctas, int sms, int flags) {
  if (gemm_splits(N, K, target_ctas, sms, 4) != 1 || wgmma_nobar(N, K, tokens, target_ctas, sms, flags) != 4) return 0;
  return nb_sk_lanes((N + 127) / 128, tokens, sms, flags);
}

bool wgmma_pair_grid(int N, int K, int tokens, int target_ctas, int sms, int flags) {
  if ((flags & kOneWarpgroup) && tokens <= 64) return false;  // WG = 1: the pair grid needs two
  if ((flags & kRowPairs) && tokens > 16) return false;       // WG = 4 from 17 tokens up
  return pair_grid((N + 127) / 128, gemm_splits(N, K, target_ctas, sms, 4), tokens, sms, flags);
}

cudaError_t gemm_wgmma_launch(const GemmArgs& a, cudaStream_t stream) {
  if (cudaError_t e0 = gemm_check_args(a); e0 != cudaSuccess) return e0;
  if (a.M == 0) return cudaSuccess;
  const int nt = (a.N + 127) / 128, kt = (a.K + 63) / 64;
  DevInfo di;
  int dev = 0;
  cudaError_t e = require_sm90(di, dev);  // wgmma is sm_90a only
  if (e != cudaSuccess) return e;
  if ((e = require_sm90a_image(dev)) != cudaSuccess) return e;
  WParams p{};
  static_cast<GemmOperands&>(p) = a;
  p.N = a.N;
  p.KT = kt;
  // v1's rule (a function of N, K and the SM count) and v1's cap, with v4's fill (gemm_splits).
  p.S = gemm_splits(a.N, a.K, a.target_ctas, di.sms, 4);
  p.ws = static_cast<float4*>(a.workspace);
  if (p.S > 1 && p.ws == nullptr) return cudaErrorInvalidValue;
  p.kper = (kt + p.S - 1) / p.S;
  p.ldx = a.ldx;
  p.ldy = a.ldy;
  p.pdl = (a.flags & 32) ? 0 : 1;  // diagnostic 32 = no PDL (the Python rule sets it: W12_GEMM_PDL)
  p.diag = a.flags & (3 | kParkEveryChunk);
  for (int m0 = 0; m0 < a.M; m0 += kMaxTokens) {
    const int tokens = (a.M - m0) < kMaxTokens ? (a.M - m0) : kMaxTokens;
    p.x = a.x + (int64_t)m0 * a.ldx;
    p.y = a.y + (int64_t)m0 * a.ldy;
    p.M = tokens;
    // Whole-K clusters (gemm_w12_wholek_sm90.cu, session 15) where they fit at <= 16 tokens: the
    // same bits as the split grid and its reduce kernel, without that kernel.
    // Diagnostics 16, 131072 and 1048576 move the rule (wholek_stages).
    if (const int wst = wholek_stages(a.N, a.K, p.S, tokens, di.sms, di.smem_sm, di.smem_optin, a.stages, a.flags)) {
      if ((e = gemm_wholek_launch(a, m0, tokens, p.S, wst, p.pdl != 0, stream)) != cudaSuccess) return e;
      continue;
    }
    const int nch = tokens <= 8 ? 1 : tokens <= 16 ? 2 : tokens <= 32 ? 4 : tokens <= 64 ? 8 : 16;
    // XT (xt_blocks): v4's counters argument is the stream's XT scratch (w12_gemm_counters), used
    // where the shared-memory epilogue runs (not with diagnostic 2, whose per-output epilogue would
    // leave the counts set). Diagnostic 32768: never. p.ws carries it (unused by unsplit grids).
    if (p.S == 1)
      p.ws = nch >= 8 && !(a.flags & 2) && !(a.flags & kNoXt) && a.counters != nullptr ? reinterpret_cast<float4*>(a.counters)
                                                                                       : nullptr;
    // Two warpgroups per CTA unless diagnostic 524288 asks for one (session 9: M = 64 -3 %
    // geomean). Row-tile pairs (4 warpgroups, half the activation-tile traffic per record) at
    // 65..128 tokens where a CTA streams >= 16 records (session 10: lm_head 451 -> 406 us at 128
    // tokens, qkv's 8-record CTAs slower; slower at 32-64); diagnostic 262144 from 33 tokens up.
    // Diagnostic 8 keeps single row tiles at 33..128 tokens (session 14: gate_up's 112 pair CTAs
    // leave 20 of 132 SMs idle). At 33..64 tokens pairs (as NB, below) on unsplit weights of >= 2
    // row tiles per SM (session 38: 32B [51200, 5120] 127.0 -> 113.0 us at 64 tokens, lm_head
    // 211.8 -> 209.5; gate_up's 112 CTAs +2.5 us, the split weights slower).
    const int wg = wgmma_warpgroups(nch, nt, p.S, p.kper, di.sms, a.flags);
    const int rt = wg == 4 ? 2 : 1;
    // The pair grid (PAIR, session 17) at 17..32 tokens on weights of >= 4 slices whose pair grid
    // still covers the SMs (qkv: 384 -> 192 CTAs, 15.9 -> 15.3 us at 32 tokens; o, down and 32B
    // [5120, 25600], which it would leave SMs idle, lost; at 33..64 qkv 0.2-0.5 us slower than
    // without it, session 38). Diagnostic 512: every split grid up to 64 tokens, 128: never. Same
    // bits (add_slice's order).
    const int tiles = (nt + rt - 1) / rt;
    const bool pair = wg == 2 && pair_grid(nt, p.S, tokens, di.sms, a.flags);
    const int sp = pair ? (p.S + 1) / 2 : p.S;  // CTAs per row tile
    int grid = tiles * sp;
    // The overlap form (decode of record i+1 behind record i's wgmma): the default at 65..128
    // tokens, where four m64n128k16 per record are long enough to hide it (session 10: Llama
    // geomean 0.604 -> 0.633); diagnostic 64 flips it (on up to 64 tokens, off above).
    const bool ov = ((a.flags & 64) != 0) != (nch == 16);
    // Ring depth (W12_GEMM_STAGES = 3 or 4 forces one): wave_stages() (session 9: 3 on the
    // many-CTA grids at <= 16 tokens, 4 on the small ones and on gate_up at 64 tokens).
    // KW (session 34, docs/perf-notes.md): at <= 16 tokens, where the plain two-warpgroup loop
    // would run a split grid of an even number of equal slices at more than two CTAs per SM (qkv
    // in 8 slices before session 41: 384 CTAs, three per SM, the only such grid measured), m-tile x
    // pair CTAs park one partial per pair, so that the reduce kernel's 4-partial slot form fits
    // beside them: qkv -0.42..0.52 us at 1-16 tokens; o (two per SM) level at 1-8, o and down
    // slower at 32-64 (each warpgroup's own activation tile). Same bits (add_slice's order). Not
    // where DEEP runs.
    bool kw = wg == 2 && !pair && !ov && p.S >= 2 && p.S % 2 == 0 && p.S * p.kper == kt && nch <= 2 &&
              (long)nt * p.S > 2L * di.sms;
    int st = wave_stages(grid, di, ring_bytes(3, nch, rt, kw ? 2 : 1), nch == 8);
    if (a.stages == 3 || a.stages == 4) st = a.stages;
    // The DEEP loop (6 stages) on request only (diagnostic 256: at every grid up to 16 tokens).
    // Session 16 took it for K slices of <= 8 records at 9..16 tokens on grids of <= 2 CTAs per SM
    // (o: 10.8 -> 10.25 us at 16 tokens); by session 42 the plain loop ran o 0.1-0.2 us faster
    // there (docs/perf-notes.md), and it lost at 1-8 tokens and on longer slices throughout.
    const bool deep_fits = nch <= 2 && wg == 2 && !ov && !pair && a.stages == 0 && !(a.flags & kNoDeep);
    if (deep_fits && (a.flags & kDeep)) st = kDeepStages;
    if (st == kDeepStages) kw = false;
    const int xt = kw ? 2 : 1;
    int parts = kw ? p.S / 2 : sp;  // parked partials per row tile
    // The balanced unsplit grid (BAL, session 20) at <= 32 tokens where the 128-row tiles leave
    // some SMs two and others one (gate_up: 224 tiles): 2 x SMs CTAs of 6-7 16-row slices, at most
    // two per SM (the shared-memory cap below); gate_up -0.2..1.1 us. Diagnostic 8192: never.
    // Bulk-copied records (BULK, session 22) at 1-2 tokens there instead: the split ring (one bulk
    // copy per record by thread 0, 4 records in flight) on the 128-row CTAs; gate_up -0.3..0.9 us
    // at 1-2 tokens, slower at 4-16 and on multi-wave grids. Diagnostic 16384: never. Same bits
    // either way. (A forced ring depth, W12_GEMM_STAGES, keeps BAL.)
    const bool bal_form = p.S == 1 && wg == 2 && nch <= 4 && !ov && st != kDeepStages && !(a.flags & kNoBalance);
    const bool bal_shape = bal_form && nt > di.sms && nt < 2 * di.sms;
    const bool bulk_rec = bal_shape && tokens <= 2 && a.stages == 0 && !(a.flags & kNoBulkRecords);
    if (bulk_rec) st = 4;  // its record slots (launch_pick fixes the form): what the cap below sizes for
    p.bal = 0;
    if (bal_shape && !bulk_rec) {
      p.bal = 1;
      grid = 2 * di.sms;
    }
    // BALT (session 35, docs/perf-notes.md): unsplit grids of >= 2 tiles per SM at <= 32 tokens
    // run their full rounds as 128-row CTAs and deal the last round's 16-row slices out over a
    // round of BAL's CTAs that fills every place (4 per SM: the plain CTA's launch bounds), where
    // that round is at least half full. 32B [51200, 5120] (400 tiles: one round) -1.0..4.3 us at
    // 1-16 tokens and -9.3..12.4 at 24-32 in three calls, lm_head (1002 tiles) level: a balanced
    // CTA keeps a 128-row CTA's step time, so the SMs end where the first round left them. At
    // 33-64 tokens slower on both (+6..32 us). Diagnostic 8192: never. Same bits (BAL's).
    if (bal_form && nt >= 2 * di.sms) {
      const int per_sm = min(4, di.smem_sm / ring_bytes(st, nch));
      const long places = (long)per_sm * di.sms, rounds = (nt + places - 1) / places;
      const long last = nt - (rounds - 1) * places;  // tiles in the last round
      if (per_sm >= 1 && last < places && 2 * last >= places && (long)nt * 8 * places < (1L << 32)) {
        p.bal = 1 + (int)((rounds - 1) * places);
        grid = (int)(rounds * places);
      }
    }
    // XT helpers (see xt_of): 4 of x's 64-column blocks each, ahead of the row-tile CTAs.
    p.xth = p.S == 1 && p.ws != nullptr ? (kt + kXtBlocksPerHelper - 1) / kXtBlocksPerHelper : 0;
    grid += p.xth;
    // With PDL the CTAs are placed while the previous kernel still holds SMs; capped at what an
    // even spread needs (ceil(grid / SMs) per SM, through the shared-memory request) so that they
    // cannot pile onto the SMs free first (session 9: uncapped, the decode-step graph set went
    // 0.878 -> 0.934 of cuBLAS; capped, 0.847). The request is the least that keeps cap + 1 CTAs
    // (each with the SM's 1 KB reservation) from fitting, so that what the carveout leaves takes a
    // reduce-kernel CTA (session 31: 1 KB more per CTA left it 2 bytes short).
    int smem_min = 0;
    // (The balanced grid's even spread needs the cap with or without PDL.)
    if (p.pdl || p.bal) {
      const int cap = (grid + di.sms - 1) / di.sms;
      if (cap < di.smem_sm / ring_bytes(st, nch, rt, xt))
        smem_min = di.smem_sm / (cap + 1) - kSmemReservedPerCta + 1;
    }
    // The split ring (session 18) for row-tile pairs at 65..128 tokens: activation tiles five
    // steps ahead, records three (bulk copies); lm_head -2 % at 128 tokens, down -3 %. At 32-64
    // tokens no ring shape was faster on every weight. Diagnostic 4096: never. Same bits.
    const bool sr = split_ring(nch, wg, ov, a.flags);
    // NB (gemm_w12_nobar_sm90.cu): the split ring's grids without its CTA barrier per record, a
    // producer warpgroup feeding the four consumers (session 38: gate_up 67.3 -> 57.8 us at 128
    // tokens, lm_head 321 -> 260, down 37.1 -> 35.5; session 37's in-loop hand-offs lost).
    // Row-tile pairs at 33-64 tokens (wgmma_warpgroups' rule, or diagnostic 262144) take NB too.
    // Diagnostic 256 (the DEEP loop's bit, which acts at <= 16 tokens only) keeps the loops with the
    // CTA barrier here (the split ring at 65-128), as do 4096 and diagnostics 1 and 2 (NB has no
    // form for them). Same bits.
    const int nbc = nobar_consumers(nch, nt, p.S, wg, sr, di.sms, a.flags);
    bool red_pairs = pair || kw;  // the reduce kernel's partials: one per slice pair
    if (nbc) {
      // SK (gemm_w12_nobar_sm90.cu, session 44): multi-wave unsplit pair grids as stream-K lanes,
      // where the caller gave the parked accumulators' workspace and the flags' counters.
      const int sk = p.S == 1 && nbc == 4 && a.workspace != nullptr && a.counters != nullptr
                         ? nb_sk_lanes(nt, tokens, di.sms, a.flags)
                         : 0;
      e = gemm_nobar_launch(a, m0, tokens, p.S, p.kper, p.ws, p.xth, p.pdl != 0, nbc, di.sms, smem_min, sk, stream);
      if (p.S > 1) grid = di.sms;  // at most one CTA an SM (the reduce kernel's slot rule below)
      parts = nb_parts(nbc, p.S);  // triples park one partial per slice pair
      red_pairs = red_pairs || parts != p.S;
    } else if (nch == 1) e = launch_pick<1>(st, ov, wg, p, grid, smem_min, stream, pair, bulk_rec, kw);
    else if (nch == 2) e = launch_pick<2>(st, ov, wg, p, grid, smem_min, stream, pair, false, kw);
    else if (nch == 4) e = launch_pick<4>(st, ov, wg, p, grid, smem_min, stream, pair);
    else if (nch == 8) e = launch_pick<8>(st, ov, wg, p, grid, smem_min, stream, pair);
    else e = launch_pick<16>(st, ov, wg, p, grid, smem_min, stream, false, sr);
    if (e != cudaSuccess) return e;
    // Diagnostic 65536 (wrong output): no reduce kernel, so that a benchmark can tell the GEMM
    // grid's time from the reduction's (session 13, docs/perf-notes.md).
    // The reduce kernel's escape slots (EscapeSlots) where the GEMM grid holds <= 2 CTAs per SM,
    // or 3 and <= 4 partials (the 4-partial slot form's 114 registers fit beside them: each SM
    // sub-partition keeps 4096 of its 16384 for a warp after six 64-register GEMM warps).
    const bool slots = grid <= 2 * di.sms || (grid <= 3 * di.sms && parts <= 4);
    if (p.S > 1 && !(a.flags & 65536) &&
        (e = gemm_reduce_launch(a, m0, tokens, parts, stream, red_pairs, slots)) != cudaSuccess)
      return e;
  }
  return cudaSuccess;
}

}  // namespace w12
