// Host entry of the CUDA QK-norm kernels (no CUDA types).
#pragma once
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "encore/norm.hpp"
#include "norm/qk_norm_problem.hpp"

namespace encore::cuda {

Status launch_qk_norm(const norm::QkNormProblem& p, const QkNormLaunchPlan& plan, Stream stream);

}  // namespace encore::cuda
