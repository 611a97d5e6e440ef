// fp64 reference of the shifted LLaMA block's backward as docs/math/gemm_epilogues.md §5 schedules it
// (the math and the shapes: llama_block_bwd.hpp): rope_bwd_zdz, gemm_rmsnorm_bwd, gemm_swiglu_bwd_zdz,
// the plain dgrad/wgrad GEMMs, the cross-entropy backward and the first/last-layer variants.
#include "blocks/reference/llama_block_bwd.hpp"

#include <algorithm>
#include <cmath>

namespace encore::reference {
namespace {

size_t at(int64_t i, int64_t j, int64_t cols) { return size_t(i * cols + j); }
double load(const TensorView& t, int64_t i, int64_t j) { return load_as_double(t.data, t.dtype, i * t.strides[0] + j * t.strides[1]); }

Mat load_matrix(const TensorView& t) {
  Mat out(size_t(t.shape[0] * t.shape[1]));
  for (int64_t i = 0; i < t.shape[0]; ++i)
    for (int64_t j = 0; j < t.shape[1]; ++j) out[at(i, j, t.shape[1])] = load(t, i, j);
  return out;
}
Mat load_vector(const TensorView& t) {
  Mat out(size_t(t.shape[0]));
  for (int64_t i = 0; i < t.shape[0]; ++i) out[size_t(i)] = load_as_double(t.data, t.dtype, i * t.strides[0]);
  return out;
}

}  // namespace

Mat matmul_nt(const Mat& a, int64_t M, int64_t K, const Mat& w, int64_t N) {
  Mat out(size_t(M * N), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += a[at(m, k, K)] * w[at(n, k, K)];
      out[at(m, n, N)] = s;
    }
  return out;
}

Mat matmul_nn(const Mat& a, int64_t M, int64_t N, const Mat& w, int64_t K) {
  Mat out(size_t(M * K), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const double v = a[at(m, n, N)];
      for (int64_t k = 0; k < K; ++k) out[at(m, k, K)] += v * w[at(n, k, K)];
    }
  return out;
}

Mat matmul_tn(const Mat& a, int64_t M, int64_t N, const Mat& b, int64_t K) {
  Mat out(size_t(N * K), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const double v = a[at(m, n, N)];
      for (int64_t k = 0; k < K; ++k) out[at(n, k, K)] += v * b[at(m, k, K)];
    }
  return out;
}

void rope_cos_sin(int64_t pos, const Mat& freq, int64_t j, double* c, double* s) {
  const double f = freq[size_t(2 * j)] + freq[size_t(2 * j + 1)];  // turns per position (hi + lo)
  if (f == 0.0) {
    *c = 1.0;
    *s = 0.0;
    return;
  }
  double turns = double(pos) * f;
  turns -= std::nearbyint(turns);  // the forward's range reduction
  const double th = 6.283185307179586 * turns;
  *c = std::cos(th);
  *s = std::sin(th);
}

LlamaBlockBwdInputs load_block_bwd_inputs(const LlamaBlockArgs& a) {
  LlamaBlockBwdInputs in;
  in.dims = {a.y0.shape[0], a.y0.shape[1], a.w2.shape[1], a.w3.shape[0]};
  in.y0 = load_matrix(a.y0);
  in.x0 = load_matrix(a.x0);
  in.w0 = load_matrix(a.w0);
  in.w1 = load_matrix(a.w1);
  in.w2 = load_matrix(a.w2);
  in.w3 = load_matrix(a.w3);
  in.gamma0 = load_vector(a.gamma0);
  in.gamma1 = load_vector(a.gamma1);
  in.freq = load_vector(a.freq);
  for (double p : load_vector(a.pos)) in.pos.push_back(int64_t(p));
  in.x1 = load_matrix(a.x1);
  in.x2 = load_matrix(a.x2);
  in.z1 = load_matrix(a.z1);
  in.qkv = load_matrix(a.qkv);
  in.r1 = load_vector(a.r1);
  in.r2 = load_vector(a.r2);
  return in;
}

RopeBwd rope_bwd_zdz(const Mat& y, const Mat& dy, int64_t M, int64_t N, const std::vector<int64_t>& pos, const Mat& freq, double scale) {
  RopeBwd o{Mat(size_t(M * N)), Mat(size_t(M), 0.0)};
  for (int64_t m = 0; m < M; ++m) {
    double zdz = 0;
    for (int64_t j = 0; 2 * j + 1 < N; ++j) {
      double c, s;
      rope_cos_sin(pos[size_t(m)], freq, j, &c, &s);
      const double da = dy[at(m, 2 * j, N)], db = dy[at(m, 2 * j + 1, N)];
      o.dz[at(m, 2 * j, N)] = c * da + s * db;  // Rᵀ of (a, b) -> (a c − b s, b c + a s)
      o.dz[at(m, 2 * j + 1, N)] = c * db - s * da;
      zdz += y[at(m, 2 * j, N)] * da + y[at(m, 2 * j + 1, N)] * db;
    }
    o.zdz[size_t(m)] = scale * zdz;
  }
  return o;
}

RmsNormDgrad rmsnorm_dgrad(const Mat& dz, int64_t M, int64_t N, const Mat& w, int64_t d, double alpha, const Mat& x, const Mat& r,
                           const Mat& gamma, const Mat& zdz, const Mat& dx_prev, int64_t tile_m) {
  RmsNormDgrad o;
  o.da = matmul_nn(dz, M, N, w, d);
  const int64_t tiles = (M + tile_m - 1) / tile_m;
  o.dx.assign(size_t(M * d), 0.0);
  o.aux.assign(size_t(M * d), 0.0);
  o.dgamma_partials.assign(size_t(tiles * d), 0.0);
  o.dgamma.assign(size_t(d), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < d; ++n) {
      double& da = o.da[at(m, n, d)];
      da *= alpha;
      const double xh = r[size_t(m)] * x[at(m, n, d)];
      o.dx[at(m, n, d)] = (dx_prev.empty() ? 0.0 : dx_prev[at(m, n, d)]) + r[size_t(m)] * (gamma[size_t(n)] * da - xh * zdz[size_t(m)]);
      o.aux[at(m, n, d)] = xh * gamma[size_t(n)];
      o.dgamma_partials[at(m / tile_m, n, d)] += da * xh;
    }
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t n = 0; n < d; ++n) o.dgamma[size_t(n)] += o.dgamma_partials[at(t, n, d)];
  return o;
}

