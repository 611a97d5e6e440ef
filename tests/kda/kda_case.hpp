// Test helper: one KDA problem as fp64 host vectors (inputs, options, output buffers) and its
// KdaForwardArgs views; shared by the CPU and GPU KDA tests.
#pragma once
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "encore/kda.hpp"
#include "kda/problem.hpp"
#include "kda/reference/kda_ref.hpp"

namespace encore::test {

enum class Gate { kPrecomputed, kSoftplus, kSoftplusBias, kLowerBound };

// fp64 host tensors for one KDA problem.
struct KdaCase {
  int64_t B, T, H, K, V;
  std::vector<int64_t> cu;  // empty: fixed length
  Gate gate = Gate::kPrecomputed;
  bool h0 = false, l2 = false, final_state = true;
  double k_sd = 0;  // key standard deviation; 0: 3.0 with the L2 norm (large keys), else 0.4
  // In-kernel gates with strong decays: e^A_log spread from 0.37 to 12 over the heads and dt_bias ~
  // N(0, 1) (the range of fla's peer-script inputs, A_log ~ N(0, 1)), so some heads' 16-row blocks
  // decay by more than 2^100 and others do not; else e^A_log in [0.37, 1.5) and dt_bias ~ N(0, 0.25).
  bool strong_decays = false;
  int64_t HV = 0;  // value heads (grouped value attention: a multiple of H); 0: H
  std::vector<double> q, k, v, g, beta, init, A_log, dt_bias, o, fin;
  KdaOptions opts;

  int64_t N() const { return cu.empty() ? B : int64_t(cu.size()) - 1; }
  int64_t Hv() const { return HV > 0 ? HV : H; }
  void fill(uint64_t seed) {
    std::mt19937_64 rng(seed ^ std::random_device{}());
    std::normal_distribution<double> nd;
    std::uniform_real_distribution<double> ud(0.0, 1.0);
    auto randn = [&](std::vector<double>& x, size_t n, double sd) {
      x.resize(n);
      for (auto& e : x) e = sd * nd(rng);
    };
    const int64_t Hv = this->Hv();
    const size_t nk = size_t(B * T * H * K), nv = size_t(B * T * Hv * V);
    randn(q, nk, 1.0);
    randn(k, nk, k_sd > 0 ? k_sd : (l2 ? 3.0 : 0.4));
    randn(v, nv, 1.0);
    beta.resize(size_t(B * T * Hv));
    for (auto& e : beta) e = 0.1 + 0.8 * ud(rng);
    g.resize(size_t(B * T * Hv * K));
    for (auto& e : g) {
      if (gate == Gate::kPrecomputed) e = std::log(1.0 / (1.0 + std::exp(-nd(rng)))) / 4.0;  // log-sigmoid / norm
      else e = 2.0 * nd(rng);                                                                // raw gate
    }
    if (h0) randn(init, size_t(N() * Hv * K * V), 0.5);
    if (gate != Gate::kPrecomputed) {
      A_log.resize(size_t(Hv));
      for (size_t h = 0; h < A_log.size(); ++h)
        A_log[h] = strong_decays ? -1.0 + 3.5 * double(h) / double(std::max<int64_t>(Hv - 1, 1)) : std::log(1.0 + 3.0 * ud(rng)) - 1.0;
    }
    if (gate == Gate::kSoftplusBias || gate == Gate::kLowerBound) randn(dt_bias, size_t(Hv * K), strong_decays ? 1.0 : 0.5);
    opts.use_gate_in_kernel = gate != Gate::kPrecomputed;
    opts.use_lower_bound = gate == Gate::kLowerBound;
    opts.lower_bound = -5.0;
    opts.use_qk_l2norm = l2;
    opts.output_final_state = final_state;
    o.assign(nv, NAN);
    fin.assign(size_t(N() * Hv * K * V), NAN);
  }
  // The same problem with H = HV heads and q, k repeated explicitly (value head h reads q/k head
  // h / (HV / H)): the reference for grouped value heads.
  KdaCase head_repeated() const {
    KdaCase r = *this;
    const int64_t Hv = this->Hv(), group = Hv / H;
    r.H = Hv;
    r.HV = 0;
    r.q.assign(size_t(B * T * Hv * K), 0.0);
    r.k.assign(size_t(B * T * Hv * K), 0.0);
    for (int64_t bt = 0; bt < B * T; ++bt)
      for (int64_t h = 0; h < Hv; ++h)
        for (int64_t c = 0; c < K; ++c) {
          r.q[size_t((bt * Hv + h) * K + c)] = q[size_t((bt * H + h / group) * K + c)];
          r.k[size_t((bt * Hv + h) * K + c)] = k[size_t((bt * H + h / group) * K + c)];
        }
    return r;
  }
  KdaForwardArgs args() {
    const int64_t Hv = this->Hv();
    auto t4 = [&](std::vector<double>& x, int64_t heads, int64_t d) { return TensorView::contiguous(x.data(), DType::kFP64, {B, T, heads, d}); };
    KdaForwardArgs a;
    a.q = t4(q, H, K);
    a.k = t4(k, H, K);
    a.v = t4(v, Hv, V);
    a.g = t4(g, Hv, K);
    a.beta = TensorView::contiguous(beta.data(), DType::kFP64, {B, T, Hv});
    if (h0) a.initial_state = TensorView::contiguous(init.data(), DType::kFP64, {N(), Hv, K, V});
    if (!A_log.empty()) a.A_log = TensorView::contiguous(A_log.data(), DType::kFP64, {Hv});
    if (!dt_bias.empty()) a.dt_bias = TensorView::contiguous(dt_bias.data(), DType::kFP64, {Hv * K});
    if (!cu.empty()) a.cu_seqlens = TensorView::contiguous(cu.data(), DType::kInt64, {int64_t(cu.size())});
    a.o = t4(o, Hv, V);
    if (final_state) a.final_state = TensorView::contiguous(fin.data(), DType::kFP64, {N(), Hv, K, V});
    return a;
  }

