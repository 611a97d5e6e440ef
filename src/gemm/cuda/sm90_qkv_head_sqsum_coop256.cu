// gemm_qkv_head_sqsum on the Cooperative128x256 tile: D = A·Wᵀ, partials[m, h] = Σ_{n in head h} D²
// (two heads of head_dim = 128 per tile, one partial per head).
#include "gemm/cuda/programs.cuh"
#include "gemm/cuda/sm90_gemm.cuh"

encore::Status encore::cuda::launch_qkv_head_sqsum_coop256(const GemmProblem& p, Stream stream) {
  return sm90::launch_family<sm90::QkvHeadSqsum, sm90::Cooperative128x256>(p, stream, "gemm_qkv_head_sqsum");
}
