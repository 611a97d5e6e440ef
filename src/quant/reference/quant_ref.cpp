#include "quant/reference/quant_ref.hpp"

#include <algorithm>
#include <cmath>

#include "encore/quant.hpp"
#include "quant/fp8_scale.hpp"

namespace encore {

uint8_t float_to_e4m3(float v) {
  if (std::isnan(v)) return 0x7f;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  float a = std::fabs(v);
  if (a >= 448.0f) return sign | 0x7e;  // saturate (finite max 448 = 1.75 * 2^8)
  if (a < 0.015625f) {                  // below 2^-6: subnormals, multiples of 2^-9
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

float e4m3_to_float(uint8_t b) {
  const int exp = (b >> 3) & 0xf, mant = b & 7;
  if (exp == 15 && mant == 7) return NAN;
  const float mag = exp == 0 ? std::ldexp(float(mant), -9) : std::ldexp(1.0f + mant / 8.0f, exp - 7);
  return (b & 0x80) ? -mag : mag;
}

namespace reference {

void fp8_group_quant(const quant::Fp8QuantProblem& p) {
  const int64_t groups = p.cols / p.group_size;
  for (int64_t m = 0; m < p.rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * p.group_size;
      p.scales[m * p.scale_stride_m + g * p.scale_stride_g] = quant::fp8_quantize_group(
          p.group_size, [&](int64_t k) { return float(load_as_double(p.x, p.dtype, m * p.x_stride + c0 + k)); },
          [&](int64_t k, float v) { p.q[m * p.q_stride + c0 + k] = float_to_e4m3(v); }, p.power_of_two, p.eps);
    }
  }
}

}  // namespace reference
}  // namespace encore
