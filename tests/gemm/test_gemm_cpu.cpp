// GEMM-epilogue programs on the CPU backend: each epilogue against a direct fp64 oracle, the
// deferred-RMSNorm identity through the composed block (residual + sqsum -> reduce -> row-scaled
// SwiGLU == RMSNorm then GEMM then SwiGLU), LSE + loss, RoPE sign and frequencies, bad inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "encore/gemm.hpp"
#include "tests/common/compare.hpp"

namespace encore::test {
namespace {

struct Mats {
  int64_t M, N, K;
  HostTensor a, w;
  std::vector<double> acc;  // fp64 A·Wᵀ of the stored (rounded) inputs
  Mats(DType t, int64_t m, int64_t n, int64_t k, std::mt19937_64& rng) : M(m), N(n), K(k), a(t, m, k), w(t, n, k) {
    a.fill_normal(rng);
    w.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(k)));
    acc.assign(size_t(m * n), 0.0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t q = 0; q < k; ++q) s += a.get(i, q) * w.get(j, q);
        acc[size_t(i * n + j)] = s;
      }
  }
  double at(int64_t i, int64_t j) const { return acc[size_t(i * N + j)]; }
};

HostTensor f32(int64_t rows, int64_t cols) { return HostTensor(DType::kFP32, rows, cols); }
TensorView vec_view(std::vector<float>& v) { return TensorView::contiguous(v.data(), DType::kFP32, {int64_t(v.size())}); }

TEST(GemmEpilogueCpu, ResidualSqsumAuxAndFinalReduce) {
  auto rng = make_rng(1);
  Mats m(DType::kBF16, 9, 200, 48, rng);  // N = 200: last partial tile of 128 is ragged
  HostTensor c(DType::kBF16, 9, 200), gamma = HostTensor::vector(DType::kBF16, 200), d(DType::kBF16, 9, 200),
      aux(DType::kBF16, 9, 200), partials = f32(9, 2);
  c.fill_normal(rng);
  gamma.fill_normal(rng, 1.0, 0.3);
  d.poison();
  aux.poison();
  partials.poison();
  GemmEpilogueArgs args;
  args.a = m.a.view();
  args.w = m.w.view();
  args.d = d.view();
  args.aux = aux.view();
  args.c = c.view();
  args.gamma = gamma.view();
  args.partials = partials.view();
  GemmEpilogueOptions o{Epilogue::kResidualSqsumAux, 128};
  Status st = run(args, o);
  ASSERT_TRUE(st) << st.to_string();
  HostTensor d_ref = d, aux_ref = aux, p_ref = partials;
  for (int64_t i = 0; i < 9; ++i) {
    double s[2] = {0, 0};
    for (int64_t j = 0; j < 200; ++j) {
      const double y = m.at(i, j) + c.get(i, j);
      d_ref.set(i, j, y);
      aux_ref.set(i, j, y * gamma.get(0, j));
      s[j / 128] += y * y;
    }
    p_ref.set(i, 0, s[0]);
    p_ref.set(i, 1, s[1]);
  }
  ENCORE_EXPECT_CLOSE(d, d_ref, DType::kBF16, "d");
  ENCORE_EXPECT_CLOSE(aux, aux_ref, DType::kBF16, "aux");
  ENCORE_EXPECT_CLOSE(partials, p_ref, DType::kFP32, "partials");

  std::vector<float> r(9, NAN);
  ASSERT_TRUE(run(RmsFinalReduceArgs{partials.view(), vec_view(r)}, 200, 1e-5f));
  for (int64_t i = 0; i < 9; ++i)
    EXPECT_NEAR(r[size_t(i)], 1.0 / std::sqrt((p_ref.get(i, 0) + p_ref.get(i, 1)) / 200.0 + 1e-5), 1e-6 * r[size_t(i)]);
}

