// FP8 e4m3 per-token-group quantization, streaming variant for large inputs (same math, shapes and
// constraints as fp8_group_quant_kernel.cuh).
//
// Mapping: a persistent grid of 256-thread blocks. The flat group sequence g = m * (K / 128) + group
//   is cut into stages of kStageGroups consecutive groups (kGroupsPerLaneGroup per lane group);
//   block b takes stages b, b + grid, b + 2 grid, ... The x bytes of a stage arrive in a shared
//   memory slot by bulk copies (cp.async.bulk, one per row the stage touches, issued by warp 0's
//   lanes) counted on the slot's mbarrier; `slots` stages are in flight per block. Each lane group
//   (kLanes lanes, one 16-byte pack each) reads its groups from shared memory, takes the butterfly
//   amax, and stores q (one 8-byte pack per lane for bf16) and the scale straight to global memory.
//   After a stage, one __syncthreads frees the slot and warp 0 refills it with the stage
//   `slots * grid` further on. Why: each block keeps slots * kStageBytes of loads in flight with a
//   handful of instructions, and the grid never turns over (no block launch ramp or tail waves).
// Dynamic shared memory: slots * kStageBytes + 8 * slots bytes.
#pragma once
#include <cuda_fp8.h>

#include <cstdint>

#include "cuda/common/bulk_copy.cuh"
#include "cuda/quant/fp8_group_quant_kernel.cuh"

namespace encore::cuda {

template <typename T, int kGroupsPerLaneGroup>
struct Fp8BulkShape {
  static constexpr int kThreads = 256;
  static constexpr int kVec = 16 / int(sizeof(T));
  static constexpr int kLanes = kFp8GroupSize / kVec;
  static constexpr int kLaneGroups = kThreads / kLanes;
  static constexpr int kStageGroups = kLaneGroups * kGroupsPerLaneGroup;
  static constexpr int kGroupBytes = kFp8GroupSize * int(sizeof(T));
  static constexpr int kStageBytes = kStageGroups * kGroupBytes;
  static int smem_bytes(int slots) { return slots * (kStageBytes + 8); }
};

template <typename T, int kGroupsPerLaneGroup>
__global__ void __launch_bounds__(256) fp8_group_quant_bulk_kernel(Fp8QuantParams<T> p, int slots) {
  using S = Fp8BulkShape<T, kGroupsPerLaneGroup>;
  using P = Pack<T, S::kVec>;
  using Q = Pack<uint8_t, S::kVec>;
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + slots * S::kStageBytes);
  const uint32_t num_stages = (p.num_groups + S::kStageGroups - 1) / S::kStageGroups;
  const int lane32 = threadIdx.x % 32;
  const bool producer = threadIdx.x < 32;
  if (threadIdx.x == 0)
    for (int s = 0; s < slots; ++s) mbar_init(&full[s]);
  __syncthreads();

  // Warp 0: the x bytes of `stage` into slot `slot`, one bulk copy per row piece.
  auto issue = [&](uint32_t stage, int slot) {
    const uint32_t g0 = stage * S::kStageGroups;
    const uint32_t g1 = min(g0 + uint32_t(S::kStageGroups), p.num_groups);
    if (lane32 == 0) mbar_expect(&full[slot], (g1 - g0) * S::kGroupBytes);
    __syncwarp();
    const uint32_t m_last = (g1 - 1) / p.groups_per_row;
    for (uint32_t m = g0 / p.groups_per_row + lane32; m <= m_last; m += 32) {
      const uint32_t a = max(g0, m * p.groups_per_row), b = min(g1, (m + 1) * p.groups_per_row);
      bulk_copy(smem + slot * S::kStageBytes + (a - g0) * S::kGroupBytes,
                p.x + int64_t(m) * p.x_stride + int64_t(a - m * p.groups_per_row) * kFp8GroupSize, (b - a) * S::kGroupBytes,
                &full[slot]);
    }
  };
  if (producer)
    for (int s = 0; s < slots; ++s) {
      const uint32_t stage = blockIdx.x + uint32_t(s) * gridDim.x;
      if (stage < num_stages) issue(stage, s);
    }

  const int lane_group = threadIdx.x / S::kLanes, lane = threadIdx.x % S::kLanes;
  int slot = 0;
  unsigned phase = 0;
  for (uint32_t stage = blockIdx.x; stage < num_stages; stage += gridDim.x) {
    mbar_wait(&full[slot], phase);
    const unsigned char* base = smem + slot * S::kStageBytes;
    P v[kGroupsPerLaneGroup];
#pragma unroll
    for (int j = 0; j < kGroupsPerLaneGroup; ++j)
      v[j] = *reinterpret_cast<const P*>(base + (lane_group + j * S::kLaneGroups) * S::kGroupBytes + lane * 16);
    const uint32_t g0 = stage * S::kStageGroups;
#pragma unroll
    for (int j = 0; j < kGroupsPerLaneGroup; ++j) {
      const uint32_t g = g0 + lane_group + j * S::kLaneGroups;
      const bool valid = g < p.num_groups;
      Q out;
      const float s = quantize_pack<T, S::kVec, S::kLanes>(v[j], valid, p.power_of_two, p.eps, out);  // all lanes
      if (!valid) continue;
      const uint32_t m = g / p.groups_per_row, gi = g - m * p.groups_per_row;
      store_pack(p.q + int64_t(m) * p.q_stride + gi * kFp8GroupSize + lane * S::kVec, out);
      if (lane == 0) p.scales[int64_t(m) * p.scale_stride_m + int64_t(gi) * p.scale_stride_g] = s;
    }
    __syncthreads();  // every lane has read the slot
    if (producer) {
      const uint32_t next = stage + uint32_t(slots) * gridDim.x;
      if (next < num_stages) issue(next, slot);
    }
    if (++slot == slots) {
      slot = 0;
      phase ^= 1;
    }
  }
}

}  // namespace encore::cuda
