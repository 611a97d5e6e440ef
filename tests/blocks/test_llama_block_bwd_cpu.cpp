// The staged fp64 backward of the shifted LLaMA block (src/blocks/reference/llama_block_bwd.hpp,
// docs/math/gemm_epilogues.md §5) against a textbook backward written here: the chain rule op by op over
// the unfused forward (linear, residual add, RMSNorm through r = (mean x² + eps)^(-1/2), SwiGLU through
// silu'(g) = s + g·s·(1 − s), RoPE), every gradient to 1e-10 relative; and both against central finite
// differences of a scalar loss L = Σ qkv⊙Pq + Σ x2⊙Px (so d_qkv = Pq, d_x2 = Px). The last layer: mean
// cross-entropy over an LM head after the final norm, with ignore_index rows and an all-ignored batch
// (loss 0, gradients 0, no NaN). A NaN anywhere fails every comparison.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "blocks/reference/llama_block_bwd.hpp"
#include "tests/blocks/llama_block_case.hpp"

namespace encore::test {
namespace {

using reference::LlamaBlockBwdInputs;
using reference::Mat;
using reference::matmul_nn;
using reference::matmul_nt;
using reference::matmul_tn;
constexpr double kEps = 1e-5;
constexpr int64_t kIgnore = -100;

// max |a − b| / max |b| (INFINITY on a size mismatch or any non-finite value).
double rel_err(const Mat& a, const Mat& b) {
  if (a.size() != b.size() || b.empty()) return INFINITY;
  double e = 0, s = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    e = std::max(e, std::fabs(a[i] - b[i]));
    s = std::max(s, std::fabs(b[i]));
  }
  return s > 0 ? e / s : e;
}
Mat add(Mat a, const Mat& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  return a;
}
double dot(const Mat& a, const Mat& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}
Mat randn(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<double> nd;
  Mat v(n);
  for (double& x : v) x = nd(rng);
  return v;
}

// ---- the textbook forward, every intermediate kept ----
struct Tape {
  Mat x1, n1, z1, y1, x2, n2, p, qkv, r1, r2;
};
Mat rms_forward(const Mat& x, const Mat& g, int64_t M, int64_t d, Mat* r) {
  Mat n(x.size());
  r->assign(size_t(M), 0.0);
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += x[size_t(m * d + j)] * x[size_t(m * d + j)];
    (*r)[size_t(m)] = 1.0 / std::sqrt(ss / double(d) + kEps);
    for (int64_t j = 0; j < d; ++j) n[size_t(m * d + j)] = x[size_t(m * d + j)] * (*r)[size_t(m)] * g[size_t(j)];
  }
  return n;
}
double silu(double g) { return g / (1.0 + std::exp(-g)); }
Tape forward(const LlamaBlockBwdInputs& in, bool with_qkv = true) {
  const auto [M, d, F, N] = in.dims;
  Tape t;
  t.x1 = add(matmul_nt(in.y0, M, d, in.w0, d), in.x0);
  t.n1 = rms_forward(t.x1, in.gamma0, M, d, &t.r1);
  t.z1 = matmul_nt(t.n1, M, d, in.w1, 2 * F);
  t.y1.resize(size_t(M * F));
  for (int64_t i = 0; i < M * F; ++i) t.y1[size_t(i)] = silu(t.z1[size_t(2 * i)]) * t.z1[size_t(2 * i + 1)];
  t.x2 = add(matmul_nt(t.y1, M, F, in.w2, d), t.x1);
  t.n2 = rms_forward(t.x2, in.gamma1, M, d, &t.r2);
  if (!with_qkv) return t;
  t.p = matmul_nt(t.n2, M, d, in.w3, N);
  t.qkv = t.p;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; 2 * j + 1 < N; ++j) {
      double c, s;
      reference::rope_cos_sin(in.pos[size_t(m)], in.freq, j, &c, &s);
      const double a = t.p[size_t(m * N + 2 * j)], b = t.p[size_t(m * N + 2 * j + 1)];
      t.qkv[size_t(m * N + 2 * j)] = a * c - b * s;
      t.qkv[size_t(m * N + 2 * j + 1)] = b * c + a * s;
    }
  return t;
}

