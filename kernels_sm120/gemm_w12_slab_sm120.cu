// W12 GEMM v3: row slabs with the K-split inside the CTA (sm_80, sm_90, sm_120a).
// y[M, N] = x[M, K] W[N, K]^T computed as y^T = W x^T, the decoded record the A operand of
// mma.m16n8k16 straight from registers (layout 1, smxx_w12_decode.cuh), tokens the MMA's n.
//
// Why this kernel (measurements in docs/perf-notes.md): v1 and v2 split K across CTAs and paid
// 3-7 us per launch for the cross-CTA reduction (global partials + fence + ticket, or the v2
// owner's fix-up), which is most of what separated them from cuBLAS on the small Llama shapes.
// Here a CTA owns a *slab* of 32*QPC rows over the whole K, so no partial sum ever leaves the CTA:
// - The K loop is cut into kSplit = 4 contiguous record ranges, range c = [c*KT/4, (c+1)*KT/4).
//   Consumer warp (quarter qq, range c) decodes the rows of quarter qq in range c; at the end of
//   the slab the four range sums of a row are added in range order through shared memory. Every
//   output element is therefore ((r0 + r1) + r2) + r3 with r_c the k-ordered MMA sum of range c:
//   a function of K alone, so the bits do not depend on M, QPC, the grid or the ring depth.
// - Warp specialisation as in v2: the last warp streams (one lane issues bulk copies of each
//   record's quarter rows on sm_90+, the 32 lanes cp.async on sm_80; activation columns by 16-byte
//   cp.async), stage s of the ring holding record i of every range; full/empty mbarriers.
// - Persistent, balanced grid: G = ceil(slabs / ceil(slabs / (SMs * cps))) CTAs, CTA b taking
//   slabs b, b+G, ...; the producer runs on across slab boundaries, so the ring never drains.
// - Programmatic dependent launch (sm_90+): the producer issues the first ring's worth of weight
//   copies before griddepcontrol.wait (weights are constant; activations are what the previous
//   kernel writes), so back-to-back layers overlap one launch's ramp with the previous tail.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gemm_w12_mma.cuh"
#include "smxx_pipe.cuh"
#include "smxx_w12_decode.cuh"

