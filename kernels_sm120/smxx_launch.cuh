// One host-side launch path for every kernel that needs launch attributes: a thread-block cluster
// along x and/or programmatic dependent launch (PDL). Torch-free, header-only.
#pragma once

#include <cuda_runtime.h>

namespace w12 {

// Launches `kern` on `stream`. cluster_x > 1 groups consecutive CTAs into clusters of that size
// (sm_90+). pdl lets the kernel start while the previous one in the stream is still running: it
// must execute griddepcontrol.wait (pdl_wait) before reading anything a previous kernel may write.
template <typename... Params, typename... Args>
cudaError_t launch_ex(void (*kern)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int cluster_x,
                      bool pdl, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (cluster_x > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster_x;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = n ? attr : nullptr;
  cfg.numAttrs = n;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kern, static_cast<Params>(args)...);
  return e != cudaSuccess ? e : cudaGetLastError();
}

// Raises kernel `kern`'s dynamic shared-memory limit on device `dev` to `bytes` the first time a
// launch there needs more than the limit set so far (the attribute is per device and per kernel;
// setting it on every launch costs a driver call each time). One static record per kernel.
template <auto kern>
cudaError_t set_smem_limit_once(int dev, int bytes) {
  static int limit[64] = {0};
  if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
  if (limit[dev] >= bytes) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) limit[dev] = bytes;
  return e;
}

}  // namespace w12