SwigluDgrad swiglu_dgrad(const Mat& dx, int64_t M, int64_t d, const Mat& w2, int64_t F, const Mat& z, double scale, int64_t tile_n) {
  SwigluDgrad o;
  // w2 is [d, F]: dy = dx·w2 is the dgrad GEMM over N = d, K = F.
  o.dy = matmul_nn(dx, M, d, w2, F);
  const int64_t tiles = (F + tile_n - 1) / tile_n;
  o.dz.assign(size_t(M * 2 * F), 0.0);
  o.y.assign(size_t(M * F), 0.0);
  o.zdz_partials.assign(size_t(M * tiles), 0.0);
  o.zdz.assign(size_t(M), 0.0);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < F; ++j) {
      const double g = z[at(m, 2 * j, 2 * F)], u = z[at(m, 2 * j + 1, 2 * F)], dy = o.dy[at(m, j, F)];
      const double s = 1.0 / (1.0 + std::exp(-g));
      const double dg = dy * u * s * (1.0 + g * (1.0 - s)), du = dy * g * s;
      o.y[at(m, j, F)] = g * s * u;
      o.dz[at(m, 2 * j, 2 * F)] = dg;
      o.dz[at(m, 2 * j + 1, 2 * F)] = du;
      o.zdz_partials[at(m, j / tile_n, tiles)] += scale * (g * dg + u * du);
    }
    for (int64_t t = 0; t < tiles; ++t) o.zdz[size_t(m)] += o.zdz_partials[at(m, t, tiles)];
  }
  return o;
}

QkvNormBwd qkv_norm_backward(const Mat& x, const Mat& r, const Mat& gamma, const Mat& w3, const Mat& qkv, const Mat& d_qkv,
                             const std::vector<int64_t>& pos, const Mat& freq, const Mat& dx_prev, int64_t M, int64_t d, int64_t N,
                             int64_t tile_m) {
  QkvNormBwd o;
  o.rope = rope_bwd_zdz(qkv, d_qkv, M, N, pos, freq, 1.0 / double(d));
  o.norm = rmsnorm_dgrad(o.rope.dz, M, N, w3, d, 1.0, x, r, gamma, o.rope.zdz, dx_prev, tile_m);
  o.dw3 = matmul_tn(o.rope.dz, M, N, o.norm.aux, d);
  return o;
}

