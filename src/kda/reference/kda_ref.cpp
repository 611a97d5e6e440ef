#include "kda/reference/kda_ref.hpp"

#include <algorithm>
#include <cmath>

namespace encore::reference {
namespace {

constexpr double kL2Eps = 1e-6;
constexpr double kRcpLn2 = 1.4426950408889634;

// Reads t[b, t, h, c] (4-D) / t[b, t, h] (3-D) / t[i] (1-D) as double, honouring strides.
double at4(const TensorView& v, int64_t b, int64_t t, int64_t h, int64_t c) {
  return load_as_double(v.data, v.dtype, b * v.strides[0] + t * v.strides[1] + h * v.strides[2] + c * v.strides[3]);
}
double at3(const TensorView& v, int64_t b, int64_t t, int64_t h) {
  return load_as_double(v.data, v.dtype, b * v.strides[0] + t * v.strides[1] + h * v.strides[2]);
}
double at1(const TensorView& v, int64_t i) { return load_as_double(v.data, v.dtype, i * v.strides[0]); }

double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
double softplus_grad(double x) { return x > 20.0 ? 1.0 : 1.0 / (1.0 + std::exp(-x)); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

struct Idx {
  int64_t T, H;
  int64_t operator()(int64_t b, int64_t t, int64_t h, int64_t c, int64_t C) const { return ((b * T + t) * H + h) * C + c; }
  int64_t bth(int64_t b, int64_t t, int64_t h) const { return (b * T + t) * H + h; }
};

int64_t state_at(const kda::KdaProblem& p, int64_t n, int64_t h, int64_t k, int64_t v) {
  return ((n * p.H + h) * p.K + k) * p.V + v;
}

}  // namespace

// The L2-norm backward per value-head row (kda_l2norm_backward's first step).
void l2norm_rows(const kda::KdaProblem& p, const KdaInputs& in, const std::vector<double>& dqn, const std::vector<double>& dkn,
                 std::vector<double>& out_q, std::vector<double>& out_k);

KdaInputs kda_prepare(const kda::KdaProblem& p, const KdaForwardArgs& a) {
  KdaInputs in;
  const Idx I{p.T, p.H};
  const size_t nk = size_t(p.B * p.T * p.H * p.K), nv = size_t(p.B * p.T * p.H * p.V), nt = size_t(p.B * p.T * p.H);
  in.q.resize(nk);
  in.k.resize(nk);
  in.g.resize(nk);
  in.v.resize(nv);
  in.beta.resize(nt);
  in.rstd_q.assign(nt, 1.0);
  in.rstd_k.assign(nt, 1.0);
  const int64_t group = p.group();  // value head h reads q/k head h / group (expanded copies here)
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t t = 0; t < p.T; ++t)
      for (int64_t h = 0; h < p.H; ++h) {
        double sq = 0, sk = 0;
        for (int64_t c = 0; c < p.K; ++c) {
          const double qv = at4(a.q, b, t, h / group, c), kv = at4(a.k, b, t, h / group, c);
          in.q[I(b, t, h, c, p.K)] = qv;
          in.k[I(b, t, h, c, p.K)] = kv;
          sq += qv * qv;
          sk += kv * kv;
          double x = at4(a.g, b, t, h, c);
          if (p.opts.use_gate_in_kernel) {
            if (a.dt_bias.defined()) x += at1(a.dt_bias, h * p.K + c);
            const double ea = a.A_log.defined() ? std::exp(at1(a.A_log, h)) : 1.0;
            x = p.opts.use_lower_bound ? p.opts.lower_bound * sigmoid(ea * x) : -ea * softplus(x);
          }
          in.g[I(b, t, h, c, p.K)] = x;
        }
        for (int64_t c = 0; c < p.V; ++c) in.v[I(b, t, h, c, p.V)] = at4(a.v, b, t, h, c);
        in.beta[I.bth(b, t, h)] = at3(a.beta, b, t, h);
        if (p.opts.use_qk_l2norm) {
          const double rq = 1.0 / std::sqrt(sq + kL2Eps), rk = 1.0 / std::sqrt(sk + kL2Eps);
          in.rstd_q[I.bth(b, t, h)] = rq;
          in.rstd_k[I.bth(b, t, h)] = rk;
          for (int64_t c = 0; c < p.K; ++c) {
            in.q[I(b, t, h, c, p.K)] *= rq;
            in.k[I(b, t, h, c, p.K)] *= rk;
          }
        }
      }
  const int64_t N = int64_t(p.seqs.size());
  in.h0.assign(size_t(N * p.H * p.K * p.V), 0.0);
  if (a.initial_state.defined()) {
    const TensorView& s = a.initial_state;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < p.H; ++h)
        for (int64_t k = 0; k < p.K; ++k)
          for (int64_t v = 0; v < p.V; ++v)
            in.h0[size_t(state_at(p, n, h, k, v))] =
                load_as_double(s.data, s.dtype, n * s.strides[0] + h * s.strides[1] + k * s.strides[2] + v * s.strides[3]);
  }
  return in;
}

