// Programmatic dependent launch (sm_90, PDL): a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may have its blocks scheduled before the stream's
// previous kernel has finished. Such a kernel calls wait_for_primary() before it reads anything that
// kernel may write (the wait returns once the previous grid has completed and its memory is visible; a
// kernel launched without the attribute returns at once), and launch_dependents() to let the next PDL
// launch in once every block of its own grid has called it or exited. (The MoE dispatch kernels, compiled
// by NVRTC too, keep their own copies of the two device calls.)
#pragma once
#include <cuda_runtime.h>

namespace encore::cuda {

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A launch configuration (grid, block, dynamic shared memory, stream), a programmatic dependent launch
// when `pdl`; `attr` holds the attribute and must outlive the launch call.
inline cudaLaunchConfig_t pdl_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl, cudaLaunchAttribute& attr) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = stream;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = pdl ? &attr : nullptr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cfg;
}

}  // namespace encore::cuda
