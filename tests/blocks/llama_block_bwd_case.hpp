// Test helper for the LLaMA block backward API (encore/blocks/llama.hpp, llama_block_backward): a
// forward case (BlockCase) run once on the CPU backend in its dtype, whose saved tensors the backward
// reads, random incoming gradients d_qkv and d_x2, NaN-poisoned outputs, and the fp64 staged
// reference (src/blocks/reference/llama_block_bwd.hpp) over the same saved tensors.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "blocks/reference/llama_block_bwd.hpp"
#include "tests/blocks/llama_block_case.hpp"

namespace encore::test {

inline void* align_up_256(std::vector<unsigned char>& buf) {
  return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(buf.data()) + 255) / 256 * 256);
}

struct BlockBwdCase {
  BlockCase c;
  BlockTensors fwd;
  LlamaBlockArgs fa;  // the forward's host args (c's inputs, fwd's outputs)
  HostTensor d_qkv, d_x2;
  HostTensor d_y0, d_x0, dw0, dw1, dw2, dw3, dg0, dg1;  // outputs, poisoned
  BlockBwdCase(int64_t M, int64_t d, int64_t F, int64_t heads, int64_t rotary, int64_t head_dim, DType t, std::mt19937_64& rng)
      : c(M, d, F, heads, rotary, head_dim, t, rng), fwd(c), d_qkv(t, M, c.nqkv()), d_x2(t, M, d), d_y0(t, M, d), d_x0(t, M, d),
        dw0(t, d, d), dw1(t, 2 * F, d), dw2(t, d, F), dw3(t, c.nqkv(), d), dg0(HostTensor::vector(DType::kFP32, d)),
        dg1(HostTensor::vector(DType::kFP32, d)) {
    fa = LlamaBlockArgs{c.y0.view(), c.x0.view(), c.w0.view(), c.w1.view(),  c.w2.view(),  c.w3.view(),  c.g0.view(),  c.g1.view(),
                        c.pos.view(), c.freq.view(), fwd.x1.view(), fwd.x2.view(), fwd.z1.view(), fwd.qkv.view(), fwd.r1.view(), fwd.r2.view()};
    std::vector<unsigned char> ws(workspace_bytes(fa, LlamaBlockOptions{}) + 256);
    const Status st = run(fa, LlamaBlockOptions{}, align_up_256(ws));
    if (!st) throw std::runtime_error("forward: " + st.to_string());
    d_qkv.fill_normal(rng);
    d_x2.fill_normal(rng);
    for (HostTensor* h : outputs()) h->poison();
  }
  BlockBwdCase(const BlockBwdCase&) = delete;
  std::vector<HostTensor*> outputs() { return {&d_y0, &d_x0, &dw0, &dw1, &dw2, &dw3, &dg0, &dg1}; }
  static std::vector<const char*> output_names() { return {"d_y0", "d_x0", "dw0", "dw1", "dw2", "dw3", "dgamma0", "dgamma1"}; }
  // Every tensor the backward reads, in LlamaBlockBwdArgs order up to d_x2.
  std::vector<const HostTensor*> inputs() const {
    return {&c.y0, &c.w0, &c.w1, &c.w2, &c.w3, &c.g0, &c.g1, &c.pos, &c.freq, &fwd.x1, &fwd.x2, &fwd.z1, &fwd.qkv, &fwd.r1, &fwd.r2, &d_qkv, &d_x2};
  }
  // Args from views (17 inputs then 8 outputs, in the order of inputs() and outputs()).
  static LlamaBlockBwdArgs args(const std::vector<TensorView>& v) {
    LlamaBlockBwdArgs a;
    TensorView* f[] = {&a.y0, &a.w0, &a.w1, &a.w2, &a.w3, &a.gamma0, &a.gamma1, &a.pos, &a.freq, &a.x1, &a.x2, &a.z1, &a.qkv, &a.r1, &a.r2,
                       &a.d_qkv, &a.d_x2, &a.d_y0, &a.d_x0, &a.dw0, &a.dw1, &a.dw2, &a.dw3, &a.dgamma0, &a.dgamma1};
    for (size_t i = 0; i < v.size(); ++i) *f[i] = v[i];
    return a;
  }
  LlamaBlockBwdArgs host_args() {
    std::vector<TensorView> v;
    for (const HostTensor* h : inputs()) v.push_back(h->view());
    for (HostTensor* h : outputs()) v.push_back(h->view());
    return args(v);
  }
  // The fp64 staged reference over the saved tensors (as stored, in the dtype) and these gradients.
  struct Ref {
    reference::LlamaBlockBwd r;
    std::vector<const std::vector<double>*> outs;  // in outputs() order
  };
  std::unique_ptr<Ref> reference() const {
    auto out = std::make_unique<Ref>();
    const reference::LlamaBlockBwdInputs in = reference::load_block_bwd_inputs(fa);
    std::vector<double> dq(size_t(c.M * c.nqkv())), dx(size_t(c.M * c.d));
    for (int64_t m = 0; m < c.M; ++m) {
      for (int64_t n = 0; n < c.nqkv(); ++n) dq[size_t(m * c.nqkv() + n)] = d_qkv.get(m, n);
      for (int64_t n = 0; n < c.d; ++n) dx[size_t(m * c.d + n)] = d_x2.get(m, n);
    }
    out->r = reference::llama_block_backward(in, dq, dx);
    const auto& r = out->r;
    out->outs = {&r.ffn.d_y0, &r.ffn.d_x0, &r.ffn.dw0, &r.ffn.dw1, &r.ffn.dw2, &r.qkv.dw3, &r.ffn.norm1.dgamma, &r.qkv.norm.dgamma};
    return out;
  }
};

// max |out − ref| / max |ref| (INFINITY on a non-finite output).
inline double rel_max_err(const HostTensor& out, const std::vector<double>& ref) {
  double s = 0;
  for (double v : ref) s = std::max(s, std::fabs(v));
  const double e = max_abs_diff(out, ref);
  return s > 0 ? e / s : e;
}
// sqrt(Σ (out − ref)² / Σ ref²) (INFINITY on a non-finite output).
inline double rel_rms_err(const HostTensor& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < out.rows; ++i)
    for (int64_t j = 0; j < out.cols; ++j) {
      const double v = out.get(i, j), r = ref[size_t(i * out.cols + j)];
      if (!std::isfinite(v)) return INFINITY;
      num += (v - r) * (v - r);
      den += r * r;
    }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace encore::test
