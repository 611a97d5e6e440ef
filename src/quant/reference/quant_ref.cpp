#include "quant/reference/quant_ref.hpp"

#include <algorithm>
#include <cmath>

#include "encore/quant.hpp"
#include "quant/fp8_scale.hpp"

namespace encore {

// The public conversions (encore/quant.hpp), core/fp8.hpp's.
uint8_t float_to_e4m3(float v) { return e4m3_encode(v); }

float e4m3_to_float(uint8_t b) { return e4m3_decode(b); }

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
