// W12 GEMM, portable mma.sync version (sm_80, sm_90, sm_120a): y[M, N] = x[M, K] W[N, K]^T.
//
// Shape of the computation (see docs/perf-notes.md for the measurements behind each choice):
// - y^T = W x^T: a 128x64 weight record is the A operand of mma.m16n8k16 (row-major, from
//   registers), the tokens are the MMA's n (8 per MMA), so 1..64 token rows waste little.
// - One CTA = 4 warps = one 128-row tile and a fixed slice of its K tiles. Each warp decodes its
//   32 rows of a record straight into A fragments (layout 4, smxx_w12_decode.cuh): no shared
//   memory round trip for decoded weights.
// - Records and the activation tile of each K step stream through a STAGES-deep cp.async ring.
//   Every thread copies exactly the record bytes it later decodes, so the weights need no
//   barrier; one __syncthreads per step covers the shared activation tile. (Above 16 tokens on
//   sm_90+ a record is one bulk copy completing on the slot's mbarrier instead.) The loop is
//   issue-bound per warp, so its instruction count is a measured cost (docs/perf-notes.md,
//   session 6; benchmarks/sass_report.py shows it without a GPU).
//   Row data for the epilogue (base, escape ranges, bias) is loaded before the main loop.
// - K-split: gemm_splits() fixes the number of K slices from (N, K, target CTAs, SMs, kernel)
//   only. Partial sums are added in add_slice's order (smxx_gemm_common.cuh: in pairs, then the
//   pairs in order) by one of three paths with identical bits: on sm_90+ the slices store
//   partials for a PDL-launched reduce kernel (or, diagnostic 65536, reduce through
//   a cluster's shared memory above 8 tokens); elsewhere the last CTA of a row tile to arrive
//   (atomic ticket) adds them. Every output element is therefore summed in one fixed order that does
//   not depend on M or on which CTA finishes last: results are deterministic and row i of y has
//   the same bits whatever M is.
// - Epilogue (once per element, in the reducing CTA): multiply by 2^(b - E0), fix escapes with
//   (w_true - w_slot) x[col] in escape-list order, add bias, round to BF16.
#include <cooperative_groups.h>
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

constexpr int kRecordBytes = 12288;
constexpr int kMaxTokens = kMmaMaxTokens;  // per launch; longer M is cut into 64-token chunks
// K slices: at most 8 where 8 already give ~target CTAs; up to 16 for weights with so few 128-row
// tiles that 8 slices would leave most SMs idle (k/v projections [1024, 4096]: 8 tiles x 8 = 64
// CTAs; 16 slices measured -2 us at M = 1, docs/perf-notes.md session 5). Possible at every M
// because the reduce kernel, not a thread-block cluster (at most 8), sums the slices on sm_90+;
// on sm_80 the in-kernel ticket path handles any count.
constexpr int kMaxSplits = 16;
// Diagnostic: never 8-warp CTAs (diagnostic 8 forces them at every token count instead).
constexpr int kDiagNarrow = 1 << 19;
// Diagnostics: never R64 (64) / R64 wherever it can run (128) at 33-64 tokens (gemm_launch).
constexpr int kNoR64 = 64;
constexpr int kAllR64 = 128;
// Largest token count the launcher gives 8-warp CTAs to (where the grid is small; gemm_launch).
constexpr int kWideMaxTokens = 32;
// Records per CTA prefetched into L2 before the wait (diagnostic bits 12..15 set 1..15). None by
// default: on the lean loop the PDL launch gained most without it (session 7, run 12: qkv 14.5 ->
// 14.1 us, o 11.3 -> 11.0 at M = 1); the early launch itself hides the CTAs' start-up.
constexpr int kPrefetchRecords = 0;

template <int NCH, int MTW>
struct MinBlocks {
  // Register budget per thread: <= 128 regs (4 CTAs of 128 or 2 of 256 threads per SM) while
  // the accumulators are small; 3 CTAs/SM (<= 168 regs) once 64 tokens need 64 accumulators.
  static constexpr int value = MTW == 1 ? 2 : (NCH <= 4 ? 4 : 3);
};

