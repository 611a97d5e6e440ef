// Internal: the CUDA chunked forward on a state pool (implemented in kda.cpp beside the forward's
// validation and launch parameters), for the serving dispatch's prefill on a pool (kda_serving.cpp,
// include/encore/kda_serving.hpp's KdaPoolForwardArgs).
#pragma once
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "encore/kda.hpp"
#include "kda/problem.hpp"

namespace encore::kda {

// run(args, opts, workspace, stream) on CUDA tensors with sequence n's initial state read from slot
// indices[n] of `pool` and its final state written back there, by the state kernel (kda_state.cu;
// the device index contract there). The caller has validated the call (p = make_problem(args, opts);
// args.initial_state, final_state and residuals absent; pool [P, HV, K, V] fp32 / bf16 with contiguous
// slots; indices [N] int32 / int64 in q's device memory). Here: the forward's CUDA checks, then the
// chunk and state kernels on the rule's launch plan. K, V <= 128 (the chunked path; Status::internal
// above: the caller takes the decode kernel there). workspace: workspace_bytes(args, opts) bytes.
Status run_cuda_on_pool(const KdaForwardArgs& args, const KdaOptions& opts, const KdaProblem& p, const TensorView& pool,
                        const TensorView& indices, void* workspace, Stream stream);

}  // namespace encore::kda
