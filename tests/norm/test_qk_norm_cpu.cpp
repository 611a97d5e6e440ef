// CPU backend of QK-norm: against an fp64 oracle (V heads and row padding untouched) and bad inputs.
#include <gtest/gtest.h>

#include "encore/norm.hpp"
#include "tests/common/compare.hpp"

namespace encore::test {
namespace {

struct QkCase {
  DType dtype;
  int64_t tokens;
  int hq, hkv, d;
  int64_t pad;  // extra elements per token row
  float offset;
};

class QkNormCpu : public ::testing::TestWithParam<QkCase> {};

TEST_P(QkNormCpu, MatchesOracleAndLeavesVAlone) {
  const QkCase c = GetParam();
  auto rng = make_rng(uint64_t(c.tokens * 17 + c.d));
  const int64_t width = int64_t(c.hq + 2 * c.hkv) * c.d;
  HostTensor qkv(c.dtype, c.tokens, width, width + c.pad), wq = HostTensor::vector(c.dtype, c.d),
      wk = HostTensor::vector(c.dtype, c.d);
  qkv.fill_normal(rng, 0.3, 2.0);
  wq.fill_normal(rng, 1.0, 0.4);
  wk.fill_normal(rng, 1.0, 0.4);
  const HostTensor before = qkv;
  QkNormOptions o{c.hq, c.hkv, c.d, 1e-6f, c.offset};
  Status st = run(QkNormArgs{qkv.view(), wq.view(), wk.view()}, o);
  ASSERT_TRUE(st) << st.to_string();

  HostTensor expect = before;
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int j = 0; j < c.hq + c.hkv; ++j) {
      const HostTensor& w = j < c.hq ? wq : wk;
      double ss = 0;
      for (int e = 0; e < c.d; ++e) ss += before.get(t, j * c.d + e) * before.get(t, j * c.d + e);
      const double r = 1.0 / std::sqrt(ss / c.d + 1e-6);
      for (int e = 0; e < c.d; ++e) expect.set(t, j * c.d + e, before.get(t, j * c.d + e) * r * (w.get(0, e) + c.offset));
    }
  }
  ENCORE_EXPECT_CLOSE(qkv, expect, c.dtype, "qkv");
  // V heads and the padding between rows are bit-identical to the input.
  const size_t esz = dtype_size(c.dtype);
  for (int64_t t = 0; t < c.tokens; ++t) {
    const size_t v0 = size_t(t * qkv.row_stride + int64_t(c.hq + c.hkv) * c.d) * esz;
    const size_t v1 = size_t(std::min(qkv.storage_elems(), (t + 1) * qkv.row_stride)) * esz;
    ASSERT_EQ(0, std::memcmp(qkv.bytes.data() + v0, before.bytes.data() + v0, v1 - v0)) << "token " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, QkNormCpu,
                         ::testing::Values(QkCase{DType::kBF16, 3, 32, 8, 128, 0, 0.f}, QkCase{DType::kFP16, 5, 2, 1, 64, 8, 1.f},
                                           QkCase{DType::kBF16, 1, 1, 1, 256, 16, 0.f}, QkCase{DType::kFP16, 7, 3, 5, 128, 64, 0.f}),
                         [](const auto& info) {
                           const QkCase& c = info.param;
                           return std::string(dtype_name(c.dtype)) + "_T" + std::to_string(c.tokens) + "_q" + std::to_string(c.hq) +
                                  "_kv" + std::to_string(c.hkv) + "_d" + std::to_string(c.d) + "_pad" + std::to_string(c.pad) +
                                  (c.offset != 0 ? "_off" : "");
                         });

struct QkBad : ::testing::Test {
  HostTensor qkv{DType::kBF16, 4, (4 + 2 * 2) * 128};
  HostTensor wq = HostTensor::vector(DType::kBF16, 128), wk = HostTensor::vector(DType::kBF16, 128);
  QkNormOptions opts{4, 2, 128, 1e-6f, 0.f};
  QkNormArgs args() { return {qkv.view(), wq.view(), wk.view()}; }
  void expect_error(QkNormArgs a, QkNormOptions o, const std::string& needle) {
    Status st = run(a, o);
    EXPECT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  }
};

TEST_F(QkBad, HeadDim) {
  auto o = opts;
  o.head_dim = 96;
  expect_error(args(), o, "head_dim: must be 64, 128 or 256, got 96");
}

TEST_F(QkBad, ZeroHeads) {
  auto o = opts;
  o.num_q_heads = 0;
  expect_error(args(), o, "num_q_heads: must be >= 1");
  o = opts;
  o.num_kv_heads = 0;
  expect_error(args(), o, "num_kv_heads: must be >= 1");
}

TEST_F(QkBad, ZeroTokens) {
  auto a = args();
  a.qkv.shape[0] = 0;
  expect_error(a, opts, "qkv: empty tensor");
}

TEST_F(QkBad, WidthMismatch) {
  auto o = opts;
  o.num_kv_heads = 3;
  expect_error(args(), o, "qkv: dimension 1 is 1024 but must equal (num_q_heads + 2*num_kv_heads) * head_dim (1280)");
}

TEST_F(QkBad, OddStride) {
  HostTensor wide(DType::kBF16, 4, 1024 + 3);
  auto a = args();
  a.qkv = TensorView::strided(wide.bytes.data(), DType::kBF16, {4, 1024}, {1027, 1});
  expect_error(a, opts, "qkv: token stride 1027 must be a multiple of 16 bytes");
}

TEST_F(QkBad, MisalignedData) {
  HostTensor wide(DType::kBF16, 4, 1024 + 8);
  auto a = args();
  a.qkv = TensorView::strided(reinterpret_cast<uint16_t*>(wide.bytes.data()) + 1, DType::kBF16, {4, 1024}, {1032, 1});
  expect_error(a, opts, "qkv: data pointer must be 16-byte aligned");
}

TEST_F(QkBad, WeightLengthAndDtype) {
  auto a = args();
  a.k_weight.shape[0] = 64;
  expect_error(a, opts, "k_weight: dimension 0 is 64 but must equal head_dim (128)");
  a = args();
  a.q_weight.dtype = DType::kFP16;
  expect_error(a, opts, "q_weight: dtype fp16 must match qkv's dtype bf16");
  a = args();
  a.qkv.dtype = DType::kFP32;
  a.q_weight.dtype = a.k_weight.dtype = DType::kFP32;
  expect_error(a, opts, "qkv: dtype must be one of {bf16, fp16}, got fp32");
}

}  // namespace
}  // namespace encore::test
