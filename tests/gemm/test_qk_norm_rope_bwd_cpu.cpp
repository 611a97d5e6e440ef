// QK-norm + RoPE backward (run(QkNormRopeBwdArgs)) on the CPU backend: against central finite
// differences of an fp64 forward (per Q/K head x·rsqrt(mean(x²) + eps)·w, then RoPE with the
// forward's turns; V heads pass through), on fresh random inputs; in place; bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "encore/gemm.hpp"
#include "tests/common/compare.hpp"

namespace encore::test {
namespace {

struct Case {
  int64_t M;
  int q_heads, kv_heads, head_dim;
};

// L = Σ dy·y(x, wq, wk) in fp64, y the QK-norm + RoPE forward.
double loss(const std::vector<double>& x, const std::vector<double>& wq, const std::vector<double>& wk, const std::vector<double>& dy,
            const Case& c, const HostTensor& pos, const HostTensor& freq, double eps) {
  const int64_t D = c.head_dim, N = int64_t(c.q_heads + 2 * c.kv_heads) * D, qk = c.q_heads + c.kv_heads;
  double L = 0;
  for (int64_t m = 0; m < c.M; ++m) {
    std::vector<double> row(x.begin() + m * N, x.begin() + (m + 1) * N);
    for (int64_t h = 0; h < qk; ++h) {
      double ss = 0;
      for (int64_t e = 0; e < D; ++e) ss += row[size_t(h * D + e)] * row[size_t(h * D + e)];
      const double r = 1.0 / std::sqrt(ss / double(D) + eps);
      for (int64_t e = 0; e < D; ++e) row[size_t(h * D + e)] *= r * (h < c.q_heads ? wq : wk)[size_t(e)];
    }
    for (int64_t j = 0; 2 * j < qk * D; ++j) {  // the forward rotates the Q and K heads only
      double t = pos.get(0, m) * (freq.get(0, 2 * j) + freq.get(0, 2 * j + 1));
      t -= std::nearbyint(t);
      const double th = 6.283185307179586 * t, a = row[size_t(2 * j)], b = row[size_t(2 * j + 1)];
      row[size_t(2 * j)] = a * std::cos(th) - b * std::sin(th);
      row[size_t(2 * j + 1)] = b * std::cos(th) + a * std::sin(th);
    }
    for (int64_t n = 0; n < N; ++n) L += dy[size_t(m * N + n)] * row[size_t(n)];
  }
  return L;
}

std::vector<double> values(const HostTensor& t) {
  std::vector<double> v;
  for (int64_t i = 0; i < t.rows; ++i)
    for (int64_t j = 0; j < t.cols; ++j) v.push_back(t.get(i, j));
  return v;
}

TEST(QkNormRopeBwdCpu, MatchesFiniteDifferences) {
  for (const Case& c : {Case{3, 2, 1, 8}, Case{5, 4, 2, 16}, Case{1, 1, 1, 2}}) {
    SCOPED_TRACE("M " + std::to_string(c.M) + " heads " + std::to_string(c.q_heads) + "/" + std::to_string(c.kv_heads) + " D " +
                 std::to_string(c.head_dim));
    auto rng = make_rng(uint64_t(c.M * 7 + c.head_dim));
    const int heads = c.q_heads + 2 * c.kv_heads;
    const int64_t N = int64_t(heads) * c.head_dim, D = c.head_dim;
    const float eps = 1e-5f;
    HostTensor x(DType::kFP32, c.M, N), dy(DType::kFP32, c.M, N), dx(DType::kFP32, c.M, N), part(DType::kFP32, c.M, heads);
    HostTensor wq = HostTensor::vector(DType::kFP32, D), wk = HostTensor::vector(DType::kFP32, D);
    HostTensor dwq = HostTensor::vector(DType::kFP32, D), dwk = HostTensor::vector(DType::kFP32, D);
    HostTensor pos = HostTensor::vector(DType::kInt32, c.M), freq = HostTensor::vector(DType::kFP32, N);
    x.fill_normal(rng);
    dy.fill_normal(rng);
    wq.fill_normal(rng, 1.0, 0.3);
    wk.fill_normal(rng, 1.0, 0.3);
    for (int64_t m = 0; m < c.M; ++m) pos.set(0, m, double(17 * m + 3));
    // Every head with a frequency, V included: the forward leaves V unrotated whatever freq holds.
    ASSERT_TRUE(rope_freq_turns(heads, heads, c.head_dim, 10000.0, freq.view()));
    for (int64_t m = 0; m < c.M; ++m)
      for (int h = 0; h < heads; ++h) {
        double s = 0;
        for (int64_t e = 0; e < D; ++e) s += x.get(m, h * D + e) * x.get(m, h * D + e);
        part.set(m, h, s);
      }
    dx.poison();
    dwq.poison();
    dwk.poison();
    const QkNormRopeOptions o{c.q_heads, c.kv_heads, c.head_dim, eps};
    ASSERT_TRUE(run(QkNormRopeBwdArgs{dy.view(), x.view(), part.view(), wq.view(), wk.view(), pos.view(), freq.view(), dx.view(), dwq.view(),
                                      dwk.view()},
                    o));
    std::vector<double> xv = values(x), qv = values(wq), kv = values(wk), dyv = values(dy);
    auto fd = [&](std::vector<double>& v, size_t i) {
      const double h = 1e-5 * std::max(1.0, std::fabs(v[i])), keep = v[i];
      v[i] = keep + h;
      const double lp = loss(xv, qv, kv, dyv, c, pos, freq, eps);
      v[i] = keep - h;
      const double lm = loss(xv, qv, kv, dyv, c, pos, freq, eps);
      v[i] = keep;
      return (lp - lm) / (2 * h);
    };
    for (size_t i = 0; i < xv.size(); ++i) {
      const double want = fd(xv, i), got = dx.get(int64_t(i) / N, int64_t(i) % N);
      ASSERT_NEAR(got, want, 1e-5 * (1.0 + std::fabs(want))) << "dx at " << i;
    }
    for (int64_t e = 0; e < D; ++e) {
      const double wq_fd = fd(qv, size_t(e)), wk_fd = fd(kv, size_t(e));
      EXPECT_NEAR(dwq.get(0, e), wq_fd, 1e-5 * (1.0 + std::fabs(wq_fd))) << "dq_weight " << e;
      EXPECT_NEAR(dwk.get(0, e), wk_fd, 1e-5 * (1.0 + std::fabs(wk_fd))) << "dk_weight " << e;
    }
    // In place (dx = dy) gives the same bits.
    HostTensor g = dy;
    ASSERT_TRUE(run(QkNormRopeBwdArgs{g.view(), x.view(), part.view(), wq.view(), wk.view(), pos.view(), freq.view(), g.view(), dwq.view(),
                                      dwk.view()},
                    o));
    EXPECT_EQ(g.bytes, dx.bytes);
  }
}

TEST(QkNormRopeBwdCpu, BadInputNamesTheArgument) {
  const int64_t M = 4, D = 8, N = 4 * D;
  HostTensor x(DType::kFP32, M, N), dy(DType::kFP32, M, N), dx(DType::kFP32, M, N), part(DType::kFP32, M, 4);
  HostTensor w = HostTensor::vector(DType::kFP32, D), dw1 = HostTensor::vector(DType::kFP32, D), dw2 = HostTensor::vector(DType::kFP32, D);
  HostTensor pos = HostTensor::vector(DType::kInt32, M), freq = HostTensor::vector(DType::kFP32, N);
  const QkNormRopeOptions o{2, 1, int(D), 1e-5f};
  auto args = [&] {
    return QkNormRopeBwdArgs{dy.view(), x.view(), part.view(), w.view(), w.view(), pos.view(), freq.view(), dx.view(), dw1.view(), dw2.view()};
  };
  EXPECT_TRUE(run(args(), o));
  HostTensor x_short(DType::kFP32, M - 1, N), part_bad(DType::kFP32, M, 3), x_bf(DType::kBF16, M, N);
  auto a = args();
  a.x = x_short.view();
  Status s = run(a, o);
  EXPECT_FALSE(s);
  EXPECT_NE(s.to_string().find("x"), std::string::npos) << s.to_string();
  a = args();
  a.x = x_bf.view();
  EXPECT_FALSE(run(a, o));
  a = args();
  a.partials = part_bad.view();
  s = run(a, o);
  EXPECT_NE(s.to_string().find("partials"), std::string::npos) << s.to_string();
  a = args();
  a.dq_weight = a.dk_weight;
  s = run(a, o);
  EXPECT_FALSE(s);
  a = args();
  a.dx = a.x;
  s = run(a, o);
  EXPECT_NE(s.to_string().find("dx"), std::string::npos) << s.to_string();
  EXPECT_FALSE(run(args(), QkNormRopeOptions{2, 1, 7, 1e-5f}));
  EXPECT_FALSE(run(args(), QkNormRopeOptions{3, 1, int(D), 1e-5f}));
}

}  // namespace
}  // namespace encore::test