// ---- the textbook backward: one vector-Jacobian product per op ----
// n = x·r·γ with r = ms^(-1/2), ms = mean(x²) + eps: adds to dx and dγ.
void rms_vjp(const Mat& x, const Mat& r, const Mat& g, const Mat& dn, int64_t M, int64_t d, Mat* dx, Mat* dg) {
  for (int64_t m = 0; m < M; ++m) {
    const double rm = r[size_t(m)];
    double dr = 0;  // dL/dr
    for (int64_t j = 0; j < d; ++j) {
      const size_t i = size_t(m * d + j);
      (*dg)[size_t(j)] += dn[i] * x[i] * rm;
      dr += dn[i] * g[size_t(j)] * x[i];
    }
    const double dms = dr * -0.5 * rm * rm * rm;  // dr/dms = -ms^(-3/2)/2
    for (int64_t j = 0; j < d; ++j) {
      const size_t i = size_t(m * d + j);
      (*dx)[i] += dn[i] * g[size_t(j)] * rm + dms * 2.0 * x[i] / double(d);
    }
  }
}
struct Grads {  // in the reference's names
  Mat d_y0, d_x0, dw0, dw1, dw2, dw3, dgamma0, dgamma1, dw_lm, dgamma_f;
};
// From the gradient at x2 (all paths) down to y0, x0, w0, w1, w2, γ0.
void textbook_lower(const LlamaBlockBwdInputs& in, const Tape& t, const Mat& dx2, Grads* g) {
  const auto [M, d, F, N] = in.dims;
  Mat dx1 = dx2;  // x2 = down + x1
  const Mat dy1 = matmul_nn(dx2, M, d, in.w2, F);
  g->dw2 = matmul_tn(dx2, M, d, t.y1, F);
  Mat dz1(size_t(M * 2 * F));
  for (int64_t i = 0; i < M * F; ++i) {
    const double gt = t.z1[size_t(2 * i)], u = t.z1[size_t(2 * i + 1)], s = 1.0 / (1.0 + std::exp(-gt));
    dz1[size_t(2 * i)] = dy1[size_t(i)] * u * (s + gt * s * (1.0 - s));
    dz1[size_t(2 * i + 1)] = dy1[size_t(i)] * silu(gt);
  }
  const Mat dn1 = matmul_nn(dz1, M, 2 * F, in.w1, d);
  g->dw1 = matmul_tn(dz1, M, 2 * F, t.n1, d);
  g->dgamma0.assign(size_t(d), 0.0);
  rms_vjp(t.x1, t.r1, in.gamma0, dn1, M, d, &dx1, &g->dgamma0);
  g->d_y0 = matmul_nn(dx1, M, d, in.w0, d);
  g->dw0 = matmul_tn(dx1, M, d, in.y0, d);
  g->d_x0 = dx1;
}
Grads textbook_block(const LlamaBlockBwdInputs& in, const Tape& t, const Mat& dqkv, const Mat& dx2_in) {
  const auto [M, d, F, N] = in.dims;
  Mat dp(dqkv.size());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; 2 * j + 1 < N; ++j) {  // qa = a c − b s, qb = b c + a s
      double c, s;
      reference::rope_cos_sin(in.pos[size_t(m)], in.freq, j, &c, &s);
      const double qa = dqkv[size_t(m * N + 2 * j)], qb = dqkv[size_t(m * N + 2 * j + 1)];
      dp[size_t(m * N + 2 * j)] = qa * c + qb * s;
      dp[size_t(m * N + 2 * j + 1)] = -qa * s + qb * c;
    }
  Grads g;
  const Mat dn2 = matmul_nn(dp, M, N, in.w3, d);
  g.dw3 = matmul_tn(dp, M, N, t.n2, d);
  Mat dx2 = dx2_in;
  g.dgamma1.assign(size_t(d), 0.0);
  rms_vjp(t.x2, t.r2, in.gamma1, dn2, M, d, &dx2, &g.dgamma1);
  textbook_lower(in, t, dx2, &g);
  return g;
}

