// gemm_rope on the Pingpong128x128 tile: z = r[m]·(A·Wᵀ) → D = RoPE(z) over column pairs.
#include "gemm/cuda/programs.cuh"
#include "gemm/cuda/sm90_gemm.cuh"

encore::Status encore::cuda::launch_rope_pp128(const GemmProblem& p, Stream stream) {
  return sm90::launch_family<sm90::Rope, sm90::Pingpong128x128>(p, stream, "gemm_rope");
}
