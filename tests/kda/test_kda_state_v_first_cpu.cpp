// fla's state_v_first on the CPU backend: states [.., HV, V, K] give exactly the transposes of the
// default layout's states and the same o and gradients (forward, backward, recurrent step, prefill on a
// pool), and states in the wrong layout are refused naming the argument.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "encore/kda.hpp"
#include "encore/kda_serving.hpp"
#include "tests/kda/kda_case.hpp"

namespace encore::test {
namespace {

TensorView states(std::vector<double>& x, int64_t rows, int64_t HV, int64_t d2, int64_t d3) {
  return TensorView::contiguous(x.data(), DType::kFP64, {rows, HV, d2, d3});
}

KdaCase make_case() {
  KdaCase c{1, 150, 2, 24, 40, {0, 70, 70, 150}, Gate::kSoftplus, true, true};  // varlen, an empty sequence, K != V
  c.HV = 4;
  c.fill(7);
  return c;
}

TEST(KdaStateVFirst, ForwardTransposesStates) {
  KdaCase c = make_case();
  const int64_t N = c.N(), HV = c.Hv(), K = c.K, V = c.V;
  ASSERT_TRUE(run(c.args(), c.opts));
  const std::vector<double> o = c.o, fin = c.fin;
  std::vector<double> init_t = transpose_states(c.init, N, HV, K, V), fin_t(fin.size(), -1.0);
  KdaForwardArgs a = c.args();
  a.initial_state = states(init_t, N, HV, V, K);
  a.final_state = states(fin_t, N, HV, V, K);
  KdaOptions o2 = c.opts;
  o2.state_v_first = true;
  std::fill(c.o.begin(), c.o.end(), 0.0);
  ASSERT_TRUE(run(a, o2));
  EXPECT_EQ(c.o, o);
  EXPECT_EQ(fin_t, transpose_states(fin, N, HV, K, V));
  // The chunked reference (residuals requested): the same final state, transposed.
  std::vector<double> G(size_t(c.B * c.T * HV * K)), fin_r(fin.size());
  a.final_state = states(fin_r, N, HV, V, K);
  a.residuals.G = TensorView::contiguous(G.data(), DType::kFP64, {c.B, c.T, HV, K});
  ASSERT_TRUE(run(a, o2));
  EXPECT_LT(rel_err(fin_r, fin_t), 1e-10);
  // The [K, V] layout is refused with state_v_first (K != V), naming the argument and the layout.
  KdaForwardArgs bad = c.args();
  const Status st = validate(bad, o2);
  EXPECT_FALSE(st);
  EXPECT_NE(st.message().find("initial_state"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("[N, HV, V, K] (state_v_first)"), std::string::npos) << st.message();
  bad.initial_state = a.initial_state;
  const Status st2 = validate(bad, o2);  // final_state still [N, HV, K, V]
  EXPECT_FALSE(st2);
  EXPECT_NE(st2.message().find("final_state"), std::string::npos) << st2.message();
}

TEST(KdaStateVFirst, BackwardTransposesStateGradients) {
  for (bool residuals : {false, true}) {
    KdaCase c = make_case();
    const int64_t N = c.N(), HV = c.Hv(), K = c.K, V = c.V;
    std::mt19937_64 rng(11);
    std::normal_distribution<double> nd;
    std::vector<double> d_o(c.o.size()), d_fin(size_t(N * HV * K * V));
    for (auto& x : d_o) x = nd(rng);
    for (auto& x : d_fin) x = nd(rng);
    std::vector<double> G(size_t(c.B * c.T * HV * K)), Aqk(size_t(c.B * c.T * HV * 64)), Akk(Aqk.size());
    KdaForwardArgs f = c.args();
    if (residuals) {
      f.residuals.G = TensorView::contiguous(G.data(), DType::kFP64, {c.B, c.T, HV, K});
      f.residuals.Aqk = TensorView::contiguous(Aqk.data(), DType::kFP64, {c.B, c.T, HV, 64});
      f.residuals.Akk = TensorView::contiguous(Akk.data(), DType::kFP64, {c.B, c.T, HV, 64});
      ASSERT_TRUE(run(f, c.opts));
    }
    auto grads = [&](bool vf, std::vector<std::vector<double>>& out) {
      out.assign(7, {});
      out[0].resize(c.q.size()), out[1].resize(c.k.size()), out[2].resize(c.v.size()), out[3].resize(c.g.size());
      out[4].resize(c.beta.size()), out[5].resize(d_fin.size()), out[6].resize(c.A_log.size());
      std::vector<double> init_t = transpose_states(c.init, N, HV, K, V), d_fin_t = transpose_states(d_fin, N, HV, K, V);
      KdaBackwardArgs b;
      b.fwd = f;
      b.fwd.o = b.fwd.final_state = TensorView{};
      if (vf) b.fwd.initial_state = states(init_t, N, HV, V, K);
      b.d_o = TensorView::contiguous(d_o.data(), DType::kFP64, {c.B, c.T, HV, V});
      b.d_final_state = vf ? states(d_fin_t, N, HV, V, K) : states(d_fin, N, HV, K, V);
      b.dq = TensorView::contiguous(out[0].data(), DType::kFP64, {c.B, c.T, c.H, K});
      b.dk = TensorView::contiguous(out[1].data(), DType::kFP64, {c.B, c.T, c.H, K});
      b.dv = TensorView::contiguous(out[2].data(), DType::kFP64, {c.B, c.T, HV, V});
      b.dg = TensorView::contiguous(out[3].data(), DType::kFP64, {c.B, c.T, HV, K});
      b.dbeta = TensorView::contiguous(out[4].data(), DType::kFP64, {c.B, c.T, HV});
      b.dh0 = vf ? states(out[5], N, HV, V, K) : states(out[5], N, HV, K, V);
      b.dA_log = TensorView::contiguous(out[6].data(), DType::kFP64, {HV});
      KdaOptions o = c.opts;
      o.state_v_first = vf;
      o.output_final_state = false;
      const Status st = run(b, o);
      ASSERT_TRUE(st) << st.message();
      if (vf) {  // a [K, V] d_final_state is refused
        b.d_final_state = states(d_fin, N, HV, K, V);
        const Status bad = validate(b, o);
        EXPECT_FALSE(bad);
        EXPECT_NE(bad.message().find("d_final_state"), std::string::npos) << bad.message();
      }
    };
    std::vector<std::vector<double>> ref, vf;
    grads(false, ref);
    grads(true, vf);
    for (int i = 0; i < 7; ++i)
      if (i != 5) EXPECT_EQ(vf[size_t(i)], ref[size_t(i)]) << "gradient " << i << (residuals ? " (chunked)" : "");
    EXPECT_EQ(vf[5], transpose_states(ref[5], N, HV, K, V)) << (residuals ? "chunked" : "token");
  }
}

// The recurrent step: states mode (initial_state -> final_state) and the pool with [N] slots and [N, S]
// token slots; the prefill on a pool.
TEST(KdaStateVFirst, ServingTransposesStates) {
  KdaCase c = make_case();
  const int64_t N = c.N(), HV = c.Hv(), K = c.K, V = c.V, P = 5;
  const KdaForwardArgs f = c.args();
  auto recurrent_args = [&] {
    KdaRecurrentArgs r;
    r.q = f.q, r.k = f.k, r.v = f.v, r.g = f.g, r.beta = f.beta, r.A_log = f.A_log, r.dt_bias = f.dt_bias, r.cu_seqlens = f.cu_seqlens;
    r.o = f.o;
    return r;
  };
  KdaRecurrentOptions ro;
  ro.use_qk_l2norm = c.opts.use_qk_l2norm, ro.use_gate_in_kernel = c.opts.use_gate_in_kernel;
  ro.use_beta_sigmoid = true;
  // States mode.
  {
    std::vector<double> fin(c.init.size()), init_t = transpose_states(c.init, N, HV, K, V), fin_t(c.init.size());
    KdaRecurrentArgs r = recurrent_args();
    r.initial_state = states(c.init, N, HV, K, V), r.final_state = states(fin, N, HV, K, V);
    ASSERT_TRUE(run(r, ro));
    const std::vector<double> o = c.o;
    KdaRecurrentOptions rv = ro;
    rv.state_v_first = true;
    r.initial_state = states(init_t, N, HV, V, K), r.final_state = states(fin_t, N, HV, V, K);
    ASSERT_TRUE(run(r, rv));
    EXPECT_EQ(c.o, o);
    EXPECT_EQ(fin_t, transpose_states(fin, N, HV, K, V));
    r.final_state = states(fin, N, HV, K, V);
    const Status bad = validate(r, rv);
    EXPECT_FALSE(bad);
    EXPECT_NE(bad.message().find("final_state: expected [N, HV, V, K] (state_v_first)"), std::string::npos) << bad.message();
  }
  // The pool, [N] slots (sequence 1 has no tokens), then the prefill on the pool.
  std::vector<double> pool(size_t(P * HV * K * V));
  std::mt19937_64 rng(3);
  std::normal_distribution<double> nd(0.0, 0.5);
  for (auto& x : pool) x = nd(rng);
  std::vector<int64_t> idx = {3, 0, 1};
  for (bool prefill : {false, true}) {
    std::vector<double> pa = pool, pb = transpose_states(pool, P, HV, K, V);
    std::vector<double> oa;
    if (!prefill) {
      KdaRecurrentArgs r = recurrent_args();
      r.state_indices = TensorView::contiguous(idx.data(), DType::kInt64, {N});
      r.initial_state = states(pa, P, HV, K, V);
      ASSERT_TRUE(run(r, ro));
      oa = c.o;
      KdaRecurrentOptions rv = ro;
      rv.state_v_first = true;
      r.initial_state = states(pb, P, HV, V, K);
      ASSERT_TRUE(run(r, rv));
      r.initial_state = states(pa, P, HV, K, V);
      const Status bad = validate(r, rv);
      EXPECT_FALSE(bad);
      EXPECT_NE(bad.message().find("initial_state: expected [P, HV, V, K] (state_v_first)"), std::string::npos) << bad.message();
    } else {
      KdaPoolForwardArgs pf;
      pf.fwd = f;
      pf.fwd.initial_state = pf.fwd.final_state = TensorView{};
      pf.state_indices = TensorView::contiguous(idx.data(), DType::kInt64, {N});
      pf.pool = states(pa, P, HV, K, V);
      ASSERT_TRUE(run(pf, c.opts));
      oa = c.o;
      KdaOptions ov = c.opts;
      ov.state_v_first = true;
      pf.pool = states(pb, P, HV, V, K);
      ASSERT_TRUE(run(pf, ov));
      pf.pool = states(pa, P, HV, K, V);
      const Status bad = validate(pf, ov);
      EXPECT_FALSE(bad);
      EXPECT_NE(bad.message().find("pool: expected [P, HV, V, K] (state_v_first)"), std::string::npos) << bad.message();
    }
    EXPECT_EQ(c.o, oa) << (prefill ? "prefill" : "recurrent");
    EXPECT_EQ(pb, transpose_states(pa, P, HV, K, V)) << (prefill ? "prefill" : "recurrent");
    EXPECT_NE(pa, pool);  // the slots were written
  }
  // [N, S] token slots: every token's state, transposed.
  {
    const int64_t S = 80;
    std::vector<int64_t> tidx(size_t(N * S), -1);
    for (int64_t n = 0; n < N; ++n) tidx[size_t(n * S)] = n;  // start slot n; token 0 rewrites it
    tidx[size_t(0 * S + 69)] = 4;                             // sequence 0's last token into slot 4
    std::vector<double> pa = pool, pb = transpose_states(pool, P, HV, K, V);
    KdaRecurrentArgs r = recurrent_args();
    r.state_indices = TensorView::contiguous(tidx.data(), DType::kInt64, {N, S});
    r.initial_state = states(pa, P, HV, K, V);
    ASSERT_TRUE(run(r, ro));
    const std::vector<double> o = c.o;
    KdaRecurrentOptions rv = ro;
    rv.state_v_first = true;
    r.initial_state = states(pb, P, HV, V, K);
    ASSERT_TRUE(run(r, rv));
    EXPECT_EQ(c.o, o);
    EXPECT_EQ(pb, transpose_states(pa, P, HV, K, V));
  }
}

}  // namespace
}  // namespace encore::test