namespace w12 {
namespace {

constexpr int kRec = 12288;
constexpr int kSplit = 4;       // K ranges per slab: fixes the summation order (never change per call)
constexpr int kMaxStages = 16;
constexpr int kXRow = 144;      // activation row pitch in shared memory: 128 B + 16 B pad
constexpr int kMaxTokens = 64;

struct SlabParams {
  const uint16_t* x;
  const uint8_t* records;
  const uint8_t* base;
  const int32_t* esc_ptr;
  const int32_t* esc_col;
  const int16_t* esc_val;
  const float* bias;
  uint16_t* y;
  int M, N, KT, nslab, G, S;
  int xrows;        // activation rows held per range in a stage (M when M < 8, else 8 * NCH)
  int stage_bytes;  // kSplit * (QPC * 3072 + xrows * kXRow), rounded up to 128
  int red_bytes;    // shared memory for the range sums, ahead of the ring
  int64_t ldx, ldy;
  int diag;         // bit 0: stream only, no decode/MMA (wrong output; benchmark diagnostics)
};

__device__ __forceinline__ int range_begin(int c, int KT) { return c * KT / kSplit; }

__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

struct Rows {
  float scale[4], bias[4];
  int e0[4], e1[4];
};

template <typename T>
__device__ __forceinline__ T pick(const T (&a)[4], int r) {
  return r == 0 ? a[0] : r == 1 ? a[1] : r == 2 ? a[2] : a[3];  // no run-time register indexing
}

// Escapes replace the slot's product 2^(b-127) x by the true weight's, in escape-list order (the
// same adds as v1 and v2; both products are exact in FP32, inf/NaN weights propagate exactly).
__device__ __forceinline__ float fix_escapes(float v, float scale, int e0, int e1, int m, const SlabParams& p) {
  const float slot = scale * 0x1p-15f;
  const uint16_t* xr = p.x + (int64_t)m * p.ldx;
  for (int e = e0; e < e1; ++e) {
    const float xv = bf16_bits_to_float(xr[__ldg(p.esc_col + e)]);
    const float wv = bf16_bits_to_float(static_cast<uint16_t>(__ldg(p.esc_val + e)));
    v = __fadd_rn(v, __fmul_rn(wv, xv));
    v = __fsub_rn(v, __fmul_rn(slot, xv));
  }
  return v;
}

template <int NCH, int QPC>
__global__ void __launch_bounds__((kSplit * QPC + 1) * 32, QPC == 1 ? 2 : 1) gemm_w12_slab_kernel(const SlabParams p) {
  constexpr int kConsumers = kSplit * QPC * 32;
  constexpr int kFrag = 2 * NCH;            // float4 fragments per thread (2 m-tiles x NCH chunks)
  constexpr int JG = NCH < 4 ? NCH : 4;     // token chunks whose B fragments are held at once
  constexpr int WB = QPC * 3072;            // weight bytes of one range's record in a stage
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t s_full[kMaxStages], s_empty[kMaxStages];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int S = p.S, L = (p.KT + kSplit - 1) / kSplit;  // stages per slab
  const int nmine = p.nslab > (int)blockIdx.x ? (p.nslab - 1 - (int)blockIdx.x) / p.G + 1 : 0;
  uint8_t* ring = smem + p.red_bytes;
  const uint32_t sbase = smem_u32(ring);
  const uint32_t full0 = smem_u32(s_full), empty0 = smem_u32(s_empty);
  const int XB = p.xrows * kXRow;

  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
#if __CUDA_ARCH__ >= 900
      mbar_init(full0 + 8 * s, 33);  // lane 0's arrive.expect_tx + 32 cp.async-tracked arrivals
#else
      mbar_init(full0 + 8 * s, 32);
#endif
      mbar_init(empty0 + 8 * s, kConsumers / 32);
    }
    mbar_fence_init();
  }
  if (p.xrows > p.M) {  // token rows >= M stay zero in every stage (the producer never writes them)
    const int zrows = p.xrows - p.M;
    for (int i = tid; i < S * kSplit * zrows * 8; i += blockDim.x) {
      const int s = i / (kSplit * zrows * 8), rem = i % (kSplit * zrows * 8);
      const int c = rem / (zrows * 8), r = rem % (zrows * 8);
      *reinterpret_cast<uint4*>(ring + s * p.stage_bytes + kSplit * WB + c * XB + (p.M + r / 8) * kXRow +
                                (r % 8) * 16) = make_uint4(0, 0, 0, 0);
    }
  }
  __syncthreads();
  pdl_launch_dependents();

  if (warp == kConsumers / 32) {
    // ---- producer: stage j = (slab j / L of this CTA, record j % L of every range) ---------------
    const int total = nmine * L;
    const int pre = total < S ? total : S;  // stages whose weights go out before griddepcontrol.wait
#if __CUDA_ARCH__ >= 900
    const uint64_t pol = l2_policy_evict_first();
#endif
    auto weights = [&](int j, int stage) {
      const int slab = (int)blockIdx.x + (j / L) * p.G, i = j % L;
      const int tile = slab * QPC / 4, q0 = (slab * QPC) % 4;
      const uint32_t dst = sbase + stage * p.stage_bytes, bar = full0 + 8 * stage;
      const uint8_t* trec = p.records + (int64_t)tile * p.KT * kRec;
#if __CUDA_ARCH__ >= 900
      if (lane == 0) {
        int nvalid = 0;
        for (int c = 0; c < kSplit; ++c) nvalid += range_begin(c, p.KT) + i < range_begin(c + 1, p.KT);
        mbar_arrive_expect_tx(bar, nvalid * WB);
        for (int c = 0; c < kSplit; ++c) {
          const int kr = range_begin(c, p.KT) + i;
          if (kr >= range_begin(c + 1, p.KT)) continue;
          const uint8_t* rec = trec + (int64_t)kr * kRec;
          bulk_copy_g2s_hint(dst + c * WB, rec + q0 * 2048, QPC * 2048, bar, pol);
          bulk_copy_g2s_hint(dst + c * WB + QPC * 2048, rec + 8192 + q0 * 1024, QPC * 1024, bar, pol);
        }
      }
#else
      for (int c = 0; c < kSplit; ++c) {
        const int kr = range_begin(c, p.KT) + i;
        if (kr >= range_begin(c + 1, p.KT)) continue;
        const uint8_t* rec = trec + (int64_t)kr * kRec;
        for (int v = lane; v < WB / 16; v += 32) {
          const int off = v < QPC * 128 ? q0 * 2048 + v * 16 : 8192 + q0 * 1024 + (v - QPC * 128) * 16;
          cp_async16(dst + c * WB + v * 16, rec + off);
        }
      }
#endif
    };
    auto activations = [&](int j, int stage) {
      const int i = j % L;
      const uint32_t dst = sbase + stage * p.stage_bytes + kSplit * WB;
      for (int v = lane; v < kSplit * p.M * 8; v += 32) {
        const int c = v / (p.M * 8), r = (v % (p.M * 8)) >> 3, ch = v & 7;
        const int kr = range_begin(c, p.KT) + i;
        if (kr >= range_begin(c + 1, p.KT)) continue;
        cp_async16(dst + c * XB + r * kXRow + ch * 16, p.x + (int64_t)r * p.ldx + (int64_t)kr * 64 + ch * 8);
      }
      cp_async_mbar_arrive_noinc(full0 + 8 * stage);
    };
    for (int j = 0; j < pre; ++j) weights(j, j);
    pdl_wait();
    for (int j = 0; j < pre; ++j) activations(j, j);
    int stage = pre % S;
    uint32_t phase = pre == S ? 1 : 0;
    for (int j = pre; j < total; ++j) {
      mbar_wait(empty0 + 8 * stage, phase ^ 1);
      weights(j, stage);
      activations(j, stage);
      if (++stage == S) stage = 0, phase ^= 1;
    }
    cp_async_wait_all_pipe();
    return;
  }

