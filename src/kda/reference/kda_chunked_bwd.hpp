// CPU reference of the chunked KDA backward, fp64 throughout, stage by stage as the GPU kernels will
// compute it (the math: docs/math/kda.md §4-§6; the forward: kda_ref.hpp). Per chunk of
// C = 64 rows (a sequence's last chunk may be partial: `rows` valid rows, gC = G at row rows - 1) and
// head, Q~ = scale q (q, k after the optional L2 norm), G the chunk-local inclusive cumsum of the
// activated gate in log2, S = h the chunk-start state [K, V], dS' the cotangent of the chunk-END state:
//
// Stage 0, recompute (kda_bwd_recompute; chunk-parallel except the rematerialize pass):
//   Qg = Q~ . 2^G   Kg = K . 2^(gC - G)   Kbeta = Diag(beta)(K . 2^G)   Vbeta = Diag(beta) V
//   Aqk_ij = sum_a Q~_ia K_ja 2^(G_ia - G_ja) (i >= j)   L_ij = beta_i sum_a K_ia K_ja 2^(G_ia - G_ja) (i > j)
//   A = (I + L)^-1   W = A Kbeta   U = A Vbeta   Vnew = U - W S
//   saved-h: S read from the forward's residual h [NT, H, K, V]; rematerialize (no h): the state pass
//   S <- Diag(2^gC) S + Kg^T Vnew is re-run from the initial state. G, Aqk, A are taken from the
//   forward's residuals when given, else recomputed from the inputs.
// Stage 1, dAv (kda_bwd_dav; chunk-parallel):
//   dAqk = tril(dO Vnew^T) (diagonal included)   dVnew(intra) = Aqk^T dO
// Stages 2-5, the reverse pass (kda_bwd_reverse; serial over a sequence's chunks, last to first),
// gradients w.r.t. the natural-log cumsum Gamma = G ln 2 written dG (so the ln 2 factors cancel):
//   2 (dhu):    dh[chunk] = dS' (dht at a sequence's last chunk, 0 without it)
//               dVnew += Kg dS'    dS = Diag(2^gC) dS' + Qg^T dO - W^T dVnew  -> dS' of the previous chunk, dh0 at the first
//   3 (WY):     dQ~ = (dO S^T) . 2^G   dK = (Vnew dS'^T) . 2^(gC - G)   (the "inter" parts)
//               dW = -dVnew S^T   dA = dVnew Vbeta^T + dW Kbeta^T (lower incl. diagonal)
//               dVbeta = A^T dVnew -> dv = beta dVbeta, dbeta += rowsum(dVbeta . V)
//               dKbeta = A^T dW    -> dk += beta 2^G . dKbeta, dbeta += rowsum(dKbeta . K . 2^G), dG += Kbeta . dKbeta
//               dG += Q~ . dQ~(inter) - K . dK(inter);  dG[rows - 1] += 2^gC . rowsum_V(S . dS') + sum_rows K . dK(inter)
//               dL = -StrictTril(A^T dA A^T)
//   4 (intra):  E_ij = 2^(G_i - G_j), i >= j:  dQ~_i += sum_j dAqk_ij K_j . E_ij
//               dKrow_i = sum_{j<i} dL_ij K_j . E_ij      dk_i += beta_i dKrow_i   dbeta_i += K_i . dKrow_i
//               dKcol_j = sum_{i>=j} (dAqk_ij Q~_i + [i>j] dL_ij beta_i K_i) . E_ij   dk_j += dKcol_j
//               dG_i += Q~_i . dQ~_i(intra) + K_i . (beta_i dKrow_i - dKcol_i)
//   5 (cumsum): dg_t = sum_{t' >= t in t's chunk} dG_t' (w.r.t. the activated natural-log gate); dq = scale dQ~.
// Then the shared tails of kda_ref.hpp: the gate backward (raw gate, dA_log, ddt_bias) and the L2-norm
// backward (kda_chunked_backward).
//
// Layouts as KdaChunkTrace: per token [B, T, H, C] row-major with C = K, V or 64 (column j of a
// 64-wide row = row j of the token's chunk; entries past the row's triangle and of rows outside any
// chunk are 0); per chunk [NT, H, K, V] (NT = chunks of all sequences in order, as residuals.h); per
// sequence [N, H, K, V]; per chunk and channel [NT, H, K].
#pragma once
#include <vector>

