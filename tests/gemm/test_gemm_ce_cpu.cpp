// Cross-entropy backward on the CPU backend (docs/math/gemm_epilogues.md §4.5): the ce_bwd row (the
// low-memory path that recomputes the LM-head GEMM: dlogits = α·(softmax(r·A·Wᵀ) − onehot) from the
// forward's lse) and the cross_entropy_bwd finisher (the stored-logits path, in place allowed), each
// against an fp64 oracle of the stored inputs; the composition lse -> lse_finish -> ce_bwd -> dx, dW
// equals the fp64 gradient of the mean loss; vocabularies that are not multiples of 8 (D with padded
// rows); bad input (targets out of range other than ignore_index, missing lse / target, wrong dtypes and
// shapes, the CUDA limits checked before any device access).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "encore/gemm.hpp"
#include "tests/common/compare.hpp"

namespace encore::test {
namespace {

TensorView vec_view(std::vector<float>& v) { return TensorView::contiguous(v.data(), DType::kFP32, {int64_t(v.size())}); }
TensorView ivec_view(std::vector<int32_t>& v) { return TensorView::contiguous(v.data(), DType::kInt32, {int64_t(v.size())}); }

// One LM-head problem: A [M, K], W [N, K], targets with ignore_index rows, optional row scale; the fp64
// logits z = r·A·Wᵀ of the stored inputs and their log-sum-exp.
struct Problem {
  int64_t M, N, K;
  HostTensor a, w;
  std::vector<float> r;
  std::vector<int32_t> target;
  std::vector<double> z, lse;
  Problem(DType t, int64_t m, int64_t n, int64_t k, bool with_r, std::mt19937_64& rng) : M(m), N(n), K(k), a(t, m, k), w(t, n, k) {
    a.fill_normal(rng);
    w.fill_normal(rng, 0.0, 2.0 / std::sqrt(double(k)));
    r.assign(size_t(m), 1.0f);
    if (with_r)
      for (auto& x : r) x = 0.5f + float(rng() % 100) / 100.0f;
    target.resize(size_t(m));
    for (int64_t i = 0; i < m; ++i) target[size_t(i)] = i % 5 == 2 ? -100 : int32_t(rng() % uint64_t(n));
    z.assign(size_t(m * n), 0.0);
    lse.assign(size_t(m), 0.0);
    for (int64_t i = 0; i < m; ++i) {
      double mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t q = 0; q < k; ++q) s += a.get(i, q) * w.get(j, q);
        z[size_t(i * n + j)] = double(r[size_t(i)]) * s;
        mx = std::max(mx, z[size_t(i * n + j)]);
      }
      double s = 0;
      for (int64_t j = 0; j < n; ++j) s += std::exp(z[size_t(i * n + j)] - mx);
      lse[size_t(i)] = mx + std::log(s);
    }
  }
  // α·(softmax − onehot) of row i, 0 on ignored rows; lse_used: the lse the kernel was given.
  double grad(int64_t i, int64_t j, double alpha, double lse_used) const {
    const int32_t t = target[size_t(i)];
    if (t == -100) return 0.0;
    return alpha * (std::exp(z[size_t(i * N + j)] - lse_used) - (j == t ? 1.0 : 0.0));
  }
};

GemmEpilogueArgs ce_args(Problem& p, HostTensor& d, std::vector<float>& lse, std::vector<float>* alpha, bool with_r) {
  GemmEpilogueArgs g;
  g.a = p.a.view();
  g.w = p.w.view();
  g.d = d.view();
  g.lse = vec_view(lse);
  g.target = ivec_view(p.target);
  if (alpha != nullptr) g.alpha = vec_view(*alpha);
  if (with_r) g.row_scale = vec_view(p.r);
  return g;
}

