// The FP8 e4m3 group scale, one definition for the CPU reference and the CUDA kernel so their
// scales (and so their quantized values) agree bit for bit.
#pragma once
#include <cmath>

#include "core/host_device.hpp"

namespace encore::quant {

constexpr float kE4m3Max = 448.0f;

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

}  // namespace encore::quant
