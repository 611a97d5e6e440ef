// Host entry of the CUDA GEMM-epilogue kernels (no CUDA or CUTLASS types).
#pragma once
#include <cstdint>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore::cuda {

struct GemmProblem {
  const void* a = nullptr;
  int64_t lda = 0;
  const void* w = nullptr;
  int64_t ldw = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  int M = 0, N = 0, K = 0;
  DType dtype = DType::kBF16;
  const float* row_scale = nullptr;  // kRowScale
  const float* alpha = nullptr;      // kScalarScale (device pointer)
  int device = 0;
  int sm_count = 0;
};

// D = r[m] · (A · Wᵀ)  (src/cuda/gemm_epilogue/sm90_row_scale.cu)
Status launch_gemm_row_scale(const GemmProblem& p, Stream stream);
// D = alpha[0] · (A · Wᵀ)  (src/cuda/gemm_epilogue/sm90_scalar_scale.cu)
Status launch_gemm_scalar_scale(const GemmProblem& p, Stream stream);

}  // namespace encore::cuda
