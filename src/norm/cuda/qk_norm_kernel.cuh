// QK-norm: per-head RMSNorm of the Q and K heads of a fused QKV buffer, in place.
//
// Math:   u = qkv[t, j*D:(j+1)*D] for j < Hq + Hkv;  u <- u * rsqrt(mean(u^2) + eps) * (w_j + offset),
//         w_j = q_weight (j < Hq) or k_weight. V heads untouched.
// Shapes: qkv [tokens, (Hq + 2*Hkv) * D] with token stride (elements, multiple of 8); T bf16/fp16.
// Mapping: a head is owned by a group of kLanes = D * sizeof(T) / kPackBytes lanes (8, 16, 32 for
//   D = 64, 128, 256 with 16-byte packs; half that with the 32-byte packs of the sm_100+ plan, one
//   256-bit access each), each lane one pack; a warp holds 32 / kLanes heads; the sum of squares is a
//   butterfly over the group. Heads are numbered g = t * (Hq + Hkv) + j, so consecutive groups touch
//   consecutive memory within a token. Each group handles kHeadsPerThread consecutive heads, all
//   loaded before any is stored, in a grid-stride loop over chunks of kHeadsPerThread heads.
// Specializations: T, D, kOffset (weight_offset != 0), kHeadsPerThread (1 decode, 2/4 prefill);
//   the JIT (docs/jit.md) also bakes in the head layout: kHeadsPerToken = Hq + Hkv and kQHeads = Hq
//   (0 in the ahead-of-time kernels: read from the params), so the token / head split of the head
//   index is a division by a constant. The math is the same either way.
// Constraints (validate): 16-byte aligned qkv rows and weights (32-byte for kPackBytes 32: the
//   dispatcher checks), D in {64, 128, 256}.
// One source, two ways in: qk_norm.cu #includes this file; the build embeds it for NVRTC
//   (cmake/EncoreJitSources.cmake; <cstdint> is a stand-in there, jit/family.cpp).
#pragma once
#include <cstdint>

#include "core/fast_div.hpp"
#include "common/cuda/reduce.cuh"
#include "common/cuda/vector_io.cuh"

namespace encore::cuda {

template <typename T>
struct QkNormParams {
  T* qkv;
  int64_t token_stride;
  const T* q_weight;
  const T* k_weight;
  uint32_t num_heads_total;  // tokens * (Hq + Hkv) < 2^31 (validate)
  uint32_t heads_per_token;  // Hq + Hkv
  FastDiv31 token_of_head;   // g / heads_per_token by multiply and shift
  int num_q_heads;
  float eps;
  float weight_offset;
};

template <typename T, int kHeadDim, bool kOffset, int kHeadsPerThread, int kHeadsPerToken = 0, int kQHeads = 0, int kPackBytes = 16>
__global__ void __launch_bounds__(512) qk_norm_kernel(QkNormParams<T> p) {
  static_assert(kPackBytes == 16 || kPackBytes == 32, "16- or 32-byte lane accesses");
  constexpr int kVec = kPackBytes / int(sizeof(T));
  constexpr int kLanes = kHeadDim / kVec;
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "head_dim must give 1-32 lanes");
  using P = Pack<T, kVec>;
  static_assert(kHeadsPerToken == 0 || (kQHeads >= 1 && kQHeads < kHeadsPerToken), "JIT head layout: 1 <= Hq < Hq + Hkv");
  const uint32_t heads_per_token = kHeadsPerToken ? uint32_t(kHeadsPerToken) : p.heads_per_token;
  const uint32_t num_q_heads = kHeadsPerToken ? uint32_t(kQHeads) : uint32_t(p.num_q_heads);

  // A lane group takes kHeadsPerThread consecutive heads (one multiply-shift division per chunk,
  // then the head index steps): per-head index math, not memory, had bounded the kernel (74% of copy).
  const int lane = threadIdx.x % kLanes;
  const uint32_t groups_in_grid = gridDim.x * (blockDim.x / kLanes);
  const uint32_t group0 = blockIdx.x * (blockDim.x / kLanes) + threadIdx.x / kLanes;
  const P wq = load_pack_global<T, kVec>(p.q_weight + lane * kVec);
  const P wk = load_pack_global<T, kVec>(p.k_weight + lane * kVec);

  for (uint32_t chunk = group0; chunk < (p.num_heads_total + kHeadsPerThread - 1) / kHeadsPerThread; chunk += groups_in_grid) {
    const uint32_t g0 = chunk * kHeadsPerThread;
    uint32_t t = kHeadsPerToken ? g0 / uint32_t(kHeadsPerToken) : p.token_of_head.div(g0);
    uint32_t j = g0 - t * heads_per_token;
    P v[kHeadsPerThread];
    T* ptr[kHeadsPerThread];
    bool is_q[kHeadsPerThread];
#pragma unroll
    for (int i = 0; i < kHeadsPerThread; ++i) {
      ptr[i] = nullptr;
      is_q[i] = j < num_q_heads;
      if (g0 + i < p.num_heads_total) {
        ptr[i] = p.qkv + int64_t(t) * p.token_stride + j * kHeadDim + lane * kVec;
        v[i] = load_pack_once<T, kVec>(ptr[i]);
      }
      if (++j == heads_per_token) {
        j = 0;
        ++t;
      }
    }
#pragma unroll
    for (int i = 0; i < kHeadsPerThread; ++i) {
      // Every lane joins the shuffles, also for heads past the end (their sums are discarded).
      const float ss = group_sum<kLanes>(ptr[i] ? pack_sumsq(v[i]) : 0.f);
      if (ptr[i]) {
        const float rstd = rsqrtf(ss / float(kHeadDim) + p.eps);
        // Select weight values, not a reference to one of two register packs (that put the packs
        // in local memory).
        P out;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          float wf = to_float(is_q[i] ? wq.v[e] : wk.v[e]);
          if constexpr (kOffset) wf += p.weight_offset;
          out.v[e] = from_float<T>(to_float(v[i].v[e]) * rstd * wf);
        }
        store_pack_once(ptr[i], out);
      }
    }
  }
}

}  // namespace encore::cuda