// ---- cases ----
struct Case {
  LlamaBlockBwdInputs in;
  Mat dqkv, dx2;
};
// Inputs from BlockCase, the library's CPU forward run once (its saved tensors must match the
// textbook's to fp32 rounding), then the saved tensors replaced by the fp64 textbook forward's.
Case make_case(int64_t M, int64_t d, int64_t F, int64_t heads, int64_t rotary, uint64_t seed) {
  auto rng = make_rng(seed);
  BlockCase c(M, d, F, heads, rotary, 8, DType::kFP32, rng);
  BlockTensors o(c);
  LlamaBlockArgs a{c.y0.view(), c.x0.view(), c.w0.view(), c.w1.view(), c.w2.view(), c.w3.view(), c.g0.view(), c.g1.view(), c.pos.view(),
                   c.freq.view(), o.x1.view(), o.x2.view(), o.z1.view(), o.qkv.view(), o.r1.view(), o.r2.view()};
  LlamaBlockOptions opts;
  opts.eps = float(kEps);
  std::vector<unsigned char> ws(workspace_bytes(a, opts) + 256);
  void* w = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 255) / 256 * 256);
  const Status st = run(a, opts, w);
  EXPECT_TRUE(st) << st.to_string();
  Case k{reference::load_block_bwd_inputs(a), {}, {}};
  const Tape t = forward(k.in);
  const std::pair<const char*, std::pair<Mat*, const Mat*>> saved[] = {{"x1", {&k.in.x1, &t.x1}},    {"x2", {&k.in.x2, &t.x2}},
                                                                       {"z1", {&k.in.z1, &t.z1}},    {"qkv", {&k.in.qkv, &t.qkv}},
                                                                       {"r1", {&k.in.r1, &t.r1}},    {"r2", {&k.in.r2, &t.r2}}};
  for (const auto& [name, pr] : saved) {
    EXPECT_LE(rel_err(*pr.first, *pr.second), 2e-5) << "the library forward's " << name << " vs the textbook";
    *pr.first = *pr.second;
  }
  k.dqkv = randn(size_t(M * k.in.dims.N), rng);
  k.dx2 = randn(size_t(M * d), rng);
  return k;
}

struct Named {
  const char* name;
  const Mat* ref;
  const Mat* want;
};
std::vector<Named> block_pairs(const reference::LlamaBlockBwd& r, const Grads& g) {
  return {{"d_y0", &r.ffn.d_y0, &g.d_y0}, {"d_x0", &r.ffn.d_x0, &g.d_x0},           {"dW0", &r.ffn.dw0, &g.dw0},
          {"dW1", &r.ffn.dw1, &g.dw1},    {"dW2", &r.ffn.dw2, &g.dw2},              {"dW3", &r.qkv.dw3, &g.dw3},
          {"dgamma0", &r.ffn.norm1.dgamma, &g.dgamma0}, {"dgamma1", &r.qkv.norm.dgamma, &g.dgamma1}};
}
void expect_close(const std::vector<Named>& pairs, double tol, const std::string& what) {
  for (const Named& p : pairs) {
    const double e = rel_err(*p.ref, *p.want);
    EXPECT_LE(e, tol) << what << " " << p.name;
    std::printf("  %-8s %-9s rel err %.3g\n", what.c_str(), p.name, e);
  }
}

TEST(LlamaBlockBwdCpu, StagedEqualsTextbookChainRule) {
  struct S {
    int64_t M, d, F, heads, rotary;
  };
  uint64_t seed = 101;
  for (const S s : {S{1, 16, 23, 4, 3}, S{7, 40, 37, 6, 4}, S{33, 64, 91, 10, 8}, S{7, 24, 13, 3, 0}}) {
    SCOPED_TRACE("M" + std::to_string(s.M) + " d" + std::to_string(s.d) + " F" + std::to_string(s.F));
    const Case k = make_case(s.M, s.d, s.F, s.heads, s.rotary, seed++);
    const Grads g = textbook_block(k.in, forward(k.in), k.dqkv, k.dx2);
    for (int64_t tile : {128, 5}) {  // one partial per tile, and several (tiles not dividing M or F)
      const auto r = reference::llama_block_backward(k.in, k.dqkv, k.dx2, {tile, tile});
      expect_close(block_pairs(r, g), 1e-10, "tile" + std::to_string(tile));
      EXPECT_EQ(r.qkv.norm.dgamma_partials.size(), size_t((s.M + tile - 1) / tile * s.d));
      EXPECT_EQ(r.ffn.swiglu.zdz_partials.size(), size_t(s.M * ((s.F + tile - 1) / tile)));
    }
  }
}

