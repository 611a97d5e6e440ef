// MXFP8 / NVFP4 quantization and dequantization kernels, bit-exact with the CPU reference
// (src/quant/reference/mx_quant_ref.cpp; the math in include/encore/quant.hpp and docs/quant.md).
//
// Mapping: a "unit" is 8 consecutive elements of a row (bf16/fp16: one 16-byte load; fp32: two).
// Unit u is row u / (K / 8), column 8 * (u % (K / 8)) (FastDiv31, so M * K / 8 < 2^31). MXFP8
// quantization and both dequantizations: a thread per unit; an MXFP8 block of 32 is 4 consecutive
// lanes, its amax a shuffle max over them, every lane computing the (same) scale and the first
// storing it. NVFP4 quantization: a thread per block of 16 (two units), so its scale and the seven
// code bounds are computed once. No shared memory, no atomics except the NVFP4 global amax.
// Elements are handled as fp32 bit patterns: |x| ordering equals the unsigned order of (bits &
// 0x7fffffff), a block is non-finite iff that maximum is >= 0x7f800000 (inf / NaN).
// JIT (docs/jit.md): the two quantization kernels take kUnitsPerRow = K / 8 as a constant (0 in the
//   ahead-of-time kernels: p.units_per_row), so the row / unit split is a constant division; same
//   math. One source, two ways in: mx_quant.cu #includes this file, the build embeds it for NVRTC.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/cuda/fp8_pack.cuh"
#include "common/cuda/vector_io.cuh"
#include "core/fast_div.hpp"
#include "quant/fp8_scale.hpp"

namespace encore::cuda {

struct MxParams {
  const void* x;      // quant: input; dequant: output (T)
  int64_t x_stride;   // elements
  uint8_t* q;         // e4m3 bytes or e2m1 pairs
  int64_t q_stride;   // bytes
  uint8_t* scales;    // e8m0 / e4m3 bytes
  int64_t scale_stride;
  uint32_t units;           // M * K / 8
  uint32_t units_per_row;   // K / 8
  FastDiv31 row_of_unit;    // u / units_per_row
  uint32_t scale_cols;      // K / block
  bool swizzled;
  bool rceil;               // MXFP8
  const float* global_in;   // NVFP4: the global scale on the device (computed), or null: global_value
  float global_value;       // NVFP4: the caller's global scale
  float* global_out;        // NVFP4 quant with a given scale: written once by thread 0
};

// Row and unit-in-row of unit u: by the constant kUnitsPerRow (JIT), or p.units_per_row by multiply-shift.
template <int kUnitsPerRow>
__device__ __forceinline__ void mx_split_unit(const MxParams& p, uint32_t u, uint32_t& row, uint32_t& cu) {
  const uint32_t per_row = kUnitsPerRow ? uint32_t(kUnitsPerRow) : p.units_per_row;
  row = kUnitsPerRow ? u / per_row : p.row_of_unit.div(u);
  cu = u - row * per_row;
}

__device__ __forceinline__ int64_t mx_scale_offset(const MxParams& p, int64_t row, int64_t col) {
  return p.swizzled ? quant::mx_swizzled_offset(row, col, p.scale_cols) : row * p.scale_stride + col;
}

// 8 consecutive 16-bit elements (one 16-byte word group) as fp32 bit patterns (conversions exact).
template <typename T>
__device__ __forceinline__ void unit_bits16(const uint4& a, uint32_t (&b)[8]) {
  const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      b[2 * i] = w[i] << 16;
      b[2 * i + 1] = w[i] & 0xffff0000u;
    } else {
      __half2 h;
      *reinterpret_cast<uint32_t*>(&h) = w[i];
      const float2 f = __half22float2(h);
      b[2 * i] = __float_as_uint(f.x);
      b[2 * i + 1] = __float_as_uint(f.y);
    }
  }
}

// 8 consecutive elements as fp32 bit patterns, by streaming loads (fp32: 32 bytes, one 256-bit load
// on sm_100+ where 32-byte aligned, else two 128-bit ones; bf16 / fp16: one 128-bit load).
template <typename T>
__device__ __forceinline__ void load_unit_bits(const T* src, uint32_t (&b)[8]) {
  if constexpr (std::is_same_v<T, float>) {
    const Bits256 v = load_global_32_once(src);
    b[0] = v.lo.x, b[1] = v.lo.y, b[2] = v.lo.z, b[3] = v.lo.w, b[4] = v.hi.x, b[5] = v.hi.y, b[6] = v.hi.z, b[7] = v.hi.w;
  } else {
    unit_bits16<T>(__ldcs(reinterpret_cast<const uint4*>(src)), b);
  }
}

