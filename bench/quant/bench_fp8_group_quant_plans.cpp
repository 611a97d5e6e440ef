// Suite "quant_plans": the FP8 group-quantization kernels (bf16, K = 7168) under a sweep of launch
// plans, L2-flushed, the plan the host heuristic picks marked: row-major scales with threads per
// block x groups per lane group x packs per lane; column-major scales with the host plan's shape
// and the row tiles of the group numbering (1, 4, 16, 32).
// The measurement behind plan_fp8_group_quant (docs/quant.md).
#include <cstdio>
#include <algorithm>
#include <string>
#include <vector>

#include "bench/suites_internal.hpp"
#include "quant/testing.hpp"
#include "encore/core/device_info.hpp"

namespace encore::bench {

void run_quant_plans_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  const int64_t K = 7168, groups = K / 128;
  for (int64_t M : {int64_t(4096), int64_t(16384)}) {
    const size_t x_bytes = size_t(M * K) * 2, q_bytes = size_t(M * K), s_bytes = size_t(M * groups) * 4;
    const size_t q_off = (x_bytes + 255) / 256 * 256, s_off = q_off + (q_bytes + 255) / 256 * 256;
    Rotation rot = make_rotation(s_off + s_bytes, info->l2_bytes, FillKind::kBF16);
    // The problem at rotation set i, scales row- or column-major.
    auto problem = [&](long long i, bool column_major) {
      char* base = rot.set(i);
      quant::Fp8QuantProblem p;
      p.x = base;
      p.x_stride = K;
      p.q = reinterpret_cast<uint8_t*>(base + q_off);
      p.q_stride = K;
      p.scales = reinterpret_cast<float*>(base + s_off);
      p.scale_stride_m = column_major ? 1 : groups;
      p.scale_stride_g = column_major ? M : 1;
      p.rows = M;
      p.cols = K;
      p.dtype = DType::kBF16;
      return p;
    };
    std::vector<std::pair<bool, quant::Fp8QuantLaunchPlan>> plans;  // (column-major scales, plan)
    for (int packs : {1, 2})
      for (int threads : {128, 256})
        for (int gpt : {1, 2, 4}) {
          quant::Fp8QuantLaunchPlan plan;
          plan.threads = threads;
          plan.groups_per_thread = gpt;
          plan.packs_per_lane = packs;
          plan.grid = quant::fp8_full_grid(plan, DType::kBF16, M * groups);
          plans.push_back({false, plan});
        }
    for (int tile_rows : {1, 4, 16, 32}) {
      quant::Fp8QuantLaunchPlan plan = quant::plan_fp8_group_quant(problem(0, true), info->sm_count);
      plan.tile_rows = tile_rows;
      plan.grid = quant::fp8_full_grid(plan, DType::kBF16, quant::fp8_numbered_groups(M, K, tile_rows));
      plans.push_back({true, plan});
    }
    for (const auto& [column_major, plan] : plans) {
      const quant::Fp8QuantLaunchPlan chosen = quant::plan_fp8_group_quant(problem(0, column_major), info->sm_count);
      Timing t = time_launches([&](long long i) {
        Status st = cuda::launch_fp8_group_quant(problem(i, column_major), plan, stream);
        check_status(st, "quant_plans");
      }, stream, topts, rot.sets);
      const double bytes = double(x_bytes + q_bytes + s_bytes), gbps = bytes / (t.median_us * 1e-6) / 1e9;
      const bool is_chosen = plan.threads == chosen.threads && plan.packs_per_lane == chosen.packs_per_lane &&
                             plan.groups_per_thread == chosen.groups_per_thread && plan.grid == chosen.grid &&
                             plan.tile_rows == chosen.tile_rows;
      Record r;
      r.suite = "quant_plans";
      r.name = "fp8_group_quant";
      r.params = {{"M", std::to_string(M)},
                  {"K", std::to_string(K)},
                  {"threads", std::to_string(plan.threads)},
                  {"groups_per_thread", std::to_string(plan.groups_per_thread)},
                  {"packs_per_lane", std::to_string(plan.packs_per_lane)},
                  {"scales", column_major ? "column-major" : "row-major"},
                  {"tile_rows", std::to_string(plan.tile_rows)},
                  {"grid", std::to_string(plan.grid)},
                  {"chosen", is_chosen ? "1" : "0"}};
      r.metrics = {{"time_us", t.median_us}, {"gbps", gbps}, {"frac_copy_bw", gbps / report.ceilings.copy_gbps}};
      report.records.push_back(r);
      std::printf("  fp8 %5lld x %lld %s threads %3d groups %d packs %d tile rows %2d (grid %6lld)%s: %8.2f us %5.1f%% of copy\n",
                  (long long)M, (long long)K, column_major ? "col-major" : "row-major", plan.threads, plan.groups_per_thread,
                  plan.packs_per_lane, plan.tile_rows, plan.grid, is_chosen ? " *" : "  ",
                  t.median_us, 100.0 * gbps / report.ceilings.copy_gbps);
      std::fflush(stdout);
    }
    free_rotation(rot);
  }
}

}  // namespace encore::bench