// The deferred row-scale identity end to end: rmsnorm(x1) * gamma @ w1ᵀ -> SwiGLU equals
// residual_sqsum_aux (h1 = x1 ⊙ gamma, partials) -> rms_final_reduce -> swiglu with r (fp32).
TEST(GemmEpilogueCpu, DeferredRmsNormIdentityThroughSwiglu) {
  auto rng = make_rng(2);
  const int64_t M = 7, D = 64, F = 24;
  Mats proj(DType::kFP32, M, D, 32, rng);
  HostTensor x0(DType::kFP32, M, D), gamma = HostTensor::vector(DType::kFP32, D), x1 = f32(M, D), h1 = f32(M, D), part = f32(M, 1);
  x0.fill_normal(rng);
  gamma.fill_normal(rng, 1.0, 0.3);
  GemmEpilogueArgs s1;
  s1.a = proj.a.view();
  s1.w = proj.w.view();
  s1.d = x1.view();
  s1.aux = h1.view();
  s1.c = x0.view();
  s1.gamma = gamma.view();
  s1.partials = part.view();
  ASSERT_TRUE(run(s1, GemmEpilogueOptions{Epilogue::kResidualSqsumAux, 64}));
  std::vector<float> r(static_cast<size_t>(M));
  ASSERT_TRUE(run(RmsFinalReduceArgs{part.view(), vec_view(r)}, D, 1e-5f));
  HostTensor w1(DType::kFP32, 2 * F, D), z = f32(M, 2 * F), y = f32(M, F);
  w1.fill_normal(rng, 0.0, 0.2);
  GemmEpilogueArgs s2;
  s2.a = h1.view();
  s2.w = w1.view();
  s2.d = z.view();
  s2.aux = y.view();
  s2.row_scale = vec_view(r);
  ASSERT_TRUE(run(s2, GemmEpilogueOptions{Epilogue::kSwiglu}));
  // Unfused reference.
  HostTensor y_ref = y;
  for (int64_t i = 0; i < M; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += x1.get(i, j) * x1.get(i, j);
    const double rr = 1.0 / std::sqrt(ss / D + 1e-5);
    for (int64_t f = 0; f < F; ++f) {
      double g = 0, u = 0;
      for (int64_t j = 0; j < D; ++j) {
        const double xn = x1.get(i, j) * rr * gamma.get(0, j);
        g += xn * w1.get(2 * f, j);
        u += xn * w1.get(2 * f + 1, j);
      }
      y_ref.set(i, f, g / (1 + std::exp(-g)) * u);
    }
  }
  ENCORE_EXPECT_CLOSE(y, y_ref, DType::kFP32, "swiglu(rmsnorm(x1) @ w1ᵀ)");
}

TEST(GemmEpilogueCpu, InterleaveGateUp) {
  auto rng = make_rng(3);
  HostTensor g(DType::kBF16, 3, 5), u(DType::kBF16, 3, 5), out(DType::kBF16, 6, 5);
  g.fill_normal(rng);
  u.fill_normal(rng);
  ASSERT_TRUE(interleave_gate_up(g.view(), u.view(), out.view()));
  for (int64_t f = 0; f < 3; ++f)
    for (int64_t k = 0; k < 5; ++k) {
      EXPECT_EQ(out.get(2 * f, k), g.get(f, k));
      EXPECT_EQ(out.get(2 * f + 1, k), u.get(f, k));
    }
}