// Two consecutive units (16 elements: an NVFP4 block): bf16 / fp16 as one 32-byte access.
template <typename T>
__device__ __forceinline__ void load_block16_bits(const T* src, uint32_t (&b0)[8], uint32_t (&b1)[8]) {
  if constexpr (std::is_same_v<T, float>) {
    load_unit_bits(src, b0);
    load_unit_bits(src + 8, b1);
  } else {
    const Bits256 v = load_global_32_once(src);
    unit_bits16<T>(v.lo, b0);
    unit_bits16<T>(v.hi, b1);
  }
}

__device__ __forceinline__ uint32_t abs_max_bits(const uint32_t (&b)[8]) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = max(m, b[i] & 0x7fffffffu);
  return m;
}

// e4m3 byte to fp32, as encore::e4m3_to_float (0x7f / 0xff: the CPU's NaN, 0x7fc00000).
__device__ __forceinline__ float mx_e4m3_decode(uint32_t b) {
  if ((b & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u);
  const uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
  const float mag = e == 0 ? float(m) * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
  return __uint_as_float(__float_as_uint(mag) | ((b & 0x80u) << 24));
}

// e8m0 byte to fp32: 2^(b - 127) (b = 0: the subnormal 2^-127), 0xff NaN (0x7fc00000).
__device__ __forceinline__ float mx_e8m0_decode(uint32_t b) {
  if (b == 0xffu) return __uint_as_float(0x7fc00000u);
  return b == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(b << 23);
}

__device__ __forceinline__ uint32_t f32_rd_bits(double v) {
  float f;
  asm("cvt.rm.f32.f64 %0, %1;" : "=f"(f) : "d"(v));
  return __float_as_uint(f);
}
__device__ __forceinline__ uint32_t f32_ru_bits(double v) {
  float f;
  asm("cvt.rp.f32.f64 %0, %1;" : "=f"(f) : "d"(v));
  return __float_as_uint(f);
}

// NVFP4 element code without the division: the CPU computes a = fl32(|x| / d) and compares it with
// the e2m1 midpoints 0.25 (<=), 0.75 (<), 1.25 (<=), 1.75 (<), 2.5 (<=), 3.5 (<), 5 (<=). Since
// rounding is monotonic and every midpoint has an even last mantissa bit, fl32(z) > t iff
// z > t + ulp(t) / 2 and fl32(z) >= t iff z >= t - ulp(t-) / 2 (z = |x| / d exactly). With T that
// bound, z > T iff |x| > T d iff |x| > RD32(T d), and z >= T iff |x| >= RU32(T d). So per block 7
// fp32 bounds k[i] (as bit patterns, the ">=" ones minus 1) and per element the magnitude code
// m = #{i : bits(|x|) > k[i]}. T = t + delta (t the midpoint, delta = +-2^-22 .. 2^-26), so T d is
// one fused multiply-add t * d + delta * d rounded once (RD / RU), exact when delta * d is (d >=
// 2^-100: normal); below that the product in fp64 (exact: 25 + 24 significant bits). d is finite and
// positive (d ~ amax / 6 <= FLT_MAX / 6 since g is finite; d = 0 skips the codes). The bounds are
// non-decreasing (T d increasing, RD(a) < RU(b) - 1 ulp + 1 ulp for a < b), so the count is a
// 3-level search.
struct E2m1Bounds {
  uint32_t k[7];
};
__device__ __forceinline__ E2m1Bounds e2m1_bounds(float d) {
  E2m1Bounds r;
  if (d >= 0x1p-100f) {
    r.k[0] = __float_as_uint(__fmaf_rd(0.25f, d, d * 0x1p-26f));
    r.k[1] = __float_as_uint(__fmaf_ru(0.75f, d, -(d * 0x1p-25f))) - 1u;
    r.k[2] = __float_as_uint(__fmaf_rd(1.25f, d, d * 0x1p-24f));
    r.k[3] = __float_as_uint(__fmaf_ru(1.75f, d, -(d * 0x1p-24f))) - 1u;
    r.k[4] = __float_as_uint(__fmaf_rd(2.5f, d, d * 0x1p-23f));
    r.k[5] = __float_as_uint(__fmaf_ru(3.5f, d, -(d * 0x1p-23f))) - 1u;
    r.k[6] = __float_as_uint(__fmaf_rd(5.0f, d, d * 0x1p-22f));
    return r;
  }
  const double dd = double(d);
  r.k[0] = f32_rd_bits((0.25 + 0x1p-26) * dd);
  r.k[1] = f32_ru_bits((0.75 - 0x1p-25) * dd) - 1u;
  r.k[2] = f32_rd_bits((1.25 + 0x1p-24) * dd);
  r.k[3] = f32_ru_bits((1.75 - 0x1p-24) * dd) - 1u;
  r.k[4] = f32_rd_bits((2.5 + 0x1p-23) * dd);
  r.k[5] = f32_ru_bits((3.5 - 0x1p-23) * dd) - 1u;
  r.k[6] = f32_rd_bits((5.0 + 0x1p-22) * dd);
  return r;
}
__device__ __forceinline__ uint32_t e2m1_code(uint32_t bits, const E2m1Bounds& k) {
  const uint32_t a = bits & 0x7fffffffu;
  const bool h = a > k.k[3];
  const bool s1 = a > (h ? k.k[5] : k.k[1]);
  const bool s2 = a > (h ? (s1 ? k.k[6] : k.k[4]) : (s1 ? k.k[2] : k.k[0]));
  return (h ? 4u : 0u) | (s1 ? 2u : 0u) | (s2 ? 1u : 0u) | ((bits >> 28) & 0x8u);
}

// ---- MXFP8 quantization: x [M, K] T -> q [M, K] e4m3, e8m0 scales per 32. ----
// e = mxfp8_floor_exponent / mxfp8_rceil_exponent(amax) (fp8_scale.hpp, shared with the CPU);
// q = e4m3_rn_satfinite(x * 2^-e) (2^-e a normal fp32 for e in [-127, 119], the product rounded
// once, as the CPU's ldexp in fp64 then fp32). Non-finite block: scale 0xff, q 0x7f.
template <typename T, int kUnitsPerRow = 0>
__global__ void __launch_bounds__(256) mxfp8_quant_kernel(MxParams p) {
  const uint32_t u = blockIdx.x * blockDim.x + threadIdx.x;
  const bool valid = u < p.units;  // the invalid lanes are whole blocks of 4; they join the shuffles
  const uint32_t uu = valid ? u : 0;
  uint32_t row, cu;
  mx_split_unit<kUnitsPerRow>(p, uu, row, cu);
  uint32_t b[8];
  load_unit_bits(static_cast<const T*>(p.x) + int64_t(row) * p.x_stride + cu * 8, b);
  uint32_t amax = abs_max_bits(b);
  amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  if (!valid) return;
  uint32_t w0 = 0x7f7f7f7fu, w1 = 0x7f7f7f7fu, sbyte = quant::kE8m0Nan;
  if (amax < 0x7f800000u) {
    const float a = __uint_as_float(amax);
    const int e = p.rceil ? quant::mxfp8_rceil_exponent(a) : quant::mxfp8_floor_exponent(a);
    sbyte = uint32_t(e + quant::kE8m0Bias);
    const float f = __uint_as_float(uint32_t(quant::kE8m0Bias - e) << 23);  // 2^-e
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(__uint_as_float(b[i]), f);
    w0 = e4m3x4(v[0], v[1], v[2], v[3]);
    w1 = e4m3x4(v[4], v[5], v[6], v[7]);
  }
  *reinterpret_cast<uint2*>(p.q + int64_t(row) * p.q_stride + cu * 8) = make_uint2(w0, w1);
  if ((cu & 3u) == 0) p.scales[mx_scale_offset(p, row, cu >> 2)] = uint8_t(sbyte);
}

// ---- NVFP4 global amax: max |x| over the finite elements into *amax_bits (zeroed before). ----
// Grid-stride, four units in flight per thread (their loads issued before any is used).
template <typename T>
__device__ __forceinline__ void nvfp4_amax_unit(const MxParams& p, uint32_t u, uint32_t (&b)[8]) {
  const uint32_t row = p.row_of_unit.div(u), cu = u - row * p.units_per_row;
  load_unit_bits(static_cast<const T*>(p.x) + int64_t(row) * p.x_stride + cu * 8, b);
}
__device__ __forceinline__ uint32_t finite_abs_max(uint32_t m, const uint32_t (&b)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t a = b[i] & 0x7fffffffu;
    if (a < 0x7f800000u) m = max(m, a);
  }
  return m;
}
template <typename T>
__global__ void __launch_bounds__(256) nvfp4_amax_kernel(MxParams p, unsigned int* amax_bits) {
  constexpr int kInFlight = 4;
  const uint32_t stride = gridDim.x * blockDim.x;  // units < 2^31 and stride <= 2^19: u + 4 stride fits
  uint32_t m = 0, u = blockIdx.x * blockDim.x + threadIdx.x;
  for (; u + (kInFlight - 1) * stride < p.units; u += kInFlight * stride) {
    uint32_t b[kInFlight][8];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) nvfp4_amax_unit<T>(p, u + i * stride, b[i]);
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) m = finite_abs_max(m, b[i]);
  }
  for (; u < p.units; u += stride) {
    uint32_t b[8];
    nvfp4_amax_unit<T>(p, u, b);
    m = finite_abs_max(m, b);
  }
  m = __reduce_max_sync(0xffffffffu, m);
  if ((threadIdx.x & 31) == 0 && m != 0) atomicMax(amax_bits, m);
}

