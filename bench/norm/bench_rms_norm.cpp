// Suite "norm": RMSNorm and add-RMSNorm (bf16) at rows 1, 64, 8192, 65536 x hidden 4096, 8192,
// reported as GB/s (bytes that must move: inputs read once, outputs written once, weight once)
// and as a fraction of the copy bandwidth measured in the same run. Inputs rotate through an arena
// of >= 3x L2, so every number is L2-flushed.
#include <cstdio>
#include <string>

#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"
#include "encore/norm.hpp"
#include "norm/testing.hpp"

namespace encore::bench {

void run_norm_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  const Device dev{DeviceType::kCUDA, 0};
  const int64_t rows_list[] = {1, 64, 8192, 65536};
  const int64_t hidden_list[] = {4096, 8192};
  void* weight = nullptr;
  check_cuda(cudaMalloc(&weight, 8192 * 2), "cudaMalloc (weight)");
  fill_random(weight, 8192, FillKind::kBF16, 7, stream);

  for (bool add : {false, true}) {
    for (int64_t hidden : hidden_list) {
      for (int64_t rows : rows_list) {
        const size_t tensor_bytes = size_t(rows * hidden) * 2;
        const int tensors = add ? 4 : 2;  // x, y (+ residual, h)
        const size_t slot = (tensor_bytes + 255) / 256 * 256;
        Rotation rot = make_rotation(slot * tensors, info->l2_bytes, FillKind::kBF16);
        auto view = [&](long long i, int k) {
          return TensorView::contiguous(rot.set(i) + k * slot, DType::kBF16, {rows, hidden}, dev);
        };
        const TensorView w = TensorView::contiguous(weight, DType::kBF16, {hidden}, dev);
        const RmsNormOptions opts{1e-6f, 0.f};
        auto launch = [&](long long i) {
          Status st = add ? run(AddRmsNormArgs{view(i, 0), view(i, 1), w, view(i, 2), view(i, 3)}, opts, nullptr, stream)
                          : run(RmsNormArgs{view(i, 0), w, view(i, 1)}, opts, nullptr, stream);
          check_status(st, "norm");
        };
        Timing t = time_launches(launch, stream, topts, rot.sets);
        free_rotation(rot);

        const double bytes = double(tensor_bytes) * tensors + double(hidden) * 2;
        const double gbps = bytes / (t.median_us * 1e-6) / 1e9;
        norm::RmsNormLaunchPlan plan = norm::plan_rms_norm(rows, hidden, DType::kBF16, true, add, info->sm_count);
        Record r;
        r.suite = "norm";
        r.name = add ? "add_rms_norm" : "rms_norm";
        r.params = {{"dtype", "bf16"},
                    {"rows", std::to_string(rows)},
                    {"hidden", std::to_string(hidden)},
                    {"plan", "wpr" + std::to_string(plan.warps_per_row) + "_rpb" + std::to_string(plan.rows_per_block) +
                                 "_cache" + std::to_string(plan.vecs_per_thread)}};
        r.metrics = {{"time_us", t.median_us},
                     {"min_us", t.min_us},
                     {"max_us", t.max_us},
                     {"bytes", bytes},
                     {"gbps", gbps},
                     {"frac_copy_bw", gbps / report.ceilings.copy_gbps},
                     {"batch", double(t.batch)},
                     {"rotation_sets", double(rot.sets)}};
        report.records.push_back(r);
        std::printf("  %-13s rows %6lld hidden %5lld: %9.2f us  %7.0f GB/s  %5.1f%% of copy\n", r.name.c_str(),
                    (long long)rows, (long long)hidden, t.median_us, gbps, 100.0 * gbps / report.ceilings.copy_gbps);
        std::fflush(stdout);
      }
    }
  }
  cudaFree(weight);
}

}  // namespace encore::bench
