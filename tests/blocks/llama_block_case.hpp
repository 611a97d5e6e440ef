// Test helper: random inputs of a LLaMA shifted block (encore/blocks/llama.hpp) and the textbook, unfused
// block computed in double with optional rounding of every op's output to a dtype:
//   ref_hi (round_to = none): the exact block, for the 2x rule and the algebra check;
//   ref_lo (round_to = bf16/fp16): the same unfused computation with each op storing its result in
//   that dtype (GEMM outputs, residual adds, norm outputs, SwiGLU, RoPE), like cuBLAS + eager ops.
#pragma once
#include <cmath>
#include <optional>
#include <random>
#include <vector>

#include "encore/gemm.hpp"
#include "encore/blocks/llama.hpp"
#include "testing/host_tensor.hpp"

namespace encore::test {

struct BlockCase {
  int64_t M, d, F, heads, rotary_heads, head_dim;
  DType t;
  HostTensor y0, x0, w0, w1, w2, w3, g0, g1, pos, freq;
  BlockCase(int64_t M_, int64_t d_, int64_t F_, int64_t heads_, int64_t rotary_, int64_t head_dim_, DType t_, std::mt19937_64& rng)
      : M(M_), d(d_), F(F_), heads(heads_), rotary_heads(rotary_), head_dim(head_dim_), t(t_), y0(t, M, d), x0(t, M, d), w0(t, d, d),
        w1(t, 2 * F, d), w2(t, d, F), w3(t, heads * head_dim, d), g0(HostTensor::vector(t, d)), g1(HostTensor::vector(t, d)),
        pos(HostTensor::vector(DType::kInt32, M)), freq(HostTensor::vector(DType::kFP32, heads * head_dim)) {
    y0.fill_normal(rng);
    x0.fill_normal(rng);
    w0.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(d)));
    w1.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(d)));
    w2.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(F)));
    w3.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(d)));
    g0.fill_normal(rng, 1.0, 0.2);
    g1.fill_normal(rng, 1.0, 0.2);
    for (int64_t m = 0; m < M; ++m) pos.set(0, m, double(int64_t(rng() % 100000)));
    rope_freq_turns(int(heads), int(rotary_heads), int(head_dim), 500000.0, freq.view());
  }
  int64_t nqkv() const { return heads * head_dim; }
};

struct BlockOutputs {
  std::vector<double> x1, x2, z1, qkv, r1, r2;
};

inline double round_to(double v, std::optional<DType> t) {
  if (!t) return v;
  unsigned char buf[8];
  store_from_double(buf, *t, 0, v);
  return load_as_double(buf, *t, 0);
}

// The textbook block (see encore/blocks/llama.hpp), every op's output rounded to `t` when given.
inline BlockOutputs unfused_block(const BlockCase& c, std::optional<DType> t, double eps) {
  const int64_t M = c.M, d = c.d, F = c.F, N = c.nqkv();
  auto gemm = [&](const std::vector<double>& a, int64_t K, const HostTensor& w, int64_t Nw) {
    std::vector<double> out(size_t(M * Nw));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < Nw; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += a[size_t(m * K + k)] * w.get(n, k);
        out[size_t(m * Nw + n)] = round_to(s, t);
      }
    return out;
  };
  auto rms = [&](const std::vector<double>& x, const HostTensor& g, std::vector<double>& r) {
    std::vector<double> out(x.size());
    r.assign(size_t(M), 0.0);
    for (int64_t m = 0; m < M; ++m) {
      double s = 0;
      for (int64_t j = 0; j < d; ++j) s += x[size_t(m * d + j)] * x[size_t(m * d + j)];
      r[size_t(m)] = 1.0 / std::sqrt(s / double(d) + eps);
      for (int64_t j = 0; j < d; ++j) out[size_t(m * d + j)] = round_to(x[size_t(m * d + j)] * r[size_t(m)] * g.get(0, j), t);
    }
    return out;
  };
  BlockOutputs o;
  std::vector<double> y0(size_t(M * d));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < d; ++j) y0[size_t(m * d + j)] = c.y0.get(m, j);
  o.x1 = gemm(y0, d, c.w0, d);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < d; ++j) o.x1[size_t(m * d + j)] = round_to(o.x1[size_t(m * d + j)] + c.x0.get(m, j), t);
  const std::vector<double> n1 = rms(o.x1, c.g0, o.r1);
  o.z1 = gemm(n1, d, c.w1, 2 * F);
  std::vector<double> y1(size_t(M * F));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < F; ++j) {
      const double g = o.z1[size_t(m * 2 * F + 2 * j)], u = o.z1[size_t(m * 2 * F + 2 * j + 1)];
      y1[size_t(m * F + j)] = round_to(g / (1.0 + std::exp(-g)) * u, t);
    }
  o.x2 = gemm(y1, F, c.w2, d);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < d; ++j) o.x2[size_t(m * d + j)] = round_to(o.x2[size_t(m * d + j)] + o.x1[size_t(m * d + j)], t);
  const std::vector<double> n2 = rms(o.x2, c.g1, o.r2);
  o.qkv = gemm(n2, d, c.w3, N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; 2 * j + 1 < N; ++j) {
      const double f = c.freq.get(0, 2 * j) + c.freq.get(0, 2 * j + 1);
      double turns = c.pos.get(0, m) * f;
      turns -= std::nearbyint(turns);
      const double th = 6.283185307179586 * turns, co = std::cos(th), si = std::sin(th);
      double& a = o.qkv[size_t(m * N + 2 * j)];
      double& b = o.qkv[size_t(m * N + 2 * j + 1)];
      const double a0 = a, b0 = b;
      a = round_to(a0 * co - b0 * si, t);
      b = round_to(b0 * co + a0 * si, t);
    }
  return o;
}

// Output tensors of a block run, host side.
struct BlockTensors {
  HostTensor x1, x2, z1, qkv, r1, r2;
  explicit BlockTensors(const BlockCase& c)
      : x1(c.t, c.M, c.d), x2(c.t, c.M, c.d), z1(c.t, c.M, 2 * c.F), qkv(c.t, c.M, c.nqkv()), r1(HostTensor::vector(DType::kFP32, c.M)),
        r2(HostTensor::vector(DType::kFP32, c.M)) {
    for (HostTensor* h : {&x1, &x2, &z1, &qkv, &r1, &r2}) h->poison();
  }
};

// max |out − ref| over a tensor (rows x cols of `out`, ref row-major dense).
inline double max_abs_diff(const HostTensor& out, const std::vector<double>& ref) {
  double mx = 0;
  for (int64_t i = 0; i < out.rows; ++i)
    for (int64_t j = 0; j < out.cols; ++j) {
      const double v = out.get(i, j), r = ref[size_t(i * out.cols + j)];
      if (!std::isfinite(v)) return INFINITY;
      mx = std::max(mx, std::fabs(v - r));
    }
  return mx;
}
inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double mx = 0;
  for (size_t i = 0; i < a.size(); ++i) mx = std::max(mx, std::fabs(a[i] - b[i]));
  return mx;
}

}  // namespace encore::test
