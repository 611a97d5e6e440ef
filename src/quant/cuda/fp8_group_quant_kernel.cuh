// FP8 e4m3 per-token-group quantization (groups of 128 along the row).
//
// Math:   s = fp8_group_scale(max |x[m, group]|);  q = e4m3_rn_satfinite(x * (1 / s));  scales[m, g] = s.
// Shapes: x [M, K] T in {bf16, fp16, fp32} (row stride multiple of 16 bytes); q [M, K] e4m3 (row
//         stride multiple of 16); scales fp32 at m * stride_m + g * stride_g (row- or column-major).
// Mapping: a group of 128 elements is owned by kLanes = 128 / (16 / sizeof(T) * kPacksPerLane)
//   lanes (bf16/fp16: 16 with one 16-byte pack per lane, 8 with two; fp32: 32, 16), each lane
//   kPacksPerLane consecutive packs; amax is a butterfly max over the lanes; each lane writes its
//   fp8 bytes with one store, the group's first lane the scale. kGroupsPerThread
//   consecutive groups per lane group are loaded before any is written (memory-level parallelism),
//   in a grid-stride loop over chunks of groups. Groups are numbered by tiles of R = 2^tile_rows_log2
//   rows: g = (tile * (K / 128) + group) * R + row in tile (tile by multiply and shift); R = 1 is row
//   order (row-major scales: a block's scales are contiguous), R = 16 puts 16 consecutive rows of one
//   group column side by side (column-major scales: a block writes 64 contiguous bytes of scales
//   instead of one 4-byte piece per 32-byte sector). Rows past M in the last tile are skipped.
//   The instruction count per byte is what bounds it at 4096 x 7168 (docs/quant.md): packed
//   abs/max, bit-level bf16 unpacking and cvt-merged e4m3 words keep it at ~95 per group.
// JIT (docs/jit.md): kGroupsPerRow = K / 128 baked in (0 in the ahead-of-time kernels: read from
//   the params), so the tile / group split is a shift and a division by a constant; same math.
//   One source, two ways in: fp8_group_quant.cu #includes this file, the build embeds it for NVRTC
//   (cmake/EncoreJitSources.cmake; the host headers are stand-ins there, jit/family.cpp).
// sm_100+ (vector_io.cuh's load_span_once): a lane's two packs (32 bytes) are one 256-bit load when
//   32-byte aligned; the sm_90 code is unchanged.
// Constraints (validate): K % 128 == 0, M * K / 128 < 2^31, 16-byte aligned x and q rows.
#pragma once
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "core/fast_div.hpp"
#include "common/cuda/fp8_pack.cuh"
#include "common/cuda/reduce.cuh"
#include "common/cuda/vector_io.cuh"
#include "quant/fp8_scale.hpp"
#include "quant/problem.hpp"

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
  uint32_t rows;            // M
  uint32_t tile_rows_log2;  // R = 2^tile_rows_log2 rows per tile of the group numbering
  FastDiv31 tile_of_group;  // g / (R * groups_per_row) by multiply and shift
  uint32_t num_groups;      // ceil(M / R) * R * groups_per_row (includes the skipped rows past M)
  bool power_of_two;
  float eps;
};

using quant::kFp8GroupSize;

// kN consecutive elements (a multiple of one 16-byte pack) by streaming loads: 16-byte ones, or
// 32-byte ones on sm_100+ where the lane's span is 32-byte aligned (vector_io.cuh).
template <typename T, int kN>
__device__ __forceinline__ Pack<T, kN> load_lane(const T* p) {
  return load_span_once<T, kN>(p);
}

// kPacksPerLane: each lane owns kPacksPerLane consecutive 16-byte packs of a group (so a group is
// 128 / (kVec kPacksPerLane) lanes: 16 or 8 for bf16), loads them with 16-byte loads and writes its
// e4m3 bytes with one store (16 bytes for bf16 with two packs): fewer shuffles and stores per byte.
// kTiled: false = row order (tile_rows_log2 taken as 0, the index math folds to the row-order one).
// kGroupsPerRow: K / 128 as a constant (JIT), or 0 (p.groups_per_row).
template <typename T, int kGroupsPerThread, int kPacksPerLane, bool kTiled, int kGroupsPerRow = 0>
__global__ void __launch_bounds__(512) fp8_group_quant_kernel(Fp8QuantParams<T> p) {
  constexpr int kElems = 16 / int(sizeof(T)) * kPacksPerLane;  // elements per lane and group
  constexpr int kLanes = kFp8GroupSize / kElems;
  using P = Pack<T, kElems>;
  const int lane = threadIdx.x % kLanes;
  const uint32_t groups_in_grid = gridDim.x * (blockDim.x / kLanes);
  const uint32_t group0 = blockIdx.x * (blockDim.x / kLanes) + threadIdx.x / kLanes;
  const uint32_t num_chunks = (p.num_groups + kGroupsPerThread - 1) / kGroupsPerThread;
  const uint32_t groups_per_row = kGroupsPerRow ? uint32_t(kGroupsPerRow) : p.groups_per_row;

  for (uint32_t chunk = group0; chunk < num_chunks; chunk += groups_in_grid) {
    // kGroupsPerThread consecutive groups: one division per chunk, then the group index steps.
    const uint32_t g0 = chunk * kGroupsPerThread;
    const uint32_t log2r = kTiled ? p.tile_rows_log2 : 0;
    // floor(g0 / (R * G)) = floor(floor(g0 / R) / G): with G constant, a shift and a constant division.
    const uint32_t tile = kGroupsPerRow ? (g0 >> log2r) / uint32_t(kGroupsPerRow) : p.tile_of_group.div(g0);
    const uint32_t within = g0 - tile * (groups_per_row << log2r);
    const uint32_t row_mask = (1u << log2r) - 1;
    uint32_t r = within & row_mask;  // row in the tile
    uint32_t gi = within >> log2r;
    uint32_t m = (tile << log2r) + r;
    P v[kGroupsPerThread];
    uint32_t mi[kGroupsPerThread], gii[kGroupsPerThread];
#pragma unroll
    for (int i = 0; i < kGroupsPerThread; ++i) {
      mi[i] = m;
      gii[i] = gi;
      if (g0 + i < p.num_groups && (!kTiled || m < p.rows))
        v[i] = load_lane<T, kElems>(p.x + int64_t(m) * p.x_stride + gi * kFp8GroupSize + lane * kElems);
      // The next group: the next row of the tile, else the tile's first row in the next column.
      if (r++ == row_mask) {
        r = 0;
        m -= row_mask;
        if (++gi == groups_per_row) {
          gi = 0;
          m += row_mask + 1;
        }
      } else {
        ++m;
      }
    }
#pragma unroll
    for (int i = 0; i < kGroupsPerThread; ++i) {
      const bool valid = g0 + i < p.num_groups && (!kTiled || mi[i] < p.rows);
      uint32_t out[kElems / 4];
      const float s = quantize_pack<T, kElems, kLanes>(v[i], valid, p.power_of_two, p.eps, out);  // all lanes
      if (!valid) continue;
      store_words<kElems>(p.q + int64_t(mi[i]) * p.q_stride + gii[i] * kFp8GroupSize + lane * kElems, out);
      if (lane == 0) p.scales[int64_t(mi[i]) * p.scale_stride_m + int64_t(gii[i]) * p.scale_stride_g] = s;
    }
  }
}

}  // namespace encore::cuda