#include "kda/problem.hpp"
#include "kda/reference/kda_ref.hpp"

namespace encore::reference {

// The forward's residuals in fp64 (KdaResiduals' layouts); an empty vector is recomputed, an empty h
// selects the rematerialize path.
struct KdaSavedResiduals {
  std::vector<double> G, Aqk, A, h;
};
// Reads the defined residual views (any float dtype, any strides) into fp64.
KdaSavedResiduals kda_load_residuals(const KdaResiduals& r);

// Stage 0 outputs.
struct KdaBwdRecompute {
  std::vector<double> G, Qg, Kg, Kbeta, W;  // [.., K]; Qg includes the scale
  std::vector<double> U, Vnew;              // [.., V]
  std::vector<double> Aqk, A;               // [.., 64]
  std::vector<double> h;                    // [NT, H, K, V] chunk-start states (read or rematerialized)
  std::vector<double> gC;                   // [NT, H, K] G at each chunk's last valid row (log2)
  int64_t num_chunks = 0;
  bool rematerialized = false;
};
// saved: nullptr or empty members = recompute those pieces (no h: rematerialize).
KdaBwdRecompute kda_bwd_recompute(const kda::KdaProblem& p, const KdaInputs& in, const KdaSavedResiduals* saved);

// Stage 1 outputs.
struct KdaBwdDAv {
  std::vector<double> dAqk;        // [.., 64] tril(dO Vnew^T)
  std::vector<double> dVnew_intra; // [.., V] Aqk^T dO
};
KdaBwdDAv kda_bwd_dav(const kda::KdaProblem& p, const KdaBwdRecompute& rc, const std::vector<double>& d_o);

// Stages 2-5 outputs; q, k gradients are w.r.t. the normalized q, k (scale applied: dq = scale dQ~),
// dg w.r.t. the activated log-decay.
struct KdaBwdReverse {
  std::vector<double> dh;                 // [NT, H, K, V] dS' of each chunk (cotangent of its end state)
  std::vector<double> dh0;                // [N, H, K, V]
  std::vector<double> dVnew;              // [.., V] total: intra + Kg dS'
  std::vector<double> dq_inter, dk_inter; // [.., K] scale dQ~(inter), dK(inter) (through Qg, Kg)
  std::vector<double> dW;                 // [.., K] -dVnew S^T
  std::vector<double> dA, dL;             // [.., 64] dA (i >= j), dL (i > j)
  std::vector<double> dq, dk, dv, dbeta;  // totals
  std::vector<double> dG;                 // [.., K] per row, before the reverse cumsum
  std::vector<double> dg;                 // [.., K] after it
};
// d_o [B, T, H, V]; d_final [N, H, K, V] (empty: zero).
KdaBwdReverse kda_bwd_reverse(const kda::KdaProblem& p, const KdaInputs& in, const KdaBwdRecompute& rc, const KdaBwdDAv& dav,
                              const std::vector<double>& d_o, const std::vector<double>& d_final);

struct KdaBwdTrace {
  KdaBwdRecompute rc;
  KdaBwdDAv dav;
  KdaBwdReverse rev;
};
// The whole chunked backward: the same gradients as kda_backward (the token-level BPTT), from the
// forward's inputs `a` (prepared as `in`) and its saved residuals (nullptr: recompute everything).
KdaGrads kda_chunked_backward(const kda::KdaProblem& p, const KdaForwardArgs& a, const KdaInputs& in, const std::vector<double>& d_o,
                              const std::vector<double>& d_final, const KdaSavedResiduals* saved, KdaBwdTrace* trace = nullptr);

}  // namespace encore::reference
