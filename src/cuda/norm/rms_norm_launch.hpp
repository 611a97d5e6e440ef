// Host entry of the CUDA RMSNorm kernels (no CUDA types: callable from plain C++ dispatch code).
#pragma once
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "encore/norm.hpp"
#include "norm/rms_norm_problem.hpp"

namespace encore::cuda {

Status launch_rms_norm(const norm::RmsNormProblem& p, const RmsNormLaunchPlan& plan, Stream stream);

}  // namespace encore::cuda
