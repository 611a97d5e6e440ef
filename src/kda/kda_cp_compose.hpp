// Internal: KDA context-parallel summaries composed from the public forward and backward on the
// piece's tokens (the CUDA path of encore/kda_cp.hpp, no summary kernel). For each value head, with the
// piece's q, k, g, beta and gate options:
//   S_ext  = final state of the forward with v, from h0 = 0
//   M      = final state of the forward with v = 0 ([.., HV, K]: "V = K"), from h0 = I  (S_end = M·I + 0)
//   dS_ext = dh0 of the backward of the first forward (d_o of the piece, d_final_state = 0)
//   dM     = Mᵀ
// On CPU tensors with a host workspace the same composition runs on the CPU backend (fp64 scratch):
// the test of the identities (tests/kda/test_kda_cp_cpu.cpp).
#pragma once
#include <cstddef>

#include "encore/kda_cp.hpp"
#include "kda/problem.hpp"

namespace encore::kda {

// Validates a summary's arguments (kda_cp.hpp) and fills the rank's local problem.
Status cp_summary_problem(const KdaCpSummaryArgs& a, const KdaOptions& o, bool backward, KdaProblem* p);

// The composition's workspace (on q's device; 0 for arguments that do not validate) and the run.
size_t cp_compose_workspace_bytes(const KdaCpSummaryArgs& a, const KdaOptions& o, bool backward);
Status cp_compose_summary(const KdaCpSummaryArgs& a, const KdaOptions& o, bool backward, void* workspace, Stream stream);

}  // namespace encore::kda