// The ce_bwd row against the fp64 oracle: bf16 / fp16 / fp32, with and without α and the row scale, N
// odd with D's rows padded (the layout the Python wrappers allocate) and N a multiple of 8.
TEST(GemmCeCpu, CeBwdRowAgainstFp64) {
  auto rng = make_rng(1);
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32})
    for (int64_t N : {int64_t(1001), int64_t(136), int64_t(7)})
      for (bool with_r : {false, true})
        for (bool with_alpha : {false, true}) {
          SCOPED_TRACE(std::string(dtype_name(t)) + " N " + std::to_string(N) + (with_r ? " r" : "") + (with_alpha ? " alpha" : ""));
          Problem p(t, 13, N, 40, with_r, rng);
          HostTensor d(t, 13, N, (N + 7) / 8 * 8);
          d.poison();
          std::vector<float> lse(13), alpha = {-0.375f};
          for (int64_t i = 0; i < 13; ++i) lse[size_t(i)] = float(p.lse[size_t(i)]);
          GemmEpilogueArgs g = ce_args(p, d, lse, with_alpha ? &alpha : nullptr, with_r);
          Status st = run(g, GemmEpilogueOptions{Epilogue::kCeBwd});
          ASSERT_TRUE(st) << st.to_string();
          HostTensor ref = d;
          for (int64_t i = 0; i < 13; ++i)
            for (int64_t j = 0; j < N; ++j) ref.set(i, j, p.grad(i, j, with_alpha ? -0.375 : 1.0, double(lse[size_t(i)])));
          ENCORE_EXPECT_CLOSE(d, ref, t, "d");
          for (int64_t j = 0; j < N; ++j) EXPECT_EQ(d.get(2, j), 0.0) << "ignored row 2, column " << j;
        }
}

// A different ignore_index (a valid column): rows with it are 0, no one-hot anywhere else.
TEST(GemmCeCpu, CeBwdCustomIgnoreIndex) {
  auto rng = make_rng(2);
  Problem p(DType::kFP32, 6, 50, 16, false, rng);
  for (auto& x : p.target)
    if (x == -100) x = 3;
  HostTensor d(DType::kFP32, 6, 50);
  std::vector<float> lse(6);
  for (int64_t i = 0; i < 6; ++i) lse[size_t(i)] = float(p.lse[size_t(i)]);
  GemmEpilogueArgs g = ce_args(p, d, lse, nullptr, false);
  GemmEpilogueOptions o{Epilogue::kCeBwd};
  o.ignore_index = 3;
  ASSERT_TRUE(run(g, o));
  for (int64_t i = 0; i < 6; ++i)
    for (int64_t j = 0; j < 50; ++j) {
      const double want = p.target[size_t(i)] == 3 ? 0.0 : std::exp(p.z[size_t(i * 50 + j)] - lse[size_t(i)]) - (j == p.target[size_t(i)] ? 1 : 0);
      EXPECT_NEAR(d.get(i, j), want, 1e-6) << i << ", " << j;
    }
}

// The whole low-memory path on the CPU backend: lse (no D) -> lse_finish -> ce_bwd (α = 1/count) ->
// dx = D·W, dW = Dᵀ·A equals the fp64 gradient of the mean cross-entropy (fp32 operands).
TEST(GemmCeCpu, LsePlusCeBwdGivesTheMeanLossGradient) {
  auto rng = make_rng(3);
  const int64_t M = 21, N = 333, K = 24;
  Problem p(DType::kFP32, M, N, K, false, rng);
  const int64_t tiles = (N + 127) / 128;
  HostTensor part(DType::kFP32, M, tiles), d(DType::kFP32, M, N, 336);
  std::vector<float> tl(static_cast<size_t>(M)), lse(static_cast<size_t>(M)), loss(static_cast<size_t>(M));
  GemmEpilogueArgs f;
  f.a = p.a.view();
  f.w = p.w.view();
  f.partials = part.view();
  f.target = ivec_view(p.target);
  f.target_logit = vec_view(tl);
  ASSERT_TRUE(run(f, GemmEpilogueOptions{Epilogue::kLse, 128}));
  ASSERT_TRUE(run(LseFinishArgs{part.view(), vec_view(lse), f.target, vec_view(tl), vec_view(loss)}));
  int count = 0;
  for (int32_t t : p.target) count += t != -100;
  std::vector<float> alpha = {1.0f / float(count)};
  GemmEpilogueArgs g = ce_args(p, d, lse, &alpha, false);
  ASSERT_TRUE(run(g, GemmEpilogueOptions{Epilogue::kCeBwd}));
  double loss_sum = 0, loss_ref = 0;
  for (int64_t i = 0; i < M; ++i) {
    loss_sum += loss[size_t(i)];
    if (p.target[size_t(i)] != -100) loss_ref += p.lse[size_t(i)] - p.z[size_t(i * N + p.target[size_t(i)])];
  }
  EXPECT_NEAR(loss_sum / count, loss_ref / count, 1e-5);
  // dx[i, k] = Σ_j D[i, j]·W[j, k] against Σ_j g_ref[i, j]·W[j, k]; dW likewise
  double err = 0, norm = 0;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) {
      double got = 0, want = 0;
      for (int64_t j = 0; j < N; ++j) {
        got += d.get(i, j) * p.w.get(j, k);
        want += p.grad(i, j, 1.0 / count, p.lse[size_t(i)]) * p.w.get(j, k);
      }
      err += (got - want) * (got - want);
      norm += want * want;
    }
  EXPECT_LT(std::sqrt(err / norm), 1e-5);
  err = norm = 0;
  for (int64_t j = 0; j < N; ++j)
    for (int64_t k = 0; k < K; ++k) {
      double got = 0, want = 0;
      for (int64_t i = 0; i < M; ++i) {
        got += d.get(i, j) * p.a.get(i, k);
        want += p.grad(i, j, 1.0 / count, p.lse[size_t(i)]) * p.a.get(i, k);
      }
      err += (got - want) * (got - want);
      norm += want * want;
    }
  EXPECT_LT(std::sqrt(err / norm), 1e-5);
}

