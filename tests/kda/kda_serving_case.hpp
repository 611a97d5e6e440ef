// Test helper for KDA serving (encore/kda_serving.hpp): per-token inputs, batches of sequence segments as
// fp64 views, and a state pool in fp32 / bf16 / fp64 with byte snapshots (untouched slots bit-identical).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "encore/kda.hpp"
#include "encore/kda_serving.hpp"

namespace encore::test {

// Sizes of the serving tests: grouped value heads (HV = 2H), K != V.
struct ServingDims {
  int64_t H = 2, HV = 4, K = 16, V = 8;
};

// One token's inputs for every head: q, k [H, K], v [HV, V], g [HV, K] (raw gate), beta [HV].
struct Token {
  std::vector<double> q, k, v, g, beta;
};

inline Token random_token(const ServingDims& d, std::mt19937_64& rng, bool nan = false) {
  std::normal_distribution<double> nd;
  std::uniform_real_distribution<double> ud(0.1, 0.9);
  auto fill = [&](std::vector<double>& x, int64_t n, double sd) {
    x.resize(size_t(n));
    for (auto& e : x) e = nan ? NAN : sd * nd(rng);
  };
  Token t;
  fill(t.q, d.H * d.K, 1.0);
  fill(t.k, d.H * d.K, 1.0);
  fill(t.v, d.HV * d.V, 1.0);
  fill(t.g, d.HV * d.K, 1.0);
  t.beta.resize(size_t(d.HV));
  for (auto& e : t.beta) e = nan ? NAN : ud(rng);
  return t;
}

// The gate parameters (softplus gate with dt_bias) shared by every call.
struct GateParams {
  std::vector<double> A_log, dt_bias;
  GateParams(const ServingDims& d, std::mt19937_64& rng) {
    std::normal_distribution<double> nd;
    for (int64_t h = 0; h < d.HV; ++h) A_log.push_back(std::log(0.5 + 0.25 * double(h)));
    for (int64_t i = 0; i < d.HV * d.K; ++i) dt_bias.push_back(0.5 * nd(rng));
  }
};

// Segments (one per sequence) as fp64 tensors: varlen (B = 1, cu_seqlens) or fixed length (B = N, every
// segment of T tokens).
struct Batch {
  ServingDims d;
  bool varlen = true;
  std::vector<double> q, k, v, g, beta, o;
  std::vector<int64_t> cu{0};
  int64_t rows = 0;

  void add(const std::vector<Token>& seg) {
    for (const Token& t : seg) {
      q.insert(q.end(), t.q.begin(), t.q.end());
      k.insert(k.end(), t.k.begin(), t.k.end());
      v.insert(v.end(), t.v.begin(), t.v.end());
      g.insert(g.end(), t.g.begin(), t.g.end());
      beta.insert(beta.end(), t.beta.begin(), t.beta.end());
    }
    rows += int64_t(seg.size());
    cu.push_back(rows);
  }
  int64_t N() const { return int64_t(cu.size()) - 1; }
  // The output rows of sequence n, [len, HV, V].
  std::vector<double> o_rows(int64_t n) const {
    return {o.begin() + cu[size_t(n)] * d.HV * d.V, o.begin() + cu[size_t(n) + 1] * d.HV * d.V};
  }
  KdaForwardArgs forward(GateParams* gp = nullptr) {
    o.assign(size_t(rows * d.HV * d.V), NAN);
    const int64_t B = varlen ? 1 : N(), T = varlen ? rows : rows / std::max<int64_t>(N(), 1);
    auto t4 = [&](std::vector<double>& x, int64_t heads, int64_t c) { return TensorView::contiguous(x.data(), DType::kFP64, {B, T, heads, c}); };
    KdaForwardArgs a;
    a.q = t4(q, d.H, d.K);
    a.k = t4(k, d.H, d.K);
    a.v = t4(v, d.HV, d.V);
    a.g = t4(g, d.HV, d.K);
    a.beta = TensorView::contiguous(beta.data(), DType::kFP64, {B, T, d.HV});
    a.o = t4(o, d.HV, d.V);
    if (varlen) a.cu_seqlens = TensorView::contiguous(cu.data(), DType::kInt64, {int64_t(cu.size())});
    if (gp) {
      a.A_log = TensorView::contiguous(gp->A_log.data(), DType::kFP64, {d.HV});
      a.dt_bias = TensorView::contiguous(gp->dt_bias.data(), DType::kFP64, {d.HV * d.K});
    }
    return a;
  }
  KdaRecurrentArgs recurrent(GateParams* gp = nullptr) {
    const KdaForwardArgs f = forward(gp);
    KdaRecurrentArgs a;
    a.q = f.q, a.k = f.k, a.v = f.v, a.g = f.g, a.beta = f.beta, a.A_log = f.A_log, a.dt_bias = f.dt_bias, a.cu_seqlens = f.cu_seqlens;
    a.o = f.o;
    return a;
  }
};

// A state pool [P, HV, K, V] in `dtype`, filled with garbage; byte snapshots compare slots bit for bit.
struct Pool {
  ServingDims d;
  int64_t P;
  DType dtype;
  std::vector<unsigned char> bytes;
  Pool(const ServingDims& dims, int64_t slots, DType dt, std::mt19937_64& rng) : d(dims), P(slots), dtype(dt) {
    bytes.resize(size_t(P * slot_elems()) * dtype_size(dtype));
    std::normal_distribution<double> nd;
    for (int64_t i = 0; i < P * slot_elems(); ++i) store_from_double(bytes.data(), dtype, i, nd(rng));
  }
  int64_t slot_elems() const { return d.HV * d.K * d.V; }
  size_t slot_bytes() const { return size_t(slot_elems()) * dtype_size(dtype); }
  TensorView view() { return TensorView::contiguous(bytes.data(), dtype, {P, d.HV, d.K, d.V}); }
  void zero(int64_t s) {
    for (int64_t i = 0; i < slot_elems(); ++i) store_from_double(bytes.data(), dtype, s * slot_elems() + i, 0.0);
  }
  std::vector<double> slot(int64_t s) const {
    std::vector<double> x(static_cast<size_t>(slot_elems()));
    for (int64_t i = 0; i < slot_elems(); ++i) x[size_t(i)] = load_as_double(bytes.data(), dtype, s * slot_elems() + i);
    return x;
  }
  // `x` rounded to the pool's dtype, as the pool would hold it.
  std::vector<double> rounded(const std::vector<double>& x) const {
    std::vector<unsigned char> b(x.size() * dtype_size(dtype));
    std::vector<double> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      store_from_double(b.data(), dtype, int64_t(i), x[i]);
      r[i] = load_as_double(b.data(), dtype, int64_t(i));
    }
    return r;
  }
  bool slot_equals(const std::vector<unsigned char>& snapshot, int64_t s) const {
    return std::memcmp(bytes.data() + size_t(s) * slot_bytes(), snapshot.data() + size_t(s) * slot_bytes(), slot_bytes()) == 0;
  }
};

}  // namespace encore::test
