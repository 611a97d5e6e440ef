// Host entry of the moe family's CUDA kernels (no CUDA types: callable from plain C++ dispatch code).
// The dispatch files have validated the problem (routing.cpp, dispatch.cpp, combine.cpp); the launches
// never allocate or synchronize. Ids / slot rows are not scanned on the host for CUDA tensors: the
// kernels skip out-of-range entries instead of reading or writing out of bounds (docs/moe.md).
#pragma once
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "moe/problem.hpp"

namespace encore::cuda {

// One warp per token, E <= moe::kCudaRoutingMaxExperts.
Status launch_moe_routing(const moe::RoutingProblem& p, int device_index, Stream stream);

// p.cursors: a workspace of plan.workspace_bytes (16-byte aligned). plan from moe::plan_moe_dispatch.
Status launch_moe_dispatch(const moe::DispatchProblem& p, const moe::DispatchPlan& plan, int device_index, Stream stream);

// One block per token; eo_rows = expert_out's rows (slot rows outside [0, eo_rows) are skipped).
Status launch_moe_combine(const moe::CombineProblem& p, int64_t eo_rows, int device_index, Stream stream);

// moe_forward's expert compute: the grouped gate/up GEMM, the SwiGLU and the grouped down GEMM
// (grouped_gemm.cu). bf16 only; D and F multiples of 8; rows, strides and pointers 16-byte aligned.
Status launch_moe_expert_gemms(const moe::ExpertGemmProblem& p, int device_index, Stream stream);

}  // namespace encore::cuda
