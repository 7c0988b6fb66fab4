// Shared pipeline primitives: shared-memory mbarriers, the bulk async copy that completes on
// one (sm_90+), its cp.async fallback (sm_80), and gpu-scope flag accesses for in-kernel
// cross-CTA hand-offs. Torch-free, header-only.
#pragma once

#include <stdint.h>

namespace w12 {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (the bulk-copy engine) as well.
__device__ __forceinline__ void mbar_fence_init() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

__device__ __forceinline__ bool mbar_test(uint32_t bar, uint32_t parity) {
  uint32_t ok;
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
#else
  asm volatile(
      "{ .reg .pred p; mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
#endif
  return ok != 0;
}

// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_test(bar, parity)) {
  }
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" ::"r"(bar) : "memory");
}

#if __CUDA_ARCH__ >= 900
// One arrival that also announces `bytes` of bulk-copy data still to land on this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }" ::"r"(bar), "r"(bytes)
               : "memory");
}

// global -> shared bulk copy (size a multiple of 16, both addresses 16-byte aligned) whose bytes
// are counted against `bar`'s expected transaction count.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

__device__ __forceinline__ void bulk_copy_g2s_hint(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                                   uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}
#endif

// L2 policy for data read exactly once (streamed weights): evicted first, so that the small,
// reused activation rows stay in L2 while hundreds of MB of records pass through it.
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

// L2 policy for data written once and read back soon by another kernel: the K-split partials (v4
// parks them, the reduce kernel reads them). Kept in L2 ahead of the weights streaming past them,
// they are not written back to HBM and fetched again (session 28, docs/perf-notes.md).
__device__ __forceinline__ uint64_t l2_policy_evict_last() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

// 16-byte global store / L1-bypassing load under an L2 policy (createpolicy).
__device__ __forceinline__ void st_global_policy(float4* dst, const float4& v, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w), "l"(policy)
               : "memory");
}
__device__ __forceinline__ float4 ld_cg_policy(const float4* src, uint64_t policy) {
  float4 v;
  asm volatile("ld.global.cg.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(src), "l"(policy)
               : "memory");  // never above the griddepcontrol.wait that makes the partials visible
  return v;
}

// sm_80 path: an arrival on `bar` once every earlier cp.async of this thread has landed
// (.noinc: the barrier's expected count includes these arrivals).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all_pipe() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Barrier over the `count` threads (a multiple of 32) that use barrier `id` (1..15; 0 is
// __syncthreads).
__device__ __forceinline__ void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere and when the launch did not ask for it).
// pdl_wait blocks until the previous kernel in the stream has completed and its writes are
// visible; pdl_launch_dependents lets the next kernel start its own prologue early.
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

// Slot bookkeeping of a STAGES-deep copy ring refilled and read in order (v1's and R64's loops):
// running indices, since i % STAGES cost a multiply-shift sequence per step, and the parity of the
// mbarrier phase the read slot completes next (records by bulk copy, one barrier per slot at
// bar0 + 8 slot, each initialised for one arrival by init_ring_barriers).
template <int STAGES>
struct RingSlots {
  int rd = 0, wr = STAGES - 1;
  uint32_t rd_phase = 0;
  // The slot the next refill writes (the ring starts with STAGES - 1 slots filled); moves on.
  __device__ __forceinline__ int take_write() {
    const int s = wr;
    wr = wr == STAGES - 1 ? 0 : wr + 1;
    return s;
  }
  // The slot this step reads, after waiting for its records' barrier where `bulk`; moves on.
  __device__ __forceinline__ int take_read(bool bulk, uint32_t bar0) {
    const int s = rd;
    if (bulk) mbar_wait(bar0 + 8 * s, rd_phase);
    rd_phase ^= s == STAGES - 1 ? 1u : 0u;
    rd = s == STAGES - 1 ? 0 : s + 1;
    return s;
  }
};

// One thread's part of a bulk-copy ring's set-up: STAGES barriers of one arrival each at bar0.
template <int STAGES>
__device__ __forceinline__ void init_ring_barriers(uint32_t bar0) {
#pragma unroll
  for (int s = 0; s < STAGES; ++s) mbar_init(bar0 + 8 * s, 1);
  mbar_fence_init();
}

// One cache line into L2 (no register, no completion to wait for).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Pulls `bytes` (a multiple of 16) at `src` into L2 without touching shared memory or registers
// (sm_90+; no-op elsewhere). Safe before pdl_wait even for data a previous kernel may still be
// writing: L2 is the point of coherence, so a later load sees the final bytes either way.
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

}  // namespace w12
