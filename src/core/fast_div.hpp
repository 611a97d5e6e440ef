// Division of 31-bit unsigned integers by a run-time constant as a multiply and a shift (the
// divisor's reciprocal rounded up), for kernels that split a flat index into (row, column) once
// per element group: 2-3 instructions instead of the ~20 of a 32-bit integer division.
//
// For 1 <= d < 2^31 let l = ceil(log2 d), p = 31 + l and m = ceil(2^p / d) (m <= 2^32 - 1 except
// m = 2^31 for d = 2^l, so it fits in 32 bits). Then floor(n / d) = (n * m) >> p for every
// 0 <= n < 2^31: with e = m d - 2^p in [0, d), n m / 2^p = n / d + n e / (d 2^p) and the error
// term is below 2^31 / 2^(31 + l) = 2^-l <= 1 / d, which cannot carry the fraction of n / d (at
// most (d - 1) / d) past the next integer. Tested exhaustively on small divisors and at the edges
// (tests/core/test_fast_div.cpp).
#pragma once
#include <cstdint>

#include "core/host_device.hpp"

namespace encore {

struct FastDiv31 {
  uint32_t magic = 0;  // m
  uint32_t shift = 0;  // p

  FastDiv31() = default;
  // d in [1, 2^31).
  explicit FastDiv31(uint32_t d) {
    uint32_t l = 0;
    while ((uint64_t(1) << l) < d) ++l;
    shift = 31 + l;
    magic = uint32_t(((uint64_t(1) << shift) + d - 1) / d);
  }
  // floor(n / divisor) for n in [0, 2^31).
  ENCORE_HOST_DEVICE uint32_t div(uint32_t n) const { return uint32_t((uint64_t(n) * magic) >> shift); }
};

}  // namespace encore
