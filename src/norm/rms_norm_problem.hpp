// Internal: a validated RMSNorm / add-RMSNorm problem, shared by the CPU and CUDA backends.
#pragma once
#include <cstddef>
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

// Split-row decode paths: blocks of kSplitRowThreads threads, each owning one 16-byte pack of every
// row; workspace = barrier state (kSplitRowBarrierBytes) + fp32 partials [rows, slices].
constexpr int kSplitRowThreads = 64;
constexpr int64_t kSplitRowMaxRows = 16;
constexpr size_t kSplitRowBarrierBytes = 16;

inline int split_row_slices(int64_t hidden, DType dtype) {
  const int64_t packs = hidden / (16 / int64_t(dtype_size(dtype)));
  return int((packs + kSplitRowThreads - 1) / kSplitRowThreads);
}

inline size_t split_row_workspace_bytes(int64_t rows, int64_t hidden, DType dtype) {
  return kSplitRowBarrierBytes + size_t(rows) * size_t(split_row_slices(hidden, dtype)) * sizeof(float);
}

}  // namespace encore::norm
