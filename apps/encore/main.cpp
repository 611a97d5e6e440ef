// encore — command-line program.
//   encore info                 build options, kernel families, the GPU (or "no CUDA device")
//   encore check [--cpu]        every op: GPU vs CPU backend on small random shapes (pass/fail table)
//   encore bench [suite] [--out FILE.json] [--quick]
//                               benchmark suites (norm, norm_plans, qk_norm, qk_norm_plans, quant, decode_path,
//                               gemm_epilogue, kda, kda_phases, kda_plans, kda_bwd, kda_decode, kda_decode_plans, quant_plans, host_overhead; all by default): table + JSON
//   encore jit warmup [--config FILE]  precompile run-time specializations into the JIT cache (jit_cmd.cpp)
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "check.hpp"
#include "jit_cmd.hpp"
#include "encore/core/device_info.hpp"
#include "encore/gemm.hpp"
#ifdef ENCORE_WITH_BENCH
#include "bench/suites.hpp"
#endif

namespace {

int usage(int code) {
  std::printf(
      "usage: encore <command> [options]\n"
      "  info                         build options, kernel families, GPU\n"
      "  check [--cpu]                run every op against the CPU backend (pass/fail table)\n"
      "  bench [suite ...] [--out FILE] [--quick]\n"
      "                               run benchmark suites (norm, norm_plans, qk_norm, qk_norm_plans, quant, decode_path,\n"
      "                               gemm_epilogue, kda, kda_phases, kda_plans, kda_bwd, kda_decode, kda_decode_plans, quant_plans, host_overhead); write JSON to FILE\n"
      "  jit warmup [--config FILE]   precompile run-time specializations (JIT cache), print each compile time\n");
  return code;
}

int info() {
  std::printf("encore %s (commit %s)\n", ENCORE_VERSION_STR, ENCORE_GIT_COMMIT);
  std::printf("  CUDA backend:    %s\n", encore::built_with_cuda() ? "yes (sm_90a)" : "no (ENCORE_CUDA=OFF)");
  if (encore::built_with_cuda()) std::printf("  CUTLASS:         %s\n", ENCORE_CUTLASS_VERSION_STR);
  std::string epilogues;
  int kernels = 0;
  for (int i = 0; i < encore::gemm_epilogue_count(); ++i) {
    const encore::GemmEpilogueInfo* e = encore::gemm_epilogue_info(encore::Epilogue(i));
    epilogues += (i ? ", " : "") + std::string(e->name);
    kernels += ((e->tiles & encore::kTileCoop256) != 0) + ((e->tiles & encore::kTilePp128) != 0) + ((e->tiles & encore::kTilePp64) != 0);
  }
  std::printf("  kernel families: norm (rms_norm, add_rms_norm, qk_norm), quant (fp8_group_quant), kda (forward; backward on the CPU),\n"
              "                   gemm (%d epilogues, %d (epilogue, tile) kernels: %s; finishers), blocks (llama_block forward)\n",
              encore::gemm_epilogue_count(), kernels, epilogues.c_str());
#ifdef ENCORE_WITH_BENCH
  std::printf("  benchmarks:      yes\n");
#else
  std::printf("  benchmarks:      no\n");
#endif
  encore::app::print_jit_info();
  int n = encore::cuda_device_count();
  if (n == 0) {
    std::printf("  GPU:             no CUDA device: CPU backend\n");
    return 0;
  }
  for (int i = 0; i < n; ++i) {
    const encore::DeviceInfo* d = nullptr;
    encore::Status st = encore::get_device_info(i, &d);
    if (!st) {
      std::printf("  GPU %d:           %s\n", i, st.to_string().c_str());
      continue;
    }
    std::printf("  GPU %d:           %s, sm_%d%d, %d SMs, L2 %.0f MB, smem/block %zu KB, %.1f GB\n", i, d->name.c_str(),
                d->cc_major, d->cc_minor, d->sm_count, d->l2_bytes / 1e6, d->smem_per_block_optin / 1024,
                d->global_mem_bytes / 1e9);
    if (d->cc_major != 9) std::printf("                   note: encore's kernels target sm_90a (Hopper); this GPU cannot run them\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage(2);
  const std::string cmd = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  if (cmd == "info") return info();
  if (cmd == "check") {
    bool cpu = false;
    for (const auto& a : args) {
      if (a == "--cpu") cpu = true;
      else return usage(2);
    }
    return encore::app::run_check(cpu);
  }
  if (cmd == "bench") {
#ifdef ENCORE_WITH_BENCH
    encore::bench::BenchOptions opts;
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i] == "--out" && i + 1 < args.size()) opts.out_path = args[++i];
      else if (args[i] == "--quick") opts.quick = true;
      else if (!args[i].empty() && args[i][0] != '-') opts.suites.push_back(args[i]);
      else return usage(2);
    }
    return encore::bench::run_suites(opts);
#else
    std::fprintf(stderr, "encore bench: this build has no benchmarks (needs ENCORE_CUDA=ON and ENCORE_BUILD_BENCH=ON)\n");
    return 2;
#endif
  }
  if (cmd == "jit") return encore::app::run_jit(args);
  if (cmd == "-h" || cmd == "--help" || cmd == "help") return usage(0);
  std::fprintf(stderr, "encore: unknown command '%s'\n", cmd.c_str());
  return usage(2);
}