void kda_recurrent_sequence(const kda::KdaProblem& p, const KdaInputs& in, size_t n, int64_t h, std::vector<double>& S,
                            std::vector<double>& o, const std::function<void(int64_t, const std::vector<double>&)>& on_token) {
  const Idx I{p.T, p.H};
  const int64_t K = p.K, V = p.V;
  const kda::Sequence& sq = p.seqs[n];
  std::vector<double> e(static_cast<size_t>(V));
  for (int64_t t = sq.begin; t < sq.end; ++t) {
    const double* q = &in.q[size_t(I(sq.batch, t, h, 0, K))];
    const double* k = &in.k[size_t(I(sq.batch, t, h, 0, K))];
    const double* g = &in.g[size_t(I(sq.batch, t, h, 0, K))];
    const double* v = &in.v[size_t(I(sq.batch, t, h, 0, V))];
    const double beta = in.beta[size_t(I.bth(sq.batch, t, h))];
    for (int64_t a = 0; a < K; ++a)
      for (int64_t c = 0; c < V; ++c) S[size_t(a * V + c)] *= std::exp(g[a]);
    for (int64_t c = 0; c < V; ++c) {
      double s = 0;
      for (int64_t a = 0; a < K; ++a) s += S[size_t(a * V + c)] * k[a];
      e[size_t(c)] = v[c] - s;
    }
    for (int64_t a = 0; a < K; ++a)
      for (int64_t c = 0; c < V; ++c) S[size_t(a * V + c)] += beta * k[a] * e[size_t(c)];
    double* out = &o[size_t(I(sq.batch, t, h, 0, V))];
    for (int64_t c = 0; c < V; ++c) {
      double s = 0;
      for (int64_t a = 0; a < K; ++a) s += S[size_t(a * V + c)] * q[a];
      out[c] = p.scale * s;
    }
    if (on_token) on_token(t - sq.begin, S);
  }
}

void kda_recurrent_forward(const kda::KdaProblem& p, const KdaInputs& in, std::vector<double>& o, std::vector<double>& final_state) {
  const int64_t KV = p.K * p.V;
  o.assign(size_t(p.B * p.T * p.H * p.V), 0.0);
  final_state.assign(in.h0.size(), 0.0);
  std::vector<double> S(static_cast<size_t>(KV));
  for (size_t n = 0; n < p.seqs.size(); ++n)
    for (int64_t h = 0; h < p.H; ++h) {
      const int64_t base = state_at(p, int64_t(n), h, 0, 0);
      std::copy(in.h0.begin() + base, in.h0.begin() + base + KV, S.begin());
      kda_recurrent_sequence(p, in, n, h, S, o);
      std::copy(S.begin(), S.end(), final_state.begin() + base);
    }
}

