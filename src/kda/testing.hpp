// Internal entry points of the KDA family for tests and benchmarks (never in include/, never from the
// kernels): the forward on an explicit launch plan, and the chunk kernel's raw-input report and phase
// profile (declared with the launchers in kda/cuda/launch.hpp, implemented by kda/cuda/kda_chunk.cu).
#pragma once
#include "encore/core/status.hpp"
#include "encore/kda.hpp"
#include "encore/kda_serving.hpp"
#include "kda/cuda/kda_bwd2.hpp"
#include "kda/cuda/launch.hpp"
#include "kda/plan.hpp"

namespace encore::kda {

// run(args, opts, workspace, stream) with `plan` in place of the rule's (kda_plan): its 0 fields take
// the rule's choice, the others are checked (Status::invalid naming the field, e.g. state_columns 48).
// The plan applies to the chunked CUDA path; the token-recurrent path (K or V > 128) and the CPU
// reference ignore it once checked.
Status run(const KdaForwardArgs& args, const KdaOptions& opts, const KdaLaunchPlan& plan, void* workspace = nullptr,
           Stream stream = nullptr);

// The recurrent step (include/encore/kda_serving.hpp's run) on `plan` in place of the rule's
// (kda_decode_plan; its kernel applies to fast single-token launches only, pdl to every launch).
Status run(const KdaRecurrentArgs& args, const KdaRecurrentOptions& opts, const cuda::KdaDecodePlan& plan, Stream stream = nullptr);

// The second backward (K0 prep, K1 scan, K2a, K2b; kda/cuda/kda_bwd2.hpp) on a validated backward
// problem with the forward's residuals G, Aqk, Akk, h (CUDA, K, V <= 128), for any input dtype (run
// takes it for bf16 / fp16 only): the workspace size, and the run, whose intermediates sit in
// `workspace` at `layout`'s offsets for the stage tests to read (dh0 into args.dh0).
Status bwd2_stages_workspace(const KdaBackwardArgs& args, const KdaOptions& opts, size_t* bytes);
Status bwd2_stages(const KdaBackwardArgs& args, const KdaOptions& opts, void* workspace, Stream stream, cuda::Kda2Layout* layout);

}  // namespace encore::kda

namespace encore::cuda {

// The chunk kernel's profile phases (kda_chunk_profile_read's counters), in the order 0, 7, 1, ..., 6
// they run: 0: the wait for the item's raw input tiles, 7: q, v and their sums of squares, the wait
// for the previous item's W and U stores to leave shared memory and the barrier, 1: k, the gate and
// k's sums of squares, 2: gate scan + L2-norm factors, 3: intra-chunk operands, 4: Aqk and L and the
// diagonal blocks of the inverse, 5: write-out beside the inverse's blocks below the diagonal, 6: W and U.
// Short names for the bench output.
constexpr int kKdaChunkPhaseOrder[kKdaChunkPhases] = {0, 7, 1, 2, 3, 4, 5, 6};
constexpr const char* kKdaChunkPhaseNames[kKdaChunkPhases] = {"raw-wait", "k+gate", "scan+norm", "operands", "Aqk/L+diag-inv",
                                                               "write-out+inverse", "W/U", "q+v+store-wait"};

}  // namespace encore::cuda
