// gemm_residual_sqsum_aux on the Cooperative128x256 tile: y = A·Wᵀ + C → D = y, aux = y ⊙ γ, partials[m, t] = Σ y² per tile-N columns.
#include "gemm/cuda/programs.cuh"
#include "gemm/cuda/sm90_gemm.cuh"

encore::Status encore::cuda::launch_residual_sqsum_aux_coop256(const GemmProblem& p, Stream stream) {
  return sm90::launch_family<sm90::ResidualSqsumAux, sm90::Cooperative128x256>(p, stream, "gemm_residual_sqsum_aux");
}
