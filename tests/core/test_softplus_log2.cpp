// softplus_log2 (src/core/softplus_log2.hpp) against log2(1 + 2^y) in long double: absolute error
// <= 1e-6 everywhere, relative <= 3e-5 (where the value is a normal float), over y from -140 to 140.
#include <gtest/gtest.h>

#include <cmath>

#include "core/softplus_log2.hpp"

namespace encore::test {
namespace {

TEST(SoftplusLog2, MatchesLongDouble) {
  double worst_abs = 0, worst_rel = 0;
  for (int i = -1400000; i <= 1400000; ++i) {
    const float y = float(i) * 1e-4f;
    const float got = softplus_log2(y, std::exp2(-std::fabs(y)));
    const long double want = std::log1p(std::exp2((long double)y)) / std::log(2.0L);  // log1p: exact for tiny 2^y
    ASSERT_TRUE(std::isfinite(got)) << "y " << y;
    const double abs_err = double(std::fabs((long double)got - want));
    worst_abs = std::max(worst_abs, abs_err);
    if (want > 1e-30L) worst_rel = std::max(worst_rel, double(abs_err / want));
  }
  EXPECT_LE(worst_abs, 1e-6);
  EXPECT_LE(worst_rel, 3e-5);
  EXPECT_EQ(softplus_log2(-200.f, 0.f), 0.f);  // 2^-200 flushes to 0: no decay, no sign flip
  EXPECT_GE(softplus_log2(-1e-3f, std::exp2(-1e-3f)), 0.f);
}

}  // namespace
}  // namespace encore::test
