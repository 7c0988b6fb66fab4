// W12 GEMM v2: warp-specialised, persistent stream-K (sm_80, sm_90, sm_120a).
// y[M, N] = x[M, K] W[N, K]^T, computed as y^T = W x^T like v1 (gemm_w12_mma_sm120.cu): a 128x64
// record is the A operand of mma.m16n8k16 decoded straight into registers (layout 4,
// smxx_w12_decode.cuh), tokens are the MMA's n.
//
// What changed against v1 and why (measurements in docs/perf-notes.md):
// - Producer/consumer split. Warp 4 only streams: on sm_90+ one lane issues a 12 KB bulk copy per
//   record plus one 128-byte copy per token row of the activation tile, completing on the
//   stage's `full` mbarrier; on sm_80 its 32 lanes issue cp.async and arrive through
//   cp.async.mbarrier.arrive.noinc. Warps 0..3 decode + MMA and free the stage on its `empty`
//   barrier. The ring is as deep as shared memory allows (up to 16 stages), and the producer
//   runs ahead by the whole ring: loads never wait on decode (v1 lost 2-10 us to that).
// - Persistent stream-K. The grid is G = SMs x CTAs-per-SM, all co-resident (checked with the
//   occupancy API at launch). The flattened record sequence (row tile major, k minor: exactly
//   the memory order of the records) is cut into G contiguous ranges, CTA c taking
//   [floor(c T / G), floor((c+1) T / G)). The cut depends on (N, K, G) only, never on M.
// - Deterministic in-kernel fix-up. A tile cut by range boundaries has one owner, the CTA whose
//   range holds its k = 0 record; the owner reaches it at the *end* of its range, while the rest
//   of the tile is the *start* of the next CTAs' ranges, so those partials are usually ready.
//   A non-owner segment (only ever the first segment of a range) writes FP32 partials to the
//   workspace slot of its CTA and releases flag[c]; the owner acquires the flags of CTAs
//   c+1, c+2, ... in order and adds their partials in that order, then resets the flags (the
//   next launch on this stream finds them zero: no memset node, graph replay safe). Every
//   output element is therefore: (k-ordered sum of the owner segment) + seg 1 + seg 2 + ...,
//   one fixed sequence of FP32 adds for a given (N, K, G), whatever M is.
// - Epilogue in the owner (as v1): scale 2^(b - E0), escapes in escape-list order, bias, BF16.
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
constexpr int kConsumers = 128;             // 4 warps x 32 rows of a record
constexpr int kThreads = kConsumers + 32;   // + the producer warp
constexpr int kMaxStages = 16;
constexpr int kXRow = 144;                  // activation row pitch in shared memory: 128 B + 16 B pad
constexpr int kMaxTokens = 64;

struct SKParams : GemmOperands {
  float4* ws;   // [G][2*NCH fragments][128 threads]
  int* flags;   // [G], zero on entry and on exit
  int M, N, KT, G, S, stage_bytes;
  int64_t T, ldx, ldy;
  int diag;     // 1: stream only, no decode/MMA (wrong output; benchmark diagnostics)
};

__device__ __forceinline__ int64_t range_start(int c, int64_t T, int G) { return (int64_t)c * T / G; }

struct Rows {
  float scale[4], bias[4];
  int e0[4], e1[4];
};

template <typename T>
__device__ __forceinline__ T pick(const T (&a)[4], int r) {
  return r == 0 ? a[0] : r == 1 ? a[1] : r == 2 ? a[2] : a[3];  // no run-time register indexing
}

