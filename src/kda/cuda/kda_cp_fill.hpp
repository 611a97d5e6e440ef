// Host entry of the small CUDA kernels of KDA context parallelism (kda_cp_fill.cu; no CUDA types):
// the fills the composed summaries need (identity h0, zero v / h0) and the merge. All fp32 contiguous,
// asynchronous on `stream`, no allocation.
#pragma once
#include <cstddef>
#include <cstdint>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore::cuda {

// bytes at p = 0 (cudaMemsetAsync).
Status kda_cp_zero(void* p, size_t bytes, int device, Stream stream);
// X [HV, K, K] = I per head.
Status kda_cp_identity(float* X, int64_t HV, int64_t K, int device, Stream stream);
// dst[h] = src[h]ᵀ over [HV, K, K] (dst and src distinct).
Status kda_cp_transpose(const float* src, float* dst, int64_t HV, int64_t K, int device, Stream stream);
// out [HV, K, V] = the merge of S [n, HV, K, V], M [n, HV, K, K]: X = 0; X = M_i·X + S_i for i = 0..n-1.
Status kda_cp_merge(const float* S, const float* M, float* out, int64_t n, int64_t HV, int64_t K, int64_t V, int device, Stream stream);

}  // namespace encore::cuda