TEST(GemmEpilogueCpu, RopeSignAndFrequencies) {
  // One pair, a quarter turn: (1, 0) -> (0, 1) (rotation by +θ).
  HostTensor a(DType::kFP32, 1, 2), w(DType::kFP32, 2, 2), d = f32(1, 2);
  a.set(0, 0, 1.0);
  a.set(0, 1, 0.0);
  w.set(0, 0, 1.0); w.set(0, 1, 0.0); w.set(1, 0, 0.0); w.set(1, 1, 1.0);  // identity
  std::vector<int32_t> pos = {1};
  std::vector<float> freq = {0.25f, 0.0f};
  GemmEpilogueArgs args;
  args.a = a.view();
  args.w = w.view();
  args.d = d.view();
  args.pos = TensorView::contiguous(pos.data(), DType::kInt32, {1});
  args.freq = vec_view(freq);
  ASSERT_TRUE(run(args, GemmEpilogueOptions{Epilogue::kRope}));
  EXPECT_NEAR(d.get(0, 0), 0.0, 1e-7);
  EXPECT_NEAR(d.get(0, 1), 1.0, 1e-7);

  // Full QKV: 2 Q + 1 K heads rotate, 1 V head passes through; large positions keep their phase.
  auto rng = make_rng(4);
  const int heads = 4, rot = 3, hd = 16;
  Mats m(DType::kFP32, 5, heads * hd, 24, rng);
  std::vector<float> f(static_cast<size_t>(heads * hd));
  ASSERT_TRUE(rope_freq_turns(heads, rot, hd, 500000.0, vec_view(f)));
  std::vector<int32_t> p = {0, 1, 1000, 131071, 524287};
  HostTensor out = f32(5, heads * hd), ref = f32(5, heads * hd);
  GemmEpilogueArgs q;
  q.a = m.a.view();
  q.w = m.w.view();
  q.d = out.view();
  q.pos = TensorView::contiguous(p.data(), DType::kInt32, {5});
  q.freq = vec_view(f);
  ASSERT_TRUE(run(q, GemmEpilogueOptions{Epilogue::kRope}));
  for (int64_t i = 0; i < 5; ++i)
    for (int h = 0; h < heads; ++h)
      for (int j = 0; j < hd / 2; ++j) {
        const int64_t c0 = h * hd + 2 * j;
        const double th = h < rot ? double(p[size_t(i)]) * std::pow(500000.0, -2.0 * j / hd) : 0.0;
        const double x = m.at(i, c0), yv = m.at(i, c0 + 1);
        ref.set(i, c0, x * std::cos(th) - yv * std::sin(th));
        ref.set(i, c0 + 1, yv * std::cos(th) + x * std::sin(th));
      }
  ENCORE_EXPECT_CLOSE(out, ref, DType::kFP32, "rope");
}

// rope_bwd rotates by −θ: the quarter turn back ((0, 1) -> (1, 0)); it inverts rope (Rᵀ·R = 1) and is
// its adjoint (Σ dy·R(z) = Σ Rᵀ(dy)·z: the gradient through the rotation), V heads and large
// positions included; the optional row scale applies before the rotation as in rope.
TEST(GemmEpilogueCpu, RopeBwdIsTheInverseRotation) {
  HostTensor a(DType::kFP32, 1, 2), w(DType::kFP32, 2, 2), d = f32(1, 2);
  a.set(0, 0, 0.0);
  a.set(0, 1, 1.0);
  w.set(0, 0, 1.0); w.set(0, 1, 0.0); w.set(1, 0, 0.0); w.set(1, 1, 1.0);  // identity
  std::vector<int32_t> pos1 = {1};
  std::vector<float> freq1 = {0.25f, 0.0f};
  GemmEpilogueArgs args;
  args.a = a.view();
  args.w = w.view();
  args.d = d.view();
  args.pos = TensorView::contiguous(pos1.data(), DType::kInt32, {1});
  args.freq = vec_view(freq1);
  ASSERT_TRUE(run(args, GemmEpilogueOptions{Epilogue::kRopeBwd}));
  EXPECT_NEAR(d.get(0, 0), 1.0, 1e-7);
  EXPECT_NEAR(d.get(0, 1), 0.0, 1e-7);

  auto rng = make_rng(14);
  const int heads = 4, rot = 3, hd = 16, n = heads * hd, M = 5;
  std::vector<float> f(static_cast<size_t>(n));
  ASSERT_TRUE(rope_freq_turns(heads, rot, hd, 500000.0, vec_view(f)));
  std::vector<int32_t> p = {0, 1, 1000, 131071, 524287};
  std::vector<float> r = {0.5f, 1.0f, 2.0f, 1.5f, 0.75f};
  HostTensor eye = f32(n, n), x = f32(M, n), dy = f32(M, n), y = f32(M, n), back = f32(M, n), dx = f32(M, n);
  for (int i = 0; i < n; ++i) eye.set(i, i, 1.0);
  x.fill_normal(rng);
  dy.fill_normal(rng);
  auto rotate = [&](HostTensor& in, HostTensor& out, Epilogue e, bool scaled) {
    GemmEpilogueArgs g;
    g.a = in.view();
    g.w = eye.view();
    g.d = out.view();
    g.pos = TensorView::contiguous(p.data(), DType::kInt32, {M});
    g.freq = vec_view(f);
    if (scaled) g.row_scale = vec_view(r);
    return run(g, GemmEpilogueOptions{e});
  };
  ASSERT_TRUE(rotate(x, y, Epilogue::kRope, false));
  ASSERT_TRUE(rotate(y, back, Epilogue::kRopeBwd, false));
  ENCORE_EXPECT_CLOSE(back, x, DType::kFP32, "rope_bwd(rope(x)) = x");
  ASSERT_TRUE(rotate(dy, dx, Epilogue::kRopeBwd, false));
  double lhs = 0, rhs = 0;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < n; ++j) {
      lhs += dy.get(i, j) * y.get(i, j);
      rhs += dx.get(i, j) * x.get(i, j);
    }
  EXPECT_NEAR(lhs, rhs, 1e-4 * std::max(1.0, std::abs(lhs))) << "rope_bwd is the adjoint of rope";
  HostTensor scaled = f32(M, n), ref = f32(M, n);
  ASSERT_TRUE(rotate(dy, scaled, Epilogue::kRopeBwd, true));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < n; ++j) ref.set(i, j, r[size_t(i)] * dx.get(i, j));
  ENCORE_EXPECT_CLOSE(scaled, ref, DType::kFP32, "rope_bwd with a row scale");
}