// The stages' side outputs are what they claim: the recomputed aux tensors equal the forward's
// normed inputs and SwiGLU output, and each zdz equals (1/d)·Σ_k a_k·da_k over the norm's output
// (the ZdZ identity the deferred norm relies on), partials summing to it.
TEST(LlamaBlockBwdCpu, StageSideOutputs) {
  const Case k = make_case(33, 40, 37, 6, 4, 7);
  const auto [M, d, F, N] = k.in.dims;
  const Tape t = forward(k.in);
  const auto r = reference::llama_block_backward(k.in, k.dqkv, k.dx2, {8, 6});
  EXPECT_LE(rel_err(r.qkv.norm.aux, t.n2), 1e-14);
  EXPECT_LE(rel_err(r.ffn.norm1.aux, t.n1), 1e-14);
  EXPECT_LE(rel_err(r.ffn.swiglu.y, t.y1), 1e-14);
  const std::pair<const reference::RmsNormDgrad*, const Mat*> norms[] = {{&r.qkv.norm, &r.qkv.rope.zdz}, {&r.ffn.norm1, &r.ffn.swiglu.zdz}};
  for (const auto& [nm, zdz] : norms) {
    Mat want(size_t(M), 0.0);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < d; ++j) want[size_t(m)] += nm->aux[size_t(m * d + j)] * nm->da[size_t(m * d + j)] / double(d);
    EXPECT_LE(rel_err(*zdz, want), 1e-12);
  }
  const int64_t tiles = (F + 5) / 6;
  Mat sum(size_t(M), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t tt = 0; tt < tiles; ++tt) sum[size_t(m)] += r.ffn.swiglu.zdz_partials[size_t(m * tiles + tt)];
  EXPECT_LE(rel_err(sum, r.ffn.swiglu.zdz), 1e-14);
}

// Central differences of f over every element of every tensor named, against the analytic grads.
using Param = Mat LlamaBlockBwdInputs::*;
struct FdTarget {
  const char* name;
  Mat* value;
  const Mat* grad;
};
void expect_fd(const std::vector<FdTarget>& targets, const std::function<double()>& f, double tol) {
  constexpr double h = 1e-5;
  for (const FdTarget& t : targets) {
    Mat fd(t.value->size());
    for (size_t i = 0; i < fd.size(); ++i) {
      const double v = (*t.value)[i];
      (*t.value)[i] = v + h;
      const double lp = f();
      (*t.value)[i] = v - h;
      const double lm = f();
      (*t.value)[i] = v;
      fd[i] = (lp - lm) / (2 * h);
    }
    const double e = rel_err(*t.grad, fd);
    EXPECT_LE(e, tol) << t.name;
    std::printf("  fd %-11s rel err %.3g\n", t.name, e);
  }
}

TEST(LlamaBlockBwdCpu, FiniteDifferencesOfEveryInputAndWeight) {
  Case k = make_case(3, 16, 5, 2, 1, 9);
  LlamaBlockBwdInputs in = k.in;
  const auto loss = [&] {
    const Tape t = forward(in);
    return dot(t.qkv, k.dqkv) + dot(t.x2, k.dx2);
  };
  const auto r = reference::llama_block_backward(k.in, k.dqkv, k.dx2, {2, 2});
  const Grads g = textbook_block(k.in, forward(k.in), k.dqkv, k.dx2);
  expect_close(block_pairs(r, g), 1e-10, "tiny");
  expect_fd({{"y0", &in.y0, &r.ffn.d_y0},
             {"x0", &in.x0, &r.ffn.d_x0},
             {"w0", &in.w0, &r.ffn.dw0},
             {"w1", &in.w1, &r.ffn.dw1},
             {"w2", &in.w2, &r.ffn.dw2},
             {"w3", &in.w3, &r.qkv.dw3},
             {"gamma0", &in.gamma0, &r.ffn.norm1.dgamma},
             {"gamma1", &in.gamma1, &r.qkv.norm.dgamma}},
            loss, 1e-6);
}

// The first layer alone: qkv = RoPE(rmsnorm(x)·γ @ w3), L = Σ qkv⊙Pq + Σ x⊙Px (Px: the residual
// gradient accumulated as dX_prev).
TEST(LlamaBlockBwdCpu, FirstLayerFiniteDifferences) {
  Case k = make_case(4, 16, 5, 2, 1, 13);
  LlamaBlockBwdInputs in = k.in;
  const auto [M, d, F, N] = in.dims;
  in.x2 = in.x0;  // the layer's input
  const auto qkv_of = [&](const LlamaBlockBwdInputs& p, Mat* r) {
    const Mat n = rms_forward(p.x2, p.gamma1, M, d, r);
    Mat pre = matmul_nt(n, M, d, p.w3, N), out = pre;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; 2 * j + 1 < N; ++j) {
        double c, s;
        reference::rope_cos_sin(p.pos[size_t(m)], p.freq, j, &c, &s);
        out[size_t(m * N + 2 * j)] = pre[size_t(m * N + 2 * j)] * c - pre[size_t(m * N + 2 * j + 1)] * s;
        out[size_t(m * N + 2 * j + 1)] = pre[size_t(m * N + 2 * j + 1)] * c + pre[size_t(m * N + 2 * j)] * s;
      }
    return out;
  };
  Mat r;
  const Mat qkv = qkv_of(in, &r);
  const auto b = reference::qkv_norm_backward(in.x2, r, in.gamma1, in.w3, qkv, k.dqkv, in.pos, in.freq, k.dx2, M, d, N, 3);
  Mat rr;
  expect_fd({{"x", &in.x2, &b.norm.dx}, {"w3", &in.w3, &b.dw3}, {"gamma", &in.gamma1, &b.norm.dgamma}},
            [&] { return dot(qkv_of(in, &rr), k.dqkv) + dot(in.x2, k.dx2); }, 1e-6);
}