template <int NCH>
__global__ void __launch_bounds__(kThreads, 2) gemm_w12_sk_kernel(const SKParams p) {
  constexpr int kFrag = 2 * NCH;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t s_full[kMaxStages], s_empty[kMaxStages];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int c = blockIdx.x;
  const int64_t r0 = range_start(c, p.T, p.G), r1 = range_start(c + 1, p.T, p.G);
  if (r0 == r1) return;  // more CTAs than records: nothing here, and no flag to set
  const uint32_t sbase = smem_u32(smem);
  const uint32_t full0 = smem_u32(s_full), empty0 = smem_u32(s_empty);
  const int S = p.S;

  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
#if __CUDA_ARCH__ >= 900
      mbar_init(full0 + 8 * s, 33);  // lane 0's arrive.expect_tx (record bytes) + 32 cp.async arrivals
#else
      mbar_init(full0 + 8 * s, 32);  // one cp.async-tracked arrival per producer lane
#endif
      mbar_init(empty0 + 8 * s, kConsumers / 32);
    }
    mbar_fence_init();
  }
  // Token rows >= M of every stage's activation tile stay zero (the producer never writes them).
  {
    const int zrows = NCH * 8 - p.M;
    for (int i = tid; i < S * zrows * 8; i += kThreads) {
      const int s = i / (zrows * 8), rem = i % (zrows * 8);
      *reinterpret_cast<uint4*>(smem + s * p.stage_bytes + kRec + (p.M + rem / 8) * kXRow + (rem % 8) * 16) =
          make_uint4(0, 0, 0, 0);
    }
  }
  __syncthreads();

  if (warp == kConsumers / 32) {
    // ---- producer ----------------------------------------------------------------------------
    int stage = 0;
    uint32_t phase = 0;
#if __CUDA_ARCH__ >= 900
    // Measured (v2b, stream-only diagnostic): with default L2 policy the records evicted the
    // activation rows between their reuses (a k-tile's rows are reused by every row tile, and
    // stream-K puts those far apart in time), so x came from HBM: +60 % bytes at 64 tokens.
    const uint64_t pol = l2_policy_evict_first();
#endif
    for (int64_t idx = r0; idx < r1; ++idx) {
      if (idx - r0 >= S) mbar_wait(empty0 + 8 * stage, phase ^ 1);
      const uint32_t dst = sbase + stage * p.stage_bytes, bar = full0 + 8 * stage;
      const int64_t kcol = (idx % p.KT) * 64;
      const uint8_t* src = p.records + idx * kRec;
#if __CUDA_ARCH__ >= 900
      if (lane == 0) {
        mbar_arrive_expect_tx(bar, kRec);
        bulk_copy_g2s_hint(dst, src, kRec, bar, pol);
      }
#else
#pragma unroll 4
      for (int i = lane; i < kRec / 16; i += 32) cp_async16(dst + i * 16, src + i * 16);
#endif
      // Activation rows by 16-byte cp.async from every lane, not one bulk copy per 128-byte row:
      // measured (v2a), 1 + M small bulk copies per record made the copy engine the bottleneck
      // from 16 tokens up.
      for (int i = lane; i < p.M * 8; i += 32)
        cp_async16(dst + kRec + (i >> 3) * kXRow + (i & 7) * 16, p.x + (i >> 3) * p.ldx + kcol + (i & 7) * 8);
      cp_async_mbar_arrive_noinc(bar);
      if (++stage == S) stage = 0, phase ^= 1;
    }
    cp_async_wait_all_pipe();
    return;
  }

  // ---- consumers: warp w owns rows 32w..32w+31 of each record (layout 4) -------------------------
  const int g = lane >> 2, t = lane & 3;
  const uint32_t hi_off = warp * 2048 + lane * 16, lo_off = 8192 + warp * 1024 + lane * 8;
  int stage = 0;
  uint32_t phase = 0;
  int64_t idx = r0;
  while (idx < r1) {
    const int tile = (int)(idx / p.KT);
    const int64_t tile_end = (int64_t)(tile + 1) * p.KT;
    const int64_t seg_end = r1 < tile_end ? r1 : tile_end;
    const bool owner = idx == (int64_t)tile * p.KT;
    const int nbase = tile * 128 + warp * 32;

    // Epilogue row data, loaded now so its latency hides behind the segment's main loop; at 64
    // tokens the 16 registers it holds through the loop would spill (168-register cap for
    // 2 CTAs x 5 warps), so there it is loaded after the loop.
    Rows rd;
    auto load_rows = [&]() {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int n = nbase + (r >> 1) * 16 + g + 8 * (r & 1);
        const bool ok = owner && n < p.N;
        rd.scale[r] = ok ? row_scale(__ldg(p.base + n)) : 0.f;
        rd.e0[r] = ok ? __ldg(p.esc_ptr + n) : 0;
        rd.e1[r] = ok ? __ldg(p.esc_ptr + n + 1) : 0;
        rd.bias[r] = (ok && p.bias) ? __ldg(p.bias + n) : 0.f;
      }
    };
    if constexpr (NCH < 8) load_rows();

    float acc[2][NCH][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int j = 0; j < NCH; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][j][i] = 0.f;

    for (; idx < seg_end; ++idx) {
      mbar_wait(full0 + 8 * stage, phase);
      const uint8_t* st = smem + stage * p.stage_bytes;
      if (!(p.diag & 1)) {
        uint32_t a[32];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint4 h = *reinterpret_cast<const uint4*>(st + hi_off + q * 512);
          const uint2 l = *reinterpret_cast<const uint2*>(st + lo_off + q * 256);
          decode16_split(h, l, a + 8 * q, opaque_k38(static_cast<uint32_t>(p.M) >> 30));  // see decode16
        }
        mma_record<NCH, 2, kXRow>(acc, a, st + kRec, g, t, true);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty0 + 8 * stage);  // this warp is done reading the stage
      if (++stage == S) stage = 0, phase ^= 1;
    }

    if (!owner) {
      // First segment of this range, continuing a tile owned by an earlier CTA: publish it.
      float4* mine = p.ws + (size_t)c * (kFrag * kConsumers) + tid;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int j = 0; j < NCH; ++j)
          __stcg(mine + (mt * NCH + j) * kConsumers, make_float4(acc[mt][j][0], acc[mt][j][1], acc[mt][j][2], acc[mt][j][3]));
      __threadfence();
      named_bar_sync(1, kConsumers);
      if (tid == 0) st_release_gpu(p.flags + c, 1);
      continue;
    }
    if (seg_end < tile_end) {
      // The tile continues in CTAs c+1 .. cend-1 (ranges starting inside it). Their flags are
      // awaited in parallel (thread i watches CTA c+1+i) and then the partials are fetched in
      // batches with every load issued before the first add: a chain of one L2 round trip per
      // CTA (v2a) cost several us per split tile.
      int cend = c + 1;
      while (cend < p.G && range_start(cend, p.T, p.G) < tile_end) ++cend;
      for (int cc = c + 1 + tid; cc < cend; cc += kConsumers)
        if (range_start(cc + 1, p.T, p.G) > range_start(cc, p.T, p.G))  // empty ranges set no flag
          while (ld_acquire_gpu(p.flags + cc) == 0) {
          }
      named_bar_sync(1, kConsumers);  // orders the acquires above before every thread's loads
      if (tid == 0)
        for (int cc = c + 1; cc < cend; ++cc) p.flags[cc] = 0;  // ready for the next launch
      constexpr int U = NCH == 1 ? 8 : NCH == 2 ? 4 : 1;          // partials per batch
      constexpr int MTB = NCH >= 8 ? 1 : 2;                      // m-tiles per batch (registers)
      for (int cb = c + 1; cb < cend; cb += U) {
#pragma unroll
        for (int mt0 = 0; mt0 < 2; mt0 += MTB) {
          float4 v[U][MTB][NCH];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int cc = cb + u;
            const bool live = cc < cend && range_start(cc + 1, p.T, p.G) > range_start(cc, p.T, p.G);
            const float4* part = p.ws + (size_t)cc * (kFrag * kConsumers) + tid;
#pragma unroll
            for (int mm = 0; mm < MTB; ++mm)
#pragma unroll
              for (int j = 0; j < NCH; ++j)
                v[u][mm][j] = live ? __ldcg(part + ((mt0 + mm) * NCH + j) * kConsumers) : make_float4(0, 0, 0, 0);
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int cc = cb + u;
            if (cc < cend && range_start(cc + 1, p.T, p.G) > range_start(cc, p.T, p.G)) {
#pragma unroll
              for (int mm = 0; mm < MTB; ++mm)
#pragma unroll
                for (int j = 0; j < NCH; ++j) {
                  float* a4 = acc[mt0 + mm][j];
                  a4[0] = __fadd_rn(a4[0], v[u][mm][j].x);
                  a4[1] = __fadd_rn(a4[1], v[u][mm][j].y);
                  a4[2] = __fadd_rn(a4[2], v[u][mm][j].z);
                  a4[3] = __fadd_rn(a4[3], v[u][mm][j].w);
                }
            }
          }
        }
      }
    }

    if constexpr (NCH >= 8) load_rows();
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int j = 0; j < NCH; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int h = i >> 1, r = 2 * mt + h;
          const int n = nbase + 16 * mt + g + 8 * h;
          const int m = 8 * j + 2 * t + (i & 1);
          if (n < p.N && m < p.M) {
            const float sc = pick(rd.scale, r);
            float v = acc[mt][j][i] * sc;
            const int e0 = pick(rd.e0, r), e1 = pick(rd.e1, r);
            if (e0 < e1) v = fix_escapes(v, sc, e0, e1, m, p);
            if (p.bias) v = __fadd_rn(v, pick(rd.bias, r));
            p.y[(int64_t)m * p.ldy + n] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
          }
        }
  }
}

