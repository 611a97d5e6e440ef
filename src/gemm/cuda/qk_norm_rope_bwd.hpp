// Host-side declarations of the QK-norm + RoPE backward kernel (qk_norm_rope_bwd.cu).
#pragma once
#include <cstdint>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore::cuda {

struct QkNormRopeBwdProblem {
  const void* dy = nullptr;
  const void* x = nullptr;
  void* dx = nullptr;
  int64_t ld_dy = 0, ld_x = 0, ld_dx = 0;
  DType dtype = DType::kBF16;
  const float* partials = nullptr;
  int64_t ld_partials = 0;
  const void* q_weight = nullptr;
  const void* k_weight = nullptr;
  bool weight_fp32 = false;
  const int32_t* pos = nullptr;
  const float* freq = nullptr;
  float* dq_weight = nullptr;
  float* dk_weight = nullptr;
  int M = 0, N = 0, num_q_heads = 0, qk_heads = 0, head_dim = 0;
  float eps = 0.f;
};

// The launch: blocks of kQkNormRopeBwdWarps warps; each warp owns a [2, head_dim] slice of the weight
// partials, so the workspace is qk_norm_rope_bwd_warps(M, qk_heads) · 2 · head_dim floats.
constexpr int kQkNormRopeBwdWarps = 8;
inline int qk_norm_rope_bwd_blocks(int64_t M, int qk_heads) {
  const int64_t b = (M * qk_heads + kQkNormRopeBwdWarps - 1) / kQkNormRopeBwdWarps;
  return int(b < 1 ? 1 : b > 264 ? 264 : b);
}
inline int64_t qk_norm_rope_bwd_warps(int64_t M, int qk_heads) { return int64_t(qk_norm_rope_bwd_blocks(M, qk_heads)) * kQkNormRopeBwdWarps; }
// ws: qk_norm_rope_bwd_warps(M, qk_heads) · 2 · head_dim floats of device memory.
Status launch_qk_norm_rope_bwd(const QkNormRopeBwdProblem& p, float* ws, Stream stream);

}  // namespace encore::cuda