// global = amax / 2688 (fp32), 1 where that is 0; in place over the amax bits.
__global__ void nvfp4_global_kernel(float* global) {
  const float g = __fdiv_rn(*global, quant::kE2m1Max * quant::kE4m3Max);
  *global = g > 0.0f ? g : 1.0f;
}

// ---- NVFP4 quantization: x [M, K] T -> q [M, K / 2] e2m1 pairs, e4m3 scales per 16. ----
// One thread per block of 16 (units 2t and 2t + 1 of a row: K % 16 == 0, so kUnitsPerRow is even).
// s = e4m3_rn_satfinite(fl32(fl32(amax / 6) / g)); d = fl32(float(s) * g); codes by e2m1_bounds(d)
// (0 where d is 0); element 2j in the low nibble of byte j. Non-finite block: s = 0x7f, codes 0.
// bf16 / fp16: the elements stay two to a 32-bit word. |x| > k (k a bound, fp32) iff |x| > k16,
// k16 = k rounded down to T (bf16: k's top 16 bits; fp16: cvt.rm), exact for any k since |x| is a T
// value; so each word's two codes come from packed compares (HSET2, a 0xffff mask a half) and LOP3
// muxes of the packed bounds (the 3-level search), the amax from packed 16-bit maxima. bf16 with
// d < 2^-100 (bounds that may be subnormal) takes the fp32 path instead.

