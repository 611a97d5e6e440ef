// Host entry of the CUDA FP8 group-quantization kernels (no CUDA types).
#pragma once
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "quant/problem.hpp"

namespace encore::cuda {

Status launch_fp8_group_quant(const quant::Fp8QuantProblem& p, const quant::Fp8QuantLaunchPlan& plan, Stream stream);

}  // namespace encore::cuda