// cross_entropy_bwd on stored logits: out of place and in place, with and without α, N odd.
TEST(GemmCeCpu, CrossEntropyBwdFinisher) {
  auto rng = make_rng(4);
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32})
    for (bool with_alpha : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + (with_alpha ? " alpha" : ""));
      Problem p(t, 11, 257, 32, false, rng);
      HostTensor logits(t, 11, 257, 264);
      for (int64_t i = 0; i < 11; ++i)
        for (int64_t j = 0; j < 257; ++j) logits.set(i, j, p.z[size_t(i * 257 + j)]);
      std::vector<float> lse(11), alpha = {2.5f};
      for (int64_t i = 0; i < 11; ++i) lse[size_t(i)] = float(p.lse[size_t(i)]);
      HostTensor out(t, 11, 257);
      out.poison();
      CrossEntropyBwdArgs a{logits.view(), vec_view(lse), ivec_view(p.target), with_alpha ? vec_view(alpha) : TensorView{}, out.view()};
      Status st = run(a);
      ASSERT_TRUE(st) << st.to_string();
      HostTensor ref = out;
      for (int64_t i = 0; i < 11; ++i)
        for (int64_t j = 0; j < 257; ++j) {
          // the oracle on the logits as stored (rounded to t)
          const int32_t tg = p.target[size_t(i)];
          ref.set(i, j, tg == -100 ? 0.0 : (with_alpha ? 2.5 : 1.0) * (std::exp(logits.get(i, j) - double(lse[size_t(i)])) - (j == tg ? 1.0 : 0.0)));
        }
      ENCORE_EXPECT_CLOSE(out, ref, t, "dlogits");
      a.dlogits = logits.view();  // in place
      ASSERT_TRUE(run(a));
      for (int64_t i = 0; i < 11; ++i)
        for (int64_t j = 0; j < 257; ++j) ASSERT_EQ(logits.get(i, j), out.get(i, j)) << i << ", " << j;
    }
}

void expect_error(const Status& st, const std::string& needle) {
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
}

