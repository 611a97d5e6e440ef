// gemm_qkv_head_sqsum on the Pingpong128x128 tile: D = A·Wᵀ, partials[m, h] = Σ_{n in head h} D² (one head of
// head_dim = 128 per tile).
#include "gemm/cuda/programs.cuh"
#include "gemm/cuda/sm90_gemm.cuh"

encore::Status encore::cuda::launch_qkv_head_sqsum_pp128(const GemmProblem& p, Stream stream) {
  return sm90::launch_family<sm90::QkvHeadSqsum, sm90::Pingpong128x128>(p, stream, "gemm_qkv_head_sqsum");
}