int nch_for(int tokens) { return tokens <= 8 ? 1 : tokens <= 16 ? 2 : tokens <= 32 ? 4 : 8; }

// Ring depth for CTAs-per-SM `cps`: as many stages as the SM's shared memory holds for `cps`
// co-resident CTAs (1 KB per CTA is reserved by the hardware), at most `cap` (0 = kMaxStages).
int stages_for(const DevInfo& d, int stage_bytes, int cps, int cap) {
  const int static_bytes = 2 * kMaxStages * 8;
  int budget = d.smem_sm / cps - 1024 - static_bytes;
  if (budget > d.smem_optin - static_bytes) budget = d.smem_optin - static_bytes;
  int s = budget / stage_bytes;
  const int hi = (cap >= 2 && cap < kMaxStages) ? cap : kMaxStages;
  return s > hi ? hi : s;
}

template <int NCH>
cudaError_t launch_sk(SKParams p, int cps, int stage_cap, cudaStream_t stream) {
  constexpr auto kern = gemm_w12_sk_kernel<NCH>;
  DevInfo d;
  int dev_idx = 0;
  cudaError_t e = dev_info(d, dev_idx);
  if (e != cudaSuccess) return e;
  p.stage_bytes = kRec + NCH * 8 * kXRow;
  p.S = stages_for(d, p.stage_bytes, cps, stage_cap);
  if (p.S < 2) return cudaErrorInvalidConfiguration;
  const int smem = p.S * p.stage_bytes;
  // Per (device, instantiation): raise the dynamic shared-memory limit once; check co-residency
  // for each (ring size, CTAs per SM) once. The owner of a split tile spins on flags set by
  // later CTAs, so every CTA of the grid must be resident at once.
  static int checked[64][kMaxStages + 1][4] = {};
  int dev = 0;
  if ((e = cudaGetDevice(&dev)) != cudaSuccess) return e;
  if (dev >= 64 || cps > 3) return cudaErrorInvalidValue;
  if ((e = set_smem_limit_once<kern>(dev, d.smem_optin - 2 * kMaxStages * 8)) != cudaSuccess) return e;
  if (!checked[dev][p.S][cps]) {
    int nb = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, kern, kThreads, smem);
    if (e != cudaSuccess) return e;
    if (nb < cps) return cudaErrorCooperativeLaunchTooLarge;  // CTAs would not all be co-resident
    checked[dev][p.S][cps] = 1;
  }
  kern<<<p.G, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