TEST(GemmCeCpu, BadInput) {
  auto rng = make_rng(5);
  Problem p(DType::kBF16, 4, 10, 16, false, rng);
  HostTensor d(DType::kBF16, 4, 10), d32(DType::kFP16, 4, 10), d_short(DType::kBF16, 4, 9);
  std::vector<float> lse(4, 3.0f), lse3(3, 3.0f), tl(4);
  GemmEpilogueArgs g = ce_args(p, d, lse, nullptr, false);
  GemmEpilogueOptions o{Epilogue::kCeBwd};
  // targets out of range other than ignore_index (host data: checked)
  p.target = {0, 10, 3, -100};
  g.target = ivec_view(p.target);
  expect_error(run(g, o), "target: row 1 has target 10, outside [0, 10) and not ignore_index (-100)");
  p.target = {0, -1, 3, -100};
  expect_error(run(g, o), "target: row 1 has target -1");
  p.target = {0, 1, 3, -100};
  ASSERT_TRUE(run(g, o));
  // missing, wrong-shaped, wrong-typed operands
  GemmEpilogueArgs m = g;
  m.lse = {};
  expect_error(run(m, o), "lse: tensor is missing");
  m = g;
  m.target = {};
  expect_error(run(m, o), "target: tensor is missing");
  m = g;
  m.lse = vec_view(lse3);
  expect_error(run(m, o), "lse: expected [M] = [4], got [3]");
  m = g;
  m.lse = TensorView::contiguous(p.target.data(), DType::kInt32, {4});
  expect_error(run(m, o), "lse: dtype must be one of {fp32}, got int32");
  m = g;
  m.target = vec_view(lse);
  expect_error(run(m, o), "target: dtype must be one of {int32}, got fp32");
  m = g;
  m.d = d32.view();
  expect_error(run(m, o), "d: dtype");
  m = g;
  m.d = d_short.view();
  expect_error(run(m, o), "d: expected [M, N] = [4, 10], got [4, 9]");
  m = g;
  m.target_logit = vec_view(tl);
  expect_error(run(m, o), "target_logit: not used by the ce_bwd epilogue");
  // the lse operand is refused by the rows that do not read it
  GemmEpilogueArgs s;
  s.a = p.a.view();
  s.w = p.w.view();
  s.d = d.view();
  s.lse = vec_view(lse);
  expect_error(run(s, GemmEpilogueOptions{Epilogue::kScalarScale}), "not used by the scalar_scale epilogue");

  // cross_entropy_bwd
  HostTensor logits(DType::kBF16, 4, 10), out(DType::kBF16, 4, 10), out16(DType::kFP16, 4, 10);
  CrossEntropyBwdArgs c{logits.view(), vec_view(lse), ivec_view(p.target), {}, out.view()};
  ASSERT_TRUE(run(c));
  p.target = {0, 1, 30, -100};
  expect_error(run(c), "target: row 2 has target 30, outside [0, 10)");
  p.target = {0, 1, 3, -100};
  CrossEntropyBwdArgs bad = c;
  bad.dlogits = out16.view();
  expect_error(run(bad), "dlogits: dtype");
  bad = c;
  bad.lse = vec_view(lse3);
  expect_error(run(bad), "lse: expected [M] = [4]");
  bad = c;
  bad.alpha = vec_view(lse);
  expect_error(run(bad), "alpha: expected [1]");
  bad = c;  // a partial overlap (not in place)
  bad.dlogits = TensorView::strided(static_cast<char*>(logits.view().data) + 2, DType::kBF16, {4, 10}, {10, 1});
  expect_error(run(bad), "dlogits");
}

// CUDA limits checked before any device access: N odd needs D's rows 16-byte aligned (a padded D view),
// else the error names d; N odd is refused for the rows that do not take it.
TEST(GemmCeCpu, CudaRaggedVocabularyNeedsAlignedDRows) {
  const Device gpu{DeviceType::kCUDA, 0};
  HostTensor a(DType::kBF16, 4, 16), w(DType::kBF16, 1001, 16), d(DType::kBF16, 4, 1001), dp(DType::kBF16, 4, 1001, 1008);
  std::vector<float> lse(4, 0.0f), r(4, 1.0f);
  std::vector<int32_t> t = {0, 1, 2, 3};
  GemmEpilogueArgs g;
  g.a = a.view();
  g.w = w.view();
  g.d = d.view();
  g.lse = vec_view(lse);
  g.target = ivec_view(t);
  for (TensorView* v : {&g.a, &g.w, &g.d, &g.lse, &g.target}) v->device = gpu;
  expect_error(run(g, GemmEpilogueOptions{Epilogue::kCeBwd}), "d: row stride 1001 elements is not 16-byte aligned (N = 1001)");
  // lse with logits: the same rule
  HostTensor part(DType::kFP32, 4, 8);
  GemmEpilogueArgs l;
  l.a = g.a;
  l.w = g.w;
  l.d = g.d;
  l.partials = part.view();
  l.partials.device = gpu;
  expect_error(run(l, GemmEpilogueOptions{Epilogue::kLse, 128}), "d: row stride 1001 elements is not 16-byte aligned");
  // row_scale keeps N % 8
  GemmEpilogueArgs s;
  s.a = g.a;
  s.w = g.w;
  s.d = dp.view();
  s.d.device = gpu;
  s.row_scale = vec_view(r);
  s.row_scale.device = gpu;
  expect_error(run(s, GemmEpilogueOptions{Epilogue::kRowScale}), "w: N = 1001 must be a multiple of 8 on CUDA");
}

}  // namespace
}  // namespace encore::test
