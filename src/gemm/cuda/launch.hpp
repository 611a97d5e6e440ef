// Host entry of the CUDA GEMM-epilogue kernels (no CUDA or CUTLASS types). One launcher per
// catalogue entry (src/gemm/cuda/sm90_<name>.cu); the dispatch has validated the problem.
#pragma once
#include <cstdint>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore::cuda {

// The head width of kQkvHeadSqsum on CUDA (its partials' column group; the tile N is 1 or 2 heads).
constexpr int kHeadSqsumDim = 128;

struct GemmProblem {
  const void* a = nullptr;
  int64_t lda = 0;
  const void* w = nullptr;
  int64_t ldw = 0;
  void* d = nullptr;  // null: D not written (kLse only)
  int64_t ldd = 0;
  int M = 0, N = 0, K = 0;
  DType dtype = DType::kBF16;
  const void* c = nullptr;  // residual (kResidualSqsumAux)
  int64_t ldc = 0;
  void* aux = nullptr;  // kResidualSqsumAux [M, N], kSwiglu [M, N/2]
  int64_t ld_aux = 0;
  const void* gamma = nullptr;       // [N], contiguous
  const float* row_scale = nullptr;  // [M] contiguous, null = 1
  const float* alpha = nullptr;      // [1] (device pointer)
  float* partials = nullptr;         // [M, tiles] fp32
  int64_t ld_partials = 0;
  const int32_t* pos = nullptr;   // [M] contiguous (kRope)
  const float* freq = nullptr;    // [N] contiguous (kRope)
  const int32_t* target = nullptr;  // [M] contiguous (kLse, optional)
  float* target_logit = nullptr;    // [M] contiguous
  int ignore_index = -100;
  int col0 = 0;     // kLse over an N-slice: global column of the slice's column 0 (target select)
  int n_total = 0;  // kLse over an N-slice: the whole N (0: N)
  int swizzle = 1;  // persistent tile scheduler: tiles per swizzle group (1, 2, 4, 8)
  int raster = 0;   // persistent tile scheduler order: 0 heuristic, 1 along M, 2 along N
  int device = 0;
  int sm_count = 0;
};

// One launcher per (epilogue, tile) pair, each in its own translation unit
// src/gemm/cuda/sm90_<epilogue>_<tile>.cu: coop256 = cooperative 128x256x64, pp128 =
// ping-pong 128x128x64 (both cluster 2x1). The partials of residual_sqsum_aux and lse are per tile N.
using GemmLauncher = Status (*)(const GemmProblem& p, Stream stream);
Status launch_row_scale_coop256(const GemmProblem& p, Stream stream);
Status launch_row_scale_pp128(const GemmProblem& p, Stream stream);
Status launch_scalar_scale_coop256(const GemmProblem& p, Stream stream);
Status launch_scalar_scale_pp128(const GemmProblem& p, Stream stream);
Status launch_residual_sqsum_aux_coop256(const GemmProblem& p, Stream stream);
Status launch_residual_sqsum_aux_pp128(const GemmProblem& p, Stream stream);
Status launch_swiglu_coop256(const GemmProblem& p, Stream stream);
Status launch_swiglu_pp128(const GemmProblem& p, Stream stream);
Status launch_rope_coop256(const GemmProblem& p, Stream stream);
Status launch_rope_pp128(const GemmProblem& p, Stream stream);
Status launch_qkv_head_sqsum_coop256(const GemmProblem& p, Stream stream);
Status launch_qkv_head_sqsum_pp128(const GemmProblem& p, Stream stream);
Status launch_lse_coop256(const GemmProblem& p, Stream stream);  // D written iff p.d
Status launch_lse_pp128(const GemmProblem& p, Stream stream);
// ping-pong 64x256x64 (pp64), for the epilogues that most need both overlap and operand reuse
Status launch_row_scale_pp64(const GemmProblem& p, Stream stream);
Status launch_swiglu_pp64(const GemmProblem& p, Stream stream);
Status launch_residual_sqsum_aux_pp64(const GemmProblem& p, Stream stream);
Status launch_lse_pp64(const GemmProblem& p, Stream stream);

// QK-norm + RoPE finish (src/gemm/cuda/qk_norm_rope.cu); validated by the dispatch.
struct QkNormRopeProblem {
  void* qkv = nullptr;
  int64_t ld_qkv = 0;
  DType dtype = DType::kBF16;
  const float* partials = nullptr;
  int64_t ld_partials = 0;
  const void* q_weight = nullptr;  // contiguous, qkv's dtype or fp32 (weight_fp32)
  const void* k_weight = nullptr;
  bool weight_fp32 = false;
  const int32_t* pos = nullptr;  // contiguous
  const float* freq = nullptr;   // contiguous, 8-byte aligned
  int M = 0, num_q_heads = 0, qk_heads = 0, head_dim = 0;
  float eps = 1e-6f;
};
Status launch_qk_norm_rope(const QkNormRopeProblem& p, Stream stream);

// Finishers (src/gemm/cuda/finishers.cu); contiguous fp32 vectors, partials row stride ld.
Status launch_rms_final_reduce(const float* partials, int64_t ld, int M, int tiles, float* r, int64_t hidden, float eps, Stream stream);
Status launch_lse_finish(const float* partials, int64_t ld, int M, int tiles, float* lse, const int32_t* target, const float* target_logit,
                         float* loss, int ignore_index, Stream stream);

}  // namespace encore::cuda
