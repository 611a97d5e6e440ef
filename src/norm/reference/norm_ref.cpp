#include "norm/reference/norm_ref.hpp"

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
  std::vector<float> h(static_cast<size_t>(p.hidden));
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

void qk_norm(const norm::QkNormProblem& p) {
  const int heads = p.num_q_heads + p.num_kv_heads;
  const int64_t d = p.head_dim;
  std::vector<double> u(static_cast<size_t>(d));
  for (int64_t t = 0; t < p.tokens; ++t) {
    for (int j = 0; j < heads; ++j) {
      const int64_t base = t * p.token_stride + j * d;
      const void* w = j < p.num_q_heads ? p.q_weight : p.k_weight;
      double ss = 0.0;
      for (int64_t c = 0; c < d; ++c) {
        u[size_t(c)] = load_as_double(p.qkv, p.dtype, base + c);
        ss += u[size_t(c)] * u[size_t(c)];
      }
      const double rstd = 1.0 / std::sqrt(ss / double(d) + double(p.eps));
      for (int64_t c = 0; c < d; ++c) {
        const double wc = load_as_double(w, p.dtype, c) + double(p.weight_offset);
        store_from_double(p.qkv, p.dtype, base + c, u[size_t(c)] * rstd * wc);
      }
    }
  }
}

}  // namespace encore::reference
