// Warp and block reductions (butterfly shuffles; shared memory across the warps of one team).
#pragma once

namespace encore::cuda {

// Inclusive prefix sum over the 32 lanes of a warp (lane l gets v_0 + .. + v_l); every lane calls it.
__device__ __forceinline__ int warp_inclusive_sum(int v) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) >= unsigned(o)) v += n;
  }
  return v;
}

// Sum / max over aligned groups of kLanes consecutive lanes (kLanes a power of two <= 32). Every
// lane of the warp must call these (the shuffles use the full mask).
template <int kLanes>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

template <int kLanes>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Sum over a team of `num_warps` consecutive warps. `scratch` holds one float per warp of the block;
// `team_warp0` is the index of the team's first warp. Every thread of the block must call this
// (it contains __syncthreads) when num_warps > 1.
__device__ __forceinline__ float team_sum(float v, int num_warps, float* scratch, int team_warp0) {
  v = group_sum<32>(v);
  if (num_warps == 1) return v;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < num_warps; ++w) total += scratch[team_warp0 + w];
  return total;
}

}  // namespace encore::cuda
