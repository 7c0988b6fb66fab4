// Host-side interface of the portable W12 GEMM (mma.sync, sm_80 / sm_90 / sm_120a).
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

namespace w12 {

// The device pointers every W12 GEMM kernel reads (weight tensors, activations, output); each
// kernel's params struct extends it with its own sizes and scratch.
struct GemmOperands {
  const uint16_t* x;       // [M, ldx] BF16 activations; ldx >= KT*64, columns K..KT*64 zero
  const uint8_t* records;  // [NT, KT, 12288] layout-1 records
  const uint8_t* base;     // [N]
  const int32_t* esc_ptr;  // [N+1]
  const int32_t* esc_col;  // [nnz]
  const int16_t* esc_val;  // [nnz]
  const float* bias;       // [N] or nullptr
  uint16_t* y;             // [M, ldy] BF16 out
};

struct GemmArgs : GemmOperands {
  int M, N, K;
  int64_t ldx, ldy;
  void* workspace;          // FP32 partial sums, gemm_workspace_bytes()
  int* counters;            // >= NT ints, zero on entry; left zero on exit
  int target_ctas;          // grid size the K-split aims at (a function of the SM count only)
  int stages;               // v1, v4: ring depth 3 or 4 (anything else: the launcher chooses); v2: cap on the ring depth (0: as deep
                            // as shared memory allows, at most 16)
  int flags = 0;            // diagnostics for benchmarks and tests (timing only unless said):
                            // 32 = no programmatic dependent launch (v1, v3 and v4; set by the
                            // caller from W12_GEMM_PDL); v3: 128 = its trigger after the main
                            // loop; v1: 1 = skip decode/MMA, 2 = skip the reduction (1 and 2 give
                            // wrong output), 4 = global-memory reduction even where clusters
                            // exist, 8 = 8-warp CTAs at every M (default: only where the grid
                            // is small, at M <= 32), 524288 = never 8-warp CTAs, 16 = cluster
                            // reduction at M <= 8 too, 512 = the in-kernel ticket reduction at M <= 8 instead of the
                            // PDL reduce kernel; with PDL: 256 = trigger after the main loop,
                            // 1024 = no L2 prefetch before the wait, 2048 = shared memory padded
                            // to <= target_ctas / SMs CTAs per SM (reduce-kernel path), bits
                            // 12..15 = records prefetched per CTA (0: none); 65536 = cluster reduction
                            // above 8 tokens; 131072 = records copied per thread with cp.async
                            // above 16 tokens on sm_90+ too (default there: one bulk copy per
                            // record); 262144 = no two-CTAs-per-SM cap on unsplit multi-wave
                            // grids at 49..64 tokens (sm_90); 64 = never the R64 kernel at
                            // 33..64 tokens, 128 = R64 wherever it can run (default: sm_90 grids
                            // of > 1.5 R64 CTAs per SM). None
                            // changes a bit of the result; bits 20+ are the launcher's own
                            // v2 (gemm_sk_launch) reads bit 1 only (stream only, wrong output)
                            // v3 (gemm_slab_launch): bit 1 (stream only), 32 (above); v4 (gemm_wgmma_launch): 64 = decode overlapping the
                            // previous record's wgmma (at 65..128 tokens: the plain loop; same bits), 524288 = one warpgroup per CTA
                            // instead of two up to 64 tokens, 262144 = two row tiles per CTA from 33 tokens up (same bits),
                            // 1 = activation tiles copied for the first ring stages only (wrong output), 2 = the
                            // per-output epilogue of unsplit grids (same bits), 256 / 1024 = the deep loop at
                            // every grid up to 16 tokens / never (same bits; v1 reads these two only with PDL),
                            // 512 / 128 = the pair grid on every split grid up to 64 tokens / never (same bits;
                            // v1 reads 512 as its in-kernel ticket reduction), 4096 = one ring for records and
                            // activation tiles on row-tile-pair grids at 65..128 tokens (default there: the
                            // split ring; same bits), 8192 = never the balanced unsplit grid, 16384 = never
                            // bulk-copied records at 1..2 tokens (same bits)
};

// Argument checks shared by every launcher (M == 0 is valid and launches nothing).
inline cudaError_t gemm_check_args(const GemmArgs& a) {
  if (a.M < 0 || a.N <= 0 || a.K <= 0) return cudaErrorInvalidValue;
  const int kt = (a.K + 63) / 64;
  // ldx < 2^24: the kernels address a chunk of x with 32-bit offsets (v4's 128 tokens: 127 * 2^24 < 2^31).
  if (a.ldx < (int64_t)kt * 64 || (a.ldx & 7) || a.ldx >= (1 << 24) || a.ldy < a.N) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(a.x) & 15) || (reinterpret_cast<uintptr_t>(a.records) & 15))
    return cudaErrorMisalignedAddress;
  return cudaSuccess;
}

