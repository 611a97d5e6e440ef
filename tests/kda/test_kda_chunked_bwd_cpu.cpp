// The chunked KDA backward reference (src/kda/reference/kda_chunked_bwd.hpp), fp64: equal to the
// token-level BPTT (kda_backward) on every gradient, the saved-h and rematerialize paths equal, the
// recompute stage equal to the chunked forward's intermediates, and central finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "encore/kda.hpp"
#include "kda/problem.hpp"
#include "kda/reference/kda_chunked_bwd.hpp"
#include "kda/reference/kda_ref.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/kda/kda_grad_check.hpp"

namespace encore::test {
namespace {

constexpr double kTol = 1e-10;  // chunked vs BPTT, fp64 (docs/math/kda.md §12)

// got ~ ref within tol relative RMS (the reference's RMS floored at floor_rms); both finite, ref not
// all zero where `nonzero`. Returns the error.
double expect_close(const char* name, const std::vector<double>& got, const std::vector<double>& ref, double tol, bool nonzero = true,
                    double floor_rms = 0) {
  EXPECT_EQ(got.size(), ref.size()) << name;
  if (got.size() != ref.size()) return INFINITY;
  double ref_sq = 0;
  for (double x : ref) {
    EXPECT_TRUE(std::isfinite(x)) << name << ": reference not finite";
    ref_sq += x * x;
  }
  if (nonzero) {
    EXPECT_GT(ref_sq, 0.0) << name << ": reference is all zero";
  }
  const double e = rel_err(got, ref, floor_rms);  // INFINITY when got holds a NaN / Inf
  EXPECT_LT(e, tol) << name;
  return e;
}

// One problem of the matrix.
struct Shape {
  const char* name;
  int64_t B, T, H, K, V;
  std::vector<int64_t> cu;
};
// Lengths 1, 63, 64, 0 (empty), 65, 130; and fixed B = 2 with T = 130. K = V = 16 and K = 8, V = 12.
const Shape kShapes[] = {
    {"varlen_K16V16", 1, 323, 2, 16, 16, {0, 1, 64, 128, 128, 193, 323}},
    {"varlen_K8V12", 1, 323, 2, 8, 12, {0, 1, 64, 128, 128, 193, 323}},
    {"fixedB2_K16V16", 2, 130, 2, 16, 16, {}},
    {"fixedB2_K8V12", 2, 130, 1, 8, 12, {}},
};
const char* gate_name(Gate g) {
  switch (g) {
    case Gate::kPrecomputed: return "precomputed";
    case Gate::kSoftplus: return "softplus";
    case Gate::kSoftplusBias: return "softplus_bias";
    case Gate::kLowerBound: return "lower_bound";
  }
  return "?";
}

using Param = std::tuple<int, Gate, bool, bool, bool>;  // shape, gate, h0, dht, l2

struct Problem {
  KdaCase kc;
  std::vector<double> d_o, d_fin;  // d_fin empty without dht
  KdaForwardArgs a;
  kda::KdaProblem p;
  reference::KdaInputs in;
  reference::KdaSavedResiduals saved;  // from the public forward's residual outputs (fp64)
  std::vector<double> G, Aqk, Akk, h;
  int64_t nt = 0;

