// FP8 e4m3 group quantization of 16-byte packs held by a team of lanes (fp8_group_quant's kernel,
// quant/cuda/fp8_group_quant_kernel.cuh, and the MoE dispatch's fused FP8 gather,
// moe/cuda/dispatch_fp8_gather.cuh): the pack's |x| max, its elements in fp32, e4m3 conversion of four
// values into one word, and a lane's share of a group (amax over the team, the scale of
// quant/fp8_scale.hpp, the lane's e4m3 bytes). One source, two ways in: the JIT embeds this header.
#pragma once
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "common/cuda/reduce.cuh"
#include "common/cuda/vector_io.cuh"
#include "quant/fp8_scale.hpp"

namespace encore::cuda {

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

// kN / 4 words of e4m3 bytes by one 4-, 8- or 16-byte store.
template <int kN>
__device__ __forceinline__ void store_words(uint8_t* dst, const uint32_t (&w)[kN / 4]) {
  if constexpr (kN == 16) *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  else if constexpr (kN == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  else *reinterpret_cast<uint32_t*>(dst) = w[0];
}

}  // namespace encore::cuda