// MTW = m-tiles (16-row MMA tiles) per warp: 2 -> 4 warps per CTA, each owning 32 rows of the
// record (the layout-1 quarter); 1 -> 8 warps, a warp pair splitting each quarter by m-tile.
// Both do the same MMAs in the same order for every output element, so they give identical
// bits; the 8-warp form halves each warp's decode chain and doubles the warps that hide it,
// which is what small M needs, while large M prefers 4 warps (each warp re-reads the
// activation fragments, so 8 warps would double that shared-memory traffic).
template <int NCH, int STAGES, int MTW>
__global__ void __launch_bounds__(256 / MTW, MinBlocks<NCH, MTW>::value) gemm_w12_mma_kernel(const KParams p) {
  constexpr int kT = 256 / MTW;             // threads per CTA
  constexpr int kXBytes = NCH * 8 * 128;    // 8*NCH tokens x 64 BF16
  constexpr int kStage = kRecordBytes + kXBytes;
  constexpr int JG = NCH < 4 ? NCH : 4;     // token chunks whose fragments are held at once
  constexpr int kFrag = MTW * NCH;          // accumulator fragments per thread
  extern __shared__ __align__(128) uint8_t smem[];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rowq = MTW == 2 ? warp : warp >> 1;  // which 32-row quarter of the record
  const int mt0 = MTW == 2 ? 0 : warp & 1;       // first m-tile of this warp
  const int rowtile = blockIdx.x / p.S, split = blockIdx.x % p.S;
  const int kt0 = split * p.kper;
  const int nrec = min(p.KT - kt0, p.kper);
  const uint8_t* rec0 = p.records + ((size_t)rowtile * p.KT + kt0) * kRecordBytes;
  if (p.flags & kPdl) {
    // Launched early behind the previous kernel: stream the first records into L2 while it
    // finishes, then wait for it (activations, row data, workspace and output are its products
    // or its inputs, so nothing else may be touched before).
    const int d = (p.flags >> 12) & 15;
    if (!(p.flags & 1024) && tid < min(nrec, d ? d : kPrefetchRecords))
      bulk_prefetch_l2(rec0 + (size_t)tid * kRecordBytes, kRecordBytes);
    pdl_wait();
  }
  // The reduce kernel's CTAs are tiny (no shared memory): let them be scheduled now and wait at
  // griddepcontrol.wait, so the reduction starts the moment this grid's partials are flushed.
  // After this grid's own wait on purpose: the reduce kernel reads row data and activations
  // before its wait, which is safe only once every kernel before this one has completed.
  if (p.flags & kReduceKernel) pdl_launch_dependents();
  const uint32_t sbase = smem_u32(smem);
  // Layout 1: vector q (= 2*mt + 0/1) of this lane at quarter*2048 + q*512 + lane*16 (hi) and
  // 8192 + quarter*1024 + q*256 + lane*8 (lo).
  const uint32_t hi_off = rowq * 2048 + mt0 * 1024 + lane * 16;
  const uint32_t lo_off = 8192 + rowq * 1024 + mt0 * 512 + lane * 8;
  const int nbase = rowtile * 128 + rowq * 32 + mt0 * 16;  // + 16*mtl

  // Activation tile [8*NCH tokens][64 columns], 16-byte chunk ch of token r stored at chunk
  // ch ^ (r & 7): the fragment reads below (8 lanes = 2 tokens x 4 t) then hit 8 distinct
  // 16-byte bank groups. Tokens >= M are zero-filled. Thread tid copies chunks tid + u*kT; their
  // offsets are fixed for the whole loop, so they are computed once here: recomputing them in
  // every stage (a generic loop with 64-bit multiplies) was a fifth of the loop's instructions,
  // and the loop's instruction count shows in the small shapes' time (docs/perf-notes.md).
  // Chunk u of this thread is token row xr0 + u*kT/8, same column chunk and swizzle; only u = 0's
  // offsets are kept (per-u arrays pushed the 64-token sm_80 build into spilling).
  constexpr int kXPer = (NCH * 64 + kT - 1) / kT;
  const int xr0 = tid >> 3, xch = tid & 7;
  const int xoff0 = xr0 * (int)p.ldx + xch * 8;  // element offset in x; ldx < 2^24 (launcher)
  const uint32_t xdst0 = kRecordBytes + xr0 * 128 + ((xch ^ (xr0 & 7)) << 4);
  const uint8_t* hi_src = rec0 + hi_off;
  const uint8_t* lo_src = rec0 + lo_off;

  // Records: above 16 tokens on sm_90+, one bulk copy per record (12 KB), issued by thread 0 and
  // completing on the slot's mbarrier; otherwise (or with diagnostic 131072) each thread
  // cp.asyncs the 8 pieces it decodes. Measured (docs/perf-notes.md, session 6): the bulk form
  // gains ~1.7 % at 32-64 tokens and loses up to 3 % at 1-16 (every thread then waits for the
  // whole record instead of its own pieces). Activations stay per-thread cp.async either way.
#if __CUDA_ARCH__ >= 900
  const bool bulk = NCH >= 4 && !(p.flags & 131072);
#else
  constexpr bool bulk = false;
#endif
  __shared__ __align__(8) uint64_t full_bar[STAGES];
  const uint32_t bar0 = smem_u32(&full_bar[0]);
  if (bulk && tid == 0) init_ring_barriers<STAGES>(bar0);

  auto load_stage = [&](int slot, int i) {
    const uint32_t dst = sbase + slot * kStage;
    if (bulk) {
#if __CUDA_ARCH__ >= 900
      if (tid == 0) {
        mbar_arrive_expect_tx(bar0 + 8 * slot, kRecordBytes);
        bulk_copy_g2s(dst, rec0 + (size_t)i * kRecordBytes, kRecordBytes, bar0 + 8 * slot);
      }
#endif
    } else {
      const uint8_t* hs = hi_src + (size_t)i * kRecordBytes;
      const uint8_t* ls = lo_src + (size_t)i * kRecordBytes;
#pragma unroll
      for (int q = 0; q < 2 * MTW; ++q) cp_async16(dst + hi_off + q * 512, hs + q * 512);
#pragma unroll
      for (int q = 0; q < 2 * MTW; ++q) cp_async8(dst + lo_off + q * 256, ls + q * 256);
    }
    const uint16_t* xs = p.x + (int64_t)(kt0 + i) * 64;
#pragma unroll
    for (int u = 0; u < kXPer; ++u) {
      const int r = xr0 + u * (kT / 8);
      if (kXPer * kT == NCH * 64 || r < NCH * 8) {
        const bool valid = r < p.M;  // rows past M are zero-filled (from a valid address)
        cp_async16_zfill(dst + xdst0 + u * (kT / 8) * 128, xs + (valid ? xoff0 + u * (kT / 8) * (int)p.ldx : xch * 8),
                         valid);
      }
    }
  };

  float acc[MTW][NCH][4];
#pragma unroll
  for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
    for (int j = 0; j < NCH; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][j][i] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nrec) load_stage(s, s);
    cp_async_commit();
  }

  RowData rd;
  if (!(p.flags & kReduceKernel)) load_row_data<MTW>(rd, nbase, g, p);

  const uint32_t k38 = opaque_k38(static_cast<uint32_t>(p.M) >> 30);  // p.M <= 64
  RingSlots<STAGES> ring;
  for (int i = 0; i < nrec; ++i) {
    cp_async_wait<STAGES - 2>();
    // Everyone has finished step i-1, so its slot (the one refilled next) is free; the mbarrier
    // inits (first step) are visible to every thread.
    __syncthreads();
    const int wslot = ring.take_write();
    if (i + STAGES - 1 < nrec) load_stage(wslot, i + STAGES - 1);
    cp_async_commit();
    const int slot = ring.take_read(bulk, bar0);

    if (p.flags & 1) continue;  // diagnostic: stream only
    const uint8_t* st = smem + slot * kStage;
    uint32_t a[16 * MTW];
#pragma unroll
    for (int q = 0; q < 2 * MTW; ++q) {
      const uint4 h = *reinterpret_cast<const uint4*>(st + hi_off + q * 512);
      const uint2 l = *reinterpret_cast<const uint2*>(st + lo_off + q * 256);
      decode16_split(h, l, a + 8 * q, k38);
    }
    // Activation fragments for JG token chunks at a time, then k-step outer: consecutive MMAs
    // go to MTW*JG different accumulators, so one accumulator's MMA latency chain is covered
    // (with j outer, only 2 were independent and the warp stalled on each).
#pragma unroll
    for (int j0 = 0; j0 < NCH; j0 += JG) {
      uint32_t bw[JG][8];
#pragma unroll
      for (int jj = 0; jj < JG; ++jj) {
        const uint8_t* xr = st + kRecordBytes + (8 * (j0 + jj) + g) * 128;
        const uint4 b0 = *reinterpret_cast<const uint4*>(xr + (((2 * t) ^ g) << 4));
        const uint4 b1 = *reinterpret_cast<const uint4*>(xr + (((2 * t + 1) ^ g) << 4));
        bw[jj][0] = b0.x, bw[jj][1] = b0.y, bw[jj][2] = b0.z, bw[jj][3] = b0.w;
        bw[jj][4] = b1.x, bw[jj][5] = b1.y, bw[jj][6] = b1.z, bw[jj][7] = b1.w;
      }
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int jj = 0; jj < JG; ++jj)
#pragma unroll
          for (int mt = 0; mt < MTW; ++mt) {
            const uint32_t af[4] = {a[16 * mt + 4 * ks + 0], a[16 * mt + 4 * ks + 1], a[16 * mt + 4 * ks + 2],
                                    a[16 * mt + 4 * ks + 3]};
            mma_bf16_16816(acc[mt][j0 + jj], af, bw[jj][2 * ks], bw[jj][2 * ks + 1]);
          }
    }
  }
  cp_async_wait<0>();
  // Diagnostic 256: let the next (PDL) launch start its prologue during this grid's reduction.
  if (p.flags & 256) pdl_launch_dependents();
  if (NCH == 1 && !(p.flags & kReduceKernel)) load_escape_x<MTW>(rd, t, p);

