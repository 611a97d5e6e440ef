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

// |x| maximum over a 16-byte pack, NaN elements ignored (as fmaxf does; 0 when all are NaN). For
// bf16/fp16 on packed pairs (abs and max on x2 registers, maxNum semantics like fmaxf): the max of
// the 16-bit values is exact, so the result equals the fp32 loop's bit for bit, in 7 instructions
// instead of 16 plus the conversions.
template <typename T, int kVec>
__device__ __forceinline__ float pack_absmax(const Pack<T, kVec>& v) {
  if constexpr (sizeof(T) == 4) {
    float m = 0.f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) m = fmaxf(m, fabsf(to_float(v.v[e])));
    return m;
  } else {
    using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
    const T2* p = reinterpret_cast<const T2*>(v.v);
    T2 m = __habs2(p[0]);
#pragma unroll
    for (int i = 1; i < kVec / 2; ++i) m = __hmax2(m, __habs2(p[i]));
    return fmaxf(fmaxf(0.f, to_float(m.x)), to_float(m.y));
  }
}

// Elements 2i and 2i+1 of a pack in fp32 (bf16: two bit operations on the 32-bit word).
template <typename T, int kVec>
__device__ __forceinline__ float2 pack_pair(const Pack<T, kVec>& v, int i) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t w = reinterpret_cast<const uint32_t*>(v.v)[i];
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    return make_float2(to_float(v.v[2 * i]), to_float(v.v[2 * i + 1]));
  }
}

// Four fp32 values to e4m3 (round to nearest even, saturating to +-448), x0 in the lowest byte:
// two cvt.rn.satfinite.e4m3x2.f32 (which put their second operand in the low byte) into 16-bit
// registers joined by one mov, so no masking of the halves.
__device__ __forceinline__ uint32_t e4m3x4(float x0, float x1, float x2, float x3) {
  uint32_t w;
  asm("{\n .reg .b16 lo, hi;\n cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      " mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(w)
      : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  return w;
}

// One lane's share of a group: the amax over the kLanes lanes of its group (every lane of the warp
// must call this: the butterfly uses the full mask), the scale, and the lane's kVec e4m3 bytes in
// `words` (four per 32-bit word, e4m3x4). Returns the scale; `words` is meaningful only when `valid`.
// Instruction count matters here: at 4096 x 7168 the kernel needs about two thirds of the SM's
// issue slots at 85% of the copy bandwidth.
template <typename T, int kVec, int kLanes>
__device__ __forceinline__ float quantize_pack(const Pack<T, kVec>& v, bool valid, bool power_of_two, float eps,
                                               uint32_t (&words)[kVec / 4]) {
  static_assert(kVec % 4 == 0, "a pack holds whole 32-bit words of e4m3 output");
  float amax = valid ? pack_absmax(v) : 0.f;
  amax = group_max<kLanes>(amax);
  const float s = quant::fp8_group_scale(amax, power_of_two, eps);
  const float inv = quant::fp8_inverse_scale(s);
#pragma unroll
  for (int w = 0; w < kVec / 4; ++w) {
    const float2 a = pack_pair(v, 2 * w), b = pack_pair(v, 2 * w + 1);
    words[w] = e4m3x4(__fmul_rn(a.x, inv), __fmul_rn(a.y, inv), __fmul_rn(b.x, inv), __fmul_rn(b.y, inv));
  }
  return s;
}

// kN consecutive elements (a multiple of one 16-byte pack) by streaming loads: 16-byte ones, or
// 32-byte ones on sm_100+ where the lane's span is 32-byte aligned (vector_io.cuh).
template <typename T, int kN>
__device__ __forceinline__ Pack<T, kN> load_lane(const T* p) {
  return load_span_once<T, kN>(p);
}

// kN / 4 words of e4m3 bytes by one 4-, 8- or 16-byte store.
template <int kN>
__device__ __forceinline__ void store_words(uint8_t* dst, const uint32_t (&w)[kN / 4]) {
  if constexpr (kN == 16) *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  else if constexpr (kN == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  else *reinterpret_cast<uint32_t*>(dst) = w[0];
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
