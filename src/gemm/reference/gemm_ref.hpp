// CPU reference of the GEMM-epilogue programs: a fp64 GEMM row followed by the epilogue, written
// as the five primitives (elementwise/pairwise transform, row-vector load, tile load/store, block
// reduction along N, stateful online log-sum-exp) applied to one accumulator row at a time.
#pragma once
#include "encore/gemm.hpp"

namespace encore::reference {

// Args are validated; every tensor is a CPU tensor.
void gemm_epilogue(const GemmEpilogueArgs& a, const GemmEpilogueOptions& o);
void rms_final_reduce(const RmsFinalReduceArgs& a, int64_t hidden, float eps);
void lse_finish(const LseFinishArgs& a, int ignore_index);
void partials_sum(const PartialsSumArgs& a, PartialsSum axis, float scale);
void qk_norm_rope(const QkNormRopeArgs& a, const QkNormRopeOptions& o);
void qk_norm_rope_bwd(const QkNormRopeBwdArgs& a, const QkNormRopeOptions& o);
void cross_entropy_bwd(const CrossEntropyBwdArgs& a, int ignore_index);
void ce_mean(const CeMeanArgs& a, int ignore_index);
void rope_bwd_zdz(const RopeBwdZdzArgs& a, float scale);

}  // namespace encore::reference
