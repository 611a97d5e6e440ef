// CPU backend of FP8 group quantization: e4m3 conversions, quantize/dequantize error bounds,
// scale layouts and power-of-two scales, bad inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "encore/quant.hpp"
#include "tests/common/compare.hpp"

namespace encore::test {
namespace {

TEST(E4m3, EveryByteRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    const float v = e4m3_to_float(uint8_t(b));
    if (std::isnan(v)) continue;  // 0x7f, 0xff
    if (v == 0.0f && b == 0x80) continue;  // -0 encodes as 0x80 too; checked below
    EXPECT_EQ(float_to_e4m3(v), uint8_t(b)) << "byte " << b << " value " << v;
  }
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
}

TEST(E4m3, RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(1.0625f)), 1.0f);    // halfway 1 and 1.125: even mantissa (1.0)
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(1.1875f)), 1.25f);   // halfway 1.125 and 1.25: even (1.25)
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(1000.0f)), 448.0f);  // saturates
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(-1e30f)), -448.0f);
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(std::ldexp(1.0f, -10))), 0.0f);  // half the smallest subnormal: to even (0)
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(3 * std::ldexp(1.0f, -10))), std::ldexp(1.0f, -8));
}

// Non-finite inputs have defined results: a NaN is skipped by the group's amax and stays NaN (0x7f);
// an infinity gives the group an infinite scale (also with power-of-two scales), its finite values
// quantize to (signed) zero and the infinity to NaN.
TEST(Fp8QuantCpuSpecials, NanAndInfinity) {
  for (bool pow2 : {false, true}) {
    std::vector<float> x(256, 1.0f), scales(2, 0.f);
    std::vector<uint8_t> q(256, 0);
    x[3] = NAN;
    x[130] = -2.0f;
    x[200] = INFINITY;
    Fp8GroupQuantOptions o;
    o.power_of_two_scales = pow2;
    ASSERT_TRUE(run(Fp8GroupQuantArgs{TensorView::contiguous(x.data(), DType::kFP32, {1, 256}),
                                      TensorView::contiguous(q.data(), DType::kFP8E4M3, {1, 256}),
                                      TensorView::contiguous(scales.data(), DType::kFP32, {1, 2})},
                    o));
    EXPECT_EQ(scales[0], pow2 ? 1.0f / 256.0f : 1.0f / 448.0f) << "NaN skipped by amax";
    EXPECT_EQ(q[3], 0x7f);
    EXPECT_EQ(e4m3_to_float(q[0]), pow2 ? 256.0f : 448.0f);
    EXPECT_TRUE(std::isinf(scales[1])) << "pow2 " << pow2;
    EXPECT_EQ(q[128], 0x00);
    EXPECT_EQ(q[130], 0x80);  // -2 * 0 = -0
    EXPECT_EQ(q[200], 0x7f);  // inf * 0 = NaN
  }
}

struct QuantCase {
  DType dtype;
  int64_t rows, cols;
  bool column_major, pow2;
};

class Fp8QuantCpu : public ::testing::TestWithParam<QuantCase> {};

