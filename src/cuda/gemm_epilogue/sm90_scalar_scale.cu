// gemm_scalar_scale: D = alpha[0] · (A · Wᵀ), alpha in device memory, bf16/fp16, cooperative 128x256x64, cluster 2x1.
#include "cuda/gemm_epilogue/epilogue_nodes.cuh"
#include "cuda/gemm_epilogue/gemm_epilogue_launch.hpp"
#include "cuda/gemm_epilogue/sm90_gemm.cuh"

namespace encore::cuda {
namespace {

using Config = sm90::TileConfig<128, 256, 64, 2, 1, true>;

template <class T>
Status launch_typed(const GemmProblem& p, cudaStream_t stream) {
  using G = sm90::Sm90Gemm<T, Config, sm90::ScalarScale<T>::template Evt>;
  typename G::Fusion::Arguments fusion{{{}, {p.alpha}, {}}, {}, {}};
  auto args = G::arguments(p.M, p.N, p.K, static_cast<const T*>(p.a), p.lda, static_cast<const T*>(p.w), p.ldw, static_cast<T*>(p.d),
                           p.ldd, fusion, p.device, p.sm_count);
  return sm90::run_gemm<G>(args, stream, "gemm_scalar_scale");
}

}  // namespace

Status launch_gemm_scalar_scale(const GemmProblem& p, Stream stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::kBF16) return launch_typed<cutlass::bfloat16_t>(p, s);
  if (p.dtype == DType::kFP16) return launch_typed<cutlass::half_t>(p, s);
  return Status::unsupported(std::string("a: gemm_scalar_scale on CUDA takes bf16 or fp16, got ") + dtype_name(p.dtype));
}

}  // namespace encore::cuda