// ---- cross-entropy and the last layer ----
Mat logsumexp_rows(const Mat& l, int64_t M, int64_t V) {
  Mat out(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) {
    double mx = -INFINITY, s = 0;
    for (int64_t n = 0; n < V; ++n) mx = std::max(mx, l[size_t(m * V + n)]);
    for (int64_t n = 0; n < V; ++n) s += std::exp(l[size_t(m * V + n)] - mx);
    out[size_t(m)] = mx + std::log(s);
  }
  return out;
}
// Mean over the rows whose target is not ignored of −log softmax(ℓ)[target]; 0 when none.
double ce_loss(const Mat& l, int64_t M, int64_t V, const std::vector<int64_t>& target) {
  const Mat lse = logsumexp_rows(l, M, V);
  double s = 0;
  int64_t n = 0;
  for (int64_t m = 0; m < M; ++m)
    if (target[size_t(m)] != kIgnore) {
      s += lse[size_t(m)] - l[size_t(m * V + target[size_t(m)])];
      ++n;
    }
  return n ? s / double(n) : 0.0;
}

TEST(LlamaBlockBwdCpu, CrossEntropyBackward) {
  auto rng = make_rng(17);
  const int64_t M = 6, V = 11;
  for (const std::vector<int64_t>& target : {std::vector<int64_t>{3, kIgnore, 0, 10, kIgnore, 7}, std::vector<int64_t>(6, kIgnore)}) {
    Mat logits = randn(size_t(M * V), rng);
    for (double& v : logits) v *= 3.0;
    const auto ce = reference::cross_entropy_backward(logits, logsumexp_rows(logits, M, V), M, V, target, kIgnore);
    ASSERT_TRUE(std::isfinite(ce.loss) && std::isfinite(ce.dloss));
    EXPECT_NEAR(ce.loss, ce_loss(logits, M, V, target), 1e-13);
    Mat grad = ce.dlogits;  // dL/dℓ = dloss·dℓ
    for (double& v : grad) v *= ce.dloss;
    for (int64_t m = 0; m < M; ++m) {
      double zdz = 0, rowsum = 0;
      for (int64_t n = 0; n < V; ++n) {
        zdz += logits[size_t(m * V + n)] * ce.dlogits[size_t(m * V + n)];
        rowsum += ce.dlogits[size_t(m * V + n)];
      }
      EXPECT_NEAR(ce.zdz_rows[size_t(m)], zdz, 1e-12);
      EXPECT_NEAR(rowsum, 0.0, 1e-14);  // softmax − onehot sums to 0 (and ignored rows are 0)
      if (target[size_t(m)] == kIgnore) EXPECT_EQ(ce.loss_rows[size_t(m)], 0.0);
    }
    if (ce.count == 0) {
      EXPECT_EQ(ce.loss, 0.0);
      for (double v : ce.dlogits) ASSERT_EQ(v, 0.0);
      continue;
    }
    EXPECT_EQ(ce.count, 4);
    expect_fd({{"logits", &logits, &grad}}, [&] { return ce_loss(logits, M, V, target); }, 1e-8);
  }
}

