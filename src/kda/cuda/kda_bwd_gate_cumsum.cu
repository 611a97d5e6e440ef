// The chunk-local cumulative gate G for a CUDA backward whose forward did not save it (residuals.G
// absent; docs/math/kda.md §2): per chunk of 64 tokens of a sequence, per value head and channel c < K,
//   G[b, t, h, c] = sum over the chunk's rows t' <= t of gate(g[b, t', h, c]),
// gate in log2 units: the precomputed log-decay times log2 e, or in the kernel −e^A_log softplus(g +
// dt_bias) log2 e (one exp2, softplus_log2.hpp) or lower_bound σ(e^A_log (g + dt_bias)) log2 e. The same
// operations in the same order as the forward's chunk kernel (kda_chunk.cu: the activation per element,
// then a running fp32 sum down the rows), so the backward reads what the forward would have saved.
// kda_gate_cumsum_kernel: grid (chunk slots, HV), K threads rounded up to a warp (a thread per channel
// down the chunk's rows; a warp's loads and stores are one row's contiguous channels). Out: fp32
// [B, T, HV, K] contiguous; rows past a sequence's end are not written (the backward never reads them).
#include <cuda_runtime.h>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/fast_math.cuh"
#include "common/cuda/launch_check.hpp"
#include "core/softplus_log2.hpp"
#include "kda/cuda/kda_bwd_device.cuh"
#include "kda/cuda/kda_bwd_launch.hpp"

namespace encore::cuda {
namespace {

// The activated gate in log2 units (kda_chunk.cu's load of the gate tile). Its last product is rounded
// on its own (__fmul_rn), never contracted into the running sum's add: in the forward the activated
// gate passes through shared memory before the sum.
__device__ __forceinline__ float activated(const KdaBwdCudaProblem& p, float a, float ea, float dtb) {
  if (!p.gate_in_kernel) return __fmul_rn(a, kLog2e);
  if (p.dt_bias) a += dtb;
  if (p.lower_bound_gate) return __fmul_rn(kLog2e, __fdividef(p.lower_bound, 1.0f + __expf(-ea * a)));
  const float y = a * kLog2e;
  return __fmul_rn(-ea, softplus_log2(y, fast_exp2(-fabsf(y))));
}

__global__ void kda_gate_cumsum_kernel(const KdaBwdCudaProblem p, float* __restrict__ G) {
  const int c = threadIdx.x, h = blockIdx.y;
  if (c >= p.K) return;
  const kdabwd::ChunkInfo ci = kdabwd::chunk_info(p, blockIdx.x);
  const float ea = p.gate_in_kernel && p.A_log ? expf(p.A_log[h]) : 1.0f;
  const float dtb = p.gate_in_kernel && p.dt_bias ? p.dt_bias[h * p.K + c] : 0.f;
  float acc = 0.f;
  for (int i0 = 0; i0 < ci.rows; i0 += 16) {  // 16 rows' loads in flight, then their sums and stores
    float raw[16];
#pragma unroll
    for (int u = 0; u < 16; ++u) raw[u] = kdabwd::load_or0(p.g, ci.b, ci.t0 + i0 + u, h, c, i0 + u < ci.rows);
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      if (i0 + u >= ci.rows) break;
      acc += activated(p, raw[u], ea, dtb);
      G[kdabwd::tok(p, ci.b, ci.t0 + i0 + u, h) * p.K + c] = acc;
    }
  }
}

}  // namespace

Status launch_kda_gate_cumsum(const KdaBwdCudaProblem& p, float* G, int chunks, Stream stream) {
  if (chunks <= 0 || p.H <= 0 || p.K <= 0) return Status::ok();
  DeviceGuard guard;  // the first launch of the backward: on the inputs' device
  ENCORE_RETURN_IF_ERROR(guard.set(p.device));
  const unsigned threads = unsigned((p.K + 31) / 32 * 32);
  auto s = static_cast<cudaStream_t>(stream);
  return launch("kda_gate_cumsum_kernel", [&] { kda_gate_cumsum_kernel<<<dim3(unsigned(chunks), unsigned(p.H)), threads, 0, s>>>(p, G); });
}

}  // namespace encore::cuda
