// Internal: a validated QK-norm problem, shared by the CPU and CUDA backends.
#pragma once
#include <cstdint>

#include "encore/core/dtype.hpp"

namespace encore::norm {

struct QkNormProblem {
  void* qkv = nullptr;
  int64_t token_stride = 0;  // elements
  const void* q_weight = nullptr;
  const void* k_weight = nullptr;
  int64_t tokens = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  DType dtype = DType::kBF16;
  float eps = 1e-6f;
  float weight_offset = 0.0f;
  int device_index = 0;
};

}  // namespace encore::norm