// The block's scale byte and decoded scale d (0: non-finite block or a zero scale; *sbyte 0x7f for
// a non-finite block) from the block's max |x| as fp32 bits.
__device__ __forceinline__ float nvfp4_block_scale(uint32_t amax, float g, uint32_t* sbyte) {
  *sbyte = 0x7fu;
  if (amax >= 0x7f800000u) return 0.0f;
  const float t = __fdiv_rn(__fdiv_rn(__uint_as_float(amax), quant::kE2m1Max), g);
  *sbyte = e4m3x4(t, 0.f, 0.f, 0.f) & 0xffu;
  return __fmul_rn(mx_e4m3_decode(*sbyte), g);
}

// 8 codes of 8 elements given as fp32 bit patterns, element i in nibble i.
__device__ __forceinline__ uint32_t e2m1_word(const uint32_t (&b)[8], const E2m1Bounds& k) {
  uint32_t w = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) w |= e2m1_code(b[i], k) << (4 * i);
  return w;
}

// Packed 16-bit lanes: per lane 0xffff where a > b (T's ordering; both non-negative, not NaN).
template <typename T>
__device__ __forceinline__ uint32_t gt_mask2(uint32_t a, uint32_t b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 x, y;
    *reinterpret_cast<uint32_t*>(&x) = a, *reinterpret_cast<uint32_t*>(&y) = b;
    return __hgt2_mask(x, y);
  } else {
    __half2 x, y;
    *reinterpret_cast<uint32_t*>(&x) = a, *reinterpret_cast<uint32_t*>(&y) = b;
    return __hgt2_mask(x, y);
  }
}
__device__ __forceinline__ uint32_t mux(uint32_t m, uint32_t a, uint32_t b) { return (m & a) | (~m & b); }

