// The second CUDA KDA backward's last reductions (kda_bwd2.hpp), after K2 (the fused kda2_k2_kernel or
// K2b): the gate reduction over the chunks' partials (dA_log, ddt_bias; kdabwd::launch_gate_reduce_parts)
// and, with grouped value heads, the sum of the dq, dk partials over each query head's value heads, in
// fixed orders.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda/launch_check.hpp"
#include "kda/cuda/kda_bwd2_device.cuh"

namespace encore::cuda {
namespace kda2 {
namespace {

// Grouped value heads: dq[b, t, hq, a] = sum over j < group (in order) of the partial of value head
// hq * group + j (dqi / dki rows); one thread per (b, t, hq, a).
__global__ void kda2_group_reduce_kernel(const __grid_constant__ KdaBwdCudaProblem p, const float* pq, const float* pk) {
  const int Hq = p.H / p.group;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(p.B) * p.T * Hq * p.K) return;
  const int a = int(idx % p.K), hq = int(idx / p.K % Hq);
  const int64_t r = idx / p.K / Hq;
  const int t = int(r % p.T), b = int(r / p.T);
  float sq = 0.f, sk = 0.f;
  for (int j = 0; j < p.group; ++j) {
    const int64_t off = ((int64_t(b) * p.T + t) * p.H + hq * p.group + j) * kD + a;
    sq += pq[off];
    sk += pk[off];
  }
  store_out(p.dq, b, t, hq, a, sq);
  store_out(p.dk, b, t, hq, a, sk);
}

}  // namespace
}  // namespace kda2

Status launch_kda2_reductions(const KdaBwdCudaProblem& p, const Kda2Layout& l, void* workspace, int chunks, Stream stream) {
  using namespace kda2;
  const Ptrs w = ptrs_of(l, workspace);
  auto s = static_cast<cudaStream_t>(stream);
  if (p.dA_log || p.ddt_bias) ENCORE_RETURN_IF_ERROR(kdabwd::launch_gate_reduce_parts(p, w.gp, 2 * kD, 0, kD, chunks, s));
  const int64_t n = int64_t(p.B) * p.T * (p.H / p.group) * p.K;
  if (p.group > 1 && n > 0)
    ENCORE_RETURN_IF_ERROR(launch("kda2_group_reduce_kernel",
                                  [&] { kda2_group_reduce_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(p, w.dqi, w.dki); }));
  return Status::ok();
}

}  // namespace encore::cuda
