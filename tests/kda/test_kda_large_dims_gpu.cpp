// KDA on CUDA with large head dims (128 < K or V <= 256: the token-recurrent fp32 path,
// kda_recurrent.cu / kda_recurrent_bwd.cu). Per case: the CUDA forward with poisoned (NaN) outputs
// writes o, the final state and the residuals (G fp32; Aqk, Akk and, saved-h, h in the inputs' dtype,
// bf16 for fp16); the CUDA backward then runs with poisoned gradients and a NaN-filled workspace,
// with all the residuals (saved-h) or none (rematerialize). Compared on the same rounded inputs against the CPU
// fp64 references: o, final state against the recurrence; G, Aqk, Akk, h against the chunked
// reference's trace; every gradient (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias) against the BPTT.
// Bounds: relative RMS <= 5e-3 (o, state, dq, dk, dv, dh0), 1e-2 (dg, dbeta, dA_log, ddt_bias), the
// residuals 5e-3 in bf16 and 1e-4 in fp32; NaN never passes; a second backward gives the same bits.
// Matrix: K = V = 256, K 256 / V 64, K 64 / V 200, K 200 / V 136; varlen with empty segments and
// fla's (30, 50), B = 2 fixed length; h0 and d_final_state; softplus with and without dt_bias, lower
// bound -5, precomputed gates; L2 norm on and off; HV = 2H; bf16, fp32 (and fp16 on two cases).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <random>
#include <string>

#include "encore/kda.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/kda/kda_device_vec.hpp"

