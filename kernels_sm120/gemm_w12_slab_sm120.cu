// W12 GEMM v3: row slabs with the K-split inside the CTA (sm_80, sm_90, sm_120a).
// y[M, N] = x[M, K] W[N, K]^T computed as y^T = W x^T, the decoded record the A operand of
// mma.m16n8k16 straight from registers (layout 4, smxx_w12_decode.cuh), tokens the MMA's n.
//
// Why this kernel (measurements in docs/perf-notes.md): v1 and v2 split K across CTAs and paid
// 3-7 us per launch for the cross-CTA reduction (global partials + fence + ticket, or the v2
// owner's fix-up), most of what separated them from cuBLAS on the small Llama shapes. Here a CTA
// owns a *slab* of 32 rows (one warp quarter of a 128-row record) over the whole K, so no
// partial sum ever leaves the CTA:
// - K is cut into at most kSplit = 4 contiguous record ranges exactly as v1 cuts it into 4
//   slices (kper = ceil(KT/4), range c = [c*kper, min((c+1)*kper, KT))). Warp c decodes the
//   slab's rows in range c; at the end of the slab the range sums of a row are added in range
//   order through shared memory. Every output element is ((r0 + r1) + r2) + r3, r_c the
//   k-ordered MMA sum of range c: a function of K alone (not of M, the grid or the ring depth).
// - Each warp streams its own records into a warp-private ring with 16-byte cp.async from all
//   32 lanes and consumes them itself: no producer warp, no CTA barrier in the main loop, and
//   S-1 quarter records in flight per warp while it decodes the current one. (The first v3
//   streamed through a producer warp issuing bulk copies into a CTA-wide mbarrier ring: its
//   stream-only rate was half of v1's per byte in flight; docs/perf-notes.md.)
// - Persistent, balanced grid: G = ceil(slabs / ceil(slabs / (SMs * cps))) CTAs, CTA b taking
//   slabs b, b+G, ...; a warp's ring runs on across slab boundaries.
// - Programmatic dependent launch (sm_90+): the first ring's worth of weight copies go out before
//   griddepcontrol.wait (weights are constant; activations are what the previous kernel
//   writes), so back-to-back layers overlap a launch's ramp with the previous kernel's tail.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gemm_w12_mma.cuh"
#include "smxx_gemm_common.cuh"
#include "smxx_launch.cuh"
#include "smxx_pipe.cuh"
#include "smxx_w12_decode.cuh"

