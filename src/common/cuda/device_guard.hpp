// Makes a device current for a scope and restores the caller's device afterwards.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "encore/core/status.hpp"

namespace encore::cuda {

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
    if (e != cudaSuccess) return Status::cuda_error(std::string("cudaGetDevice: ") + cudaGetErrorString(e));
    if (previous_ == device) return Status::ok();
    e = cudaSetDevice(device);
    if (e != cudaSuccess) return Status::cuda_error(std::string("cudaSetDevice: ") + cudaGetErrorString(e));
    changed_ = true;
    return Status::ok();
  }

 private:
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace encore::cuda