void kda_chunked_forward(const kda::KdaProblem& p, const KdaInputs& in, std::vector<double>& o, std::vector<double>& final_state,
                         KdaChunkTrace* trace) {
  constexpr int C = kda::kChunk;
  const Idx I{p.T, p.H};
  const int64_t K = p.K, V = p.V;
  o.assign(size_t(p.B * p.T * p.H * V), 0.0);
  final_state.assign(in.h0.size(), 0.0);
  int64_t chunks = 0;
  for (const auto& s : p.seqs) chunks += (s.end - s.begin + C - 1) / C;
  KdaChunkTrace local;
  KdaChunkTrace& tr = trace ? *trace : local;
  const size_t ntok = size_t(p.B * p.T * p.H);
  tr.G.assign(ntok * size_t(K), 0.0);
  tr.Aqk.assign(ntok * C, 0.0);
  tr.A.assign(ntok * C, 0.0);
  tr.W.assign(ntok * size_t(K), 0.0);
  tr.U.assign(ntok * size_t(V), 0.0);
  tr.Vnew.assign(ntok * size_t(V), 0.0);
  tr.h.assign(size_t(chunks * p.H * K * V), 0.0);
  tr.num_chunks = chunks;

  std::vector<double> S(static_cast<size_t>(K * V)), L(C * C), Ainv(C * C), E2(static_cast<size_t>(C * K));
  int64_t chunk_base = 0;
  for (size_t n = 0; n < p.seqs.size(); ++n) {
    const kda::Sequence& sq = p.seqs[n];
    const int64_t seq_chunks = (sq.end - sq.begin + C - 1) / C;
    for (int64_t h = 0; h < p.H; ++h) {
      for (int64_t i = 0; i < K * V; ++i) S[size_t(i)] = in.h0[size_t(state_at(p, int64_t(n), h, 0, 0) + i)];
      for (int64_t c = 0; c < seq_chunks; ++c) {
        const int64_t t0 = sq.begin + c * C, rows = std::min<int64_t>(C, sq.end - t0);
        auto tok = [&](int64_t i) { return I.bth(sq.batch, t0 + i, h); };
        auto G = [&](int64_t i, int64_t a) -> double& { return tr.G[size_t(tok(i) * K + a)]; };
        auto q = [&](int64_t i, int64_t a) { return in.q[size_t(tok(i) * K + a)] * p.scale; };  // Q~ = s Q
        auto k = [&](int64_t i, int64_t a) { return in.k[size_t(tok(i) * K + a)]; };
        auto v = [&](int64_t i, int64_t a) { return in.v[size_t(tok(i) * V + a)]; };
        auto beta = [&](int64_t i) { return in.beta[size_t(tok(i))]; };
        for (int64_t a = 0; a < K; ++a) {
          double acc = 0;
          for (int64_t i = 0; i < rows; ++i) {
            acc += in.g[size_t(tok(i) * K + a)];
            G(i, a) = acc * kRcpLn2;
          }
        }
        // h: the chunk-start state.
        std::copy(S.begin(), S.end(), tr.h.begin() + (chunk_base + c) * p.H * K * V + h * K * V);
        // Aqk (i >= j) and L (i > j).
        std::fill(L.begin(), L.end(), 0.0);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j <= i; ++j) {
            double aqk = 0, l = 0;
            for (int64_t a = 0; a < K; ++a) {
              const double d = std::exp2(G(i, a) - G(j, a));
              aqk += q(i, a) * k(j, a) * d;
              l += k(i, a) * k(j, a) * d;
            }
            tr.Aqk[size_t(tok(i) * C + j)] = aqk;
            if (j < i) L[size_t(i * C + j)] = beta(i) * l;
          }
        // A = (I + L)^-1, unit lower triangular.
        kda_unit_lower_inverse(L, rows, C, Ainv);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j <= i; ++j) tr.A[size_t(tok(i) * C + j)] = Ainv[size_t(i * C + j)];
        // W = A Kbeta, U = A Vbeta, Vnew = U - W S.
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t a = 0; a < K; ++a) {
            double w = 0;
            for (int64_t j = 0; j <= i; ++j) w += Ainv[size_t(i * C + j)] * beta(j) * k(j, a) * std::exp2(G(j, a));
            tr.W[size_t(tok(i) * K + a)] = w;
          }
          for (int64_t b2 = 0; b2 < V; ++b2) {
            double u = 0;
            for (int64_t j = 0; j <= i; ++j) u += Ainv[size_t(i * C + j)] * beta(j) * v(j, b2);
            double ws = 0;
            for (int64_t a = 0; a < K; ++a) ws += tr.W[size_t(tok(i) * K + a)] * S[size_t(a * V + b2)];
            tr.U[size_t(tok(i) * V + b2)] = u;
            tr.Vnew[size_t(tok(i) * V + b2)] = u - ws;
          }
        }
        // O = (Q~ . 2^G) S + Aqk Vnew.
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t b2 = 0; b2 < V; ++b2) {
            double acc = 0;
            for (int64_t a = 0; a < K; ++a) acc += q(i, a) * std::exp2(G(i, a)) * S[size_t(a * V + b2)];
            for (int64_t j = 0; j <= i; ++j) acc += tr.Aqk[size_t(tok(i) * C + j)] * tr.Vnew[size_t(tok(j) * V + b2)];
            o[size_t(tok(i) * V + b2)] = acc;
          }
        // S' = Diag(2^gC) S + Kg^T Vnew, Kg = K . 2^(gC - G).
        for (int64_t a = 0; a < K; ++a) {
          const double gc = G(rows - 1, a);
          for (int64_t b2 = 0; b2 < V; ++b2) {
            double acc = std::exp2(gc) * S[size_t(a * V + b2)];
            for (int64_t j = 0; j < rows; ++j) acc += k(j, a) * std::exp2(gc - G(j, a)) * tr.Vnew[size_t(tok(j) * V + b2)];
            S[size_t(a * V + b2)] = acc;
          }
        }
      }
      for (int64_t i = 0; i < K * V; ++i) final_state[size_t(state_at(p, int64_t(n), h, 0, 0) + i)] = S[size_t(i)];
    }
    chunk_base += seq_chunks;
  }
}

