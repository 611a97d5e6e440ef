// Programmatic dependent launch (sm_90, PDL), the device side: a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization (launch_check.hpp's pdl_config) may have its blocks
// scheduled before the stream's previous kernel has finished. Such a kernel calls wait_for_primary()
// before it reads anything that kernel may write (the wait returns once the previous grid has completed
// and its memory is visible; in a kernel launched without the attribute it returns at once), and
// launch_dependents() to let the next PDL launch in once every block of its own grid has called it or
// exited. No includes: the JIT (NVRTC) compiles it too, embedded (cmake/EncoreJitSources.cmake).
#pragma once

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

}  // namespace encore::cuda
