// The quant family's run-time specializations (docs/jit.md): the FP8 group quantization kernel of
// quant/cuda/fp8_group_quant_kernel.cuh with K / group_size a compile-time constant, and the MXFP8 /
// NVFP4 quantization kernels of mx_quant_kernel.cuh with K / 8 constant, compiled by NVRTC from the
// same headers the ahead-of-time build includes. Internal (tests, bench, the CLI).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "encore/core/dtype.hpp"
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "jit/family.hpp"
#include "jit/jit.hpp"
#include "quant/problem.hpp"

namespace encore::quant {

using JitPolicy = jit::JitPolicy;

// One specialization: the template arguments of fp8_group_quant_kernel, K included.
struct Fp8QuantJitVariant {
  DType dtype = DType::kBF16;
  int64_t cols = 0;  // K
  int group_size = kFp8GroupSize;
  int groups_per_thread = 1;
  int packs_per_lane = 1;
  bool tiled = false;  // tile_rows > 1 (column-major scales)
  bool operator==(const Fp8QuantJitVariant&) const = default;
};
// K the JIT specializes at most (K / 128 groups per row as a template argument); larger K stays AOT.
constexpr int64_t kFp8QuantJitMaxCols = int64_t(1) << 20;
jit::KernelSpec fp8_group_quant_jit_spec(const Fp8QuantJitVariant& v);
Fp8QuantJitVariant fp8_group_quant_jit_variant(const Fp8QuantProblem& p, const Fp8QuantLaunchPlan& plan);
// K the ahead-of-time kernel is benchmarked on (model hidden and expert sizes); it runs any K % 128 == 0.
bool fp8_group_quant_cols_in_aot_list(int64_t cols);
jit::Family& fp8_group_quant_jit_family();
void set_fp8_group_quant_jit_policy(JitPolicy policy);
bool fp8_group_quant_uses_jit(const Fp8QuantProblem& p);
// The variants plan_fp8_group_quant picks for M = 1 .. 2^20 with row- and column-major scales.
std::vector<Fp8QuantJitVariant> fp8_group_quant_jit_variants(DType dtype, int64_t cols, int sm_count);
Status fp8_group_quant_jit_warmup(const Fp8QuantJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms);
Status launch_fp8_group_quant_jit(const Fp8QuantProblem& p, const Fp8QuantLaunchPlan& plan, Stream stream);
int64_t fp8_group_quant_jit_launch_count();

// ---- MXFP8 / NVFP4 quantization (mx_quant_jit.cpp): the quantization kernel only; the swizzled
// padding and NVFP4's global-scale passes stay ahead-of-time (cuda::mx_quant_prologue). ----
struct MxQuantJitVariant {
  MxKind kind = MxKind::kMxfp8;
  DType dtype = DType::kBF16;
  int64_t cols = 0;  // K
  bool operator==(const MxQuantJitVariant&) const = default;
};
constexpr int64_t kMxQuantJitMaxCols = int64_t(1) << 20;
jit::KernelSpec mx_quant_jit_spec(const MxQuantJitVariant& v);
MxQuantJitVariant mx_quant_jit_variant(const MxProblem& p);
// The same K list as FP8 group quantization (model hidden and expert sizes).
bool mx_quant_cols_in_aot_list(int64_t cols);
jit::Family& mx_quant_jit_family();
void set_mx_quant_jit_policy(JitPolicy policy);
bool mx_quant_uses_jit(const MxProblem& p);
Status mx_quant_jit_warmup(const MxQuantJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms);
// The prologue (AOT), then the JIT kernel; the kernel is found (or compiled) first, so a refusal
// during a graph capture records nothing.
Status launch_mx_quant_jit(const MxProblem& p, int device_index, Stream stream);
int64_t mx_quant_jit_launch_count();

}  // namespace encore::quant
