// gemm_residual_sqsum_aux: y = A·Wᵀ + C → D = y, aux = y ⊙ γ, partials[m, t] = Σ y² per 256-column tile; bf16/fp16, cooperative 128x256x64, cluster 2x1.
#include "cuda/gemm_epilogue/epilogue_programs.cuh"
#include "cuda/gemm_epilogue/sm90_gemm.cuh"

namespace encore::cuda {

Status launch_gemm_residual_sqsum_aux(const GemmProblem& p, Stream stream) {
  return sm90::launch_family<sm90::ResidualSqsumAux, sm90::TileConfig<128, 256, 64, 2, 1, true>>(p, stream, "gemm_residual_sqsum_aux");
}

}  // namespace encore::cuda
