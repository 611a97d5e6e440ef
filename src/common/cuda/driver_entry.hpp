// A CUDA driver API function by name through the runtime (cudaGetDriverEntryPointByVersion, the 12.0
// ABI): no link against libcuda. nullptr when the driver lacks it. Also the message of a failed driver
// call, in the launch paths' format (core/fault_injection.hpp).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "core/fault_injection.hpp"

namespace encore::cuda {

template <typename F>
F driver_entry(const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q) != cudaSuccess || q != cudaDriverEntryPointSuccess)
    return nullptr;
  return reinterpret_cast<F>(f);
}

// "<what>: <call> failed: CUDA_ERROR_X (code): description" (cuGetErrorName / cuGetErrorString).
inline std::string driver_failure_message(const std::string& what, const char* call, CUresult r) {
  using ErrorText = CUresult (*)(CUresult, const char**);
  static const ErrorText name = driver_entry<ErrorText>("cuGetErrorName");
  static const ErrorText text = driver_entry<ErrorText>("cuGetErrorString");
  const char* n = nullptr;
  const char* t = nullptr;
  if (name == nullptr || name(r, &n) != CUDA_SUCCESS) n = "CUresult";
  if (text == nullptr || text(r, &t) != CUDA_SUCCESS) t = nullptr;
  return fault::failure_message(what.c_str(), call, n, int(r), t);
}

}  // namespace encore::cuda
