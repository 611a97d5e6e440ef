// Suite "norm_plans": the RMSNorm / add-RMSNorm kernels (bf16) under every launch plan that fits
// (warps per row x rows per block, with the register cache the row needs), at prefill and decode
// sizes, beside the plan the host heuristic picks. This is the measurement behind plan_rms_norm.
#include <cstdio>
#include <string>

#include "bench/suites_internal.hpp"
#include "norm/testing.hpp"
#include "encore/core/device_info.hpp"
#include "encore/norm.hpp"

namespace encore::bench {

void run_norm_plans_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  const int64_t shapes[][2] = {{65536, 4096}, {8192, 4096}, {65536, 8192}, {64, 4096}, {1, 4096}, {65536, 5184}, {8192, 5184},
                               {16384, 7168}, {16384, 6144}, {16384, 5120}, {16384, 3000}};
  void* weight = nullptr;
  check_cuda(cudaMalloc(&weight, 8192 * 2), "cudaMalloc (weight)");
  fill_random(weight, 8192, FillKind::kBF16, 7, stream);

  for (bool add : {false, true}) {
    for (const auto& shape : shapes) {
      const int64_t rows = shape[0], hidden = shape[1];
      const size_t slot = (size_t(rows * hidden) * 2 + 255) / 256 * 256;
      const int tensors = add ? 4 : 2;
      Rotation rot = make_rotation(slot * tensors, info->l2_bytes, FillKind::kBF16);
      const norm::RmsNormLaunchPlan chosen = norm::plan_rms_norm(rows, hidden, DType::kBF16, true, add, info->sm_count);
      const int64_t packs = hidden / 8;
      for (int wpr = 1; wpr <= 16; wpr *= 2) {
        for (int rpb = 1; rpb * wpr <= 16; rpb *= 2) {
          int cached = 1;
          while (cached * 32 * wpr < packs) cached *= 2;
          if (cached > 8) continue;
          norm::RmsNormLaunchPlan plan{8, wpr, rpb, cached, (rows + rpb - 1) / rpb};
          auto launch = [&](long long i) {
            norm::RmsNormProblem p;
            char* base = rot.set(i);
            p.x = base;
            p.x_stride = p.y_stride = p.residual_stride = p.h_stride = hidden;
            p.y = base + slot;
            if (add) {
              p.residual = base + 2 * slot;
              p.h = base + 3 * slot;
            }
            p.weight = weight;
            p.rows = rows;
            p.hidden = hidden;
            p.dtype = DType::kBF16;
            Status st = cuda::launch_rms_norm(p, plan, stream);
            check_status(st, "norm_plans");
          };
          Timing t = time_launches(launch, stream, topts, rot.sets);
          const double bytes = double(slot) * tensors + double(hidden) * 2;
          const double gbps = bytes / (t.median_us * 1e-6) / 1e9;
          const bool is_chosen = chosen.warps_per_row == wpr && chosen.rows_per_block == rpb && chosen.vecs_per_thread == cached;
          Record r;
          r.suite = "norm_plans";
          r.name = add ? "add_rms_norm" : "rms_norm";
          r.params = {{"rows", std::to_string(rows)}, {"hidden", std::to_string(hidden)},
                      {"plan", "wpr" + std::to_string(wpr) + "_rpb" + std::to_string(rpb) + "_cache" + std::to_string(cached)},
                      {"chosen", is_chosen ? "yes" : "no"}};
          r.metrics = {{"time_us", t.median_us}, {"gbps", gbps}, {"frac_copy_bw", gbps / report.ceilings.copy_gbps}};
          report.records.push_back(r);
          std::printf("  %-13s %6lld x %5lld  wpr %2d rpb %2d cache %d: %9.2f us %6.0f GB/s %5.1f%%%s\n", r.name.c_str(),
                      (long long)rows, (long long)hidden, wpr, rpb, cached, t.median_us, gbps,
                      100.0 * gbps / report.ceilings.copy_gbps, is_chosen ? "  <- chosen" : "");
          std::fflush(stdout);
        }
      }
      free_rotation(rot);
    }
  }
  cudaFree(weight);
}

}  // namespace encore::bench
