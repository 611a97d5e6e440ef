// Host entry of the CUDA GEMM-epilogue kernels (no CUDA or CUTLASS types); the dispatch has
// validated the problem. The (epilogue, tile) launchers are generated at build time from
// encore/gemm_epilogues.def (cmake/EncoreGemmInstances.cmake): one translation unit per pair and a
// table that gemm_launcher reads.
#pragma once
#include <cstdint>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "encore/gemm.hpp"
#include "gemm/problem.hpp"

namespace encore::cuda {

using gemm::GemmProblem;
using gemm::kHeadSqsumDim;
using gemm::QkNormRopeProblem;

using GemmLauncher = Status (*)(const GemmProblem& p, Stream stream);
// The launcher of an epilogue on a resolved tile (never kAuto), or null where the catalogue does
// not instantiate that pair.
GemmLauncher gemm_launcher(Epilogue e, GemmTile tile);

Status launch_qk_norm_rope(const QkNormRopeProblem& p, Stream stream);
Status launch_rope_bwd_zdz(const gemm::RopeBwdZdzProblem& p, Stream stream);

// Finishers (src/gemm/cuda/finishers.cu); contiguous fp32 vectors, partials row stride ld.
Status launch_rms_final_reduce(const float* partials, int64_t ld, int M, int tiles, float* r, int64_t hidden, float eps, Stream stream);
// out[i] = scale · Σ_t partials[i, t] (per row, i < rows) or Σ_t partials[t, i] (per column, i < n_out).
Status launch_partials_sum(const float* partials, int64_t ld, int rows, int cols, float* out, int n_out, bool per_column, float scale,
                           Stream stream);
Status launch_lse_finish(const float* partials, int64_t ld, int M, int tiles, float* lse, const int32_t* target, const float* target_logit,
                         float* loss, int ignore_index, Stream stream);
// loss[0] = Σ_{counted} loss_rows / n, alpha[0] = d_loss[0] / n (0 when n = 0); one CTA; null outputs skipped.
Status launch_ce_mean(const int32_t* target, int M, const float* loss_rows, float* loss, const float* d_loss, float* alpha, int ignore_index,
                      Stream stream);
// dlogits = α·(softmax − one-hot) per row (cross_entropy_bwd); logits and dlogits [M, N] of `dtype`, unit
// last stride, row strides ld / ld_out (dlogits may be logits); lse, target contiguous; alpha null = 1.
Status launch_cross_entropy_bwd(const void* logits, int64_t ld, void* dlogits, int64_t ld_out, DType dtype, int M, int N, const float* lse,
                                const int32_t* target, const float* alpha, int ignore_index, Stream stream);

}  // namespace encore::cuda
