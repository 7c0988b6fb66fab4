// Probe (session 37): does a register-A wgmma block its warpgroup while other warpgroups' wgmma
// occupy the tensor pipe, and do one warpgroup's decode and another's wgmma overlap on an SM?
// No global memory in the loop: records and activation tiles sit in shared memory (zeros), so
// the loop is v4's step without its copies. Cycles from clock64, per warpgroup, averaged over
// 132 CTAs (one per SM). From this folder:
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I../../kernels_sm120 -I../../kernels_sm90 \
//     probe_wgmma_issue.cu -o probe_wgmma_issue && ./probe_wgmma_issue out.json
// prints a line per configuration (cycles per step against the wgmma's tensor time, and the
// cycles spent issuing, in wait_group and in the barrier) and writes them as JSON. sm_90 only.
// Session 37's run and reading: docs/perf-notes.md, session 37 item 1.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <vector>

#include "smxx_w12_decode.cuh"
#include "smxx_wgmma.cuh"

using namespace w12;
#include "ss_wgmma.inc"

constexpr int kSmem = 200 * 1024;  // one CTA per SM
constexpr int kBOff = 0;           // activation tile: up to 128 rows x 128 B
constexpr int kAOff = 16384;       // SS: one 64 x 128 B A tile per warpgroup (8 KB each)
constexpr int kROff = 65536;       // two record slots of 12 KB

// mode 0: plain (wait0, decode, [barrier], issue); 1: overlap (decode, wait0, ...); 2: deep
// (wait1, decode, ...). stagger: warpgroup w spins w * stagger cycles before its loop.
template <int NWG, int NT, bool SS>
__global__ void __launch_bounds__(128 * NWG, 1)
    probe(int iters, int decode, int extra, int barrier, int mode, int stagger, const uint16_t* x, long long* out) {
#if W12_WGMMA
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, quarter = (tid >> 5) & 3;
  for (int i = tid * 16; i < kSmem; i += blockDim.x * 16) *reinterpret_cast<uint4*>(smem + i) = make_uint4(0, 0, 0, 0);
  fence_proxy_async_smem();
  __syncthreads();
  const uint32_t sb = smem_u32(smem);
  const uint32_t hi_off = quarter * 2048 + lane * 16 + (wg & 1) * 1024, lo_off = 8192 + quarter * 1024 + lane * 8 + (wg & 1) * 512;
  float acc[NT / 2];
#pragma unroll
  for (int i = 0; i < NT / 2; ++i) acc[i] = 0.f;
  uint32_t a0[16], a1[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) a0[i] = a1[i] = 0u;
  long long issue = 0, waitc = 0, barc = 0;
  const uint32_t k38 = opaque_k38(static_cast<uint32_t>(iters) >> 30);
  if (stagger) {
    const long long t = clock64();
    while (clock64() - t < (long long)stagger * wg) {
    }
  }
  const long long tstart = clock64();
  auto step = [&](int it, uint32_t(&buf)[16]) {
    const uint8_t* st = smem + kROff + (it & 1) * kRec;
    auto dec = [&]() {
      if (decode) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const uint4 h = *reinterpret_cast<const uint4*>(st + hi_off + q * 512);
          const uint2 l = *reinterpret_cast<const uint2*>(st + lo_off + q * 256);
          decode16_split(h, l, buf + 8 * q, k38);
        }
      }
      for (int e = 0; e < extra; ++e)
#pragma unroll
        for (int j = 0; j < 16; ++j) asm volatile("lop3.b32 %0, %0, %1, %2, 0x96;" : "+r"(buf[j]) : "r"(k38), "r"(e));
      if (SS)
#pragma unroll
        for (int j = 0; j < 16; ++j) asm volatile("" ::"r"(buf[j]));
    };
    long long t0 = clock64();
    if (mode == 2) {
      wgmma_wait1();
      t0 = clock64() - t0;
      dec();
    } else {
      if (mode == 1) dec();
      const long long tw = clock64();
      wgmma_wait0();
      t0 = clock64() - tw;
#pragma unroll
      for (int k = 0; k < NT / 2; ++k) pin(acc[k]);
      if (mode == 0) dec();
    }
    waitc += t0;
    if (x) {
      cp_async_wait<0>();
      fence_proxy_async_smem();
    }
    if (barrier) {
      const long long tb = clock64();
      __syncthreads();
      barc += clock64() - tb;
    }
    if (x) {
      // NT rows of 128 B, 16 B per piece, into the slot not read by this step's wgmma (a race
      // with the previous step's wgmma is harmless here: timing only).
      const uint32_t dst = sb + 32768 + ((it + 1) & 1) * 16384;
      for (int pc = tid; pc < NT * 8; pc += 128 * NWG)
        cp_async16_ca(dst + pc * 16, x + (size_t)((it * 7) & 63) * NT * 64 + pc * 8);
      cp_async_commit();
    }
    const long long ti = clock64();
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint64_t db = smem_desc_sw128(sb + kBOff + 32 * ks);
      if constexpr (SS) {
        const uint64_t da = smem_desc_sw128(sb + kAOff + wg * 8192 + 32 * ks);
        WgmmaSS<NT>::run(acc, da, db);
      } else {
        Wgmma<NT>::run(acc, buf + 4 * ks, db);
      }
    }
    wgmma_commit();
    issue += clock64() - ti;
  };
  int i = 0;
  for (; i + 1 < iters; i += 2) {
    step(i, a0);
    step(i + 1, a1);
  }
  wgmma_wait0();