// Number of K slices kernel `kernel` (1 = v1, 4 = v4) uses for an (N, K) weight: depends on N,
// K, target_ctas, the SM count and the kernel only, never on M, so every output element is summed
// in the same order whatever M is. At most 16 slices for few-tile weights, else 8.
int gemm_splits(int N, int K, int target_ctas, int sms, int kernel);
// Token rows per launch of v1 (longer M runs in 64-token passes); v4's is kWgmmaMaxTokens.
constexpr int kMmaMaxTokens = 64;
// Partial-sum bytes of one launch of kernel 1 (v1, up to kMmaMaxTokens token rows) or 4 (v4, up to
// kWgmmaMaxTokens); longer M runs in passes that reuse them, in stream order. For v4 on unsplit
// weights, SK's parked accumulators where it runs SK with the diagnostics `flags` (else 0).
size_t gemm_workspace_bytes(int M, int N, int K, int target_ctas, int sms, int kernel, int flags);
cudaError_t gemm_launch(const GemmArgs& a, cudaStream_t stream);
// v2, persistent stream-K (gemm_w12_streamk_sm120.cu). The grid (target_ctas CTAs) fixes the
// record ranges and so the summation order; M never does. workspace: gemm_sk_workspace_bytes();
// counters: >= target_ctas ints, zero on entry, left zero on exit.
size_t gemm_sk_workspace_bytes(int M, int target_ctas);
cudaError_t gemm_sk_launch(const GemmArgs& a, cudaStream_t stream);

// v3, row slabs with the K-split inside the CTA (gemm_w12_slab_sm120.cu): no workspace, no
// counters. Summation order fixed by K alone.
cudaError_t gemm_slab_launch(const GemmArgs& a, cudaStream_t stream);

// v1's PDL reduce kernel on its own (sm_90+): sums the S partials another GEMM kernel parked in
// a.workspace in v1's order ([row tile][slice][fragment][thread] of a 4-warp CTA) for tokens
// m0 .. m0+tokens-1, and writes y with v1's epilogue. The GEMM before it must trigger its
// dependents (griddepcontrol.launch_dependents) or simply finish.
// pairs_parked: the GEMM parked one partial per pair of slices (S counts those partials).
// slots: the staged escapes through per-row slots of products at <= 32 tokens (EscapeSlots in
// gemm_w12_reduce_sm120.cu; the caller says whether the GEMM leaves their registers room).
cudaError_t gemm_reduce_launch(const GemmArgs& a, int m0, int tokens, int S, cudaStream_t stream,
                               bool pairs_parked = false, bool slots = false);

