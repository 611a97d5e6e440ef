#include "gemm/reference/gemm_ref.hpp"

#include <cmath>
#include <limits>
#include <vector>

namespace encore::reference {
namespace {

constexpr double kTwoPi = 6.283185307179586;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

double at2(const TensorView& t, int64_t i, int64_t j) { return load_as_double(t.data, t.dtype, i * t.strides[0] + j * t.strides[1]); }
double at1(const TensorView& t, int64_t i) { return load_as_double(t.data, t.dtype, i * t.strides[0]); }
void put2(const TensorView& t, int64_t i, int64_t j, double v) { store_from_double(t.data, t.dtype, i * t.strides[0] + j * t.strides[1], v); }
void put1(const TensorView& t, int64_t i, double v) { store_from_double(t.data, t.dtype, i * t.strides[0], v); }

// ---- primitives -------------------------------------------------------------------------------

// Row-vector load + elementwise: acc[n] *= s.
void scale_row(std::vector<double>& acc, double s) {
  for (double& v : acc) v *= s;
}
// Tile load + elementwise: acc[n] += C[m, n].
void add_tile_row(std::vector<double>& acc, const TensorView& c, int64_t m) {
  for (size_t n = 0; n < acc.size(); ++n) acc[n] += at2(c, m, int64_t(n));
}
// Tile store of one row.
void store_row(const TensorView& t, int64_t m, const std::vector<double>& v) {
  for (size_t n = 0; n < v.size(); ++n) put2(t, m, int64_t(n), v[n]);
}
// Block reduction along N: partials[m, t] = Σ_{n in tile t} f(v[n]).
template <typename F>
void reduce_tiles(const TensorView& partials, int64_t m, const std::vector<double>& v, int64_t tile, F f) {
  const int64_t n = int64_t(v.size());
  for (int64_t t = 0; t * tile < n; ++t) {
    double s = 0;
    for (int64_t j = t * tile; j < std::min(n, (t + 1) * tile); ++j) s += f(v[size_t(j)]);
    put2(partials, m, t, s);
  }
}
// Stateful transform: online (max, Σexp) over each tile, written as max + log Σ.
void online_lse_tiles(const TensorView& partials, int64_t m, const std::vector<double>& v, int64_t tile) {
  const int64_t n = int64_t(v.size());
  for (int64_t t = 0; t * tile < n; ++t) {
    double mx = kNegInf, s = 0;
    bool nan = false;  // a NaN column makes the tile NaN (as on CUDA): std::max alone would skip it
    for (int64_t j = t * tile; j < std::min(n, (t + 1) * tile); ++j) {
      const double x = v[size_t(j)];
      nan = nan || std::isnan(x);
      const double m2 = std::max(mx, x);
      s = (mx == kNegInf ? 0.0 : s * std::exp(mx - m2)) + std::exp(x - m2);
      mx = m2;
    }
    put2(partials, m, t, nan ? std::numeric_limits<double>::quiet_NaN() : mx == kNegInf ? kNegInf : mx + std::log(s));
  }
}
// Pairwise transforms on columns (2j, 2j+1).
double silu(double x) { return x / (1.0 + std::exp(-x)); }
// inverse: rotate by −θ (the RoPE backward, Rᵀ).
void rope_pairs(std::vector<double>& z, int64_t pos, const TensorView& freq, bool inverse = false) {
  for (size_t j = 0; 2 * j + 1 < z.size(); ++j) {
    const double f = at1(freq, int64_t(2 * j)) + at1(freq, int64_t(2 * j + 1));  // turns per position (hi + lo)
    if (f == 0.0) continue;
    double turns = double(pos) * f;
    turns -= std::nearbyint(turns);  // range-reduce to [-1/2, 1/2]
    const double th = kTwoPi * turns, c = std::cos(th), s = inverse ? -std::sin(th) : std::sin(th);
    const double a = z[2 * j], b = z[2 * j + 1];
    z[2 * j] = a * c - b * s;
    z[2 * j + 1] = b * c + a * s;
  }
}

// dZ of the SwiGLU backward from dy and the saved pair (g, u): (dy·u·s·(1 + g(1 − s)), dy·g·s), y = g·s·u.
struct SwigluGrad {
  double y, dg, du;
};
SwigluGrad swiglu_grad(double dy, double g, double u) {
  const double s = 1.0 / (1.0 + std::exp(-g));
  return {g * s * u, dy * u * s * (1.0 + g * (1.0 - s)), dy * g * s};
}

// Cross-entropy gradient of one row of logits z, in place: α·(e^(z − lse) − [n == target]); 0 when
// target == ignore_index.
void ce_grad_row(std::vector<double>& z, double lse, int64_t target, int ignore_index, double alpha) {
  for (size_t n = 0; n < z.size(); ++n)
    z[n] = target == ignore_index ? 0.0 : alpha * (std::exp(z[n] - lse) - (int64_t(n) == target ? 1.0 : 0.0));
}

}  // namespace

void gemm_epilogue(const GemmEpilogueArgs& a, const GemmEpilogueOptions& o) {
  const bool w_kn = gemm_epilogue_info(o.epilogue)->operands & kOperandWeightKN;  // w [K, N]: acc = A · W
  const bool a_t = gemm_epilogue_info(o.epilogue)->operands & kOperandATransposed;  // a [K, M]
  const int64_t M = a.a.shape[a_t ? 1 : 0], K = a.a.shape[a_t ? 0 : 1], N = a.w.shape[w_kn ? 1 : 0];
  std::vector<double> w(static_cast<size_t>(N * K)), arow(static_cast<size_t>(K)), acc(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) w[size_t(n * K + k)] = w_kn ? at2(a.w, k, n) : at2(a.w, n, k);
  // Column partials (block reduction along M), fp64 [rows, cols], stored after the last row.
  const bool col_parts = gemm_epilogue_info(o.epilogue)->operands & kOperandColumnPartials;
  const int64_t pcols = col_parts ? a.partials.shape[1] : 0;
  std::vector<double> col_sums(col_parts ? size_t(a.partials.shape[0] * pcols) : 0, 0.0);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) arow[size_t(k)] = a_t ? at2(a.a, k, m) : at2(a.a, m, k);
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      const double* wr = &w[size_t(n * K)];
      for (int64_t k = 0; k < K; ++k) s += arow[size_t(k)] * wr[k];
      acc[size_t(n)] = s;
    }
    const bool has_r = a.row_scale.defined();
    switch (o.epilogue) {
      case Epilogue::kResidualSqsumAux: {
        add_tile_row(acc, a.c, m);
        store_row(a.d, m, acc);
        std::vector<double> aux(acc);
        for (int64_t n = 0; n < N; ++n) aux[size_t(n)] *= at1(a.gamma, n);
        store_row(a.aux, m, aux);
        reduce_tiles(a.partials, m, acc, o.partial_tile_n, [](double y) { return y * y; });
        break;
      }
      case Epilogue::kRowScale:
        scale_row(acc, at1(a.row_scale, m));
        store_row(a.d, m, acc);
        break;
      case Epilogue::kSwiglu: {
        if (has_r) scale_row(acc, at1(a.row_scale, m));
        store_row(a.d, m, acc);
        std::vector<double> y(static_cast<size_t>(N / 2));
        for (int64_t j = 0; j < N / 2; ++j) y[size_t(j)] = silu(acc[size_t(2 * j)]) * acc[size_t(2 * j + 1)];
        store_row(a.aux, m, y);
        break;
      }
      case Epilogue::kRope:
        if (has_r) scale_row(acc, at1(a.row_scale, m));
        rope_pairs(acc, int64_t(at1(a.pos, m)), a.freq);
        store_row(a.d, m, acc);
        break;
      case Epilogue::kRopeBwd:
        if (has_r) scale_row(acc, at1(a.row_scale, m));
        rope_pairs(acc, int64_t(at1(a.pos, m)), a.freq, /*inverse=*/true);
        store_row(a.d, m, acc);
        break;
      case Epilogue::kQkvHeadSqsum:
        store_row(a.d, m, acc);
        reduce_tiles(a.partials, m, acc, o.head_dim, [](double y) { return y * y; });
        break;
      case Epilogue::kLse: {
        if (has_r) scale_row(acc, at1(a.row_scale, m));
        if (a.d.defined()) store_row(a.d, m, acc);
        online_lse_tiles(a.partials, m, acc, o.partial_tile_n);
        if (a.target.defined()) {
          const int64_t t = int64_t(at1(a.target, m));
          put1(a.target_logit, m, (t == o.ignore_index || t < 0 || t >= N) ? 0.0 : acc[size_t(t)]);
        }
        break;
      }
      case Epilogue::kScalarScale:
        scale_row(acc, at1(a.alpha, 0));
        store_row(a.d, m, acc);
        break;
      case Epilogue::kResidualAdd:
        add_tile_row(acc, a.c, m);
        store_row(a.d, m, acc);
        break;
      case Epilogue::kCeBwd: {  // row vector loads (r, lse, target), elementwise softmax − one-hot, scalar α
        if (has_r) scale_row(acc, at1(a.row_scale, m));
        const std::vector<double> z = acc;
        ce_grad_row(acc, at1(a.lse, m), int64_t(at1(a.target, m)), o.ignore_index, a.alpha.defined() ? at1(a.alpha, 0) : 1.0);
        store_row(a.d, m, acc);
        if (a.partials.defined()) {  // block reduction along N of z·D (the zdz of the final norm)
          for (size_t n = 0; n < z.size(); ++n) acc[n] *= z[n];
          reduce_tiles(a.partials, m, acc, o.partial_tile_n, [](double v) { return v; });
        }
        break;
      }
      case Epilogue::kDgrad:
        store_row(a.d, m, acc);
        break;
      case Epilogue::kWgrad:
        if (a.alpha.defined()) scale_row(acc, at1(a.alpha, 0));
        store_row(a.d, m, acc);
        break;
      case Epilogue::kSwigluBwd: {  // acc = dy; pairwise over the saved (g, u); block reduction along N
        std::vector<double> y(acc.size()), dz(2 * acc.size()), zdz(acc.size());
        for (int64_t n = 0; n < N; ++n) {
          const double g = at2(a.c, m, 2 * n), u = at2(a.c, m, 2 * n + 1);
          const SwigluGrad s = swiglu_grad(acc[size_t(n)], g, u);
          y[size_t(n)] = s.y;
          dz[size_t(2 * n)] = s.dg;
          dz[size_t(2 * n + 1)] = s.du;
          zdz[size_t(n)] = g * s.dg + u * s.du;
        }
        store_row(a.d, m, y);
        store_row(a.aux, m, dz);
        reduce_tiles(a.partials, m, zdz, o.partial_tile_n, [](double v) { return v; });
        break;
      }
      case Epilogue::kRmsnormBwd: {  // da = α·acc; two tile inputs, row and column vectors; block reduction along M
        if (a.alpha.defined()) scale_row(acc, at1(a.alpha, 0));
        const double r = at1(a.row_scale, m), zdz = at1(a.zdz, m);
        std::vector<double> dx(acc.size()), aux(acc.size());
        for (int64_t n = 0; n < N; ++n) {
          const double xh = r * at2(a.c, m, n), g = at1(a.gamma, n), da = acc[size_t(n)];
          dx[size_t(n)] = (a.c2.defined() ? at2(a.c2, m, n) : 0.0) + r * (g * da - xh * zdz);
          aux[size_t(n)] = xh * g;
          col_sums[size_t((m / kColumnPartialsTileM) * pcols + n)] += da * xh;
        }
        store_row(a.d, m, dx);
        store_row(a.aux, m, aux);
        break;
      }
    }
  }
  for (int64_t t = 0; col_parts && t < a.partials.shape[0]; ++t)
    for (int64_t n = 0; n < pcols; ++n) put2(a.partials, t, n, col_sums[size_t(t * pcols + n)]);
}

