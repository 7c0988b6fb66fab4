// W12 GEMM v4 at 33-128 tokens on row-tile-pair grids, without a CTA-wide barrier per
// record (NB; session 37 built it with in-loop hand-offs, session 38 with a producer warpgroup).
// Same consumers as v4's split ring (gemm_w12_wgmma_sm90.cu, session 18): four warpgroups,
// warpgroup w on m-tile w & 1 of row tile w >> 1, records bulk-copied per row-tile pair, one
// activation tile per step (128 tokens at 65-128, 64 at 33-64); the same decode, the same four
// m64nTk16 wgmma per record in the same order, the same epilogues, so the same bits. Where: the
// split ring's grids at 65-128 tokens and unsplit weights of >= 2 row tiles per SM at 33-64
// (the launcher, gemm_w12_wgmma_sm90.cu). Triples (session 39): three consumer warpgroups on three
// consecutive m-tiles of a split weight whose 8-record slices would leave pairs' units unevenly
// spread (qkv: 192 pair units on 132 SMs); a unit runs a slice pair and parks one partial for it
// (the PAIR grid's sum), so the reduce kernel reads half the partials; at most one CTA an SM,
// running its units back to back, its producer filling the ring with the next slice's records
// while the consumers park.
//
// Why (docs/perf-notes.md, sessions 37-38, benchmarks/probes/probe_wgmma_issue.cu): a wgmma blocks
// its warpgroup at issue while the tensor pipe holds other warpgroups' wgmma (~415 of 1024 cycles
// per step at four warpgroups). With a __syncthreads per record every warpgroup decodes at the
// same time, so the tensor pipe idles through the decodes: v4's step measured 1.30-1.45x the
// tensor time in shared memory alone, 1.00-1.02x with no CTA barrier. Session 37's forms without
// the barrier lost more to their hand-offs (200-450 cycles a warp and step: a shared atomic whose
// result was awaited, an arrival per warp, refills waiting for thread 0's schedule) than the
// barrier costs. Here the hand-offs are the ones Hopper's warp-specialised GEMMs use:
// - a fifth warpgroup produces (setmaxnreg: 24 registers, the consumers 112): one thread waits for
//   a stage's empty barrier and refills it;
// - a stage holds a record pair and its activation tile (one TMA box of 64 columns x T tokens,
//   128-byte swizzle, rows >= M zero from the tensor map's bounds) behind one full barrier;
// - one thread per consumer warpgroup releases stage i once a wgmma.wait_group at step i + 1 has
//   retired the warpgroup's wgmma of step i: they read the tile and, through their register
//   operand, every value the warpgroup's four warps loaded from the records, so no warp needs to
//   say more (four arrivals a stage, none awaited).
// - Half a record's wgmma stay in flight while the next half is decoded (the loop, below).
//
// SK (session 44, template flag SK; nb_sk_lanes: at 33-64 tokens, and at 65-128 where one unit a
// CTA's last round would be mostly empty): an unsplit weight with more row-tile pairs than SMs
// runs as one persistent lane an SM (sk_segment in gemm_w12_mma.cuh: the head of a cut chain
// first, parked with a flag per warpgroup, the tail last, continued from the parked
// accumulators). Each epilogue still takes the ring over: the producer waits on `epid`,
// which the consumers arrive on past it, before it copies the next segment's records. No XT helper
// CTAs (they held the last lanes' SMs): the producer warpgroup's idle warps transpose x. 32B [51200,
// 5120] -7 % at 64 tokens and -3..5 % at 96-128, lm_head -1 % at 64 (docs/perf-notes.md, s45).
#include <cuda.h>
#include <cudaTypedefs.h>
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