TEST(GemmEpilogueCpu, LseTargetAndLoss) {
  auto rng = make_rng(5);
  const int64_t M = 6, N = 300, tile = 128;  // 3 tiles, the last one ragged
  Mats m(DType::kBF16, M, N, 40, rng);
  std::vector<float> r(static_cast<size_t>(M));
  for (auto& x : r) x = 0.5f + float(rng() % 100) / 100.0f;
  HostTensor part = f32(M, 3);
  std::vector<int32_t> target = {0, 299, 17, -100, 128, 255};
  std::vector<float> tlogit(static_cast<size_t>(M), NAN), lse(size_t(M), NAN), loss(size_t(M), NAN);
  GemmEpilogueArgs args;
  args.a = m.a.view();
  args.w = m.w.view();
  args.row_scale = vec_view(r);
  args.partials = part.view();
  args.target = TensorView::contiguous(target.data(), DType::kInt32, {M});
  args.target_logit = vec_view(tlogit);
  ASSERT_TRUE(run(args, GemmEpilogueOptions{Epilogue::kLse, int(tile)}));  // logits never written
  ASSERT_TRUE(run(LseFinishArgs{part.view(), vec_view(lse), args.target, vec_view(tlogit), vec_view(loss)}));
  for (int64_t i = 0; i < M; ++i) {
    double mx = -INFINITY;
    for (int64_t j = 0; j < N; ++j) mx = std::max(mx, r[size_t(i)] * m.at(i, j));
    double s = 0;
    for (int64_t j = 0; j < N; ++j) s += std::exp(r[size_t(i)] * m.at(i, j) - mx);
    const double lse_ref = mx + std::log(s);
    EXPECT_NEAR(lse[size_t(i)], lse_ref, 1e-5 * std::fabs(lse_ref) + 1e-5);
    const double want = target[size_t(i)] == -100 ? 0.0 : lse_ref - r[size_t(i)] * m.at(i, target[size_t(i)]);
    EXPECT_NEAR(loss[size_t(i)], want, 1e-4) << "row " << i;
  }
}

