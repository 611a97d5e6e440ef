// FastDiv31 (src/core/fast_div.hpp) against integer division: every n < 2^16 for divisors up to
// 300, and for divisors across the whole range the dividends that sit at multiples of d (k d - 1,
// k d, k d + 1) near 0, near 2^31 and at random.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "core/fast_div.hpp"

namespace encore::test {
namespace {

void expect_divides(uint32_t d, uint32_t n) {
  const FastDiv31 f(d);
  ASSERT_EQ(f.div(n), n / d) << "n " << n << " d " << d;
}

TEST(FastDiv31, SmallDivisorsExhaustive) {
  for (uint32_t d = 1; d <= 300; ++d)
    for (uint32_t n = 0; n < (1u << 16); ++n) expect_divides(d, n);
}

TEST(FastDiv31, EdgesAcrossTheRange) {
  std::mt19937_64 rng(5);
  std::vector<uint32_t> divisors = {1, 2, 3, 7, 56, 128, 1000, 65535, 65536, 65537, (1u << 30) - 1, 1u << 30, (1u << 30) + 1,
                                    (1u << 31) - 1};
  for (int i = 0; i < 2000; ++i) divisors.push_back(uint32_t(rng() % ((1u << 31) - 1)) + 1);
  const uint32_t top = (1u << 31) - 1;
  for (uint32_t d : divisors) {
    for (uint32_t n : {0u, 1u, d - 1, d, top, top - 1, top - (top % d), top - (top % d) - 1}) expect_divides(d, n);
    for (int j = 0; j < 50; ++j) {
      const uint64_t k = rng() % (uint64_t(top) / d + 1);
      for (int64_t delta : {-1, 0, 1}) {
        const int64_t n = int64_t(k * d) + delta;
        if (n >= 0 && n <= int64_t(top)) expect_divides(d, uint32_t(n));
      }
    }
  }
}

}  // namespace
}  // namespace encore::test
