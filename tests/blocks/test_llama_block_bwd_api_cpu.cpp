// The LLaMA block backward API (encore/blocks/llama.hpp: llama_block_backward, qkv_norm_backward) on
// the CPU backend against the fp64 staged reference (src/blocks/reference/llama_block_bwd.hpp), in
// fp32 (to fp32 rounding) and bf16 (bf16 tolerances); d_x0 in place over d_x2; the elementwise
// rope_bwd_zdz and the plain dgrad / wgrad GEMM rows against direct fp64 math; bad input (wrong
// shapes or dtypes of gradients, saved tensors of another forward, overlapping outputs) refused with
// Status errors naming the tensor. Outputs NaN-poisoned first.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "encore/blocks/llama.hpp"
#include "encore/gemm.hpp"
#include "tests/blocks/llama_block_bwd_case.hpp"

namespace encore::test {
namespace {

Status run_host(LlamaBlockBwdArgs a) {
  const size_t bytes = workspace_bytes(a);
  if (bytes == 0) return validate(a);
  std::vector<unsigned char> ws(bytes + 256);
  return run(a, align_up_256(ws));
}

void expect_matches_reference(BlockBwdCase& k, double tol_max, const std::string& what) {
  const auto ref = k.reference();
  const std::vector<const char*> names = BlockBwdCase::output_names();
  std::vector<HostTensor*> outs = k.outputs();
  for (size_t i = 0; i < outs.size(); ++i) {
    const double e = rel_max_err(*outs[i], *ref->outs[i]), rms = rel_rms_err(*outs[i], *ref->outs[i]);
    EXPECT_LE(e, tol_max) << what << " " << names[i];
    std::printf("  %-10s %-8s rel max err %.3g, rel rms %.3g\n", what.c_str(), names[i], e, rms);
  }
}

TEST(LlamaBlockBwdApiCpu, Fp32MatchesStagedReference) {
  struct S {
    int64_t M, d, F, heads, rotary;
  };
  uint64_t seed = 3;
  // M across several 128-row dγ tiles and F across several 128-column zdz tiles (the partials); d
  // 8192 puts swiglu_bwd's zdz partials on 256-column tiles (gemm_partial_tile_n from K 8192).
  for (const S s : {S{1, 16, 8, 4, 3}, S{37, 40, 24, 5, 3}, S{300, 48, 136, 6, 4}, S{3, 8192, 264, 1, 3}}) {
    SCOPED_TRACE("M" + std::to_string(s.M) + " d" + std::to_string(s.d) + " F" + std::to_string(s.F));
    auto rng = make_rng(seed++);
    BlockBwdCase k(s.M, s.d, s.F, s.heads, s.rotary, 8, DType::kFP32, rng);
    const Status st = run_host(k.host_args());
    ASSERT_TRUE(st) << st.to_string();
    expect_matches_reference(k, 2e-5, "fp32");
  }
}

TEST(LlamaBlockBwdApiCpu, Bf16MatchesStagedReference) {
  auto rng = make_rng(5);
  BlockBwdCase k(200, 64, 88, 6, 4, 16, DType::kBF16, rng);
  const Status st = run_host(k.host_args());
  ASSERT_TRUE(st) << st.to_string();
  expect_matches_reference(k, 3e-2, "bf16");
}

// d_x0 may be d_x2 itself (the residual gradient updated in place): the same results.
TEST(LlamaBlockBwdApiCpu, ResidualGradientInPlace) {
  auto rng = make_rng(7);
  BlockBwdCase k(45, 32, 24, 4, 2, 8, DType::kFP32, rng);
  const auto ref = k.reference();
  LlamaBlockBwdArgs a = k.host_args();
  a.d_x0 = a.d_x2;
  const Status st = run_host(a);
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_LE(rel_max_err(k.d_x2, *ref->outs[1]), 2e-5);
  EXPECT_LE(rel_max_err(k.d_y0, *ref->outs[0]), 2e-5);
  EXPECT_LE(rel_max_err(k.dw0, *ref->outs[2]), 2e-5);
}

// The first layer: stage (a) alone, with and without the residual gradient of x.
TEST(LlamaBlockBwdApiCpu, QkvNormBackwardMatchesReference) {
  auto rng = make_rng(11);
  BlockBwdCase k(150, 40, 8, 5, 3, 8, DType::kFP32, rng);
  const int64_t M = k.c.M, d = k.c.d, N = k.c.nqkv();
  const reference::LlamaBlockBwdInputs in = reference::load_block_bwd_inputs(k.fa);
  std::vector<double> dq(size_t(M * N)), dxp(size_t(M * d));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) dq[size_t(m * N + n)] = k.d_qkv.get(m, n);
    for (int64_t n = 0; n < d; ++n) dxp[size_t(m * d + n)] = k.d_x2.get(m, n);
  }
  for (const bool with_prev : {true, false}) {
    SCOPED_TRACE(with_prev ? "with d_x_prev" : "without d_x_prev");
    HostTensor dx(DType::kFP32, M, d), dw3(DType::kFP32, N, d), dg(HostTensor::vector(DType::kFP32, d));
    for (HostTensor* h : {&dx, &dw3, &dg}) h->poison();
    QkvNormBwdArgs a{k.fwd.x2.view(), k.c.g1.view(), k.c.w3.view(), k.c.pos.view(), k.c.freq.view(), k.fwd.r2.view(), k.fwd.qkv.view(),
                     k.d_qkv.view(), with_prev ? k.d_x2.view() : TensorView{}, dx.view(), dw3.view(), dg.view()};
    const size_t bytes = workspace_bytes(a);
    ASSERT_GT(bytes, 0u);
    std::vector<unsigned char> ws(bytes + 256);
    const Status st = run(a, align_up_256(ws));
    ASSERT_TRUE(st) << st.to_string();
    const auto r = reference::qkv_norm_backward(in.x2, in.r2, in.gamma1, in.w3, in.qkv, dq, in.pos, in.freq, with_prev ? dxp : std::vector<double>{},
                                                M, d, N, 128);
    EXPECT_LE(rel_max_err(dx, r.norm.dx), 2e-5);
    EXPECT_LE(rel_max_err(dw3, r.dw3), 2e-5);
    EXPECT_LE(rel_max_err(dg, r.norm.dgamma), 2e-5);
  }
}

