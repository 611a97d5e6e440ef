// A CUDA driver API function by name through the runtime (cudaGetDriverEntryPointByVersion, the 12.0
// ABI): no link against libcuda. nullptr when the driver lacks it.
#pragma once
#include <cuda_runtime.h>

namespace encore::cuda {

template <typename F>
F driver_entry(const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q) != cudaSuccess || q != cudaDriverEntryPointSuccess)
    return nullptr;
  return reinterpret_cast<F>(f);
}

}  // namespace encore::cuda