namespace w12 {
namespace {

constexpr int kRec = 12288;
constexpr int kSplit = 8;       // K ranges per slab: with v1's slicing rule, fixes the summation order
constexpr int kMaxStages = 16;
constexpr int kXRow = 144;      // activation row pitch in shared memory: 128 B + 16 B pad
constexpr int kMaxTokens = 64;

// H = warps per K range: 2 splits the slab's two m-tiles between two warps (twice the warps for
// the latency-bound decode at M <= 8), 1 gives a warp both (more independent MMAs per warp).
// Neither changes which products a row's sum adds, or in which order.
template <int H>
struct Geo {
  static constexpr int kWarps = kSplit * H;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int MT = 2 / H;          // m-tiles per warp
  static constexpr int kHi = 2048 / H;      // hi bytes of one warp's share of a record quarter
  static constexpr int kW = 3072 / H;       // hi + lo bytes of that share
};

struct SlabParams : GemmOperands {
  int M, N, KT, kper, nslab, G, S;
  int xrows;        // activation rows held per stage (M when M < 8, else 8 * NCH; rows >= M are zero)
  int stage_bytes;  // Geo::kW + xrows * kXRow, rounded up to 16
  int red_bytes;    // shared memory for the range sums, ahead of the rings
  int red_ranges;   // range sums the buffer holds at once (the hand-over runs in rounds)
  int64_t ldx, ldy;
  int diag;         // bit 0: stream only, no decode/MMA (wrong output; benchmark diagnostics)
};

// cp.async.wait_group takes an immediate: dispatch a uniform run-time count.
__device__ __forceinline__ void cp_async_wait_dyn(int n) {
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    case 7: cp_async_wait<7>(); break;
    case 8: cp_async_wait<8>(); break;
    case 9: cp_async_wait<9>(); break;
    case 10: cp_async_wait<10>(); break;
    case 11: cp_async_wait<11>(); break;
    case 12: cp_async_wait<12>(); break;
    case 13: cp_async_wait<13>(); break;
    default: cp_async_wait<14>(); break;
  }
}

template <int NCH, int H>
__global__ void __launch_bounds__(Geo<H>::kThreads, 1) gemm_w12_slab_kernel(const SlabParams p) {
  using G_ = Geo<H>;
  constexpr int MT = G_::MT;
  extern __shared__ __align__(128) uint8_t smem[];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int c = warp / H, mh = warp % H;  // K range, and (H = 2) which m-tile
  const int g = lane >> 2, t = lane & 3;
  const int S = p.S;
  const int nmine = p.nslab > (int)blockIdx.x ? (p.nslab - 1 - (int)blockIdx.x) / p.G + 1 : 0;
  const int kb = c * p.kper;
  const int len = kb < p.KT ? min(p.kper, p.KT - kb) : 0;  // records of this warp's range
  uint8_t* ring = smem + p.red_bytes + warp * S * p.stage_bytes;
  const uint32_t rbase = smem_u32(ring);

  if (p.xrows > p.M) {  // token rows >= M stay zero in every stage (no copy ever writes them)
    const int zrows = p.xrows - p.M;
    for (int i = lane; i < S * zrows * 8; i += 32) {
      const int s = i / (zrows * 8), r = i % (zrows * 8);
      *reinterpret_cast<uint4*>(ring + s * p.stage_bytes + G_::kW + (p.M + r / 8) * kXRow + (r % 8) * 16) =
          make_uint4(0, 0, 0, 0);
    }
  }
  __syncwarp();
  if (!(p.diag & 128)) pdl_launch_dependents();  // bit 128: trigger after the main loop instead

  // Stage j of this warp = record kb + j % len of slab blockIdx.x + (j / len) * G: its share of
  // the record's quarter (low bytes then N words, as layout 4 stores them) and the activation columns.
  const int total = nmine * len;
  auto load_w = [&](int slot, int slab, int i) {
    const uint8_t* rec = p.records + ((int64_t)(slab >> 2) * p.KT + kb + i) * kRec;
    const int q0 = slab & 3;
    const uint32_t dst = rbase + slot * p.stage_bytes;
#pragma unroll
    for (int v = 0; v < G_::kHi / 512; ++v)
      cp_async16(dst + v * 512 + lane * 16, rec + q0 * 2048 + mh * 1024 + v * 512 + lane * 16);
#pragma unroll
    for (int v = 0; v < G_::kHi / 1024; ++v)
      cp_async16(dst + G_::kHi + v * 512 + lane * 16, rec + 8192 + q0 * 1024 + mh * 512 + v * 512 + lane * 16);
  };
  auto load_x = [&](int slot, int i) {
    const int64_t col = (int64_t)(kb + i) * 64;
    const uint32_t dst = rbase + slot * p.stage_bytes + G_::kW;
    for (int v = lane; v < p.M * 8; v += 32)
      cp_async16(dst + (v >> 3) * kXRow + (v & 7) * 16, p.x + (int64_t)(v >> 3) * p.ldx + col + (v & 7) * 8);
  };
  // Prologue, S-1 stages: weights first (constant, so they may stream while the previous kernel
  // finishes), then griddepcontrol.wait, then the activation columns; one commit group per stage
  // (the first group also holds every prologue weight copy).
  const int pre = total < S - 1 ? total : S - 1;
  int ld_j = 0, ld_slab = (int)blockIdx.x, ld_i = 0;  // next stage to load (no divisions per stage)
  for (int j = 0; j < pre; ++j) {
    load_w(j, ld_slab, ld_i);
    if (++ld_i == len) ld_i = 0, ld_slab += p.G;
  }
  pdl_wait();  // x is read and y written only after the previous kernel has finished
  for (int j = 0, i = 0; j < S - 1; ++j) {
    if (j < pre) {
      load_x(j, i);
      if (++i == len) i = 0;
    }
    cp_async_commit();
  }
  ld_j = pre;
  int ld_slot = pre % S;

  float4* red = reinterpret_cast<float4*>(smem);  // [red_ranges][2 m-tiles][NCH][32 lanes]
  int slot = 0;
  for (int it = 0; it < nmine; ++it) {
    const int nbase = ((int)blockIdx.x + it * p.G) * 32;

    // Epilogue row data of this warp's m-tiles (rows 16*mtg + g + 8h), loaded ahead of the loop.
    float rscale[2 * MT], rbias[2 * MT];
    int re0[2 * MT], re1[2 * MT];
    auto load_rows = [&]() {
#pragma unroll
      for (int r = 0; r < 2 * MT; ++r) {
        const int mtg = H == 2 ? mh : r >> 1;
        const int n = nbase + 16 * mtg + g + 8 * (r & 1);
        const bool ok = c == 0 && n < p.N;
        rscale[r] = ok ? row_scale(__ldg(p.base + n)) : 0.f;
        re0[r] = ok ? __ldg(p.esc_ptr + n) : 0;
        re1[r] = ok ? __ldg(p.esc_ptr + n + 1) : 0;
        rbias[r] = (ok && p.bias) ? __ldg(p.bias + n) : 0.f;
      }
    };
    if constexpr (NCH < 8) load_rows();  // latency hidden behind the main loop (spills at NCH = 8)

    float acc[MT][NCH][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int jj = 0; jj < NCH; ++jj)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][jj][i] = 0.f;

    for (int i = 0; i < len; ++i) {
      cp_async_wait_dyn(S - 2);  // this lane's copies of stage j have landed
      __syncwarp();              // ... and every lane's; all lanes are done with stage j - 1
      if (ld_j < total) {
        load_w(ld_slot, ld_slab, ld_i);
        load_x(ld_slot, ld_i);
        ++ld_j;
        if (++ld_i == len) ld_i = 0, ld_slab += p.G;
        if (++ld_slot == S) ld_slot = 0;
      }
      cp_async_commit();
      const uint8_t* st = ring + slot * p.stage_bytes;
      if (++slot == S) slot = 0;
      if (p.diag & 1) continue;
      uint32_t a[16 * MT];
#pragma unroll
      for (int q = 0; q < 2 * MT; ++q) {
        const uint4 hv = *reinterpret_cast<const uint4*>(st + q * 512 + lane * 16);
        const uint2 lv = *reinterpret_cast<const uint2*>(st + G_::kHi + q * 256 + lane * 8);
        decode16_split(hv, lv, a + 8 * q, opaque_k38(static_cast<uint32_t>(p.M) >> 30));  // see decode16
      }
      mma_record<NCH, MT, kXRow>(acc, a, st + G_::kW, g, t, g < p.xrows);  // rows past M: zero (NCH = 1)
    }

    if ((p.diag & 128) && it == nmine - 1) pdl_launch_dependents();
    // Range sums: warps of ranges c >= 1 hand theirs over, red_ranges at a time; the range-0
    // warp(s) add them in range order. Two barriers per round: after the writes, after the reads.
    for (int r0 = 1; r0 < kSplit; r0 += p.red_ranges) {
      const int r1 = min(r0 + p.red_ranges, kSplit);
      if (c >= r0 && c < r1) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const int mtg = H == 2 ? mh : mt;
#pragma unroll
          for (int jj = 0; jj < NCH; ++jj)
            red[(((c - r0) * 2 + mtg) * NCH + jj) * 32 + lane] =
                make_float4(acc[mt][jj][0], acc[mt][jj][1], acc[mt][jj][2], acc[mt][jj][3]);
        }
      }
      __syncthreads();
      if (c == 0) {
        for (int cc = r0; cc < r1; ++cc)
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const int mtg = H == 2 ? mh : mt;
#pragma unroll
            for (int jj = 0; jj < NCH; ++jj) {
              const float4 v = red[(((cc - r0) * 2 + mtg) * NCH + jj) * 32 + lane];
              float* a4 = acc[mt][jj];
              a4[0] = __fadd_rn(a4[0], v.x);
              a4[1] = __fadd_rn(a4[1], v.y);
              a4[2] = __fadd_rn(a4[2], v.z);
              a4[3] = __fadd_rn(a4[3], v.w);
            }
          }
      }
      __syncthreads();
    }
    if (c != 0) continue;

    if constexpr (NCH >= 8) load_rows();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int mtg = H == 2 ? mh : mt;
