// encore::TensorView — a non-owning view of a strided tensor: data pointer, dtype, device,
// shape and strides (in elements, not bytes), up to kMaxDims dimensions. Ops take views; they never
// allocate or free the memory behind them.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "encore/core/dtype.hpp"

namespace encore {

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  std::string to_string() const;  // "cpu", "cuda:0"
};

// CUDA stream as an opaque handle so public headers stay free of CUDA; nullptr = default stream.
using Stream = void*;

struct TensorView {
  static constexpr int kMaxDims = 6;

  void* data = nullptr;
  DType dtype = DType::kFP32;
  Device device{};
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};

  // A contiguous (row-major) view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = {});
  // A strided view; strides in elements.
  static TensorView strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> strides, Device device = {});

  bool defined() const { return ndim > 0 || data != nullptr; }
  int64_t numel() const;
  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  int64_t stride(int d) const { return strides[d < 0 ? d + ndim : d]; }
  size_t element_size() const { return dtype_size(dtype); }
  bool is_contiguous() const;
  std::string shape_string() const;  // "[64, 4096]"
};

}  // namespace encore
