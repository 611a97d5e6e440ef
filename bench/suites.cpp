#include <cstdio>
#include <functional>
#include <map>

#include "bench/suites.hpp"
#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"

namespace encore::bench {

int run_suites(const BenchOptions& opts) {
  const std::map<std::string, std::function<void(Report&, const TimeOptions&, cudaStream_t)>> suites = {
      {"norm", run_norm_suite},
      {"norm_plans", run_norm_plans_suite},
      {"norm_jit", run_norm_jit_suite},
      {"qk_norm", run_qk_norm_suite},
      {"qk_norm_plans", run_qk_norm_plans_suite},
      {"qk_norm_jit", run_qk_norm_jit_suite},
      {"quant_jit", run_quant_jit_suite},
      {"quant", run_quant_suite},
      {"decode_path", run_decode_path_suite},
      {"gemm_epilogue", run_gemm_epilogue_suite},
      {"kda", run_kda_suite},
      {"kda_phases", run_kda_phases_suite},
      {"kda_plans", run_kda_plans_suite},
      {"kda_bwd", run_kda_bwd_suite},
      {"kda_decode", run_kda_decode_suite},
      {"kda_decode_plans", run_kda_decode_plans_suite},
      {"quant_plans", run_quant_plans_suite},
      {"host_overhead", run_host_overhead_suite},
      {"moe", run_moe_suite},
      {"moe_jit", run_moe_jit_suite},
  };
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "encore bench: no CUDA device: benchmarks need a GPU (try `encore check`)\n");
    return 2;
  }
  std::vector<std::string> names = opts.suites;
  if (names.empty())
    for (const auto& [k, v] : suites) names.push_back(k);
  for (const auto& n : names) {
    if (!suites.count(n)) {
      std::string list;
      for (const auto& [k, v] : suites) list += " " + k;
      std::fprintf(stderr, "encore bench: unknown suite '%s'; available:%s\n", n.c_str(), list.c_str());
      return 2;
    }
  }
  TimeOptions topts;
  if (opts.quick) {
    topts.samples = 5;
    topts.warmup = 3;
  }
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  Report report;
  report.env = read_environment();
  std::printf("encore bench: measuring ceilings on %s ...\n", report.env.gpu.c_str());
  std::fflush(stdout);
  report.ceilings = measure_ceilings(stream, topts);
  std::printf("  copy %.0f GB/s (memcpy %.0f, copy kernel %.0f), cuBLAS bf16 GEMM %.0f TFLOP/s\n", report.ceilings.copy_gbps,
              report.ceilings.memcpy_gbps, report.ceilings.copy_kernel_gbps, report.ceilings.gemm_tflops);
  for (const auto& n : names) {
    std::printf("suite %s\n", n.c_str());
    suites.at(n)(report, topts, stream);
  }
  report.env.sm_clock_mhz = read_environment().sm_clock_mhz;  // clock right after the work
  cudaStreamDestroy(stream);
  report.print_table();

  std::string path = opts.out_path;
  if (path.empty()) {
    std::string suite_tag = opts.suites.empty() ? "all" : opts.suites.front();
    path = "bench-" + suite_tag + "-" + report.env.commit + ".json";
  }
  if (!report.write_json(path)) {
    std::fprintf(stderr, "encore bench: cannot write %s\n", path.c_str());
    return 3;
  }
  std::printf("\nwrote %s\n", path.c_str());
  return 0;
}

}  // namespace encore::bench
