// gemm_lse on the Pingpong128x128 tile: z = r[m]·(A·Wᵀ) → per-tile log-sum-exp partials, optional target-logit
// select; D = z stored or not (two instantiations).
#include "gemm/cuda/programs.cuh"
#include "gemm/cuda/sm90_gemm.cuh"

encore::Status encore::cuda::launch_lse_pp128(const GemmProblem& p, Stream stream) {
  if (p.d != nullptr) return sm90::launch_family<sm90::LseStore, sm90::Pingpong128x128>(p, stream, "gemm_lse");
  return sm90::launch_family<sm90::Lse, sm90::Pingpong128x128>(p, stream, "gemm_lse");
}
