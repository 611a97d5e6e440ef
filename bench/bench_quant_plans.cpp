// Suite "quant_plans": the FP8 group-quantization kernels (bf16, K = 7168, row-major scales) under a
// sweep of launch plans, L2-flushed, the plan the host heuristic picks marked: threads per block x
// groups per lane group.
// The measurement behind plan_fp8_group_quant (docs/inference.md).
#include <cstdio>
#include <algorithm>
#include <string>
#include <vector>

#include "bench/suites_internal.hpp"
#include "cuda/quant/fp8_group_quant_launch.hpp"
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
    const cuda::Fp8QuantLaunchPlan chosen = cuda::plan_fp8_group_quant(M * groups, DType::kBF16, info->sm_count);
    std::vector<cuda::Fp8QuantLaunchPlan> plans;
    for (int threads : {128, 256})
      for (int gpt : {1, 2, 4}) {
        cuda::Fp8QuantLaunchPlan plan;
        plan.threads = threads;
        plan.groups_per_thread = gpt;
        const int64_t per_block = int64_t(threads / 16) * gpt;
        plan.grid = (M * groups + per_block - 1) / per_block;
        plans.push_back(plan);
      }
    for (const cuda::Fp8QuantLaunchPlan& plan : plans) {
      Timing t = time_launches([&](long long i) {
        char* base = rot.set(i);
        quant::Fp8QuantProblem p;
        p.x = base;
        p.x_stride = K;
        p.q = reinterpret_cast<uint8_t*>(base + q_off);
        p.q_stride = K;
        p.scales = reinterpret_cast<float*>(base + s_off);
        p.scale_stride_m = groups;
        p.scale_stride_g = 1;
        p.rows = M;
        p.cols = K;
        p.dtype = DType::kBF16;
        Status st = cuda::launch_fp8_group_quant(p, plan, stream);
        check_status(st, "quant_plans");
      }, stream, topts, rot.sets);
      const double bytes = double(x_bytes + q_bytes + s_bytes), gbps = bytes / (t.median_us * 1e-6) / 1e9;
      const bool is_chosen =
          plan.threads == chosen.threads && plan.groups_per_thread == chosen.groups_per_thread && plan.grid == chosen.grid;
      Record r;
      r.suite = "quant_plans";
      r.name = "fp8_group_quant";
      r.params = {{"M", std::to_string(M)},
                  {"K", std::to_string(K)},
                  {"threads", std::to_string(plan.threads)},
                  {"groups_per_thread", std::to_string(plan.groups_per_thread)},
                  {"grid", std::to_string(plan.grid)},
                  {"chosen", is_chosen ? "1" : "0"}};
      r.metrics = {{"time_us", t.median_us}, {"gbps", gbps}, {"frac_copy_bw", gbps / report.ceilings.copy_gbps}};
      report.records.push_back(r);
      std::printf("  fp8 %5lld x %lld threads %3d groups %d (grid %6lld)%s: %8.2f us %5.1f%% of copy\n", (long long)M, (long long)K,
                  plan.threads, plan.groups_per_thread, plan.grid, is_chosen ? " *" : "  ", t.median_us,
                  100.0 * gbps / report.ceilings.copy_gbps);
      std::fflush(stdout);
    }
    free_rotation(rot);
  }
}

}  // namespace encore::bench
