#include "reference/norm_ref.hpp"

#include <cmath>
#include <vector>

namespace encore::reference {

namespace {
float round_to(DType t, float v) {
  switch (t) {
    case DType::kBF16: return bf16_to_float(float_to_bf16(v));
    case DType::kFP16: return fp16_to_float(float_to_fp16(v));
    default: return v;
  }
}
}  // namespace

void rms_norm(const norm::RmsNormProblem& p) {
  std::vector<float> h(size_t(p.hidden));
  for (int64_t r = 0; r < p.rows; ++r) {
    double sumsq = 0.0;
    for (int64_t c = 0; c < p.hidden; ++c) {
      float v = float(load_as_double(p.x, p.dtype, r * p.x_stride + c));
      if (p.residual) {
        v = round_to(p.dtype, v + float(load_as_double(p.residual, p.dtype, r * p.residual_stride + c)));
      }
      h[size_t(c)] = v;
      sumsq += double(v) * double(v);
    }
    // Store h only after the whole row is read: h may alias x or residual.
    if (p.h) {
      for (int64_t c = 0; c < p.hidden; ++c) store_from_double(p.h, p.dtype, r * p.h_stride + c, h[size_t(c)]);
    }
    double rstd = 1.0 / std::sqrt(sumsq / double(p.hidden) + double(p.eps));
    for (int64_t c = 0; c < p.hidden; ++c) {
      double w = load_as_double(p.weight, p.dtype, c) + double(p.weight_offset);
      store_from_double(p.y, p.dtype, r * p.y_stride + c, double(h[size_t(c)]) * rstd * w);
    }
  }
}

}  // namespace encore::reference
