// Test helper for the last layer + loss (encore/blocks/llama_last.hpp): random inputs of one dtype with
// ignore_index rows among the targets, NaN-poisoned outputs, host args of the forward and the backward,
// and the fp64 textbook (the unfused layer and loss written op by op) with its gradients from the staged
// fp64 reference (src/blocks/reference/llama_block_bwd.hpp, llama_last_layer_backward).
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "blocks/reference/llama_block_bwd.hpp"
#include "encore/blocks/llama_last.hpp"
#include "tests/blocks/llama_block_bwd_case.hpp"

namespace encore::test {

using Vec = std::vector<double>;

// The layer's parameters and inputs in fp64 (row-major), the perturbable arguments of textbook().
struct LastParams {
  int64_t M = 0, d = 0, F = 0, V = 0;
  Vec y0, x0, w0, w1, w2, g0, gf, wlm;
  std::vector<int64_t> target;
  std::vector<Vec*> all() { return {&y0, &x0, &w0, &w1, &w2, &g0, &gf, &wlm}; }
};

struct LastForward {
  Vec x1, x2, z1, h2, r1, r2, logits, lse;
  double loss = 0;
};

// The textbook layer: x1 = y0·w0ᵀ + x0; z1 = rmsnorm(x1)·γ0 @ w1ᵀ; y1 = silu(gate)·up; x2 = y1·w2ᵀ + x1;
// logits = rmsnorm(x2)·γf @ W_lmᵀ; loss = mean over counted rows of lse − logit[target] (0 if none).
inline LastForward textbook(const LastParams& p, double eps, int64_t ignore_index = -100) {
  using reference::matmul_nt;
  const int64_t M = p.M, d = p.d, F = p.F, V = p.V;
  LastForward o;
  auto norm = [&](const Vec& x, const Vec& g, Vec& r, Vec* h) {
    Vec out(x.size());
    r.assign(size_t(M), 0.0);
    if (h) h->assign(x.size(), 0.0);
    for (int64_t m = 0; m < M; ++m) {
      double s = 0;
      for (int64_t j = 0; j < d; ++j) s += x[size_t(m * d + j)] * x[size_t(m * d + j)];
      r[size_t(m)] = 1.0 / std::sqrt(s / double(d) + eps);
      for (int64_t j = 0; j < d; ++j) {
        out[size_t(m * d + j)] = x[size_t(m * d + j)] * r[size_t(m)] * g[size_t(j)];
        if (h) (*h)[size_t(m * d + j)] = x[size_t(m * d + j)] * g[size_t(j)];
      }
    }
    return out;
  };
  o.x1 = matmul_nt(p.y0, M, d, p.w0, d);
  for (size_t i = 0; i < o.x1.size(); ++i) o.x1[i] += p.x0[i];
  o.z1 = matmul_nt(norm(o.x1, p.g0, o.r1, nullptr), M, d, p.w1, 2 * F);
  Vec y1(size_t(M * F));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < F; ++j) {
      const double g = o.z1[size_t(m * 2 * F + 2 * j)], u = o.z1[size_t(m * 2 * F + 2 * j + 1)];
      y1[size_t(m * F + j)] = g / (1.0 + std::exp(-g)) * u;
    }
  o.x2 = matmul_nt(y1, M, F, p.w2, d);
  for (size_t i = 0; i < o.x2.size(); ++i) o.x2[i] += o.x1[i];
  o.logits = matmul_nt(norm(o.x2, p.gf, o.r2, &o.h2), M, d, p.wlm, V);
  o.lse.assign(size_t(M), 0.0);
  double total = 0;
  int64_t n = 0;
  for (int64_t m = 0; m < M; ++m) {
    double mx = -INFINITY, s = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, o.logits[size_t(m * V + v)]);
    for (int64_t v = 0; v < V; ++v) s += std::exp(o.logits[size_t(m * V + v)] - mx);
    o.lse[size_t(m)] = mx + std::log(s);
    const int64_t y = p.target[size_t(m)];
    if (y == ignore_index) continue;
    ++n;
    total += o.lse[size_t(m)] - o.logits[size_t(m * V + y)];
  }
  o.loss = n > 0 ? total / double(n) : 0.0;
  return o;
}