// WGC consumer warpgroups (4: row-tile pairs; 3: m-tile triples, split weights only) + the producer.
constexpr int nb_consumers(int wgc) { return wgc * kThreads; }
constexpr int nb_threads(int wgc) { return nb_consumers(wgc) + kThreads; }
constexpr int kNbRecBytes = 2 * kRec;             // a stage's two record slots
// Per 8-token chunk count NCH (16: 65-128 tokens, 8: 33-64): the activation tile's bytes (NCH * 8
// token rows of 64 BF16 columns), a stage's (a multiple of 1024: the tiles stay swizzle-aligned),
// the stages (200 and 192 KB).
constexpr int nb_x_bytes(int nch) { return nch * 8 * 128; }
constexpr int nb_stage_bytes(int nch) { return kNbRecBytes + nb_x_bytes(nch); }
constexpr int nb_stages(int nch) { return nch == 16 ? 5 : 6; }
constexpr int nb_smem_bytes(int nch) { return nb_stages(nch) * nb_stage_bytes(nch); }
// setmaxnreg moves registers within the CTA's own allocation (ptxas gives each of the 640 threads
// 65536 / 640 rounded down to a multiple of 8 at launch): what the consumers take beyond it, the
// producer must have given back, or their setmaxnreg.inc waits forever. (Triples: 512 threads
// start with 128 registers each, more than the consumers need, so they move none.)
constexpr int kNbLaunchRegs = 65536 / nb_threads(4) / 8 * 8;
// (SK's consumers, which hold their lane's state too, get the same 112: 120 would not fit beside the
// producer's 24 in the 640 threads' 96 each.)
constexpr int kNbConsumerRegs = 112, kNbProducerRegs = 24;
static_assert(nb_consumers(4) * kNbConsumerRegs + kThreads * kNbProducerRegs <= nb_threads(4) * kNbLaunchRegs,
              "the CTA's registers");
static_assert(nb_stage_bytes(8) % 1024 == 0 && nb_stage_bytes(16) % 1024 == 0, "128-byte swizzle atoms");
static_assert(epilogue_smem_bytes(8, 2) <= nb_smem_bytes(8) && epilogue_smem_bytes(16, 2) <= nb_smem_bytes(16),
              "the epilogue reuses the ring");

#if W12_WGMMA
// x..w = *src where p (an L1-bypassing load), else unchanged.
__device__ __forceinline__ void ld_cg_if(bool p, const float4* src, float& x, float& y, float& z, float& w) {
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %4, 0;\n @q ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%5];\n}"
      : "+f"(x), "+f"(y), "+f"(z), "+f"(w)
      : "r"((int)p), "l"(src)
      : "memory");
}
// 2-D tensor copy of the box at (c0, c1) (column, token) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
template <int R>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}
#endif

// A unit of NB's grid: WGC consecutive 64-row m-tiles, from m-tile 1 of row tile ft when `odd`
// (triples whose first m-tile is odd), else from m-tile 0, over K slice `part` (pairs) or the two
// K slices 2 part, 2 part + 1 (triples). Its records are row tiles ft and ft + 1 (nrt of them
// exist); consumer warpgroup w takes m-tile (w + odd) & 1 of record slot (w + odd) >> 1. Pairs
// (WGC = 4): 2 row tiles from 2 g, never odd. Triples (WGC = 3): m-tiles 3g..3g + 2, i.e. row tile
// 3g / 2 from m-tile g & 1; a triple's half-used record is also the next triple's, copied by both
// (the same slices, so the second read mostly hits L2). nb_parts / nb_units: gemm_w12_mma.cuh.
struct NbUnit {
  int ft, odd, part, nrt;
};
template <int WGC>
__device__ __forceinline__ NbUnit nb_unit(int u, int parts, int nt) {
  const int g = u / parts, ft = WGC == 4 ? 2 * g : g + (g >> 1);
  return NbUnit{ft, WGC == 4 ? 0 : g & 1, u % parts, ft + 1 < nt ? 2 : 1};
}

