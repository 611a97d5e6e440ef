// Internal: a validated FP8 group-quantization problem, shared by the CPU and CUDA backends.
#pragma once
#include <cstdint>

#include "encore/core/dtype.hpp"

namespace encore::quant {

struct Fp8QuantProblem {
  const void* x = nullptr;
  int64_t x_stride = 0;  // elements
  uint8_t* q = nullptr;
  int64_t q_stride = 0;
  float* scales = nullptr;
  int64_t scale_stride_m = 0, scale_stride_g = 0;
  int64_t rows = 0, cols = 0;
  int group_size = 128;
  DType dtype = DType::kBF16;
  bool power_of_two = false;
  float eps = 1e-10f;
  int device_index = 0;
};

}  // namespace encore::quant