  // ---- consumers: warp = qq * kSplit + c decodes quarter qq of range c ----------------------------
  pdl_wait();  // the epilogue reads x (escapes) and writes y
  const int qq = warp / kSplit, c = warp % kSplit;
  const int g = lane >> 2, t = lane & 3;
  const int kb = range_begin(c, p.KT), len = range_begin(c + 1, p.KT) - kb;
  const uint32_t hi_off = c * WB + qq * 2048 + lane * 16, lo_off = c * WB + QPC * 2048 + qq * 1024 + lane * 8;
  const uint32_t x_off = kSplit * WB + c * XB;
  const bool xrow_ok = g < p.xrows;  // only false when M < 8 (rows past M are not in the stage)
  float4* red = reinterpret_cast<float4*>(smem);  // [QPC][kSplit - 1][kFrag][32]
  int stage = 0;
  uint32_t phase = 0;
  for (int it = 0; it < nmine; ++it) {
    const int slab = (int)blockIdx.x + it * p.G;
    const int nbase = slab * QPC * 32 + qq * 32;

    Rows rd;
    auto load_rows = [&]() {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int n = nbase + (r >> 1) * 16 + g + 8 * (r & 1);
        const bool ok = c == 0 && n < p.N;
        rd.scale[r] = ok ? row_scale(__ldg(p.base + n)) : 0.f;
        rd.e0[r] = ok ? __ldg(p.esc_ptr + n) : 0;
        rd.e1[r] = ok ? __ldg(p.esc_ptr + n + 1) : 0;
        rd.bias[r] = (ok && p.bias) ? __ldg(p.bias + n) : 0.f;
      }
    };
    if constexpr (NCH < 8) load_rows();  // latency hidden behind the main loop (spills at NCH = 8)

    float acc[2][NCH][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int j = 0; j < NCH; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][j][i] = 0.f;