KdaGrads kda_backward(const kda::KdaProblem& p, const KdaForwardArgs& a, const KdaInputs& in, const std::vector<double>& d_o,
                      const std::vector<double>& d_final) {
  const Idx I{p.T, p.H};
  const int64_t K = p.K, V = p.V;
  KdaGrads gr;
  const size_t nk = size_t(p.B * p.T * p.H * K), nt = size_t(p.B * p.T * p.H);
  std::vector<double> dqn(nk, 0.0), dkn(nk, 0.0), dgact(nk, 0.0);  // w.r.t. normalized q, k and activated g
  gr.dv.assign(size_t(p.B * p.T * p.H * V), 0.0);
  gr.dbeta.assign(nt, 0.0);
  gr.dh0.assign(in.h0.size(), 0.0);

  std::vector<double> dS(static_cast<size_t>(K * V)), dSt(static_cast<size_t>(K * V)), Sbar(static_cast<size_t>(K * V)), e(static_cast<size_t>(V)), de(static_cast<size_t>(V));
  for (size_t n = 0; n < p.seqs.size(); ++n) {
    const kda::Sequence& sq = p.seqs[n];
    const int64_t len = sq.end - sq.begin;
    for (int64_t h = 0; h < p.H; ++h) {
      // Forward again, keeping every state S_begin-1 .. S_end-1.
      std::vector<double> states(static_cast<size_t>((len + 1) * K * V));
      for (int64_t i = 0; i < K * V; ++i) states[size_t(i)] = in.h0[size_t(state_at(p, int64_t(n), h, 0, 0) + i)];
      for (int64_t t = 0; t < len; ++t) {
        const int64_t tt = sq.begin + t;
        const double* k = &in.k[size_t(I(sq.batch, tt, h, 0, K))];
        const double* g = &in.g[size_t(I(sq.batch, tt, h, 0, K))];
        const double* v = &in.v[size_t(I(sq.batch, tt, h, 0, V))];
        const double beta = in.beta[size_t(I.bth(sq.batch, tt, h))];
        const double* Sp = &states[size_t(t * K * V)];
        double* Sn = &states[size_t((t + 1) * K * V)];
        for (int64_t x = 0; x < K; ++x)
          for (int64_t y = 0; y < V; ++y) Sn[x * V + y] = std::exp(g[x]) * Sp[x * V + y];
        for (int64_t y = 0; y < V; ++y) {
          double s = 0;
          for (int64_t x = 0; x < K; ++x) s += Sn[x * V + y] * k[x];
          e[size_t(y)] = v[y] - s;
        }
        for (int64_t x = 0; x < K; ++x)
          for (int64_t y = 0; y < V; ++y) Sn[x * V + y] += beta * k[x] * e[size_t(y)];
      }
      for (int64_t i = 0; i < K * V; ++i)
        dS[size_t(i)] = d_final.empty() ? 0.0 : d_final[size_t(state_at(p, int64_t(n), h, 0, 0) + i)];
      for (int64_t t = len - 1; t >= 0; --t) {
        const int64_t tt = sq.begin + t;
        const double* q = &in.q[size_t(I(sq.batch, tt, h, 0, K))];
        const double* k = &in.k[size_t(I(sq.batch, tt, h, 0, K))];
        const double* g = &in.g[size_t(I(sq.batch, tt, h, 0, K))];
        const double* v = &in.v[size_t(I(sq.batch, tt, h, 0, V))];
        const double* dO = &d_o[size_t(I(sq.batch, tt, h, 0, V))];
        const double beta = in.beta[size_t(I.bth(sq.batch, tt, h))];
        const double* Sp = &states[size_t(t * K * V)];
        const double* St = &states[size_t((t + 1) * K * V)];
        for (int64_t x = 0; x < K; ++x)
          for (int64_t y = 0; y < V; ++y) Sbar[size_t(x * V + y)] = std::exp(g[x]) * Sp[x * V + y];
        for (int64_t y = 0; y < V; ++y) {
          double s = 0;
          for (int64_t x = 0; x < K; ++x) s += Sbar[size_t(x * V + y)] * k[x];
          e[size_t(y)] = v[y] - s;
        }
        for (int64_t x = 0; x < K; ++x)
          for (int64_t y = 0; y < V; ++y) dSt[size_t(x * V + y)] = dS[size_t(x * V + y)] + p.scale * q[x] * dO[y];
        double* dq = &dqn[size_t(I(sq.batch, tt, h, 0, K))];
        double* dk = &dkn[size_t(I(sq.batch, tt, h, 0, K))];
        double* dg = &dgact[size_t(I(sq.batch, tt, h, 0, K))];
        for (int64_t x = 0; x < K; ++x) {
          double s = 0;
          for (int64_t y = 0; y < V; ++y) s += St[x * V + y] * dO[y];
          dq[x] = p.scale * s;
        }
        for (int64_t y = 0; y < V; ++y) {
          double s = 0;
          for (int64_t x = 0; x < K; ++x) s += dSt[size_t(x * V + y)] * k[x];
          de[size_t(y)] = beta * s;
          gr.dv[size_t(I(sq.batch, tt, h, y, V))] = de[size_t(y)];
        }
        double db = 0;
        for (int64_t x = 0; x < K; ++x) {
          double dse = 0, sde = 0;
          for (int64_t y = 0; y < V; ++y) {
            dse += dSt[size_t(x * V + y)] * e[size_t(y)];
            sde += Sbar[size_t(x * V + y)] * de[size_t(y)];
          }
          db += k[x] * dse;
          dk[x] = beta * dse - sde;
        }
        gr.dbeta[size_t(I.bth(sq.batch, tt, h))] = db;
        for (int64_t x = 0; x < K; ++x) {
          double s = 0;
          for (int64_t y = 0; y < V; ++y) {
            const double dsbar = dSt[size_t(x * V + y)] - k[x] * de[size_t(y)];
            s += Sbar[size_t(x * V + y)] * dsbar;
            dS[size_t(x * V + y)] = std::exp(g[x]) * dsbar;
          }
          dg[x] = s;
        }
      }
      for (int64_t i = 0; i < K * V; ++i) gr.dh0[size_t(state_at(p, int64_t(n), h, 0, 0) + i)] = dS[size_t(i)];
    }
  }

  kda_l2norm_backward(p, in, dqn, dkn, gr);
  kda_gate_backward(p, a, in, dgact, gr);
  return gr;
}