void rms_final_reduce(const RmsFinalReduceArgs& a, int64_t hidden, float eps) {
  for (int64_t m = 0; m < a.partials.shape[0]; ++m) {
    double s = 0;
    for (int64_t t = 0; t < a.partials.shape[1]; ++t) s += at2(a.partials, m, t);
    put1(a.r, m, 1.0 / std::sqrt(s / double(hidden) + double(eps)));
  }
}

void lse_finish(const LseFinishArgs& a, int ignore_index) {
  for (int64_t m = 0; m < a.partials.shape[0]; ++m) {
    double mx = kNegInf;
    bool nan = false;  // a NaN tile makes the row NaN (std::max alone would skip it)
    for (int64_t t = 0; t < a.partials.shape[1]; ++t) {
      mx = std::max(mx, at2(a.partials, m, t));
      nan = nan || std::isnan(at2(a.partials, m, t));
    }
    double s = 0;
    if (mx != kNegInf)
      for (int64_t t = 0; t < a.partials.shape[1]; ++t) s += std::exp(at2(a.partials, m, t) - mx);
    const double lse = nan ? std::numeric_limits<double>::quiet_NaN() : mx == kNegInf ? kNegInf : mx + std::log(s);
    put1(a.lse, m, lse);
    if (a.target.defined()) {
      const int64_t t = int64_t(at1(a.target, m));
      put1(a.loss, m, t == ignore_index ? 0.0 : lse - at1(a.target_logit, m));
    }
  }
}

