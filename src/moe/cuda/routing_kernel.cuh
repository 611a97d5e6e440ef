// MoE routing kernel: one warp per token, four tokens per 128-thread block. Lane l holds the scores
// of experts l, l + 32, ... (kPerLane = ceil(E / 32) rounded up to a power of two, in registers). The
// scores are computed in fp64, as the CPU reference does, so the selection sees the reference's values
// up to the last bits of exp (and of the softmax sum's order): ids equal the reference's, weights agree
// to ~1e-15 before the final rounding to fp32. Selection: k rounds of a warp argmax over (value desc,
// expert asc), the reference's tie rule; grouped selection: a lane per group scores it from shared
// memory with moe::group_score (problem.hpp, shared with the reference), then topk_group rounds of the
// same argmax over groups.
// Specializations: kPerLane, TL (logits dtype); the JIT (docs/jit.md) also bakes in E, k, n_group and
//   topk_group (0 in the ahead-of-time kernels: read from the params), so the expert masks, the group
//   size and the selection loops are constants. The math is the same either way.
// Shared memory (dynamic): kRoutingWarps * E * (sizeof(double) + sizeof(int)) bytes.
// One source, two ways in: routing.cu #includes this file; the build embeds it for NVRTC
//   (cmake/EncoreJitSources.cmake).
#pragma once
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "moe/problem.hpp"

namespace encore::cuda {

constexpr int kNoIndex = 0x7fffffff;  // an argmax with no candidate yet: loses every tie

// The JIT's constants (all 0 in the ahead-of-time kernels) describe a shape the kernel handles.
constexpr bool routing_shape_ok(int per_lane, int experts, int top_k, int n_group, int topk_group) {
  if (experts == 0) return true;
  return experts <= 32 * per_lane && top_k >= 1 && top_k <= experts && n_group >= 1 && experts % n_group == 0 && topk_group >= 1 &&
         topk_group <= n_group;
}
constexpr int kRoutingWarps = 4;  // tokens per block

struct RoutingParams {  // the same layout for every logits dtype
  const void* logits;
  int64_t logits_stride;
  const void* bias;  // nullptr: none
  bool bias_bf16;
  int64_t bias_stride;
  int32_t* ids;
  int64_t ids_stride;
  float* weights;
  int64_t weights_stride;
  int64_t tokens;
  int E, k;
  bool sigmoid, renormalize;
  int n_group, topk_group;
  float scale;
};

template <typename T>
__device__ __forceinline__ double load_d(const T* p);
template <> __device__ __forceinline__ double load_d<float>(const float* p) { return double(*p); }
template <> __device__ __forceinline__ double load_d<__half>(const __half* p) { return double(__half2float(*p)); }
template <> __device__ __forceinline__ double load_d<__nv_bfloat16>(const __nv_bfloat16* p) { return double(__bfloat162float(*p)); }

// (v, i) beats (w, j): larger value, lower index on ties (the reference's best_allowed).
__device__ __forceinline__ bool beats(double v, int i, double w, int j) { return v > w || (v == w && i < j); }

// Warp argmax of (v, i) carrying a payload; every lane gets the winner.
__device__ __forceinline__ void warp_argmax(double& v, int& i, double& payload) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const double ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off);
    const double op = __shfl_xor_sync(0xffffffffu, payload, off);
    if (beats(ov, oi, v, i)) {
      v = ov;
      i = oi;
      payload = op;
    }
  }
}

