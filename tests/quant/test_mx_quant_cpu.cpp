// CPU backend of MXFP8 / NVFP4: bit-exact against an independent nearest-code implementation, specials, round-trip bounds, the swizzled layout, bad inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "encore/quant.hpp"

namespace encore::test {
namespace {

// ---- the independent implementation: decode every code, pick the nearest, ties to the even code ----
double e4m3_value(int b) {  // sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7f / 0xff NaN
  const int e = (b >> 3) & 15, m = b & 7;
  const double mag = e == 0 ? m / 8.0 * std::pow(2.0, -6) : (1 + m / 8.0) * std::pow(2.0, e - 7);
  return (b & 0x80) ? -mag : mag;
}
double e2m1_value(int c) {
  static const double mags[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (c & 8) ? -mags[c & 7] : mags[c & 7];
}
// The nearest of `n` codes of v's sign (magnitude clamped to `max`), ties to the even code.
template <class F>
int nearest(double v, int n, int sign_bit, double max, F value, int skip) {
  const int sign = std::signbit(v) ? sign_bit : 0;
  const double a = std::min(std::fabs(v), max);
  int best = -1;
  double best_d = INFINITY;
  for (int c = sign; c < sign + sign_bit; ++c) {
    if (c == (skip | sign)) continue;  // NaN code
    const double d = std::fabs(std::fabs(value(c)) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) best = c, best_d = d;
  }
  (void)n;
  return best;
}
int e4m3_nearest(double v) { return nearest(v, 256, 0x80, 448.0, e4m3_value, 0x7f); }
int e2m1_nearest(double v) { return nearest(v, 16, 0x8, 6.0, e2m1_value, -1); }

int floor_log2(double a) {  // largest e with 2^e <= a (a > 0), by search
  int e = -200;
  while (std::ldexp(1.0, e + 1) <= a) ++e;
  return e;
}
int ceil_log2(double a) {  // smallest e with 2^e >= a
  int e = -200;
  while (std::ldexp(1.0, e) < a) ++e;
  return e;
}
int clamp127(int e) { return std::min(127, std::max(-127, e)); }

struct Ref {
  std::vector<uint8_t> q, s;  // row-major scales
  float global = 0;
};

Ref mxfp8_ref(const std::vector<float>& x, int64_t M, int64_t K, bool rceil) {
  Ref r{std::vector<uint8_t>(size_t(M * K)), std::vector<uint8_t>(size_t(M * K / 32))};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / 32; ++b) {
      double amax = 0;
      bool bad = false;
      for (int k = 0; k < 32; ++k) {
        const float v = x[size_t(m * K + b * 32 + k)];
        bad = bad || !std::isfinite(v);
        amax = std::max(amax, std::fabs(double(v)));
      }
      uint8_t* q = &r.q[size_t(m * K + b * 32)];
      if (bad) {
        r.s[size_t(m * (K / 32) + b)] = 0xff;
        std::memset(q, 0x7f, 32);
        continue;
      }
      const float d = float(amax) / 448.0f;
      const int e = amax == 0 ? -127 : clamp127(rceil ? ceil_log2(d) : floor_log2(amax) - 8);
      r.s[size_t(m * (K / 32) + b)] = uint8_t(e + 127);
      for (int k = 0; k < 32; ++k) q[k] = uint8_t(e4m3_nearest(double(x[size_t(m * K + b * 32 + k)]) / std::ldexp(1.0, e)));
    }
  return r;
}

Ref nvfp4_ref(const std::vector<float>& x, int64_t M, int64_t K, float given) {
  Ref r{std::vector<uint8_t>(size_t(M * K / 2)), std::vector<uint8_t>(size_t(M * K / 16))};
  float amax = 0;
  for (float v : x)
    if (std::isfinite(v)) amax = std::max(amax, std::fabs(v));
  r.global = given > 0 ? given : (amax / 2688.0f > 0 ? amax / 2688.0f : 1.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / 16; ++b) {
      float bmax = 0;
      bool bad = false;
      for (int k = 0; k < 16; ++k) {
        const float v = x[size_t(m * K + b * 16 + k)];
        bad = bad || !std::isfinite(v);
        bmax = std::max(bmax, std::fabs(v));
      }
      int codes[16] = {};
      uint8_t& s = r.s[size_t(m * (K / 16) + b)];
      if (bad) {
        s = 0x7f;
      } else {
        s = uint8_t(e4m3_nearest(double(bmax / 6.0f / r.global)));
        const float d = float(e4m3_value(s)) * r.global;
        for (int k = 0; k < 16 && d > 0; ++k) codes[k] = e2m1_nearest(double(x[size_t(m * K + b * 16 + k)] / d));
      }
      for (int k = 0; k < 16; k += 2) r.q[size_t(m * K / 2 + b * 8 + k / 2)] = uint8_t(codes[k] | codes[k + 1] << 4);
    }
  return r;
}

// Random values over many binades, with zero blocks, subnormal-range blocks and a few outliers.
std::vector<float> make_input(int64_t M, int64_t K, uint32_t seed, DType dtype) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  std::uniform_int_distribution<int> ex(dtype == DType::kFP16 ? -8 : -20, dtype == DType::kFP16 ? 8 : 20);  // fp16: finite
  std::vector<float> x(size_t(M * K));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / 16; ++b) {
      const int e = (b % 7 == 3) ? -135 : ex(rng);  // fp32 subnormal-range blocks (fp32 only)
      for (int k = 0; k < 16; ++k) x[size_t(m * K + b * 16 + k)] = (b % 5 == 2) ? 0.f : std::ldexp(n(rng), e);
    }
  for (auto& v : x) {  // what the dtype holds
    if (dtype == DType::kBF16) v = bf16_to_float(float_to_bf16(v));
    if (dtype == DType::kFP16) v = fp16_to_float(float_to_fp16(v));
  }
  return x;
}

