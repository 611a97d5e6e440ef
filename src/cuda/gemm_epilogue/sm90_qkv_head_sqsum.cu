// gemm_qkv_head_sqsum: D = A·Wᵀ, partials[m, h] = Σ_{n in head h} D² (head_dim 128); bf16/fp16, cooperative 128x128x64 (tile N = head_dim), cluster 2x1.
#include "cuda/gemm_epilogue/epilogue_programs.cuh"
#include "cuda/gemm_epilogue/sm90_gemm.cuh"

namespace encore::cuda {

Status launch_gemm_qkv_head_sqsum(const GemmProblem& p, Stream stream) {
  return sm90::launch_family<sm90::QkvHeadSqsum, sm90::TileConfig<128, kHeadSqsumDim, 64, 2, 1, true>>(p, stream, "gemm_qkv_head_sqsum");
}

}  // namespace encore::cuda
