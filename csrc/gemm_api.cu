// C ABI of the W12 GEMM, loaded by w12/cuda_ops.py through ctypes.
//
// Device pointers, sizes and the caller's cudaStream_t (as void*) in; a cudaError_t value out
// (0 = success). Nothing here allocates or synchronises, so every call can be captured into a
// CUDA graph; the caller (Python) allocates the workspace with torch and checks dtypes, devices
// and contiguity, where the error messages can name tensors.
#include <cuda_runtime.h>
#include <stdint.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "gemm_w12_mma.cuh"
#include "smxx_gemm_common.cuh"

extern "C" {

// Bumped whenever a signature below changes; w12/cuda_ops.py refuses a library it does not know.
// 5: v4 reads layout 2 (w12_gemm_kernel_layout). 6: w12_gemm_v4_ready. 7: w12_gemm_splits takes
// the kernel. 8: v4 reads layout 3, v1-v3 layout 4 (split records, decode16_split). 9:
// w12_gemm_wholek_stages. 10: w12_gemm_counters takes the SM count; w12_gemm_xt_buffer (v4's XT).
// 11: w12_gemm_pair_grid. 12: w12_gemm_nobar. 13: w12_gemm_nobar returns the consumer warpgroups.
// 14: w12_gemm_wholek_warpgroups, w12_gemm_wholek_cluster. 15: w12_gemm_sk_lanes; the XT scratch's
// header holds SK's flags (4 KB). 16: w12_gemm_workspace_bytes takes the diagnostics (SK's park
// only where SK runs).
int w12_gemm_abi_version(void) { return 16; }

// 0 when GEMM kernel v4 (wgmma) can run on the current device (sm_90 with this library's real
// sm_90a code), else the CUDA error that says why not. `auto` takes v4 wherever it is 0.
int w12_gemm_v4_ready(void) { return static_cast<int>(w12::wgmma_image_check()); }

// The record layout the portable GEMM kernels (v1-v3) read (layout 4 in w12/layouts.py: layout
// 1's fragments, split).
int w12_gemm_record_layout(void) { return 4; }

// The record layout GEMM kernel `kernel` (1-4) reads: v4 (wgmma) takes its activation tile in
// column order, so its records put MMA k in column order too, and split (layout 3,
// w12/layouts.py: the decode in 7 instructions per 8 weights).
int w12_gemm_kernel_layout(int kernel) { return kernel == 4 ? 3 : 4; }

// Number of K slices kernel 1 (v1) or 4 (v4) uses for an (N, K) weight (a function of N, K,
// target_ctas, the device's SM count and the kernel only); 0 for any other kernel.
int w12_gemm_splits(int n, int k, int target_ctas, int sms, int kernel) {
  return (kernel == 1 || kernel == 4) ? w12::gemm_splits(n, k, target_ctas, sms, kernel) : 0;
}

// One answer of v4's whole-K rule (kernels_sm90/gemm_w12_wholek_sm90.cu) for an (N, K) weight at
// m token rows on the current device with diagnostics `flags`; -1 if the device cannot be queried.
static int wholek_query(int (*rule)(int, int, int, int, int, int, int, int, int), int n, int k, int m,
                        int target_ctas, int flags) {
  w12::DevInfo di;
  int dev = 0;
  if (w12::dev_info(di, dev) != cudaSuccess) return -1;
  return rule(n, k, w12::gemm_splits(n, k, target_ctas, di.sms, 4), m, di.sms, di.smem_sm, di.smem_optin, 0, flags);
}

// The ring depth of v4's whole-K clusters, or 0 where v4 runs its split grid and reduce kernel or
// an unsplit grid instead (same bits either way; v4's diagnostics 16, 131072, 1048576 and 2097152
// move the rule).
int w12_gemm_wholek_stages(int n, int k, int m, int target_ctas, int flags) {
  return wholek_query(w12::wholek_stages, n, k, m, target_ctas, flags);
}

// Warpgroups per CTA of those clusters (S / 2 for two CTAs per m-tile; 4, or 2 with diagnostic
// 2097152, where m-tiles are packed), 0 where they do not run.
int w12_gemm_wholek_warpgroups(int n, int k, int m, int target_ctas, int flags) {
  return wholek_query(w12::wholek_warpgroups, n, k, m, target_ctas, flags);
}

// CTAs per cluster of those clusters (2 for two CTAs per m-tile; with packed m-tiles S / gcd(S, W):
// by default 1, up to 8 with diagnostic 2097152), 0 where they do not run.
int w12_gemm_wholek_cluster(int n, int k, int m, int target_ctas, int flags) {
  return wholek_query(w12::wholek_cluster_ctas, n, k, m, target_ctas, flags);
}

// 1 where v4 runs its pair grid for an (N, K) weight at m token rows (one pass) with
// target_ctas and a device of `sms` SMs, diagnostics `flags`, else 0 (a pure function, like
// w12_gemm_splits).
int w12_gemm_pair_grid(int n, int k, int m, int target_ctas, int sms, int flags) {
  return w12::wgmma_pair_grid(n, k, m, target_ctas, sms, flags) ? 1 : 0;
}

// Where v4 runs without a CTA barrier per record (NB, sessions 37-39: a producer warpgroup) for an
// (N, K) weight at m token rows (one pass), its consumer warpgroups: 4 (row-tile pairs) or 3
// (m-tile triples, split weights); else 0. Arguments as w12_gemm_pair_grid's.
int w12_gemm_nobar(int n, int k, int m, int target_ctas, int sms, int flags) {
  return w12::wgmma_nobar(n, k, m, target_ctas, sms, flags);
}

// NB's stream-K lanes (SK, session 44: multi-wave unsplit row-tile-pair grids at 33-128 tokens as
// persistent lanes, one an SM) for an (N, K) weight at m token rows (one pass); 0 where v4 runs
// one unit a CTA or another form. Arguments as w12_gemm_pair_grid's.
int w12_gemm_sk_lanes(int n, int k, int m, int target_ctas, int sms, int flags) {
  return w12::wgmma_sk_lanes(n, k, m, target_ctas, sms, flags);
}

// Bytes of FP32 partial sums a call with these sizes needs (v1: 0 when K is not split).
// kernel: 1 = v1 (fixed K-split, gemm_w12_mma_sm120.cu), 2 = v2 (stream-K, gemm_w12_streamk_sm120.cu),
// 3 = v3 (row slabs, gemm_w12_slab_sm120.cu: no workspace), 4 = v4 (wgmma,
// kernels_sm90/gemm_w12_wgmma_sm90.cu: v1's workspace, no counters; on unsplit weights the
// accumulators its SK lanes park, where they run with the diagnostics `flags`).
int64_t w12_gemm_workspace_bytes(int m, int n, int k, int target_ctas, int sms, int kernel, int flags) {
  if (kernel == 3) return 0;
  if (kernel == 2) return static_cast<int64_t>(w12::gemm_sk_workspace_bytes(m, target_ctas));
  // v4 parks v1-ordered partials for v1's reduce kernel, up to 128 tokens per launch (v1: 64).
  return static_cast<int64_t>(w12::gemm_workspace_bytes(m, n, k, target_ctas, sms, kernel == 4 ? 4 : 1, flags));
}

// Ints of zeroed counter/flag memory a call needs (zero on entry, left zero on exit).
// v4 reads its counters argument as the XT scratch on unsplit weights (gemm_w12_wgmma_sm90.cu): two
// counts and the flags of its stream-K lanes (SK) in a 4 KB header, and x transposed, 16 KB per 64
// columns (xt_scratch_ints); callers give it a buffer of its own (w12_gemm_xt_buffer), never v1's
// counters.
static_assert(w12::xt_scratch_ints(4096) == 1024 + 64 * 4096, "XT scratch: 4 KB + 16 KB per 64 columns");
int w12_gemm_counters(int n, int k, int target_ctas, int sms, int kernel) {
  if (kernel == 3) return 0;
  if (kernel == 4) return w12::gemm_splits(n, k, target_ctas, sms, 4) == 1 ? w12::xt_scratch_ints(k) : 0;
  return kernel == 2 ? target_ctas : (n + 127) / 128;
}

// y[M, ldy] (BF16) = x[M, ldx] (BF16) . W^T (+ bias, FP32), W given by its W12 tensors with
// records in layout 4 (v4: layout 3). x must be zero in columns K .. ceil(K/64)*64 (the caller pads).
// counters: >= w12_gemm_counters() ints, zero before the first call, left zero after each call;
// one counter array must not be used by two calls running concurrently. Kernel 4 reads it as its XT
// scratch (w12_gemm_xt_buffer), which must not be another kernel's counters.
int w12_gemm(const void* x, int64_t ldx, const void* records, const void* base, const void* esc_ptr,
             const void* esc_col, const void* esc_val, const void* bias, void* y, int64_t ldy, int m, int n, int k,
             void* workspace, void* counters, int target_ctas, int stages, int flags, int kernel, void* stream) {
  w12::GemmArgs a;
  a.x = static_cast<const uint16_t*>(x);
  a.records = static_cast<const uint8_t*>(records);
  a.base = static_cast<const uint8_t*>(base);
  a.esc_ptr = static_cast<const int32_t*>(esc_ptr);
  a.esc_col = static_cast<const int32_t*>(esc_col);
  a.esc_val = static_cast<const int16_t*>(esc_val);
  a.bias = static_cast<const float*>(bias);
  a.y = static_cast<uint16_t*>(y);
  a.M = m;
  a.N = n;
  a.K = k;
  a.ldx = ldx;
  a.ldy = ldy;
  a.workspace = workspace;
  a.counters = static_cast<int*>(counters);
  a.target_ctas = target_ctas;
  a.stages = stages;
  a.flags = flags;  // 0 except in diagnostic benchmark runs (wrong results by design)
  if (kernel == 4) return static_cast<int>(w12::gemm_wgmma_launch(a, static_cast<cudaStream_t>(stream)));
  if (kernel == 3) return static_cast<int>(w12::gemm_slab_launch(a, static_cast<cudaStream_t>(stream)));
  if (kernel == 2) return static_cast<int>(w12::gemm_sk_launch(a, static_cast<cudaStream_t>(stream)));
  return static_cast<int>(w12::gemm_launch(a, static_cast<cudaStream_t>(stream)));
}

// Zeroed int counters for the K-split tickets of (device, stream), owned by this library (never
// freed: in-flight kernels and captured graphs may still use a buffer after it is outgrown).
// Allocated outside torch's caching allocator on purpose: a buffer created while a graph is
// being captured must not live in that graph's private pool, where torch.compile's CUDA-graph
// trees reject it as an untracked live tensor and where it would be reused after replay. The
// allocation switches the thread to relaxed capture mode (as torch's allocator does) and zeroes
// the memory on a private stream, so it is legal during capture and adds no graph node.
// Returns nullptr and sets *err on failure. Pool 0: the K-split counters; pool 1: v4's XT scratch
// (two counts and x transposed), so that neither ever sees the other's bytes.
static void* stream_buffer(int pool, int device, void* stream, int n_ints, int* err) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, void*>, std::pair<void*, int>> bufs;
  std::lock_guard<std::mutex> lock(mu);
  *err = 0;
  auto key = std::make_tuple(pool, device, stream);
  auto it = bufs.find(key);
  if (it != bufs.end() && it->second.second >= n_ints) return it->second.first;
  const int n = n_ints < 4096 ? 4096 : n_ints;
  int prev = 0;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess) e = cudaSetDevice(device);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (e == cudaSuccess) e = cudaThreadExchangeStreamCaptureMode(&mode);
  void* ptr = nullptr;
  cudaStream_t side = nullptr;
  if (e == cudaSuccess) e = cudaMalloc(&ptr, static_cast<size_t>(n) * sizeof(int));
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaMemsetAsync(ptr, 0, static_cast<size_t>(n) * sizeof(int), side);
  if (e == cudaSuccess) e = cudaStreamSynchronize(side);
  if (side) cudaStreamDestroy(side);
  cudaThreadExchangeStreamCaptureMode(&mode);  // back to the caller's mode
  cudaSetDevice(prev);
  if (e != cudaSuccess) {
    if (ptr) cudaFree(ptr);
    *err = static_cast<int>(e);
    return nullptr;
  }
  bufs[key] = std::make_pair(ptr, n);
  return ptr;
}