// x as a buffer of `dtype` (kept alive by `storage`).
TensorView x_view(const std::vector<float>& x, DType dtype, int64_t M, int64_t K, std::vector<uint16_t>& storage) {
  if (dtype == DType::kFP32) return TensorView::contiguous(const_cast<float*>(x.data()), dtype, {M, K});
  storage.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) storage[i] = dtype == DType::kBF16 ? float_to_bf16(x[i]) : float_to_fp16(x[i]);
  return TensorView::contiguous(storage.data(), dtype, {M, K});
}

// Row-major scales from a swizzled buffer (and a check that its padding is 0).
std::vector<uint8_t> unswizzle(const std::vector<uint8_t>& sw, int64_t M, int64_t sc) {
  std::vector<uint8_t> out(size_t(M * sc));
  std::vector<bool> used(sw.size(), false);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t c = 0; c < sc; ++c) {
      const int64_t o = mx_swizzled_scale_offset(r, c, sc);
      out[size_t(r * sc + c)] = sw[size_t(o)];
      used[size_t(o)] = true;
    }
  for (size_t i = 0; i < sw.size(); ++i)
    if (!used[i]) EXPECT_EQ(sw[i], 0) << "padding byte " << i;
  return out;
}

int64_t pad(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

struct Case {
  DType dtype;
  int64_t M, K;
  bool swizzled, rceil;
};
class MxQuantCpu : public ::testing::TestWithParam<Case> {};

TEST_P(MxQuantCpu, Mxfp8BitExactAndWithinHalfAStep) {
  const Case c = GetParam();
  const auto x = make_input(c.M, c.K, uint32_t(c.M * 7 + c.K), c.dtype);
  std::vector<uint16_t> storage;
  const int64_t sc = c.K / 32, srows = c.swizzled ? pad(c.M, 128) : c.M, scols = c.swizzled ? pad(sc, 4) : sc;
  std::vector<uint8_t> q(size_t(c.M * c.K)), s(size_t(srows * scols), 0xaa);
  MxQuantOptions o;
  o.scale_layout = c.swizzled ? MxScaleLayout::kSwizzled : MxScaleLayout::kRowMajor;
  o.rounding = c.rceil ? MxScaleRounding::kRceil : MxScaleRounding::kFloor;
  const TensorView sv = TensorView::contiguous(s.data(), DType::kUInt8, {srows, scols});
  const TensorView qv = TensorView::contiguous(q.data(), DType::kFP8E4M3, {c.M, c.K});
  Status st = run(Mxfp8QuantArgs{x_view(x, c.dtype, c.M, c.K, storage), qv, sv}, o);
  ASSERT_TRUE(st) << st.to_string();
  const Ref ref = mxfp8_ref(x, c.M, c.K, c.rceil);
  const auto rs = c.swizzled ? unswizzle(s, c.M, sc) : s;
  ASSERT_EQ(rs, ref.s);
  ASSERT_EQ(q, ref.q);
  std::vector<float> back(x.size());
  ASSERT_TRUE(run(Mxfp8DequantArgs{qv, sv, TensorView::contiguous(back.data(), DType::kFP32, {c.M, c.K})}, o));
  for (size_t i = 0; i < x.size(); ++i) {
    const double scale = std::ldexp(1.0, int(ref.s[i / 32]) - 127), v = x[i] / scale;
    const double bound = std::fabs(v) > 448 ? std::fabs(v) - 448 : std::max(std::fabs(v) / 16, std::ldexp(1.0, -10));
    ASSERT_LE(std::fabs(double(back[i]) - x[i]), bound * scale) << i;
  }
}

TEST_P(MxQuantCpu, Nvfp4BitExactAndWithinHalfAStep) {
  const Case c = GetParam();
  const auto x = make_input(c.M, c.K, uint32_t(c.M * 5 + c.K), c.dtype);
  std::vector<uint16_t> storage;
  const int64_t sc = c.K / 16, srows = c.swizzled ? pad(c.M, 128) : c.M, scols = c.swizzled ? pad(sc, 4) : sc;
  std::vector<uint8_t> q(size_t(c.M * c.K / 2)), s(size_t(srows * scols), 0xaa);
  float global = 0;
  MxQuantOptions o;
  o.scale_layout = c.swizzled ? MxScaleLayout::kSwizzled : MxScaleLayout::kRowMajor;
  const TensorView sv = TensorView::contiguous(s.data(), DType::kFP8E4M3, {srows, scols});
  const TensorView qv = TensorView::contiguous(q.data(), DType::kUInt8, {c.M, c.K / 2});
  const TensorView gv = TensorView::contiguous(&global, DType::kFP32, {1});
  Status st = run(Nvfp4QuantArgs{x_view(x, c.dtype, c.M, c.K, storage), qv, sv, gv}, o);
  ASSERT_TRUE(st) << st.to_string();
  const Ref ref = nvfp4_ref(x, c.M, c.K, 0.f);
  ASSERT_EQ(global, ref.global);
  ASSERT_EQ(c.swizzled ? unswizzle(s, c.M, sc) : s, ref.s);
  ASSERT_EQ(q, ref.q);
  std::vector<float> back(x.size());
  ASSERT_TRUE(run(Nvfp4DequantArgs{qv, sv, gv, TensorView::contiguous(back.data(), DType::kFP32, {c.M, c.K})}, o));
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = e4m3_value(ref.s[i / 16]) * global, v = d > 0 ? x[i] / d : 0;
    const double a = std::fabs(v), half = a < 2 ? 0.25 : (a < 4 ? 0.5 : 1.0);
    const double bound = d == 0 ? std::fabs(x[i]) : (a > 6 ? (a - 6) * d : half * d);
    ASSERT_LE(std::fabs(double(back[i]) - x[i]), bound + std::fabs(x[i]) * 1e-6 + 1e-45) << i << " x " << x[i] << " back " << back[i];
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, MxQuantCpu,
                         ::testing::Values(Case{DType::kFP32, 3, 96, false, false}, Case{DType::kFP32, 130, 160, true, false},
                                           Case{DType::kBF16, 5, 256, false, true}, Case{DType::kBF16, 129, 64, true, true},
                                           Case{DType::kFP16, 2, 32, true, false}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           return std::string(dtype_name(c.dtype)) + "_" + std::to_string(c.M) + "x" + std::to_string(c.K) +
                                  (c.swizzled ? "_swizzled" : "_rowmajor") + (c.rceil ? "_rceil" : "_floor");
                         });

TEST(MxFormats, E2m1EveryCodeAndTies) {
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(e2m1_to_float(uint8_t(c)), float(e2m1_value(c)));
    EXPECT_EQ(float_to_e2m1(float(e2m1_value(c))), c == 8 ? 8 : c) << c;
  }
  const float ties[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const float to[] = {0.f, 1.f, 1.f, 2.f, 2.f, 4.f, 4.f};
  for (int i = 0; i < 7; ++i) EXPECT_EQ(e2m1_to_float(float_to_e2m1(ties[i])), to[i]) << ties[i];
  EXPECT_EQ(float_to_e2m1(7.f), 7);
  EXPECT_EQ(float_to_e2m1(-1e30f), 15);
  for (float v = -8.f; v <= 8.f; v += 1.f / 64) EXPECT_EQ(float_to_e2m1(v), e2m1_nearest(v)) << v;
  EXPECT_EQ(e8m0_to_float(127), 1.f);
  EXPECT_EQ(e8m0_to_float(0), std::ldexp(1.f, -127));
  EXPECT_TRUE(std::isnan(e8m0_to_float(255)));
}

TEST(MxSwizzle, HandCheckedOffsetsAndBijection) {
  EXPECT_EQ(mx_swizzled_scale_offset(0, 0, 4), 0);
  EXPECT_EQ(mx_swizzled_scale_offset(0, 1, 4), 1);
  EXPECT_EQ(mx_swizzled_scale_offset(1, 0, 4), 16);
  EXPECT_EQ(mx_swizzled_scale_offset(32, 0, 4), 4);
  EXPECT_EQ(mx_swizzled_scale_offset(33, 2, 4), 22);
  EXPECT_EQ(mx_swizzled_scale_offset(127, 3, 4), 511);
  EXPECT_EQ(mx_swizzled_scale_offset(0, 4, 8), 512);     // next column tile
  EXPECT_EQ(mx_swizzled_scale_offset(128, 0, 8), 1024);  // next row tile, after both column tiles
  EXPECT_EQ(mx_swizzled_scale_offset(130, 5, 6), 1569);  // 6 columns pad to 8: tile (1, 1) = 3 * 512, + 2 * 16 + 1
  for (int64_t sc : {1, 4, 6, 9}) {
    for (int64_t M : {1, 128, 200}) {
      const int64_t total = pad(M, 128) * pad(sc, 4);
      std::set<int64_t> seen;
      for (int64_t r = 0; r < pad(M, 128); ++r)
        for (int64_t c = 0; c < pad(sc, 4); ++c) {
          const int64_t o = mx_swizzled_scale_offset(r, c, sc);
          ASSERT_TRUE(o >= 0 && o < total);
          seen.insert(o);
        }
      EXPECT_EQ(int64_t(seen.size()), total) << "not a bijection: M " << M << " scale cols " << sc;
    }
  }
}

// One row of 32 (MXFP8) through the op.
void mx_row(std::vector<float> x, std::vector<uint8_t>& q, uint8_t& s, MxScaleRounding r = MxScaleRounding::kFloor) {
  q.assign(x.size(), 0);
  std::vector<uint8_t> sv(x.size() / 32);
  MxQuantOptions o;
  o.rounding = r;
  const int64_t K = int64_t(x.size());
  ASSERT_TRUE(run(Mxfp8QuantArgs{TensorView::contiguous(x.data(), DType::kFP32, {1, K}), TensorView::contiguous(q.data(), DType::kFP8E4M3, {1, K}),
                                 TensorView::contiguous(sv.data(), DType::kUInt8, {1, K / 32})},
                  o));
  s = sv[0];
}

TEST(Mxfp8Specials, ZerosSaturationNegativesNanSubnormals) {
  std::vector<uint8_t> q;
  uint8_t s = 0;
  mx_row(std::vector<float>(32, 0.f), q, s);
  EXPECT_EQ(s, 0);  // amax 0: 2^-127
  EXPECT_EQ(q, std::vector<uint8_t>(32, 0));
  std::vector<float> x(32, 1.0f);
  x[0] = -1.9f * 256;  // floor(log2(486.4)) = 8: e = 0, 486.4 saturates to -448
  mx_row(x, q, s);
  EXPECT_EQ(s, 127);
  EXPECT_EQ(q[0], 0xfe);
  EXPECT_EQ(q[1], 0x38);  // 1.0
  mx_row(x, q, s, MxScaleRounding::kRceil);  // RCEIL: 2^ceil(log2(486.4 / 448)) = 2: nothing saturates
  EXPECT_EQ(s, 128);
  EXPECT_EQ(e4m3_to_float(q[0]), -240.f);  // -243.2 -> -240
  x.assign(32, std::ldexp(1.f, -140));      // fp32 subnormals: floor(log2) - 8 = -148, clamped to -127
  x[5] = -std::ldexp(3.f, -141);
  mx_row(x, q, s);
  EXPECT_EQ(s, 0);
  EXPECT_EQ(q[0], uint8_t(e4m3_nearest(std::ldexp(1.0, -13))));  // 2^-140 / 2^-127 = 2^-13 -> 0 (below 2^-10)
  EXPECT_EQ(q[0], 0);
  x.assign(32, 0.5f);
  x[7] = NAN;
  mx_row(x, q, s);
  EXPECT_EQ(s, 0xff);
  EXPECT_EQ(q, std::vector<uint8_t>(32, 0x7f));
  x[7] = -INFINITY;
  mx_row(x, q, s);
  EXPECT_EQ(s, 0xff);
}

TEST(Nvfp4Specials, ZerosSaturationNanGlobal) {
  const int64_t K = 32;
  std::vector<float> x(K, 0.f);
  for (int k = 16; k < 32; ++k) x[size_t(k)] = float(k - 24) * 0.75f;  // block 1: -6 .. 5.25
  x[16] = NAN;
  std::vector<uint8_t> q(K / 2), s(2);
  float g = 0;
  auto go = [&](float given) {
    MxQuantOptions o;
    o.global_scale = given;
    return run(Nvfp4QuantArgs{TensorView::contiguous(x.data(), DType::kFP32, {1, K}), TensorView::contiguous(q.data(), DType::kUInt8, {1, K / 2}),
                              TensorView::contiguous(s.data(), DType::kFP8E4M3, {1, K / 16}), TensorView::contiguous(&g, DType::kFP32, {1})},
               o);
  };
  ASSERT_TRUE(go(0.f));
  EXPECT_EQ(g, 5.25f / 2688.f);  // the NaN is skipped by the global amax
  EXPECT_EQ(s[0], 0);            // an all-zero block
  EXPECT_EQ(s[1], 0x7f);         // the NaN block
  EXPECT_EQ(q, std::vector<uint8_t>(K / 2, 0));
  x[16] = -6.f;
  ASSERT_TRUE(go(0.f));
  EXPECT_EQ(g, 6.f / 2688.f);
  EXPECT_EQ(e4m3_to_float(s[1]), 448.f);  // amax / 6 / global = 448
  EXPECT_EQ(q[8] & 0xf, 0xf);             // -6 -> code 15
  ASSERT_TRUE(go(1e-6f));                 // a tiny calibrated global: the block scale saturates at 448, elements at 6
  EXPECT_EQ(g, 1e-6f);
  EXPECT_EQ(e4m3_to_float(s[1]), 448.f);
  EXPECT_EQ(q[8] & 0xf, 0xf);
  EXPECT_EQ(q[15] >> 4, 7);  // 5.25 -> +6 saturated
}

struct MxBad : ::testing::Test {
  std::vector<float> x = std::vector<float>(4 * 64, 1.f), g = {0.f};
  std::vector<uint8_t> q = std::vector<uint8_t>(4 * 64), s = std::vector<uint8_t>(128 * 4);
  Mxfp8QuantArgs mx() {
    return {TensorView::contiguous(x.data(), DType::kFP32, {4, 64}), TensorView::contiguous(q.data(), DType::kFP8E4M3, {4, 64}),
            TensorView::contiguous(s.data(), DType::kUInt8, {4, 2})};
  }
  Nvfp4QuantArgs nv() {
    return {TensorView::contiguous(x.data(), DType::kFP32, {4, 64}), TensorView::contiguous(q.data(), DType::kUInt8, {4, 32}),
            TensorView::contiguous(s.data(), DType::kFP8E4M3, {4, 4}), TensorView::contiguous(g.data(), DType::kFP32, {1})};
  }
  template <class A>
  void expect(const A& a, const std::string& needle, MxQuantOptions o = {}) {
    const Status st = run(a, o);
    EXPECT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  }
};

TEST_F(MxBad, KNotAMultipleOfTheBlock) {
  auto a = mx();
  a.x.shape[1] = a.q.shape[1] = 48;
  expect(a, "x: K = 48 must be a multiple of 32 (the mxfp8 block)");
  auto b = nv();
  b.x.shape[1] = 40;
  b.q.shape[1] = 20;
  expect(b, "x: K = 40 must be a multiple of 16 (the nvfp4 block)");
}
TEST_F(MxBad, Dtypes) {
  auto a = mx();
  a.x.dtype = DType::kInt32;
  expect(a, "x: dtype must be one of {bf16, fp16, fp32}");
  a = mx();
  a.q.dtype = DType::kUInt8;
  expect(a, "q: dtype must be one of {fp8_e4m3}");
  a = mx();
  a.scales.dtype = DType::kFP32;
  expect(a, "scales: dtype must be one of {uint8}");
  auto b = nv();
  b.scales.dtype = DType::kUInt8;
  expect(b, "scales: dtype must be one of {fp8_e4m3}");
  b = nv();
  b.global_scale.dtype = DType::kBF16;
  expect(b, "global_scale: dtype must be one of {fp32}");
}
TEST_F(MxBad, Shapes) {
  auto a = mx();
  a.scales.shape[1] = 3;
  expect(a, "scales: dimension 1 is 3 but must equal K / block (2)");
  MxQuantOptions sw;
  sw.scale_layout = MxScaleLayout::kSwizzled;
  expect(mx(), "scales: dimension 0 is 4 but must equal M rounded up to 128", sw);
  a = mx();
  a.scales = TensorView::contiguous(s.data(), DType::kUInt8, {128, 2});
  expect(a, "scales: dimension 1 is 2 but must equal K / block rounded up to 4", sw);
  a.scales = TensorView::contiguous(s.data(), DType::kUInt8, {128, 4});
  EXPECT_TRUE(run(a, sw));
  auto b = nv();
  b.q.shape[1] = 64;
  expect(b, "q: dimension 1 is 64 but must equal K / 2");
  b = nv();
  b.global_scale.shape[0] = 2;
  expect(b, "global_scale: dimension 0 is 2 but must equal 1");
  MxQuantOptions neg;
  neg.global_scale = -1.f;
  expect(nv(), "global_scale: must be finite and >= 0", neg);
}
// CUDA tensors (validation only: these host pointers are never launched on): mixed devices, and the
// kernels' alignment rules.
TEST_F(MxBad, CudaDeviceAndAlignmentChecks) {
  const Device gpu{DeviceType::kCUDA, 0};
  auto a = mx();
  a.x.device = gpu;
  expect(a, "all tensors must be on one device");
  for (TensorView* t : {&a.x, &a.q, &a.scales}) t->device = gpu;
  a.x.data = x.data() + 1;  // 4-byte aligned, not 16
  expect(a, "mxfp8 on CUDA: x's data pointer and row stride must be 16-byte aligned");
  a = mx();
  for (TensorView* t : {&a.x, &a.q, &a.scales}) t->device = gpu;
  a.q.data = q.data() + 4;
  expect(a, "mxfp8 on CUDA: q's data pointer and row stride must be multiples of 8 bytes");
  auto b = nv();
  for (TensorView* t : {&b.x, &b.q, &b.scales, &b.global_scale}) t->device = gpu;
  b.global_scale.device = {};
  expect(b, "global_scale: on cpu");
  b.global_scale.device = gpu;
  b.q.data = q.data() + 2;
  expect(b, "nvfp4 on CUDA: q's data pointer and row stride must be multiples of 4 bytes");
  std::vector<float> out(4 * 64 + 1);
  Mxfp8DequantArgs d{mx().q, mx().scales, TensorView::contiguous(out.data() + 1, DType::kFP32, {4, 64}, gpu)};
  d.q.device = d.scales.device = gpu;
  const Status st = run(d, {});
  EXPECT_NE(st.message().find("x's data pointer and row stride must be 16-byte aligned"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace encore::test