TEST(GemmEpilogueCpu, RowScaleScalarScaleHeadSqsum) {
  auto rng = make_rng(6);
  Mats m(DType::kFP16, 5, 96, 33, rng);
  std::vector<float> r = {0.5f, 1.0f, 2.0f, -1.0f, 0.25f}, alpha = {-0.75f};
  HostTensor d1(DType::kFP16, 5, 96), d2(DType::kFP16, 5, 96), d3(DType::kFP16, 5, 96), heads = f32(5, 3);
  GemmEpilogueArgs a1;
  a1.a = m.a.view(); a1.w = m.w.view(); a1.d = d1.view(); a1.row_scale = vec_view(r);
  ASSERT_TRUE(run(a1, GemmEpilogueOptions{Epilogue::kRowScale}));
  GemmEpilogueArgs a2;
  a2.a = m.a.view(); a2.w = m.w.view(); a2.d = d2.view(); a2.alpha = vec_view(alpha);
  ASSERT_TRUE(run(a2, GemmEpilogueOptions{Epilogue::kScalarScale}));
  GemmEpilogueArgs a3;
  a3.a = m.a.view(); a3.w = m.w.view(); a3.d = d3.view(); a3.partials = heads.view();
  GemmEpilogueOptions o3{Epilogue::kQkvHeadSqsum};
  o3.head_dim = 32;
  ASSERT_TRUE(run(a3, o3));
  HostTensor r1 = d1, r2 = d2, r3 = d3, rh = heads;
  for (int64_t i = 0; i < 5; ++i) {
    double hs[3] = {0, 0, 0};
    for (int64_t j = 0; j < 96; ++j) {
      r1.set(i, j, r[size_t(i)] * m.at(i, j));
      r2.set(i, j, alpha[0] * m.at(i, j));
      r3.set(i, j, m.at(i, j));
      hs[j / 32] += m.at(i, j) * m.at(i, j);
    }
    for (int h = 0; h < 3; ++h) rh.set(i, h, hs[h]);
  }
  ENCORE_EXPECT_CLOSE(d1, r1, DType::kFP16, "row_scale");
  ENCORE_EXPECT_CLOSE(d2, r2, DType::kFP16, "scalar_scale");
  ENCORE_EXPECT_CLOSE(d3, r3, DType::kFP16, "qkv_head_sqsum d");
  ENCORE_EXPECT_CLOSE(heads, rh, DType::kFP32, "qkv_head_sqsum partials");
}

// gemm_qkv_head_sqsum + the QK-norm + RoPE finish equals per-head RMSNorm of the exact GEMM output
// followed by RoPE (Q and K heads), V heads untouched.
TEST(GemmEpilogueCpu, QkvHeadSqsumThenQkNormRope) {
  auto rng = make_rng(23);
  const int hq = 4, hkv = 2, hd = 16, heads = hq + 2 * hkv, N = heads * hd;
  const int64_t M = 11, K = 24;
  HostTensor a(DType::kFP32, M, K), w(DType::kFP32, N, K), qkv(DType::kFP32, M, N), part = f32(M, heads);
  a.fill_normal(rng);
  w.fill_normal(rng, 0.0, 0.3);
  std::vector<float> qw(hd), kw(hd), f(static_cast<size_t>(N));
  for (int e = 0; e < hd; ++e) qw[size_t(e)] = 1.0f + 0.1f * float(e % 5), kw[size_t(e)] = 0.7f + 0.05f * float(e % 3);
  std::vector<int32_t> pos(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) pos[size_t(m)] = int32_t(m * 977);
  ASSERT_TRUE(rope_freq_turns(heads, hq + hkv, hd, 1000000.0, vec_view(f)));
  GemmEpilogueArgs g;
  g.a = a.view();
  g.w = w.view();
  g.d = qkv.view();
  g.partials = part.view();
  GemmEpilogueOptions o{Epilogue::kQkvHeadSqsum};
  o.head_dim = hd;
  ASSERT_TRUE(run(g, o));
  QkNormRopeArgs f_args{qkv.view(), part.view(), vec_view(qw), vec_view(kw), TensorView::contiguous(pos.data(), DType::kInt32, {M}),
                        vec_view(f)};
  Status st = run(f_args, QkNormRopeOptions{hq, hkv, hd, 1e-6f});
  ASSERT_TRUE(st) << st.to_string();
  double worst = 0;
  for (int64_t m = 0; m < M; ++m) {
    std::vector<double> row(static_cast<size_t>(N));
    for (int n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += a.get(m, k) * w.get(n, k);
      row[size_t(n)] = s;
    }
    for (int h = 0; h < hq + hkv; ++h) {
      double ss = 0;
      for (int e = 0; e < hd; ++e) ss += row[size_t(h * hd + e)] * row[size_t(h * hd + e)];
      const double r = 1.0 / std::sqrt(ss / hd + 1e-6);
      for (int e = 0; e < hd; ++e) row[size_t(h * hd + e)] *= r * (h < hq ? qw[size_t(e)] : kw[size_t(e)]);
      for (int j = 0; j < hd / 2; ++j) {
        const int c = h * hd + 2 * j;
        const double th = 2 * 3.141592653589793 * pos[size_t(m)] * (double(f[size_t(c)]) + double(f[size_t(c + 1)]));
        const double x = row[size_t(c)], y = row[size_t(c + 1)];
        row[size_t(c)] = x * std::cos(th) - y * std::sin(th);
        row[size_t(c + 1)] = y * std::cos(th) + x * std::sin(th);
      }
    }
    for (int n = 0; n < N; ++n) worst = std::max(worst, std::fabs(qkv.get(m, n) - row[size_t(n)]));
  }
  EXPECT_LT(worst, 2e-5);
  QkNormRopeArgs bad = f_args;
  HostTensor short_part = f32(M, heads - 1);
  bad.partials = short_part.view();
  EXPECT_FALSE(run(bad, QkNormRopeOptions{hq, hkv, hd, 1e-6f}).is_ok());
}

