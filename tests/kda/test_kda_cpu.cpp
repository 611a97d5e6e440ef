// KDA CPU references: chunked forward == token recurrence (fp64), the hand-written backward ==
// central finite differences (fp64), the public forward in bf16/fp32, and bad inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "encore/kda.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/kda/kda_grad_check.hpp"
#include "kda/problem.hpp"
#include "kda/reference/kda_ref.hpp"

namespace encore::test {
namespace {

// One named problem for the parameterized suites.
struct ShapeCase {
  const char* name;
  int64_t B, T, H, K, V;
  std::vector<int64_t> cu;
  Gate gate;
  bool h0, l2;
  int64_t HV = 0;  // value heads (0: H)
  KdaCase make() const {
    KdaCase c{B, T, H, K, V, cu, gate, h0, l2};
    c.HV = HV;
    return c;
  }
};

void PrintTo(const ShapeCase& c, std::ostream* os) { *os << c.name; }

class KdaChunked : public ::testing::TestWithParam<ShapeCase> {};

TEST_P(KdaChunked, EqualsRecurrence) {
  const ShapeCase& c = GetParam();
  KdaCase kc = c.make();
  kc.fill(uint64_t(c.T));
  if (c.gate == Gate::kPrecomputed) {
    std::mt19937_64 rng(5);
    for (auto& e : kc.g)
      if (rng() % 4 == 0) e = -1000.0;  // extreme decays
  }
  KdaForwardArgs a = kc.args();
  kda::KdaProblem p;
  ASSERT_TRUE(kda::make_problem(a, kc.opts, &p));
  const auto in = reference::kda_prepare(p, a);
  std::vector<double> o_rec, f_rec, o_chk, f_chk;
  reference::KdaChunkTrace trace;
  reference::kda_recurrent_forward(p, in, o_rec, f_rec);
  reference::kda_chunked_forward(p, in, o_chk, f_chk, &trace);
  EXPECT_LT(rel_err(o_chk, o_rec), 1e-10);
  EXPECT_LT(rel_err(f_chk, f_rec), 1e-10);
  int64_t chunks = 0;
  for (const auto& s : p.seqs) chunks += (s.end - s.begin + 63) / 64;
  EXPECT_EQ(trace.num_chunks, chunks);
  // The first chunk-start state of each sequence is its initial state.
  EXPECT_EQ(trace.h[0], in.h0[0]);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, KdaChunked,
    ::testing::Values(ShapeCase{"fixed_B2_T130", 2, 130, 2, 8, 6, {}, Gate::kPrecomputed, true, false},
                      ShapeCase{"varlen_short_segments", 1, 171, 2, 8, 8, {0, 15, 100, 100, 171}, Gate::kSoftplusBias, true, true},
                      ShapeCase{"varlen_1_63_64_65", 1, 193, 1, 6, 5, {0, 1, 64, 128, 193}, Gate::kLowerBound, false, true},
                      ShapeCase{"softplus_no_bias_T64", 1, 64, 3, 4, 7, {}, Gate::kSoftplus, false, false},
                      ShapeCase{"grouped_hv4_varlen", 1, 150, 1, 8, 6, {0, 70, 150}, Gate::kSoftplusBias, true, true, 4}),
    [](const auto& info) { return std::string(info.param.name); });

// Central finite differences of loss = sum(o * d_o) + sum(final * d_final) against the backward.

class KdaBackward : public ::testing::TestWithParam<ShapeCase> {};

TEST_P(KdaBackward, MatchesFiniteDifferences) {
  const ShapeCase& c = GetParam();
  KdaCase kc = c.make();
  kc.fill(uint64_t(c.T * 7 + c.K));
  std::mt19937_64 rng(11);
  std::normal_distribution<double> nd;
  std::vector<double> d_o(kc.o.size()), d_fin(kc.fin.size());
  for (auto& e : d_o) e = nd(rng);
  for (auto& e : d_fin) e = 0.1 * nd(rng);

  // Analytic gradients.
  std::vector<double> dq(kc.q.size()), dk(kc.k.size()), dv(kc.v.size()), dg(kc.g.size()), db(kc.beta.size()),
      dh0(kc.init.size()), dA(kc.A_log.size()), ddt(kc.dt_bias.size());
  KdaBackwardArgs b;
  b.fwd = kc.args();
  auto like = [](std::vector<double>& x, const TensorView& t) {
    TensorView v = t;
    v.data = x.data();
    return v;
  };
  b.d_o = like(d_o, b.fwd.o);
  b.d_final_state = like(d_fin, b.fwd.final_state);
  b.dq = like(dq, b.fwd.q);
  b.dk = like(dk, b.fwd.k);
  b.dv = like(dv, b.fwd.v);
  b.dg = like(dg, b.fwd.g);
  b.dbeta = like(db, b.fwd.beta);
  if (c.h0) b.dh0 = like(dh0, b.fwd.initial_state);
  if (!kc.A_log.empty()) b.dA_log = like(dA, b.fwd.A_log);
  if (!kc.dt_bias.empty()) b.ddt_bias = like(ddt, b.fwd.dt_bias);
  Status st = run(b, kc.opts);
  ASSERT_TRUE(st) << st.to_string();

  expect_matches_finite_differences(kc, d_o, d_fin, {&dq, &dk, &dv, &dg, &db, &dh0, &dA, &ddt});

  // Given the forward's residuals the public backward reads them (the chunked backward): the same
  // gradients, with h saved (G, Aqk, Akk, h) and rematerialized (h absent).
  int64_t chunks = 0;
  ASSERT_TRUE(kda_chunk_count(b.fwd, kc.opts, &chunks));
  const int64_t B = kc.B, T = kc.T, H = kc.Hv(), K = kc.K, V = kc.V;  // residuals per value head
  std::vector<double> G(size_t(B * T * H * K)), Aqk(size_t(B * T * H * 64)), Akk(Aqk.size()), h(size_t(chunks * H * K * V));
  KdaForwardArgs f = kc.args();
  f.residuals = {TensorView::contiguous(G.data(), DType::kFP64, {B, T, H, K}), TensorView::contiguous(Aqk.data(), DType::kFP64, {B, T, H, 64}),
                 TensorView::contiguous(Akk.data(), DType::kFP64, {B, T, H, 64}),
                 TensorView::contiguous(h.data(), DType::kFP64, {chunks, H, K, V})};
  ASSERT_TRUE(run(f, kc.opts));
  for (bool saved_h : {true, false}) {
    SCOPED_TRACE(saved_h ? "saved h" : "rematerialized h");
    std::vector<double> dq2(dq.size()), dk2(dk.size()), dv2(dv.size()), dg2(dg.size()), db2(db.size()), dh02(dh0.size()), dA2(dA.size()),
        ddt2(ddt.size());
    KdaBackwardArgs b2 = b;
    b2.fwd.residuals = f.residuals;
    if (!saved_h) b2.fwd.residuals.h = TensorView{};
    b2.dq = like(dq2, b.fwd.q);
    b2.dk = like(dk2, b.fwd.k);
    b2.dv = like(dv2, b.fwd.v);
    b2.dg = like(dg2, b.fwd.g);
    b2.dbeta = like(db2, b.fwd.beta);
    if (c.h0) b2.dh0 = like(dh02, b.fwd.initial_state);
    if (!kc.A_log.empty()) b2.dA_log = like(dA2, b.fwd.A_log);
    if (!kc.dt_bias.empty()) b2.ddt_bias = like(ddt2, b.fwd.dt_bias);
    ASSERT_TRUE(run(b2, kc.opts));
    for (auto [x, y] : {std::pair{&dq, &dq2}, {&dk, &dk2}, {&dv, &dv2}, {&dg, &dg2}, {&db, &db2}, {&dh0, &dh02}, {&dA, &dA2}, {&ddt, &ddt2}})
      for (size_t i = 0; i < x->size(); ++i) ASSERT_NEAR((*y)[i], (*x)[i], 1e-10 * (1.0 + std::fabs((*x)[i]))) << i;
  }
  KdaBackwardArgs bad = b;
  bad.fwd.residuals = f.residuals;
  bad.fwd.residuals.h.shape[0] = chunks + 1;
  Status sb = run(bad, kc.opts);
  EXPECT_FALSE(sb.is_ok());
  EXPECT_NE(sb.message().find("residuals.h: expected [NT, HV, K, V]"), std::string::npos) << sb.message();
}

INSTANTIATE_TEST_SUITE_P(
    Cases, KdaBackward,
    ::testing::Values(ShapeCase{"precomputed_h0_l2", 2, 5, 2, 3, 2, {}, Gate::kPrecomputed, true, true},
                      ShapeCase{"varlen_softplus_bias", 1, 7, 2, 3, 2, {0, 3, 3, 7}, Gate::kSoftplusBias, true, false},
                      ShapeCase{"softplus_no_bias_l2", 1, 4, 1, 4, 3, {}, Gate::kSoftplus, false, true},
                      ShapeCase{"lower_bound", 1, 6, 2, 2, 3, {0, 2, 6}, Gate::kLowerBound, true, true},
                      ShapeCase{"grouped_hv2_softplus_bias_l2", 1, 7, 1, 3, 2, {0, 3, 7}, Gate::kSoftplusBias, true, true, 2},
                      ShapeCase{"grouped_hv4_precomputed_B2", 2, 4, 1, 2, 2, {}, Gate::kPrecomputed, true, true, 4}),
    [](const auto& info) { return std::string(info.param.name); });

// The public forward on bf16 inputs writes bf16 o and fp32 final state close to the fp64 reference.
TEST(KdaForward, Bf16InputsMatchFp64Reference) {
  KdaCase kc{1, 150, 2, 16, 16, {0, 70, 150}, Gate::kSoftplusBias, true, true};
  kc.fill(3);
  KdaForwardArgs a64 = kc.args();
  ASSERT_TRUE(run(a64, kc.opts));
  // Same (rounded) inputs in bf16; outputs bf16 / fp32.
  auto to_bf16 = [](const std::vector<double>& x) {
    std::vector<uint16_t> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = float_to_bf16(float(x[i]));
    return y;
  };
  auto q = to_bf16(kc.q), k = to_bf16(kc.k), v = to_bf16(kc.v), g = to_bf16(kc.g), be = to_bf16(kc.beta);
  std::vector<uint16_t> o(kc.o.size());
  std::vector<float> fin(kc.fin.size(), NAN), init(kc.init.begin(), kc.init.end()), alog(kc.A_log.begin(), kc.A_log.end()),
      dtb(kc.dt_bias.begin(), kc.dt_bias.end());
  KdaForwardArgs a = a64;
  a.q.data = q.data(); a.q.dtype = DType::kBF16;
  a.k.data = k.data(); a.k.dtype = DType::kBF16;
  a.v.data = v.data(); a.v.dtype = DType::kBF16;
  a.g.data = g.data(); a.g.dtype = DType::kBF16;
  a.beta.data = be.data(); a.beta.dtype = DType::kBF16;
  a.o.data = o.data(); a.o.dtype = DType::kBF16;
  a.final_state.data = fin.data(); a.final_state.dtype = DType::kFP32;
  a.initial_state.data = init.data(); a.initial_state.dtype = DType::kFP32;
  a.A_log.data = alog.data(); a.A_log.dtype = DType::kFP32;
  a.dt_bias.data = dtb.data(); a.dt_bias.dtype = DType::kFP32;
  Status st = run(a, kc.opts);
  ASSERT_TRUE(st) << st.to_string();
  std::vector<double> o_d(o.size()), f_d(fin.begin(), fin.end());
  for (size_t i = 0; i < o.size(); ++i) o_d[i] = bf16_to_float(o[i]);
  EXPECT_LT(rel_err(o_d, kc.o), 5e-2);  // bf16 rounding of every input, against the unrounded fp64 run
  EXPECT_LT(rel_err(f_d, kc.fin), 5e-2);
}

// fp16 inputs and outputs (fla's test matrix uses them): the forward and the backward read and write
// them, close to the fp64 run on the unrounded inputs.
TEST(KdaForward, Fp16InputsMatchFp64Reference) {
  KdaCase kc{1, 150, 2, 16, 16, {0, 70, 150}, Gate::kSoftplusBias, true, true};
  kc.HV = 4;
  kc.fill(4);
  KdaForwardArgs a64 = kc.args();
  ASSERT_TRUE(run(a64, kc.opts));
  auto to_h = [](const std::vector<double>& x) {
    std::vector<uint16_t> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = float_to_fp16(float(x[i]));
    return y;
  };
  auto from_h = [](const std::vector<uint16_t>& x) {
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = fp16_to_float(x[i]);
    return y;
  };
  auto q = to_h(kc.q), k = to_h(kc.k), v = to_h(kc.v), g = to_h(kc.g), be = to_h(kc.beta);
  std::vector<uint16_t> o(kc.o.size());
  std::vector<float> fin(kc.fin.size(), NAN);
  KdaForwardArgs a = a64;
  auto half = [](TensorView& t, std::vector<uint16_t>& x) {
    t.data = x.data();
    t.dtype = DType::kFP16;
  };
  half(a.q, q), half(a.k, k), half(a.v, v), half(a.g, g), half(a.beta, be), half(a.o, o);
  a.final_state.data = fin.data();
  a.final_state.dtype = DType::kFP32;
  Status st = run(a, kc.opts);
  ASSERT_TRUE(st) << st.to_string();
  const std::vector<double> f_d(fin.begin(), fin.end());
  EXPECT_LT(rel_err(from_h(o), kc.o), 5e-3);  // fp16 rounding (2^-11) of every input and of o
  EXPECT_LT(rel_err(f_d, kc.fin), 5e-3);

  // The backward: fp16 d_o and fp16 gradients, against the fp64 backward.
  std::vector<double> d_o(kc.o.size());
  std::mt19937_64 rng(3);
  std::normal_distribution<double> nd;
  for (auto& e : d_o) e = nd(rng);
  std::vector<double> dq(kc.q.size()), dk(kc.k.size()), dv(kc.v.size()), dg(kc.g.size()), db(kc.beta.size());
  KdaBackwardArgs b;
  b.fwd = a64;
  auto like = [](auto& x, const TensorView& t, DType dt) {
    TensorView r = t;
    r.data = x.data();
    r.dtype = dt;
    return r;
  };
  b.d_o = like(d_o, a64.o, DType::kFP64);
  b.dq = like(dq, a64.q, DType::kFP64), b.dk = like(dk, a64.k, DType::kFP64), b.dv = like(dv, a64.v, DType::kFP64);
  b.dg = like(dg, a64.g, DType::kFP64), b.dbeta = like(db, a64.beta, DType::kFP64);
  ASSERT_TRUE(run(b, kc.opts));
  auto d_oh = to_h(d_o);
  std::vector<uint16_t> hq(dq.size()), hk(dk.size()), hv(dv.size()), hg(dg.size()), hb(db.size());
  KdaBackwardArgs bh;
  bh.fwd = a;
  bh.fwd.o = TensorView{};
  bh.fwd.final_state = TensorView{};
  bh.d_o = like(d_oh, a64.o, DType::kFP16);
  bh.dq = like(hq, a64.q, DType::kFP16), bh.dk = like(hk, a64.k, DType::kFP16), bh.dv = like(hv, a64.v, DType::kFP16);
  bh.dg = like(hg, a64.g, DType::kFP16), bh.dbeta = like(hb, a64.beta, DType::kFP16);
  st = run(bh, kc.opts);
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_LT(rel_err(from_h(hq), dq), 1e-2);
  EXPECT_LT(rel_err(from_h(hk), dk), 1e-2);
  EXPECT_LT(rel_err(from_h(hv), dv), 1e-2);
  EXPECT_LT(rel_err(from_h(hg), dg), 1e-2);
  EXPECT_LT(rel_err(from_h(hb), db), 1e-2);
}

// Grouped value heads (HV = 2H): forward and backward (token-level, and chunked from the forward's
// residuals with and without h) equal an explicit head-repeat computation in fp64, dq and dk being
// the sums over each q/k head's value heads.
TEST(KdaGrouped, EqualsHeadRepeat) {
  for (bool l2 : {false, true}) {
    SCOPED_TRACE(l2 ? "l2" : "no l2");
    KdaCase gc{1, 150, 2, 8, 6, {0, 70, 71, 150}, Gate::kSoftplusBias, true, l2};
    gc.HV = 4;
    gc.fill(l2 ? 8 : 9);
    KdaCase rc = gc.head_repeated();
    ASSERT_EQ(rc.H, 4);
    KdaForwardArgs ga = gc.args(), ra = rc.args();
    ASSERT_TRUE(run(ga, gc.opts));
    ASSERT_TRUE(run(ra, rc.opts));
    for (size_t i = 0; i < gc.o.size(); ++i) ASSERT_NEAR(gc.o[i], rc.o[i], 1e-12 * (1 + std::fabs(rc.o[i]))) << i;
    for (size_t i = 0; i < gc.fin.size(); ++i) ASSERT_NEAR(gc.fin[i], rc.fin[i], 1e-12 * (1 + std::fabs(rc.fin[i]))) << i;

    std::mt19937_64 rng(13);
    std::normal_distribution<double> nd;
    std::vector<double> d_o(gc.o.size()), d_fin(gc.fin.size());
    for (auto& e : d_o) e = nd(rng);
    for (auto& e : d_fin) e = 0.1 * nd(rng);
    struct Grads {
      std::vector<double> dq, dk, dv, dg, db, dh0, dA, ddt;
    };
    auto backward = [&](KdaCase& c, KdaForwardArgs f, const KdaResiduals& res) {
      Grads r{std::vector<double>(c.q.size()), std::vector<double>(c.k.size()), std::vector<double>(c.v.size()), std::vector<double>(c.g.size()),
              std::vector<double>(c.beta.size()), std::vector<double>(c.init.size()), std::vector<double>(c.A_log.size()),
              std::vector<double>(c.dt_bias.size())};
      auto like = [](std::vector<double>& x, const TensorView& t) {
        TensorView v = t;
        v.data = x.data();
        return v;
      };
      KdaBackwardArgs b;
      b.fwd = f;
      b.fwd.residuals = res;
      b.d_o = like(d_o, f.o);
      b.d_final_state = like(d_fin, f.final_state);
      b.dq = like(r.dq, f.q), b.dk = like(r.dk, f.k), b.dv = like(r.dv, f.v), b.dg = like(r.dg, f.g), b.dbeta = like(r.db, f.beta);
      b.dh0 = like(r.dh0, f.initial_state), b.dA_log = like(r.dA, f.A_log), b.ddt_bias = like(r.ddt, f.dt_bias);
      Status st = run(b, c.opts);
      EXPECT_TRUE(st) << st.to_string();
      return r;
    };
    const Grads rg = backward(rc, rc.args(), {});
    // The grouped forward's residuals (per value head).
    int64_t nt = 0;
    ASSERT_TRUE(kda_chunk_count(ga, gc.opts, &nt));
    const int64_t T = gc.T, HV = 4, K = gc.K, V = gc.V;
    std::vector<double> G(size_t(T * HV * K)), Aqk(size_t(T * HV * 64)), Akk(Aqk.size()), h(size_t(nt * HV * K * V));
    const KdaResiduals res{TensorView::contiguous(G.data(), DType::kFP64, {1, T, HV, K}),
                           TensorView::contiguous(Aqk.data(), DType::kFP64, {1, T, HV, 64}),
                           TensorView::contiguous(Akk.data(), DType::kFP64, {1, T, HV, 64}),
                           TensorView::contiguous(h.data(), DType::kFP64, {nt, HV, K, V})};
    KdaForwardArgs gr = gc.args();
    gr.residuals = res;
    ASSERT_TRUE(run(gr, gc.opts));
    KdaResiduals remat = res;
    remat.h = TensorView{};
    for (int mode = 0; mode < 3; ++mode) {
      SCOPED_TRACE(mode == 0 ? "token-level" : mode == 1 ? "chunked, saved h" : "chunked, rematerialized");
      const Grads gg = backward(gc, gc.args(), mode == 0 ? KdaResiduals{} : mode == 1 ? res : remat);
      auto near = [](const std::vector<double>& x, const std::vector<double>& y, const char* name) {
        ASSERT_EQ(x.size(), y.size()) << name;
        for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(x[i], y[i], 1e-10 * (1 + std::fabs(y[i]))) << name << " " << i;
      };
      near(gg.dv, rg.dv, "dv"), near(gg.dg, rg.dg, "dg"), near(gg.db, rg.db, "dbeta"), near(gg.dh0, rg.dh0, "dh0");
      near(gg.dA, rg.dA, "dA_log"), near(gg.ddt, rg.ddt, "ddt_bias");
      std::vector<double> sq(gc.q.size(), 0.0), sk(gc.k.size(), 0.0);  // the repeat's dq, dk summed over each group
      for (int64_t t = 0; t < T; ++t)
        for (int64_t hv = 0; hv < HV; ++hv)
          for (int64_t c = 0; c < K; ++c) {
            sq[size_t((t * 2 + hv / 2) * K + c)] += rg.dq[size_t((t * HV + hv) * K + c)];
            sk[size_t((t * 2 + hv / 2) * K + c)] += rg.dk[size_t((t * HV + hv) * K + c)];
          }
      near(gg.dq, sq, "dq"), near(gg.dk, sk, "dk");
    }
  }
}

// The GPU test's strong-decay case (tests/kda/test_kda_gpu.cpp, "varlen strong decays") is meant to
// send diagonal blocks down each of the chunk kernel's three paths (one reference, two references,
// halving references); the GPU test checks its own draw, this checks that the draw does so reliably.
TEST(KdaForward, StrongDecayCaseCoversEveryDiagonalBlockPath) {
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    KdaCase c{1, 300, 8, 128, 128, {0, 100, 300}, Gate::kSoftplusBias, true, true};
    c.strong_decays = true;
    c.fill(seed);
    const auto paths = c.diag_block_paths();
    EXPECT_GT(paths.one_ref, 0) << "seed " << seed;
    EXPECT_GT(paths.two_refs, 0) << "seed " << seed;
    EXPECT_GT(paths.halving, 0) << "seed " << seed;
    EXPECT_EQ(paths.one_ref + paths.two_refs + paths.halving, 8 * (7 + 13)) << "seed " << seed;  // 100 + 200 tokens: 7 + 13 blocks a head
  }
}

// The public forward's residual outputs equal the chunked reference's intermediates (G, Aqk, A, h)
// and o / final state still equal the recurrence.
TEST(KdaForward, ResidualsForTheBackward) {
  KdaCase kc{1, 150, 2, 16, 8, {0, 70, 71, 150}, Gate::kSoftplusBias, true, true};
  kc.fill(5);
  KdaForwardArgs a = kc.args();
  int64_t nt = 0;
  ASSERT_TRUE(kda_chunk_count(a, kc.opts, &nt));
  EXPECT_EQ(nt, 2 + 1 + 2);  // 70, 1 and 79 tokens
  std::vector<double> G(kc.q.size(), NAN), Aqk(size_t(150 * 2 * 64), NAN), Akk(Aqk.size(), NAN), h(size_t(nt * 2 * 16 * 8), NAN);
  a.residuals.G = TensorView::contiguous(G.data(), DType::kFP64, {1, 150, 2, 16});
  a.residuals.Aqk = TensorView::contiguous(Aqk.data(), DType::kFP64, {1, 150, 2, 64});
  a.residuals.Akk = TensorView::contiguous(Akk.data(), DType::kFP64, {1, 150, 2, 64});
  a.residuals.h = TensorView::contiguous(h.data(), DType::kFP64, {nt, 2, 16, 8});
  Status st = run(a, kc.opts);
  ASSERT_TRUE(st) << st.to_string();
  kda::KdaProblem p;
  ASSERT_TRUE(kda::make_problem(a, kc.opts, &p));
  const reference::KdaInputs in = reference::kda_prepare(p, a);
  std::vector<double> o_rec, f_rec, o_chk, f_chk;
  reference::kda_recurrent_forward(p, in, o_rec, f_rec);
  reference::KdaChunkTrace trace;
  reference::kda_chunked_forward(p, in, o_chk, f_chk, &trace);
  EXPECT_EQ(G, trace.G);
  EXPECT_EQ(Aqk, trace.Aqk);
  EXPECT_EQ(Akk, trace.A);
  EXPECT_EQ(h, trace.h);
  EXPECT_LT(rel_err(kc.o, o_rec), 1e-10);
  EXPECT_LT(rel_err(kc.fin, f_rec), 1e-10);
  // A is unit lower triangular on the valid rows: A[t, t mod 64] = 1.
  EXPECT_EQ(Akk[size_t((3 * 2 + 1) * 64 + 3)], 1.0);
  // Wrong residual shapes are refused by name.
  a.residuals.h = TensorView::contiguous(h.data(), DType::kFP64, {nt - 1, 2, 16, 8});
  st = run(a, kc.opts);
  EXPECT_NE(st.message().find("residuals.h: expected [NT, HV, K, V] = [5, 2, 16, 8]"), std::string::npos) << st.message();
}

// ---- bad input -------------------------------------------------------------------------------

struct KdaBad : ::testing::Test {
  KdaCase kc{1, 10, 2, 4, 4, {0, 4, 10}, Gate::kPrecomputed, true, false};
  void SetUp() override { kc.fill(1); }
  void expect_error(const KdaForwardArgs& a, const KdaOptions& o, const std::string& needle) {
    Status st = run(a, o);
    EXPECT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  }
};

TEST_F(KdaBad, CuSeqlens) {
  kc.cu = {1, 4, 10};
  expect_error(kc.args(), kc.opts, "cu_seqlens: must start at 0, got 1");
  kc.cu = {0, 6, 4, 10};
  kc.init.resize(size_t(3 * 2 * 4 * 4));
  kc.fin.resize(kc.init.size());
  expect_error(kc.args(), kc.opts, "cu_seqlens: must be non-decreasing");
  kc.cu = {0, 4, 9};
  kc.init.resize(size_t(2 * 2 * 4 * 4));
  kc.fin.resize(kc.init.size());
  expect_error(kc.args(), kc.opts, "cu_seqlens: must end at T = 10, got 9");
}

TEST_F(KdaBad, BatchWithCuSeqlens) {
  KdaCase b2{2, 10, 2, 4, 4, {0, 4, 10}, Gate::kPrecomputed, false, false};
  b2.fill(2);
  expect_error(b2.args(), b2.opts, "q: B must be 1 with cu_seqlens");
}

TEST_F(KdaBad, Shapes) {
  auto a = kc.args();
  a.beta.shape[2] = 3;
  expect_error(a, kc.opts, "beta: expected shape [B, T, HV] = [1, 10, 2], got [1, 10, 3]");
  a = kc.args();
  a.g.shape[3] = 5;
  expect_error(a, kc.opts, "g: expected shape [B, T, HV, K]");
  a = kc.args();
  a.initial_state.shape[0] = 3;
  expect_error(a, kc.opts, "initial_state: expected shape [N, HV, K, V] = [2, 2, 4, 4]");
  // Value heads: a multiple of q's heads (grouped value attention), named in the message.
  std::vector<double> v3(size_t(10 * 3 * 4));
  a = kc.args();
  a.v = TensorView::contiguous(v3.data(), DType::kFP64, {1, 10, 3, 4});
  expect_error(a, kc.opts, "v: expected [B, T, HV, V] with B = 1, T = 10 and HV a multiple of H = 2 (q's heads), got [1, 10, 3, 4]");
  std::vector<double> v4(size_t(10 * 4 * 4));
  a = kc.args();
  a.v = TensorView::contiguous(v4.data(), DType::kFP64, {1, 10, 4, 4});  // HV = 4 = 2H: g, beta, ... must follow
  expect_error(a, kc.opts, "g: expected shape [B, T, HV, K] = [1, 10, 4, 4], got [1, 10, 2, 4]");
  a = kc.args();
  a.initial_state.dtype = DType::kBF16;
  expect_error(a, kc.opts, "initial_state: dtype must be one of {fp32, fp64}");
}

TEST_F(KdaBad, HeadDims) {
  std::vector<double> big(static_cast<size_t>(10 * 2 * 300));
  auto a = kc.args();
  a.q = a.k = a.g = TensorView::contiguous(big.data(), DType::kFP64, {1, 10, 2, 300});
  expect_error(a, kc.opts, "q: head dim K = 300 exceeds 256");
}

TEST_F(KdaBad, GateOptions) {
  auto o = kc.opts;
  o.use_gate_in_kernel = true;
  expect_error(kc.args(), o, "A_log: required by the softplus in-kernel gate");
  o.use_lower_bound = true;
  o.lower_bound = -6.0;
  expect_error(kc.args(), o, "lower_bound: must lie in [-5, 0), got -6");
}

TEST_F(KdaBad, CudaLimitsAreCheckedBeforeDeviceAccess) {
  auto a = kc.args();
  for (TensorView* t : {&a.q, &a.k, &a.v, &a.g, &a.beta, &a.initial_state, &a.o, &a.final_state}) t->device = Device{DeviceType::kCUDA, 0};
  a.cu_seqlens = TensorView{};
  expect_error(a, kc.opts, "initial_state: expected shape [N, HV, K, V] = [1, 2, 4, 4]");  // N changes without cu_seqlens
  a.initial_state.shape[0] = 1;
  a.final_state.shape[0] = 1;
  // The CUDA forward's own limits are checked before any device access.
  expect_error(a, kc.opts, "q: dtype must be one of {bf16, fp16, fp32}, got fp64");  // the CUDA forward takes bf16/fp16/fp32
}

}  // namespace
}  // namespace encore::test
