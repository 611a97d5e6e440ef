// Internal: a validated RMSNorm / add-RMSNorm problem, shared by the CPU and CUDA backends.
#pragma once
#include <cstdint>

#include "encore/core/dtype.hpp"

namespace encore::norm {

struct RmsNormProblem {
  const void* x = nullptr;
  int64_t x_stride = 0;          // row strides in elements
  const void* residual = nullptr;  // null for plain RMSNorm
  int64_t residual_stride = 0;
  const void* weight = nullptr;  // [hidden]
  void* y = nullptr;
  int64_t y_stride = 0;
  void* h = nullptr;             // null for plain RMSNorm
  int64_t h_stride = 0;
  int64_t rows = 0;
  int64_t hidden = 0;
  DType dtype = DType::kFP32;
  float eps = 1e-6f;
  float weight_offset = 0.0f;
  int device_index = 0;
};

}  // namespace encore::norm
