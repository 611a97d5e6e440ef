// RMSNorm run-time specializations (src/norm/jit.hpp): source generation from the embedded kernel
// header, the policy, the dispatcher's function cache and launch.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <unordered_map>

#include "norm/jit.hpp"
#ifdef ENCORE_WITH_CUDA
#include "common/cuda/device_guard.hpp"
#include "norm/cuda/launch.hpp"
#endif

namespace encore::norm {
namespace {

std::atomic<JitPolicy> g_policy{JitPolicy::kEnv};
std::atomic<int64_t> g_launches{0};

const char* device_type_name(DType t) {
  switch (t) {
    case DType::kBF16: return "__nv_bfloat16";
    case DType::kFP16: return "__half";
    default: return "float";
  }
}

// One uint64 per (variant, device) for the dispatcher's lock-cheap lookup.
uint64_t fast_key(const RmsNormJitVariant& v, int device) {
  return (uint64_t(v.hidden) << 24) | (uint64_t(device & 0xff) << 16) | (uint64_t(int(v.dtype) & 0xff) << 8) |
         (uint64_t(v.vec_elems & 0xf) << 4) | (uint64_t(v.cached & 0xf) << 1) | uint64_t(v.add);
}
std::mutex g_fn_mu;
std::unordered_map<uint64_t, void*> g_functions;
std::unordered_map<uint64_t, Status> g_failures;  // a compile or load that failed is not retried

Status load_function(const RmsNormJitVariant& v, int device, Stream stream, void** fn, jit::Origin* origin, double* ms) {
  const uint64_t k = fast_key(v, device);
  {
    std::lock_guard<std::mutex> lock(g_fn_mu);
    auto it = g_functions.find(k);
    if (it != g_functions.end()) {
      *fn = it->second;
      if (origin) *origin = jit::Origin::kMemory;
      if (ms) *ms = 0.0;
      return Status::ok();
    }
    auto failed = g_failures.find(k);
    if (failed != g_failures.end()) return failed->second;
  }
  Status st = jit::Jit::global().get_function(rms_norm_jit_spec(v), device, stream, fn, origin, ms);
  std::lock_guard<std::mutex> lock(g_fn_mu);
  if (!st) {
    if (!jit::stream_capturing(stream)) g_failures.emplace(k, st);
    return st;
  }
  g_functions.emplace(k, *fn);
  return Status::ok();
}

}  // namespace

jit::KernelSpec rms_norm_jit_spec(const RmsNormJitVariant& v) {
  jit::KernelSpec s;
  s.name = std::string("rms_norm-") + dtype_name(v.dtype) + "-h" + std::to_string(v.hidden) + "-v" +
           std::to_string(v.vec_elems) + "-c" + std::to_string(v.cached) + (v.add ? "-add" : "");
  // NVRTC has no host <cstdint>: the kernel header skips it under __CUDACC_RTC__, the prelude types it.
  s.source = "typedef long long int64_t;\n#include \"norm/cuda/rms_norm_kernel.cuh\"\n";
  for (const char* h : {"common/cuda/reduce.cuh", "common/cuda/vector_io.cuh", "norm/cuda/rms_norm_kernel.cuh"}) {
    const char* text = jit::embedded_source(h);
    s.headers.emplace_back(h, text ? text : "#error \"encore jit: header not embedded in this build\"\n");
  }
  s.name_expression = std::string("&encore::cuda::rms_norm_kernel<") + device_type_name(v.dtype) + ", " +
                      std::to_string(v.vec_elems) + ", " + std::to_string(v.cached) + ", " + (v.add ? "true" : "false") +
                      ", " + std::to_string(v.hidden) + ">";
  s.options = {"-std=c++17"};
  return s;
}

RmsNormJitVariant rms_norm_jit_variant(const RmsNormProblem& p, const RmsNormLaunchPlan& plan) {
  return RmsNormJitVariant{p.dtype, p.hidden, plan.vec_elems, plan.vecs_per_thread, p.residual != nullptr};
}

bool rms_norm_hidden_in_aot_list(int64_t hidden) {
  static constexpr int64_t kList[] = {512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192, 12288, 16384};
  return std::find(std::begin(kList), std::end(kList), hidden) != std::end(kList);
}

void set_rms_norm_jit_policy(JitPolicy policy) { g_policy = policy; }

bool rms_norm_uses_jit(int64_t hidden) {
  JitPolicy p = g_policy.load(std::memory_order_relaxed);
  jit::Jit& j = jit::Jit::global();
  if (p == JitPolicy::kEnv) {
    p = j.mode() == jit::JitMode::kOff ? JitPolicy::kOff : j.mode() == jit::JitMode::kAlways ? JitPolicy::kAlways : JitPolicy::kAuto;
  }
  if (p == JitPolicy::kOff || !jit::nvrtc_info().available) return false;
  return p == JitPolicy::kAlways || !rms_norm_hidden_in_aot_list(hidden);
}

std::vector<RmsNormJitVariant> rms_norm_jit_variants(DType dtype, int64_t hidden, bool add, int sm_count) {
  std::vector<RmsNormJitVariant> out;
  const bool vec = hidden % (16 / int64_t(dtype_size(dtype))) == 0;
  for (int64_t rows = 1; rows <= (int64_t(1) << 20); rows *= 2) {
    const RmsNormLaunchPlan plan = plan_rms_norm(rows, hidden, dtype, vec, add, sm_count);
    const RmsNormJitVariant v{dtype, hidden, plan.vec_elems, plan.vecs_per_thread, add};
    if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
  }
  return out;
}

Status rms_norm_jit_warmup(const RmsNormJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms) {
  if (device < 0) {
    std::shared_ptr<const jit::Cubin> cubin;
    return jit::Jit::global().get_cubin(rms_norm_jit_spec(v), arch, &cubin, origin, ms);
  }
  void* fn = nullptr;
  return load_function(v, device, nullptr, &fn, origin, ms);
}

int64_t rms_norm_jit_launch_count() { return g_launches.load(); }

Status launch_rms_norm_jit(const RmsNormProblem& p, const RmsNormLaunchPlan& plan, Stream stream) {
#ifdef ENCORE_WITH_CUDA
  void* fn = nullptr;
  ENCORE_RETURN_IF_ERROR(load_function(rms_norm_jit_variant(p, plan), p.device_index, stream, &fn, nullptr, nullptr));
  alignas(16) unsigned char params[cuda::kRmsNormParamsMaxBytes];
  cuda::rms_norm_kernel_params(p, plan, params);
  void* args[] = {params};
  const unsigned threads = unsigned(32 * plan.warps_per_row * plan.rows_per_block);
  // The JIT function belongs to the device's primary context: launch with that device current.
  cuda::DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(p.device_index));
  ENCORE_RETURN_IF_ERROR(jit::launch(fn, unsigned(plan.grid), threads, 0, stream, args));
  g_launches.fetch_add(1, std::memory_order_relaxed);
  return Status::ok();
#else
  (void)p, (void)plan, (void)stream;
  return Status::unsupported("rms_norm jit: encore was built without CUDA");
#endif
}

}  // namespace encore::norm