#if __CUDA_ARCH__ >= 900
  if (p.S > 1 && p.cluster) {
    // Cluster reduction: the S slices of this row tile are the S CTAs of one cluster. Each
    // parks its partial in its own shared memory; after a cluster barrier, CTA `split` sums
    // fragments f = split, split + S, ... over ranks 0..S-1 (add_slice's order, as the global
    // path below, so both give identical bits) straight out of the other CTAs' shared memory.
    // This replaces a global fence + atomic + L2 round trips by two cluster barriers and DSMEM
    // reads (measured: much faster once M >= 16; at M <= 8 the global path is used).
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    __syncthreads();  // every warp is done reading the ring before it is reused
    float4* part = reinterpret_cast<float4*>(smem);
#pragma unroll
    for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
      for (int j = 0; j < NCH; ++j)
        part[(mt * NCH + j) * kT + tid] = make_float4(acc[mt][j][0], acc[mt][j][1], acc[mt][j][2], acc[mt][j][3]);
    cluster.sync();
    for (int f = split; f < kFrag; f += p.S) {
      float sum[4], pend[4] = {0.f, 0.f, 0.f, 0.f};
      for (int sl = 0; sl < p.S; ++sl) {
        const float4 v = *cluster.map_shared_rank(part + f * kT + tid, sl);
        const float vv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) add_slice(sum[i], pend[i], vv[i], sl, p.S);
      }
      const int mtl = f / NCH;
      store_fragment<NCH, MTW>(sum, nbase + 16 * mtl, mtl, f % NCH, rd, p);
    }
    cluster.sync();  // keep this CTA's shared memory alive until every rank has read it
    return;
  }
