// Softplus in log2 units with one exp2: log2(1 + 2^y) = max(y, 0) + log2(1 + t), t = 2^-|y| in (0, 1],
// and log2(1 + t) = t q(t) with q a degree-6 polynomial (least-squares fit weighted by t; in fp32
// |error| <= 1e-6 over all y, relative <= 2.5e-5). The KDA chunk kernel's in-kernel gate uses it in
// place of log(1 + exp(x)) (an exp and a log: two MUFU operations, and 1 + e^x rounds away the
// relative accuracy of small values); tests/core/test_softplus_log2.cpp checks the bound.
#pragma once

#include "core/host_device.hpp"

namespace encore {

// log2(1 + t) for t in [0, 1].
ENCORE_HOST_DEVICE inline float log2_1p_unit(float t) {
  float q = 0.015251781791448593f;
  q = q * t - 0.07835926115512848f;
  q = q * t + 0.19231005012989044f;
  q = q * t - 0.3242966830730438f;
  q = q * t + 0.47289395332336426f;
  q = q * t - 0.7204583883285522f;
  q = q * t + 1.4426592588424683f;
  return q * t;
}

// log2(1 + 2^y), given t = 2^-|y| (the caller's exp2: the hardware approximation on the GPU).
ENCORE_HOST_DEVICE inline float softplus_log2(float y, float t) { return (y > 0.f ? y : 0.f) + log2_1p_unit(t); }

}  // namespace encore
