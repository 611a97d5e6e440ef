// MoE dispatch's gather with the FP8 1x128 quantization fused in (MoeDispatchArgs::x_scales):
//   row r < offsets[E] of the permuted buffer takes token t = row_slots[r] / k (a zero row for padding),
//   per group g of 128 columns: s = fp8_group_scale(max |x[t, g]|), q[r, g] = e4m3_rn_satfinite(x * (1 / s)),
//   scales[r, g] = s: bit for bit fp8_group_quant on the unquantized permuted rows (the same lane-team
//   arithmetic, common/cuda/fp8_pack.cuh).
// Shapes: x [T, D] T in {bf16, fp16, fp32}; q [R, D] e4m3; scales [R, D / 128] fp32 (row stride any);
//   D % 128 == 0; x and q rows 16-byte aligned (validated).
// Mapping: a 16-byte pack per lane, a group owned by kLanes = 128 / (16 / sizeof(T)) lanes (16 for
//   bf16 / fp16: two groups per warp; 32 for fp32); a warp's work item is (row, kUnroll x its groups),
//   every load of an item issued before its stores; one warp-wide butterfly per group (the team's
//   lanes only exchange with each other). Launched as a programmatic dependent of the map kernel, as
//   the plain gather (dispatch_kernel.cuh), whose decode-path duty it shares: row_slots[offsets[E], R) = -1.
// Ahead-of-time only (dispatch.cu).
#pragma once
#include <cstdint>

#include "common/cuda/fp8_pack.cuh"
#include "moe/cuda/dispatch_kernel.cuh"

namespace encore::cuda {

struct DispatchFp8Params {
  DispatchParams d;  // the maps (offsets, row_slots, k, E, rows, fill_tail)
  const void* x;
  int64_t x_stride;  // elements
  uint8_t* q;
  int64_t q_stride;  // bytes
  float* scales;
  int64_t scales_stride;
  int groups_per_row;  // D / 128
  bool power_of_two;
  float eps;
};

template <typename T, int kUnroll>
__global__ void __launch_bounds__(kDispatchThreads, moe::kDispatchGatherBlocksPerSm) dispatch_gather_fp8_kernel(DispatchFp8Params p) {
  constexpr int kElems = 16 / int(sizeof(T));
  constexpr int kLanes = 128 / kElems;
  constexpr int kTeams = 32 / kLanes;  // groups per warp and unroll step
  using P = Pack<T, kElems>;
  static_assert(sizeof(P) == 16, "one 16-byte pack per lane");
  wait_for_primary();
  const int total = p.d.offsets[p.d.E];
  if (p.d.fill_tail) {
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    for (int64_t r = int64_t(total) + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < p.d.rows; r += stride) p.d.row_slots[r] = -1;
  }
  const int lane = int(threadIdx.x) & 31, team = lane / kLanes, tl = lane % kLanes;
  const unsigned per_row = unsigned((p.groups_per_row + kTeams * kUnroll - 1) / (kTeams * kUnroll));
  const unsigned items = unsigned(total) * per_row;
  const unsigned warps = gridDim.x * (blockDim.x >> 5);
  const T* x = static_cast<const T*>(p.x);
  for (unsigned it = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
    const unsigned r = it / per_row;
    const int g0 = int(it - r * per_row) * kTeams * kUnroll + team;
    const int32_t slot = p.d.row_slots[r];
    const T* src = slot >= 0 ? x + int64_t(unsigned(slot) / unsigned(p.d.k)) * p.x_stride : nullptr;
    P v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int g = g0 + u * kTeams;
      if (src && g < p.groups_per_row) v[u] = load_span_once<T, kElems>(src + g * 128 + tl * kElems);
      else *reinterpret_cast<uint4*>(&v[u]) = make_uint4(0u, 0u, 0u, 0u);  // padding rows quantize a zero row
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int g = g0 + u * kTeams;
      const bool valid = g < p.groups_per_row;
      uint32_t words[kElems / 4];
      const float s = quantize_pack<T, kElems, kLanes>(v[u], valid, p.power_of_two, p.eps, words);  // every lane
      if (!valid) continue;
      store_words<kElems>(p.q + int64_t(r) * p.q_stride + g * 128 + tl * kElems, words);
      if (tl == 0) p.scales[int64_t(r) * p.scales_stride + g] = s;
    }
  }
}

}  // namespace encore::cuda
