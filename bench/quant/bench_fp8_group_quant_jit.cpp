// Suite "quant_jit": the JIT FP8 group quantization (K baked in, docs/jit.md) against the
// ahead-of-time kernel (K read at run time) on the same buffers, bf16, groups of 128: K = 5248
// (5120 + 128) and 3200 (outside the AOT list) and 7168 (inside it: JIT must be no slower), row- and
// column-major scales, M 1 .. 16384; L2-flushed like suite "quant". The JIT kernel is compiled first.
#include <cstdio>
#include <string>

#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"
#include "encore/quant.hpp"
#include "quant/jit.hpp"

namespace encore::bench {

void run_quant_jit_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  if (!jit::nvrtc_info().available) {
    std::printf("  quant_jit: NVRTC not available (%s): skipped\n", jit::nvrtc_info().library.c_str());
    return;
  }
  const Device dev{DeviceType::kCUDA, 0};
  for (int64_t K : {int64_t(5248), int64_t(3200), int64_t(7168)}) {
    const int64_t groups = K / 128;
    for (int64_t M : {int64_t(1), int64_t(128), int64_t(4096), int64_t(16384)}) {
      if (!size_selected(M)) continue;
      for (bool column_major : {false, true}) {
        const size_t x_bytes = size_t(M * K) * 2, q_bytes = size_t(M * K), s_bytes = size_t(M * groups) * 4;
        const size_t q_off = (x_bytes + 255) / 256 * 256, s_off = q_off + (q_bytes + 255) / 256 * 256;
        Rotation rot = make_rotation(s_off + s_bytes, info->l2_bytes, FillKind::kBF16);
        auto launch = [&](long long i) {
          char* base = rot.set(i);
          TensorView s = column_major ? TensorView::strided(base + s_off, DType::kFP32, {M, groups}, {1, M}, dev)
                                      : TensorView::contiguous(base + s_off, DType::kFP32, {M, groups}, dev);
          check_status(run(Fp8GroupQuantArgs{TensorView::contiguous(base, DType::kBF16, {M, K}, dev),
                                             TensorView::contiguous(base + q_off, DType::kFP8E4M3, {M, K}, dev), s},
                           Fp8GroupQuantOptions{}, nullptr, stream),
                       "quant_jit");
        };
        const double bytes = double(x_bytes + q_bytes + s_bytes);
        double us[2] = {0, 0};
        for (int jit_on = 0; jit_on < 2; ++jit_on) {
          quant::set_fp8_group_quant_jit_policy(jit_on ? quant::JitPolicy::kAlways : quant::JitPolicy::kOff);
          launch(0);  // compile / load outside the timing (and outside the harness's graph capture)
          check_cuda(cudaStreamSynchronize(stream), "warm-up");
          const Timing t = time_launches(launch, stream, topts, rot.sets);
          us[jit_on] = t.median_us;
          const double gbps = bytes / (t.median_us * 1e-6) / 1e9;
          Record r;
          r.suite = "quant_jit";
          r.name = jit_on ? "fp8_group_quant_jit" : "fp8_group_quant_aot";
          r.params = {{"dtype", "bf16"}, {"M", std::to_string(M)}, {"K", std::to_string(K)}, {"group", "128"},
                      {"scales", column_major ? "column-major" : "row-major"},
                      {"in_aot_list", quant::fp8_group_quant_cols_in_aot_list(K) ? "yes" : "no"}};
          r.metrics = {{"time_us", t.median_us}, {"min_us", t.min_us}, {"max_us", t.max_us}, {"bytes", bytes}, {"gbps", gbps},
                       {"frac_copy_bw", gbps / report.ceilings.copy_gbps}};
          if (jit_on) r.metrics.push_back({"speedup_vs_aot", us[0] / us[1]});
          report.records.push_back(r);
        }
        quant::set_fp8_group_quant_jit_policy(quant::JitPolicy::kEnv);
        free_rotation(rot);
        std::printf("  fp8_group_quant %5lld x %5lld %-12s: aot %9.2f us  jit %9.2f us  jit speedup %.2fx\n", (long long)M, (long long)K,
                    column_major ? "column-major" : "row-major", us[0], us[1], us[0] / us[1]);
        std::fflush(stdout);
      }
    }
  }
}

}  // namespace encore::bench
