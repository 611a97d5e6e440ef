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

// Returns the process exit code: 0 when every row passed (check.cpp).
int run_check(bool force_cpu);

// One family's rows each (check_<family>.cpp); `gpu`: compare CUDA against the CPU backend, else
// check properties of the CPU result. run_check calls them in this order.
std::vector<CheckRow> check_norm(bool gpu, std::mt19937_64& rng);   // rms_norm, add_rms_norm, qk_norm
std::vector<CheckRow> check_quant(bool gpu, std::mt19937_64& rng);  // fp8_group_quant
std::vector<CheckRow> check_gemm(bool gpu, std::mt19937_64& rng);   // every GEMM epilogue of the catalogue
std::vector<CheckRow> check_kda(bool gpu, std::mt19937_64& rng);    // kda_forward
std::vector<CheckRow> check_moe(bool gpu, std::mt19937_64& rng);    // moe routing, dispatch, combine, forward (CPU)

}  // namespace encore::app
