// gemm_row_scale: D = r[m] · (A · Wᵀ); bf16/fp16, cooperative 128x256x64, cluster 2x1.
#include "cuda/gemm_epilogue/epilogue_programs.cuh"
#include "cuda/gemm_epilogue/sm90_gemm.cuh"

namespace encore::cuda {

Status launch_gemm_row_scale(const GemmProblem& p, Stream stream) {
  return sm90::launch_family<sm90::RowScale, sm90::TileConfig<128, 256, 64, 2, 1, true>>(p, stream, "gemm_row_scale");
}

}  // namespace encore::cuda