#pragma unroll
  for (int k = 0; k < NT / 2; ++k) pin(acc[k]);
  const long long total = clock64() - tstart;
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < NT / 2; ++k) s += acc[k];
  if ((tid & 127) == 0) {
    long long* o = out + ((size_t)blockIdx.x * NWG + wg) * 5;
    o[0] = total;
    o[1] = issue;
    o[2] = waitc;
    o[3] = barc;
    o[4] = (long long)s;
  }
#endif
}

struct Cfg {
  int nwg, nt;
  bool ss;
  int decode, extra, barrier, mode, stagger;
  const char* what;
  int copyx = 0;
};
static uint16_t* xbuf = nullptr;

template <int NWG, int NT, bool SS>
void run_one(const Cfg& c, int iters, long long* dout, FILE* js, bool first) {
  auto k = probe<NWG, NT, SS>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  const int grid = 132;
  std::vector<double> tot, iss, wt, br;
  for (int rep = 0; rep < 5; ++rep) {
    k<<<grid, 128 * NWG, kSmem>>>(iters, c.decode, c.extra, c.barrier, c.mode, c.stagger, c.copyx ? xbuf : nullptr, dout);
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      printf("error %s\n", cudaGetErrorString(e));
      exit(1);
    }
    std::vector<long long> h((size_t)grid * NWG * 5);
    cudaMemcpy(h.data(), dout, h.size() * 8, cudaMemcpyDeviceToHost);
    double t = 0, is = 0, w = 0, b = 0;
    for (int j = 0; j < grid * NWG; ++j) {
      t += h[j * 5];
      is += h[j * 5 + 1];
      w += h[j * 5 + 2];
      b += h[j * 5 + 3];
    }
    const double n = (double)grid * NWG * iters;
    tot.push_back(t / n);
    iss.push_back(is / n);
    wt.push_back(w / n);
    br.push_back(b / n);
  }
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double ideal = NWG * 4 * (NT / 2.0);
  printf("%s%-44s nwg=%d n=%3d %s dec=%d ext=%d bar=%d mode=%d stag=%4d | cyc/iter %7.1f (ideal %5.0f, x%.2f) issue %6.1f wait %6.1f bar %6.1f\n",
         c.copyx ? "+x " : "", c.what, NWG, NT, SS ? "SS" : "RS", c.decode, c.extra, c.barrier, c.mode, c.stagger, med(tot), ideal,
         med(tot) / ideal, med(iss), med(wt), med(br));
  fprintf(js,
          "%s{\"copyx\":%d,\"what\":\"%s\",\"nwg\":%d,\"n\":%d,\"ss\":%d,\"decode\":%d,\"extra\":%d,\"barrier\":%d,\"mode\":%d,"
          "\"stagger\":%d,\"cycles_per_iter\":%.2f,\"ideal\":%.0f,\"issue\":%.2f,\"wait\":%.2f,\"bar\":%.2f}\n",
          first ? "" : ",", c.copyx, c.what, NWG, NT, (int)SS, c.decode, c.extra, c.barrier, c.mode, c.stagger, med(tot), ideal,
          med(iss), med(wt), med(br));
}

