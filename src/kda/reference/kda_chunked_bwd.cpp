#include "kda/reference/kda_chunked_bwd.hpp"

#include <algorithm>
#include <cmath>

namespace encore::reference {
namespace {

constexpr int C = kda::kChunk;
constexpr double kRcpLn2 = 1.4426950408889634;

// One chunk of one sequence: chunk slot `id` (in the order of residuals.h), tokens [t0, t0 + rows)
// of batch row `b`.
struct Chunk {
  int64_t n, b, t0, rows, id;
};

// Chunks of sequence n, in order.
std::vector<Chunk> seq_chunks(const kda::KdaProblem& p, size_t n, int64_t base) {
  const kda::Sequence& sq = p.seqs[n];
  std::vector<Chunk> out;
  for (int64_t t0 = sq.begin, c = 0; t0 < sq.end; t0 += C, ++c) out.push_back({int64_t(n), sq.batch, t0, std::min<int64_t>(C, sq.end - t0), base + c});
  return out;
}

int64_t total_chunks(const kda::KdaProblem& p) {
  int64_t n = 0;
  for (const auto& s : p.seqs) n += (s.end - s.begin + C - 1) / C;
  return n;
}

// Row-major [d0, d1, d2, d3] (or any rank) copy of a view into fp64.
std::vector<double> load_view(const TensorView& t) {
  std::vector<double> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    int64_t rem = i, off = 0;
    for (int d = t.ndim - 1; d >= 0; --d) {
      off += (rem % t.shape[size_t(d)]) * t.strides[size_t(d)];
      rem /= t.shape[size_t(d)];
    }
    out[size_t(i)] = load_as_double(t.data, t.dtype, off);
  }
  return out;
}

// Per-token row accessors of one (chunk, head): x(i, c) = X[tok(t0 + i) * width + c].
struct Rows {
  int64_t T, H, b, t0, h;
  int64_t tok(int64_t i) const { return (b * T + t0 + i) * H + h; }
  size_t at(int64_t i, int64_t c, int64_t width) const { return size_t(tok(i) * width + c); }
};

}  // namespace

KdaSavedResiduals kda_load_residuals(const KdaResiduals& r) {
  KdaSavedResiduals s;
  if (r.G.defined()) s.G = load_view(r.G);
  if (r.Aqk.defined()) s.Aqk = load_view(r.Aqk);
  if (r.Akk.defined()) s.A = load_view(r.Akk);
  if (r.h.defined()) s.h = load_view(r.h);
  return s;
}

// ---- stage 0: recompute ---------------------------------------------------------------------------

