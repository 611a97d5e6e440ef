// The moe family's run-time specializations (docs/jit.md): routing (routing_kernel.cuh with E, k,
// n_group, topk_group constant), the dispatch's map kernels (dispatch_kernel.cuh with k and E
// constant) and combine (combine_kernel.cuh with k and D constant), compiled by NVRTC from the same
// headers the ahead-of-time build includes. Internal (tests, bench, the CLI).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "encore/core/dtype.hpp"
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "jit/family.hpp"
#include "jit/jit.hpp"
#include "moe/problem.hpp"

namespace encore::moe {

using JitPolicy = jit::JitPolicy;

// ---- routing ----
struct RoutingJitVariant {
  DType dtype = DType::kBF16;  // logits
  int experts = 0, top_k = 0;
  int n_group = 1, topk_group = 1;
  bool operator==(const RoutingJitVariant&) const = default;
};
jit::KernelSpec routing_jit_spec(const RoutingJitVariant& v);
RoutingJitVariant routing_jit_variant(const RoutingProblem& p);
// "" when the JIT can specialize v (the CUDA kernel's limits, validate's option rules), else why not.
std::string routing_jit_check(const RoutingJitVariant& v);
// (E, k) the ahead-of-time kernels are benchmarked on (bench/moe: Qwen3-30B-A3B, DeepSeek-V3).
bool routing_shape_in_aot_list(int experts, int top_k);
jit::Family& routing_jit_family();
void set_routing_jit_policy(JitPolicy policy);
bool routing_uses_jit(const RoutingProblem& p);
Status routing_jit_warmup(const RoutingJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms);
Status launch_routing_jit(const RoutingProblem& p, int device, Stream stream);
int64_t routing_jit_launch_count();

// ---- dispatch (the map kernels; the gather stays ahead-of-time) ----
struct DispatchJitVariant {
  DispatchMapKernel kernel = DispatchMapKernel::kSingleBlock;
  int experts = 0, top_k = 0;
  bool operator==(const DispatchJitVariant&) const = default;
};
jit::KernelSpec dispatch_jit_spec(const DispatchJitVariant& v);
std::string dispatch_jit_check(int experts, int top_k);
bool dispatch_shape_in_aot_list(int experts, int top_k);
jit::Family& dispatch_jit_family();
void set_dispatch_jit_policy(JitPolicy policy);
bool dispatch_uses_jit(const DispatchProblem& p);
// Both paths' map kernels for (E, k): what `encore jit warmup` compiles.
std::vector<DispatchJitVariant> dispatch_jit_variants(int experts, int top_k);
Status dispatch_jit_warmup(const DispatchJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms);
// Every map kernel of the plan is found (compiled / loaded) before the first is launched, so a
// capture refused for a missing one records nothing; the gather follows (ahead-of-time).
Status launch_dispatch_jit(const DispatchProblem& p, const DispatchPlan& plan, int device, Stream stream);
int64_t dispatch_jit_launch_count();  // map-kernel launches

// ---- combine ----
struct CombineJitVariant {
  DType in = DType::kBF16, out = DType::kBF16;  // expert_out, out
  int vec = 8;                                   // 8 (rows aligned to 8 elements) or 1
  int top_k = 0;
  int64_t hidden = 0;
  bool operator==(const CombineJitVariant&) const = default;
};
constexpr int64_t kCombineJitMaxHidden = int64_t(1) << 16;  // larger D stays ahead-of-time
constexpr int kCombineJitMaxTopK = 256;
jit::KernelSpec combine_jit_spec(const CombineJitVariant& v);
std::string combine_jit_check(const CombineJitVariant& v);
bool combine_shape_in_aot_list(int64_t hidden, int top_k);
jit::Family& combine_jit_family();
void set_combine_jit_policy(JitPolicy policy);
bool combine_uses_jit(const CombineProblem& p);
Status combine_jit_warmup(const CombineJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms);
Status launch_combine_jit(const CombineProblem& p, int64_t eo_rows, int device, Stream stream);
int64_t combine_jit_launch_count();

// ---- The dispatchers' CUDA step (routing.cpp, dispatch.cpp, combine.cpp, moe.cpp; CUDA builds):
// the JIT specialization when routing_uses_jit / dispatch_uses_jit / combine_uses_jit say so, else
// (or after a JIT failure, said once per family) the ahead-of-time kernels. During a graph capture a
// kernel not yet loaded is refused (unsupported, naming `encore jit warmup`), never compiled.
Status cuda_routing(const RoutingProblem& p, int device, Stream stream);
Status cuda_dispatch(const DispatchProblem& p, const DispatchPlan& plan, int device, Stream stream);
Status cuda_combine(const CombineProblem& p, int64_t eo_rows, int device, Stream stream);

}  // namespace encore::moe
