// The second CUDA KDA backward's stages K0 (prep), K1 (the reverse scan) and K2a (the state products),
// src/kda/cuda/kda_bwd2.cu and kda_bwd2_grad.cu, against the CPU chunked backward (fp64) fed the GPU
// forward's own residuals (G fp32; Aqk, Akk and h in the inputs' dtype): per chunk dS' (the cotangent
// of its end state), dVnew = Aqk^T dO + Kg dS' per token, and dh0; K2a's dq / dk inter-chunk parts,
// dW, dAqk, dA and rowsum(S . dS'). The kernels round their intermediates to bf16 (Qg, Kg, W,
// Aqk^T dO, dS', dVnew, Vnew), so the bound is bf16's: relative RMS <= 1e-2 (dh0 2e-2: a 30-chunk
// chain; K2a 1.5e-2: it takes K1's rounded dS' and dVnew). The workspace is poisoned (NaN) first and
// rows past a sequence's end must stay so; a second run gives the same bits. The row loader's fast
// (cp.async) and generic paths give the same bits on the same values (RowLoaderPathsAreBitIdentical).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>

#include "encore/kda.hpp"
#include "kda/cuda/kda_bwd2.hpp"
#include "kda/problem.hpp"
#include "kda/reference/kda_chunked_bwd.hpp"
#include "kda/testing.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/kda/kda_device_vec.hpp"

namespace encore::test {
namespace {

using cuda::kKda2D;

struct Case {
  KdaCase c;
  const char* label;
};

// bf16 values of a [rows][HV][128] or [NT][HV][128][128] workspace tensor at byte offset `at`.
std::vector<double> fetch_bf16(const DeviceBuffer& ws, size_t at, size_t n) {
  std::vector<unsigned char> bytes(n * 2);
  cudaMemcpy(bytes.data(), ws.at(at), bytes.size(), cudaMemcpyDeviceToHost);
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = load_as_double(bytes.data(), DType::kBF16, int64_t(i));
  return out;
}

void run_case(Case cs) {
  KdaCase& c = cs.c;
  SCOPED_TRACE(cs.label);
  if (!c.l2) c.k_sd = 0.08 * std::sqrt(128.0 / double(c.K));
  c.fill(uint64_t(c.T * 17 + c.K));
  const DType dt = DType::kBF16;
  const int64_t B = c.B, T = c.T, H = c.Hv(), Hq = c.H, K = c.K, V = c.V, N = c.N();
  KdaDeviceForward f(c, dt, dt, /*remat=*/false);
  ASSERT_TRUE(f.counted);
  {
    const Status st = f.run(c);
    ASSERT_TRUE(st) << "forward: " << st.to_string();
  }
  const KdaForwardArgs& a = f.a;
  const int64_t nt = f.nt;
  const auto &rG = f.rG, &rAqk = f.rAqk, &rAkk = f.rAkk, &rh = f.rh;
  auto [d_o, d_fin] = cotangents(c, uint64_t(T * 29 + K));
  auto ddo = dev(d_o, dt, {B, T, H, V}), ddfin = dev(d_fin, DType::kFP32, {N, H, K, V});
  auto dh0 = poisoned(size_t(N * H * K * V), DType::kFP32, {N, H, K, V});
  // The gradient outputs validate() asks for (the stages write none of them).
  auto dq = poisoned(size_t(B * T * Hq * K), dt, {B, T, Hq, K}), dk = poisoned(size_t(B * T * Hq * K), dt, {B, T, Hq, K}),
       dv = poisoned(c.v.size(), dt, {B, T, H, V}), dg = poisoned(size_t(B * T * H * K), dt, {B, T, H, K}),
       dbeta = poisoned(c.beta.size(), dt, {B, T, H});
  KdaBackwardArgs b;
  b.fwd = a;
  b.d_o = ddo->view;
  b.d_final_state = ddfin->view;
  if (c.h0) b.dh0 = dh0->view;
  b.dq = dq->view, b.dk = dk->view, b.dv = dv->view, b.dg = dg->view, b.dbeta = dbeta->view;

  size_t bytes = 0;
  {
    const Status st = kda::bwd2_stages_workspace(b, c.opts, &bytes);
    ASSERT_TRUE(st) << st.to_string();
  }
  DeviceBuffer ws(bytes);
  ENCORE_ASSERT_CUDA(cudaMemset(ws.ptr, 0xff, ws.bytes));  // NaN in bf16 and fp32
  cuda::Kda2Layout layout;
  const Status st = kda::bwd2_stages(b, c.opts, ws.ptr, nullptr, &layout);
  ASSERT_TRUE(st) << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());

