// KDA context parallelism (docs/kda.md "Context parallelism"): the
// per-rank summaries that let ranks holding consecutive slices of the same sequences exchange only
// their state maps. For local sequence `piece` of a rank's inputs, per value head:
//   forward:  S_end = M·S_start + S_ext over the piece (M [K, K], S_ext [K, V]: the end state from 0)
//   backward: dS_start = dM·dS_end + dS_ext (dM = Mᵀ; dS_ext the gradient at S_start of the piece's own
//             outputs through d_o alone)
// A rank merges the summaries gathered from its neighbours (X = 0; X = M_j·X + S_j in order) into the
// initial state of its first piece (forward) or the d_final_state of its last piece (backward).
// Backends: CPU (fp64 arithmetic, any float inputs; S, M fp32 or fp64). The CUDA summary kernels are
// not written yet: CUDA tensors are refused (unsupported).
#pragma once
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

Status run_cp_forward_summary(const KdaCpSummaryArgs& args, const KdaOptions& opts, Stream stream = nullptr);
Status run_cp_backward_summary(const KdaCpSummaryArgs& args, const KdaOptions& opts, Stream stream = nullptr);

// out = the merge of n summaries in order (X = 0; X = M_i·X + S_i): S_i [HV, K, V], M_i [HV, K, K] given as
// S [n, HV, K, V] and M [n, HV, K, K] (the all-gathered summaries of the ranks that matter, in merge order).
// out [HV, K, V]. CPU backend.
Status run_cp_merge(const TensorView& S, const TensorView& M, const TensorView& out);

}  // namespace encore
