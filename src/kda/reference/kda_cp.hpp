// Context parallelism for KDA (docs/math/kda.md §10): the fp64 CPU reference of the split
// of a varlen batch over ranks and of the two merges, on the inputs kda_prepare produces.
//
// A global varlen batch (B = 1, cu_seqlens) is split along T into contiguous rank slices
// [bounds[r], bounds[r + 1]); each rank holds its pieces of the sequences as a local varlen batch.
// Per head, the state map of one piece (tokens t0..t1 of a sequence) is affine:
//   S_end = M·S_start + S_ext,   M = A_{t1}·…·A_{t0},  A_t = (I − β_t k_t k_tᵀ)·Diag(e^{g_t})  [K, K],
// S_ext = the piece's end state from S_start = 0 (the forward summary, folded token by token: M ← A_t·M,
// never a K³ product per chunk in the kernels, Φ·M = Diag(2^{g_C})·M − Kgᵀ·(W·M)). Gradients go back
// through the transpose: dS_start = Mᵀ·dS_end + dS_ext, with dS_ext the gradient at S_start of the
// piece's own outputs o_t = s·S_tᵀ q_t alone (the backward summary: dS, dM = Mᵀ folded in reverse).
// Forward merge (a rank whose first piece continues a sequence from pre_num_ranks earlier ranks):
//   S = 0; for j = r − pre … r − 1: S = M_j·S + S_ext_j   (the forward summaries of those ranks' last pieces)
// Backward merge (a rank whose last piece continues onto post_num_ranks later ranks):
//   dS = 0; for j = r + post … r + 1: dS = dM_j·dS + dS_ext_j   (the backward summaries of their first pieces)
// and dS is the last piece's d_final_state. Both merges are compositions of affine maps: exact.
#pragma once
#include <cstdint>
#include <vector>

#include "kda/problem.hpp"
#include "kda/reference/kda_ref.hpp"

namespace encore::reference {

struct KdaCpRank {
  int64_t t0 = 0, t1 = 0;         // the rank's global token slice [t0, t1)
  std::vector<int64_t> cu;        // local cu_seqlens over the slice (0-based), one piece per sequence touched
  std::vector<int64_t> seq_ids;   // the global sequence of each local piece
  int pre_num_ranks = 0;          // earlier ranks holding earlier pieces of the first local sequence
  int post_num_ranks = 0;         // later ranks holding later pieces of the last local sequence
};
// bounds: [R + 1] strictly increasing token offsets from 0 to cu.back() (every rank holds a token).
std::vector<KdaCpRank> kda_cp_split(const std::vector<int64_t>& cu, const std::vector<int64_t>& bounds);

// Per-head summaries of one piece: S [H, K, V] and M [H, K, K] (forward: S_ext, M; backward: dS_ext, dM = Mᵀ).
struct KdaCpSummary {
  std::vector<double> S, M;
};
// Piece n of the local problem p (its B = 1 varlen sequences; H = the value heads).
KdaCpSummary kda_cp_forward_summary(const kda::KdaProblem& p, const KdaInputs& in, int64_t n);
// d_o: [1, T, H, V] of the local problem.
KdaCpSummary kda_cp_backward_summary(const kda::KdaProblem& p, const KdaInputs& in, const std::vector<double>& d_o, int64_t n);
// X = 0; for each summary in order: X = M·X + S. Returns [H, K, V].
std::vector<double> kda_cp_merge(const std::vector<const KdaCpSummary*>& chain, int64_t H, int64_t K, int64_t V);

}  // namespace encore::reference