TEST(LlamaBlockBwdApiCpu, RopeBwdZdzMatchesReference) {
  auto rng = make_rng(13);
  const int64_t M = 9, N = 48;
  HostTensor y(DType::kFP32, M, N, N + 4), dy(DType::kFP32, M, N), dz(DType::kFP32, M, N), zdz(HostTensor::vector(DType::kFP32, M));
  HostTensor pos(HostTensor::vector(DType::kInt32, M)), freq(HostTensor::vector(DType::kFP32, N));
  y.fill_normal(rng);
  dy.fill_normal(rng);
  dz.poison();
  zdz.poison();
  for (int64_t m = 0; m < M; ++m) pos.set(0, m, double(int64_t(rng() % 100000)));
  ASSERT_TRUE(rope_freq_turns(6, 4, 8, 500000.0, freq.view()));
  const Status st = run(RopeBwdZdzArgs{y.view(), dy.view(), pos.view(), freq.view(), dz.view(), zdz.view()}, 0.25f);
  ASSERT_TRUE(st) << st.to_string();
  std::vector<double> yv(static_cast<size_t>(M * N)), dyv(static_cast<size_t>(M * N)), fv(static_cast<size_t>(N));
  std::vector<int64_t> pv(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) {
    pv[size_t(m)] = int64_t(pos.get(0, m));
    for (int64_t n = 0; n < N; ++n) yv[size_t(m * N + n)] = y.get(m, n), dyv[size_t(m * N + n)] = dy.get(m, n);
  }
  for (int64_t n = 0; n < N; ++n) fv[size_t(n)] = freq.get(0, n);
  const auto r = reference::rope_bwd_zdz(yv, dyv, M, N, pv, fv, 0.25);
  EXPECT_LE(rel_max_err(dz, r.dz), 1e-6);
  EXPECT_LE(rel_max_err(zdz, r.zdz), 1e-6);
  // bad input
  HostTensor odd(DType::kFP32, M, N - 2);
  Status bad = run(RopeBwdZdzArgs{y.view(), odd.view(), pos.view(), freq.view(), dz.view(), zdz.view()}, 0.25f);
  EXPECT_FALSE(bad);
  EXPECT_NE(bad.message().find("dy"), std::string::npos) << bad.to_string();
  bad = run(RopeBwdZdzArgs{y.view(), dy.view(), pos.view(), freq.view(), dy.view(), zdz.view()}, 0.25f);
  EXPECT_FALSE(bad) << "dz over dy";
}