void kda_l2norm_backward(const kda::KdaProblem& p, const KdaInputs& in, const std::vector<double>& dqn, const std::vector<double>& dkn,
                         KdaGrads& gr) {
  // L2-norm backward: dx = rstd * (dy - y * (dy . y)), per value head (q, k expanded), then the sum
  // over each q/k head's group of value heads in head order.
  const int64_t K = p.K, group = p.group();
  const size_t nt = size_t(p.B * p.T * p.H);
  std::vector<double> dq = dqn, dk = dkn;
  if (p.opts.use_qk_l2norm) l2norm_rows(p, in, dqn, dkn, dq, dk);
  if (group == 1) {
    gr.dq = std::move(dq);
    gr.dk = std::move(dk);
    return;
  }
  const size_t nq = nt / size_t(group) * size_t(K);
  gr.dq.assign(nq, 0.0);
  gr.dk.assign(nq, 0.0);
  for (size_t r = 0; r < nt; ++r) {  // rows (b, t, h) in order: h = hq * group + j, j ascending
    const size_t rq = r / size_t(group);
    for (int64_t c = 0; c < K; ++c) {
      gr.dq[rq * size_t(K) + size_t(c)] += dq[r * size_t(K) + size_t(c)];
      gr.dk[rq * size_t(K) + size_t(c)] += dk[r * size_t(K) + size_t(c)];
    }
  }
}