  // Builds the case, runs the public forward with every residual output.
  void make(const Shape& s, Gate gate, bool h0, bool dht, bool l2, uint64_t seed) {
    kc = KdaCase{s.B, s.T, s.H, s.K, s.V, s.cu, gate, h0, l2};
    kc.fill(seed);
    std::mt19937_64 rng(seed * 31 + 7);
    std::normal_distribution<double> nd;
    if (gate == Gate::kPrecomputed)
      for (auto& e : kc.g)
        if (rng() % 10 == 0) e = -1000.0;  // extreme decays
    d_o.resize(kc.o.size());
    for (auto& e : d_o) e = nd(rng);
    d_fin.clear();
    if (dht) {
      d_fin.resize(kc.fin.size());
      for (auto& e : d_fin) e = 0.1 * nd(rng);
    }
    a = kc.args();
    ASSERT_TRUE(kda_chunk_count(a, kc.opts, &nt));
    const size_t ntok = size_t(s.B * s.T * s.H);
    G.assign(ntok * size_t(s.K), NAN);
    Aqk.assign(ntok * 64, NAN);
    Akk.assign(ntok * 64, NAN);
    h.assign(size_t(nt * s.H * s.K * s.V), NAN);
    a.residuals.G = TensorView::contiguous(G.data(), DType::kFP64, {s.B, s.T, s.H, s.K});
    a.residuals.Aqk = TensorView::contiguous(Aqk.data(), DType::kFP64, {s.B, s.T, s.H, 64});
    a.residuals.Akk = TensorView::contiguous(Akk.data(), DType::kFP64, {s.B, s.T, s.H, 64});
    a.residuals.h = TensorView::contiguous(h.data(), DType::kFP64, {nt, s.H, s.K, s.V});
    Status st = run(a, kc.opts);
    ASSERT_TRUE(st) << st.to_string();
    ASSERT_TRUE(kda::make_problem(a, kc.opts, &p));
    in = reference::kda_prepare(p, a);
    saved = reference::kda_load_residuals(a.residuals);
  }
};

class KdaChunkedBackward : public ::testing::TestWithParam<Param> {};

TEST_P(KdaChunkedBackward, EqualsBpttSavedHAndRematerialize) {
  const auto [si, gate, h0, dht, l2] = GetParam();
  Problem pr;
  pr.make(kShapes[si], gate, h0, dht, l2, uint64_t(si * 1000 + int(gate) * 100 + h0 * 4 + dht * 2 + l2));
  if (HasFatalFailure()) return;
  const reference::KdaGrads ref = reference::kda_backward(pr.p, pr.a, pr.in, pr.d_o, pr.d_fin);
  reference::KdaBwdTrace tr_h, tr_r;
  const reference::KdaGrads gh = reference::kda_chunked_backward(pr.p, pr.a, pr.in, pr.d_o, pr.d_fin, &pr.saved, &tr_h);
  const reference::KdaGrads gr = reference::kda_chunked_backward(pr.p, pr.a, pr.in, pr.d_o, pr.d_fin, nullptr, &tr_r);
  EXPECT_FALSE(tr_h.rc.rematerialized);
  EXPECT_TRUE(tr_r.rc.rematerialized);
  EXPECT_EQ(tr_h.rc.num_chunks, pr.nt);
  const bool gate_in_kernel = gate != Gate::kPrecomputed;
  double worst = 0;
  for (const reference::KdaGrads* g : {&gh, &gr}) {
    worst = std::max(worst, expect_close("dq", g->dq, ref.dq, kTol));
    worst = std::max(worst, expect_close("dk", g->dk, ref.dk, kTol));
    worst = std::max(worst, expect_close("dv", g->dv, ref.dv, kTol));
    worst = std::max(worst, expect_close("dg", g->dg, ref.dg, kTol));
    worst = std::max(worst, expect_close("dbeta", g->dbeta, ref.dbeta, kTol));
    worst = std::max(worst, expect_close("dh0", g->dh0, ref.dh0, kTol));
    // dA_log and ddt_bias sum a head's per-element gate terms: on fresh inputs their sum can cancel to far
    // below the terms, so their error is measured against the per-element gradient's RMS at least.
    const double dg_rms = std::sqrt(std::inner_product(ref.dg.begin(), ref.dg.end(), ref.dg.begin(), 0.0) / double(std::max<size_t>(ref.dg.size(), 1)));
    worst = std::max(worst, expect_close("dA_log", g->dA_log, ref.dA_log, kTol, gate_in_kernel, dg_rms));
    worst = std::max(worst, expect_close("ddt_bias", g->ddt_bias, ref.ddt_bias, kTol, !pr.kc.dt_bias.empty(), dg_rms));
  }
  // The saved-h and rematerialize paths: the same states, Vnew, dh and gradients.
  double paths = 0;
  paths = std::max(paths, expect_close("h (saved vs remat)", tr_h.rc.h, tr_r.rc.h, 1e-13, h0));
  paths = std::max(paths, expect_close("Vnew (saved vs remat)", tr_h.rc.Vnew, tr_r.rc.Vnew, 1e-13));
  paths = std::max(paths, expect_close("dh (saved vs remat)", tr_h.rev.dh, tr_r.rev.dh, 1e-13, false));
  for (auto [name, x, y] : {std::tuple{"dq", &gh.dq, &gr.dq}, {"dk", &gh.dk, &gr.dk}, {"dv", &gh.dv, &gr.dv}, {"dg", &gh.dg, &gr.dg},
                            {"dbeta", &gh.dbeta, &gr.dbeta}, {"dh0", &gh.dh0, &gr.dh0}})
    paths = std::max(paths, expect_close(name, *x, *y, 1e-12));
  std::printf("[chunked bwd] max rel RMS err vs BPTT %.3g, saved-h vs remat %.3g\n", worst, paths);
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  const auto [si, gate, h0, dht, l2] = info.param;
  return std::string(kShapes[si].name) + "_" + gate_name(gate) + (h0 ? "_h0" : "") + (dht ? "_dht" : "") + (l2 ? "_l2" : "");
}

INSTANTIATE_TEST_SUITE_P(Matrix, KdaChunkedBackward,
                         ::testing::Combine(::testing::Range(0, 4),
                                            ::testing::Values(Gate::kPrecomputed, Gate::kSoftplus, Gate::kSoftplusBias, Gate::kLowerBound),
                                            ::testing::Bool(), ::testing::Bool(), ::testing::Bool()),
                         param_name);

// Stage 0 recomputes the chunked forward's intermediates (both paths), and the forward's saved
// residuals are what the saved-h path reads.
TEST(KdaChunkedBackwardStages, RecomputeEqualsChunkedForward) {
  Problem pr;
  pr.make(kShapes[1], Gate::kSoftplusBias, true, true, true, 17);
  if (HasFatalFailure()) return;
  std::vector<double> o, fin;
  reference::KdaChunkTrace ft;
  reference::kda_chunked_forward(pr.p, pr.in, o, fin, &ft);
  const reference::KdaSavedResiduals* paths[] = {&pr.saved, nullptr};
  for (const reference::KdaSavedResiduals* s : paths) {
    const reference::KdaBwdRecompute rc = reference::kda_bwd_recompute(pr.p, pr.in, s);
    expect_close("G", rc.G, ft.G, 1e-14);
    expect_close("Aqk", rc.Aqk, ft.Aqk, 1e-14);
    expect_close("A", rc.A, ft.A, 1e-14);
    expect_close("W", rc.W, ft.W, 1e-13);
    expect_close("U", rc.U, ft.U, 1e-13);
    expect_close("Vnew", rc.Vnew, ft.Vnew, 1e-13);
    expect_close("h", rc.h, ft.h, 1e-13);
    EXPECT_EQ(rc.num_chunks, ft.num_chunks);
  }
  EXPECT_EQ(pr.saved.h, ft.h);
}

// The stage outputs hold the identities that tie them together: dh at a sequence's last chunk is
// dht, dL strictly lower, dAqk lower, dg the reverse cumsum of dG (its first row = the chunk's sum).
TEST(KdaChunkedBackwardStages, StageOutputsAreConsistent) {
  Problem pr;
  pr.make(kShapes[0], Gate::kLowerBound, true, true, false, 23);
  if (HasFatalFailure()) return;
  reference::KdaBwdTrace tr;
  (void)reference::kda_chunked_backward(pr.p, pr.a, pr.in, pr.d_o, pr.d_fin, &pr.saved, &tr);
  const int64_t H = pr.p.H, K = pr.p.K, V = pr.p.V;
  int64_t base = 0;
  for (size_t n = 0; n < pr.p.seqs.size(); ++n) {
    const auto& s = pr.p.seqs[n];
    const int64_t nch = (s.end - s.begin + 63) / 64;
    base += nch;
    if (nch == 0) {  // an empty sequence passes the cotangent through
      for (int64_t i = 0; i < H * K * V; ++i) EXPECT_EQ(tr.rev.dh0[size_t(int64_t(n) * H * K * V + i)], pr.d_fin[size_t(int64_t(n) * H * K * V + i)]);
      continue;
    }
    for (int64_t i = 0; i < H * K * V; ++i) EXPECT_EQ(tr.rev.dh[size_t((base - 1) * H * K * V + i)], pr.d_fin[size_t(int64_t(n) * H * K * V + i)]);
    for (int64_t t = s.begin; t < s.end; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t tok = t * H + h, r = (t - s.begin) % 64;
        for (int64_t j = r; j < 64; ++j) EXPECT_EQ(tr.rev.dL[size_t(tok * 64 + j)], 0.0);
        for (int64_t j = r + 1; j < 64; ++j) EXPECT_EQ(tr.dav.dAqk[size_t(tok * 64 + j)], 0.0);
        if (r == 0) {  // a chunk's first row: dg = the chunk's sum of dG
          const int64_t rows = std::min<int64_t>(64, s.end - t);
          for (int64_t a = 0; a < K; ++a) {
            double sum = 0;
            for (int64_t i = 0; i < rows; ++i) sum += tr.rev.dG[size_t(((t + i) * H + h) * K + a)];
            EXPECT_NEAR(tr.rev.dg[size_t(tok * K + a)], sum, 1e-12 * (1 + std::fabs(sum)));
          }
        }
      }
  }
}

// The comparison can fail: dropping the final-state cotangent, or perturbing one saved state, moves
// the chunked gradients far outside the tolerance.
TEST(KdaChunkedBackwardStages, DetectsWrongInputs) {
  Problem pr;
  pr.make(kShapes[2], Gate::kSoftplusBias, true, true, true, 29);
  if (HasFatalFailure()) return;
  const reference::KdaGrads ref = reference::kda_backward(pr.p, pr.a, pr.in, pr.d_o, pr.d_fin);
  const reference::KdaGrads no_dht = reference::kda_chunked_backward(pr.p, pr.a, pr.in, pr.d_o, {}, &pr.saved);
  EXPECT_GT(rel_err(no_dht.dk, ref.dk), 1e-6);  // the last tokens' keys (h0 is decayed out over 130 tokens)
  EXPECT_GT(rel_err(no_dht.dg, ref.dg), 1e-6);
  reference::KdaSavedResiduals bad = pr.saved;
  bad.h[bad.h.size() / 2 + 3] += 1.0;  // the start state of batch row 1 (chunk 3 of 6)
  const reference::KdaGrads wrong = reference::kda_chunked_backward(pr.p, pr.a, pr.in, pr.d_o, pr.d_fin, &bad);
  EXPECT_GT(rel_err(wrong.dq, ref.dq), 1e-6);
  std::vector<double> nan_grad = ref.dq;
  nan_grad[0] = NAN;
  EXPECT_EQ(rel_err(nan_grad, ref.dq), INFINITY);
}

// The saved-h path on fp32 residuals (a padded, strided h view) read by kda_load_residuals: the
// gradients within fp32 rounding of the BPTT's, and the rounding visible (not the fp64 path).
TEST(KdaChunkedBackwardStages, Fp32StridedResiduals) {
  Problem pr;
  pr.make(kShapes[0], Gate::kSoftplusBias, true, true, true, 31);
  if (HasFatalFailure()) return;
  const int64_t B = pr.p.B, T = pr.p.T, H = pr.p.H, K = pr.p.K, V = pr.p.V, Vp = V + 3;
  std::vector<float> G(size_t(B * T * H * K), NAN), Aqk(size_t(B * T * H * 64), NAN), Akk(Aqk.size(), NAN),
      h(size_t(pr.nt * H * K * Vp), NAN);
  KdaForwardArgs a = pr.kc.args();
  a.residuals.G = TensorView::contiguous(G.data(), DType::kFP32, {B, T, H, K});
  a.residuals.Aqk = TensorView::contiguous(Aqk.data(), DType::kFP32, {B, T, H, 64});
  a.residuals.Akk = TensorView::contiguous(Akk.data(), DType::kFP32, {B, T, H, 64});
  a.residuals.h = TensorView::strided(h.data(), DType::kFP32, {pr.nt, H, K, V}, {H * K * Vp, K * Vp, Vp, 1});
  Status st = run(a, pr.kc.opts);
  ASSERT_TRUE(st) << st.to_string();
  const reference::KdaSavedResiduals saved = reference::kda_load_residuals(a.residuals);
  EXPECT_LT(rel_err(saved.h, pr.saved.h), 1e-6);
  const reference::KdaGrads ref = reference::kda_backward(pr.p, pr.a, pr.in, pr.d_o, pr.d_fin);
  const reference::KdaGrads g = reference::kda_chunked_backward(pr.p, pr.a, pr.in, pr.d_o, pr.d_fin, &saved);
  for (auto [name, x, y] : {std::tuple{"dq", &g.dq, &ref.dq}, {"dk", &g.dk, &ref.dk}, {"dv", &g.dv, &ref.dv}, {"dg", &g.dg, &ref.dg},
                            {"dbeta", &g.dbeta, &ref.dbeta}, {"dh0", &g.dh0, &ref.dh0}, {"dA_log", &g.dA_log, &ref.dA_log},
                            {"ddt_bias", &g.ddt_bias, &ref.ddt_bias}})
    expect_close(name, *x, *y, 1e-4);
  EXPECT_GT(rel_err(g.dq, ref.dq), 1e-12);  // the fp32 residuals were read, not recomputed
}

// Central finite differences of the loss against the chunked backward, for every input; tiny cases
// crossing a chunk boundary (66 rows) with an empty segment, and fixed B = 2 with T = 65.
struct FdCase {
  const char* name;
  int64_t B, T, H, K, V;
  std::vector<int64_t> cu;
  Gate gate;
  bool h0, l2, dht;
};
void PrintTo(const FdCase& c, std::ostream* os) { *os << c.name; }
class KdaChunkedBackwardFd : public ::testing::TestWithParam<FdCase> {};

TEST_P(KdaChunkedBackwardFd, MatchesFiniteDifferences) {
  const FdCase& c = GetParam();
  KdaCase kc{c.B, c.T, c.H, c.K, c.V, c.cu, c.gate, c.h0, c.l2};
  kc.fill(uint64_t(c.T * 13 + c.K));
  std::mt19937_64 rng(3);
  std::normal_distribution<double> nd;
  std::vector<double> d_o(kc.o.size()), d_fin;
  for (auto& e : d_o) e = nd(rng);
  if (c.dht) {
    d_fin.resize(kc.fin.size());
    for (auto& e : d_fin) e = 0.1 * nd(rng);
  }
  KdaForwardArgs a = kc.args();
  kda::KdaProblem p;
  ASSERT_TRUE(kda::make_problem(a, kc.opts, &p));
  const reference::KdaInputs in = reference::kda_prepare(p, a);
  const reference::KdaGrads g = reference::kda_chunked_backward(p, a, in, d_o, d_fin, nullptr);
  expect_matches_finite_differences(kc, d_o, d_fin, {&g.dq, &g.dk, &g.dv, &g.dg, &g.dbeta, &g.dh0, &g.dA_log, &g.ddt_bias});
}

INSTANTIATE_TEST_SUITE_P(
    Cases, KdaChunkedBackwardFd,
    ::testing::Values(FdCase{"varlen_66_0_4_softplus_bias_h0_l2_dht", 1, 70, 1, 3, 2, {0, 66, 66, 70}, Gate::kSoftplusBias, true, true, true},
                      FdCase{"fixedB2_T65_lower_bound_h0", 2, 65, 1, 2, 3, {}, Gate::kLowerBound, true, false, true},
                      FdCase{"fixed_T65_precomputed_l2", 1, 65, 2, 2, 2, {}, Gate::kPrecomputed, false, true, false}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace encore::test