struct LastCase {
  int64_t M, d, F, V;
  DType t;
  HostTensor y0, x0, w0, w1, w2, g0, gf, wlm, target;
  HostTensor x1, x2, z1, h2, r1, r2, lse, loss;                  // forward outputs
  HostTensor d_loss, d_y0, d_x0, dw0, dw1, dw2, dwlm, dg0, dgf;  // backward: input d_loss, outputs
  // ignore_every: rows m with m % ignore_every == 1 are ignored (0: none; 1: all)
  LastCase(int64_t M_, int64_t d_, int64_t F_, int64_t V_, DType t_, std::mt19937_64& rng, int ignore_every = 5, double d_loss_value = 0.75)
      : M(M_), d(d_), F(F_), V(V_), t(t_), y0(t, M, d), x0(t, M, d), w0(t, d, d), w1(t, 2 * F, d), w2(t, d, F), g0(HostTensor::vector(t, d)),
        gf(HostTensor::vector(t, d)), wlm(t, V, d), target(HostTensor::vector(DType::kInt32, M)), x1(t, M, d), x2(t, M, d), z1(t, M, 2 * F),
        h2(t, M, d), r1(HostTensor::vector(DType::kFP32, M)), r2(HostTensor::vector(DType::kFP32, M)), lse(HostTensor::vector(DType::kFP32, M)),
        loss(HostTensor::vector(DType::kFP32, 1)), d_loss(HostTensor::vector(DType::kFP32, 1)), d_y0(t, M, d), d_x0(t, M, d), dw0(t, d, d),
        dw1(t, 2 * F, d), dw2(t, d, F), dwlm(t, V, d), dg0(HostTensor::vector(DType::kFP32, d)), dgf(HostTensor::vector(DType::kFP32, d)) {
    y0.fill_normal(rng);
    x0.fill_normal(rng);
    w0.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(d)));
    w1.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(d)));
    w2.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(F)));
    wlm.fill_normal(rng, 0.0, 2.0 / std::sqrt(double(d)));
    g0.fill_normal(rng, 1.0, 0.2);
    gf.fill_normal(rng, 1.0, 0.2);
    for (int64_t m = 0; m < M; ++m) {
      const bool ignored = ignore_every == 1 || (ignore_every > 1 && m % ignore_every == 1);
      target.set(0, m, ignored ? -100.0 : double(int64_t(rng() % uint64_t(V))));
    }
    d_loss.set(0, 0, d_loss_value);
    for (HostTensor* h : outputs()) h->poison();
  }
  LastCase(const LastCase&) = delete;

  std::vector<HostTensor*> forward_outputs() { return {&x1, &x2, &z1, &h2, &r1, &r2, &lse, &loss}; }
  std::vector<HostTensor*> grads() { return {&d_y0, &d_x0, &dw0, &dw1, &dw2, &dwlm, &dg0, &dgf}; }
  static std::vector<const char*> grad_names() { return {"d_y0", "d_x0", "dw0", "dw1", "dw2", "dw_lm", "dgamma0", "dgamma_final"}; }
  std::vector<HostTensor*> outputs() {
    std::vector<HostTensor*> o = forward_outputs();
    for (HostTensor* g : grads()) o.push_back(g);
    return o;
  }
  LlamaLastBlockArgs fwd_args() const {
    return {y0.view(), x0.view(), w0.view(), w1.view(), w2.view(), g0.view(), gf.view(), wlm.view(), target.view(),
            x1.view(), x2.view(), z1.view(), h2.view(), r1.view(), r2.view(), lse.view(), loss.view()};
  }
  LlamaLastBlockBwdArgs bwd_args() const {
    return {y0.view(),  w0.view(),  w1.view(),  w2.view(),  g0.view(),  gf.view(),   wlm.view(), target.view(), x1.view(),
            x2.view(),  z1.view(),  h2.view(),  r1.view(),  r2.view(),  lse.view(),  d_loss.view(), d_y0.view(), d_x0.view(),
            dw0.view(), dw1.view(), dw2.view(), dwlm.view(), dg0.view(), dgf.view()};
  }
  LastParams params() const {
    LastParams p;
    p.M = M, p.d = d, p.F = F, p.V = V;
    auto load = [](const HostTensor& h) {
      Vec v(size_t(h.rows * h.cols));
      for (int64_t i = 0; i < h.rows; ++i)
        for (int64_t j = 0; j < h.cols; ++j) v[size_t(i * h.cols + j)] = h.get(i, j);
      return v;
    };
    p.y0 = load(y0), p.x0 = load(x0), p.w0 = load(w0), p.w1 = load(w1), p.w2 = load(w2), p.g0 = load(g0), p.gf = load(gf), p.wlm = load(wlm);
    for (int64_t m = 0; m < M; ++m) p.target.push_back(int64_t(target.get(0, m)));
    return p;
  }
};

// fp64 gradients of d_loss·loss, in the order of LastCase::grads(), from the staged reference over the
// fp64 textbook forward.
inline std::vector<Vec> reference_grads(const LastParams& p, const LastForward& f, double d_loss) {
  reference::LlamaBlockBwdInputs in;
  in.dims = {p.M, p.d, p.F, 0};
  in.y0 = p.y0, in.x0 = p.x0, in.w0 = p.w0, in.w1 = p.w1, in.w2 = p.w2, in.gamma0 = p.g0;
  in.x1 = f.x1, in.x2 = f.x2, in.z1 = f.z1, in.r1 = f.r1, in.r2 = f.r2;
  reference::LlamaHeadInputs head;
  head.V = p.V;
  head.w_lm = p.wlm, head.gamma_final = p.gf, head.logits = f.logits, head.lse = f.lse, head.target = p.target;
  const reference::LlamaLastLayerBwd r = reference::llama_last_layer_backward(in, head);
  std::vector<Vec> g = {r.ffn.d_y0, r.ffn.d_x0, r.ffn.dw0, r.ffn.dw1, r.ffn.dw2, r.dw_lm, r.ffn.norm1.dgamma, r.norm.dgamma};
  for (Vec& v : g)
    for (double& x : v) x *= d_loss;
  return g;
}

inline Status run_last_forward(const LastCase& k, const LlamaLastBlockOptions& o = {}) {
  const LlamaLastBlockArgs a = k.fwd_args();
  const size_t bytes = workspace_bytes(a, o);
  if (bytes == 0) return validate(a, o);
  std::vector<unsigned char> ws(bytes + 256);
  return run(a, o, align_up_256(ws));
}
inline Status run_last_backward(const LastCase& k, const LlamaLastBlockBwdOptions& o = {}) {
  const LlamaLastBlockBwdArgs a = k.bwd_args();
  const size_t bytes = workspace_bytes(a, o);
  if (bytes == 0) return validate(a, o);
  std::vector<unsigned char> ws(bytes + 256);
  return run(a, o, align_up_256(ws));
}

}  // namespace encore::test
