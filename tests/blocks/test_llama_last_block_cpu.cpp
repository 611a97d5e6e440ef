// The last layer + loss (encore/blocks/llama_last.hpp) on the CPU backend: the forward (x1, x2, z1, h2,
// r1, r2, lse, the mean loss) against the fp64 textbook layer, every gradient of d_loss·loss (d_y0, d_x0,
// dw0, dw1, dw2, dw_lm, dγ0, dγf) against the fp64 staged reference and against central finite
// differences of the textbook loss; fp32 and bf16; ignored rows, an all-ignored batch (loss 0, zero
// gradients, no NaN), odd V; bad input refused with Status errors naming the tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/blocks/llama_last_case.hpp"

namespace encore::test {
namespace {

constexpr double kEps = 1e-5;

void expect_forward(LastCase& k, const LastForward& f, double tol, const std::string& what) {
  const std::vector<const Vec*> ref = {&f.x1, &f.x2, &f.z1, &f.h2, &f.r1, &f.r2, &f.lse};
  const char* names[] = {"x1", "x2", "z1", "h2", "r1", "r2", "lse"};
  std::vector<HostTensor*> outs = k.forward_outputs();
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = rel_max_err(*outs[i], *ref[i]);
    EXPECT_LE(e, tol) << what << " " << names[i];
    std::printf("  %-5s %-6s rel max err %.3g\n", what.c_str(), names[i], e);
  }
  const double le = std::fabs(k.loss.get(0, 0) - f.loss) / std::max(1.0, std::fabs(f.loss));
  EXPECT_LE(le, tol) << what << " loss " << k.loss.get(0, 0) << " vs " << f.loss;
  std::printf("  %-5s loss   %.8f vs fp64 %.8f (rel err %.3g)\n", what.c_str(), k.loss.get(0, 0), f.loss, le);
}

void expect_grads(LastCase& k, const std::vector<Vec>& ref, double tol, const std::string& what) {
  std::vector<HostTensor*> g = k.grads();
  for (size_t i = 0; i < g.size(); ++i) {
    const double e = rel_max_err(*g[i], ref[i]), rms = rel_rms_err(*g[i], ref[i]);
    EXPECT_LE(e, tol) << what << " " << LastCase::grad_names()[i];
    std::printf("  %-5s %-13s rel max err %.3g, rel rms %.3g\n", what.c_str(), LastCase::grad_names()[i], e, rms);
  }
}

TEST(LlamaLastBlockCpu, Fp32MatchesFp64) {
  struct S {
    int64_t M, d, F, V;
  };
  uint64_t seed = 61;
  // odd V, V a multiple of 8; M over two 128-row dγ tiles; V over several 128-column zdz tiles
  for (const S s : {S{1, 16, 8, 11}, S{37, 40, 24, 1001}, S{150, 32, 136, 264}}) {
    SCOPED_TRACE("M" + std::to_string(s.M) + " d" + std::to_string(s.d) + " F" + std::to_string(s.F) + " V" + std::to_string(s.V));
    auto rng = make_rng(seed++);
    LastCase k(s.M, s.d, s.F, s.V, DType::kFP32, rng);
    ASSERT_TRUE(run_last_forward(k)) << run_last_forward(k).to_string();
    ASSERT_TRUE(run_last_backward(k)) << run_last_backward(k).to_string();
    const LastParams p = k.params();
    const LastForward f = textbook(p, kEps);
    expect_forward(k, f, 2e-5, "fp32");
    expect_grads(k, reference_grads(p, f, k.d_loss.get(0, 0)), 5e-5, "fp32");
  }
}

TEST(LlamaLastBlockCpu, Bf16MatchesFp64) {
  auto rng = make_rng(67);
  LastCase k(130, 64, 88, 501, DType::kBF16, rng);
  ASSERT_TRUE(run_last_forward(k)) << run_last_forward(k).to_string();
  ASSERT_TRUE(run_last_backward(k)) << run_last_backward(k).to_string();
  const LastParams p = k.params();
  const LastForward f = textbook(p, kEps);
  expect_forward(k, f, 3e-2, "bf16");
  expect_grads(k, reference_grads(p, f, k.d_loss.get(0, 0)), 5e-2, "bf16");
}

// Every gradient against central differences of the fp64 textbook loss (step 1e-5 on each element).
TEST(LlamaLastBlockCpu, GradientsMatchFiniteDifferences) {
  auto rng = make_rng(71);
  LastCase k(6, 8, 8, 13, DType::kFP32, rng, 4, 1.0);
  ASSERT_TRUE(run_last_forward(k));
  ASSERT_TRUE(run_last_backward(k));
  LastParams p = k.params();
  // grads() order: d_y0, d_x0, dw0, dw1, dw2, dw_lm, dγ0, dγf; params: y0, x0, w0, w1, w2, g0, gf, wlm
  const std::vector<std::pair<Vec*, HostTensor*>> pairs = {{&p.y0, &k.d_y0}, {&p.x0, &k.d_x0}, {&p.w0, &k.dw0}, {&p.w1, &k.dw1},
                                                          {&p.w2, &k.dw2}, {&p.wlm, &k.dwlm}, {&p.g0, &k.dg0}, {&p.gf, &k.dgf}};
  const double h = 1e-5;
  for (size_t i = 0; i < pairs.size(); ++i) {
    Vec& x = *pairs[i].first;
    Vec fd(x.size());
    for (size_t j = 0; j < x.size(); ++j) {
      const double x0 = x[j];
      x[j] = x0 + h;
      const double lp = textbook(p, kEps).loss;
      x[j] = x0 - h;
      const double lm = textbook(p, kEps).loss;
      x[j] = x0;
      fd[j] = (lp - lm) / (2 * h);
    }
    const double e = rel_max_err(*pairs[i].second, fd);
    EXPECT_LE(e, 1e-4) << LastCase::grad_names()[i];
    std::printf("  fd    %-13s rel max err %.3g\n", LastCase::grad_names()[i], e);
  }
}

TEST(LlamaLastBlockCpu, AllIgnoredGivesZeroLossAndGradients) {
  auto rng = make_rng(73);
  LastCase k(20, 16, 8, 37, DType::kFP32, rng, /*ignore_every=*/1);
  ASSERT_TRUE(run_last_forward(k));
  ASSERT_TRUE(run_last_backward(k));
  EXPECT_EQ(k.loss.get(0, 0), 0.0);
  for (size_t i = 0; i < k.grads().size(); ++i) {
    const HostTensor& g = *k.grads()[i];
    for (int64_t r = 0; r < g.rows; ++r)
      for (int64_t c = 0; c < g.cols; ++c) ASSERT_EQ(g.get(r, c), 0.0) << LastCase::grad_names()[i] << " [" << r << ", " << c << "]";
  }
  // the lse is still every row's (the forward's saved tensor)
  const LastForward f = textbook(k.params(), kEps);
  EXPECT_LE(rel_max_err(k.lse, f.lse), 2e-5);
}

// A custom ignore_index (7 is also a class index: rows with target 7 count nothing).
TEST(LlamaLastBlockCpu, CustomIgnoreIndex) {
  auto rng = make_rng(79);
  LastCase k(30, 16, 8, 19, DType::kFP32, rng, 0);
  for (int64_t m = 0; m < k.M; m += 3) k.target.set(0, m, 7.0);
  ASSERT_TRUE(run_last_forward(k, {1e-5f, 7}));
  ASSERT_TRUE(run_last_backward(k, {7}));
  const LastParams p = k.params();
  const LastForward f = textbook(p, kEps, 7);
  EXPECT_NEAR(k.loss.get(0, 0), f.loss, 2e-5 * std::max(1.0, f.loss));
  // the staged reference ignores -100: rewrite the ignored rows for it
  LastParams q = p;
  for (int64_t& y : q.target) y = y == 7 ? -100 : y;
  const LastForward fq = textbook(q, kEps);
  expect_grads(k, reference_grads(q, fq, k.d_loss.get(0, 0)), 5e-5, "ii7");
}

// ---- bad input ----
template <class Args>
void expect_refused(const Args& a, const std::string& name, const std::string& what) {
  Status st;
  if constexpr (std::is_same_v<Args, LlamaLastBlockArgs>) {
    st = validate(a, LlamaLastBlockOptions{});
    EXPECT_EQ(workspace_bytes(a, LlamaLastBlockOptions{}), 0u) << what;
  } else {
    st = validate(a);
    EXPECT_EQ(workspace_bytes(a), 0u) << what;
  }
  EXPECT_FALSE(st) << what;
  EXPECT_NE(st.message().find(name), std::string::npos) << what << ": " << st.to_string();
}

TEST(LlamaLastBlockCpu, RefusesBadInput) {
  auto rng = make_rng(83);
  LastCase k(20, 16, 8, 37, DType::kFP32, rng);
  LastCase other(20, 16, 8, 41, DType::kFP32, rng);  // another vocabulary
  ASSERT_TRUE(run_last_forward(k));
  HostTensor bf_h2(DType::kBF16, 20, 16), lse_bf(HostTensor::vector(DType::kBF16, 20)), two(HostTensor::vector(DType::kFP32, 2));
  const LlamaLastBlockArgs good = k.fwd_args();
  ASSERT_TRUE(validate(good, {}));
  LlamaLastBlockArgs a = good;
  k.target.set(0, 3, 37.0);  // outside [0, V)
  expect_refused(a, "target", "forward: target = V");
  expect_refused(k.bwd_args(), "target", "backward: target = V");
  k.target.set(0, 3, -1.0);
  expect_refused(a, "row 3", "forward: target -1");
  k.target.set(0, 3, 2.0);
  a.w_lm = other.wlm.view();
  a.lse = good.lse;
  ASSERT_TRUE(validate(a, {})) << "another vocabulary is a valid forward";
  a = good;
  a.loss = two.view();
  expect_refused(a, "loss", "loss of 2 elements");
  a = good;
  a.h2 = a.x2;
  expect_refused(a, "h2", "h2 over x2");
  a = good;
  a.lse = a.r2;
  expect_refused(a, "lse", "lse over r2");
  a = good;
  a.target = TensorView{};
  expect_refused(a, "target", "no target");

  const LlamaLastBlockBwdArgs gb = k.bwd_args();
  ASSERT_TRUE(validate(gb)) << validate(gb).to_string();
  LlamaLastBlockBwdArgs b = gb;
  b.w_lm = other.wlm.view();  // a head of V = 41 with dw_lm of 37 rows
  expect_refused(b, "dw_lm", "dw_lm of another vocabulary");
  b = gb;
  b.h2 = bf_h2.view();
  expect_refused(b, "h2", "h2 in bf16");
  b = gb;
  b.lse = lse_bf.view();
  expect_refused(b, "lse", "lse not fp32");
  b = gb;
  b.d_loss = TensorView{};
  expect_refused(b, "d_loss", "no d_loss");
  b = gb;
  b.dw_lm = b.w_lm;
  expect_refused(b, "dw_lm", "dw_lm over w_lm");
  b = gb;
  b.d_y0 = b.d_x0;
  expect_refused(b, "d_y0", "d_y0 over d_x0");
  b = gb;
  b.x2 = other.x2.view();
  b.z1 = HostTensor(DType::kFP32, 20, 10).view();
  expect_refused(b, "z1", "z1 of another F");
  std::vector<unsigned char> ws(1 << 20);
  EXPECT_FALSE(run(gb, {}, nullptr));
  EXPECT_FALSE(run(good, {}, nullptr));
}

}  // namespace
}  // namespace encore::test
