// `encore check` driver: runs every family's rows (check_<family>.cpp) and prints the pass/fail
// table; the exit code is 0 when every row passed.
#include "check.hpp"

#include <cstdio>
#include <random>
#include <utility>
#include <vector>

#include "encore/core/device_info.hpp"

namespace encore::app {

int run_check(bool force_cpu) {
  const bool gpu = !force_cpu && cuda_device_count() > 0;
  if (gpu) {
    const DeviceInfo* info = nullptr;
    if (get_device_info(0, &info)) std::printf("encore check: GPU %s (%d SMs) against the CPU backend\n", info->name.c_str(), info->sm_count);
  } else {
    std::printf("encore check: no CUDA device: CPU backend only (property checks; nothing to compare against)\n");
  }
  std::mt19937_64 rng(std::random_device{}());
  std::vector<CheckRow> rows;
  // One family after another, in this order (the table's row order).
  for (auto* family : {check_norm, check_quant, check_gemm, check_kda, check_moe})
    for (CheckRow& r : family(gpu, rng)) rows.push_back(std::move(r));

  std::printf("%-16s %-12s %-6s %-11s %-10s %s\n", "op", "shape", "dtype", "mode", "error", "result");
  int failed = 0;
  for (const CheckRow& r : rows) {
    failed += !r.pass;
    std::printf("%-16s %-12s %-6s %-11s %-10.3g %s%s%s\n", r.op.c_str(), r.shape.c_str(), r.dtype.c_str(), r.mode.c_str(),
                r.error, r.pass ? "PASS" : "FAIL", r.note.empty() ? "" : "  ", r.note.c_str());
  }
  std::printf("check: %zu passed, %d failed\n", rows.size() - size_t(failed), failed);
  return failed ? 1 : 0;
}

}  // namespace encore::app