FfnOprojBwd ffn_oproj_backward(const LlamaBlockBwdInputs& in, const Mat& dx2, const LlamaBlockBwdOptions& opt) {
  const auto [M, d, F, N] = in.dims;
  (void)N;
  FfnOprojBwd o;
  // (b) down-proj dgrad + SwiGLU backward; wgrad on the recomputed y1
  o.swiglu = swiglu_dgrad(dx2, M, d, in.w2, F, in.z1, 1.0 / double(d), opt.zdz_tile_n);
  o.dw2 = matmul_tn(dx2, M, d, o.swiglu.y, F);
  // (c) gate/up dgrad + the first norm's backward, accumulating the residual gradient dx2
  o.norm1 = rmsnorm_dgrad(o.swiglu.dz, M, 2 * F, in.w1, d, 1.0, in.x1, in.r1, in.gamma0, o.swiglu.zdz, dx2, opt.dgamma_tile_m);
  o.dw1 = matmul_tn(o.swiglu.dz, M, 2 * F, o.norm1.aux, d);
  // (d) o-proj dgrad and wgrad; x0 reaches x1 through the residual add
  o.d_y0 = matmul_nn(o.norm1.dx, M, d, in.w0, d);
  o.dw0 = matmul_tn(o.norm1.dx, M, d, in.y0, d);
  o.d_x0 = o.norm1.dx;
  return o;
}

LlamaBlockBwd llama_block_backward(const LlamaBlockBwdInputs& in, const Mat& d_qkv, const Mat& d_x2, const LlamaBlockBwdOptions& opt) {
  const auto [M, d, F, N] = in.dims;
  (void)F;
  LlamaBlockBwd o;
  o.qkv = qkv_norm_backward(in.x2, in.r2, in.gamma1, in.w3, in.qkv, d_qkv, in.pos, in.freq, d_x2, M, d, N, opt.dgamma_tile_m);
  o.ffn = ffn_oproj_backward(in, o.qkv.norm.dx, opt);
  return o;
}

CrossEntropyBwd cross_entropy_backward(const Mat& logits, const Mat& lse, int64_t M, int64_t V, const std::vector<int64_t>& target,
                                       int64_t ignore_index) {
  CrossEntropyBwd o;
  o.loss_rows.assign(size_t(M), 0.0);
  o.dlogits.assign(size_t(M * V), 0.0);
  o.zdz_rows.assign(size_t(M), 0.0);
  double total = 0;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t y = target[size_t(m)];
    if (y == ignore_index) continue;
    ++o.count;
    o.loss_rows[size_t(m)] = lse[size_t(m)] - logits[at(m, y, V)];
    total += o.loss_rows[size_t(m)];
    for (int64_t n = 0; n < V; ++n) {
      const double l = logits[at(m, n, V)], dl = std::exp(l - lse[size_t(m)]) - (n == y ? 1.0 : 0.0);
      o.dlogits[at(m, n, V)] = dl;
      o.zdz_rows[size_t(m)] += l * dl;
    }
  }
  if (o.count > 0) {
    o.dloss = 1.0 / double(o.count);
    o.loss = total * o.dloss;
  }
  return o;
}

LlamaLastLayerBwd llama_last_layer_backward(const LlamaBlockBwdInputs& in, const LlamaHeadInputs& h, const LlamaBlockBwdOptions& opt) {
  const int64_t M = in.dims.M, d = in.dims.d;
  LlamaLastLayerBwd o;
  o.ce = cross_entropy_backward(h.logits, h.lse, M, h.V, h.target, h.ignore_index);
  Mat zdz(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) zdz[size_t(m)] = o.ce.dloss * o.ce.zdz_rows[size_t(m)] / double(d);
  o.norm = rmsnorm_dgrad(o.ce.dlogits, M, h.V, h.w_lm, d, o.ce.dloss, in.x2, in.r2, h.gamma_final, zdz, Mat{}, opt.dgamma_tile_m);
  o.dw_lm = matmul_tn(o.ce.dlogits, M, h.V, o.norm.aux, d);  // gemm_scalar_scale: α = dloss
  for (double& v : o.dw_lm) v *= o.ce.dloss;
  o.ffn = ffn_oproj_backward(in, o.norm.dx, opt);
  return o;
}

}  // namespace encore::reference
