// Test helper (CUDA builds only): device copies of the fp64 host vectors of a KdaCase, shared by the
// KDA GPU backward tests.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "encore/core/tensor_view.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {

// A device copy of an fp64 host vector in `dt`; the host vector is rounded to `dt` in place so the
// CPU references see exactly the device's inputs.
struct DevVec {
  std::unique_ptr<DeviceBuffer> buf;
  TensorView view;
  size_t n = 0;
  DevVec(std::vector<double>& host, DType dt, std::initializer_list<int64_t> shape) : n(host.size()) {
    std::vector<unsigned char> bytes(std::max<size_t>(host.size(), 1) * dtype_size(dt));
    for (size_t i = 0; i < host.size(); ++i) {
      store_from_double(bytes.data(), dt, int64_t(i), host[i]);
      host[i] = load_as_double(bytes.data(), dt, int64_t(i));
    }
    buf = std::make_unique<DeviceBuffer>(bytes.size());
    cudaMemcpy(buf->ptr, bytes.data(), bytes.size(), cudaMemcpyHostToDevice);
    view = TensorView::contiguous(buf->ptr, dt, shape, Device{DeviceType::kCUDA, 0});
  }
  std::vector<double> fetch() const {
    std::vector<unsigned char> bytes(n * dtype_size(view.dtype));
    cudaMemcpy(bytes.data(), buf->ptr, bytes.size(), cudaMemcpyDeviceToHost);
    std::vector<double> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = load_as_double(bytes.data(), view.dtype, int64_t(i));
    return out;
  }
};

inline std::unique_ptr<DevVec> dev(std::vector<double>& host, DType dt, std::initializer_list<int64_t> shape) {
  return std::make_unique<DevVec>(host, dt, shape);
}
inline std::unique_ptr<DevVec> poisoned(size_t n, DType dt, std::initializer_list<int64_t> shape) {
  std::vector<double> nan(n, NAN);
  return dev(nan, dt, shape);
}

}  // namespace encore::test
