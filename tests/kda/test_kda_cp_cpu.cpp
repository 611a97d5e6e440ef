// KDA context parallelism, the fp64 CPU reference (src/kda/reference/kda_cp.hpp; docs/math/kda.md §10): a
// global varlen batch split over simulated ranks, each rank running the public CPU forward and
// backward on its own slice with the merged initial state (forward) and the merged d_final_state
// (backward) of the sequences it shares with its neighbours, against the whole batch in one pass:
// outputs and every gradient equal to fp64 rounding; the split's metadata. And the identities the CUDA
// summaries are composed of (kda/kda_cp_compose.hpp), run on the CPU backend: S_ext = the forward's final
// state from 0, M = the final state of the forward with v = 0 from h0 = I, dS_ext = the backward's dh0,
// dM = Mᵀ, against the token-by-token reference summaries.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "encore/kda.hpp"
#include "encore/kda_cp.hpp"
#include "kda/kda_cp_compose.hpp"
#include "kda/problem.hpp"
#include "kda/reference/kda_cp.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/kda/kda_cp_case.hpp"

namespace encore::test {
namespace {

using reference::KdaCpRank;
using reference::KdaCpSummary;

Grads backward(KdaCase& c, std::vector<double>& d_o, std::vector<double>* d_final) {
  bool ok = false;
  Grads g = cpu_backward(c, d_o, d_final, &ok);
  EXPECT_TRUE(ok);
  return g;
}

struct Layout {
  const char* name;
  std::vector<int64_t> cu, bounds;
};

void run_layout(const Layout& L, Gate gate, bool l2, int64_t HV) {
  SCOPED_TRACE(std::string(L.name) + (l2 ? " l2" : "") + " HV " + std::to_string(HV));
  const int64_t T = L.cu.back(), H = 2, K = 8, V = 6;
  KdaCase global{1, T, H, K, V, L.cu, gate, false, l2};
  global.HV = HV;
  global.final_state = false;
  global.fill(uint64_t(T) * 31 + uint64_t(L.bounds.size()));
  const int64_t Hv = global.Hv();
  ASSERT_TRUE(run(global.args(), global.opts));
  std::vector<double> d_o(size_t(T * Hv * V));
  std::mt19937_64 rng(static_cast<uint64_t>(T) ^ std::random_device{}());  // fresh each run
  std::normal_distribution<double> nd;
  for (auto& e : d_o) e = nd(rng);
  const Grads want = backward(global, d_o, nullptr);

  const std::vector<KdaCpRank> ranks = reference::kda_cp_split(L.cu, L.bounds);
  const int R = int(ranks.size());
  // Each rank's slice as a local varlen problem (its pieces of the sequences).
  std::vector<KdaCase> local;
  for (const KdaCpRank& r : ranks) {
    KdaCase c{1, r.t1 - r.t0, H, K, V, r.cu, gate, true, l2};
    c.HV = HV;
    c.final_state = false;
    c.opts = global.opts;
    c.opts.output_final_state = false;
    c.q = rows(global.q, r.t0, r.t1, H * K);
    c.k = rows(global.k, r.t0, r.t1, H * K);
    c.v = rows(global.v, r.t0, r.t1, Hv * V);
    c.g = rows(global.g, r.t0, r.t1, Hv * K);
    c.beta = rows(global.beta, r.t0, r.t1, Hv);
    c.A_log = global.A_log;
    c.dt_bias = global.dt_bias;
    c.init.assign(size_t(c.N() * Hv * K * V), 0.0);
    c.o.assign(size_t(c.T * Hv * V), NAN);
    local.push_back(c);
  }
  // Summaries, each rank on its own data: forward of its last piece, backward of its first.
  std::vector<KdaCpSummary> fwd(static_cast<size_t>(R)), bwd(static_cast<size_t>(R));
  std::vector<std::vector<double>> d_o_local(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    kda::KdaProblem p;
    ASSERT_TRUE(kda::make_problem(local[size_t(r)].args(), local[size_t(r)].opts, &p));
    const reference::KdaInputs in = reference::kda_prepare(p, local[size_t(r)].args());
    d_o_local[size_t(r)] = rows(d_o, ranks[size_t(r)].t0, ranks[size_t(r)].t1, Hv * V);
    fwd[size_t(r)] = reference::kda_cp_forward_summary(p, in, int64_t(p.seqs.size()) - 1);
    bwd[size_t(r)] = reference::kda_cp_backward_summary(p, in, d_o_local[size_t(r)], 0);
  }
  std::vector<double> dA_log(want.dA_log.size(), 0.0), ddt_bias(want.ddt_bias.size(), 0.0);
  for (int r = 0; r < R; ++r) {
    const KdaCpRank& rk = ranks[size_t(r)];
    KdaCase& c = local[size_t(r)];
    SCOPED_TRACE("rank " + std::to_string(r) + " pre " + std::to_string(rk.pre_num_ranks) + " post " + std::to_string(rk.post_num_ranks));
    if (rk.pre_num_ranks > 0) {  // the first piece's initial state from the earlier ranks (nearest last)
      std::vector<const KdaCpSummary*> chain;
      for (int j = r - rk.pre_num_ranks; j < r; ++j) chain.push_back(&fwd[size_t(j)]);
      const std::vector<double> s0 = reference::kda_cp_merge(chain, Hv, K, V);
      std::copy(s0.begin(), s0.end(), c.init.begin());
    }
    ASSERT_TRUE(run(c.args(), c.opts));
    EXPECT_LT(rel_err(c.o, rows(global.o, rk.t0, rk.t1, Hv * V)), 1e-11) << "o";
    std::vector<double> d_final(size_t(c.N() * Hv * K * V), 0.0);
    if (rk.post_num_ranks > 0) {  // the last piece's d_final_state from the later ranks (furthest first)
      std::vector<const KdaCpSummary*> chain;
      for (int j = r + rk.post_num_ranks; j > r; --j) chain.push_back(&bwd[size_t(j)]);
      const std::vector<double> ds = reference::kda_cp_merge(chain, Hv, K, V);
      std::copy(ds.begin(), ds.end(), d_final.end() - int64_t(ds.size()));
    }
    const Grads got = backward(c, d_o_local[size_t(r)], &d_final);
    EXPECT_LT(rel_err(got.dq, rows(want.dq, rk.t0, rk.t1, H * K)), 1e-10) << "dq";
    EXPECT_LT(rel_err(got.dk, rows(want.dk, rk.t0, rk.t1, H * K)), 1e-10) << "dk";
    EXPECT_LT(rel_err(got.dv, rows(want.dv, rk.t0, rk.t1, Hv * V)), 1e-10) << "dv";
    EXPECT_LT(rel_err(got.dg, rows(want.dg, rk.t0, rk.t1, Hv * K)), 1e-10) << "dg";
    EXPECT_LT(rel_err(got.dbeta, rows(want.dbeta, rk.t0, rk.t1, Hv)), 1e-10) << "dbeta";
    for (size_t i = 0; i < dA_log.size(); ++i) dA_log[i] += got.dA_log[i];  // the all-reduce of the gate parameters
    for (size_t i = 0; i < ddt_bias.size(); ++i) ddt_bias[i] += got.ddt_bias[i];
  }
  if (!global.A_log.empty()) EXPECT_LT(rel_err(dA_log, want.dA_log), 1e-10) << "dA_log";
  if (!global.dt_bias.empty()) EXPECT_LT(rel_err(ddt_bias, want.ddt_bias), 1e-10) << "ddt_bias";
}

const Layout kLayouts[] = {
    {"three sequences over 4 ranks", {0, 150, 220, 520}, {0, 130, 260, 390, 520}},
    {"one sequence over 4 ranks", {0, 400}, {0, 100, 200, 300, 400}},
    {"short sequences over 2 ranks", {0, 10, 25, 60, 61, 90, 130, 200}, {0, 100, 200}},
    {"boundaries on sequence ends", {0, 64, 128, 300}, {0, 64, 128, 300}},
    {"odd slices", {0, 7, 333}, {0, 5, 71, 200, 201, 333}},
};

TEST(KdaCpCpu, SplitForwardAndBackwardEqualTheWholeBatch) {
  for (const Layout& L : kLayouts) run_layout(L, Gate::kSoftplusBias, true, 0);
  run_layout(kLayouts[0], Gate::kPrecomputed, false, 0);
  run_layout(kLayouts[1], Gate::kLowerBound, true, 4);  // grouped value heads
}

TEST(KdaCpCpu, SplitMetadata) {
  const auto r = reference::kda_cp_split({0, 150, 220, 520}, {0, 130, 260, 390, 520});
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0].cu, (std::vector<int64_t>{0, 130}));
  EXPECT_EQ(r[1].cu, (std::vector<int64_t>{0, 20, 90, 130}));
  EXPECT_EQ(r[1].seq_ids, (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(r[0].pre_num_ranks, 0);
  EXPECT_EQ(r[0].post_num_ranks, 1);
  EXPECT_EQ(r[1].pre_num_ranks, 1);
  EXPECT_EQ(r[1].post_num_ranks, 2);  // sequence 2 runs over ranks 2 and 3
  EXPECT_EQ(r[2].pre_num_ranks, 1);
  EXPECT_EQ(r[2].post_num_ranks, 1);
  EXPECT_EQ(r[3].pre_num_ranks, 2);
  EXPECT_EQ(r[3].post_num_ranks, 0);
  const auto one = reference::kda_cp_split({0, 400}, {0, 100, 200, 300, 400});
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(one[size_t(i)].pre_num_ranks, i);
    EXPECT_EQ(one[size_t(i)].post_num_ranks, 3 - i);
  }
  const auto aligned = reference::kda_cp_split({0, 64, 128, 300}, {0, 64, 128, 300});
  for (const auto& k : aligned) EXPECT_TRUE(k.pre_num_ranks == 0 && k.post_num_ranks == 0);
}


// The composed summaries (the CUDA path's runs, on the CPU backend in fp64) against the reference, per
// piece of a local problem with an empty piece; the reference is also what run_cp_*_summary gives on CPU.
void composed_matches_reference(Gate gate, bool l2, int64_t HV) {
  SCOPED_TRACE(std::string("gate ") + std::to_string(int(gate)) + (l2 ? " l2" : "") + " HV " + std::to_string(HV));
  const std::vector<int64_t> cu = {0, 37, 37, 130, 200};
  const int64_t T = cu.back(), H = 2, K = 8, V = 6;
  KdaCase c{1, T, H, K, V, cu, gate, false, l2};
  c.HV = HV;
  c.final_state = false;
  c.fill(uint64_t(T) * 7 + uint64_t(HV));
  const int64_t Hv = c.Hv();
  std::vector<double> d_o(size_t(T * Hv * V));
  std::mt19937_64 rng(11);
  std::normal_distribution<double> nd;
  for (auto& e : d_o) e = nd(rng);
  kda::KdaProblem p;
  ASSERT_TRUE(kda::make_problem(c.args(), c.opts, &p));
  const reference::KdaInputs in = reference::kda_prepare(p, c.args());
  double worst[4] = {0, 0, 0, 0};
  for (int64_t n = 0; n < int64_t(cu.size()) - 1; ++n) {
    for (bool backward : {false, true}) {
      const KdaCpSummary want = backward ? reference::kda_cp_backward_summary(p, in, d_o, n) : reference::kda_cp_forward_summary(p, in, n);
      std::vector<double> S(size_t(Hv * K * V), NAN), M(size_t(Hv * K * K), NAN);
      KdaCpSummaryArgs a;
      a.fwd = c.args();
      a.fwd.o = TensorView{};
      a.piece = n;
      a.S = TensorView::contiguous(S.data(), DType::kFP64, {Hv, K, V});
      a.M = TensorView::contiguous(M.data(), DType::kFP64, {Hv, K, K});
      if (backward) a.d_o = TensorView::contiguous(d_o.data(), DType::kFP64, {1, T, Hv, V});
      const size_t bytes = kda::cp_compose_workspace_bytes(a, c.opts, backward);
      EXPECT_EQ(bytes == 0, cu[size_t(n)] == cu[size_t(n) + 1]) << "piece " << n;
      std::vector<double> ws(bytes / sizeof(double) + 32, NAN);  // NaN scratch: a read of an unwritten value shows
      void* base = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 255) / 256 * 256);
      const Status st = kda::cp_compose_summary(a, c.opts, backward, base, nullptr);
      ASSERT_TRUE(st) << st.to_string();
      const double eS = rel_err(S, want.S), eM = rel_err(M, want.M);
      EXPECT_LT(eS, 1e-11) << (backward ? "dS_ext" : "S_ext") << " piece " << n;
      EXPECT_LT(eM, 1e-11) << (backward ? "dM" : "M") << " piece " << n;
      worst[backward ? 2 : 0] = std::max(worst[backward ? 2 : 0], eS);
      worst[backward ? 3 : 1] = std::max(worst[backward ? 3 : 1], eM);
      // The public entry on CPU tensors (the reference) gives the same.
      std::vector<double> S2(S.size()), M2(M.size());
      a.S.data = S2.data();
      a.M.data = M2.data();
      ASSERT_TRUE(backward ? run_cp_backward_summary(a, c.opts) : run_cp_forward_summary(a, c.opts));
      EXPECT_EQ(rel_err(S2, want.S), 0.0);
      EXPECT_EQ(rel_err(M2, want.M), 0.0);
    }
  }
  std::printf("[ composed ] relative RMS vs reference: S_ext %.1e  M %.1e  dS_ext %.1e  dM %.1e\n", worst[0], worst[1], worst[2], worst[3]);
}

