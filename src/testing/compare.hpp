// The one comparison policy for encore (tests and `encore check`): relative-RMS error
// ||a - b|| / ||b|| and an element-wise bound |a - b| <= atol + rtol * |b|, per dtype, over the
// logical [rows, cols] region. Any NaN or Inf in `actual` fails.
#pragma once
#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

#include "testing/host_tensor.hpp"

namespace encore::test {

struct Tolerance {
  double rel_rms;
  double atol;
  double rtol;
};

// Between two implementations of one op that both round their output to `t` once: at most a
// couple of units in the last place apart.
inline Tolerance tolerance_for(DType t) {
  switch (t) {
    case DType::kBF16: return {8e-3, 1e-2, 1.6e-2};   // 2^-7 = 7.8e-3 per ulp
    case DType::kFP16: return {1e-3, 1e-3, 2e-3};     // 2^-10 = 9.8e-4 per ulp
    case DType::kFP32: return {1e-5, 1e-5, 1e-5};
    default: return {1e-12, 1e-12, 1e-12};
  }
}

struct CompareResult {
  double rel_rms = 0, max_abs = 0;
  int64_t bad = 0, non_finite = 0;
  std::string first_bad;
};

inline CompareResult compare(const HostTensor& actual, const HostTensor& expected, Tolerance tol) {
  CompareResult r;
  double num = 0, den = 0;
  for (int64_t i = 0; i < expected.rows; ++i) {
    for (int64_t j = 0; j < expected.cols; ++j) {
      double a = actual.get(i, j), e = expected.get(i, j);
      if (!std::isfinite(a)) {
        if (r.non_finite++ == 0 && r.first_bad.empty()) {
          std::ostringstream os;
          os << "non-finite at (" << i << ", " << j << "): " << a << " expected " << e;
          r.first_bad = os.str();
        }
        continue;
      }
      double d = std::fabs(a - e);
      num += d * d;
      den += e * e;
      r.max_abs = std::max(r.max_abs, d);
      if (d > tol.atol + tol.rtol * std::fabs(e)) {
        if (r.bad++ == 0 && r.first_bad.empty()) {
          std::ostringstream os;
          os << "mismatch at (" << i << ", " << j << "): " << a << " expected " << e;
          r.first_bad = os.str();
        }
      }
    }
  }
  r.rel_rms = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return r;
}

inline bool compare_ok(const CompareResult& r, Tolerance tol) {
  return r.non_finite == 0 && r.bad == 0 && r.rel_rms <= tol.rel_rms;
}

}  // namespace encore::test
