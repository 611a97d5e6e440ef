// The norm family's run-time specializations (docs/jit.md): RMSNorm (norm/cuda/rms_norm_kernel.cuh
// with the hidden size a compile-time constant) and QK-norm (qk_norm_kernel.cuh with the head
// layout constant), compiled by NVRTC from the same headers the ahead-of-time build includes.
// Internal (tests, bench, the CLI).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "encore/core/dtype.hpp"
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "jit/family.hpp"
#include "jit/jit.hpp"
#include "norm/problem.hpp"

namespace encore::norm {

// One specialization: the template arguments of rms_norm_kernel.
struct RmsNormJitVariant {
  DType dtype = DType::kBF16;
  int64_t hidden = 0;
  int vec_elems = 1;  // 16 / element size, 32 / element size (sm_100+ plans), or 1
  int cached = 0;     // kCached: 0, 1, 2, 4, 8
  bool add = false;
  int warps_per_row = 0;  // kWarpsPerRow: the launch plan's team size in warps (0: read at run time)
  bool operator==(const RmsNormJitVariant&) const = default;
};
jit::KernelSpec rms_norm_jit_spec(const RmsNormJitVariant& v);
RmsNormJitVariant rms_norm_jit_variant(const RmsNormProblem& p, const RmsNormLaunchPlan& plan);

// Hidden sizes the ahead-of-time kernels are tuned and benchmarked on (common model widths);
// the AOT kernels run any hidden size, with run-time loop bounds.
bool rms_norm_hidden_in_aot_list(int64_t hidden);

// Policy (jit/family.hpp): kEnv reads ENCORE_JIT; the test hook overrides it for the process.
using JitPolicy = jit::JitPolicy;
jit::Family& rms_norm_jit_family();
void set_rms_norm_jit_policy(JitPolicy policy);
// Whether the dispatcher takes the JIT path for this hidden size (JIT on, NVRTC present, policy).
bool rms_norm_uses_jit(int64_t hidden);

// The variants the launch plan can pick for (dtype, hidden, add) over batch sizes 1 .. 2^20 on a
// device with `sm_count` SMs (vectorized when hidden allows; with the 32-byte-pack forms the
// dispatcher takes on sm_100+): what `encore jit warmup` compiles.
std::vector<RmsNormJitVariant> rms_norm_jit_variants(DType dtype, int64_t hidden, bool add, int sm_count);

// Compiles (or finds in a cache) one variant. device >= 0: also loads it on that device (the
// in-process function cache the dispatcher reads); device < 0: cubin only for `arch` (no GPU).
Status rms_norm_jit_warmup(const RmsNormJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms);

// The dispatcher's JIT launch (CUDA builds; plan from plan_rms_norm). Refused while `stream` is
// capturing a graph and the kernel is not loaded yet.
Status launch_rms_norm_jit(const RmsNormProblem& p, const RmsNormLaunchPlan& plan, Stream stream);
// JIT launches so far in this process (tests: which path the dispatcher took).
int64_t rms_norm_jit_launch_count();

// ---- QK-norm (qk_norm_jit.cpp) ----
// One specialization: the template arguments of qk_norm_kernel, the head layout included.
struct QkNormJitVariant {
  DType dtype = DType::kBF16;
  int head_dim = 128;
  int q_heads = 0, kv_heads = 0;
  bool offset = false;       // weight_offset != 0
  int heads_per_thread = 1;  // from plan_qk_norm
  int pack_bytes = 16;       // 16, or 32 (widen_qk_norm_plan, sm_100+)
  bool operator==(const QkNormJitVariant&) const = default;
};
// Head layouts the JIT specializes at most (Hq + Hkv); larger ones stay ahead-of-time.
constexpr int kQkNormJitMaxHeads = 1024;
jit::KernelSpec qk_norm_jit_spec(const QkNormJitVariant& v);
QkNormJitVariant qk_norm_jit_variant(const QkNormProblem& p, const QkNormLaunchPlan& plan);
// (head_dim, Hq, Hkv) layouts the ahead-of-time kernel is benchmarked on (bench/norm/bench_qk_norm.cpp
// and common models); it runs any layout, the head split at run time.
bool qk_norm_heads_in_aot_list(int head_dim, int q_heads, int kv_heads);
jit::Family& qk_norm_jit_family();
void set_qk_norm_jit_policy(JitPolicy policy);
bool qk_norm_uses_jit(const QkNormProblem& p);
// The variants plan_qk_norm picks for tokens 1 .. 2^20 (what `encore jit warmup` compiles).
std::vector<QkNormJitVariant> qk_norm_jit_variants(DType dtype, int head_dim, int q_heads, int kv_heads, bool offset, int sm_count);
Status qk_norm_jit_warmup(const QkNormJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms);
Status launch_qk_norm_jit(const QkNormProblem& p, const QkNormLaunchPlan& plan, Stream stream);
int64_t qk_norm_jit_launch_count();

}  // namespace encore::norm