#endif
  if (p.S > 1) {
    // Partial sums in fragment order: thread tid's float4 of fragment f at [tile][split][f][tid],
    // so both the stores here and the reducing loads below are coalesced 16-byte accesses.
    float4* mine = p.ws + ((size_t)rowtile * p.S + split) * (kFrag * kT) + tid;
#pragma unroll
    for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
      for (int j = 0; j < NCH; ++j)
        mine[(mt * NCH + j) * kT] = make_float4(acc[mt][j][0], acc[mt][j][1], acc[mt][j][2], acc[mt][j][3]);
    if (p.flags & 2) return;  // diagnostic: no cross-CTA reduction (output incomplete)
    if (p.flags & kReduceKernel) return;
    __threadfence();
    __syncthreads();
    __shared__ int s_last;
    if (tid == 0) {
      const int ticket = atomicAdd(&p.counters[rowtile], 1);
      s_last = ticket == p.S - 1;
      if (s_last) p.counters[rowtile] = 0;  // every slice has arrived: ready for the next launch
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const float4* tile = p.ws + (size_t)rowtile * p.S * (kFrag * kT) + tid;
    // Fixed order (add_slice: in pairs, then the pairs in order) whoever reduces (its own slice
    // is read back too, so the accumulator registers can hold the running sum). Slices are
    // fetched U at a time with all their loads issued before the first add: ~S/U L2 round trips
    // instead of one per (slice, fragment).
    constexpr int U = kFrag >= 4 ? 1 : 8 / kFrag;
    float pend[MTW][NCH][4] = {};
    for (int s0 = 0; s0 < p.S; s0 += U) {
      float4 v[U][MTW][NCH];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (s0 + u < p.S) {
#pragma unroll
          for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
            for (int j = 0; j < NCH; ++j)
              v[u][mt][j] = __ldcg(tile + (size_t)(s0 + u) * (kFrag * kT) + (mt * NCH + j) * kT);
        }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (s0 + u < p.S) {
#pragma unroll
          for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
            for (int j = 0; j < NCH; ++j) {
              const float vv[4] = {v[u][mt][j].x, v[u][mt][j].y, v[u][mt][j].z, v[u][mt][j].w};
#pragma unroll
              for (int i = 0; i < 4; ++i) add_slice(acc[mt][j][i], pend[mt][j][i], vv[i], s0 + u, p.S);
            }
        }
    }
  }

#pragma unroll
  for (int mt = 0; mt < MTW; ++mt)
#pragma unroll
    for (int j = 0; j < NCH; ++j) store_fragment<NCH, MTW>(acc[mt][j], nbase + 16 * mt, mt, j, rd, p);
}