template <int NCH, int WGC, bool SK>
__global__ void __launch_bounds__(nb_threads(WGC), 1) gemm_w12_nobar_kernel(const WParams p, const __grid_constant__ CUtensorMap tmx) {
#if W12_WGMMA
  static_assert(WGC == 4 || WGC == 3, "pairs or triples");
  static_assert(!SK || WGC == 4, "SK: row-tile pairs of unsplit weights");
  constexpr int T = 8 * NCH, kNbX = nb_x_bytes(NCH), kNbStage = nb_stage_bytes(NCH), kNbStages = nb_stages(NCH);
  constexpr int kCons = nb_consumers(WGC);
  extern __shared__ __align__(1024) uint8_t smem[];
  // XT helpers first, as in v4's unsplit grids at 33-128 tokens: transpose x for the epilogue, exit.
  if (blockIdx.x < p.xth) {
    if (p.pdl) pdl_wait();
    xt_blocks(p.x, p.ldx, p.M, p.KT, p.ws, p.xth);
    return;
  }
  const int tid = threadIdx.x;
  // Units (NbUnit) u = bid, bid + G, ... (G: the grid less the XT helpers). Unsplit weights run one
  // unit a CTA (the epilogue takes the ring over); on split weights (e.g. down, or qkv's triples) a
  // CTA parks each unit's partial (triples: one per slice pair) for v1's reduce kernel, as v4's
  // split grids do, while its producer already fills the ring with the next records.
  const int nt = (p.N + 127) >> 7, G = gridDim.x - p.xth, bid = blockIdx.x - p.xth;
  const int parts = nb_parts(WGC, p.S), units = nb_units(WGC, nt, p.S);
  // The unit's first slice and slice count: triples run a slice pair (the PAIR grid's: each slice
  // from zero, then p_2j + p_2j+1, add_slice's first add), so that the reduce kernel reads half the
  // partials; their records are consecutive, one stream for the producer.
  constexpr int kSl = WGC == 3 ? 2 : 1;
  __shared__ __align__(8) uint64_t bars[2 * kNbStages + 1];
  const uint32_t full = smem_u32(&bars[0]), empty = full + 8 * kNbStages, epid = empty + 8 * kNbStages;
  // SK (p.sk lanes, unsplit pairs only; its own instance, so that the others keep their registers):
  // this lane's segments (sk_segment), else the CTA's units bid, bid + G, ...; an item is {unit,
  // first record, end record (-1: the slice's), kind} (kind as SkSeg's).
  constexpr bool sk = SK;
  const int items = sk ? sk_segments(bid, p.sk, units, p.KT) : 0;
  // (Without SK the loops below keep their unit-stride form, and their loops' code.)
  auto item = [&](int i, int u) { return sk ? sk_segment(bid, p.sk, units, p.KT, i) : SkSeg{u, 0, -1, 0}; };
  auto more = [&](int i, int u) { return sk ? i < items : u < units; };
  const uint32_t sbase = smem_u32(smem);
  // With PDL nothing the previous kernel may write is read before the wait.
  if (p.pdl) pdl_wait();
  // The reduce kernel (S > 1) only waits for this grid's completion: let its CTAs be placed now.
  if (p.S > 1) pdl_launch_dependents();
  if (tid == 0) {
    for (int s = 0; s < kNbStages; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, WGC);
    }
    mbar_init(epid, 1);
    mbar_fence_init();
  }
  __syncthreads();  // the barriers' initialisation before any thread waits on them (the last CTA-wide barrier)

  if (tid >= kCons) {
    if constexpr (WGC == 4) regs_dec<kNbProducerRegs>();
    // SK's XT: the producer warpgroup's warps 1-3 transpose x's blocks bid, bid + lanes, ... (no
    // helper CTAs: xt_blocks_spare), long before any lane's first epilogue reads x^T.
    if (sk && p.ws != nullptr && tid >= kCons + 32) {
      xt_blocks_spare(p.x, p.ldx, p.M, p.KT, p.ws, bid, p.sk, tid - kCons - 32, kThreads - 32, 6);
      return;
    }
    if (tid != kCons) return;
    // c: steps issued over the CTA's units; stage s = c % kNbStages.
    for (int it = 0, u = bid, c = 0, s = 0, epi = 0; more(it, u); ++it, u += G) {
      const SkSeg sg = item(it, u);
      const NbUnit un = nb_unit<WGC>(sg.u, parts, nt);
      const int kt0 = kSl * un.part * p.kper, nrec = sg.r1 < 0 ? min(p.KT - kt0, kSl * p.kper) : sg.r1;
      const uint8_t* recb = p.records + ((size_t)un.ft * p.KT + kt0) * kRec;
      // SK: an epilogue (after a whole chain or a tail) takes the ring over; nothing is copied into
      // it until the consumers are past it.
      if (sk && it > 0 && item(it - 1, u).kind != 1) mbar_wait(epid, epi++ & 1);
      for (int i = sg.r0; i < nrec; ++i, ++c) {
        // Stage s last held step c - kNbStages; its release completed phase (c / kNbStages - 1) & 1.
        if (c >= kNbStages) {
          mbar_wait(empty + 8 * s, ((c / kNbStages) - 1) & 1);
          fence_proxy_async_smem();  // the consumers' generic reads of the records before the copy's writes
        }
        const uint32_t bar = full + 8 * s, dst = sbase + s * kNbStage;
        mbar_arrive_expect_tx(bar, un.nrt * kRec + kNbX);
        for (int r = 0; r < un.nrt; ++r) bulk_copy_g2s(dst + r * kRec, recb + ((size_t)r * p.KT + i) * kRec, kRec, bar);
        tma_load_2d(dst + kNbRecBytes, &tmx, (kt0 + i) * 64, 0, bar);
        s = s == kNbStages - 1 ? 0 : s + 1;
      }
    }
    return;
  }
  if constexpr (WGC == 4) regs_inc<kNbConsumerRegs>();
  const int lane = tid & 31, quarter = (tid >> 5) & 3, w = tid >> 7;
  const bool signals = (tid & (kThreads - 1)) == 0;  // the warpgroup's releasing thread

  constexpr int ND = T / 2;
  float acc[1][ND];
  const uint32_t k38 = opaque_k38(static_cast<uint32_t>(p.M) >> 30);
  // Chunk j's 8 tokens hold one of the pass's (only those are parked; diagnostic 131072: all).
  auto live = [&](int j) { return chunk_parked(j, p.M, p.diag); };
  // The stage of the next step and its phase parity, over the CTA's units.
  int rd = 0, prev = 0;
  uint32_t ph = 0;
  uint32_t buf[16];
  for (int it = 0, u = bid; more(it, u); ++it, u += G) {
    const SkSeg sg = item(it, u);
    const NbUnit un = nb_unit<WGC>(sg.u, parts, nt);
    const int mt0 = (w + un.odd) & 1, rtl = (w + un.odd) >> 1;  // this warpgroup's m-tile and record slot
    const uint32_t hi_off = quarter * 2048 + lane * 16 + mt0 * 1024, lo_off = 8192 + quarter * 1024 + lane * 8 + mt0 * 512;
    // Where the unit parks (v1's order: [row tile][part][fragment][thread]); a record slot past the
    // last row tile holds nothing of this unit: nothing to park there.
    const int rowtile = un.ft + rtl;
    float4* mine = p.S == 1 ? nullptr : p.ws + ((size_t)rowtile * parts + un.part) * (2 * NCH * kThreads) + (tid & (kThreads - 1));
    const int s0 = kSl * un.part, nsl = min(kSl, p.S - s0);
    for (int h = 0; h < nsl; ++h) {
      // Steps of this slice (or segment), counted from 0 so that its first record is not live in the loop.
      const int nrec = (sg.r1 < 0 ? min(p.KT - (s0 + h) * p.kper, p.kper) : sg.r1) - sg.r0;
      // SK's tail: the chain goes on from the accumulators the previous lane parked after its head
      // (each warpgroup its own, under its own flag, which the reader resets for the next launch);
      // the producer already streams the tail's records meanwhile. Else from zero.
      const bool cont = sk && sg.kind == 2;
      const float4* from = p.park + ((size_t)((bid - 1) * 4 + w) * NCH) * kThreads + (tid & (kThreads - 1));
      if (cont) {
        if (signals && !(p.diag & (kSkDiagNoWait | kSkDiagNoHandoff))) {
          int* f = p.skf + (bid - 1) * 4 + w;
          while (ld_acquire_gpu(f) == 0) __nanosleep(64);
          *f = 0;
        }
        named_bar_sync(2 + w, kThreads);  // the flag's acquire before the warpgroup's loads
      }
#pragma unroll
      for (int k = 0; k < ND; ++k) acc[0][k] = 0.f;
      // A predicated load, not a branch: accumulator writes under control flow make ptxas
      // serialise every wgmma of the kernel (C7515).
      if constexpr (SK)
#pragma unroll
        for (int j = 0; j < NCH; ++j)
          ld_cg_if(cont && !(p.diag & kSkDiagNoHandoff) && live(j), from + j * kThreads, acc[0][4 * j], acc[0][4 * j + 1],
                   acc[0][4 * j + 2], acc[0][4 * j + 3]);
      // Half a record at a time, one A buffer (the deep loop's two need 127 registers; the pairs'
      // consumers have 112): each half's two wgmma are a group of their own, so the wait before decoding a half
      // into its part of the buffer retires only the same half of the previous record, and that
      // record's other half stays in flight through the decode. The same wgmma in the same order.
      for (int i = 0; i < nrec; ++i) {
        mbar_wait(full + 8 * rd, ph);
        const uint8_t* st = smem + rd * kNbStage + rtl * kRec;
        const uint32_t xb = sbase + rd * kNbStage + kNbRecBytes;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          wgmma_wait1();  // this warpgroup's wgmma of half q of record i - 1 retired
#pragma unroll
          for (int k = 0; k < ND; ++k) pin(acc[0][k]);
          // After half 1's wait every wgmma of step i - 1 has retired: its stage is free.
          if (q == 1 && i > 0 && signals) mbar_arrive(empty + 8 * prev);
          const uint4 hv = *reinterpret_cast<const uint4*>(st + hi_off + q * 512);
          const uint2 lv = *reinterpret_cast<const uint2*>(st + lo_off + q * 256);
          decode16_split(hv, lv, buf + 8 * q, k38);
          wgmma_fence();
#pragma unroll
          for (int ks = 2 * q; ks < 2 * q + 2; ++ks) Wgmma<T>::run(acc[0], buf + 4 * ks, smem_desc_sw128(xb + 32 * ks));
          wgmma_commit();
        }
        prev = rd;
        ph ^= rd == kNbStages - 1 ? 1u : 0u;
        rd = rd == kNbStages - 1 ? 0 : rd + 1;
      }
      wgmma_wait0();
#pragma unroll
      for (int k = 0; k < ND; ++k) pin(acc[0][k]);
      // The slice's last stage, which no later step of it releases: the producer may refill it
      // with the next slice's records while this one parks.
      if (nrec > 0 && signals) mbar_arrive(empty + 8 * prev);
      // Every copy issued was waited for by every consumer, so none is in flight over the ring
      // that the epilogue (after its own barrier among the consumers) takes over: unsplit grids
      // run one unit a CTA and the producer has issued nothing more, or (SK) it waits for epid.
      if (p.S == 1) {
        if constexpr (WGC == 4) {
          // The segment's kind, recomputed from an index ptxas cannot see through, so that it is not
          // held in a register across the loop (SK's 16-chunk loop is at the consumers' 112).
          int itr = it;
          asm volatile("" : "+r"(itr));
          if (sk && item(itr, u).kind == 1) {
            // SK's head: parked for the next lane's tail (kept in L2 like the split partials), then
            // flagged: the warpgroup's barrier orders its stores before the one releasing store,
            // which makes them visible GPU-wide first (release is cumulative; no fence per thread).
            if (!(p.diag & kSkDiagNoHandoff)) {
              float4* to = p.park + ((size_t)(bid * 4 + w) * NCH) * kThreads + (tid & (kThreads - 1));
              const uint64_t keep = l2_policy_evict_last();
#pragma unroll
              for (int j = 0; j < NCH; ++j)
                if (live(j))  // not chunks of padding tokens only (the tail loads zeros there)
                  st_global_policy(to + j * kThreads,
                                   make_float4(acc[0][4 * j], acc[0][4 * j + 1], acc[0][4 * j + 2], acc[0][4 * j + 3]), keep);
              named_bar_sync(2 + w, kThreads);
              if (signals) st_release_gpu(p.skf + bid * 4 + w, 1);
            }
            continue;
          }
          store_rows_smem<NCH, 1, 4, kCons>(acc, smem, un.ft * 128, p);
          if (!sk) return;
          named_bar_sync(1, kCons);  // every consumer is past the epilogue's reads of the ring
          if (tid == 0) mbar_arrive(epid);
          continue;
        }
        return;
      }
      if (rowtile >= nt) continue;
      // A pair's second slice: p_2j (parked below by these same threads, so read back in program
      // order) + p_2j+1, then the sum in its place.
      if (h == 1) {
#pragma unroll
        for (int j = 0; j < NCH; ++j) {
          // (Chunks of padding tokens were not parked: zeros, a predicated load, no branch.)
          float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
          ld_cg_if(live(j), mine + (mt0 * NCH + j) * kThreads, f.x, f.y, f.z, f.w);
          acc[0][4 * j] = __fadd_rn(f.x, acc[0][4 * j]);
          acc[0][4 * j + 1] = __fadd_rn(f.y, acc[0][4 * j + 1]);
          acc[0][4 * j + 2] = __fadd_rn(f.z, acc[0][4 * j + 2]);
          acc[0][4 * j + 3] = __fadd_rn(f.w, acc[0][4 * j + 3]);
        }
      }
      // Parked evict_last in v1's order, as v4's split grids park theirs (gemm_w12_wgmma_sm90.cu),
      // but not the chunks that hold padding tokens only (the reduce kernel reads none of them).
      const uint64_t keep = l2_policy_evict_last();
#pragma unroll
      for (int j = 0; j < NCH; ++j)
        if (live(j))
          st_global_policy(mine + (mt0 * NCH + j) * kThreads,
                           make_float4(acc[0][4 * j], acc[0][4 * j + 1], acc[0][4 * j + 2], acc[0][4 * j + 3]), keep);
    }
  }
