// Host entry of the CUDA FP8 group-quantization kernels (no CUDA types).
#pragma once
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "quant/fp8_problem.hpp"

namespace encore::cuda {

// Register kernel (bulk = false): `threads` per block, `groups_per_thread` groups per lane group,
// `grid` blocks. Bulk kernel (bulk = true, fp8_group_quant_bulk_kernel.cuh): 256 threads,
// `groups_per_thread` in {1, 2, 4} groups per lane group and stage, `slots` stages in flight per
// block, `grid` persistent blocks (at most the resident ones).
struct Fp8QuantLaunchPlan {
  bool bulk = false;
  int threads = 256;
  int groups_per_thread = 1;
  int slots = 0;
  long long grid = 0;
};

// The most blocks of the bulk kernel one SM holds with `slots` stages (0 when the plan cannot run).
int fp8_bulk_blocks_per_sm(DType dtype, int groups_per_thread, int slots);

Fp8QuantLaunchPlan plan_fp8_group_quant(int64_t num_groups, DType dtype, int sm_count);
Status launch_fp8_group_quant(const quant::Fp8QuantProblem& p, const Fp8QuantLaunchPlan& plan, Stream stream);

}  // namespace encore::cuda
