// Test helper (CUDA builds only): an owning device allocation mirroring a HostTensor.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "testing/host_tensor.hpp"

namespace encore::test {

#define ENCORE_ASSERT_CUDA(expr)                                                            \
  do {                                                                                      \
    cudaError_t e_ = (expr);                                                                \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);                  \
  } while (0)

struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (cudaMalloc(&ptr, n) != cudaSuccess) ptr = nullptr;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  char* at(size_t byte_offset) const { return static_cast<char*>(ptr) + byte_offset; }
};

// Copies a host tensor to device memory at `byte_offset` into `buf` and returns its device view.
inline TensorView to_device(const HostTensor& h, DeviceBuffer& buf, size_t byte_offset = 0) {
  cudaMemcpy(buf.at(byte_offset), h.bytes.data(), h.storage_bytes(), cudaMemcpyHostToDevice);
  return h.view(buf.at(byte_offset), Device{DeviceType::kCUDA, 0});
}

inline void from_device(HostTensor& h, const DeviceBuffer& buf, size_t byte_offset = 0) {
  cudaMemcpy(h.bytes.data(), buf.at(byte_offset), h.storage_bytes(), cudaMemcpyDeviceToHost);
}

inline bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

}  // namespace encore::test
