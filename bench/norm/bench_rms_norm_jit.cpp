// Suite "norm_jit": the JIT RMSNorm (hidden size baked in, docs/jit.md) against the ahead-of-time
// kernels (run-time hidden size) on the same shapes, bf16, plain and add: hidden 5184 (5120 + 64)
// and 3000 (outside the AOT list; the issue's >= 1.3x target) and 4096 (inside it: JIT must be no
// slower). L2-flushed like suite "norm"; the JIT kernel is compiled before timing.
#include <cstdio>
#include <string>

#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"
#include "encore/norm.hpp"
#include "norm/jit.hpp"

namespace encore::bench {

void run_norm_jit_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  if (!jit::nvrtc_info().available) {
    std::printf("  norm_jit: NVRTC not available (%s): skipped\n", jit::nvrtc_info().library.c_str());
    return;
  }
  const Device dev{DeviceType::kCUDA, 0};
  const int64_t rows_list[] = {1, 64, 8192, 65536};
  const int64_t hidden_list[] = {5184, 3000, 4096};
  void* weight = nullptr;
  check_cuda(cudaMalloc(&weight, 8192 * 2), "cudaMalloc (weight)");
  fill_random(weight, 8192, FillKind::kBF16, 7, stream);
  for (bool add : {false, true}) {
    for (int64_t hidden : hidden_list) {
      for (int64_t rows : rows_list) {
        const size_t tensor_bytes = size_t(rows * hidden) * 2;
        const int tensors = add ? 4 : 2;
        const size_t slot = (tensor_bytes + 255) / 256 * 256;
        Rotation rot = make_rotation(slot * tensors, info->l2_bytes, FillKind::kBF16);
        auto view = [&](long long i, int k) { return TensorView::contiguous(rot.set(i) + k * slot, DType::kBF16, {rows, hidden}, dev); };
        const TensorView w = TensorView::contiguous(weight, DType::kBF16, {hidden}, dev);
        const RmsNormOptions opts{1e-6f, 0.f};
        auto launch = [&](long long i) {
          Status st = add ? run(AddRmsNormArgs{view(i, 0), view(i, 1), w, view(i, 2), view(i, 3)}, opts, nullptr, stream)
                          : run(RmsNormArgs{view(i, 0), w, view(i, 1)}, opts, nullptr, stream);
          check_status(st, "norm_jit");
        };
        double us[2] = {0, 0};
        for (int jit_on = 0; jit_on < 2; ++jit_on) {
          norm::set_rms_norm_jit_policy(jit_on ? norm::JitPolicy::kAlways : norm::JitPolicy::kOff);
          launch(0);  // compile / load outside the timing (and outside the harness's graph capture)
          check_cuda(cudaStreamSynchronize(stream), "warm-up");
          Timing t = time_launches(launch, stream, topts, rot.sets);
          us[jit_on] = t.median_us;
          const double bytes = double(tensor_bytes) * tensors + double(hidden) * 2;
          const double gbps = bytes / (t.median_us * 1e-6) / 1e9;
          Record r;
          r.suite = "norm_jit";
          r.name = std::string(add ? "add_rms_norm" : "rms_norm") + (jit_on ? "_jit" : "_aot");
          r.params = {{"dtype", "bf16"}, {"rows", std::to_string(rows)}, {"hidden", std::to_string(hidden)}};
          r.metrics = {{"time_us", t.median_us}, {"min_us", t.min_us}, {"max_us", t.max_us}, {"gbps", gbps},
                       {"frac_copy_bw", gbps / report.ceilings.copy_gbps}};
          if (jit_on) r.metrics.push_back({"speedup_vs_aot", us[0] / us[1]});
          report.records.push_back(r);
        }
        norm::set_rms_norm_jit_policy(norm::JitPolicy::kEnv);
        free_rotation(rot);
        std::printf("  %-13s rows %6lld hidden %5lld: aot %9.2f us  jit %9.2f us  jit speedup %.2fx\n", add ? "add_rms_norm" : "rms_norm",
                    (long long)rows, (long long)hidden, us[0], us[1], us[0] / us[1]);
        std::fflush(stdout);
      }
    }
  }
  cudaFree(weight);
}

}  // namespace encore::bench
