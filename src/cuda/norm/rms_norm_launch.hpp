// Host entry of the CUDA RMSNorm kernels (no CUDA types: callable from plain C++ dispatch code).
#pragma once
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "encore/norm.hpp"
#include "norm/rms_norm_problem.hpp"

namespace encore::cuda {

Status launch_rms_norm(const norm::RmsNormProblem& p, const RmsNormLaunchPlan& plan, Stream stream);

// Split-row paths (src/cuda/norm/rms_norm_split.cu); workspace layout in norm/rms_norm_problem.hpp.
Status launch_rms_norm_split(const norm::RmsNormProblem& p, bool barrier, void* workspace, Stream stream);
Status zero_split_barrier(void* workspace, int device_index, Stream stream);

}  // namespace encore::cuda