  // The CPU chunked backward on the GPU's residuals.
  KdaForwardArgs ra = c.args();
  std::vector<double> G = rG->fetch(), Aqk = rAqk->fetch(), Akk = rAkk->fetch(), hh = rh->fetch();
  ra.residuals.G = TensorView::contiguous(G.data(), DType::kFP64, {B, T, H, K});
  ra.residuals.Aqk = TensorView::contiguous(Aqk.data(), DType::kFP64, {B, T, H, 64});
  ra.residuals.Akk = TensorView::contiguous(Akk.data(), DType::kFP64, {B, T, H, 64});
  ra.residuals.h = TensorView::contiguous(hh.data(), DType::kFP64, {nt, H, K, V});
  kda::KdaProblem p;
  ASSERT_TRUE(kda::make_problem(ra, c.opts, &p));
  const reference::KdaInputs in = reference::kda_prepare(p, ra);
  const reference::KdaSavedResiduals saved = reference::kda_load_residuals(ra.residuals);
  reference::KdaBwdTrace tr;
  (void)reference::kda_chunked_backward(p, ra, in, d_o, d_fin, &saved, &tr);

  // dS' per chunk: [NT][H][128][128] -> [NT][H][K][V].
  const std::vector<double> dsp = fetch_bf16(ws, layout.dsp, size_t(nt * H) * kKda2D * kKda2D);
  std::vector<double> got_dh(size_t(nt * H * K * V));
  for (int64_t s = 0; s < nt * H; ++s)
    for (int64_t x = 0; x < K; ++x)
      for (int64_t y = 0; y < V; ++y) got_dh[size_t((s * K + x) * V + y)] = dsp[size_t((s * kKda2D + x) * kKda2D + y)];
  // dVnew per token: [B*T][H][128] -> [B, T, H, V]; rows outside every sequence stay NaN (unwritten).
  const std::vector<double> dvn = fetch_bf16(ws, layout.dvn, size_t(B * T * H) * kKda2D);
  std::vector<double> got_dv(size_t(B * T * H * V)), ref_dv = tr.rev.dVnew;
  for (int64_t r = 0; r < B * T * H; ++r)
    for (int64_t y = 0; y < V; ++y) got_dv[size_t(r * V + y)] = dvn[size_t(r * kKda2D + y)];
  // Tokens of no sequence (varlen T past cu's last entry): both sides skip them.
  if (!c.cu.empty())
    for (int64_t t = c.cu.back(); t < T; ++t)
      for (int64_t x = 0; x < H * V; ++x) got_dv[size_t(t * H * V + x)] = ref_dv[size_t(t * H * V + x)] = 0;
  // K2a: [B*T][H][W] workspace rows (bf16 or fp32) -> [B, T, H, C]; tokens of no sequence zero on
  // both sides (ref is zeroed there in place).
  auto rows_of = [&](size_t at, int64_t W, int64_t C, bool bf16, std::vector<double>& ref) {
    std::vector<double> raw(size_t(B * T * H * W));
    if (bf16) raw = fetch_bf16(ws, at, raw.size());
    else {
      std::vector<float> f(raw.size());
      cudaMemcpy(f.data(), ws.at(at), f.size() * sizeof(float), cudaMemcpyDeviceToHost);
      for (size_t i = 0; i < f.size(); ++i) raw[i] = f[i];
    }
    std::vector<double> out(size_t(B * T * H * C));
    for (int64_t r = 0; r < B * T * H; ++r)
      for (int64_t y = 0; y < C; ++y) out[size_t(r * C + y)] = raw[size_t(r * W + y)];
    if (!c.cu.empty())
      for (int64_t t = c.cu.back(); t < T; ++t)
        for (int64_t x = 0; x < H * C; ++x) out[size_t(t * H * C + x)] = ref[size_t(t * H * C + x)] = 0;
    return out;
  };
  const double e_dqi = rel_err(rows_of(layout.dqi, kKda2D, K, false, tr.rev.dq_inter), tr.rev.dq_inter);
  const double e_dki = rel_err(rows_of(layout.dki, kKda2D, K, false, tr.rev.dk_inter), tr.rev.dk_inter);
  const double e_dw = rel_err(rows_of(layout.dw, kKda2D, K, true, tr.rev.dW), tr.rev.dW);
  const double e_daqk = rel_err(rows_of(layout.daqk, 64, 64, true, tr.dav.dAqk), tr.dav.dAqk);
  const double e_da = rel_err(rows_of(layout.da, 64, 64, true, tr.rev.dA), tr.rev.dA);
  std::vector<double> ref_sd(size_t(nt * H * K)), got_sd(ref_sd.size());
  {
    std::vector<float> f(size_t(nt * H) * kKda2D);
    cudaMemcpy(f.data(), ws.at(layout.sd), f.size() * sizeof(float), cudaMemcpyDeviceToHost);
    for (int64_t s = 0; s < nt * H; ++s)
      for (int64_t x = 0; x < K; ++x) {
        double acc = 0;
        for (int64_t y = 0; y < V; ++y) acc += tr.rc.h[size_t((s * K + x) * V + y)] * tr.rev.dh[size_t((s * K + x) * V + y)];
        ref_sd[size_t(s * K + x)] = acc;
        got_sd[size_t(s * K + x)] = f[size_t(s * kKda2D + x)];
      }
  }
  const double e_sd = rel_err(got_sd, ref_sd);
  std::printf("  kda bwd2 K2a %-46s dqi %.2e dki %.2e dW %.2e dAqk %.2e dA %.2e sd %.2e\n", cs.label, e_dqi, e_dki, e_dw, e_daqk,
              e_da, e_sd);
  for (const double e : {e_dqi, e_dki, e_dw, e_daqk, e_da, e_sd}) {
    EXPECT_TRUE(std::isfinite(e)) << "NaN/inf (or an unwritten value) in K2a's outputs";
    EXPECT_LE(e, 1.5e-2);
  }
  const double e_dh = rel_err(got_dh, tr.rev.dh), e_dv = rel_err(got_dv, ref_dv), e_h0 = c.h0 ? rel_err(dh0->fetch(), tr.rev.dh0) : 0.0;
  std::printf("  kda bwd2 K0+K1 %-44s dS' %.2e dVnew %.2e dh0 %.2e\n", cs.label, e_dh, e_dv, e_h0);
  EXPECT_TRUE(std::isfinite(e_dh) && std::isfinite(e_dv) && std::isfinite(e_h0)) << "NaN/inf (or an unwritten value)";
  EXPECT_LE(e_dh, 1e-2);
  EXPECT_LE(e_dv, 1e-2);
  EXPECT_LE(e_h0, 2e-2);
  // Deterministic: the same bits again.
  ASSERT_TRUE(kda::bwd2_stages(b, c.opts, ws.ptr, nullptr, &layout));
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  // Bit for bit (memcmp: slots of empty sequences keep the NaN poison, and NaN != NaN).
  const auto same = [](const std::vector<double>& x, const std::vector<double>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0;
  };
  EXPECT_TRUE(same(fetch_bf16(ws, layout.dsp, dsp.size()), dsp) && same(fetch_bf16(ws, layout.dvn, dvn.size()), dvn))
      << "a second run differs";
}

TEST(KdaBwd2Gpu, PrepAndScanMatchTheChunkedReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Case cases[] = {
      {KdaCase{1, 1193, 2, 128, 128, {0, 1, 64, 128, 193, 1193}, Gate::kSoftplus, true, true}, "varlen 1/63/64/65/1000 sp h0 l2"},
      {KdaCase{1, 200, 2, 48, 40, {0, 0, 70, 70, 200}, Gate::kSoftplusBias, true, true}, "varlen empty/70/empty/130 K48 V40"},
      {KdaCase{2, 200, 2, 128, 128, {}, Gate::kPrecomputed, false, false}, "fixed B2 T200 precomputed"},
      {KdaCase{1, 300, 2, 128, 128, {0, 37, 300}, Gate::kLowerBound, true, false}, "varlen 37/263 lower bound -5"},
      {KdaCase{1, 1900, 2, 128, 128, {0, 1900}, Gate::kSoftplus, false, true}, "one sequence of 30 chunks"},
  };
  for (const Case& cs : cases) run_case(cs);
}

// The row loader's two paths on the same values (kda_bwd2_load.cuh): 16-bit q, k, v, dO in contiguous
// rows take K0's and K2a's cp.async path (kBf16 / kFp16); the same tensors copied into rows padded by
// 4 channels a head (strides not multiples of 8 elements) take the generic per-element loads. The
// whole second backward runs on each (into workspaces poisoned alike), and the workspace (every
// intermediate: Qg, Kg, -W, dvl, dS', dVnew, dqi, dki, dW, dAqk, dA, sd, ...) and every gradient
// must be the same bits.
void run_paths(KdaCase c, DType dt, const char* label) {
  SCOPED_TRACE(label);
  c.fill(uint64_t(c.T * 13 + c.K));
  const int64_t B = c.B, T = c.T, H = c.Hv(), Hq = c.H, K = c.K, V = c.V, N = c.N();
  KdaDeviceForward f(c, dt, DType::kBF16, /*remat=*/false);
  ASSERT_TRUE(f.counted);
  {
    const Status st = f.run(c);
    ASSERT_TRUE(st) << "forward: " << st.to_string();
  }
  auto [d_o, d_fin] = cotangents(c, uint64_t(T * 31 + K));
  auto ddo = dev(d_o, dt, {B, T, H, V}), ddfin = dev(d_fin, DType::kFP32, {N, H, K, V});
  // A [B, T, Hx, C] copy of `x` (contiguous, 16-bit) with each head's row padded to C + 4 elements.
  const size_t es = dtype_size(dt);
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  auto padded = [&](const TensorView& x, int64_t Hx, int64_t C) {
    const int64_t P = C + 4;
    std::vector<unsigned char> src(size_t(B * T * Hx * C) * es), dst(size_t(B * T * Hx * P) * es, 0);
    cudaMemcpy(src.data(), x.data, src.size(), cudaMemcpyDeviceToHost);
    for (int64_t r = 0; r < B * T * Hx; ++r) std::memcpy(&dst[size_t(r * P) * es], &src[size_t(r * C) * es], size_t(C) * es);
    keep.push_back(std::make_unique<DeviceBuffer>(dst.size()));
    cudaMemcpy(keep.back()->ptr, dst.data(), dst.size(), cudaMemcpyHostToDevice);
    return TensorView::strided(keep.back()->ptr, dt, {B, T, Hx, C}, {T * Hx * P, Hx * P, P, 1}, x.device);
  };
  struct Run {
    std::vector<unsigned char> ws;
    std::vector<std::vector<double>> grads;
  };
  auto run = [&](bool pad, Run* out) {
    auto dh0 = poisoned(size_t(N * H * K * V), DType::kFP32, {N, H, K, V});
    auto dq = poisoned(size_t(B * T * Hq * K), dt, {B, T, Hq, K}), dk = poisoned(size_t(B * T * Hq * K), dt, {B, T, Hq, K}),
         dv = poisoned(c.v.size(), dt, {B, T, H, V}), dg = poisoned(size_t(B * T * H * K), dt, {B, T, H, K}),
         dbeta = poisoned(c.beta.size(), dt, {B, T, H});
    KdaBackwardArgs b;
    b.fwd = f.a;
    b.d_o = ddo->view;
    if (pad) {
      b.fwd.q = padded(f.a.q, Hq, K), b.fwd.k = padded(f.a.k, Hq, K), b.fwd.v = padded(f.a.v, H, V);
      b.d_o = padded(ddo->view, H, V);
    }
    b.d_final_state = ddfin->view;
    if (c.h0) b.dh0 = dh0->view;
    b.dq = dq->view, b.dk = dk->view, b.dv = dv->view, b.dg = dg->view, b.dbeta = dbeta->view;
    size_t bytes = 0;
    ASSERT_TRUE(kda::bwd2_stages_workspace(b, c.opts, &bytes));
    DeviceBuffer ws(bytes);
    ENCORE_ASSERT_CUDA(cudaMemset(ws.ptr, 0xff, ws.bytes));
    cuda::Kda2Layout layout;
    const Status st = kda::bwd2_stages(b, c.opts, ws.ptr, nullptr, &layout);
    ASSERT_TRUE(st) << st.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    out->ws.resize(bytes);
    cudaMemcpy(out->ws.data(), ws.ptr, bytes, cudaMemcpyDeviceToHost);
    out->grads = {dq->fetch(), dk->fetch(), dv->fetch(), dg->fetch(), dbeta->fetch()};
    if (c.h0) out->grads.push_back(dh0->fetch());
  };
  Run fast, generic;
  run(false, &fast);
  if (::testing::Test::HasFatalFailure()) return;
  run(true, &generic);
  if (::testing::Test::HasFatalFailure()) return;
  ASSERT_EQ(fast.ws.size(), generic.ws.size());
  EXPECT_EQ(std::memcmp(fast.ws.data(), generic.ws.data(), fast.ws.size()), 0) << "the workspace differs between the loader's paths";
  const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "dh0"};
  for (size_t i = 0; i < fast.grads.size(); ++i) {
    const auto &x = fast.grads[i], &y = generic.grads[i];
    EXPECT_TRUE(x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0)
        << names[i] << " differs between the loader's paths";
  }
}

