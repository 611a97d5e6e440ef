// gemm_scalar_scale on the Cooperative128x256 tile: D = alpha[0]·(A·Wᵀ), alpha in device memory.
#include "gemm/cuda/programs.cuh"
#include "gemm/cuda/sm90_gemm.cuh"

encore::Status encore::cuda::launch_scalar_scale_coop256(const GemmProblem& p, Stream stream) {
  return sm90::launch_family<sm90::ScalarScale, sm90::Cooperative128x256>(p, stream, "gemm_scalar_scale");
}