TEST_P(Fp8QuantCpu, DequantizesWithinHalfAnUlpOfTheGroupScale) {
  const QuantCase c = GetParam();
  auto rng = make_rng(uint64_t(c.rows * 3 + c.cols));
  const int64_t groups = c.cols / 128;
  HostTensor x(c.dtype, c.rows, c.cols), q(DType::kFP8E4M3, c.rows, c.cols), back(DType::kFP32, c.rows, c.cols);
  x.fill_normal(rng, 0.0, 3.0);
  for (int64_t j = 0; j < 128 && groups > 1; ++j) x.set(0, 128 + j, 0.0);  // an all-zero group
  std::vector<float> scales(size_t(c.rows * groups), NAN);
  const TensorView sv = c.column_major ? TensorView::strided(scales.data(), DType::kFP32, {c.rows, groups}, {1, c.rows})
                                       : TensorView::contiguous(scales.data(), DType::kFP32, {c.rows, groups});
  Fp8GroupQuantOptions o;
  o.power_of_two_scales = c.pow2;
  Status st = run(Fp8GroupQuantArgs{x.view(), q.view(), sv}, o);
  ASSERT_TRUE(st) << st.to_string();
  ASSERT_TRUE(run(Fp8GroupDequantArgs{q.view(), sv, back.view()}, o));
  for (int64_t m = 0; m < c.rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scales[size_t(c.column_major ? g * c.rows + m : m * groups + g)];
      double amax = 0;
      for (int64_t k = 0; k < 128; ++k) amax = std::max(amax, std::fabs(x.get(m, g * 128 + k)));
      ASSERT_TRUE(std::isfinite(s) && s > 0) << "scale (" << m << ", " << g << ")";
      if (c.pow2) {
        int e;
        EXPECT_EQ(std::frexp(s, &e), 0.5f) << "scale not a power of two: " << s;
        EXPECT_GE(double(s) * 448.0, amax);
        EXPECT_LT(double(s) * 224.0, std::max(amax, 1e-10));
      } else if (amax > 0) {
        EXPECT_NEAR(double(s), amax / 448.0, amax / 448.0 * 1e-6);
      }
      for (int64_t k = 0; k < 128; ++k) {
        const double v = x.get(m, g * 128 + k), d = back.get(m, g * 128 + k);
        // e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals; subnormals step 2^-9 * s.
        EXPECT_LE(std::fabs(v - d), std::max(std::fabs(v) * 0.0625, std::ldexp(double(s), -10)) + 1e-12)
            << "(" << m << ", " << g * 128 + k << ") x " << v << " back " << d << " scale " << s;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, Fp8QuantCpu,
                         ::testing::Values(QuantCase{DType::kBF16, 5, 512, false, false}, QuantCase{DType::kBF16, 3, 256, true, true},
                                           QuantCase{DType::kFP32, 7, 384, true, false}, QuantCase{DType::kFP16, 1, 128, false, true}),
                         [](const auto& info) {
                           const QuantCase& c = info.param;
                           return std::string(dtype_name(c.dtype)) + "_" + std::to_string(c.rows) + "x" + std::to_string(c.cols) +
                                  (c.column_major ? "_colmajor" : "_rowmajor") + (c.pow2 ? "_pow2" : "");
                         });

struct QuantBad : ::testing::Test {
  HostTensor x{DType::kBF16, 4, 256}, q{DType::kFP8E4M3, 4, 256};
  std::vector<float> s = std::vector<float>(8);
  Fp8GroupQuantArgs args() { return {x.view(), q.view(), TensorView::contiguous(s.data(), DType::kFP32, {4, 2})}; }
  void expect_error(Fp8GroupQuantArgs a, Fp8GroupQuantOptions o, const std::string& needle) {
    Status st = run(a, o);
    EXPECT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  }
};

TEST_F(QuantBad, KNotMultipleOfGroup) {
  auto a = args();
  a.x.shape[1] = a.q.shape[1] = 200;
  expect_error(a, {}, "x: K = 200 must be a multiple of group_size (128)");
}
TEST_F(QuantBad, GroupSize) {
  Fp8GroupQuantOptions o;
  o.group_size = 64;
  expect_error(args(), o, "group_size: only 128 is supported");
}
TEST_F(QuantBad, Dtypes) {
  auto a = args();
  a.q.dtype = DType::kBF16;
  expect_error(a, {}, "q: dtype must be one of {fp8_e4m3}");
  a = args();
  a.scales.dtype = DType::kBF16;
  expect_error(a, {}, "scales: dtype must be one of {fp32}");
}
TEST_F(QuantBad, ScaleShapeAndStrides) {
  auto a = args();
  a.scales.shape[1] = 3;
  expect_error(a, {}, "scales: dimension 1 is 3 but must equal K / group_size (2)");
  a = args();
  a.scales.strides = {1, 1};
  expect_error(a, {}, "scales: strides {1, 1} must be row-major");
}
TEST_F(QuantBad, EmptyAndNull) {
  auto a = args();
  a.x.shape[0] = 0;
  expect_error(a, {}, "x: empty tensor");
  a = args();
  a.q.data = nullptr;
  expect_error(a, {}, "q: data pointer is null");
}

}  // namespace
}  // namespace encore::test