KdaBwdRecompute kda_bwd_recompute(const kda::KdaProblem& p, const KdaInputs& in, const KdaSavedResiduals* saved) {
  const int64_t K = p.K, V = p.V, H = p.H;
  const bool have_G = saved && !saved->G.empty(), have_Aqk = saved && !saved->Aqk.empty(), have_A = saved && !saved->A.empty(),
             have_h = saved && !saved->h.empty();
  KdaBwdRecompute rc;
  const size_t ntok = size_t(p.B * p.T * p.H);
  rc.num_chunks = total_chunks(p);
  rc.rematerialized = !have_h;
  rc.G.assign(ntok * size_t(K), 0.0);
  rc.Qg.assign(ntok * size_t(K), 0.0);
  rc.Kg.assign(ntok * size_t(K), 0.0);
  rc.Kbeta.assign(ntok * size_t(K), 0.0);
  rc.W.assign(ntok * size_t(K), 0.0);
  rc.U.assign(ntok * size_t(V), 0.0);
  rc.Vnew.assign(ntok * size_t(V), 0.0);
  rc.Aqk.assign(ntok * C, 0.0);
  rc.A.assign(ntok * C, 0.0);
  rc.h.assign(size_t(rc.num_chunks * H * K * V), 0.0);
  rc.gC.assign(size_t(rc.num_chunks * H * K), 0.0);

  std::vector<double> S(size_t(K * V)), L(C * C), Ainv(C * C);
  int64_t base = 0;
  for (size_t n = 0; n < p.seqs.size(); ++n) {
    const std::vector<Chunk> chunks = seq_chunks(p, n, base);
    base += int64_t(chunks.size());
    for (int64_t h = 0; h < H; ++h) {
      const double* h0 = &in.h0[size_t((int64_t(n) * H + h) * K * V)];
      std::copy(h0, h0 + K * V, S.begin());
      for (const Chunk& ch : chunks) {
        const Rows R{p.T, H, ch.b, ch.t0, h};
        const int64_t rows = ch.rows;
        auto G = [&](int64_t i, int64_t a) -> double& { return rc.G[R.at(i, a, K)]; };
        auto q = [&](int64_t i, int64_t a) { return in.q[R.at(i, a, K)] * p.scale; };  // Q~ = s Q
        auto k = [&](int64_t i, int64_t a) { return in.k[R.at(i, a, K)]; };
        auto v = [&](int64_t i, int64_t a) { return in.v[R.at(i, a, V)]; };
        auto beta = [&](int64_t i) { return in.beta[size_t(R.tok(i))]; };
        // G: the local inclusive cumsum in log2 (as the forward), or the saved one.
        for (int64_t a = 0; a < K; ++a) {
          double acc = 0;
          for (int64_t i = 0; i < rows; ++i) {
            acc += in.g[R.at(i, a, K)];
            G(i, a) = have_G ? saved->G[R.at(i, a, K)] : acc * kRcpLn2;
          }
          rc.gC[size_t((ch.id * H + h) * K + a)] = G(rows - 1, a);
        }
        // h: the chunk-start state, saved or from the running state of the rematerialize pass.
        double* hs = &rc.h[size_t((ch.id * H + h) * K * V)];
        if (have_h) std::copy(&saved->h[size_t((ch.id * H + h) * K * V)], &saved->h[size_t((ch.id * H + h + 1) * K * V)], hs);
        else std::copy(S.begin(), S.end(), hs);
        // Gated operands.
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t a = 0; a < K; ++a) {
            const double gc = rc.gC[size_t((ch.id * H + h) * K + a)];
            rc.Qg[R.at(i, a, K)] = q(i, a) * std::exp2(G(i, a));
            rc.Kg[R.at(i, a, K)] = k(i, a) * std::exp2(gc - G(i, a));
            rc.Kbeta[R.at(i, a, K)] = beta(i) * k(i, a) * std::exp2(G(i, a));
          }
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
            rc.Aqk[R.at(i, j, C)] = have_Aqk ? saved->Aqk[R.at(i, j, C)] : aqk;
            if (j < i) L[size_t(i * C + j)] = beta(i) * l;
          }
        // A = (I + L)^-1 by forward substitution, or the saved rows.
        kda_unit_lower_inverse(L, rows, C, Ainv);
        for (int64_t i = 0; i < rows; ++i) {
          if (have_A)
            for (int64_t j = 0; j <= i; ++j) Ainv[size_t(i * C + j)] = saved->A[R.at(i, j, C)];
          for (int64_t j = 0; j <= i; ++j) rc.A[R.at(i, j, C)] = Ainv[size_t(i * C + j)];
        }
        // W = A Kbeta, U = A Vbeta, Vnew = U - W h.
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t a = 0; a < K; ++a) {
            double w = 0;
            for (int64_t j = 0; j <= i; ++j) w += Ainv[size_t(i * C + j)] * rc.Kbeta[R.at(j, a, K)];
            rc.W[R.at(i, a, K)] = w;
          }
          for (int64_t y = 0; y < V; ++y) {
            double u = 0, ws = 0;
            for (int64_t j = 0; j <= i; ++j) u += Ainv[size_t(i * C + j)] * beta(j) * v(j, y);
            for (int64_t a = 0; a < K; ++a) ws += rc.W[R.at(i, a, K)] * hs[a * V + y];
            rc.U[R.at(i, y, V)] = u;
            rc.Vnew[R.at(i, y, V)] = u - ws;
          }
        }
        // Rematerialize: S' = Diag(2^gC) S + Kg^T Vnew.
        if (!have_h)
          for (int64_t a = 0; a < K; ++a) {
            const double gc = rc.gC[size_t((ch.id * H + h) * K + a)];
            for (int64_t y = 0; y < V; ++y) {
              double acc = std::exp2(gc) * S[size_t(a * V + y)];
              for (int64_t j = 0; j < rows; ++j) acc += rc.Kg[R.at(j, a, K)] * rc.Vnew[R.at(j, y, V)];
              S[size_t(a * V + y)] = acc;
            }
          }
      }
    }
  }
  return rc;
}