// v4, Hopper wgmma (kernels_sm90/gemm_w12_wgmma_sm90.cu, sm_90a only): K slices by v1's rule
// with v4's fill (gemm_splits(..., 4)), summed by v1's reduce kernel; up to kWgmmaMaxTokens
// token rows per launch; workspace gemm_workspace_bytes(..., 4), no counters.
constexpr int kWgmmaMaxTokens = 128;
// v4's XT scratch on unsplit weights (gemm_w12_wgmma_sm90.cu: XT): a kXtHeader-byte header (two
// counts in its first ints, SK's flags from int kSkFlags0 on: gemm_w12_nobar_sm90.cu), then x^T,
// kWgmmaMaxTokens BF16 per column; its size in ints for K columns (w12_gemm_counters). The header
// is never written by x^T, whatever the K of the stream's calls, so what each call leaves zero
// stays zero.
constexpr int kXtHeader = 4096;
constexpr int kSkFlags0 = 64;
constexpr int xt_scratch_ints(int k) { return kXtHeader / 4 + (k + 63) / 64 * 64 * kWgmmaMaxTokens * 2 / 4; }
// cudaErrorNoKernelImageForDevice off sm_90.
cudaError_t gemm_wgmma_launch(const GemmArgs& a, cudaStream_t stream);
// v4's whole-K clusters (kernels_sm90/gemm_w12_wholek_sm90.cu): at <= 16 tokens, one warpgroup
// per (64-row m-tile, K slice), a cluster holding all slices of its m-tiles (two CTAs per m-tile,
// or four warpgroups per CTA packing whole m-tiles), the split grid's bits without the reduce
// kernel. wholek_stages: their ring depth for an [N, K] weight cut into S slices on a GPU with
// `sms` SMs, smem_sm bytes of shared memory per SM and smem_optin per CTA (stages: 3 or 4 forces
// that depth where it fits), 0 where they are not taken (more than 16 tokens, S outside 2..8, no
// form whose CTAs fit the SMs in one wave, a packed form of more than two CTAs per cluster unless
// `flags` has kWholekEveryPacking, a packed grid where the split grid has at most one CTA per SM,
// slices under 16 records unless `flags` has kWholekShortSlices, 3 stages not fitting, or `flags`
// has kWholekOff or, for the packed forms, kWholekNoPack). wholek_warpgroups and
// wholek_cluster_ctas: the same rule's warpgroups per CTA and CTAs per cluster (0 where not
// taken). flags: the call's GemmArgs::flags (v4's diagnostics).
constexpr int kWholekOff = 16;                // diagnostic 16: the split grid + reduce kernel instead
constexpr int kWholekShortSlices = 1 << 17;   // diagnostic 131072: slices under 16 records too
constexpr int kWholekNoPack = 1 << 20;        // diagnostic 1048576: never the packed forms
constexpr int kWholekEveryPacking = 1 << 21;  // diagnostic 2097152: every packing (clusters of 3-8 CTAs, 2 warpgroups)
// Diagnostic 131072 at 17-128 tokens, where whole-K clusters never run: v4 parks every 8-token chunk
// of its tile and the reduce kernel runs a CTA for each, as before session 47, instead of only the
// chunks that hold a token of the pass (same bits; timing only).
constexpr int kParkEveryChunk = kWholekShortSlices;
// That rule, in one place for the parks (gemm_w12_wgmma_sm90.cu, gemm_w12_nobar_sm90.cu) and the
// reduce kernel's grid (gemm_w12_reduce_sm120.cu): whether chunk j of a pass of M tokens is parked
// (flags: the kernel's diagnostics), and how many of a tile's nch chunks are (the first ones).
__host__ __device__ constexpr bool chunk_parked(int j, int M, int flags) {
  return 8 * j < M || (flags & kParkEveryChunk) != 0;
}
__host__ __device__ constexpr int chunks_parked(int nch, int M, int flags) {
  return (flags & kParkEveryChunk) || (M + 7) / 8 > nch ? nch : (M + 7) / 8;
}
static_assert(chunks_parked(16, 65, 0) == 9 && chunks_parked(16, 128, 0) == 16 && chunks_parked(4, 17, 0) == 3 &&
                  chunks_parked(16, 65, kParkEveryChunk) == 16 && chunk_parked(8, 65, 0) && !chunk_parked(9, 65, 0) &&
                  chunk_parked(9, 65, kParkEveryChunk),
              "the parked chunks");
