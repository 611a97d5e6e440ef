// KDA inter-chunk state and output kernel (docs/kda.md, "Design"): one block a (sequence, head, value
// slice), the pass of kda_state_pass.cuh; grid (H · ceil(V / kVs), N), 512 threads, kVs = 64, 32 or 16.
#include "kda/cuda/kda_state_pass.cuh"

namespace encore::cuda::kda {
namespace {

using state::kThreads;
using state::StateSmem;

template <int kVs, class P>  // P: KdaCudaProblem or KdaCudaProblemFew
__global__ void __launch_bounds__(kThreads, 1) kda_state_kernel(const __grid_constant__ P p, const void* ws) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  state::state_pass<kVs>(p, ws, blockIdx.x, blockIdx.y, smem_raw, [](int, int) {});
}

}  // namespace

template <int kVs, class P>
Status launch_state(const P& p, const void* ws, cudaStream_t stream) {
  using Sm = StateSmem<kVs>;
  constexpr const char* what = "kda forward: state kernel (kda_state_kernel)";
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kda_state_kernel<kVs, P>, Sm::kAlloc));
  return launch(what, [&] {
    kda_state_kernel<kVs, P><<<dim3(unsigned(p.H * state_column_blocks(p.V, kVs)), unsigned(p.N)), kThreads, Sm::kAlloc, stream>>>(p, ws);
  });
}

template <class P>
Status launch_state_kernel(const P& p, const void* ws, int columns, cudaStream_t stream) {
  return columns == 16 ? launch_state<16>(p, ws, stream) : columns == 32 ? launch_state<32>(p, ws, stream) : launch_state<64>(p, ws, stream);
}
template Status launch_state_kernel(const KdaCudaProblem&, const void*, int, cudaStream_t);
template Status launch_state_kernel(const KdaCudaProblemFew&, const void*, int, cudaStream_t);

}  // namespace encore::cuda::kda
