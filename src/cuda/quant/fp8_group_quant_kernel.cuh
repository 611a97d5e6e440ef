// FP8 e4m3 per-token-group quantization (groups of 128 along the row).
//
// Math:   s = fp8_group_scale(max |x[m, group]|);  q = e4m3_rn_satfinite(x * (1 / s));  scales[m, g] = s.
// Shapes: x [M, K] T in {bf16, fp16, fp32} (row stride multiple of 16 bytes); q [M, K] e4m3 (row
//         stride multiple of 16); scales fp32 at m * stride_m + g * stride_g (row- or column-major).
// Mapping: a group of 128 elements is owned by kLanes = 128 / (16 / sizeof(T)) lanes (16 for
//   bf16/fp16, 32 for fp32), each lane one 16-byte pack; amax is a butterfly max over the lanes;
//   each lane writes its 8 (or 4) fp8 bytes, the group's first lane the scale. kGroupsPerThread
//   consecutive groups per lane group are loaded before any is written (memory-level parallelism),
//   in a grid-stride loop over chunks of groups g = m * (K / 128) + group.
// Constraints (validate): K % 128 == 0, M * K / 128 < 2^31, 16-byte aligned x and q rows.
#pragma once
#include <cuda_fp8.h>

#include <cstdint>

#include "cuda/common/reduce.cuh"
#include "cuda/common/vector_io.cuh"
#include "quant/fp8_scale.hpp"

namespace encore::cuda {

template <typename T>
struct Fp8QuantParams {
  const T* x;
  int64_t x_stride;
  uint8_t* q;
  int64_t q_stride;
  float* scales;
  int64_t scale_stride_m, scale_stride_g;
  uint32_t groups_per_row;
  uint32_t num_groups;  // M * groups_per_row
  bool power_of_two;
  float eps;
};

constexpr int kFp8GroupSize = 128;

// One lane's share of a group: the amax over the kLanes lanes of its group (every lane of the warp
// must call this: the butterfly uses the full mask), the scale, and the lane's kVec e4m3 bytes in
// `out` (cvt.rn.satfinite.e4m3x2.f32, two values per instruction, .x in the low byte). Returns the
// scale; `out` is meaningful only when `valid`.
template <typename T, int kVec, int kLanes>
__device__ __forceinline__ float quantize_pack(const Pack<T, kVec>& v, bool valid, bool power_of_two, float eps,
                                               Pack<uint8_t, kVec>& out) {
  float amax = 0.f;
  if (valid) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) amax = fmaxf(amax, fabsf(to_float(v.v[e])));
  }
  amax = group_max<kLanes>(amax);
  const float s = quant::fp8_group_scale(amax, power_of_two, eps);
  const float inv = quant::fp8_inverse_scale(s);
#pragma unroll
  for (int e = 0; e < kVec; e += 2) {
    const __nv_fp8x2_storage_t two = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(to_float(v.v[e]), inv), __fmul_rn(to_float(v.v[e + 1]), inv)), __NV_SATFINITE, __NV_E4M3);
    out.v[e] = uint8_t(two & 0xff);
    out.v[e + 1] = uint8_t(two >> 8);
  }
  return s;
}

template <typename T, int kGroupsPerThread>
__global__ void __launch_bounds__(512) fp8_group_quant_kernel(Fp8QuantParams<T> p) {
  constexpr int kVec = 16 / int(sizeof(T));
  constexpr int kLanes = kFp8GroupSize / kVec;
  using P = Pack<T, kVec>;
  using Q = Pack<uint8_t, kVec>;
  const int lane = threadIdx.x % kLanes;
  const uint32_t groups_in_grid = gridDim.x * (blockDim.x / kLanes);
  const uint32_t group0 = blockIdx.x * (blockDim.x / kLanes) + threadIdx.x / kLanes;
  const uint32_t num_chunks = (p.num_groups + kGroupsPerThread - 1) / kGroupsPerThread;

  for (uint32_t chunk = group0; chunk < num_chunks; chunk += groups_in_grid) {
    // kGroupsPerThread consecutive groups: one division per chunk, then the group index steps.
    const uint32_t g0 = chunk * kGroupsPerThread;
    uint32_t m = g0 / p.groups_per_row;
    uint32_t gi = g0 - m * p.groups_per_row;
    P v[kGroupsPerThread];
    int64_t x_off[kGroupsPerThread];
    uint32_t mi[kGroupsPerThread], gii[kGroupsPerThread];
#pragma unroll
    for (int i = 0; i < kGroupsPerThread; ++i) {
      mi[i] = m;
      gii[i] = gi;
      x_off[i] = int64_t(m) * p.x_stride + gi * kFp8GroupSize + lane * kVec;
      if (g0 + i < p.num_groups) v[i] = load_pack_once<T, kVec>(p.x + x_off[i]);
      if (++gi == p.groups_per_row) {
        gi = 0;
        ++m;
      }
    }
#pragma unroll
    for (int i = 0; i < kGroupsPerThread; ++i) {
      const bool valid = g0 + i < p.num_groups;
      Q out;
      const float s = quantize_pack<T, kVec, kLanes>(v[i], valid, p.power_of_two, p.eps, out);  // all lanes
      if (!valid) continue;
      store_pack(p.q + int64_t(mi[i]) * p.q_stride + gii[i] * kFp8GroupSize + lane * kVec, out);
      if (lane == 0) p.scales[int64_t(mi[i]) * p.scale_stride_m + int64_t(gii[i]) * p.scale_stride_g] = s;
    }
  }
}

}  // namespace encore::cuda