int wholek_stages(int N, int K, int S, int tokens, int sms, int smem_sm, int smem_optin, int stages, int flags);
int wholek_warpgroups(int N, int K, int S, int tokens, int sms, int smem_sm, int smem_optin, int stages, int flags);
int wholek_cluster_ctas(int N, int K, int S, int tokens, int sms, int smem_sm, int smem_optin, int stages, int flags);
cudaError_t gemm_wholek_launch(const GemmArgs& a, int m0, int tokens, int S, int stages, bool pdl, cudaStream_t stream);
// v4 at 33-128 tokens without a CTA barrier per record (NB, sessions 37-39,
// kernels_sm90/gemm_w12_nobar_sm90.cu): row-tile pairs (the split ring's grid, bits and epilogues)
// or, on split weights, m-tile triples. ws: the partials (S > 1) or the XT scratch (S = 1, or
// nullptr); xth: XT helper CTAs at the grid's start; wgc: consumer warpgroups (4 pairs, 3 triples);
// sms: the SM count (split weights: at most one CTA an SM). wgmma_nobar: the consumer warpgroups v4
// takes for an (N, K) weight at `tokens` rows (one pass), diagnostics `flags`; 0 where not NB.
int wgmma_nobar(int N, int K, int tokens, int target_ctas, int sms, int flags);
// NB's partials per m-tile group of wgc consumer warpgroups (triples: one per K slice pair), and
// its units (m-tile group, partial) for nt 128-row tiles in S K slices; the kernel's grid, its
// launcher's reduce kernel and nobar_consumers' rule count them alike.
__host__ __device__ constexpr int nb_parts(int wgc, int S) { return wgc == 3 ? (S + 1) / 2 : S; }
__host__ __device__ constexpr int nb_units(int wgc, int nt, int S) {
  return (wgc == 4 ? (nt + 1) / 2 : (2 * nt + 2) / 3) * nb_parts(wgc, S);
}
// SK (session 44): NB's row-tile pairs of a multi-wave unsplit weight (more pair units than SMs)
// as stream-K lanes, one persistent CTA an SM. The units' K chains (KT records each) laid end to
// end are cut into `lanes` equal ranges; a lane runs, in this order, the head of the chain its range
// ends in (from zero, then parked), the chains wholly inside it, and the tail of the chain its range
// starts in (continued from the head's parked accumulators: wgmma adds into whatever accumulator
// it is given, so a chain's bits do not depend on where it is cut). With a range of at least KT
// records (units >= lanes) a cut chain spans two lanes, the head in the earlier one, and the head
// ends no later than the tail starts (range - KT records of slack), so no lane waits for another in
// the steady state (McNaughton's wrap-around rule, run head first). sk_segments / sk_segment: a
// lane's segments in run order {chain, first record, end record, kind}.
struct SkSeg {
  int u, r0, r1, kind;  // kind 0: a whole chain; 1: a head (parked); 2: a tail (continued)
};
__host__ __device__ inline int sk_bound(int lane, int lanes, int units, int KT) {
  return static_cast<int>(static_cast<long long>(lane) * units * KT / lanes);
}
__host__ __device__ inline int sk_segments(int lane, int lanes, int units, int KT) {
  const int f0 = sk_bound(lane, lanes, units, KT), f1 = sk_bound(lane + 1, lanes, units, KT);
  return (f1 % KT != 0) + (f1 / KT - (f0 + KT - 1) / KT) + (f0 % KT != 0);
}
__host__ __device__ inline SkSeg sk_segment(int lane, int lanes, int units, int KT, int i) {
  const int f0 = sk_bound(lane, lanes, units, KT), f1 = sk_bound(lane + 1, lanes, units, KT);
  if (f1 % KT != 0) {
    if (i == 0) return SkSeg{f1 / KT, 0, f1 % KT, 1};
    --i;
  }
  const int full0 = (f0 + KT - 1) / KT;
  if (i < f1 / KT - full0) return SkSeg{full0 + i, 0, KT, 0};
  return SkSeg{f0 / KT, f0 % KT, KT, 2};
}
// SK's lanes for nt 128-row tiles at `tokens` rows on `sms` SMs (0: one pair unit a CTA), and the
// bytes of its parked accumulators (a workspace, w12_gemm_workspace_bytes, sized for the passes
// that run SK under the call's diagnostics); its flags, 4 a lane, sit in the XT scratch's header
// (w12_gemm_counters). At 33-64 tokens on every weight of more pair units than SMs; at 65-128 only
// where one unit a CTA's rounds (ceil(units / SMs) x SMs CTA slots) exceed the units by at least
// kSkMinIdle percent (sk_rounds_idle). Session 45's sweep of 12 such weights at 96-128 tokens
// (docs/perf-notes.md): -10..22 % where that excess is >= 49 %, -3 % on average at 32 %, between
// +2 and -3 % at 18-22 %, and +8-9 % at 5-10 % (lm_head: 501 units, 5 %), so SK's own costs there
// outweigh a nearly full last round. kNoSk: diagnostic 8192 at 33-128 tokens (BAL's bit, which acts
// at <= 32 only), never SK; kSkAll: 2097152 at 33-128 (whole-K's "every packing", which acts at
// <= 16 only), SK at 65-128 tokens on every such weight.
constexpr int kNoSk = 8192, kSkAll = 1 << 21, kSkMinIdle = 30;
// Wrong output on purpose (timing probes): SK's tails go on without waiting for their heads' flags
// (1 << 22), or no head parks and no tail loads (1 << 23).
constexpr int kSkDiagNoWait = 1 << 22, kSkDiagNoHandoff = 1 << 23;
// The lanes v4 runs for an (N, K) weight at `tokens` rows (one pass), where the caller gives the
// workspace and counters (w12.linear does); 0 where it runs one unit a CTA or another form.
int wgmma_sk_lanes(int N, int K, int tokens, int target_ctas, int sms, int flags);
// Whether one unit a CTA's rounds hold >= kSkMinIdle % more CTA slots than units.
__host__ __device__ constexpr bool sk_rounds_idle(int units, int sms) {
  return 100LL * ((units + sms - 1) / sms) * sms >= (100LL + kSkMinIdle) * units;
}
__host__ __device__ constexpr int nb_sk_lanes(int nt, int tokens, int sms, int flags) {
  return tokens > 32 && tokens <= kWgmmaMaxTokens &&
                 (tokens <= 64 || (flags & kSkAll) || sk_rounds_idle((nt + 1) / 2, sms)) && (nt + 1) / 2 > sms &&
                 4 * sms <= kXtHeader / 4 - kSkFlags0 && !(flags & kNoSk)
             ? sms
             : 0;
}
constexpr long long nb_sk_park_bytes(int lanes, int tokens) {
  return (long long)lanes * 4 * (tokens > 64 ? 16 : 8) * 128 * 16;
}
cudaError_t gemm_nobar_launch(const GemmArgs& a, int m0, int tokens, int S, int kper, void* ws, int xth, bool pdl,
                              int wgc, int sms, int smem_min, int sk, cudaStream_t stream);
// Whether v4's launcher, where it runs a split grid, takes the pair grid (PAIR: one CTA per two
// consecutive K slices) for an [N, K] weight at `tokens` token rows (one pass, <= kWgmmaMaxTokens)
// on a GPU with `sms` SMs, with v4's diagnostics `flags`. Timing only (the bits are the same either
// way); w12/cuda_ops.py: pair_grid asks it (tests and benchmarks; the PDL rule asked it in
// session 30 and, since session 31, takes PDL on every weight of >= 4 slices instead).
bool wgmma_pair_grid(int N, int K, int tokens, int target_ctas, int sms, int flags);
// cudaSuccess when v4 can run on the current device: sm_90 and real sm_90a code in this library.
cudaError_t wgmma_image_check();
// The wgmma building blocks alone (register A, descriptor B, accumulator layout) on one 64x16x16
// product; see gemm_w12_wgmma_sm90.cu. For tests.
cudaError_t wgmma_selftest_launch(const uint16_t* A, const uint16_t* B, float* D, cudaStream_t stream);

// cudaSuccess when this library holds a kernel image for the current device.
cudaError_t gemm_check_device();

}  // namespace w12
