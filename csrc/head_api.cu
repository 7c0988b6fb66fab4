// C ABI of the certified LM head kernels (bound by w12/head_cuda.py through ctypes).
//
// Every function returns a cudaError_t code (0 = success); cudaErrorInvalidValue (1) for bad
// arguments. Streams are passed as void*. Nothing here synchronises, allocates or reads back, so
// the calls can be captured in a CUDA graph.
#include <stdint.h>

#include "head_common.cuh"
#include "smxx_gemm_common.cuh"

namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

bool bad_shape(int m, int k, int v, int vpad, int kpad) {
  return m < 1 || m > HEAD_MAX_M || k < 1 || k > kpad || kpad % HEAD_KQ != 0 || v < 1 || vpad < v ||
         vpad % HEAD_TILE_ROWS != 0;
}

}  // namespace

extern "C" {

// Bytes of the per-head workspace (256-byte aligned sub-buffers); allocate it 256-byte aligned.
int w12_head_workspace_bytes(int kpad, int vpad, long long* bytes) {
  if (!bytes || kpad < HEAD_KQ || kpad % HEAD_KQ != 0 || vpad < HEAD_TILE_ROWS || vpad % HEAD_TILE_ROWS != 0)
    return cudaErrorInvalidValue;
  *bytes = static_cast<long long>(head_ws_layout(nullptr, kpad, vpad, nullptr));
  return cudaSuccess;
}

// Certified argmax of m <= 32 hidden rows.
//   h: [m, ldh] float32 (h_bf16 = 0) or bfloat16 (h_bf16 = 1), first k columns used;
//   q: int8 [vpad, kpad] (zero padded), rowp: float4 [vpad] {a_v, rho_v, ||q_hat_v||, 0};
//   w: bfloat16 [v, kpad] exact weights (zero padded columns); ws: workspace (see above);
//   out_ids: int64 [m]; out_count: int32 [m] survivors rescored, or NULL;
//   flags: HEAD_FLAG_RESCORE_ALL (1) skips the screening decision and rescores the whole
//   vocabulary; HEAD_FLAG_PDL (2) launches screen and rescore with programmatic dependent launch
//   (sm_90+, ignored elsewhere); HEAD_FLAG_L2_256B (4): the screen's loads carry the L2::256B
//   prefetch hint (w12/head_cuda.py sets it unless W12_HEAD_DIAG=4).
int w12_head_argmax(const void* h, int h_bf16, int m, long long ldh, int k, const void* q, const void* rowp,
                    const void* w, int v, int vpad, int kpad, void* ws, long long* out_ids, int* out_count,
                    int flags, void* stream) {
  if (!h || !q || !rowp || !w || !ws || !out_ids || bad_shape(m, k, v, vpad, kpad) || ldh < k) return cudaErrorInvalidValue;
  if (!aligned16(q) || !aligned16(rowp) || !aligned16(w) || (reinterpret_cast<uintptr_t>(ws) & 255u) != 0)
    return cudaErrorInvalidValue;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int rescore_all = flags & HEAD_FLAG_RESCORE_ALL;
  bool pdl = false;
  if (flags & HEAD_FLAG_PDL) {  // device properties cached per device (no attribute query per call)
    w12::DevInfo di;
    int dev = 0;
    if (cudaError_t e = w12::dev_info(di, dev); e != cudaSuccess) return e;
    pdl = di.major >= 9;
  }
  HeadWs hw;
  head_ws_layout(ws, kpad, vpad, &hw);
  cudaError_t err = w12h_launch_prep(h, h_bf16 ? 1 : 0, m, ldh, k, kpad, hw, st);
  if (err != cudaSuccess) return err;
  if (!rescore_all) {
    err = w12h_launch_screen(static_cast<const int8_t*>(q), static_cast<const float4*>(rowp), v, vpad, kpad, m, hw,
                             flags, pdl, st);
    if (err != cudaSuccess) return err;
  }
  return w12h_launch_rescore(static_cast<const uint16_t*>(w), v, vpad, kpad, m, rescore_all, hw, out_ids,
                             out_count, pdl, st);
}

// The exact routine over the whole vocabulary: out float32 [m, v] (the scores of h' = 2^-e h).
int w12_head_exact_scores(const void* h, int h_bf16, int m, long long ldh, int k, const void* w, int v, int vpad,
                          int kpad, void* ws, float* out, void* stream) {
  if (!h || !w || !ws || !out || bad_shape(m, k, v, vpad, kpad) || ldh < k) return cudaErrorInvalidValue;
  if (!aligned16(w) || (reinterpret_cast<uintptr_t>(ws) & 255u) != 0) return cudaErrorInvalidValue;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  HeadWs hw;
  head_ws_layout(ws, kpad, vpad, &hw);
  cudaError_t err = w12h_launch_prep(h, h_bf16 ? 1 : 0, m, ldh, k, kpad, hw, st);
  if (err != cudaSuccess) return err;
  return w12h_launch_exact_all(static_cast<const uint16_t*>(w), v, kpad, m, hw, out, st);
}

}  // extern "C"
