// gemm_rope on the Cooperative128x256 tile: z = r[m]·(A·Wᵀ) → D = RoPE(z) over column pairs.
#include "gemm/cuda/programs.cuh"
#include "gemm/cuda/sm90_gemm.cuh"

encore::Status encore::cuda::launch_rope_coop256(const GemmProblem& p, Stream stream) {
  return sm90::launch_family<sm90::Rope, sm90::Cooperative128x256>(p, stream, "gemm_rope");
}