namespace encore::test {
namespace {

struct LargeCase {
  KdaCase c;
  const char* label;
  bool dht = true;
};

// One case in one dtype: the fp64 references once, then the CUDA forward and backward on each path
// (saved h, rematerialize) against them.
void run_large(LargeCase lc, DType dt, std::initializer_list<bool> remat_modes) {
  KdaCase& c = lc.c;
  SCOPED_TRACE(std::string(lc.label) + " " + dtype_name(dt));
  if (!c.l2) c.k_sd = 0.08 * std::sqrt(128.0 / double(c.K));  // contractive keys (β|k|² < 1) without the L2 norm
  c.fill(uint64_t(c.T * 13 + c.K * 7 + c.V));
  const int64_t B = c.B, T = c.T, H = c.Hv(), Hq = c.H, K = c.K, V = c.V, N = c.N();
  const DType gdt = c.opts.use_gate_in_kernel ? dt : DType::kFP32;
  const DType rdt = dt == DType::kFP16 ? DType::kBF16 : dt;
  auto q = dev(c.q, dt, {B, T, Hq, K}), k = dev(c.k, dt, {B, T, Hq, K}), v = dev(c.v, dt, {B, T, H, V}), g = dev(c.g, gdt, {B, T, H, K}),
       beta = dev(c.beta, dt, {B, T, H});
  std::unique_ptr<DevVec> h0, A_log, dt_bias;
  KdaForwardArgs in;
  in.q = q->view, in.k = k->view, in.v = v->view, in.g = g->view, in.beta = beta->view;
  if (c.h0) in.initial_state = (h0 = dev(c.init, DType::kFP32, {N, H, K, V}))->view;
  if (!c.A_log.empty()) in.A_log = (A_log = dev(c.A_log, DType::kFP32, {H}))->view;
  if (!c.dt_bias.empty()) in.dt_bias = (dt_bias = dev(c.dt_bias, DType::kFP32, {H * K}))->view;
  if (!c.cu.empty()) in.cu_seqlens = TensorView::contiguous(c.cu.data(), DType::kInt64, {int64_t(c.cu.size())});
  int64_t nt = 0;
  ASSERT_TRUE(kda_chunk_count(in, c.opts, &nt));
  const size_t nG = size_t(B * T * H * K), nQ = size_t(B * T * Hq * K), nA = size_t(B * T * H * 64), nH = size_t(nt * H * K * V);

  // The CPU chunked forward (fp64) with its trace: o, final state (equal to the recurrence to 1e-10) and the residuals.
  std::vector<double> G(nG, NAN), Aqk(nA, NAN), Akk(nA, NAN), hh(nH, NAN);
  {
    KdaForwardArgs r = c.args();
    r.residuals.G = TensorView::contiguous(G.data(), DType::kFP64, {B, T, H, K});
    r.residuals.Aqk = TensorView::contiguous(Aqk.data(), DType::kFP64, {B, T, H, 64});
    r.residuals.Akk = TensorView::contiguous(Akk.data(), DType::kFP64, {B, T, H, 64});
    r.residuals.h = TensorView::contiguous(hh.data(), DType::kFP64, {nt, H, K, V});
    ASSERT_TRUE(run(r, c.opts));
  }
  // The fp64 BPTT on the rounded inputs (no residuals: the token-level backward).
  auto [d_o, d_fin] = cotangents(c, uint64_t(T * 31 + K));
  std::vector<std::vector<double>> ex = {std::vector<double>(nQ, NAN),         std::vector<double>(nQ, NAN),
                                         std::vector<double>(c.v.size(), NAN), std::vector<double>(nG, NAN),
                                         std::vector<double>(c.beta.size(), NAN), std::vector<double>(c.init.size(), NAN),
                                         std::vector<double>(size_t(H), NAN),  std::vector<double>(size_t(H * K), NAN)};
  {
    KdaBackwardArgs r;
    r.fwd = c.args();
    r.d_o = TensorView::contiguous(d_o.data(), DType::kFP64, {B, T, H, V});
    if (lc.dht) r.d_final_state = TensorView::contiguous(d_fin.data(), DType::kFP64, {N, H, K, V});
    r.dq = TensorView::contiguous(ex[0].data(), DType::kFP64, {B, T, Hq, K});
    r.dk = TensorView::contiguous(ex[1].data(), DType::kFP64, {B, T, Hq, K});
    r.dv = TensorView::contiguous(ex[2].data(), DType::kFP64, {B, T, H, V});
    r.dg = TensorView::contiguous(ex[3].data(), DType::kFP64, {B, T, H, K});
    r.dbeta = TensorView::contiguous(ex[4].data(), DType::kFP64, {B, T, H});
    if (c.h0) r.dh0 = TensorView::contiguous(ex[5].data(), DType::kFP64, {N, H, K, V});
    if (!c.A_log.empty()) r.dA_log = TensorView::contiguous(ex[6].data(), DType::kFP64, {H});
    if (!c.dt_bias.empty()) r.ddt_bias = TensorView::contiguous(ex[7].data(), DType::kFP64, {H * K});
    ASSERT_TRUE(run(r, c.opts));
  }
  auto ddo = dev(d_o, dt, {B, T, H, V});
  std::unique_ptr<DevVec> ddfin;
  if (lc.dht) ddfin = dev(d_fin, DType::kFP32, {N, H, K, V});

  for (const bool remat : remat_modes) {
    SCOPED_TRACE(remat ? "remat" : "saved-h");
    std::string line;
    auto check = [&](const char* name, const std::vector<double>& got, const std::vector<double>& want, double tol) {
      const double e = rel_err(got, want);
      char buf[64];
      std::snprintf(buf, sizeof buf, " %s %.2e", name, e);
      line += buf;
      EXPECT_TRUE(std::isfinite(e)) << name << ": NaN/inf (or an unwritten output)";
      EXPECT_LE(e, tol) << name;
    };
    auto o = poisoned(c.o.size(), dt, {B, T, H, V}), fin = poisoned(c.fin.size(), DType::kFP32, {N, H, K, V});
    KdaForwardArgs a = in;
    a.o = o->view, a.final_state = fin->view;
    auto rG = poisoned(nG, DType::kFP32, {B, T, H, K}), rAqk = poisoned(nA, rdt, {B, T, H, 64}), rAkk = poisoned(nA, rdt, {B, T, H, 64}),
         rh = poisoned(nH, rdt, {nt, H, K, V});
    a.residuals.G = rG->view, a.residuals.Aqk = rAqk->view, a.residuals.Akk = rAkk->view;
    if (!remat) a.residuals.h = rh->view;
    EXPECT_EQ(workspace_bytes(a, c.opts), size_t(0)) << "the token-recurrent forward takes no workspace";
    {
      const Status st = run(a, c.opts, nullptr);
      ASSERT_TRUE(st) << "forward: " << st.to_string();
      ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    }
    const bool bf = rdt != DType::kFP32;
    check("o", o->fetch(), c.o, 5e-3);
    check("state", fin->fetch(), c.fin, 5e-3);
    check("G", rG->fetch(), G, 1e-5);
    check("Aqk", rAqk->fetch(), Aqk, bf ? 5e-3 : 1e-4);
    check("Akk", rAkk->fetch(), Akk, bf ? 5e-3 : 1e-4);
    if (!remat) check("h", rh->fetch(), hh, bf ? 5e-3 : 1e-4);

    KdaBackwardArgs b;
    b.fwd = a;
    if (remat) b.fwd.residuals = KdaResiduals{};  // this path reads h at most: rematerialize from no residuals at all
    b.d_o = ddo->view;
    if (ddfin) b.d_final_state = ddfin->view;
    auto dq = poisoned(nQ, dt, {B, T, Hq, K}), dk = poisoned(nQ, dt, {B, T, Hq, K}), dv = poisoned(c.v.size(), dt, {B, T, H, V}),
         dg = poisoned(nG, dt, {B, T, H, K}), dbeta = poisoned(c.beta.size(), dt, {B, T, H});
    b.dq = dq->view, b.dk = dk->view, b.dv = dv->view, b.dg = dg->view, b.dbeta = dbeta->view;
    std::unique_ptr<DevVec> dh0, dA, ddt;
    if (c.h0) b.dh0 = (dh0 = poisoned(c.init.size(), DType::kFP32, {N, H, K, V}))->view;
    if (!c.A_log.empty()) b.dA_log = (dA = poisoned(size_t(H), DType::kFP32, {H}))->view;
    if (!c.dt_bias.empty()) b.ddt_bias = (ddt = poisoned(size_t(H * K), DType::kFP32, {H * K}))->view;
    const size_t ws_bytes = workspace_bytes(b, c.opts);
    EXPECT_GT(ws_bytes, size_t(0));
    {
      const Status st = run(b, c.opts, nullptr);
      EXPECT_NE(st.to_string().find("workspace"), std::string::npos) << st.to_string();
    }
    DeviceBuffer ws(std::max<size_t>(ws_bytes, 16));
    ASSERT_NE(ws.ptr, nullptr) << ws_bytes << " bytes of workspace";
    ENCORE_ASSERT_CUDA(cudaMemset(ws.ptr, 0xff, ws.bytes));  // NaN: a read of an unwritten slot shows
    {
      const Status st = run(b, c.opts, ws.ptr);
      ASSERT_TRUE(st) << "backward: " << st.to_string();
      ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    }
    const char* names[8] = {"dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"};
    const DevVec* gpu[8] = {dq.get(), dk.get(), dv.get(), dg.get(), dbeta.get(), dh0.get(), dA.get(), ddt.get()};
    for (int i = 0; i < 8; ++i)
      if (gpu[i]) check(names[i], gpu[i]->fetch(), ex[size_t(i)], i == 3 || i == 4 || i >= 6 ? 1e-2 : 5e-3);
    // Deterministic: a second run (workspace reused) gives the same bits.
    const std::vector<double> dq1 = dq->fetch(), dk1 = dk->fetch(), dg1 = dg->fetch(), db1 = dbeta->fetch();
    ASSERT_TRUE(run(b, c.opts, ws.ptr));
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    EXPECT_TRUE(dq->fetch() == dq1 && dk->fetch() == dk1 && dg->fetch() == dg1 && dbeta->fetch() == db1) << "a second run differs";
    std::printf("  kda large %-40s %-4s %-7s%s\n", lc.label, dtype_name(dt), remat ? "remat" : "saved-h", line.c_str());
  }
}

class KdaLargeDimsGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

KdaCase grouped(KdaCase c, int64_t hv) {
  c.HV = hv;
  return c;
}

std::vector<LargeCase> matrix() {
  return {
      {KdaCase{1, 330, 2, 256, 256, {0, 0, 70, 330}, Gate::kSoftplusBias, true, true}, "K256 V256 varlen empty/70/260 sp+b h0 l2"},
      {KdaCase{2, 150, 2, 256, 64, {}, Gate::kLowerBound, true, true}, "K256 V64 fixed B2 T150 lb-5 h0 l2"},
      {KdaCase{1, 300, 2, 64, 200, {0, 5, 5, 300}, Gate::kPrecomputed, false, false}, "K64 V200 varlen 5/empty/295 precomputed", false},
      {grouped(KdaCase{1, 200, 1, 256, 256, {0, 30, 80, 200}, Gate::kSoftplus, true, true}, 2), "HV=2H K256 V256 varlen 30/50/120 sp h0 l2"},
      {grouped(KdaCase{1, 140, 1, 200, 136, {0, 0, 140}, Gate::kLowerBound, false, true}, 2), "HV=2H K200 V136 empty/140 lb-5 l2"},
  };
}

// Both paths per case and dtype (the references are the expensive part, computed once).
TEST_F(KdaLargeDimsGpu, SavedHAndRematerializeMatchReferences) {
  for (const LargeCase& lc : matrix())
    for (DType dt : {DType::kFP32, DType::kBF16}) run_large(lc, dt, {false, true});
}

TEST_F(KdaLargeDimsGpu, Fp16) {
  const std::vector<LargeCase> cases = matrix();
  for (int i : {0, 3}) run_large(cases[size_t(i)], DType::kFP16, {false, true});
}

}  // namespace
}  // namespace encore::test
