// `encore check`: every op on small random shapes, GPU against the CPU backend (or, without a GPU,
// the CPU backend against properties that must hold), printed as a pass/fail table.
#pragma once
#include <random>
#include <string>
#include <vector>

namespace encore::app {

struct CheckRow {
  std::string op, shape, dtype, mode;
  double error = 0;  // relative-RMS error (norms) or mismatching fraction (quantization)
  bool pass = false;
  std::string note;
};

// Returns the process exit code: 0 when every row passed.
int run_check(bool force_cpu);

// Rows for the QK-norm and FP8 group-quantization ops (check_ops.cpp).
std::vector<CheckRow> check_qk_norm(bool gpu, std::mt19937_64& rng);
std::vector<CheckRow> check_fp8_group_quant(bool gpu, std::mt19937_64& rng);
// Rows for the GEMM epilogues and the KDA forward (check_gemm_kda.cpp).
std::vector<CheckRow> check_gemm_kda(bool gpu, std::mt19937_64& rng);

}  // namespace encore::app