// The two codes of word w (elements in its low and high halves) in bits 0-3 and 16-19.
template <typename T>
__device__ __forceinline__ uint32_t e2m1_code2(uint32_t w, const uint32_t (&k)[7]) {
  const uint32_t a = w & 0x7fff7fffu;
  const uint32_t h = gt_mask2<T>(a, k[3]);
  const uint32_t s1 = gt_mask2<T>(a, mux(h, k[5], k[1]));
  const uint32_t s2 = gt_mask2<T>(a, mux(h, mux(s1, k[6], k[4]), mux(s1, k[2], k[0])));
  return (h & 0x00040004u) | (s1 & 0x00020002u) | (s2 & 0x00010001u) | ((w >> 12) & 0x00080008u);
}

// Codes of 8 elements in 4 words (word j: elements 2j, 2j + 1) as one 32-bit word, element i in nibble i.
template <typename T>
__device__ __forceinline__ uint32_t e2m1_word2(const uint32_t* w, const uint32_t (&k)[7]) {
  uint32_t c[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t x = e2m1_code2<T>(w[j], k);
    c[j] = x | (x >> 12);  // byte 0: the low code in bits 0-3, the high one in bits 4-7
  }
  return __byte_perm(__byte_perm(c[0], c[1], 0x0040), __byte_perm(c[2], c[3], 0x0040), 0x5410);
}

template <typename T, int kUnitsPerRow = 0>
__global__ void __launch_bounds__(256) nvfp4_quant_kernel(MxParams p) {
  const uint32_t u = 2 * (blockIdx.x * blockDim.x + threadIdx.x);
  if (u >= p.units) return;
  uint32_t row, cu;
  mx_split_unit<kUnitsPerRow>(p, u, row, cu);
  const T* src = static_cast<const T*>(p.x) + int64_t(row) * p.x_stride + cu * 8;
  const float g = p.global_in ? *p.global_in : p.global_value;
  if (p.global_out && u == 0) *p.global_out = g;
  uint32_t w0 = 0, w1 = 0, sbyte;
  if constexpr (std::is_same_v<T, float>) {
    uint32_t b0[8], b1[8];
    load_block16_bits(src, b0, b1);
    const float d = nvfp4_block_scale(max(abs_max_bits(b0), abs_max_bits(b1)), g, &sbyte);
    if (d > 0.0f) {
      const E2m1Bounds k = e2m1_bounds(d);
      w0 = e2m1_word(b0, k);
      w1 = e2m1_word(b1, k);
    }
  } else {
    const Bits256 v = load_global_32_once(src);
    const uint32_t w[8] = {v.lo.x, v.lo.y, v.lo.z, v.lo.w, v.hi.x, v.hi.y, v.hi.z, v.hi.w};
    uint32_t m = __vmaxu2(__vmaxu2(__vmaxu2(w[0] & 0x7fff7fffu, w[1] & 0x7fff7fffu), __vmaxu2(w[2] & 0x7fff7fffu, w[3] & 0x7fff7fffu)),
                          __vmaxu2(__vmaxu2(w[4] & 0x7fff7fffu, w[5] & 0x7fff7fffu), __vmaxu2(w[6] & 0x7fff7fffu, w[7] & 0x7fff7fffu)));
    m = max(m & 0xffffu, m >> 16);  // the block's max |x| as a T bit pattern
    uint32_t amax;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) amax = m << 16;
    else amax = __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(m))));
    const float d = nvfp4_block_scale(amax, g, &sbyte);
    if (d > 0.0f) {
      const E2m1Bounds kb = e2m1_bounds(d);
      if (std::is_same_v<T, __nv_bfloat16> && !(d >= 0x1p-100f)) {
        uint32_t b0[8], b1[8];
        unit_bits16<T>(v.lo, b0);
        unit_bits16<T>(v.hi, b1);
        w0 = e2m1_word(b0, kb);
        w1 = e2m1_word(b1, kb);
      } else {
        uint32_t k[7];
#pragma unroll
        for (int i = 0; i < 7; ++i) {
          uint32_t k16;
          if constexpr (std::is_same_v<T, __nv_bfloat16>) k16 = kb.k[i] >> 16;
          else k16 = __half_as_ushort(__float2half_rd(__uint_as_float(kb.k[i])));
          k[i] = k16 * 0x10001u;
        }
        w0 = e2m1_word2<T>(w, k);
        w1 = e2m1_word2<T>(w + 4, k);
      }
    }
  }
  uint8_t* dst = p.q + int64_t(row) * p.q_stride + cu * 4;  // 4-byte aligned (validate_cuda), mostly 8
  if ((reinterpret_cast<size_t>(dst) & 7u) == 0) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w0, w1);
  } else {
    reinterpret_cast<uint32_t*>(dst)[0] = w0;
    reinterpret_cast<uint32_t*>(dst)[1] = w1;
  }
  p.scales[mx_scale_offset(p, row, cu >> 1)] = uint8_t(sbyte);
}

