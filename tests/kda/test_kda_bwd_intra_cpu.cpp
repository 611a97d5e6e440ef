// The KDA backward's intra-chunk terms (src/kda/cuda/kda_bwd_intra.cuh), host-run: the factored form
// (fla's per-16-row-sub-block references, what kda_bwd_grads_tc runs)
// and the exact per-pair form against an fp64 evaluation of the sums, on random tiles: K 128 / 60 /
// 48, full and partial chunks (rows 64, 37, 17, 16, 1), mild, strong (per-token log2 decays down to
// -20) and extreme (-1000) gates, where far pairs underflow. Bound: relative RMS <= 2e-6 per sum and
// tile, both forms; NaN never passes.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kda/cuda/kda_bwd_intra.cuh"

namespace encore::test {
namespace {

using cuda::kdabwd::intra_exact;
using cuda::kdabwd::intra_factored;
using cuda::kdabwd::IntraTiles;

struct Tiles {
  int K, rows;
  std::vector<float> G, Kt, Q, D, M, Dt, Mt, beta;
  IntraTiles view() const { return {G.data(), Kt.data(), Q.data(), D.data(), M.data(), Dt.data(), Mt.data(), beta.data(), K, rows}; }
};

Tiles make(int K, int rows, float decay_max, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  Tiles t{K, rows, std::vector<float>(size_t(64 * K), 0.f), {}, {}, {}, {}, {}, {}, std::vector<float>(64, 0.f)};
  t.Kt.assign(size_t(64 * K), 0.f);
  t.Q.assign(size_t(64 * K), 0.f);
  for (int a = 0; a < K; ++a) {
    float g = 0.f;
    for (int i = 0; i < rows; ++i) {
      g -= decay_max * ud(rng) * ud(rng);  // log2 decays in (-decay_max, 0], many small
      t.G[size_t(i * K + a)] = g;
      t.Kt[size_t(i * K + a)] = 0.1f * nd(rng);
      t.Q[size_t(i * K + a)] = 0.1f * nd(rng);
    }
  }
  t.D.assign(64 * 64, 0.f);
  t.M.assign(64 * 64, 0.f);
  for (int i = 0; i < rows; ++i) {
    t.beta[size_t(i)] = 0.1f + 0.8f * ud(rng);
    for (int j = 0; j <= i; ++j) {
      t.D[size_t(i * 64 + j)] = nd(rng);
      if (j < i) t.M[size_t(i * 64 + j)] = nd(rng);
    }
  }
  t.Dt.assign(64 * 64, 0.f);
  t.Mt.assign(64 * 64, 0.f);
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 64; ++j) {
      t.Dt[size_t(j * 64 + i)] = t.D[size_t(i * 64 + j)];
      t.Mt[size_t(j * 64 + i)] = t.M[size_t(i * 64 + j)];
    }
  return t;
}

double rel(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

void check(int K, int rows, float decay_max) {
  SCOPED_TRACE("K " + std::to_string(K) + " rows " + std::to_string(rows) + " decay " + std::to_string(decay_max));
  const Tiles t = make(K, rows, decay_max, uint64_t(K * 131 + rows * 7) + uint64_t(decay_max));
  const IntraTiles s = t.view();
  const size_t n = size_t(rows * K);
  std::vector<double> ref[3], ex[3], fa[3];
  for (int c = 0; c < 3; ++c) ref[c].assign(n, 0.0), ex[c].assign(n, NAN), fa[c].assign(n, NAN);
  for (int i = 0; i < rows; ++i)
    for (int a = 0; a < K; ++a) {
      const size_t e = size_t(i * K + a);
      auto E = [&](int x, int y) { return std::exp2(double(t.G[size_t(x * K + a)]) - double(t.G[size_t(y * K + a)])); };
      for (int j = 0; j <= i; ++j) {
        ref[0][e] += double(t.D[size_t(i * 64 + j)]) * t.Kt[size_t(j * K + a)] * E(i, j);
        ref[1][e] += double(t.M[size_t(i * 64 + j)]) * t.Kt[size_t(j * K + a)] * E(i, j);
      }
      for (int m = i; m < rows; ++m)
        ref[2][e] += (double(t.D[size_t(m * 64 + i)]) * t.Q[size_t(m * K + a)] +
                      double(t.M[size_t(m * 64 + i)]) * t.beta[size_t(m)] * t.Kt[size_t(m * K + a)]) * E(m, i);
      float q, r, c;
      intra_exact(s, i, a, q, r, c);
      ex[0][e] = q, ex[1][e] = r, ex[2][e] = c;
    }
  for (int I = 0; I < 4; ++I)
    for (int a = 0; a < K; ++a) {
      float q[16], r[16], c[16];
      intra_factored(s, I, a, q, r, c);
      for (int u = 0; u < 16; ++u) {
        const int i = 16 * I + u;
        if (i >= rows) continue;
        const size_t e = size_t(i * K + a);
        fa[0][e] = q[u], fa[1][e] = r[u], fa[2][e] = c[u];
      }
    }
  const char* names[3] = {"dq intra", "dk rows", "dk columns"};
  for (int c = 0; c < 3; ++c) {
    EXPECT_LE(rel(ex[c], ref[c]), 2e-6) << names[c] << " exact";
    EXPECT_LE(rel(fa[c], ref[c]), 2e-6) << names[c] << " factored";
  }
}

TEST(KdaBwdIntraCpu, FactoredAndExactMatchFp64) {
  for (int K : {128, 60, 48})
    for (int rows : {64, 37, 17, 16, 1})
      for (float decay : {0.5f, 20.f, 1000.f}) check(K, rows, decay);
}

}  // namespace
}  // namespace encore::test