TEST(KdaBwd2Gpu, RowLoaderPathsAreBitIdentical) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    const bool bf = dt == DType::kBF16;
    run_paths(KdaCase{1, 1193, 2, 128, 128, {0, 1, 64, 128, 193, 1193}, Gate::kSoftplus, true, true}, dt,
              bf ? "bf16 varlen 1/63/64/65/1000 sp h0 l2" : "fp16 varlen 1/63/64/65/1000 sp h0 l2");
    run_paths(KdaCase{2, 200, 2, 64, 96, {}, Gate::kPrecomputed, false, false}, dt, bf ? "bf16 fixed B2 T200 K64 V96" : "fp16 fixed B2 T200 K64 V96");
    KdaCase grouped{1, 300, 1, 128, 128, {0, 37, 300}, Gate::kLowerBound, true, false};
    grouped.HV = 2;
    run_paths(grouped, dt, bf ? "bf16 varlen 37/263 lower bound HV 2H" : "fp16 varlen 37/263 lower bound HV 2H");
  }
}

// run() without some of the forward's residuals against run() reading all of them (G, Aqk, Akk, h from
// one forward): the same gradients, bit for bit. Without G the backward recomputes it from g into its
// workspace's tail; without h or Aqk and Akk (drop_A; the second backward: bf16 inputs, fp16 with h) the
// forward re-runs first and writes the absent ones (and G) into the workspace. Both sides take the same
// kernels: the second backward for 16-bit inputs, the first for fp32 inputs.
void run_dropping(KdaCase c, DType dt, bool drop_G, bool drop_h, const char* label, bool drop_A = false) {
  SCOPED_TRACE(label);
  c.fill(uint64_t(c.T * 7 + c.K));
  const int64_t B = c.B, T = c.T, H = c.Hv(), Hq = c.H, K = c.K, V = c.V, N = c.N();
  KdaDeviceForward f(c, dt, dt == DType::kFP32 ? DType::kFP32 : DType::kBF16, /*remat=*/false);
  ASSERT_TRUE(f.counted);
  {
    const Status st = f.run(c);
    ASSERT_TRUE(st) << "forward: " << st.to_string();
  }
  auto [d_o, d_fin] = cotangents(c, uint64_t(T * 17 + V));
  auto ddo = dev(d_o, dt, {B, T, H, V}), ddfin = dev(d_fin, DType::kFP32, {N, H, K, V});
  auto run = [&](bool all, std::vector<std::vector<double>>* grads) {
    auto dq = poisoned(size_t(B * T * Hq * K), dt, {B, T, Hq, K}), dk = poisoned(size_t(B * T * Hq * K), dt, {B, T, Hq, K}),
         dv = poisoned(c.v.size(), dt, {B, T, H, V}), dg = poisoned(size_t(B * T * H * K), dt, {B, T, H, K}),
         dbeta = poisoned(c.beta.size(), dt, {B, T, H}), dh0 = poisoned(size_t(N * H * K * V), DType::kFP32, {N, H, K, V}),
         dA = poisoned(size_t(H), DType::kFP32, {H}), ddt = poisoned(size_t(H * K), DType::kFP32, {H * K});
    KdaBackwardArgs b;
    b.fwd = f.a;
    if (!all && drop_G) b.fwd.residuals.G = TensorView{};
    if (!all && drop_h) b.fwd.residuals.h = TensorView{};
    if (!all && drop_A) b.fwd.residuals.Aqk = b.fwd.residuals.Akk = TensorView{};
    b.d_o = ddo->view, b.d_final_state = ddfin->view;
    b.dq = dq->view, b.dk = dk->view, b.dv = dv->view, b.dg = dg->view, b.dbeta = dbeta->view;
    if (c.h0) b.dh0 = dh0->view;
    if (!c.A_log.empty()) b.dA_log = dA->view;
    if (!c.dt_bias.empty()) b.ddt_bias = ddt->view;
    DeviceBuffer ws(std::max<size_t>(workspace_bytes(b, c.opts), 16));
    ENCORE_ASSERT_CUDA(cudaMemset(ws.ptr, 0xff, ws.bytes));
    const Status st = encore::run(b, c.opts, ws.ptr);
    ASSERT_TRUE(st) << (all ? "every residual: " : "residuals dropped: ") << st.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    *grads = {dq->fetch(), dk->fetch(), dv->fetch(), dg->fetch(), dbeta->fetch(), dh0->fetch(), dA->fetch(), ddt->fetch()};
  };
  std::vector<std::vector<double>> saved, dropped;
  run(true, &saved);
  if (::testing::Test::HasFatalFailure()) return;
  run(false, &dropped);
  if (::testing::Test::HasFatalFailure()) return;
  const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"};
  for (size_t i = 0; i < saved.size(); ++i) {
    const auto &x = saved[i], &y = dropped[i];
    EXPECT_TRUE(x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0)
        << names[i] << " differs without the dropped residuals (relative RMS " << rel_err(y, x) << ")";
  }
}

