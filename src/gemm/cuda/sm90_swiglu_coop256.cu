// gemm_swiglu on the Cooperative128x256 tile: z = r[m]·(A·Wᵀ) → D = z, aux[m, j] = silu(z[2j])·z[2j+1].
#include "gemm/cuda/programs.cuh"
#include "gemm/cuda/sm90_gemm.cuh"

encore::Status encore::cuda::launch_swiglu_coop256(const GemmProblem& p, Stream stream) {
  return sm90::launch_family<sm90::Swiglu, sm90::Cooperative128x256>(p, stream, "gemm_swiglu");
}