TEST(LlamaBlockBwdCpu, LastLayerWithLossFiniteDifferences) {
  for (const bool all_ignored : {false, true}) {
    SCOPED_TRACE(all_ignored ? "all ignored" : "two rows ignored");
    Case k = make_case(5, 16, 7, 2, 1, 19);
    auto rng = make_rng(23);
    LlamaBlockBwdInputs in = k.in;
    const auto [M, d, F, N] = in.dims;
    reference::LlamaHeadInputs head;
    head.V = 13;
    head.w_lm = randn(size_t(head.V * d), rng);
    for (double& v : head.w_lm) v /= std::sqrt(double(d));
    head.gamma_final = randn(size_t(d), rng);
    for (double& v : head.gamma_final) v = 1.0 + 0.2 * v;
    head.target = all_ignored ? std::vector<int64_t>(size_t(M), kIgnore) : std::vector<int64_t>{4, kIgnore, 12, 0, kIgnore};
    head.ignore_index = kIgnore;
    // the textbook head: nf = rmsnorm(x2)·γf, logits = nf·W_lmᵀ, mean CE
    const auto logits_of = [&](const LlamaBlockBwdInputs& p, const reference::LlamaHeadInputs& h, Tape* t, Mat* nf) {
      *t = forward(p, false);
      Mat r;
      *nf = rms_forward(t->x2, h.gamma_final, M, d, &r);
      return matmul_nt(*nf, M, d, h.w_lm, h.V);
    };
    Tape t;
    Mat nf;
    head.logits = logits_of(in, head, &t, &nf);
    head.lse = logsumexp_rows(head.logits, M, head.V);
    const auto r = reference::llama_last_layer_backward(in, head, {2, 3});
    // textbook backward
    Grads g;
    Mat dl(head.logits.size(), 0.0);
    const double count = all_ignored ? 0.0 : 3.0;
    for (int64_t m = 0; m < M; ++m)
      if (head.target[size_t(m)] != kIgnore)
        for (int64_t n = 0; n < head.V; ++n)
          dl[size_t(m * head.V + n)] =
              (std::exp(head.logits[size_t(m * head.V + n)] - head.lse[size_t(m)]) - (n == head.target[size_t(m)] ? 1.0 : 0.0)) / count;
    const Mat dnf = matmul_nn(dl, M, head.V, head.w_lm, d);
    g.dw_lm = matmul_tn(dl, M, head.V, nf, d);
    Mat dx2(size_t(M * d), 0.0);
    g.dgamma_f.assign(size_t(d), 0.0);
    rms_vjp(t.x2, t.r2, head.gamma_final, dnf, M, d, &dx2, &g.dgamma_f);
    textbook_lower(in, t, dx2, &g);
    const std::vector<Named> pairs = {{"d_y0", &r.ffn.d_y0, &g.d_y0},     {"d_x0", &r.ffn.d_x0, &g.d_x0},
                                      {"dW0", &r.ffn.dw0, &g.dw0},        {"dW1", &r.ffn.dw1, &g.dw1},
                                      {"dW2", &r.ffn.dw2, &g.dw2},        {"dW_lm", &r.dw_lm, &g.dw_lm},
                                      {"dgamma0", &r.ffn.norm1.dgamma, &g.dgamma0}, {"dgamma_f", &r.norm.dgamma, &g.dgamma_f}};
    if (all_ignored) {
      EXPECT_EQ(r.ce.loss, 0.0);
      for (const Named& p : pairs)
        for (double v : *p.ref) ASSERT_EQ(v, 0.0) << p.name;  // exactly zero (and so not NaN)
      continue;
    }
    expect_close(pairs, 1e-10, "last");
    EXPECT_NEAR(r.ce.loss, ce_loss(head.logits, M, head.V, head.target), 1e-13);
    const auto loss = [&] {
      Tape tt;
      Mat nn;
      return ce_loss(logits_of(in, head, &tt, &nn), M, head.V, head.target);
    };
    expect_fd({{"y0", &in.y0, &r.ffn.d_y0},
               {"x0", &in.x0, &r.ffn.d_x0},
               {"w0", &in.w0, &r.ffn.dw0},
               {"w1", &in.w1, &r.ffn.dw1},
               {"w2", &in.w2, &r.ffn.dw2},
               {"gamma0", &in.gamma0, &r.ffn.norm1.dgamma},
               {"w_lm", &head.w_lm, &r.dw_lm},
               {"gamma_final", &head.gamma_final, &r.norm.dgamma}},
              loss, 1e-6);
  }
}

// NaN never passes: a poisoned gradient fails the comparison used above.
TEST(LlamaBlockBwdCpu, ComparisonFailsOnNaN) {
  Mat a{1.0, 2.0}, b{1.0, 2.0};
  EXPECT_EQ(rel_err(a, b), 0.0);
  a[1] = NAN;
  EXPECT_EQ(rel_err(a, b), INFINITY);
  EXPECT_EQ(rel_err(Mat{1.0}, b), INFINITY);
}

}  // namespace
}  // namespace encore::test