TEST(KdaBwd2Gpu, RecomputedResidualsGiveTheSavedGradients) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const KdaCase varlen{1, 1193, 2, 128, 128, {0, 1, 64, 64, 193, 1193}, Gate::kSoftplus, true, true};
  KdaCase grouped{1, 300, 1, 128, 128, {0, 37, 300}, Gate::kLowerBound, true, false};
  grouped.HV = 2;
  const KdaCase odd{2, 200, 2, 64, 96, {}, Gate::kPrecomputed, false, false};
  // G recomputed from g: the second backward (16-bit inputs, saved h) and the first (fp32 inputs).
  run_dropping(varlen, DType::kBF16, true, false, "no G: bf16 varlen 1/63/0/129/1000 softplus h0 l2");
  run_dropping(grouped, DType::kFP16, true, false, "no G: fp16 varlen 37/263 lower bound HV 2H");
  run_dropping(odd, DType::kBF16, true, false, "no G: bf16 B2 T200 K64 V96 precomputed");
  run_dropping(KdaCase{1, 260, 2, 128, 128, {0, 100, 260}, Gate::kSoftplus, true, true}, DType::kFP32, true, false,
               "no G: fp32 varlen softplus (first backward)");
  // The chunk states rematerialized by the forward (bf16): with the caller's G, and without (chunk_kda's default).
  run_dropping(varlen, DType::kBF16, false, true, "no h: bf16 varlen softplus h0 l2");
  run_dropping(varlen, DType::kBF16, true, true, "no G, no h: bf16 varlen softplus h0 l2");
  run_dropping(grouped, DType::kBF16, true, true, "no G, no h: bf16 varlen lower bound HV 2H");
  run_dropping(odd, DType::kBF16, true, true, "no G, no h: bf16 B2 T200 K64 V96 precomputed");
  // Aqk and Akk written by the re-run too: nothing kept but the inputs (chunk_kda's default for bf16), and
  // with the saved states (the re-run for Aqk, Akk alone; fp16 with h: Aqk, Akk written in h's dtype).
  run_dropping(varlen, DType::kBF16, true, true, "nothing saved: bf16 varlen softplus h0 l2", true);
  run_dropping(grouped, DType::kBF16, true, true, "nothing saved: bf16 varlen lower bound HV 2H", true);
  run_dropping(odd, DType::kBF16, true, true, "nothing saved: bf16 B2 T200 K64 V96 precomputed", true);
  run_dropping(varlen, DType::kBF16, false, false, "no Aqk, Akk: bf16 varlen softplus h0 l2, saved h and G", true);
  run_dropping(grouped, DType::kFP16, true, false, "no G, Aqk, Akk: fp16 varlen lower bound HV 2H, saved h", true);
}

}  // namespace
}  // namespace encore::test