// ---- bad input -------------------------------------------------------------------------------

struct GemmBad : ::testing::Test {
  HostTensor a{DType::kBF16, 4, 16}, w{DType::kBF16, 10, 16}, d{DType::kBF16, 4, 10}, aux{DType::kBF16, 4, 5};
  std::vector<float> r = std::vector<float>(4, 1.0f);
  GemmEpilogueArgs base() {
    GemmEpilogueArgs g;
    g.a = a.view();
    g.w = w.view();
    g.d = d.view();
    return g;
  }
  void expect_error(const GemmEpilogueArgs& g, const GemmEpilogueOptions& o, const std::string& needle) {
    Status st = run(g, o);
    EXPECT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  }
};

TEST_F(GemmBad, ShapesAndDtypes) {
  auto g = base();
  g.w.shape[1] = 15;
  expect_error(g, GemmEpilogueOptions{Epilogue::kScalarScale}, "w: expected [N, K] with K = 16");
  g = base();
  g.w.dtype = DType::kFP16;
  expect_error(g, GemmEpilogueOptions{Epilogue::kRowScale}, "w: dtype fp16 must match a's dtype bf16");
  g = base();
  g.d.shape[1] = 11;
  expect_error(g, GemmEpilogueOptions{Epilogue::kRowScale}, "d: expected [M, N] = [4, 10], got [4, 11]");
}

TEST_F(GemmBad, MissingAndExtraOperands) {
  auto g = base();
  expect_error(g, GemmEpilogueOptions{Epilogue::kRowScale}, "row_scale: tensor is missing");
  g.row_scale = vec_view(r);
  g.gamma = TensorView::contiguous(r.data(), DType::kFP32, {4});
  expect_error(g, GemmEpilogueOptions{Epilogue::kRowScale}, "gamma: not used by the row_scale epilogue");
}

TEST_F(GemmBad, OddPairsAndTargets) {
  HostTensor w9(DType::kBF16, 9, 16), d9(DType::kBF16, 4, 9);
  auto g = base();
  g.w = w9.view();
  g.d = d9.view();
  g.aux = aux.view();
  expect_error(g, GemmEpilogueOptions{Epilogue::kSwiglu}, "w: N = 9 must be even for the swiglu epilogue");
  HostTensor part(DType::kFP32, 4, 1);
  std::vector<int32_t> t = {0, 10, 3, -100};
  std::vector<float> tl(4);
  GemmEpilogueArgs l;
  l.a = a.view();
  l.w = w.view();
  l.partials = part.view();
  l.target = TensorView::contiguous(t.data(), DType::kInt32, {4});
  l.target_logit = vec_view(tl);
  expect_error(l, GemmEpilogueOptions{Epilogue::kLse}, "target: row 1 has target 10, outside [0, 10)");
}