#pragma unroll
      for (int jj = 0; jj < NCH; ++jj)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int h = i >> 1, r = 2 * mt + h;
          const int n = nbase + 16 * mtg + g + 8 * h;
          const int m = 8 * jj + 2 * t + (i & 1);
          if (n < p.N && m < p.M) {
            const float sc = rscale[r];
            float v = acc[mt][jj][i] * sc;
            if (re0[r] < re1[r]) v = fix_escapes(v, sc, re0[r], re1[r], m, p);
            if (p.bias) v = __fadd_rn(v, rbias[r]);
            p.y[(int64_t)m * p.ldy + n] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
          }
        }
    }
  }
  cp_async_wait<0>();
}

int nch_for(int tokens) { return tokens <= 8 ? 1 : tokens <= 16 ? 2 : tokens <= 32 ? 4 : 8; }

// Ring depth per warp with `cps` CTAs per SM: what the SM's shared memory holds after the
// range-sum buffer and the 1 KB per CTA the hardware reserves, at most `cap` (0: kMaxStages).
int ring_stages(const DevInfo& d, int warps, int stage_bytes, int red_bytes, int cps, int cap) {
  int budget = d.smem_sm / cps - 1024;
  if (budget > d.smem_optin) budget = d.smem_optin;
  const int s = (budget - red_bytes) / (warps * stage_bytes);
  const int hi = (cap >= 2 && cap < kMaxStages) ? cap : kMaxStages;
  return s > hi ? hi : s;
}