void partials_sum(const PartialsSumArgs& a, PartialsSum axis, float scale) {
  const int64_t rows = a.partials.shape[0], cols = a.partials.shape[1];
  if (axis == PartialsSum::kPerRow) {
    for (int64_t m = 0; m < rows; ++m) {
      double s = 0;
      for (int64_t t = 0; t < cols; ++t) s += at2(a.partials, m, t);
      put1(a.out, m, double(scale) * s);
    }
  } else {
    for (int64_t n = 0; n < a.out.shape[0]; ++n) {
      double s = 0;
      for (int64_t t = 0; t < rows; ++t) s += at2(a.partials, t, n);
      put1(a.out, n, double(scale) * s);
    }
  }
}

void qk_norm_rope(const QkNormRopeArgs& a, const QkNormRopeOptions& o) {
  const int64_t M = a.qkv.shape[0], N = a.qkv.shape[1], D = o.head_dim, qk_heads = o.num_q_heads + o.num_kv_heads;
  std::vector<double> row(static_cast<size_t>(N));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) row[size_t(n)] = at2(a.qkv, m, n);
    for (int64_t h = 0; h < qk_heads; ++h) {  // row-vector load (per-head statistic) + elementwise
      const double r = 1.0 / std::sqrt(at2(a.partials, m, h) / double(D) + double(o.eps));
      const TensorView& w = h < o.num_q_heads ? a.q_weight : a.k_weight;
      for (int64_t e = 0; e < D; ++e) row[size_t(h * D + e)] *= r * at1(w, e);
    }
    rope_pairs(row, int64_t(at1(a.pos, m)), a.freq);  // pairwise (V heads have frequency 0)
    for (int64_t n = 0; n < qk_heads * D; ++n) put2(a.qkv, m, n, row[size_t(n)]);
  }
}

