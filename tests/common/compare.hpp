// gtest side of the comparison policy in src/testing/compare.hpp: every compare EXPECTs.
#pragma once
#include <gtest/gtest.h>

#include "testing/compare.hpp"

#define ENCORE_EXPECT_CLOSE(actual, expected, dtype, what)                                             \
  do {                                                                                                 \
    auto tol_ = ::encore::test::tolerance_for(dtype);                                                  \
    auto res_ = ::encore::test::compare((actual), (expected), tol_);                                   \
    EXPECT_TRUE(::encore::test::compare_ok(res_, tol_))                                                \
        << (what) << ": rel_rms=" << res_.rel_rms << " (tol " << tol_.rel_rms << ") max_abs=" << res_.max_abs \
        << " bad=" << res_.bad << " non_finite=" << res_.non_finite << " " << res_.first_bad;           \
  } while (0)