template <int NCH, int H>
cudaError_t launch_slab(SlabParams p, const DevInfo& d, int dev, int cps_req, int stage_cap, bool pdl,
                        cudaStream_t stream) {
  using G_ = Geo<H>;
  constexpr auto kern = gemm_w12_slab_kernel<NCH, H>;
  p.xrows = NCH == 1 ? p.M : 8 * NCH;
  p.stage_bytes = (G_::kW + p.xrows * kXRow + 15) / 16 * 16;
  const int per_range = 2 * NCH * 32 * 16;  // one range's sums for the slab's two m-tiles
  p.red_ranges = NCH >= 8 ? 4 : kSplit - 1;
  p.red_bytes = p.red_ranges * per_range;
  // Two CTAs per SM when there are slabs for them and each warp still gets a ring of >= 4
  // stages, else one (with the deeper ring).
  int cps = cps_req < 1 ? 1 : cps_req > 2 ? 2 : cps_req;
  if (p.nslab <= d.sms) cps = 1;
  if (cps == 2 && ring_stages(d, G_::kWarps, p.stage_bytes, p.red_bytes, 2, stage_cap) < 4) cps = 1;
  p.S = ring_stages(d, G_::kWarps, p.stage_bytes, p.red_bytes, cps, stage_cap);
  if (p.S < 2) return cudaErrorInvalidConfiguration;
  const int per = (p.nslab + d.sms * cps - 1) / (d.sms * cps);
  p.G = (p.nslab + per - 1) / per;
  const int smem = p.red_bytes + G_::kWarps * p.S * p.stage_bytes;
  if (const cudaError_t e = set_smem_limit_once<kern>(dev, d.smem_optin); e != cudaSuccess) return e;
  return launch_ex(kern, dim3(p.G), dim3(G_::kThreads), smem, stream, 1, pdl && d.major >= 9, p);
}

}  // namespace

cudaError_t gemm_slab_launch(const GemmArgs& a, cudaStream_t stream) {
  if (cudaError_t e0 = gemm_check_args(a); e0 != cudaSuccess) return e0;
  if (a.M == 0) return cudaSuccess;
  const int kt = (a.K + 63) / 64;
  DevInfo d;
  int dev = 0;
  cudaError_t e = dev_info(d, dev);
  if (e != cudaSuccess) return e;
  const int cps = a.target_ctas > d.sms ? 2 : 1;
  const bool pdl = !(a.flags & 32);
  SlabParams p{};
  static_cast<GemmOperands&>(p) = a;  // x and y are re-pointed per 64-token pass below
  p.N = a.N;
  p.KT = kt;
  p.kper = (kt + kSplit - 1) / kSplit;
  p.nslab = (a.N + 31) / 32;
  p.ldx = a.ldx;
  p.ldy = a.ldy;
  p.diag = a.flags & (1 | 128);
  for (int m0 = 0; m0 < a.M; m0 += kMaxTokens) {
    const int tokens = (a.M - m0) < kMaxTokens ? (a.M - m0) : kMaxTokens;
    p.x = a.x + (int64_t)m0 * a.ldx;
    p.y = a.y + (int64_t)m0 * a.ldy;
    p.M = tokens;
    // Two warps per K range (one per m-tile) where decode latency dominates (M <= 8), unless
    // W12_GEMM_DIAG bit 64 asks for one (timing only: the same bits either way).
    const bool split_m = nch_for(tokens) == 1 && !(a.flags & 64);
    switch (nch_for(tokens)) {
      case 1:
        e = split_m ? launch_slab<1, 2>(p, d, dev, cps, a.stages, pdl, stream)
                    : launch_slab<1, 1>(p, d, dev, cps, a.stages, pdl, stream);
        break;
      case 2: e = launch_slab<2, 1>(p, d, dev, cps, a.stages, pdl, stream); break;
      case 4: e = launch_slab<4, 1>(p, d, dev, cps, a.stages, pdl, stream); break;
      default: e = launch_slab<8, 1>(p, d, dev, cps, a.stages, pdl, stream); break;
    }
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace w12