// ---- stage 1: dAv ---------------------------------------------------------------------------------

KdaBwdDAv kda_bwd_dav(const kda::KdaProblem& p, const KdaBwdRecompute& rc, const std::vector<double>& d_o) {
  const int64_t V = p.V, H = p.H;
  const size_t ntok = size_t(p.B * p.T * p.H);
  KdaBwdDAv d;
  d.dAqk.assign(ntok * C, 0.0);
  d.dVnew_intra.assign(ntok * size_t(V), 0.0);
  int64_t base = 0;
  for (size_t n = 0; n < p.seqs.size(); ++n) {
    const std::vector<Chunk> chunks = seq_chunks(p, n, base);
    base += int64_t(chunks.size());
    for (const Chunk& ch : chunks)
      for (int64_t h = 0; h < H; ++h) {
        const Rows R{p.T, H, ch.b, ch.t0, h};
        for (int64_t i = 0; i < ch.rows; ++i)
          for (int64_t j = 0; j <= i; ++j) {  // dAqk = tril(dO Vnew^T)
            double s = 0;
            for (int64_t y = 0; y < V; ++y) s += d_o[R.at(i, y, V)] * rc.Vnew[R.at(j, y, V)];
            d.dAqk[R.at(i, j, C)] = s;
          }
        for (int64_t j = 0; j < ch.rows; ++j)  // dVnew = Aqk^T dO
          for (int64_t y = 0; y < V; ++y) {
            double s = 0;
            for (int64_t i = j; i < ch.rows; ++i) s += rc.Aqk[R.at(i, j, C)] * d_o[R.at(i, y, V)];
            d.dVnew_intra[R.at(j, y, V)] = s;
          }
      }
  }
  return d;
}

// ---- stages 2-5: the reverse pass -----------------------------------------------------------------

