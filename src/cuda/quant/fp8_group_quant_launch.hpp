// Host entry of the CUDA FP8 group-quantization kernels (no CUDA types).
#pragma once
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "quant/fp8_problem.hpp"

namespace encore::cuda {

// `threads` per block, `groups_per_thread` groups per lane group and chunk (1, 2, 4, 8), `grid`
// blocks striding over the chunks, `packs_per_lane` 16-byte packs of a group per lane (1 or 2; a
// group is 128 / (16 / sizeof(T) * packs_per_lane) lanes), `tile_rows` rows per tile of the group
// numbering (a power of two <= 64; 1 = row order; see fp8_group_quant_kernel.cuh).
struct Fp8QuantLaunchPlan {
  int threads = 256;
  int groups_per_thread = 1;
  long long grid = 0;
  int packs_per_lane = 1;
  int tile_rows = 1;
};

// Lanes per group for a plan's packs_per_lane.
inline int fp8_lanes_per_group(DType dtype, int packs_per_lane) { return 128 / (16 / int(dtype_size(dtype)) * packs_per_lane); }

// Groups the kernel numbers for a plan with `tile_rows` (rows padded to whole tiles): what `grid`
// covers.
int64_t fp8_numbered_groups(int64_t rows, int64_t cols, int tile_rows);

// Blocks that cover `numbered_groups` with one chunk per lane group (grid-stride loop not needed):
// ceil(numbered_groups / (threads / lanes per group * groups_per_thread)).
long long fp8_full_grid(const Fp8QuantLaunchPlan& plan, DType dtype, int64_t numbered_groups);

Fp8QuantLaunchPlan plan_fp8_group_quant(const quant::Fp8QuantProblem& p, int sm_count);
Status launch_fp8_group_quant(const quant::Fp8QuantProblem& p, const Fp8QuantLaunchPlan& plan, Stream stream);

}  // namespace encore::cuda
