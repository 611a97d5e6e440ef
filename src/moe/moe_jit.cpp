// MoE run-time specializations (src/moe/jit.hpp): routing with (E, k, n_group, topk_group) baked in,
// the dispatch's map kernels with (k, E) and combine with (k, D), on the shared pieces of
// jit/family.hpp. The kernel arguments, grids and shared memory come from the CUDA launch code
// (moe/cuda/launch.hpp), so both ways launch the same shapes.
#include <algorithm>
#include <utility>

#include "moe/jit.hpp"
#include "encore/moe.hpp"
#include "moe/args.hpp"
#ifdef ENCORE_WITH_CUDA
#include "moe/cuda/launch.hpp"
#endif

namespace encore::moe {
namespace {

jit::Family& routing_family() {
  static jit::Family f("moe_routing");
  return f;
}
jit::Family& dispatch_family() {
  static jit::Family f("moe_dispatch");
  return f;
}
jit::Family& combine_family() {
  static jit::Family f("moe_combine");
  return f;
}

// (E, k) of the shapes bench/moe benchmarks (Qwen3-30B-A3B, DeepSeek-V3).
bool in_bench_shapes(int experts, int top_k) {
  static constexpr std::pair<int, int> kList[] = {{128, 8}, {256, 8}};
  return std::find(std::begin(kList), std::end(kList), std::make_pair(experts, top_k)) != std::end(kList);
}

// Injective: E, k, n_group, topk_group <= 512 < 2^10 (routing_jit_check), dtype < 2^8.
uint64_t routing_key(const RoutingJitVariant& v) {
  return (uint64_t(int(v.dtype) & 0xff) << 40) | (uint64_t(v.experts & 0x3ff) << 30) | (uint64_t(v.top_k & 0x3ff) << 20) |
         (uint64_t(v.n_group & 0x3ff) << 10) | uint64_t(v.topk_group & 0x3ff);
}
// Injective: E, k <= 1024 < 2^11, four kernels.
uint64_t dispatch_key(const DispatchJitVariant& v) {
  return (uint64_t(int(v.kernel) & 0x3) << 22) | (uint64_t(v.experts & 0x7ff) << 11) | uint64_t(v.top_k & 0x7ff);
}
// Injective: D <= 2^16 < 2^17, k <= 256 < 2^9, vec 1 or 8, dtypes < 2^8.
uint64_t combine_key(const CombineJitVariant& v) {
  return (uint64_t(int(v.in) & 0xff) << 40) | (uint64_t(int(v.out) & 0xff) << 32) | (uint64_t(v.vec == 8) << 31) |
         (uint64_t(v.top_k & 0x1ff) << 20) | uint64_t(v.hidden & 0x1ffff);
}

const char* dispatch_kernel_name(DispatchMapKernel k) {
  switch (k) {
    case DispatchMapKernel::kSingleBlock: return "single_block";
    case DispatchMapKernel::kHistogram: return "histogram";
    case DispatchMapKernel::kScan: return "scan";
    case DispatchMapKernel::kScatter: return "scatter";
  }
  return "?";
}

}  // namespace

// ---- routing ----

jit::KernelSpec routing_jit_spec(const RoutingJitVariant& v) {
  std::string name = std::string("moe_routing-") + dtype_name(v.dtype) + "-e" + std::to_string(v.experts) + "-k" + std::to_string(v.top_k);
  if (v.n_group > 1) name += "-g" + std::to_string(v.n_group) + "-tg" + std::to_string(v.topk_group);
  return jit::embedded_spec(std::move(name), "moe/cuda/routing_kernel.cuh",
                            {"core/host_device.hpp", "encore/core/dtype.hpp", "moe/problem.hpp", "moe/cuda/routing_kernel.cuh"},
                            "&encore::cuda::moe_routing_kernel<" + std::to_string(routing_per_lane(v.experts)) + ", " +
                                jit::device_type_name(v.dtype) + ", " + std::to_string(v.experts) + ", " + std::to_string(v.top_k) +
                                ", " + std::to_string(v.n_group) + ", " + std::to_string(v.topk_group) + ">");
}

RoutingJitVariant routing_jit_variant(const RoutingProblem& p) {
  return RoutingJitVariant{p.logits_dtype, p.num_experts, p.top_k, p.n_group, p.topk_group};
}

std::string routing_jit_check(const RoutingJitVariant& v) {
  if (v.dtype != DType::kBF16 && v.dtype != DType::kFP16 && v.dtype != DType::kFP32) return "logits dtype must be bf16, fp16 or fp32";
  if (v.experts < 1 || v.experts > kCudaRoutingMaxExperts)
    return "experts must be in [1, " + std::to_string(kCudaRoutingMaxExperts) + "] (the CUDA routing kernel's limit)";
  MoeRoutingOptions o;
  o.top_k = v.top_k;
  o.n_group = v.n_group;
  o.topk_group = v.topk_group;
  const Status st = validate_routing_options(o, v.experts);
  return st ? "" : st.message();
}

bool routing_shape_in_aot_list(int experts, int top_k) { return in_bench_shapes(experts, top_k); }
jit::Family& routing_jit_family() { return routing_family(); }
void set_routing_jit_policy(JitPolicy policy) { routing_family().set_policy(policy); }
int64_t routing_jit_launch_count() { return routing_family().launch_count(); }

// The policy first: the shape checks (strings on a refusal) only when the JIT is on.
bool routing_uses_jit(const RoutingProblem& p) {
  return routing_family().uses_jit(routing_shape_in_aot_list(p.num_experts, p.top_k)) && routing_jit_check(routing_jit_variant(p)).empty();
}

Status routing_jit_warmup(const RoutingJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms) {
  return routing_family().warm(routing_key(v), routing_jit_spec(v), device, arch, origin, ms);
}

Status launch_routing_jit(const RoutingProblem& p, int device, Stream stream) {
#ifdef ENCORE_WITH_CUDA
  if (p.tokens == 0) return Status::ok();
  const RoutingJitVariant v = routing_jit_variant(p);  // options validated by run(); E checked by routing_uses_jit
  if (p.num_experts < 1 || p.num_experts > kCudaRoutingMaxExperts) return Status::unsupported("moe_routing jit: " + routing_jit_check(v));
  void* fn = nullptr;
  ENCORE_RETURN_IF_ERROR(routing_family().function(routing_key(v), device, stream, [&] { return routing_jit_spec(v); }, &fn));
  alignas(16) unsigned char params[cuda::kMoeRoutingParamsMaxBytes];
  cuda::moe_routing_kernel_params(p, params);
  return routing_family().launch(fn, cuda::moe_routing_grid(p.tokens), cuda::kMoeRoutingBlock, device, stream, params,
                                 cuda::moe_routing_smem_bytes(p.num_experts));
#else
  (void)p, (void)device, (void)stream;
  return Status::unsupported("moe_routing jit: encore was built without CUDA");
#endif
}

// ---- dispatch ----

jit::KernelSpec dispatch_jit_spec(const DispatchJitVariant& v) {
  const std::string kernel = dispatch_kernel_name(v.kernel);
  return jit::embedded_spec("moe_dispatch_" + kernel + "-e" + std::to_string(v.experts) + "-k" + std::to_string(v.top_k),
                            "moe/cuda/dispatch_kernel.cuh",
                            {"core/host_device.hpp", "encore/core/dtype.hpp", "common/cuda/pdl.cuh", "common/cuda/reduce.cuh",
                             "common/cuda/vector_io.cuh", "moe/problem.hpp", "moe/cuda/dispatch_kernel.cuh"},
                            "&encore::cuda::dispatch_" + kernel + "_kernel<" + std::to_string(v.top_k) + ", " + std::to_string(v.experts) + ">");
}

std::string dispatch_jit_check(int experts, int top_k) {
  if (experts < 1 || experts > kCudaDispatchMaxExperts)
    return "experts must be in [1, " + std::to_string(kCudaDispatchMaxExperts) + "] (the CUDA dispatch kernels' limit)";
  if (top_k < 1 || top_k > experts) return "top_k must be in [1, experts]";
  return "";
}

bool dispatch_shape_in_aot_list(int experts, int top_k) { return in_bench_shapes(experts, top_k); }
jit::Family& dispatch_jit_family() { return dispatch_family(); }
void set_dispatch_jit_policy(JitPolicy policy) { dispatch_family().set_policy(policy); }
int64_t dispatch_jit_launch_count() { return dispatch_family().launch_count(); }

bool dispatch_uses_jit(const DispatchProblem& p) {
  return dispatch_family().uses_jit(dispatch_shape_in_aot_list(p.num_experts, p.top_k)) && dispatch_jit_check(p.num_experts, p.top_k).empty();
}

std::vector<DispatchJitVariant> dispatch_jit_variants(int experts, int top_k) {
  std::vector<DispatchJitVariant> out;
  for (DispatchMapKernel k : {DispatchMapKernel::kSingleBlock, DispatchMapKernel::kHistogram, DispatchMapKernel::kScan, DispatchMapKernel::kScatter})
    out.push_back({k, experts, top_k});
  return out;
}

Status dispatch_jit_warmup(const DispatchJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms) {
  return dispatch_family().warm(dispatch_key(v), dispatch_jit_spec(v), device, arch, origin, ms);
}

Status launch_dispatch_jit(const DispatchProblem& p, const DispatchPlan& plan, int device, Stream stream) {
#ifdef ENCORE_WITH_CUDA
  if (std::string e = dispatch_jit_check(p.num_experts, p.top_k); !e.empty()) return Status::unsupported("moe_dispatch jit: " + e);
  ENCORE_RETURN_IF_ERROR(cuda::moe_dispatch_check(p, plan));
  alignas(16) unsigned char params[cuda::kMoeDispatchParamsMaxBytes];
  cuda::DispatchMapLaunch launches[3];
  const int n = cuda::moe_dispatch_map_launches(p, plan, launches, params);
  void* fns[3] = {};
  for (int i = 0; i < n; ++i) {  // all found before the first launch
    const DispatchJitVariant v{launches[i].kernel, p.num_experts, p.top_k};
    ENCORE_RETURN_IF_ERROR(dispatch_family().function(dispatch_key(v), device, stream, [&] { return dispatch_jit_spec(v); }, &fns[i]));
  }
  for (int i = 0; i < n; ++i)
    ENCORE_RETURN_IF_ERROR(dispatch_family().launch(fns[i], launches[i].grid, int(launches[i].block), device, stream, params, launches[i].smem));
  return cuda::launch_moe_dispatch_gather(p, plan, params, device, stream);
#else
  (void)p, (void)plan, (void)device, (void)stream;
  return Status::unsupported("moe_dispatch jit: encore was built without CUDA");
#endif
}

// ---- combine ----

jit::KernelSpec combine_jit_spec(const CombineJitVariant& v) {
  return jit::embedded_spec(std::string("moe_combine-") + dtype_name(v.in) + "-" + dtype_name(v.out) + "-h" + std::to_string(v.hidden) + "-k" +
                                std::to_string(v.top_k) + "-v" + std::to_string(v.vec),
                            "moe/cuda/combine_kernel.cuh", {"common/cuda/vector_io.cuh", "moe/cuda/combine_kernel.cuh"},
                            std::string("&encore::cuda::moe_combine_kernel<") + jit::device_type_name(v.in) + ", " +
                                jit::device_type_name(v.out) + ", " + std::to_string(v.vec) + ", " + std::to_string(v.top_k) + ", " +
                                std::to_string(v.hidden) + ">");
}

std::string combine_jit_check(const CombineJitVariant& v) {
  for (DType t : {v.in, v.out})
    if (t != DType::kBF16 && t != DType::kFP16 && t != DType::kFP32) return "dtypes must be bf16, fp16 or fp32";
  if (v.vec != 1 && v.vec != 8) return "internal: vec must be 1 or 8";
  if (v.hidden < 1 || v.hidden > kCombineJitMaxHidden) return "hidden above " + std::to_string(kCombineJitMaxHidden) + " stays ahead-of-time";
  if (v.hidden % v.vec != 0) return "hidden must be a multiple of 8 for the vectorized kernel";
  if (v.top_k < 1 || v.top_k > kCombineJitMaxTopK) return "top_k must be in [1, " + std::to_string(kCombineJitMaxTopK) + "]";
  return "";
}

bool combine_shape_in_aot_list(int64_t hidden, int top_k) {
  static constexpr std::pair<int64_t, int> kList[] = {{2048, 8}, {7168, 8}};  // bench/moe's D and k
  return std::find(std::begin(kList), std::end(kList), std::make_pair(hidden, top_k)) != std::end(kList);
}
jit::Family& combine_jit_family() { return combine_family(); }
void set_combine_jit_policy(JitPolicy policy) { combine_family().set_policy(policy); }
int64_t combine_jit_launch_count() { return combine_family().launch_count(); }

bool combine_uses_jit(const CombineProblem& p) {
  const CombineJitVariant v{p.eo_dtype, p.out_dtype, p.hidden % 8 == 0 ? 8 : 1, p.top_k, p.hidden};
  return combine_family().uses_jit(combine_shape_in_aot_list(p.hidden, p.top_k)) && combine_jit_check(v).empty();
}

Status combine_jit_warmup(const CombineJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms) {
  return combine_family().warm(combine_key(v), combine_jit_spec(v), device, arch, origin, ms);
}

Status launch_combine_jit(const CombineProblem& p, int64_t eo_rows, int device, Stream stream) {
#ifdef ENCORE_WITH_CUDA
  if (p.tokens == 0 || p.hidden == 0) return Status::ok();
  const bool vec = cuda::moe_combine_vectorized(p);
  const CombineJitVariant v{p.eo_dtype, p.out_dtype, vec ? 8 : 1, p.top_k, p.hidden};
  if (std::string e = combine_jit_check(v); !e.empty()) return Status::unsupported("moe_combine jit: " + e);
  void* fn = nullptr;
  ENCORE_RETURN_IF_ERROR(combine_family().function(combine_key(v), device, stream, [&] { return combine_jit_spec(v); }, &fn));
  alignas(16) unsigned char params[cuda::kMoeCombineParamsMaxBytes];
  cuda::moe_combine_kernel_params(p, eo_rows, params);
  return combine_family().launch(fn, cuda::moe_combine_grid(p, vec), cuda::kMoeCombineBlock, device, stream, params);
#else
  (void)p, (void)eo_rows, (void)device, (void)stream;
  return Status::unsupported("moe_combine jit: encore was built without CUDA");
#endif
}

// ---- the dispatchers' CUDA step ----

#ifdef ENCORE_WITH_CUDA
Status cuda_routing(const RoutingProblem& p, int device, Stream stream) {
  if (routing_uses_jit(p)) {  // docs/jit.md: E, k and the groups baked in
    Status st = launch_routing_jit(p, device, stream);
    if (routing_family().handled(st, stream)) return st;  // ran, or refused during a graph capture
  }
  return cuda::launch_moe_routing(p, device, stream);
}

Status cuda_dispatch(const DispatchProblem& p, const DispatchPlan& plan, int device, Stream stream) {
  if (dispatch_uses_jit(p)) {  // k and E baked into the map kernels
    Status st = launch_dispatch_jit(p, plan, device, stream);
    if (dispatch_family().handled(st, stream)) return st;
  }
  return cuda::launch_moe_dispatch(p, plan, device, stream);
}

Status cuda_combine(const CombineProblem& p, int64_t eo_rows, int device, Stream stream) {
  if (combine_uses_jit(p)) {  // k and D baked in
    Status st = launch_combine_jit(p, eo_rows, device, stream);
    if (combine_family().handled(st, stream)) return st;
  }
  return cuda::launch_moe_combine(p, eo_rows, device, stream);
}
#endif

}  // namespace encore::moe