  // How the CUDA chunk kernel computes each diagonal 16-row block of Aqk and L, decided (as there)
  // by decay spans in log2 over all channels of this case's current inputs, the gate activated by the
  // CPU reference (reference::kda_prepare): one reference (row r) when max (G_r − G_i) over the
  // block is <= 100; two references (rows r..r+7 against r, r+8..r+15 against r+8) when each half's
  // span is; the halving references (diag_block_by_halving) otherwise.
  struct DiagBlockPaths {
    int one_ref = 0, two_refs = 0, halving = 0;
  };
  DiagBlockPaths diag_block_paths() {
    constexpr double kMaxSpan = 100.0 * 0.6931471805599453;  // 2^100, in the reference's natural-log gate
    kda::KdaProblem p;
    if (!kda::make_problem(args(), opts, &p)) return {};
    const reference::KdaInputs in = reference::kda_prepare(p, args());
    DiagBlockPaths n;
    for (const kda::Sequence& sq : p.seqs)
      for (int64_t h = 0; h < Hv(); ++h)
        for (int64_t r = sq.begin; r < sq.end; r += 16) {  // chunks start at sq.begin: 16 divides 64
          double span = 0, span_lo = 0, span_hi = 0;
          for (int64_t kc = 0; kc < K; ++kc) {
            double d = 0, d8 = 0;  // G_r − G_i and G_{r+8} − G_i
            for (int64_t i = r + 1; i < std::min(r + 16, sq.end); ++i) {
              const double x = -in.g[size_t(((sq.batch * T + i) * Hv() + h) * K + kc)];
              d += x;
              span = std::max(span, d);
              if (i < r + 8) span_lo = std::max(span_lo, d);
              if (i > r + 8) span_hi = std::max(span_hi, d8 += x);
            }
          }
          if (span <= kMaxSpan) ++n.one_ref;
          else if (span_lo <= kMaxSpan && span_hi <= kMaxSpan) ++n.two_refs;
          else ++n.halving;
        }
    return n;
  }
};

// Relative RMS error of a against b; with floor_rms > 0 the denominator is at least that RMS per element
// (for quantities whose scale is known, e.g. a transition matrix against the identity's).
inline double rel_err(const std::vector<double>& a, const std::vector<double>& b, double floor_rms = 0) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  den = std::max(den, floor_rms * floor_rms * double(b.size()));
  return std::sqrt(num / std::max(den, 1e-300));
}

// States [rows, HV, d2, d3] -> [rows, HV, d3, d2]: [.., K, V] to state_v_first's [.., V, K] (d2, d3 swapped
// for the way back).
inline std::vector<double> transpose_states(const std::vector<double>& s, int64_t rows, int64_t HV, int64_t d2, int64_t d3) {
  std::vector<double> t(s.size());
  for (int64_t r = 0; r < rows * HV; ++r)
    for (int64_t a = 0; a < d2; ++a)
      for (int64_t b = 0; b < d3; ++b) t[size_t((r * d3 + b) * d2 + a)] = s[size_t((r * d2 + a) * d3 + b)];
  return t;
}

// A backward's cotangents for case c: d_o ~ N(0, 1) [o's size], then d_fin ~ 0.1 N(0, 1) [fin's size], from seed.
struct Cotangents {
  std::vector<double> d_o, d_fin;
};
inline Cotangents cotangents(const KdaCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd;
  Cotangents t{std::vector<double>(c.o.size()), std::vector<double>(c.fin.size())};
  for (auto& x : t.d_o) x = nd(rng);
  for (auto& x : t.d_fin) x = 0.1 * nd(rng);
  return t;
}

}  // namespace encore::test