__device__ __forceinline__ double warp_max(double v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Shared memory per warp: E doubles (the biased scores, then the selected weights) + E ints (the
// kept-group flags, then the selected ids).
// kExperts, kTopK, kNGroup, kTopkGroup: 0 in the ahead-of-time kernels (read from p), the problem's
// values in a JIT specialization (all four constant together).
template <int kPerLane, typename TL, int kExperts = 0, int kTopK = 0, int kNGroup = 0, int kTopkGroup = 0>
__global__ void __launch_bounds__(kRoutingWarps * 32) moe_routing_kernel(RoutingParams p) {
  static_assert(routing_shape_ok(kPerLane, kExperts, kTopK, kNGroup, kTopkGroup),
                "JIT routing: 1 <= k <= E <= 32 * kPerLane, n_group divides E, 1 <= topk_group <= n_group");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int64_t t = int64_t(blockIdx.x) * kRoutingWarps + warp;
  if (t >= p.tokens) return;  // whole warps leave together; no block-wide barrier below
  const int E = kExperts ? kExperts : p.E;
  const int K = kExperts ? kTopK : p.k;
  const int n_group = kExperts ? kNGroup : p.n_group;
  const int topk_group = kExperts ? kTopkGroup : p.topk_group;
  double* dbuf = reinterpret_cast<double*>(smem_raw) + size_t(warp) * size_t(E);
  int* ibuf = reinterpret_cast<int*>(reinterpret_cast<double*>(smem_raw) + size_t(kRoutingWarps) * size_t(E)) + size_t(warp) * size_t(E);

  const TL* row = static_cast<const TL*>(p.logits) + t * p.logits_stride;
  double s[kPerLane], c[kPerLane];
  bool allowed[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    allowed[i] = e < E;
    s[i] = allowed[i] ? load_d<TL>(row + e) : -INFINITY;
  }
  if (p.sigmoid) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) s[i] = allowed[i] ? 1.0 / (1.0 + exp(-s[i])) : 0.0;
  } else {
    double m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) m = fmax(m, s[i]);
    m = warp_max(m);
    double sum = 0.0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      s[i] = allowed[i] ? exp(s[i] - m) : 0.0;
      sum += s[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) s[i] /= sum;
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    double b = 0.0;
    if (p.bias && allowed[i]) {
      b = p.bias_bf16 ? double(__bfloat162float(static_cast<const __nv_bfloat16*>(p.bias)[int64_t(e) * p.bias_stride]))
                      : double(static_cast<const float*>(p.bias)[int64_t(e) * p.bias_stride]);
    }
    c[i] = s[i] + b;
  }

  if (n_group > 1) {
    const int size = E / n_group;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (allowed[i]) dbuf[lane + 32 * i] = c[i];
    for (int g = lane; g < n_group; g += 32) ibuf[g] = 0;
    __syncwarp();
    double gs[kPerLane];  // n_group <= E: at most kPerLane groups per lane
    bool gfree[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int g = lane + 32 * i;
      gfree[i] = g < n_group;
      gs[i] = gfree[i] ? moe::group_score(dbuf + size_t(g) * size_t(size), size, p.bias != nullptr) : -INFINITY;
    }
    for (int r = 0; r < topk_group; ++r) {
      double v = -INFINITY, pay = 0.0;
      int gi = kNoIndex;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (gfree[i] && beats(gs[i], lane + 32 * i, v, gi)) {
          v = gs[i];
          gi = lane + 32 * i;
        }
      warp_argmax(v, gi, pay);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (lane + 32 * i == gi) gfree[i] = false;
      if (lane == 0 && gi < n_group) ibuf[gi] = 1;
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (allowed[i]) allowed[i] = ibuf[(lane + 32 * i) / size] != 0;
    __syncwarp();  // dbuf / ibuf are reused for the selection below
  }

  double wsum = 0.0;
  for (int j = 0; j < K; ++j) {
    double v = -INFINITY, sel = 0.0;
    int ei = kNoIndex;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (allowed[i] && beats(c[i], lane + 32 * i, v, ei)) {
        v = c[i];
        ei = lane + 32 * i;
        sel = s[i];
      }
    warp_argmax(v, ei, sel);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (lane + 32 * i == ei) allowed[i] = false;
    if (lane == 0) {
      dbuf[j] = sel;
      ibuf[j] = ei;
    }
    wsum += sel;  // every lane holds the same winner: the reference's sequential sum over j
  }
  __syncwarp();
  const double norm = p.renormalize && wsum > 0 ? wsum : 1.0;
  for (int j = lane; j < K; j += 32) {
    p.ids[t * p.ids_stride + j] = ibuf[j];
    p.weights[t * p.weights_stride + j] = float(dbuf[j] / norm * double(p.scale));
  }
}

}  // namespace encore::cuda
