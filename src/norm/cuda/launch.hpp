// Host entry of the norm family's CUDA kernels (no CUDA types: callable from plain C++ dispatch
// code). The dispatch has validated the problem and chosen the plan (norm/plan.cpp).
#pragma once
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "norm/problem.hpp"

namespace encore::cuda {

Status launch_rms_norm(const norm::RmsNormProblem& p, const norm::RmsNormLaunchPlan& plan, Stream stream);

// The kernel argument (RmsNormParams<T>, whose layout does not depend on T) of a JIT-compiled
// rms_norm_kernel, written to `out` (at least kRmsNormParamsMaxBytes bytes); returns its size.
constexpr size_t kRmsNormParamsMaxBytes = 128;
size_t rms_norm_kernel_params(const norm::RmsNormProblem& p, const norm::RmsNormLaunchPlan& plan, void* out);

// Split-row decode paths (rows <= kSplitRowMaxRows): barrier = one cooperative launch with a grid
// barrier between the phases, else two launches. The workspace is split_row_workspace_bytes.
Status launch_rms_norm_split(const norm::RmsNormProblem& p, bool barrier, void* workspace, Stream stream);
Status zero_split_barrier(void* workspace, int device_index, Stream stream);

Status launch_qk_norm(const norm::QkNormProblem& p, const norm::QkNormLaunchPlan& plan, Stream stream);
// The kernel argument (QkNormParams<T>, the same layout for bf16 and fp16) of a JIT-compiled
// qk_norm_kernel, written to `out` (at least kQkNormParamsMaxBytes bytes); returns its size.
constexpr size_t kQkNormParamsMaxBytes = 96;
size_t qk_norm_kernel_params(const norm::QkNormProblem& p, void* out);

}  // namespace encore::cuda