void rope_bwd_zdz(const RopeBwdZdzArgs& a, float scale) {
  const int64_t M = a.y.shape[0], N = a.y.shape[1];
  std::vector<double> dy(static_cast<size_t>(N));
  for (int64_t m = 0; m < M; ++m) {
    double zdz = 0;
    for (int64_t n = 0; n < N; ++n) {
      dy[size_t(n)] = at2(a.dy, m, n);
      zdz += at2(a.y, m, n) * dy[size_t(n)];  // Σ y·dy over the post-RoPE y (R orthogonal)
    }
    rope_pairs(dy, int64_t(at1(a.pos, m)), a.freq, /*inverse=*/true);  // pairwise: Rᵀ
    store_row(a.dz, m, dy);
    put1(a.zdz, m, double(scale) * zdz);
  }
}

void cross_entropy_bwd(const CrossEntropyBwdArgs& a, int ignore_index) {
  const int64_t M = a.logits.shape[0], N = a.logits.shape[1];
  const double alpha = a.alpha.defined() ? at1(a.alpha, 0) : 1.0;
  std::vector<double> row(static_cast<size_t>(N));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) row[size_t(n)] = at2(a.logits, m, n);  // read the whole row first: dlogits may be logits
    ce_grad_row(row, at1(a.lse, m), int64_t(at1(a.target, m)), ignore_index, alpha);
    store_row(a.dlogits, m, row);
  }
}