template <int NCH, int STAGES, int MTW>
cudaError_t launch_one(const KParams& p, int grid, int smem_min, int dev, cudaStream_t stream) {
  const int smem = max(STAGES * (kRecordBytes + NCH * 1024), smem_min);
  constexpr int threads = 256 / MTW;
  constexpr auto kern = gemm_w12_mma_kernel<NCH, STAGES, MTW>;
  if (const cudaError_t err = set_smem_limit_once<kern>(dev, smem); err != cudaSuccess) return err;
  return launch_ex(kern, dim3(grid), dim3(threads), smem, stream, p.cluster ? p.S : 1, (p.flags & kPdl) != 0, p);
}

template <int STAGES>
cudaError_t launch_stages(const KParams& p, int grid, int tokens, int smem_min, int dev, cudaStream_t stream) {
  const bool wide = (p.flags & kWide) != 0;
  if (tokens <= 8) return wide ? launch_one<1, STAGES, 1>(p, grid, smem_min, dev, stream) : launch_one<1, STAGES, 2>(p, grid, smem_min, dev, stream);
  if (tokens <= 16)
    return wide ? launch_one<2, STAGES, 1>(p, grid, smem_min, dev, stream) : launch_one<2, STAGES, 2>(p, grid, smem_min, dev, stream);
  if (tokens <= 32)
    return wide ? launch_one<4, STAGES, 1>(p, grid, smem_min, dev, stream) : launch_one<4, STAGES, 2>(p, grid, smem_min, dev, stream);
  return wide ? launch_one<8, STAGES, 1>(p, grid, smem_min, dev, stream) : launch_one<8, STAGES, 2>(p, grid, smem_min, dev, stream);
}