    for (int i = 0; i < L; ++i) {
      mbar_wait(full0 + 8 * stage, phase);
      const uint8_t* st = ring + stage * p.stage_bytes;
      if (i < len && !(p.diag & 1)) {
        uint32_t a[32];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint4 h = *reinterpret_cast<const uint4*>(st + hi_off + q * 512);
          const uint2 l = *reinterpret_cast<const uint2*>(st + lo_off + q * 256);
          decode16(h, l, a + 8 * q);
        }
#pragma unroll
        for (int j0 = 0; j0 < NCH; j0 += JG) {
          uint32_t bw[JG][8];
#pragma unroll
          for (int jj = 0; jj < JG; ++jj) {
            uint4 b0 = make_uint4(0, 0, 0, 0), b1 = make_uint4(0, 0, 0, 0);
            if (NCH > 1 || xrow_ok) {
              const uint8_t* xr = st + x_off + (8 * (j0 + jj) + g) * kXRow + 32 * t;
              b0 = *reinterpret_cast<const uint4*>(xr);
              b1 = *reinterpret_cast<const uint4*>(xr + 16);
            }
            bw[jj][0] = b0.x, bw[jj][1] = b0.y, bw[jj][2] = b0.z, bw[jj][3] = b0.w;
            bw[jj][4] = b1.x, bw[jj][5] = b1.y, bw[jj][6] = b1.z, bw[jj][7] = b1.w;
          }
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)
#pragma unroll
            for (int jj = 0; jj < JG; ++jj)
#pragma unroll
              for (int mt = 0; mt < 2; ++mt) {
                const uint32_t af[4] = {a[16 * mt + 4 * ks], a[16 * mt + 4 * ks + 1], a[16 * mt + 4 * ks + 2],
                                        a[16 * mt + 4 * ks + 3]};
                mma_bf16_16816(acc[mt][j0 + jj], af, bw[jj][2 * ks], bw[jj][2 * ks + 1]);
              }
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty0 + 8 * stage);
      if (++stage == S) stage = 0, phase ^= 1;
    }

    // Range sums of quarter qq: warps c >= 1 hand theirs over, warp c = 0 adds them in range order.
    // Two barriers: after the writes, and after warp 0's reads (so the next slab's writes wait).
    float4* mine = red + (size_t)qq * (kSplit - 1) * kFrag * 32;
    if (c > 0) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int j = 0; j < NCH; ++j)
          mine[((c - 1) * kFrag + mt * NCH + j) * 32 + lane] =
              make_float4(acc[mt][j][0], acc[mt][j][1], acc[mt][j][2], acc[mt][j][3]);
      named_bar_sync(1 + qq, kSplit * 32);
      named_bar_sync(1 + qq, kSplit * 32);
      continue;
    }
    named_bar_sync(1 + qq, kSplit * 32);
#pragma unroll
    for (int cc = 1; cc < kSplit; ++cc)
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int j = 0; j < NCH; ++j) {
          const float4 v = mine[((cc - 1) * kFrag + mt * NCH + j) * 32 + lane];
          float* a4 = acc[mt][j];
          a4[0] = __fadd_rn(a4[0], v.x);
          a4[1] = __fadd_rn(a4[1], v.y);
          a4[2] = __fadd_rn(a4[2], v.z);
          a4[3] = __fadd_rn(a4[3], v.w);
        }
    named_bar_sync(1 + qq, kSplit * 32);

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

struct DevInfo {
  int sms = 0, smem_sm = 0, smem_optin = 0, major = 0;
};

cudaError_t dev_info(DevInfo& d, int& dev) {
  static DevInfo cache[64];
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev >= 64) return cudaErrorInvalidDevice;
  if (cache[dev].sms) {
    d = cache[dev];
    return cudaSuccess;
  }
  if ((e = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return e;
  if ((e = cudaDeviceGetAttribute(&d.smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev)) != cudaSuccess)
    return e;
  if ((e = cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess)
    return e;
  if ((e = cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev)) != cudaSuccess) return e;
  cache[dev] = d;
  return cudaSuccess;
}

// Ring depth with `cps` CTAs per SM: what the SM's shared memory holds after the range-sum
// buffer and the 1 KB per CTA the hardware reserves, at most `cap` (0: kMaxStages).
int ring_stages(const DevInfo& d, int stage_bytes, int red_bytes, int cps, int cap) {
  const int static_bytes = 2 * kMaxStages * 8;
  int budget = d.smem_sm / cps - 1024 - static_bytes;
  if (budget > d.smem_optin - static_bytes) budget = d.smem_optin - static_bytes;
  const int s = (budget - red_bytes) / stage_bytes;
  const int hi = (cap >= 2 && cap < kMaxStages) ? cap : kMaxStages;
  return s > hi ? hi : s;
}

template <int NCH, int QPC>
cudaError_t launch_slab(SlabParams p, const DevInfo& d, int dev, int cps_req, int stage_cap, bool pdl,
                        cudaStream_t stream) {
  auto kern = gemm_w12_slab_kernel<NCH, QPC>;
  constexpr int threads = (kSplit * QPC + 1) * 32;
  p.xrows = NCH == 1 ? p.M : 8 * NCH;
  p.stage_bytes = (kSplit * (QPC * 3072 + p.xrows * kXRow) + 127) / 128 * 128;
  p.red_bytes = QPC * (kSplit - 1) * 2 * NCH * 32 * 16;
  // Two CTAs per SM when a ring of >= 4 stages still fits (more warps to hide decode and MMA),
  // else one; never more than requested.
  int cps = cps_req < 1 ? 1 : cps_req > 2 ? 2 : cps_req;
  if (cps == 2 && ring_stages(d, p.stage_bytes, p.red_bytes, 2, stage_cap) < 4) cps = 1;
  p.S = ring_stages(d, p.stage_bytes, p.red_bytes, cps, stage_cap);
  if (p.S < 2) return cudaErrorInvalidConfiguration;
  const int per = (p.nslab + d.sms * cps - 1) / (d.sms * cps);
  p.G = (p.nslab + per - 1) / per;
  const int smem = p.red_bytes + p.S * p.stage_bytes;
  static int configured[64] = {0};
  if (!configured[dev]) {
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         d.smem_optin - 2 * kMaxStages * 8);
    if (e != cudaSuccess) return e;
    configured[dev] = 1;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.G);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (pdl && d.major >= 9) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  cudaError_t e = cudaLaunchKernelEx(&cfg, kern, p);
  if (e != cudaSuccess) return e;
  return cudaGetLastError();
}

}  // namespace