int gemm_sk_grid(int target_ctas) { return target_ctas < 1 ? 1 : target_ctas; }

size_t gemm_sk_workspace_bytes(int M, int target_ctas) {
  if (M <= 0) return 0;
  const int tokens = M < kMaxTokens ? M : kMaxTokens;
  return (size_t)gemm_sk_grid(target_ctas) * 2 * nch_for(tokens) * kConsumers * sizeof(float4);
}

cudaError_t gemm_sk_launch(const GemmArgs& a, cudaStream_t stream) {
  if (cudaError_t e0 = gemm_check_args(a); e0 != cudaSuccess) return e0;
  if (a.M == 0) return cudaSuccess;
  const int nt = (a.N + 127) / 128, kt = (a.K + 63) / 64;
  if (a.workspace == nullptr || a.counters == nullptr) return cudaErrorInvalidValue;
  DevInfo d;
  int dev_idx = 0;
  cudaError_t e = dev_info(d, dev_idx);
  if (e != cudaSuccess) return e;
  const int G = gemm_sk_grid(a.target_ctas);
  const int cps = (G + d.sms - 1) / d.sms;
  SKParams p{};
  static_cast<GemmOperands&>(p) = a;  // x and y are re-pointed per 64-token pass below
  p.ws = static_cast<float4*>(a.workspace);
  p.flags = a.counters;
  p.N = a.N;
  p.KT = kt;
  p.G = G;
  p.T = (int64_t)nt * kt;
  p.ldx = a.ldx;
  p.ldy = a.ldy;
  p.diag = a.flags;
  // M > 64: 64-token passes (stream order: they share the workspace and flags).
  for (int m0 = 0; m0 < a.M; m0 += kMaxTokens) {
    const int tokens = (a.M - m0) < kMaxTokens ? (a.M - m0) : kMaxTokens;
    p.x = a.x + (int64_t)m0 * a.ldx;
    p.y = a.y + (int64_t)m0 * a.ldy;
    p.M = tokens;
    switch (nch_for(tokens)) {
      case 1: e = launch_sk<1>(p, cps, a.stages, stream); break;
      case 2: e = launch_sk<2>(p, cps, a.stages, stream); break;
      case 4: e = launch_sk<4>(p, cps, a.stages, stream); break;
      default: e = launch_sk<8>(p, cps, a.stages, stream); break;
    }
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace w12
