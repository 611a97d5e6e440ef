// Test helper (CUDA builds only) for KDA serving on CUDA: device mirrors of fp64 host views in a device
// dtype (the host rounded in place, so the CPU reference sees the device's values; outputs poisoned
// with NaN) and reading device views back.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "tests/common/device_buffer.hpp"

namespace encore::test {

inline const Device kCuda{DeviceType::kCUDA, 0};

// Device copies that live as long as the object.
struct DeviceArena {
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  // A device copy of the contiguous host view h in dtype dt (same dtype: the bytes; else converted, and h
  // rounded in place to dt so the reference sees the device's values); poison: NaN instead.
  TensorView mirror(const TensorView& h, DType dt, bool poison = false) {
    if (!h.defined()) return {};
    const int64_t n = h.numel();
    std::vector<unsigned char> bytes(size_t(std::max<int64_t>(n, 1)) * dtype_size(dt));
    if (dt == h.dtype && !poison) {
      std::memcpy(bytes.data(), h.data, size_t(n) * dtype_size(dt));
    } else {
      for (int64_t i = 0; i < n; ++i) {
        store_from_double(bytes.data(), dt, i, poison ? NAN : load_as_double(h.data, h.dtype, i));
        if (!poison) store_from_double(h.data, h.dtype, i, load_as_double(bytes.data(), dt, i));
      }
    }
    bufs.push_back(std::make_unique<DeviceBuffer>(bytes.size()));
    cudaMemcpy(bufs.back()->ptr, bytes.data(), bytes.size(), cudaMemcpyHostToDevice);
    TensorView d = h;
    d.data = bufs.back()->ptr, d.dtype = dt, d.device = kCuda;
    return d;
  }
  // Uninitialized device bytes (a workspace); null for 0 bytes.
  void* bytes(size_t n) {
    if (n == 0) return nullptr;
    bufs.push_back(std::make_unique<DeviceBuffer>(n));
    return bufs.back()->ptr;
  }
};

inline std::vector<unsigned char> fetch_bytes(const TensorView& d) {
  std::vector<unsigned char> b(size_t(d.numel()) * dtype_size(d.dtype));
  cudaMemcpy(b.data(), d.data, b.size(), cudaMemcpyDeviceToHost);
  return b;
}
inline std::vector<double> fetch(const TensorView& d) {
  const std::vector<unsigned char> b = fetch_bytes(d);
  std::vector<double> x(size_t(d.numel()));
  for (size_t i = 0; i < x.size(); ++i) x[i] = load_as_double(b.data(), d.dtype, int64_t(i));
  return x;
}

}  // namespace encore::test