cudaError_t gemm_slab_launch(const GemmArgs& a, cudaStream_t stream) {
  if (a.M < 0 || a.N <= 0 || a.K <= 0) return cudaErrorInvalidValue;
  if (a.M == 0) return cudaSuccess;
  const int kt = (a.K + 63) / 64;
  if (a.ldx < (int64_t)kt * 64 || (a.ldx & 7) || a.ldy < a.N) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(a.x) & 15) || (reinterpret_cast<uintptr_t>(a.records) & 15))
    return cudaErrorMisalignedAddress;
  DevInfo d;
  int dev = 0;
  cudaError_t e = dev_info(d, dev);
  if (e != cudaSuccess) return e;
  const int cps = a.target_ctas > d.sms ? 2 : 1;
  // Slab height (a speed choice only: the summation order does not depend on it). Four-quarter
  // slabs share each activation tile between twice the rows; they pay off once the activation
  // traffic is comparable to the weight traffic and there are still enough slabs for every SM.
  const int qpc_env = (a.flags >> 8) & 3;  // 1 or 2 forces, 0 = heuristic
  const bool pdl = !(a.flags & 32);
  SlabParams p{};
  p.records = a.records;
  p.base = a.base;
  p.esc_ptr = a.esc_ptr;
  p.esc_col = a.esc_col;
  p.esc_val = a.esc_val;
  p.bias = a.bias;
  p.N = a.N;
  p.KT = kt;
  p.ldx = a.ldx;
  p.ldy = a.ldy;
  p.diag = a.flags & 1;
  for (int m0 = 0; m0 < a.M; m0 += kMaxTokens) {
    const int tokens = (a.M - m0) < kMaxTokens ? (a.M - m0) : kMaxTokens;
    p.x = a.x + (int64_t)m0 * a.ldx;
    p.y = a.y + (int64_t)m0 * a.ldy;
    p.M = tokens;
    const int nch = nch_for(tokens);
    int qpc = qpc_env ? qpc_env : (nch >= 4 && (a.N + 63) / 64 >= d.sms ? 2 : 1);
    p.nslab = (a.N + 32 * qpc - 1) / (32 * qpc);
    if (qpc == 1) {
      switch (nch) {
        case 1: e = launch_slab<1, 1>(p, d, dev, cps, a.stages, pdl, stream); break;
        case 2: e = launch_slab<2, 1>(p, d, dev, cps, a.stages, pdl, stream); break;
        case 4: e = launch_slab<4, 1>(p, d, dev, cps, a.stages, pdl, stream); break;
        default: e = launch_slab<8, 1>(p, d, dev, cps, a.stages, pdl, stream); break;
      }
    } else {
      switch (nch) {
        case 1: e = launch_slab<1, 2>(p, d, dev, cps, a.stages, pdl, stream); break;
        case 2: e = launch_slab<2, 2>(p, d, dev, cps, a.stages, pdl, stream); break;
        case 4: e = launch_slab<4, 2>(p, d, dev, cps, a.stages, pdl, stream); break;
        default: e = launch_slab<8, 2>(p, d, dev, cps, a.stages, pdl, stream); break;
      }
    }
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace w12
