// gemm_row_scale on the Pingpong64x256 tile (see sm90_row_scale_coop256.cu for the math).
#include "gemm/cuda/programs.cuh"
#include "gemm/cuda/sm90_gemm.cuh"

encore::Status encore::cuda::launch_row_scale_pp64(const GemmProblem& p, Stream stream) {
  return sm90::launch_family<sm90::RowScale, sm90::Pingpong64x256>(p, stream, "gemm_row_scale");
}