// The plain rows: dgrad D = a·w (w [K, N]); wgrad D = α·aᵀ·w (a stored [K, M]), α optional.
TEST(LlamaBlockBwdApiCpu, DgradAndWgradRows) {
  auto rng = make_rng(17);
  const int64_t M = 13, N = 10, K = 21;
  HostTensor a(DType::kFP32, M, K), at(DType::kFP32, K, M, M + 3), w(DType::kFP32, K, N, N + 2), d(DType::kFP32, M, N);
  HostTensor alpha(HostTensor::vector(DType::kFP32, 1));
  a.fill_normal(rng);
  at.fill_normal(rng);
  w.fill_normal(rng);
  alpha.set(0, 0, -0.5);
  for (const bool t : {false, true})
    for (const bool with_alpha : {false, true}) {
      if (!t && with_alpha) continue;
      d.poison();
      GemmEpilogueArgs g;
      g.a = t ? at.view() : a.view();
      g.w = w.view();
      g.d = d.view();
      if (with_alpha) g.alpha = alpha.view();
      GemmEpilogueOptions o;
      o.epilogue = t ? Epilogue::kWgrad : Epilogue::kDgrad;
      const Status st = run(g, o);
      ASSERT_TRUE(st) << st.to_string();
      double err = 0;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double s = 0;
          for (int64_t k = 0; k < K; ++k) s += (t ? at.get(k, m) : a.get(m, k)) * w.get(k, n);
          if (with_alpha) s *= -0.5;
          err = std::max(err, std::fabs(d.get(m, n) - s));
        }
      EXPECT_LE(err, 1e-5) << epilogue_name(o.epilogue) << (with_alpha ? " with alpha" : "");
    }
  // shapes: wgrad's a is [K, M]; its w must have K rows
  GemmEpilogueArgs g;
  g.a = at.view();
  g.w = HostTensor(DType::kFP32, K + 1, N).view();
  g.d = d.view();
  GemmEpilogueOptions o;
  o.epilogue = Epilogue::kWgrad;
  const Status bad = validate(g, o);
  EXPECT_FALSE(bad);
  EXPECT_NE(bad.message().find("[K, M]"), std::string::npos) << bad.to_string();
}

// ---- bad input ----
void expect_refused(LlamaBlockBwdArgs a, const std::string& name, const std::string& what) {
  const Status st = validate(a);
  EXPECT_FALSE(st) << what;
  EXPECT_EQ(workspace_bytes(a), 0u) << what;
  EXPECT_NE(st.message().find(name), std::string::npos) << what << ": " << st.to_string();
  std::vector<unsigned char> ws(1 << 20);
  EXPECT_FALSE(run(a, align_up_256(ws))) << what;
}

TEST(LlamaBlockBwdApiCpu, RefusesBadInput) {
  auto rng = make_rng(19);
  BlockBwdCase k(20, 16, 8, 4, 2, 8, DType::kFP32, rng);
  BlockBwdCase other(20, 16, 16, 4, 2, 8, DType::kFP32, rng);  // another forward: F = 16
  HostTensor short_dq(DType::kFP32, 20, 24), bf_dx2(DType::kBF16, 20, 16), long_dx2(DType::kFP32, 21, 16), bf_dg(HostTensor::vector(DType::kBF16, 16));
  HostTensor r64(HostTensor::vector(DType::kFP64, 20)), dw3_t(DType::kFP32, 16, 32);
  const LlamaBlockBwdArgs good = k.host_args();
  ASSERT_TRUE(validate(good)) << validate(good).to_string();
  LlamaBlockBwdArgs a = good;
  a.d_qkv = short_dq.view();
  expect_refused(a, "d_qkv", "d_qkv of the wrong width");
  a = good;
  a.d_x2 = bf_dx2.view();
  expect_refused(a, "d_x2", "d_x2 in bf16 with fp32 tensors");
  a = good;
  a.d_x2 = long_dx2.view();
  expect_refused(a, "d_x2", "d_x2 with one row too many");
  a = good;
  a.d_qkv = TensorView{};
  expect_refused(a, "d_qkv", "d_qkv missing");
  a = good;
  a.z1 = other.fwd.z1.view();
  expect_refused(a, "z1", "z1 saved by another forward (F = 16)");
  a = good;
  a.r1 = r64.view();
  expect_refused(a, "r1", "r1 not fp32");
  a = good;
  a.dgamma0 = bf_dg.view();
  expect_refused(a, "dgamma0", "dgamma0 not fp32");
  a = good;
  a.dw3 = dw3_t.view();
  expect_refused(a, "dw3", "dw3 transposed");
  a = good;
  a.dw0 = a.d_y0;
  expect_refused(a, "dw0", "dw0 over d_y0");  // also a shape mismatch here: [d, d] vs [M, d]
  a = good;
  a.d_y0 = a.d_qkv;
  expect_refused(a, "d_y0", "d_y0 over d_qkv");
  a = good;
  a.d_x0 = a.x1;
  expect_refused(a, "d_x0", "d_x0 over the saved x1");
  // d_x0 over a part of d_x2 (not the same tensor) is refused
  a = good;
  a.d_x0 = TensorView::strided(static_cast<float*>(k.d_x2.view().data) + 1, DType::kFP32, {20, 16}, {16, 1}, {});
  a.d_x0.shape[0] = 19;
  expect_refused(a, "d_x0", "d_x0 shifted over d_x2");
  // a null workspace
  EXPECT_FALSE(run(good, nullptr));
}

}  // namespace
}  // namespace encore::test
