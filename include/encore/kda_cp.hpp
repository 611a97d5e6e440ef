// KDA context parallelism (docs/kda.md "Context parallelism"): the
// per-rank summaries that let ranks holding consecutive slices of the same sequences exchange only
// their state maps. For local sequence `piece` of a rank's inputs, per value head:
//   forward:  S_end = M·S_start + S_ext over the piece (M [K, K], S_ext [K, V]: the end state from 0)
//   backward: dS_start = dM·dS_end + dS_ext (dM = Mᵀ; dS_ext the gradient at S_start of the piece's own
//             outputs through d_o alone)
// A rank merges the summaries gathered from its neighbours (X = 0; X = M_j·X + S_j in order) into the
// initial state of its first piece (forward) or the d_final_state of its last piece (backward).
// Backends: CPU (fp64 arithmetic, any float inputs; S, M fp32 or fp64) and CUDA, composed from the
// existing CUDA forward and backward on the piece's tokens (no summary kernel; docs/kda.md):
//   S_ext = the final state of the forward from 0;  M = the final state of the forward with v = 0 (V = K) from
//   h0 = I per value head;  dS_ext = dh0 of the backward (from 0, d_final_state 0, the piece's d_o);  dM = Mᵀ.
// CUDA takes what the CUDA forward and backward take (K, V <= 128, bf16/fp16/fp32 inputs, fp32 A_log,
// dt_bias) and S, M fp32 contiguous, with the workspace the *_workspace_bytes functions give (16-byte
// aligned); run neither allocates nor synchronizes. Precision: the CUDA forward's (bf16 operands, fp32 state).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "encore/kda.hpp"

namespace encore {

// The split of a varlen batch (B = 1, global cu_seqlens) into contiguous rank slices [bounds[r], bounds[r + 1])
// (strictly increasing, from 0 to cu.back()): per rank its local cu_seqlens (one piece per sequence it
// touches), how many earlier ranks hold earlier pieces of its first sequence (pre_num_ranks: merge their
// forward summaries, nearest last) and how many later ranks hold later pieces of its last (post_num_ranks:
// merge their backward summaries, furthest first).
struct KdaCpRankSplit {
  std::vector<int64_t> cu;
  int pre_num_ranks = 0, post_num_ranks = 0;
};
Status kda_cp_split(const std::vector<int64_t>& cu, const std::vector<int64_t>& bounds, std::vector<KdaCpRankSplit>* out);

struct KdaCpSummaryArgs {
  KdaForwardArgs fwd;  // the rank's local inputs (q, k, v, g, beta, A_log, dt_bias, cu_seqlens; o, states, residuals unused)
  TensorView d_o;      // [B, T, HV, V]: the backward summary's incoming gradient
  int64_t piece = 0;   // the local sequence summarized
  TensorView S;        // output [HV, K, V]: S_ext (forward) or dS_ext (backward)
  TensorView M;        // output [HV, K, K]: M (forward) or dM = Mᵀ (backward)
};

// Device workspace of the summaries (0 on the CPU backend or for arguments that do not validate).
size_t cp_forward_summary_workspace_bytes(const KdaCpSummaryArgs& args, const KdaOptions& opts);
size_t cp_backward_summary_workspace_bytes(const KdaCpSummaryArgs& args, const KdaOptions& opts);
// CPU: workspace and stream unused.
Status run_cp_forward_summary(const KdaCpSummaryArgs& args, const KdaOptions& opts, void* workspace = nullptr, Stream stream = nullptr);
Status run_cp_backward_summary(const KdaCpSummaryArgs& args, const KdaOptions& opts, void* workspace = nullptr, Stream stream = nullptr);

// out = the merge of n summaries in order (X = 0; X = M_i·X + S_i): S_i [HV, K, V], M_i [HV, K, K] given as
// S [n, HV, K, V] and M [n, HV, K, K] (the all-gathered summaries of the ranks that matter, in merge order).
// out [HV, K, V]. CPU: fp32 / fp64, fp64 arithmetic. CUDA: fp32 contiguous, fp32 arithmetic (one small
// kernel, n steps per head and block of value columns; no workspace).
Status run_cp_merge(const TensorView& S, const TensorView& M, const TensorView& out, Stream stream = nullptr);

}  // namespace encore
