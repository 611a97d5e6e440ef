// Suite "quant": FP8 e4m3 per-token-group quantization (groups of 128) of bf16 activations at
// K = 7168 (DeepSeek-V3 hidden size), row- and column-major scales. Bytes = x read once, q and the
// scales written once; L2-flushed. Then the MXFP8 / NVFP4 records (bench_mx_quant.cpp).
#include <cstdio>
#include <string>

#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"
#include "encore/quant.hpp"

namespace encore::bench {

void run_mx_quant_records(Report& report, const TimeOptions& topts, cudaStream_t stream);  // bench_mx_quant.cpp

void run_quant_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  const Device dev{DeviceType::kCUDA, 0};
  const int64_t K = 7168, groups = K / 128;
  for (int64_t M : {int64_t(1), int64_t(128), int64_t(4096), int64_t(16384)}) {
    if (!size_selected(M)) continue;
    for (bool column_major : {false, true}) {
      const size_t x_bytes = size_t(M * K) * 2, q_bytes = size_t(M * K), s_bytes = size_t(M * groups) * 4;
      const size_t q_off = (x_bytes + 255) / 256 * 256, s_off = q_off + (q_bytes + 255) / 256 * 256;
      Rotation rot = make_rotation(s_off + s_bytes, info->l2_bytes, FillKind::kBF16);
      Timing t = time_launches([&](long long i) {
        char* base = rot.set(i);
        TensorView s = column_major ? TensorView::strided(base + s_off, DType::kFP32, {M, groups}, {1, M}, dev)
                                    : TensorView::contiguous(base + s_off, DType::kFP32, {M, groups}, dev);
        Status st = run(Fp8GroupQuantArgs{TensorView::contiguous(base, DType::kBF16, {M, K}, dev),
                                          TensorView::contiguous(base + q_off, DType::kFP8E4M3, {M, K}, dev), s},
                        Fp8GroupQuantOptions{}, nullptr, stream);
        check_status(st, "quant");
      }, stream, topts, rot.sets);
      free_rotation(rot);
      const double bytes = double(x_bytes + q_bytes + s_bytes);
      const double gbps = bytes / (t.median_us * 1e-6) / 1e9;
      Record r;
      r.suite = "quant";
      r.name = "fp8_group_quant";
      r.params = {{"dtype", "bf16"}, {"M", std::to_string(M)}, {"K", std::to_string(K)}, {"group", "128"},
                  {"scales", column_major ? "column-major" : "row-major"}};
      r.metrics = {{"time_us", t.median_us}, {"bytes", bytes}, {"gbps", gbps}, {"frac_copy_bw", gbps / report.ceilings.copy_gbps}};
      report.records.push_back(r);
      std::printf("  fp8_group_quant %5lld x %lld %-12s: %9.2f us %6.0f GB/s %5.1f%% of copy\n", (long long)M, (long long)K,
                  column_major ? "column-major" : "row-major", t.median_us, gbps, 100.0 * gbps / report.ceilings.copy_gbps);
      std::fflush(stdout);
    }
  }
  run_mx_quant_records(report, topts, stream);
}

}  // namespace encore::bench