template <int NT>
void dispatch(const Cfg& c, int iters, long long* d, FILE* js, bool first) {
  if (c.nwg == 1) c.ss ? run_one<1, NT, true>(c, iters, d, js, first) : run_one<1, NT, false>(c, iters, d, js, first);
  if (c.nwg == 2) c.ss ? run_one<2, NT, true>(c, iters, d, js, first) : run_one<2, NT, false>(c, iters, d, js, first);
  if (c.nwg == 4) c.ss ? run_one<4, NT, true>(c, iters, d, js, first) : run_one<4, NT, false>(c, iters, d, js, first);
}

int main(int argc, char** argv) {
  const char* path = argc > 1 ? argv[1] : "probe_wgmma_issue.json";
  // The kernel bodies exist for sm_90a only: elsewhere they would time nothing and print zeros.
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9 || prop.minor != 0) {
    fprintf(stderr, "probe_wgmma_issue: needs an sm_90 GPU (wgmma); device 0 is not one\n");
    return 2;
  }
  FILE* js = fopen(path, "w");
  if (js == nullptr) {
    fprintf(stderr, "probe_wgmma_issue: cannot write %s\n", path);
    return 2;
  }
  fprintf(js, "[\n");
  long long* d;
  cudaMalloc(&d, 132 * 4 * 5 * 8);
  const int iters = 512;
  cudaMalloc(&xbuf, 64 * 128 * 128);
  cudaMemset(xbuf, 0, 64 * 128 * 128);
  std::vector<Cfg> cfgs;
  for (int nt : {128, 64}) {
    cfgs.push_back({1, nt, false, 0, 0, 0, 0, 0, "tensor rate, 1 WG RS"});
    cfgs.push_back({1, nt, true, 0, 0, 0, 0, 0, "tensor rate, 1 WG SS"});
    cfgs.push_back({4, nt, false, 0, 0, 0, 0, 0, "4 WG RS, no decode, no barrier"});
    cfgs.push_back({4, nt, true, 0, 0, 0, 0, 0, "4 WG SS, no decode, no barrier"});
    cfgs.push_back({4, nt, false, 0, 0, 1, 0, 0, "4 WG RS, no decode, barrier"});
    cfgs.push_back({1, nt, false, 1, 0, 0, 0, 0, "1 WG RS plain decode"});
    cfgs.push_back({1, nt, false, 1, 0, 0, 1, 0, "1 WG RS overlap decode"});
    cfgs.push_back({4, nt, false, 1, 0, 1, 0, 0, "v4-like plain: decode, barrier"});
    cfgs.push_back({4, nt, false, 1, 0, 1, 1, 0, "v4-like overlap: decode, barrier"});
    cfgs.push_back({4, nt, false, 1, 0, 1, 2, 0, "v4-like deep: decode, barrier"});
    cfgs.push_back({4, nt, false, 1, 0, 0, 1, 0, "overlap, no barrier"});
    cfgs.push_back({4, nt, false, 1, 0, 0, 1, 200, "overlap, no barrier, staggered"});
    cfgs.push_back({4, nt, false, 1, 0, 0, 2, 200, "deep, no barrier, staggered"});
    cfgs.push_back({4, nt, true, 1, 0, 1, 1, 0, "SS + decode sink, overlap, barrier"});
    cfgs.push_back({4, nt, false, 1, 2, 1, 1, 0, "overlap + 32 lop3, barrier"});
    cfgs.push_back({4, nt, false, 1, 2, 0, 2, 200, "deep + 32 lop3, no barrier, staggered"});
    cfgs.push_back({2, nt, false, 1, 0, 1, 1, 0, "2 WG overlap, barrier"});
    cfgs.push_back({2, nt, false, 1, 0, 0, 2, 300, "2 WG deep, no barrier, staggered"});
    cfgs.push_back({4, nt, false, 1, 0, 1, 1, 0, "v4-like overlap: decode, barrier", 1});
    cfgs.push_back({4, nt, false, 1, 0, 1, 0, 0, "v4-like plain: decode, barrier", 1});
    cfgs.push_back({4, nt, false, 1, 0, 0, 2, 200, "deep, no barrier, staggered", 1});
  }
  bool first = true;
  for (const Cfg& c : cfgs) {
    if (c.nt == 128) dispatch<128>(c, iters, d, js, first);
    else dispatch<64>(c, iters, d, js, first);
    first = false;
  }
  fprintf(js, "]\n");
  fclose(js);
  return 0;
}
