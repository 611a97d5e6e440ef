// Host entry of the CUDA FP8 group-quantization kernels (no CUDA types).
#pragma once
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "quant/fp8_problem.hpp"

namespace encore::cuda {

// `threads` per block, `groups_per_thread` groups per lane group and chunk (1, 2, 4, 8), `grid`
// blocks striding over the chunks.
struct Fp8QuantLaunchPlan {
  int threads = 256;
  int groups_per_thread = 1;
  long long grid = 0;
};

Fp8QuantLaunchPlan plan_fp8_group_quant(int64_t num_groups, DType dtype, int sm_count);
Status launch_fp8_group_quant(const quant::Fp8QuantProblem& p, const Fp8QuantLaunchPlan& plan, Stream stream);

}  // namespace encore::cuda