KdaBwdReverse kda_bwd_reverse(const kda::KdaProblem& p, const KdaInputs& in, const KdaBwdRecompute& rc, const KdaBwdDAv& dav,
                              const std::vector<double>& d_o, const std::vector<double>& d_final) {
  const int64_t K = p.K, V = p.V, H = p.H;
  const size_t ntok = size_t(p.B * p.T * p.H), nk = ntok * size_t(K), nv = ntok * size_t(V);
  KdaBwdReverse r;
  r.dh.assign(rc.h.size(), 0.0);
  r.dh0.assign(in.h0.size(), 0.0);
  r.dVnew.assign(nv, 0.0);
  r.dq_inter.assign(nk, 0.0);
  r.dk_inter.assign(nk, 0.0);
  r.dW.assign(nk, 0.0);
  r.dA.assign(ntok * C, 0.0);
  r.dL.assign(ntok * C, 0.0);
  r.dq.assign(nk, 0.0);
  r.dk.assign(nk, 0.0);
  r.dv.assign(nv, 0.0);
  r.dbeta.assign(ntok, 0.0);
  r.dG.assign(nk, 0.0);
  r.dg.assign(nk, 0.0);

  std::vector<double> dS(size_t(K * V)), dSn(size_t(K * V)), M(C * C), dKrow(size_t(C * K)), dKcol(size_t(C * K)),
      dQi(size_t(C * K)), kdk(static_cast<size_t>(K));
  int64_t base = 0;
  for (size_t n = 0; n < p.seqs.size(); ++n) {
    const std::vector<Chunk> chunks = seq_chunks(p, n, base);
    base += int64_t(chunks.size());
    for (int64_t h = 0; h < H; ++h) {
      const size_t s0 = size_t((int64_t(n) * H + h) * K * V);
      for (int64_t i = 0; i < K * V; ++i) dS[size_t(i)] = d_final.empty() ? 0.0 : d_final[s0 + size_t(i)];
      for (auto it = chunks.rbegin(); it != chunks.rend(); ++it) {
        const Chunk& ch = *it;
        const Rows R{p.T, H, ch.b, ch.t0, h};
        const int64_t rows = ch.rows;
        const double* S = &rc.h[size_t((ch.id * H + h) * K * V)];
        const double* gC = &rc.gC[size_t((ch.id * H + h) * K)];
        std::copy(dS.begin(), dS.end(), r.dh.begin() + (ch.id * H + h) * K * V);
        auto x = [&](const std::vector<double>& X, int64_t i, int64_t c, int64_t w) { return X[R.at(i, c, w)]; };
        auto G = [&](int64_t i, int64_t a) { return rc.G[R.at(i, a, K)]; };
        auto qt = [&](int64_t i, int64_t a) { return in.q[R.at(i, a, K)] * p.scale; };
        auto k = [&](int64_t i, int64_t a) { return in.k[R.at(i, a, K)]; };
        auto beta = [&](int64_t i) { return in.beta[size_t(R.tok(i))]; };
        auto A = [&](int64_t i, int64_t j) { return rc.A[R.at(i, j, C)]; };
        auto dG = [&](int64_t i, int64_t a) -> double& { return r.dG[R.at(i, a, K)]; };

        // Stage 2 (dhu): dVnew = Aqk^T dO + Kg dS'.
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t y = 0; y < V; ++y) {
            double s = x(dav.dVnew_intra, i, y, V);
            for (int64_t a = 0; a < K; ++a) s += x(rc.Kg, i, a, K) * dS[size_t(a * V + y)];
            r.dVnew[R.at(i, y, V)] = s;
          }
        // Stage 3, inter-chunk terms: dQ~ = (dO S^T) . 2^G, dK = (Vnew dS'^T) . 2^(gC - G), dW = -dVnew S^T.
        std::fill(kdk.begin(), kdk.end(), 0.0);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t a = 0; a < K; ++a) {
            double so = 0, sv = 0, sw = 0;
            for (int64_t y = 0; y < V; ++y) {
              so += d_o[R.at(i, y, V)] * S[a * V + y];
              sv += x(rc.Vnew, i, y, V) * dS[size_t(a * V + y)];
              sw += x(r.dVnew, i, y, V) * S[a * V + y];
            }
            const double dqt = so * std::exp2(G(i, a)), dki = sv * std::exp2(gC[a] - G(i, a));
            r.dq_inter[R.at(i, a, K)] = p.scale * dqt;
            r.dk_inter[R.at(i, a, K)] = dki;
            r.dW[R.at(i, a, K)] = -sw;
            dG(i, a) += qt(i, a) * dqt - k(i, a) * dki;
            kdk[size_t(a)] += k(i, a) * dki;
          }
        // dS = Diag(2^gC) dS' + Qg^T dO - W^T dVnew; the gC terms of dG on the last row.
        for (int64_t a = 0; a < K; ++a) {
          const double e = std::exp2(gC[a]);
          double sd = 0;
          for (int64_t y = 0; y < V; ++y) {
            double s = e * dS[size_t(a * V + y)];
            sd += S[a * V + y] * dS[size_t(a * V + y)];
            for (int64_t i = 0; i < rows; ++i) s += x(rc.Qg, i, a, K) * d_o[R.at(i, y, V)] - x(rc.W, i, a, K) * x(r.dVnew, i, y, V);
            dSn[size_t(a * V + y)] = s;
          }
          dG(rows - 1, a) += e * sd + kdk[size_t(a)];
        }
        // dA = dVnew Vbeta^T + dW Kbeta^T (i >= j).
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j <= i; ++j) {
            double s = 0;
            for (int64_t y = 0; y < V; ++y) s += x(r.dVnew, i, y, V) * beta(j) * x(in.v, j, y, V);
            for (int64_t a = 0; a < K; ++a) s += x(r.dW, i, a, K) * x(rc.Kbeta, j, a, K);
            r.dA[R.at(i, j, C)] = s;
          }
        // dVbeta = A^T dVnew, dKbeta = A^T dW and their chain rule into v, k, beta, G.
        for (int64_t j = 0; j < rows; ++j) {
          double db = 0;
          for (int64_t y = 0; y < V; ++y) {
            double s = 0;
            for (int64_t i = j; i < rows; ++i) s += A(i, j) * x(r.dVnew, i, y, V);
            r.dv[R.at(j, y, V)] = beta(j) * s;
            db += s * x(in.v, j, y, V);
          }
          for (int64_t a = 0; a < K; ++a) {
            double s = 0;
            for (int64_t i = j; i < rows; ++i) s += A(i, j) * x(r.dW, i, a, K);
            const double e = std::exp2(G(j, a));
            r.dk[R.at(j, a, K)] += beta(j) * e * s;
            db += s * k(j, a) * e;
            dG(j, a) += x(rc.Kbeta, j, a, K) * s;
          }
          r.dbeta[size_t(R.tok(j))] += db;
        }
        // dL = -StrictTril(A^T dA A^T): M = A^T dA (M_ij = sum_m A_mi dA_mj), dL_ij = -sum_m M_im A_jm.
        std::fill(M.begin(), M.end(), 0.0);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < rows; ++j) {
            double s = 0;
            for (int64_t m = std::max(i, j); m < rows; ++m) s += A(m, i) * r.dA[R.at(m, j, C)];
            M[size_t(i * C + j)] = s;
          }
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < i; ++j) {
            double s = 0;
            for (int64_t m = 0; m <= j; ++m) s += M[size_t(i * C + m)] * A(j, m);
            r.dL[R.at(i, j, C)] = -s;
          }
        // Stage 4, intra-chunk terms through Aqk and L.
        std::fill(dKrow.begin(), dKrow.end(), 0.0);
        std::fill(dKcol.begin(), dKcol.end(), 0.0);
        std::fill(dQi.begin(), dQi.end(), 0.0);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j <= i; ++j) {
            const double daqk = dav.dAqk[R.at(i, j, C)], dl = j < i ? r.dL[R.at(i, j, C)] : 0.0;
            for (int64_t a = 0; a < K; ++a) {
              const double e = std::exp2(G(i, a) - G(j, a));
              dQi[size_t(i * K + a)] += daqk * k(j, a) * e;
              dKcol[size_t(j * K + a)] += (daqk * qt(i, a) + dl * beta(i) * k(i, a)) * e;
              dKrow[size_t(i * K + a)] += dl * k(j, a) * e;
            }
          }
        for (int64_t i = 0; i < rows; ++i) {
          double db = 0;
          for (int64_t a = 0; a < K; ++a) {
            const double dkr = dKrow[size_t(i * K + a)], dkc = dKcol[size_t(i * K + a)], dqi = dQi[size_t(i * K + a)];
            r.dq[R.at(i, a, K)] = r.dq_inter[R.at(i, a, K)] + p.scale * dqi;
            r.dk[R.at(i, a, K)] += r.dk_inter[R.at(i, a, K)] + beta(i) * dkr + dkc;
            db += k(i, a) * dkr;
            dG(i, a) += qt(i, a) * dqi + k(i, a) * (beta(i) * dkr - dkc);
          }
          r.dbeta[size_t(R.tok(i))] += db;
        }
        // Stage 5: the reverse cumsum of dG within the chunk.
        for (int64_t a = 0; a < K; ++a) {
          double acc = 0;
          for (int64_t i = rows - 1; i >= 0; --i) {
            acc += dG(i, a);
            r.dg[R.at(i, a, K)] = acc;
          }
        }
        dS.swap(dSn);
      }
      std::copy(dS.begin(), dS.end(), r.dh0.begin() + int64_t(s0));
    }
  }
  return r;
}

KdaGrads kda_chunked_backward(const kda::KdaProblem& p, const KdaForwardArgs& a, const KdaInputs& in, const std::vector<double>& d_o,
                              const std::vector<double>& d_final, const KdaSavedResiduals* saved, KdaBwdTrace* trace) {
  KdaBwdTrace local;
  KdaBwdTrace& tr = trace ? *trace : local;
  tr.rc = kda_bwd_recompute(p, in, saved);
  tr.dav = kda_bwd_dav(p, tr.rc, d_o);
  tr.rev = kda_bwd_reverse(p, in, tr.rc, tr.dav, d_o, d_final);
  KdaGrads gr;
  gr.dv = tr.rev.dv;
  gr.dbeta = tr.rev.dbeta;
  gr.dh0 = tr.rev.dh0;
  kda_l2norm_backward(p, in, tr.rev.dq, tr.rev.dk, gr);
  kda_gate_backward(p, a, in, tr.rev.dg, gr);
  return gr;
}

}  // namespace encore::reference
