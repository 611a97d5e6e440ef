// Suite "qk_norm_jit": the JIT QK-norm (head layout baked in, docs/jit.md) against the ahead-of-time
// kernel (layout read at run time) on the same buffers, bf16, head_dim 128: 24 q + 4 kv and 48 q + 8
// kv (outside the AOT list) and 32 q + 8 kv (inside it: JIT must be no slower), tokens 1 .. 65536;
// L2-flushed. Bytes = Q and K heads read and written once. The JIT kernel is compiled before timing.
#include <cstdio>
#include <string>

#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"
#include "encore/norm.hpp"
#include "norm/jit.hpp"

namespace encore::bench {

void run_qk_norm_jit_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  if (!jit::nvrtc_info().available) {
    std::printf("  qk_norm_jit: NVRTC not available (%s): skipped\n", jit::nvrtc_info().library.c_str());
    return;
  }
  const Device dev{DeviceType::kCUDA, 0};
  constexpr int kD = 128;
  void* w = nullptr;
  check_cuda(cudaMalloc(&w, 2 * kD * 2), "cudaMalloc (weights)");
  fill_random(w, 2 * kD, FillKind::kBF16, 9, stream);
  const TensorView wq = TensorView::contiguous(w, DType::kBF16, {kD}, dev);
  const TensorView wk = TensorView::contiguous(static_cast<char*>(w) + kD * 2, DType::kBF16, {kD}, dev);
  const int layouts[][2] = {{24, 4}, {48, 8}, {32, 8}};
  for (const auto& hl : layouts) {
    for (int64_t tokens : {int64_t(1), int64_t(64), int64_t(4096), int64_t(65536)}) {
      if (!size_selected(tokens)) continue;
      const int64_t width = int64_t(hl[0] + 2 * hl[1]) * kD;
      Rotation rot = make_rotation(size_t(tokens * width) * 2, info->l2_bytes, FillKind::kBF16);
      const QkNormOptions o{hl[0], hl[1], kD, 1e-6f, 0.f};
      auto launch = [&](long long i) {
        check_status(run(QkNormArgs{TensorView::contiguous(rot.set(i), DType::kBF16, {tokens, width}, dev), wq, wk}, o, nullptr, stream),
                     "qk_norm_jit");
      };
      const double bytes = double(tokens) * (hl[0] + hl[1]) * kD * 2 * 2;
      double us[2] = {0, 0};
      for (int jit_on = 0; jit_on < 2; ++jit_on) {
        norm::set_qk_norm_jit_policy(jit_on ? norm::JitPolicy::kAlways : norm::JitPolicy::kOff);
        launch(0);  // compile / load outside the timing (and outside the harness's graph capture)
        check_cuda(cudaStreamSynchronize(stream), "warm-up");
        const Timing t = time_launches(launch, stream, topts, rot.sets);
        us[jit_on] = t.median_us;
        const double gbps = bytes / (t.median_us * 1e-6) / 1e9;
        Record r;
        r.suite = "qk_norm_jit";
        r.name = jit_on ? "qk_norm_jit" : "qk_norm_aot";
        r.params = {{"dtype", "bf16"}, {"tokens", std::to_string(tokens)}, {"q_heads", std::to_string(hl[0])},
                    {"kv_heads", std::to_string(hl[1])}, {"head_dim", std::to_string(kD)},
                    {"in_aot_list", norm::qk_norm_heads_in_aot_list(kD, hl[0], hl[1]) ? "yes" : "no"}};
        r.metrics = {{"time_us", t.median_us}, {"min_us", t.min_us}, {"max_us", t.max_us}, {"gbps", gbps},
                     {"frac_copy_bw", gbps / report.ceilings.copy_gbps}};
        if (jit_on) r.metrics.push_back({"speedup_vs_aot", us[0] / us[1]});
        report.records.push_back(r);
      }
      norm::set_qk_norm_jit_policy(norm::JitPolicy::kEnv);
      free_rotation(rot);
      std::printf("  qk_norm %2dq+%dkv T %6lld: aot %9.2f us  jit %9.2f us  jit speedup %.2fx\n", hl[0], hl[1], (long long)tokens, us[0],
                  us[1], us[0] / us[1]);
      std::fflush(stdout);
    }
  }
  cudaFree(w);
}

}  // namespace encore::bench