int nchunks_for(int tokens) { return tokens <= 8 ? 1 : tokens <= 16 ? 2 : tokens <= 32 ? 4 : tokens <= 64 ? 8 : 16; }

}  // namespace

int gemm_splits(int N, int K, int target_ctas, int sms, int kernel) {
  const int nt = (N + 127) / 128, kt = (K + 63) / 64;
  if (target_ctas < 1) target_ctas = 1;
  if (sms < 1) sms = 1;
  // At most 8 slices, 16 for few-tile weights (kMaxSplits above); this also bounds the
  // partial-sum traffic at M = 64.
  int smax = 10L * nt * kMaxClusterSplits < 9L * target_ctas ? kMaxSplits : kMaxClusterSplits;
  smax = kt < smax ? kt : smax;
  auto clamp = [&](int s) { return s < 1 ? 1 : (s > smax ? smax : s); };
  auto no_empty = [&](int s) {
    const int kper = (kt + s - 1) / s;
    return (kt + kper - 1) / kper;
  };
  // Enough CTAs for ~target_ctas (the warps that keep records in flight on every SM): 9/10 of it
  // for v1, 8/10 for v4. Session 12: at 8/10 gate_up [28672, 4096] (224 tiles at 264) runs
  // unsplit, a single wave without the reduce kernel, at the busiest-SM cost of S = 2 below; v4
  // gained there (M = 1 48.1 -> 46.5 us, graph set 0.816 -> 0.804) and v1 lost (47.7 -> 51.8).
  const int fill = kernel == 4 ? 8 : 9;
  const int s_min = clamp((fill * target_ctas + 10 * nt - 1) / (10 * nt));
  // ...then the slice count whose busiest SM streams the fewest records: a single wave of G =
  // nt * S CTAs puts ceil(G / SMs) of them on some SM, each ceil(KT / S) records long (qkv
  // [6144, 4096]: S = 6 gives 288 CTAs, 3 on 24 SMs, 33 records; S = 8 gives 24 -> measured
  // 18.9 -> 16.0 us at M = 1). Only S that keep G <= 2 * target_ctas (one resident wave); the
  // smallest within 5 % of the best, since every slice adds partial-sum traffic; for v4 also the
  // smallest within 10 % that cuts at least a quarter of the best's slices (session 41,
  // docs/perf-notes.md: qkv [6144, 4096] in 5 slices, 26 records on the busiest SM against 24 in 8,
  // runs 4-7 % faster at 40-128 tokens and +0..1.5 % at 1-16; [5760, 4096] 8 -> 5 and [22016,
  // 4096] 3 -> 2 likewise; [2048, 14336] in 15 slices instead of 16 lost 2-3 % at 48-128 tokens).
  int best = s_min, best_s = s_min;
  long best_cost = 0;
  long costs[kMaxSplits + 1] = {0};
  for (int s = s_min; s <= smax; ++s) {
    const int se = no_empty(s);
    if (s > s_min && (long)nt * se > 2L * target_ctas) break;
    const long per_sm = ((long)nt * se + sms - 1) / sms;
    costs[s] = per_sm * ((kt + se - 1) / se);
    if (best_cost == 0 || costs[s] < best_cost) best_cost = costs[s], best_s = s;
  }
  for (int s = s_min; s <= smax; ++s) {
    if (costs[s] == 0) continue;
    const bool near = 20 * costs[s] <= 21L * best_cost;
    const bool fewer = kernel == 4 && 10 * costs[s] <= 11L * best_cost && 4 * no_empty(s) <= 3 * no_empty(best_s);
    if (near || fewer) {
      best = s;
      break;
    }
  }
  return no_empty(best);
}

