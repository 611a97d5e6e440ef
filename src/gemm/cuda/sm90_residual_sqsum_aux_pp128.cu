// gemm_residual_sqsum_aux on the Pingpong128x128 tile: y = A·Wᵀ + C → D = y, aux = y ⊙ γ, partials[m, t] = Σ y² per tile-N columns.
#include "gemm/cuda/programs.cuh"
#include "gemm/cuda/sm90_gemm.cuh"

encore::Status encore::cuda::launch_residual_sqsum_aux_pp128(const GemmProblem& p, Stream stream) {
  return sm90::launch_family<sm90::ResidualSqsumAux, sm90::Pingpong128x128>(p, stream, "gemm_residual_sqsum_aux");
}