TEST(KdaCpCpu, ComposedSummariesEqualTheReference) {
  composed_matches_reference(Gate::kSoftplusBias, true, 0);
  composed_matches_reference(Gate::kPrecomputed, false, 0);
  composed_matches_reference(Gate::kLowerBound, true, 4);  // grouped value heads
}

TEST(KdaCpCpu, SummaryRefusals) {
  KdaCase c{1, 16, 1, 4, 4, {0, 16}, Gate::kPrecomputed, false, false};
  c.final_state = false;
  c.fill(3);
  std::vector<double> S(16), M(16);
  KdaCpSummaryArgs a;
  a.fwd = c.args();
  a.piece = 1;
  a.S = TensorView::contiguous(S.data(), DType::kFP64, {1, 4, 4});
  a.M = TensorView::contiguous(M.data(), DType::kFP64, {1, 4, 4});
  EXPECT_EQ(run_cp_forward_summary(a, c.opts).code(), StatusCode::kInvalidArgument);  // piece out of range
  a.piece = 0;
  EXPECT_EQ(run_cp_backward_summary(a, c.opts).code(), StatusCode::kInvalidArgument);  // no d_o
  EXPECT_EQ(cp_forward_summary_workspace_bytes(a, c.opts), 0u);  // CPU: no workspace
  a.M = TensorView::contiguous(M.data(), DType::kFP64, {1, 4, 3});
  EXPECT_EQ(run_cp_forward_summary(a, c.opts).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace encore::test
