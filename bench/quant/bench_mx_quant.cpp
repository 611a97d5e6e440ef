// Part of suite "quant": MXFP8 (e8m0 per 32) and NVFP4 (e4m3 per 16) quantization of bf16
// activations at K = 7168, swizzled (Blackwell) scales; NVFP4 with a given global scale (one pass
// over x) and a computed one (amax pass + quantization pass). Bytes = x read once, q and the
// scales written once (so the computed-global row shows the second read as a lower fraction of
// copy); L2-flushed. Called from run_quant_suite (bench_fp8_group_quant.cpp).
#include <cstdio>
#include <string>

#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"
#include "encore/quant.hpp"

namespace encore::bench {

void run_mx_quant_records(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  const Device dev{DeviceType::kCUDA, 0};
  const int64_t K = 7168;
  struct Variant {
    const char* name;
    bool nvfp4;
    float global;
  };
  for (int64_t M : {int64_t(128), int64_t(4096), int64_t(16384)}) {
    if (!size_selected(M)) continue;
    for (const Variant v : {Variant{"mxfp8_quant", false, 0.f}, Variant{"nvfp4_quant", true, 0.01f}, Variant{"nvfp4_quant", true, 0.f}}) {
      const int64_t sc = K / (v.nvfp4 ? 16 : 32), prows = (M + 127) / 128 * 128, pcols = (sc + 3) / 4 * 4;
      const size_t x_bytes = size_t(M * K) * 2, q_bytes = size_t(v.nvfp4 ? M * K / 2 : M * K), s_bytes = size_t(prows * pcols);
      const size_t q_off = (x_bytes + 255) / 256 * 256, s_off = q_off + (q_bytes + 255) / 256 * 256,
                   g_off = s_off + (s_bytes + 255) / 256 * 256;
      Rotation rot = make_rotation(g_off + 256, info->l2_bytes, FillKind::kBF16);
      MxQuantOptions o;
      o.scale_layout = MxScaleLayout::kSwizzled;
      o.global_scale = v.global;
      Timing t = time_launches([&](long long i) {
        char* base = rot.set(i);
        const TensorView x = TensorView::contiguous(base, DType::kBF16, {M, K}, dev);
        Status st;
        if (v.nvfp4)
          st = run(Nvfp4QuantArgs{x, TensorView::contiguous(base + q_off, DType::kUInt8, {M, K / 2}, dev),
                                  TensorView::contiguous(base + s_off, DType::kFP8E4M3, {prows, pcols}, dev),
                                  TensorView::contiguous(base + g_off, DType::kFP32, {1}, dev)},
                   o, nullptr, stream);
        else
          st = run(Mxfp8QuantArgs{x, TensorView::contiguous(base + q_off, DType::kFP8E4M3, {M, K}, dev),
                                  TensorView::contiguous(base + s_off, DType::kUInt8, {prows, pcols}, dev)},
                   o, nullptr, stream);
        check_status(st, v.name);
      }, stream, topts, rot.sets);
      free_rotation(rot);
      const double bytes = double(x_bytes + q_bytes + s_bytes);
      const double gbps = bytes / (t.median_us * 1e-6) / 1e9;
      const std::string global = !v.nvfp4 ? "-" : v.global > 0 ? "given" : "computed";
      Record r;
      r.suite = "quant";
      r.name = v.name;
      r.params = {{"dtype", "bf16"}, {"M", std::to_string(M)}, {"K", std::to_string(K)}, {"scales", "swizzled"}, {"global", global}};
      r.metrics = {{"time_us", t.median_us}, {"bytes", bytes}, {"gbps", gbps}, {"frac_copy_bw", gbps / report.ceilings.copy_gbps}};
      report.records.push_back(r);
      std::printf("  %s %5lld x %lld global %-8s: %9.2f us %6.0f GB/s %5.1f%% of copy\n", v.name, (long long)M, (long long)K,
                  global.c_str(), t.median_us, gbps, 100.0 * gbps / report.ceilings.copy_gbps);
      std::fflush(stdout);
    }
  }
}

}  // namespace encore::bench
