// The fp64 CPU reference of KDA context parallelism: the split, the summaries and the merges
// (kda_cp.hpp; docs/math/kda.md §10). Token by token (exact in fp64); the CUDA summary kernels fold chunks.
#include "kda/reference/kda_cp.hpp"

#include <algorithm>
#include <cmath>

namespace encore::reference {
namespace {

// X ← A_t·X over the K rows of X [K, C] (row stride C): X ← Diag(e^g)·X, then X ← X − β·k·(kᵀX).
void apply_A(const double* k, const double* g, double beta, int64_t K, int64_t C, double* X, std::vector<double>& tmp) {
  tmp.assign(size_t(C), 0.0);
  for (int64_t a = 0; a < K; ++a) {
    const double e = std::exp(g[a]);
    for (int64_t c = 0; c < C; ++c) {
      X[a * C + c] *= e;
      tmp[size_t(c)] += k[a] * X[a * C + c];
    }
  }
  for (int64_t a = 0; a < K; ++a)
    for (int64_t c = 0; c < C; ++c) X[a * C + c] -= beta * k[a] * tmp[size_t(c)];
}
// X ← A_tᵀ·X: X ← X − β·k·(kᵀX), then X ← Diag(e^g)·X.
void apply_At(const double* k, const double* g, double beta, int64_t K, int64_t C, double* X, std::vector<double>& tmp) {
  tmp.assign(size_t(C), 0.0);
  for (int64_t a = 0; a < K; ++a)
    for (int64_t c = 0; c < C; ++c) tmp[size_t(c)] += k[a] * X[a * C + c];
  for (int64_t a = 0; a < K; ++a) {
    const double e = std::exp(g[a]);
    for (int64_t c = 0; c < C; ++c) X[a * C + c] = e * (X[a * C + c] - beta * k[a] * tmp[size_t(c)]);
  }
}

struct Row {  // token t of head h in the prepared [1, T, H, C] arrays
  const kda::KdaProblem& p;
  int64_t at(int64_t t, int64_t h, int64_t C) const { return (t * p.H + h) * C; }
};

void identity(double* M, int64_t K) {
  for (int64_t a = 0; a < K; ++a)
    for (int64_t b = 0; b < K; ++b) M[a * K + b] = a == b ? 1.0 : 0.0;
}

}  // namespace

std::vector<KdaCpRank> kda_cp_split(const std::vector<int64_t>& cu, const std::vector<int64_t>& bounds) {
  const int R = int(bounds.size()) - 1;
  std::vector<KdaCpRank> ranks(size_t(R > 0 ? R : 0));
  for (int r = 0; r < R; ++r) {
    KdaCpRank& k = ranks[size_t(r)];
    k.t0 = bounds[size_t(r)];
    k.t1 = bounds[size_t(r) + 1];
    k.cu.push_back(0);
    for (size_t n = 0; n + 1 < cu.size(); ++n) {
      const int64_t b = std::max(cu[n], k.t0), e = std::min(cu[n + 1], k.t1);
      if (b >= e) continue;
      k.cu.push_back(e - k.t0);
      k.seq_ids.push_back(int64_t(n));
    }
  }
  // pre / post: how many neighbouring ranks hold pieces of the same sequence (their only pieces or their
  // last / first ones), stopping at a rank where the sequence starts or ends.
  auto first = [&](int r) { return ranks[size_t(r)].seq_ids.empty() ? int64_t(-1) : ranks[size_t(r)].seq_ids.front(); };
  auto last = [&](int r) { return ranks[size_t(r)].seq_ids.empty() ? int64_t(-1) : ranks[size_t(r)].seq_ids.back(); };
  for (int r = 0; r < R; ++r) {
    KdaCpRank& k = ranks[size_t(r)];
    if (k.seq_ids.empty()) continue;
    const int64_t s0 = k.seq_ids.front(), s1 = k.seq_ids.back();
    if (k.t0 > cu[size_t(s0)])  // the first sequence started before this slice
      for (int j = r - 1; j >= 0 && last(j) == s0; --j) {
        ++k.pre_num_ranks;
        if (first(j) != s0 || ranks[size_t(j)].t0 == cu[size_t(s0)]) break;  // it starts on rank j
      }
    if (k.t1 < cu[size_t(s1) + 1])  // the last sequence goes on past this slice
      for (int j = r + 1; j < R && first(j) == s1; ++j) {
        ++k.post_num_ranks;
        if (last(j) != s1 || ranks[size_t(j)].t1 == cu[size_t(s1) + 1]) break;  // it ends on rank j
      }
  }
  return ranks;
}

KdaCpSummary kda_cp_forward_summary(const kda::KdaProblem& p, const KdaInputs& in, int64_t n) {
  const int64_t H = p.H, K = p.K, V = p.V;
  const kda::Sequence& sq = p.seqs[size_t(n)];
  KdaCpSummary s{std::vector<double>(size_t(H * K * V), 0.0), std::vector<double>(size_t(H * K * K), 0.0)};
  std::vector<double> tmp;
  const Row row{p};
  for (int64_t h = 0; h < H; ++h) {
    double* S = &s.S[size_t(h * K * V)];
    double* M = &s.M[size_t(h * K * K)];
    identity(M, K);
    for (int64_t t = sq.begin; t < sq.end; ++t) {
      const double* k = &in.k[size_t(row.at(t, h, K))];
      const double* g = &in.g[size_t(row.at(t, h, K))];
      const double* v = &in.v[size_t(row.at(t, h, V))];
      const double beta = in.beta[size_t(t * H + h)];
      apply_A(k, g, beta, K, V, S, tmp);  // S ← A_t·S + β·k·vᵀ
      for (int64_t a = 0; a < K; ++a)
        for (int64_t c = 0; c < V; ++c) S[a * V + c] += beta * k[a] * v[c];
      apply_A(k, g, beta, K, K, M, tmp);  // M ← A_t·M
    }
  }
  return s;
}

KdaCpSummary kda_cp_backward_summary(const kda::KdaProblem& p, const KdaInputs& in, const std::vector<double>& d_o, int64_t n) {
  const int64_t H = p.H, K = p.K, V = p.V;
  const kda::Sequence& sq = p.seqs[size_t(n)];
  KdaCpSummary s{std::vector<double>(size_t(H * K * V), 0.0), std::vector<double>(size_t(H * K * K), 0.0)};
  std::vector<double> tmp;
  const Row row{p};
  for (int64_t h = 0; h < H; ++h) {
    double* dS = &s.S[size_t(h * K * V)];
    double* dM = &s.M[size_t(h * K * K)];
    identity(dM, K);
    for (int64_t t = sq.end - 1; t >= sq.begin; --t) {
      const double* q = &in.q[size_t(row.at(t, h, K))];
      const double* k = &in.k[size_t(row.at(t, h, K))];
      const double* g = &in.g[size_t(row.at(t, h, K))];
      const double* dout = &d_o[size_t(row.at(t, h, V))];
      const double beta = in.beta[size_t(t * H + h)];
      for (int64_t a = 0; a < K; ++a)  // dS_t = s·q_t·dO_tᵀ + (what the later tokens passed back)
        for (int64_t c = 0; c < V; ++c) dS[a * V + c] += p.scale * q[a] * dout[c];
      apply_At(k, g, beta, K, V, dS, tmp);  // to the state before token t
      apply_At(k, g, beta, K, K, dM, tmp);  // dM ← A_tᵀ·dM
    }
  }
  return s;
}

std::vector<double> kda_cp_merge(const std::vector<const KdaCpSummary*>& chain, int64_t H, int64_t K, int64_t V) {
  std::vector<double> X(size_t(H * K * V), 0.0), Y(size_t(K * V));
  for (const KdaCpSummary* s : chain)
    for (int64_t h = 0; h < H; ++h) {
      const double* M = &s->M[size_t(h * K * K)];
      double* x = &X[size_t(h * K * V)];
      for (int64_t a = 0; a < K; ++a)
        for (int64_t c = 0; c < V; ++c) {
          double acc = s->S[size_t((h * K + a) * V + c)];
          for (int64_t b = 0; b < K; ++b) acc += M[a * K + b] * x[b * V + c];
          Y[size_t(a * V + c)] = acc;
        }
      std::copy(Y.begin(), Y.end(), x);
    }
  return X;
}

}  // namespace encore::reference
