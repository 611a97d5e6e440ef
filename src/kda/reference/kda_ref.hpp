// CPU references for Kimi Delta Attention, fp64 throughout (the math: include/encore/kda.hpp, docs/kda.md):
//   (a) the token recurrence (forward),
//   (b) the chunked algorithm (chunk 64, log2 gates, WY form) exposing its intermediates,
//   (c) the token-level backpropagation through time, with the gate and L2-norm backward.
// Dense arrays are [B, T, H, C] row-major (index ((b * T + t) * H + h) * C + c); states [N, H, K, V],
// H = the value heads (KdaProblem::H): q and k are expanded to one copy per value head by kda_prepare,
// and only KdaGrads::dq, dk are per q/k head ([B, T, Hq, K], the sums over each group).
#pragma once
#include <functional>
#include <vector>

#include "kda/problem.hpp"

namespace encore::reference {

// The inputs after gate activation and the optional L2 norm, in fp64.
struct KdaInputs {
  std::vector<double> q, k, v, g, beta;  // q, k normalized when use_qk_l2norm; g = activated log-decay
  std::vector<double> rstd_q, rstd_k;    // [B, T, H] (1 without the L2 norm)
  std::vector<double> h0;                // [N, H, K, V] (zeros without initial_state)
};
KdaInputs kda_prepare(const kda::KdaProblem& p, const KdaForwardArgs& a);

// o [B, T, H, V] and final state [N, H, K, V].
void kda_recurrent_forward(const kda::KdaProblem& p, const KdaInputs& in, std::vector<double>& o, std::vector<double>& final_state);
// The recurrence of sequence n (p.seqs[n]) and value head h from S (the [K, V] state, row-major), updated
// in place; the sequence's rows of o [B, T, H, V] written; after each token t (counted from the
// sequence's start) on_token(t, S) where given (serving: the per-token states of speculative decoding).
void kda_recurrent_sequence(const kda::KdaProblem& p, const KdaInputs& in, size_t n, int64_t h, std::vector<double>& S,
                            std::vector<double>& o, const std::function<void(int64_t, const std::vector<double>&)>& on_token = {});

// Intermediates of the chunked forward. Per token: G (local inclusive cumsum of g, log2) [.., K];
// Aqk and A ((I + L)^-1) rows [.., 64] (column j = chunk row j); W [.., K]; U, Vnew [.., V].
// Per chunk (sequences in order, chunks in order): h = the chunk-start state [chunks, H, K, V].
struct KdaChunkTrace {
  std::vector<double> G, Aqk, A, W, U, Vnew, h;
  int64_t num_chunks = 0;
};
void kda_chunked_forward(const kda::KdaProblem& p, const KdaInputs& in, std::vector<double>& o, std::vector<double>& final_state,
                         KdaChunkTrace* trace);

struct KdaGrads {
  std::vector<double> dq, dk, dv, dg, dbeta;  // with respect to the raw inputs (pre-norm q, k; g as passed); dq, dk [B, T, Hq, K]
  std::vector<double> dh0;                    // [N, H, K, V]
  std::vector<double> dA_log, ddt_bias;       // [H], [H * K] (zeros when unused)
};
// d_o [B, T, H, V]; d_final [N, H, K, V] (empty: zero).
KdaGrads kda_backward(const kda::KdaProblem& p, const KdaForwardArgs& a, const KdaInputs& in, const std::vector<double>& d_o,
                      const std::vector<double>& d_final);

// The chain-rule tails shared by the backwards. kda_l2norm_backward: gr.dq, gr.dk from the gradients
// w.r.t. the normalized q, k (dx = rstd (dy - y (dy . y)); a copy without the L2 norm).
// kda_gate_backward: gr.dg (w.r.t. the g passed in), gr.dA_log, gr.ddt_bias from dgact, the gradient
// w.r.t. the activated log-decay (docs/kda.md; a copy for a precomputed gate, zeros for the others).
void kda_l2norm_backward(const kda::KdaProblem& p, const KdaInputs& in, const std::vector<double>& dqn, const std::vector<double>& dkn,
                         KdaGrads& gr);
void kda_gate_backward(const kda::KdaProblem& p, const KdaForwardArgs& a, const KdaInputs& in, const std::vector<double>& dgact,
                       KdaGrads& gr);

// A = (I + L)^-1 of a chunk's strictly lower L (rows x rows, row stride C) by forward substitution,
// into Ainv (row stride C, zero above the diagonal); shared by the chunked forward and backward.
void kda_unit_lower_inverse(const std::vector<double>& L, int64_t rows, int64_t C, std::vector<double>& Ainv);

}  // namespace encore::reference