void l2norm_rows(const kda::KdaProblem& p, const KdaInputs& in, const std::vector<double>& dqn, const std::vector<double>& dkn,
                 std::vector<double>& out_q, std::vector<double>& out_k) {
  const int64_t K = p.K;
  const size_t nt = size_t(p.B * p.T * p.H);
  for (size_t r = 0; r < nt; ++r) {
    for (int which = 0; which < 2; ++which) {
      const std::vector<double>& y = which ? in.k : in.q;
      const std::vector<double>& dy = which ? dkn : dqn;
      std::vector<double>& dx = which ? out_k : out_q;
      const double rstd = which ? in.rstd_k[r] : in.rstd_q[r];
      double dot = 0;
      for (int64_t c = 0; c < K; ++c) dot += dy[r * size_t(K) + size_t(c)] * y[r * size_t(K) + size_t(c)];
      for (int64_t c = 0; c < K; ++c) {
        const size_t i = r * size_t(K) + size_t(c);
        dx[i] = rstd * (dy[i] - y[i] * dot);
      }
    }
  }
}

void kda_gate_backward(const kda::KdaProblem& p, const KdaForwardArgs& a, const KdaInputs& in, const std::vector<double>& dgact,
                       KdaGrads& gr) {
  const Idx I{p.T, p.H};
  const int64_t K = p.K;
  gr.dg = dgact;
  gr.dA_log.assign(size_t(p.H), 0.0);
  gr.ddt_bias.assign(size_t(p.H * K), 0.0);
  if (!p.opts.use_gate_in_kernel) return;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t t = 0; t < p.T; ++t)
      for (int64_t h = 0; h < p.H; ++h)
        for (int64_t c = 0; c < K; ++c) {
          const size_t i = size_t(I(b, t, h, c, K));
          double x = at4(a.g, b, t, h, c);
          if (a.dt_bias.defined()) x += at1(a.dt_bias, h * K + c);
          const double dy = dgact[i];
          const double ea = a.A_log.defined() ? std::exp(at1(a.A_log, h)) : 1.0;
          double dx;
          if (p.opts.use_lower_bound) {
            const double s = sigmoid(ea * x);
            dx = dy * p.opts.lower_bound * s * (1.0 - s) * ea;
            gr.dA_log[size_t(h)] += dx * x;  // d/dA of lb * sigmoid(e^A x) = lb * sigmoid' * e^A * x
          } else {
            dx = dy * (-ea) * softplus_grad(x);
            gr.dA_log[size_t(h)] += dy * in.g[i];  // dg/dA_log = g
          }
          gr.dg[i] = dx;
          gr.ddt_bias[size_t(h * K + c)] += dx;
        }
}

void kda_unit_lower_inverse(const std::vector<double>& L, int64_t rows, int64_t C, std::vector<double>& Ainv) {
  std::fill(Ainv.begin(), Ainv.end(), 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    Ainv[size_t(i * C + i)] = 1.0;
    for (int64_t j = 0; j < i; ++j) {
      double s = 0;
      for (int64_t m = j; m < i; ++m) s += L[size_t(i * C + m)] * Ainv[size_t(m * C + j)];
      Ainv[size_t(i * C + j)] = -s;
    }
  }
}

}  // namespace encore::reference