void ce_mean(const CeMeanArgs& a, int ignore_index) {
  int64_t n = 0;
  double total = 0;
  for (int64_t m = 0; m < a.target.shape[0]; ++m) {
    if (int64_t(at1(a.target, m)) == ignore_index) continue;
    ++n;
    if (a.loss_rows.defined()) total += at1(a.loss_rows, m);
  }
  if (a.loss.defined()) put1(a.loss, 0, n > 0 ? total / double(n) : 0.0);
  if (a.alpha.defined()) put1(a.alpha, 0, n > 0 ? at1(a.d_loss, 0) / double(n) : 0.0);
}

void qk_norm_rope_bwd(const QkNormRopeBwdArgs& a, const QkNormRopeOptions& o) {
  const int64_t M = a.dy.shape[0], N = a.dy.shape[1], D = o.head_dim, qk_heads = o.num_q_heads + o.num_kv_heads;
  std::vector<double> dn(static_cast<size_t>(N)), dx(static_cast<size_t>(N)), dw(size_t(2 * D), 0.0);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) dn[size_t(n)] = at2(a.dy, m, n);
    for (int64_t n = qk_heads * D; n < N; ++n) dx[size_t(n)] = dn[size_t(n)];  // V heads: untouched by the forward
    rope_pairs(dn, int64_t(at1(a.pos, m)), a.freq, /*inverse=*/true);        // pairwise: Rᵀ (the Q / K columns are read)
    for (int64_t h = 0; h < qk_heads; ++h) {  // per-head statistic, then the norm's backward
      const double r = 1.0 / std::sqrt(at2(a.partials, m, h) / double(D) + double(o.eps));
      const bool q = h < o.num_q_heads;
      const TensorView& w = q ? a.q_weight : a.k_weight;
      double dot = 0;
      for (int64_t e = 0; e < D; ++e) dot += at1(w, e) * dn[size_t(h * D + e)] * at2(a.x, m, h * D + e);
      for (int64_t e = 0; e < D; ++e) {
        const double x = at2(a.x, m, h * D + e), g = dn[size_t(h * D + e)];
        dx[size_t(h * D + e)] = r * at1(w, e) * g - r * r * r * x * dot / double(D);
        dw[size_t((q ? 0 : D) + e)] += g * r * x;
      }
    }
    store_row(a.dx, m, dx);
  }
  for (int64_t e = 0; e < D; ++e) {
    put1(a.dq_weight, e, dw[size_t(e)]);
    put1(a.dk_weight, e, dw[size_t(D + e)]);
  }
}

}  // namespace encore::reference
