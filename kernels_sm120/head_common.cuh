// Shared definitions of the certified LM head kernels (screen + rescore). Torch-free.
//
// Workspace (one per head and device, sized for up to HEAD_MAX_M hidden rows), byte offsets from
// head_ws_layout(): h' (fp32 [32][Kpad]), p_hi / p_lo (int8 [32][Kpad]), per-row stats, control
// words (Lmax, best key, survivor count, done ticket) and the upper bounds U (fp32 [32][Vpad]).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "smxx_launch.cuh"

#define HEAD_MAX_M 32
#define HEAD_KQ 64        // K granularity of the INT8 rows (one 64-byte chunk per lane group)
#define HEAD_TILE_ROWS 16 // vocabulary rows per warp tile (mma m16)
#define HEAD_SEG 2048     // vocabulary entries scanned (and at most rescored) per rescore block
#define HEAD_FLAG_RESCORE_ALL 1  // w12_head_argmax flags: skip the screen, rescore every token
#define HEAD_FLAG_PDL 2          // programmatic dependent launch of screen and rescore (sm_90+)
#define HEAD_FLAG_L2_256B 4      // screen loads ask L2 for whole 256-byte sectors (on by default)

struct HeadWs {
  float* hp;          // [32][Kpad] h' = 2^-e h (fp32), zero padded
  int8_t* phi;        // [32][Kpad] high digit of p = rint(2^15 h')
  int8_t* plo;        // [32][Kpad] low digit (p = 256 p_hi + p_lo)
  float* hn;          // [32] ||h'||_2 rounded up
  float* rh;          // [32] ||h' - 2^-15 p||_2 rounded up
  unsigned* lmax;     // [32] order-preserving encoding of max_v (c_v - B_v)
  unsigned long long* key;  // [32] (enc(s) << 32) | ~v of the best exact score so far
  int* count;         // [32] survivors rescored
  unsigned* done;     // [1] rescore blocks finished
  float* upper;       // [32][Vpad] c_v + B_v
};

static inline size_t head_align(size_t x) { return (x + 255) & ~size_t(255); }

// Offsets are a pure function of (Kpad, Vpad) so the Python side only allocates the byte count.
static inline size_t head_ws_layout(void* base, int kpad, int vpad, HeadWs* ws) {
  size_t off = 0;
  char* b = static_cast<char*>(base);
  auto take = [&](size_t bytes) { char* p = b ? b + off : nullptr; off = head_align(off + bytes); return p; };
  HeadWs w;
  w.hp = reinterpret_cast<float*>(take(sizeof(float) * HEAD_MAX_M * kpad));
  w.phi = reinterpret_cast<int8_t*>(take(size_t(HEAD_MAX_M) * kpad));
  w.plo = reinterpret_cast<int8_t*>(take(size_t(HEAD_MAX_M) * kpad));
  w.hn = reinterpret_cast<float*>(take(sizeof(float) * HEAD_MAX_M));
  w.rh = reinterpret_cast<float*>(take(sizeof(float) * HEAD_MAX_M));
  w.lmax = reinterpret_cast<unsigned*>(take(sizeof(unsigned) * HEAD_MAX_M));
  w.key = reinterpret_cast<unsigned long long*>(take(sizeof(unsigned long long) * HEAD_MAX_M));
  w.count = reinterpret_cast<int*>(take(sizeof(int) * HEAD_MAX_M));
  w.done = reinterpret_cast<unsigned*>(take(sizeof(unsigned)));
  w.upper = reinterpret_cast<float*>(take(sizeof(float) * HEAD_MAX_M * size_t(vpad)));
  if (ws) *ws = w;
  return off;
}

// Monotone map float -> uint32 (a < b  <=>  enc(a) < enc(b) for non-NaN; -0 maps below +0, so the
// exact scores are canonicalised to +0 before encoding).
__device__ __forceinline__ unsigned head_enc(float f) {
  unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float head_dec(unsigned e) {
  return __uint_as_float((e & 0x80000000u) ? (e & 0x7fffffffu) : ~e);
}

// Launchers (host functions; defined next to their kernels, called by csrc/head_api.cu).
cudaError_t w12h_launch_prep(const void* h, int h_bf16, int m, long long ldh, int k, int kpad, const HeadWs& ws,
                             cudaStream_t st);
cudaError_t w12h_launch_screen(const int8_t* q, const float4* rowp, int v, int vpad, int kpad, int m,
                               const HeadWs& ws, int flags, bool pdl, cudaStream_t st);
cudaError_t w12h_launch_rescore(const uint16_t* w, int v, int vpad, int kpad, int m, int rescore_all,
                                const HeadWs& ws, long long* out_ids, int* out_count, bool pdl, cudaStream_t st);

// Launches `kern` with programmatic stream serialization when `pdl` (the kernel must call
// griddepcontrol.wait before it reads anything the previous kernel writes).
template <typename... Params, typename... Args>
cudaError_t head_launch(void (*kern)(Params...), dim3 grid, int threads, bool pdl, cudaStream_t st, Args... args) {
  return w12::launch_ex(kern, grid, dim3(threads), 0, st, 1, pdl, args...);
}
cudaError_t w12h_launch_exact_all(const uint16_t* w, int v, int kpad, int m, const HeadWs& ws, float* out,
                                  cudaStream_t st);