// ---- Swizzled layout: zero the padding (rows M..pad128(M), and columns K/block..pad4) ----
__global__ void mx_zero_padding_kernel(uint8_t* scales, int64_t rows, int64_t scale_cols) {
  const int64_t prows = quant::mx_padded_rows(rows), pcols = quant::mx_padded_scale_cols(scale_cols);
  const int64_t extra_cols = pcols - scale_cols, n_a = (prows - rows) * pcols, n = n_a + rows * extra_cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t r, c;
    if (i < n_a) {
      r = rows + i / pcols;
      c = i % pcols;
    } else {
      r = (i - n_a) / extra_cols;
      c = scale_cols + (i - n_a) % extra_cols;
    }
    scales[quant::mx_swizzled_offset(r, c, scale_cols)] = 0;
  }
}

// ---- Dequantization: x [M, K] fp32 or bf16 (the CPU's NaN: 0x7fc00000 / 0x7fc0). ----
// MXFP8 x = fl32(e4m3(q) * 2^(s - 127)); NVFP4 x = fl32(fl32(e2m1(q) * e4m3(s)) * g).
template <typename O>
__device__ __forceinline__ void store_unit(O* dst, const float (&v)[8]) {
  if constexpr (std::is_same_v<O, float>) {
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = v[i] != v[i] ? 0x7fc00000u : __float_as_uint(v[i]);
    store_global_32_once(dst, Bits256{make_uint4(w[0], w[1], w[2], w[3]), make_uint4(w[4], w[5], w[6], w[7])});
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t lo = v[2 * i] != v[2 * i] ? 0x7fc0u : __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i]));
      const uint32_t hi = v[2 * i + 1] != v[2 * i + 1] ? 0x7fc0u : __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i + 1]));
      w[i] = lo | (hi << 16);
    }
    __stcs(reinterpret_cast<uint4*>(dst), make_uint4(w[0], w[1], w[2], w[3]));
  }
}

template <typename O, bool kNvfp4>
__global__ void __launch_bounds__(256) mx_dequant_kernel(MxParams p) {
  const uint32_t u = blockIdx.x * blockDim.x + threadIdx.x;
  if (u >= p.units) return;
  const uint32_t row = p.row_of_unit.div(u), cu = u - row * p.units_per_row;
  float v[8];
  if constexpr (kNvfp4) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p.q + int64_t(row) * p.q_stride + cu * 4);
    const float s = mx_e4m3_decode(p.scales[mx_scale_offset(p, row, cu >> 1)]);
    const float g = *p.global_in;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(__fmul_rn(quant::e2m1_code_to_float(uint8_t((w >> (4 * i)) & 0xfu)), s), g);
  } else {
    const uint2 w = *reinterpret_cast<const uint2*>(p.q + int64_t(row) * p.q_stride + cu * 8);
    const float s = mx_e8m0_decode(p.scales[mx_scale_offset(p, row, cu >> 2)]);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(mx_e4m3_decode(((i < 4 ? w.x : w.y) >> (8 * (i % 4))) & 0xffu), s);
  }
  store_unit(static_cast<O*>(const_cast<void*>(p.x)) + int64_t(row) * p.x_stride + cu * 8, v);
}

}  // namespace encore::cuda
