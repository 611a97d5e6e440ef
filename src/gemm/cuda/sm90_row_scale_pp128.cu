// gemm_row_scale on the Pingpong128x128 tile: D = r[m]·(A·Wᵀ).
#include "gemm/cuda/programs.cuh"
#include "gemm/cuda/sm90_gemm.cuh"

encore::Status encore::cuda::launch_row_scale_pp128(const GemmProblem& p, Stream stream) {
  return sm90::launch_family<sm90::RowScale, sm90::Pingpong128x128>(p, stream, "gemm_row_scale");
}