// Limits of the CUDA kernels that are checked before any device access (so testable without a GPU).
TEST_F(GemmBad, CudaTileLimits) {
  HostTensor a16(DType::kBF16, 4, 16), w16(DType::kBF16, 16, 16), d16(DType::kBF16, 4, 16), heads(DType::kFP32, 4, 2),
      c16(DType::kBF16, 4, 16), aux16(DType::kBF16, 4, 16), gamma(DType::kBF16, 16, 1), tiles(DType::kFP32, 4, 1), c32(DType::kFP32, 4, 16);
  // partials [4, 1] fit every partial_tile_n >= 16
  const Device gpu{DeviceType::kCUDA, 0};
  GemmEpilogueArgs g;
  g.a = a16.view();
  g.w = w16.view();
  g.d = d16.view();
  g.partials = heads.view();
  for (TensorView* t : {&g.a, &g.w, &g.d, &g.partials}) t->device = gpu;
  GemmEpilogueOptions o{Epilogue::kQkvHeadSqsum};
  o.head_dim = 8;
  expect_error(g, o, "head_dim: the CUDA qkv_head_sqsum kernel takes head_dim 128, got 8");
  {
    std::vector<float> alpha = {1.0f};
    GemmEpilogueArgs s{};
    s.a = g.a;
    s.w = g.w;
    s.d = g.d;
    s.alpha = vec_view(alpha);
    s.alpha.device = gpu;
    GemmEpilogueOptions so{Epilogue::kScalarScale};
    so.tile = GemmTile::kPingpong64x256;
    expect_error(s, so, "tile: pingpong_64x256 exists for residual_sqsum_aux, row_scale, swiglu, lse, not scalar_scale");
    so.tile = GemmTile::kAuto;
    so.swizzle = 3;
    expect_error(s, so, "swizzle: must be 0 (auto), 1, 2, 4 or 8, got 3");
    so.swizzle = 0;
    so.raster = static_cast<GemmRaster>(9);
    expect_error(s, so, "raster: must be GemmRaster::kAuto, kAlongM or kAlongN, got 9");
    so.raster = GemmRaster::kAuto;
    so.n_slices = -1;
    expect_error(s, so, "n_slices: must be >= 0 (0 = auto), got -1");
  }

  GemmEpilogueArgs r;
  r.a = a16.view();
  r.w = w16.view();
  r.d = d16.view();
  r.c = c16.view();
  r.aux = aux16.view();
  r.gamma = TensorView::contiguous(gamma.view().data, DType::kBF16, {16});
  r.partials = tiles.view();
  for (TensorView* t : {&r.a, &r.w, &r.d, &r.c, &r.aux, &r.gamma, &r.partials}) t->device = gpu;
  GemmEpilogueOptions ro{Epilogue::kResidualSqsumAux};
  ro.partial_tile_n = 64;
  expect_error(r, ro, "partial_tile_n: the CUDA residual_sqsum_aux kernels write partials per tile N, 128 or 256; got 64");
  ro.partial_tile_n = 256;
  ro.tile = GemmTile::kPingpong128x128;
  expect_error(r, ro, "tile: pingpong_128x128 conflicts with the residual_sqsum_aux kernel's tile cooperative_128x256");
  ro.tile = GemmTile::kAuto;
  r.c = c32.view();
  r.c.device = gpu;
  expect_error(r, ro, "c: dtype fp32 must match a's dtype bf16");
}

TEST_F(GemmBad, CudaTmaAlignment) {
  auto g = base();
  g.row_scale = vec_view(r);
  for (TensorView* t : {&g.a, &g.w, &g.d, &g.row_scale}) t->device = Device{DeviceType::kCUDA, 0};
  expect_error(g, GemmEpilogueOptions{Epilogue::kRowScale}, "w: N = 10 must be a multiple of 8 on CUDA");
}

}  // namespace
}  // namespace encore::test