#endif
}

// cuTensorMapEncodeTiled from the driver the runtime loaded (no link against libcuda).
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (fn == nullptr) {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }
  return fn;
}

template <int NCH, int WGC, bool SK = false>
cudaError_t nb_launch(int dev, int grid, int smem, cudaStream_t stream, bool pdl, const WParams& p, const CUtensorMap& map) {
  constexpr auto kern = gemm_w12_nobar_kernel<NCH, WGC, SK>;
  if (cudaError_t e = set_smem_limit_once<kern>(dev, smem); e != cudaSuccess) return e;
  return launch_ex(kern, dim3(grid), dim3(nb_threads(WGC)), smem, stream, 1, pdl, p, map);
}

}  // namespace

cudaError_t gemm_nobar_launch(const GemmArgs& a, int m0, int tokens, int S, int kper, void* ws, int xth, bool pdl,
                              int wgc, int sms, int smem_min, int sk, cudaStream_t stream) {
  // 33-64 tokens in 64-token tiles, 65-128 in 128-token tiles.
  const int nch = tokens > 64 ? 16 : 8;
  if (tokens <= 32 || tokens > kWgmmaMaxTokens || S < 1 || (S > 1 && xth != 0) || (wgc != 4 && wgc != 3) ||
      (wgc == 3 && S == 1) || sms < 1 || (sk && (S != 1 || wgc != 4)))
    return cudaErrorInvalidValue;
  // One unit a CTA on unsplit weights (their epilogue takes the ring over); on split ones at most one
  // CTA an SM, each running units bid, bid + grid, ... (nb_unit).
  const int nt = (a.N + 127) / 128, units = nb_units(wgc, nt, S);
  // SK: `sk` persistent lanes (nb_sk_lanes; fewer than the units, so a range holds >= KT records),
  // no XT helper CTAs (the lanes' producer warpgroups transpose x: xt_blocks_spare).
  if (sk) xth = 0;
  const int grid = (S > 1 ? min(units, sms) : sk ? sk : units) + xth;
  if (sk && (sk >= units || a.workspace == nullptr || a.counters == nullptr)) return cudaErrorInvalidValue;
  WParams p{};
  static_cast<GemmOperands&>(p) = a;
  const int kt = (a.K + 63) / 64;
  p.x = a.x + (int64_t)m0 * a.ldx;
  p.y = a.y + (int64_t)m0 * a.ldy;
  p.M = tokens;
  p.N = a.N;
  p.KT = kt;
  p.S = S;
  p.kper = kper;
  p.pdl = pdl ? 1 : 0;
  p.ldx = a.ldx;
  p.ldy = a.ldy;
  p.ws = static_cast<float4*>(ws);  // S > 1: the partials; S = 1: the XT scratch (or none)
  p.xth = xth;
  p.diag = a.flags & kParkEveryChunk;
  if (sk) {
    p.sk = sk;
    p.park = static_cast<float4*>(a.workspace);
    p.skf = a.counters + kSkFlags0;  // in the XT scratch's header
    p.epis = units;  // one epilogue a chain, wherever it is cut
    p.diag |= a.flags & (kSkDiagNoWait | kSkDiagNoHandoff);
  }
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  // x as [tokens, KT * 64] BF16 rows ldx apart (gemm_check_args: 16-byte aligned, ldx % 8 == 0,
  // columns K..KT*64 zero); boxes of 64 columns x 8 * nch tokens, rows past `tokens` filled with zeros.
  CUtensorMap map;
  const cuuint64_t dims[2] = {(cuuint64_t)kt * 64, (cuuint64_t)tokens};
  const cuuint64_t strides[1] = {(cuuint64_t)a.ldx * 2};
  const cuuint32_t box[2] = {64, (cuuint32_t)(8 * nch)}, estr[2] = {1, 1};
  if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<uint16_t*>(p.x), dims, strides, box, estr,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;
  const int smem = max(nb_smem_bytes(nch), smem_min);
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (sk) return nch == 8 ? nb_launch<8, 4, true>(dev, grid, smem, stream, pdl, p, map) : nb_launch<16, 4, true>(dev, grid, smem, stream, pdl, p, map);
  if (nch == 8)
    return wgc == 4 ? nb_launch<8, 4>(dev, grid, smem, stream, pdl, p, map) : nb_launch<8, 3>(dev, grid, smem, stream, pdl, p, map);
  return wgc == 4 ? nb_launch<16, 4>(dev, grid, smem, stream, pdl, p, map) : nb_launch<16, 3>(dev, grid, smem, stream, pdl, p, map);
}

}  // namespace w12