size_t gemm_workspace_bytes(int M, int N, int K, int target_ctas, int sms, int kernel, int flags) {
  const int s = gemm_splits(N, K, target_ctas, sms, kernel);
  const int max_tokens = kernel == 4 ? kWgmmaMaxTokens : kMmaMaxTokens;
  if (M <= 0) return 0;
  const int tokens = M < max_tokens ? M : max_tokens;
  const size_t nt = (N + 127) / 128;
  if (s > 1) return nt * s * 2 * nchunks_for(tokens) * 128 * sizeof(float4);  // same for 4 or 8 warps
  if (kernel != 4) return 0;
  // v4's SK lanes (unsplit weights at 33-128 tokens) park the accumulators of the chains they cut:
  // sized for the passes that run them, the full ones and the last (M > 128 runs in 128-token passes).
  size_t park = 0;
  for (const int t : {tokens, M > max_tokens ? M % max_tokens : 0})
    if (t > 0 && wgmma_sk_lanes(N, K, t, target_ctas, sms, flags)) {
      const size_t b = (size_t)nb_sk_park_bytes(sms, t);
      park = b > park ? b : park;
    }
  return park;
}

cudaError_t gemm_launch(const GemmArgs& a, cudaStream_t stream) {
  if (cudaError_t e0 = gemm_check_args(a); e0 != cudaSuccess) return e0;
  if (a.M == 0) return cudaSuccess;
  const int nt = (a.N + 127) / 128, kt = (a.K + 63) / 64;
  DevInfo di;
  int dev = 0;
  if (cudaError_t qerr = dev_info(di, dev); qerr != cudaSuccess) return qerr;
  const int major = di.major;
  const int s = gemm_splits(a.N, a.K, a.target_ctas, di.sms, 1);
  const int kper = (kt + s - 1) / s;
  if (s > 1 && (a.workspace == nullptr || a.counters == nullptr)) return cudaErrorInvalidValue;  // sm_80 path
  // Cluster reduction where the GPU has clusters (sm_90+); the global ticket path elsewhere.
  // Measured (docs/perf-notes.md): the cluster reduction wins from 16 tokens up, the global
  // one at <= 8 tokens. Both sum in the same order, so the choice does not change any bit.
  const bool cluster_ok = s > 1 && s <= kMaxClusterSplits && major >= 9 && !(a.flags & 4);
  KParams p{};
  static_cast<GemmOperands&>(p) = a;
  p.ws = static_cast<float4*>(a.workspace);
  p.counters = a.counters;
  p.N = a.N;
  p.KT = kt;
  p.S = s;
  p.kper = kper;
  p.ldx = a.ldx;
  p.ldy = a.ldy;
  p.flags = a.flags;
  // M > 64: 64-token chunks, one launch each; the chunks share the workspace (stream order).
  for (int m0 = 0; m0 < a.M; m0 += kMaxTokens) {
    const int tokens = (a.M - m0) < kMaxTokens ? (a.M - m0) : kMaxTokens;
    p.x = a.x + (int64_t)m0 * a.ldx;
    p.y = a.y + (int64_t)m0 * a.ldy;
    p.M = tokens;
    // Diagnostic 65536: the thread-block cluster reduction above 8 tokens (the default before the
    // reduce kernel served every M); 16: also at M <= 8. Neither where S > 8.
    p.cluster = (cluster_ok && ((tokens > 8 && (a.flags & 65536)) || (a.flags & 16))) ? 1 : 0;
    // Otherwise on sm_90+ a separate PDL-launched reduce kernel unless diagnostic 512 asks for the
    // in-kernel ticket path (same bits either way).
    const bool reduce_kernel = s > 1 && !p.cluster && major >= 9 && !(a.flags & (2 | 512));
    // PDL on sm_90+ (sm_80 has none) unless diagnostic 32 (W12_GEMM_PDL=0) turns it off.
    const bool pdl = major >= 9 && !(a.flags & 32);
    // 8-warp CTAs where the grid leaves every SM <= 2 CTAs (o, down, k/v, 32B [10240, 5120] and
    // [5120, 25600] at 2 x 132 target CTAs): 4-warp CTAs there give an SM only 8 warps to hide
    // the decode chain, while grids of ~3+ CTAs per SM already have 12. Measured (session 7,
    // docs/perf-notes.md) at 1..32 tokens: down -5..11 %, o -1..7 %; qkv, gate_up and lm_head
    // +4..16 % (so not there); at 64 tokens mixed (o -4 %, 32B +1..2 %), so 4 warps there.
    // Same MMAs in the same order either way: the bits do not change.
    const bool wide = (a.flags & 8) || (!(a.flags & kDiagNarrow) && tokens <= kWideMaxTokens &&
                                        (long)nt * s <= 2L * di.sms);
    p.flags = (reduce_kernel ? (a.flags | kReduceKernel) : a.flags) | (pdl ? kPdl : 0) | (wide ? kWide : 0);
    // Diagnostic 2048: with PDL the next GEMM's CTAs are placed while the reduce kernel's are
    // still resident; pad shared memory so an SM holds at most target_ctas / SMs of them.
    int smem_min = 0;
    if (reduce_kernel && pdl && (a.flags & 2048)) {
      const int cps = a.target_ctas / di.sms > 1 ? a.target_ctas / di.sms : 1;
      smem_min = di.smem_sm / (cps + 1) + 1024;
    }
    // Unsplit multi-wave grids at 49-64 tokens on sm_90: at most two CTAs per SM (session 22,
    // docs/perf-notes.md; same calls, interleaved: lm_head 319.5 / 317.1 -> 299.8 / 295.2 us at
    // 64 tokens and 300.5 / 296.4 -> 286.1 / 277.4 at 56, level to -4 % at 40-48; measured on the
    // H200 only). Diagnostic 262144: never. Timing only: the bits do not change.
    if (s == 1 && tokens > 48 && major == 9 && (long)nt > 2L * di.sms && !(a.flags & (1 << 18)))
      smem_min = max(smem_min, di.smem_sm / 3 + 1024);
    // Ring depth: W12_GEMM_STAGES 3 or 4, else 3 up to 32 tokens and wave_stages() above (4 on
    // small grids and where 3 would leave a thin last wave: gate_up 82.6 -> 77.7 us at 64 tokens,
    // down 41.1 -> 40.1; qkv, 384 CTAs in one 3-stage wave, keeps 3: 22.1 against 25.8).
    int stages = 3;
    if (a.stages == 3 || a.stages == 4) stages = a.stages;
    else if (tokens > 32) stages = wave_stages((long)nt * s, di, 3 * (kRecordBytes + 8 * 1024) + 1024, true);
    cudaError_t err;
    // R64 (gemm_w12_rows64_sm120.cu: 64 rows per warp, two row tiles per CTA) at 33-64 tokens on
    // sm_90 where its grid of ceil(tiles / 2) x S CTAs is more than 1.5 per SM. Measured on the
    // H200 (session 23, docs/perf-notes.md), interleaved, at 64 / 48 / 33 tokens: lm_head 289 /
    // 273 / 248 -> 239 / 226 / 214 us, gate_up 67.4 / 64.9 / 64.3 -> 63.7 / 60.9 / 60.1, 32B
    // [51200, 5120] -14 %; qkv (1.45 CTAs per SM) 18.7 -> 21.4 and o, down (< 1 per SM) slower, so
    // not there. Diagnostic 64: never; 128: wherever it can run. Same bits.
    const bool r64_ok = tokens > 32 && major >= 9 && !p.cluster && (s == 1 || reduce_kernel) && !(a.flags & kNoR64);
    const long r64_ctas = (long)(nt + 1) / 2 * s;
    if (r64_ok && ((a.flags & kAllR64) || (major == 9 && 2 * r64_ctas > 3L * di.sms)))
      err = gemm_r64_launch(p, smem_min, dev, stream);
    else switch (stages) {
      case 4: err = launch_stages<4>(p, nt * s, tokens, smem_min, dev, stream); break;
      default: err = launch_stages<3>(p, nt * s, tokens, smem_min, dev, stream); break;
    }
    if (err != cudaSuccess) return err;
    if (reduce_kernel) {
      err = launch_reduce_for(p, nt, tokens, stream);
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

cudaError_t gemm_check_device() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, gemm_w12_mma_kernel<1, 4, 2>);
}

}  // namespace w12
