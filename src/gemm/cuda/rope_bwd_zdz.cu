// RoPE backward + zdz (encore/gemm.hpp RopeBwdZdzArgs; docs/math/gemm_epilogues.md §4.3), elementwise:
//   dz = Rᵀ(θ)·dy per column pair (2j, 2j+1), θ = 2π·pos[m]·(freq[2j] + freq[2j+1]) with the exact phase
//   reduction of the GEMM RoPE node; zdz[m] = scale · Σ_n y[m, n]·dy[m, n].
// One CTA of 256 threads per row: thread i takes the pairs i, i + 256, ...; its fp32 partial of
// Σ y·dy is reduced by warp shuffles and then over the 8 warps in index order (deterministic).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/cuda/launch_check.hpp"
#include "common/cuda/vector_io.cuh"
#include "gemm/cuda/launch.hpp"

namespace encore::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) rope_bwd_zdz_kernel(gemm::RopeBwdZdzProblem p) {
  const int m = blockIdx.x;
  const T* y = static_cast<const T*>(p.y) + int64_t(m) * p.ld_y;
  const T* dy = static_cast<const T*>(p.dy) + int64_t(m) * p.ld_dy;
  T* dz = static_cast<T*>(p.dz) + int64_t(m) * p.ld_dz;
  const float pos = float(p.pos[m]);
  float acc = 0.0f;
  for (int j = threadIdx.x; j < p.N / 2; j += kThreads) {  // N even; not 2 * j < N: 2 * j passes 2^31 - 1 for N close to 2^31
    const int n = 2 * j;
    const float a = to_float(dy[n]), b = to_float(dy[n + 1]);
    acc = fmaf(to_float(y[n]), a, fmaf(to_float(y[n + 1]), b, acc));
    const float2 f = *reinterpret_cast<const float2*>(p.freq + n);
    const float prod = pos * f.x, err = fmaf(pos, f.x, -prod);
    const float turns = (prod - rintf(prod)) + fmaf(pos, f.y, err);
    float s, c;
    __sincosf(6.283185307179586f * turns, &s, &c);
    dz[n] = from_float<T>(a * c + b * s);  // Rᵀ of (a, b) -> (a c − b s, b c + a s)
    dz[n + 1] = from_float<T>(b * c - a * s);
  }
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  __shared__ float warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) s += warp_sums[w];
    p.zdz[m] = p.scale * s;
  }
}

template <typename T>
Status launch_typed(const gemm::RopeBwdZdzProblem& p, cudaStream_t s) {
  return launch("rope_bwd_zdz", [&] { rope_bwd_zdz_kernel<T><<<unsigned(p.M), kThreads, 0, s>>>(p); });
}

}  // namespace

Status launch_rope_bwd_zdz(const gemm::RopeBwdZdzProblem& p, Stream stream) {
  if (p.M == 0) return Status::ok();
  auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::kBF16) return launch_typed<__nv_bfloat16>(p, s);
  if (p.dtype == DType::kFP16) return launch_typed<__half>(p, s);
  return launch_typed<float>(p, s);
}

}  // namespace encore::cuda
