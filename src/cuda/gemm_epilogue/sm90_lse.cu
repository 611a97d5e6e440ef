// gemm_lse: z = r[m]·(A·Wᵀ) → per-256-column-tile log-sum-exp partials, optional target-logit select,
// D = z stored or not (two instantiations); bf16/fp16, cooperative 128x256x64, cluster 2x1.
#include "cuda/gemm_epilogue/epilogue_programs.cuh"
#include "cuda/gemm_epilogue/sm90_gemm.cuh"

namespace encore::cuda {

Status launch_gemm_lse(const GemmProblem& p, Stream stream) {
  using Config = sm90::TileConfig<128, 256, 64, 2, 1, true>;
  if (p.d != nullptr) return sm90::launch_family<sm90::LseStore, Config>(p, stream, "gemm_lse");
  return sm90::launch_family<sm90::Lse, Config>(p, stream, "gemm_lse");
}

}  // namespace encore::cuda
