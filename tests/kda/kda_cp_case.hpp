// Test helper of the KDA context-parallelism tests (CPU and GPU): token rows of a host vector and the
// public CPU backward of a KdaCase (fp64), the references the split runs are compared with.
#pragma once
#include <vector>

#include "encore/kda.hpp"
#include "tests/kda/kda_case.hpp"

namespace encore::test {

// Rows [t0, t1) of a [1, T, heads, C] vector (per_token = heads * C).
inline std::vector<double> rows(const std::vector<double>& x, int64_t t0, int64_t t1, int64_t per_token) {
  return {x.begin() + t0 * per_token, x.begin() + t1 * per_token};
}

struct Grads {
  std::vector<double> dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias;
};

// The public CPU backward of case c (its forward arguments) with d_o and d_final (null: none).
inline Grads cpu_backward(KdaCase& c, std::vector<double>& d_o, std::vector<double>* d_final, bool* ok) {
  const int64_t T = c.T, H = c.H, Hv = c.Hv(), K = c.K, V = c.V;
  Grads g{std::vector<double>(size_t(T * H * K)), std::vector<double>(size_t(T * H * K)), std::vector<double>(size_t(T * Hv * V)),
          std::vector<double>(size_t(T * Hv * K)), std::vector<double>(size_t(T * Hv)), std::vector<double>(size_t(c.N() * Hv * K * V)),
          std::vector<double>(size_t(Hv)), std::vector<double>(size_t(Hv * K))};
  auto t4 = [&](std::vector<double>& x, int64_t heads, int64_t d) { return TensorView::contiguous(x.data(), DType::kFP64, {1, T, heads, d}); };
  KdaBackwardArgs b;
  b.fwd = c.args();
  b.d_o = t4(d_o, Hv, V);
  if (d_final) b.d_final_state = TensorView::contiguous(d_final->data(), DType::kFP64, {c.N(), Hv, K, V});
  b.dq = t4(g.dq, H, K);
  b.dk = t4(g.dk, H, K);
  b.dv = t4(g.dv, Hv, V);
  b.dg = t4(g.dg, Hv, K);
  b.dbeta = TensorView::contiguous(g.dbeta.data(), DType::kFP64, {1, T, Hv});
  if (c.h0) b.dh0 = TensorView::contiguous(g.dh0.data(), DType::kFP64, {c.N(), Hv, K, V});
  if (!c.A_log.empty()) b.dA_log = TensorView::contiguous(g.dA_log.data(), DType::kFP64, {Hv});
  if (!c.dt_bias.empty()) b.ddt_bias = TensorView::contiguous(g.ddt_bias.data(), DType::kFP64, {Hv * K});
  KdaOptions o = c.opts;
  o.output_final_state = false;
  *ok = bool(run(b, o));
  return g;
}

}  // namespace encore::test
