// FP8 e4m3 arithmetic the families share (quant's fp8_group_quant and MX formats, the MoE dispatch's
// fused FP8 quantization): the group scale (amax / 448, optionally a power of two) and its inverse,
// one definition for the CPU references and the CUDA kernels (the JIT embeds this header); on the
// host also the e4m3 conversions (round to nearest even, saturating) and one group's quantization.
#pragma once
#include <cmath>
#include <cstdint>

#include "core/host_device.hpp"

namespace encore {

constexpr float kE4m3Max = 448.0f;  // largest finite e4m3 ("fn": no infinities) value

// amax / 448 (amax floored at eps), or the smallest power of two >= that (exact, via frexp). An
// infinite amax (an infinite input) gives an infinite scale either way (frexp of infinity has no
// defined exponent), so the group's finite values quantize to 0 and the infinity to NaN.
ENCORE_HOST_DEVICE inline float fp8_group_scale(float amax, bool power_of_two, float eps) {
  float s = fmaxf(amax, eps) / kE4m3Max;
  if (power_of_two && s <= 3.40282347e38f) {  // finite
    int e;
    const float f = frexpf(s, &e);  // s = f * 2^e, f in [0.5, 1); s == 2^(e-1) iff f == 0.5
    s = ldexpf(1.0f, f == 0.5f ? e - 1 : e);
  }
  return s;
}

// 1 / s, rounded once (IEEE division); values are quantized as x * (1 / s), exactly x / s when s
// is a power of two. One division per group instead of one per element.
ENCORE_HOST_DEVICE inline float fp8_inverse_scale(float s) { return 1.0f / s; }

#ifndef __CUDACC_RTC__  // host only (the JIT compiles this header for the kernels' formulas)
// e4m3 byte of v: round to nearest even, saturating to +-448; NaN -> 0x7f.
inline uint8_t e4m3_encode(float v) {
  if (std::isnan(v)) return 0x7f;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const float a = std::fabs(v);
  if (a >= kE4m3Max) return sign | 0x7e;  // saturate (finite max 448 = 1.75 * 2^8)
  if (a < 0.015625f) {                    // below 2^-6: subnormals, multiples of 2^-9
    const float m = std::nearbyint(a * 512.0f);  // 8 rounds up into the smallest normal (bits 0x08)
    return sign | uint8_t(m);
  }
  int e;
  const float f = std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  int exponent = e - 1;               // a = (2f) * 2^exponent, 2f in [1, 2)
  int mant = int(std::nearbyint((2.0f * f - 1.0f) * 8.0f));
  if (mant == 8) {
    mant = 0;
    ++exponent;
  }
  const int biased = exponent + 7;
  if (biased > 15 || (biased == 15 && mant == 7)) return sign | 0x7e;
  return sign | uint8_t(biased << 3) | uint8_t(mant);
}

// The value of an e4m3 byte (0x7f / 0xff: NaN).
inline float e4m3_decode(uint8_t b) {
  const int exp = (b >> 3) & 0xf, mant = b & 7;
  if (exp == 15 && mant == 7) return NAN;
  const float mag = exp == 0 ? std::ldexp(float(mant), -9) : std::ldexp(1.0f + float(mant) / 8.0f, exp - 7);
  return (b & 0x80) ? -mag : mag;
}

// One group of n values on the CPU (the references of fp8_group_quant and of the MoE dispatch's fused
// quantization): amax over x(i) (NaN ignored, as fmaxf), s, then store(i, x(i) * (1 / s)) for the
// caller's e4m3 conversion (e4m3_encode); returns s. The CUDA kernels compute the same per lane team
// (common/cuda/fp8_pack.cuh).
template <class Load, class Store>
inline float fp8_quantize_group(int64_t n, Load x, Store store, bool power_of_two, float eps) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = fmaxf(amax, fabsf(x(i)));
  const float s = fp8_group_scale(amax, power_of_two, eps);
  const float inv = fp8_inverse_scale(s);
  for (int64_t i = 0; i < n; ++i) store(i, x(i) * inv);
  return s;
}
#endif

}  // namespace encore
