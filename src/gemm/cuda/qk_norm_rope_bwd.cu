// Backward of the QK-norm + RoPE finish (encore/gemm.hpp QkNormRopeBwdArgs). One warp per (row m,
// Q/K head h) item, items strided over a fixed set of warps; lane l owns the column pairs
// j = l + 32·k (k < ceil(D / 64), D = head_dim <= 256) of the head:
//   dn = Rᵀ·dy per pair (θ = 2π·pos[m]·(freq[2j] + freq[2j+1]), the forward's exact phase reduction);
//   dot = Σ_e w_e·dn_e·x_e (warp shuffle tree: a fixed order);  r = rsqrt(partials[m, h] / D + eps);
//   dx = r·w⊙dn − r³·x·dot / D;  each lane accumulates dn·r·x of its columns for the Q and the K
//   weight, and each warp writes its [2, D] partials to the workspace, summed over warps in order by
//   the per-column partials sum (deterministic for a given M). V heads: dx = dy (copied unless in place).
// Shapes: dy, x, dx [M, N] (unit last stride, row strides ld_*), partials [M, heads] fp32, freq [N]
// fp32 8-byte aligned, pos [M] int32, weights [D] (qkv's dtype or fp32).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "common/cuda/launch_check.hpp"
#include "common/cuda/vector_io.cuh"
#include "gemm/cuda/launch.hpp"
#include "gemm/cuda/qk_norm_rope_bwd.hpp"

namespace encore::cuda {
namespace {

constexpr int kWarps = kQkNormRopeBwdWarps;  // per block
constexpr int kMaxPairsPerLane = 4;  // head_dim <= 256

template <typename T, typename W>
__global__ void __launch_bounds__(kWarps * 32) qk_norm_rope_bwd_kernel(QkNormRopeBwdProblem p, float* ws) {
  const int lane = threadIdx.x & 31, warp = int(blockIdx.x) * kWarps + int(threadIdx.x >> 5);
  const int total_warps = int(gridDim.x) * kWarps, D = p.head_dim, pairs = D / 2;
  const int64_t items = int64_t(p.M) * p.qk_heads;
  float acc_q[kMaxPairsPerLane][2] = {}, acc_k[kMaxPairsPerLane][2] = {};  // named: no run-time index into registers
  for (int64_t it = warp; it < items; it += total_warps) {
    const int m = int(it / p.qk_heads), h = int(it % p.qk_heads);
    const bool q = h < p.num_q_heads;
    const W* w = static_cast<const W*>(q ? p.q_weight : p.k_weight);
    const T* dy = static_cast<const T*>(p.dy) + int64_t(m) * p.ld_dy + int64_t(h) * D;
    const T* x = static_cast<const T*>(p.x) + int64_t(m) * p.ld_x + int64_t(h) * D;
    const float pos = float(p.pos[m]);
    float dn[kMaxPairsPerLane][2], xv[kMaxPairsPerLane][2], wv[kMaxPairsPerLane][2];
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxPairsPerLane; ++k) {
      const int j = lane + 32 * k;
      dn[k][0] = dn[k][1] = xv[k][0] = xv[k][1] = wv[k][0] = wv[k][1] = 0.f;
      if (j >= pairs) continue;
      const int e = 2 * j;
      const float2 f = *reinterpret_cast<const float2*>(p.freq + int64_t(h) * D + e);
      const float prod = pos * f.x, err = fmaf(pos, f.x, -prod);
      const float turns = (prod - rintf(prod)) + fmaf(pos, f.y, err);
      float s, c;
      __sincosf(6.283185307179586f * turns, &s, &c);
      const float g0 = to_float(dy[e]), g1 = to_float(dy[e + 1]);
      dn[k][0] = g0 * c + g1 * s;  // Rᵀ: rotate by −θ
      dn[k][1] = g1 * c - g0 * s;
      xv[k][0] = to_float(x[e]);
      xv[k][1] = to_float(x[e + 1]);
      wv[k][0] = to_float(w[e]);
      wv[k][1] = to_float(w[e + 1]);
      dot += wv[k][0] * dn[k][0] * xv[k][0] + wv[k][1] * dn[k][1] * xv[k][1];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const float r = rsqrtf(p.partials[int64_t(m) * p.ld_partials + h] / float(D) + p.eps);
    const float c3 = r * r * r * dot / float(D);
    T* dx = static_cast<T*>(p.dx) + int64_t(m) * p.ld_dx + int64_t(h) * D;
#pragma unroll
    for (int k = 0; k < kMaxPairsPerLane; ++k) {
      const int j = lane + 32 * k;
      if (j >= pairs) continue;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        dx[2 * j + i] = from_float<T>(r * wv[k][i] * dn[k][i] - c3 * xv[k][i]);
        const float gw = dn[k][i] * r * xv[k][i];
        acc_q[k][i] += q ? gw : 0.f;
        acc_k[k][i] += q ? 0.f : gw;
      }
    }
  }
  float* part = ws + int64_t(warp) * 2 * D;
#pragma unroll
  for (int k = 0; k < kMaxPairsPerLane; ++k) {
    const int j = lane + 32 * k;
    if (j < pairs) {
      part[2 * j] = acc_q[k][0];
      part[2 * j + 1] = acc_q[k][1];
      part[D + 2 * j] = acc_k[k][0];
      part[D + 2 * j + 1] = acc_k[k][1];
    }
  }
  // V heads pass through (dx = dy) unless in place.
  if (p.dx != p.dy) {
    const int v0 = p.qk_heads * D, vn = p.N - v0;
    const int64_t n_v = int64_t(p.M) * vn;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_v; i += int64_t(gridDim.x) * blockDim.x) {
      const int m = int(i / vn), c = v0 + int(i % vn);
      static_cast<T*>(p.dx)[int64_t(m) * p.ld_dx + c] = static_cast<const T*>(p.dy)[int64_t(m) * p.ld_dy + c];
    }
  }
}

template <typename T>
Status launch_typed(const QkNormRopeBwdProblem& p, float* ws, int blocks, cudaStream_t s) {
  return launch("qk_norm_rope_bwd", [&] {
    if (p.weight_fp32) qk_norm_rope_bwd_kernel<T, float><<<blocks, kWarps * 32, 0, s>>>(p, ws);
    else qk_norm_rope_bwd_kernel<T, T><<<blocks, kWarps * 32, 0, s>>>(p, ws);
  });
}

}  // namespace

Status launch_qk_norm_rope_bwd(const QkNormRopeBwdProblem& p, float* ws, Stream stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const int blocks = qk_norm_rope_bwd_blocks(p.M, p.qk_heads);
  Status st = p.dtype == DType::kBF16   ? launch_typed<__nv_bfloat16>(p, ws, blocks, s)
              : p.dtype == DType::kFP16 ? launch_typed<__half>(p, ws, blocks, s)
                                        : launch_typed<float>(p, ws, blocks, s);
  if (!st) return st;
  const int rows = blocks * kWarps, D = p.head_dim;
  st = launch_partials_sum(ws, 2 * D, rows, D, p.dq_weight, D, /*per_column=*/true, 1.0f, stream);
  if (!st) return st;
  return launch_partials_sum(ws + D, 2 * D, rows, D, p.dk_weight, D, /*per_column=*/true, 1.0f, stream);
}

}  // namespace encore::cuda
