// `encore check` helpers shared by the check_<family>.cpp files: kGpu (the device compared
// against the CPU backend) and a device copy of a host buffer for the duration of one check (CUDA
// builds; without CUDA get() is null and download() reports it).
#pragma once
#include <cstddef>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#ifdef ENCORE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace encore::app {

inline constexpr Device kGpu{DeviceType::kCUDA, 0};

class DeviceCopy {
 public:
  explicit DeviceCopy(const void* host, size_t bytes) : bytes_(bytes) {
#ifdef ENCORE_WITH_CUDA
    if (cudaMalloc(&ptr_, bytes) != cudaSuccess) ptr_ = nullptr;
    else if (host != nullptr) cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice);  // null host: uninitialized (workspace)
#else
    (void)host;
#endif
  }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  ~DeviceCopy() {
#ifdef ENCORE_WITH_CUDA
    if (ptr_) cudaFree(ptr_);
#endif
  }
  void* get() const { return ptr_; }
  Status download(void* host) const {
#ifdef ENCORE_WITH_CUDA
    if (cudaDeviceSynchronize() != cudaSuccess || cudaMemcpy(host, ptr_, bytes_, cudaMemcpyDeviceToHost) != cudaSuccess)
      return Status::cuda_error(cudaGetErrorString(cudaGetLastError()));
    return Status::ok();
#else
    (void)host;
    return Status::unsupported("built without CUDA");
#endif
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace encore::app
