// gemm_scalar_scale: D = alpha[0] · (A · Wᵀ), alpha in device memory; bf16/fp16, cooperative 128x256x64, cluster 2x1.
#include "cuda/gemm_epilogue/epilogue_programs.cuh"
#include "cuda/gemm_epilogue/sm90_gemm.cuh"

namespace encore::cuda {

Status launch_gemm_scalar_scale(const GemmProblem& p, Stream stream) {
  return sm90::launch_family<sm90::ScalarScale, sm90::TileConfig<128, 256, 64, 2, 1, true>>(p, stream, "gemm_scalar_scale");
}

}  // namespace encore::cuda
