// Suite "quant_jit": the JIT quantization kernels (docs/jit.md) against the ahead-of-time ones on the
// same buffers, bf16: FP8 group quant (K baked in; row- and column-major scales) and MXFP8 / NVFP4
// (K / 8 baked in; row-major scales, NVFP4 with its computed global scale). K = 5248 (5120 + 128) and
// 3200 (outside the AOT list) and 7168 (inside it: JIT must be no slower); L2-flushed like suite
// "quant". Bytes = x read once, q and the scales written once. The JIT kernels are compiled first.
#include <cstdio>
#include <functional>
#include <string>

#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"
#include "encore/quant.hpp"
#include "quant/jit.hpp"

namespace encore::bench {
namespace {

// AOT then JIT (set_policy(off / always)), one record each (the JIT one with speedup_vs_aot).
void time_jit_vs_aot(Report& report, const TimeOptions& topts, cudaStream_t stream, const Rotation& rot,
                     const std::function<void(quant::JitPolicy)>& set_policy, const std::function<void(long long)>& launch,
                     const std::string& name, const std::vector<std::pair<std::string, std::string>>& params, double bytes) {
  double us[2] = {0, 0};
  for (int jit_on = 0; jit_on < 2; ++jit_on) {
    set_policy(jit_on ? quant::JitPolicy::kAlways : quant::JitPolicy::kOff);
    launch(0);  // compile / load outside the timing (and outside the harness's graph capture)
    check_cuda(cudaStreamSynchronize(stream), "warm-up");
    const Timing t = time_launches(launch, stream, topts, rot.sets);
    us[jit_on] = t.median_us;
    const double gbps = bytes / (t.median_us * 1e-6) / 1e9;
    Record r;
    r.suite = "quant_jit";
    r.name = name + (jit_on ? "_jit" : "_aot");
    r.params = params;
    r.metrics = {{"time_us", t.median_us}, {"min_us", t.min_us}, {"max_us", t.max_us}, {"bytes", bytes}, {"gbps", gbps},
                 {"frac_copy_bw", gbps / report.ceilings.copy_gbps}};
    if (jit_on) r.metrics.push_back({"speedup_vs_aot", us[0] / us[1]});
    report.records.push_back(r);
  }
  set_policy(quant::JitPolicy::kEnv);
  std::string where;
  for (const auto& [k, v] : params) where += " " + k + "=" + v;
  std::printf("  %-16s%s: aot %9.2f us  jit %9.2f us  jit speedup %.2fx\n", name.c_str(), where.c_str(), us[0], us[1], us[0] / us[1]);
  std::fflush(stdout);
}

size_t round256(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

void run_quant_jit_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  if (!jit::nvrtc_info().available) {
    std::printf("  quant_jit: NVRTC not available (%s): skipped\n", jit::nvrtc_info().library.c_str());
    return;
  }
  const Device dev{DeviceType::kCUDA, 0};
  for (int64_t K : {int64_t(5248), int64_t(3200), int64_t(7168)}) {
    const std::string in_list = quant::fp8_group_quant_cols_in_aot_list(K) ? "yes" : "no";
    for (int64_t M : {int64_t(1), int64_t(128), int64_t(4096), int64_t(16384)}) {
      if (!size_selected(M)) continue;
      const size_t x_bytes = size_t(M * K) * 2;
      // FP8 group quant: q [M, K] e4m3, fp32 scales [M, K / 128].
      for (bool column_major : {false, true}) {
        const int64_t groups = K / 128;
        const size_t q_off = round256(x_bytes), s_off = q_off + round256(size_t(M * K)), s_bytes = size_t(M * groups) * 4;
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
        time_jit_vs_aot(report, topts, stream, rot, quant::set_fp8_group_quant_jit_policy, launch, "fp8_group_quant",
                        {{"dtype", "bf16"}, {"M", std::to_string(M)}, {"K", std::to_string(K)}, {"group", "128"},
                         {"scales", column_major ? "column-major" : "row-major"}, {"in_aot_list", in_list}},
                        double(x_bytes + size_t(M * K) + s_bytes));
        free_rotation(rot);
      }
      // MXFP8: q [M, K] e4m3, e8m0 scales [M, K / 32]; NVFP4: q [M, K / 2], e4m3 scales [M, K / 16], a global.
      for (bool nvfp4 : {false, true}) {
        const int64_t qcols = nvfp4 ? K / 2 : K, sc = K / (nvfp4 ? 16 : 32);
        const size_t q_off = round256(x_bytes), s_off = q_off + round256(size_t(M * qcols)), g_off = s_off + round256(size_t(M * sc));
        Rotation rot = make_rotation(g_off + 4, info->l2_bytes, FillKind::kBF16);
        auto launch = [&](long long i) {
          char* base = rot.set(i);
          const TensorView x = TensorView::contiguous(base, DType::kBF16, {M, K}, dev);
          const TensorView s = TensorView::contiguous(base + s_off, nvfp4 ? DType::kFP8E4M3 : DType::kUInt8, {M, sc}, dev);
          const Status st = nvfp4 ? run(Nvfp4QuantArgs{x, TensorView::contiguous(base + q_off, DType::kUInt8, {M, qcols}, dev), s,
                                                       TensorView::contiguous(base + g_off, DType::kFP32, {1}, dev)},
                                        MxQuantOptions{}, nullptr, stream)
                                  : run(Mxfp8QuantArgs{x, TensorView::contiguous(base + q_off, DType::kFP8E4M3, {M, qcols}, dev), s},
                                        MxQuantOptions{}, nullptr, stream);
          check_status(st, "quant_jit");
        };
        time_jit_vs_aot(report, topts, stream, rot, quant::set_mx_quant_jit_policy, launch, nvfp4 ? "nvfp4_quant" : "mxfp8_quant",
                        {{"dtype", "bf16"}, {"M", std::to_string(M)}, {"K", std::to_string(K)}, {"scales", "row-major"},
                         {"in_aot_list", in_list}},
                        double(x_bytes + size_t(M * qcols) + size_t(M * sc)));
        free_rotation(rot);
      }
    }
  }
}

}  // namespace encore::bench