void* w12_gemm_counters_buffer(int device, void* stream, int n_ints, int* err) {
  return stream_buffer(0, device, stream, n_ints, err);
}

// v4's XT scratch of (device, stream): w12_gemm_counters() ints for kernel 4, passed as w12_gemm's
// counters (zero between calls, as the counters).
void* w12_gemm_xt_buffer(int device, void* stream, int n_ints, int* err) {
  return stream_buffer(1, device, stream, n_ints, err);
}

// D[64][16] (FP32) = A[64][16] B[16][16]^T (BF16, row-major) through v4's wgmma building blocks
// (sm_90 only; cudaErrorNoKernelImageForDevice elsewhere). A test hook: it isolates the wgmma
// operand layouts from the W12 decode.
int w12_selftest_wgmma(const void* a, const void* b, void* d, void* stream) {
  return static_cast<int>(w12::wgmma_selftest_launch(static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b),
                                                     static_cast<float*>(d), static_cast<cudaStream_t>(stream)));
}

// 0 when this library holds a GEMM kernel image for the current device, else the cudaError_t
// (cudaErrorNoKernelImageForDevice / cudaErrorInvalidDeviceFunction on an unsupported GPU).
int w12_gemm_check_device(void) { return static_cast<int>(w12::gemm_check_device()); }

const char* w12_gemm_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
