// Launch heuristic of the FP8 group-quantization kernel (the quant_plans sweep behind it: docs/quant.md).
#include "quant/problem.hpp"

namespace encore::quant {

Fp8QuantLaunchPlan plan_fp8_group_quant(const Fp8QuantProblem& p, int sm_count) {
  Fp8QuantLaunchPlan plan;
  // Column-major scales (consecutive rows adjacent): groups numbered by tiles of 16 rows, so a
  // block's scale stores fill whole sectors; row order otherwise (and below 16 rows).
  const bool column_major = p.scale_stride_m == 1 && p.scale_stride_g != 1;
  plan.tile_rows = column_major && p.rows >= 16 && fp8_numbered_groups(p.rows, p.cols, 16) < (int64_t(1) << 31) ? 16 : 1;
  const int64_t num_groups = fp8_numbered_groups(p.rows, p.cols, plan.tile_rows);
  // From a few waves up two 16-byte packs per lane (8 lanes per bf16 group, 16-byte stores) and one
  // group per lane group in 128-thread blocks: quant_plans sweep at 4096 x 7168 84.8% of copy vs
  // 83.7% with 256 threads and 82.3% for the best one-pack plan; 92.2% at 16384 x 7168
  // (bench/results/2026-11-29-h200-quant-quant_plans-tiles-0672911.json).
  const bool large = num_groups * fp8_lanes_per_group(p.dtype, 1) >= int64_t(sm_count) * 2048;
  plan.packs_per_lane = large && p.dtype != DType::kFP32 ? 2 : 1;
  plan.threads = large ? 128 : 256;
  plan.groups_per_thread = 1;
  plan.grid = fp8_full_grid(plan, p.dtype, num_groups);
  return plan;
}

}  // namespace encore::quant
