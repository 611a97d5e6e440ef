// QK-norm + RoPE finish after gemm_qkv_head_sqsum, in place (encore/gemm.hpp QkNormRopeArgs):
//   x ← x · rsqrt(partials[m, h] / D + eps) · w for the Q and K heads, then the rotation of each
//   column pair (2j, 2j+1) by 2π·pos[m]·(freq[2j] + freq[2j+1]) (exact phase reduction, as in the
//   GEMM RoPE node). One thread per column pair of the Q and K heads; V heads are not touched.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/cuda/launch_check.hpp"
#include "common/cuda/vector_io.cuh"
#include "gemm/cuda/launch.hpp"

namespace encore::cuda {
namespace {

template <typename T, typename W>
__global__ void qk_norm_rope_kernel(QkNormRopeProblem p) {
  const int64_t pair = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int pairs_per_row = p.qk_heads * p.head_dim / 2;
  if (pair >= int64_t(p.M) * pairs_per_row) return;
  const int m = int(pair / pairs_per_row), j = int(pair % pairs_per_row);
  const int n = 2 * j, h = n / p.head_dim, e = n % p.head_dim;
  T* row = static_cast<T*>(p.qkv) + int64_t(m) * p.ld_qkv;
  const float r = rsqrtf(p.partials[int64_t(m) * p.ld_partials + h] / float(p.head_dim) + p.eps);
  const W* w = static_cast<const W*>(h < p.num_q_heads ? p.q_weight : p.k_weight);
  const float a = to_float(row[n]) * r * to_float(w[e]), b = to_float(row[n + 1]) * r * to_float(w[e + 1]);
  const float2 f = *reinterpret_cast<const float2*>(p.freq + n);
  const float pos = float(p.pos[m]);
  const float prod = pos * f.x, err = fmaf(pos, f.x, -prod);
  const float turns = (prod - rintf(prod)) + fmaf(pos, f.y, err);
  float s, c;
  __sincosf(6.283185307179586f * turns, &s, &c);
  row[n] = from_float<T>(a * c - b * s);
  row[n + 1] = from_float<T>(b * c + a * s);
}

template <typename T>
Status launch_typed(const QkNormRopeProblem& p, cudaStream_t s) {
  const int64_t pairs = int64_t(p.M) * p.qk_heads * p.head_dim / 2;
  const unsigned grid = unsigned((pairs + 255) / 256);
  return launch("qk_norm_rope", [&] {
    if (p.weight_fp32) qk_norm_rope_kernel<T, float><<<grid, 256, 0, s>>>(p);
    else qk_norm_rope_kernel<T, T><<<grid, 256, 0, s>>>(p);
  });
}

}  // namespace

Status launch_qk_norm_rope(const QkNormRopeProblem& p, Stream stream) {
  if (p.M == 0) return Status::ok();
  auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::kBF16) return launch_typed<__nv_bfloat16>(p, s);
  if (p.dtype == DType::kFP16) return launch_typed<__half>(p, s);
  return launch_typed<float>(p, s);
}

}  // namespace encore::cuda
