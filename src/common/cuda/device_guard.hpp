// Makes a device current for a scope and restores the caller's device afterwards. Also makes sure the
// calling thread has a current context on that device: a thread that has made no runtime call yet has
// none even where cudaGetDevice already answers the device, and driver-API work done before the first
// launch (CUTLASS's and KDA's TMA descriptors: cuTensorMapEncodeTiled, the JIT's module loads) fails
// there with CUDA_ERROR_INVALID_CONTEXT (201). Cost: cudaGetDevice and cuCtxGetCurrent (thread-local).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "common/cuda/driver_entry.hpp"
#include "encore/core/status.hpp"

namespace encore::cuda {

// Whether the calling thread has a current CUDA context (true when the driver cannot tell).
inline bool context_current() {
  using CtxGetCurrent = CUresult (*)(CUcontext*);
  static const CtxGetCurrent get = driver_entry<CtxGetCurrent>("cuCtxGetCurrent");
  if (get == nullptr) return true;
  CUcontext c = nullptr;
  return get(&c) == CUDA_SUCCESS && c != nullptr;
}

class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }
  Status set(int device) {
    cudaError_t e = cudaGetDevice(&previous_);
    if (e != cudaSuccess) return failed("cudaGetDevice", e, device);
    if (previous_ == device && context_current()) return Status::ok();
    e = cudaSetDevice(device);  // CUDA 12: also makes the device's primary context current
    if (e != cudaSuccess) return failed("cudaSetDevice", e, device);
    changed_ = previous_ != device;
    return Status::ok();
  }

 private:
  static Status failed(const char* call, cudaError_t e, int device) {
    (void)cudaGetLastError();
    return Status::cuda_error("cuda:" + std::to_string(device) + ": " + call + " failed: " + cudaGetErrorName(e) + " (" +
                              std::to_string(int(e)) + "): " + cudaGetErrorString(e));
  }
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace encore::cuda
