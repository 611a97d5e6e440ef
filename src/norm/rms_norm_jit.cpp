// RMSNorm run-time specializations (src/norm/jit.hpp): source generation from the embedded kernel
// header, the policy, the dispatcher's function cache and launch.
#include <algorithm>

#include "norm/jit.hpp"
#ifdef ENCORE_WITH_CUDA
#include "norm/cuda/launch.hpp"
#endif

namespace encore::norm {
namespace {

jit::Family& family() {
  static jit::Family f("rms_norm");
  return f;
}

// One uint64 per variant for the dispatcher's lookup.
uint64_t variant_key(const RmsNormJitVariant& v) {
  return (uint64_t(v.hidden) << 24) | (uint64_t(int(v.dtype) & 0xff) << 16) | (uint64_t(v.warps_per_row & 0x1f) << 11) |
         (uint64_t(v.vec_elems & 0x1f) << 6) | (uint64_t(v.cached & 0x1f) << 1) | uint64_t(v.add);
}

}  // namespace

jit::KernelSpec rms_norm_jit_spec(const RmsNormJitVariant& v) {
  jit::KernelSpec s = jit::embedded_spec(
      std::string("rms_norm-") + dtype_name(v.dtype) + "-h" + std::to_string(v.hidden) + "-v" + std::to_string(v.vec_elems) + "-c" +
          std::to_string(v.cached) + (v.warps_per_row > 0 ? "-w" + std::to_string(v.warps_per_row) : std::string()) + (v.add ? "-add" : ""),
      "norm/cuda/rms_norm_kernel.cuh", {"common/cuda/reduce.cuh", "common/cuda/vector_io.cuh", "norm/cuda/rms_norm_kernel.cuh"},
      std::string("&encore::cuda::rms_norm_kernel<") + jit::device_type_name(v.dtype) + ", " + std::to_string(v.vec_elems) + ", " +
          std::to_string(v.cached) + ", " + (v.add ? "true" : "false") + ", " + std::to_string(v.hidden) + ", " +
          std::to_string(v.warps_per_row) + ">");
  // The kernel header skips <cstdint> under __CUDACC_RTC__: the prelude types int64_t.
  s.source = "typedef long long int64_t;\n" + s.source;
  return s;
}

RmsNormJitVariant rms_norm_jit_variant(const RmsNormProblem& p, const RmsNormLaunchPlan& plan) {
  return RmsNormJitVariant{p.dtype, p.hidden, plan.vec_elems, plan.vecs_per_thread, p.residual != nullptr, plan.warps_per_row};
}

bool rms_norm_hidden_in_aot_list(int64_t hidden) {
  static constexpr int64_t kList[] = {512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192, 12288, 16384};
  return std::find(std::begin(kList), std::end(kList), hidden) != std::end(kList);
}

jit::Family& rms_norm_jit_family() { return family(); }
void set_rms_norm_jit_policy(JitPolicy policy) { family().set_policy(policy); }
bool rms_norm_uses_jit(int64_t hidden) { return family().uses_jit(rms_norm_hidden_in_aot_list(hidden)); }

std::vector<RmsNormJitVariant> rms_norm_jit_variants(DType dtype, int64_t hidden, bool add, int sm_count) {
  std::vector<RmsNormJitVariant> out;
  const bool vec = hidden % (16 / int64_t(dtype_size(dtype))) == 0, wide = hidden % (32 / int64_t(dtype_size(dtype))) == 0;
  for (int64_t rows = 1; rows <= (int64_t(1) << 20); rows *= 2) {
    const RmsNormLaunchPlan plan = plan_rms_norm(rows, hidden, dtype, vec, add, sm_count);
    // The 16-byte-pack plan, and its 32-byte form (sm_100+: widen_rms_norm_plan) where hidden allows.
    for (const RmsNormLaunchPlan& pl : {plan, wide ? widen_rms_norm_plan(plan, dtype) : plan}) {
      const RmsNormJitVariant v{dtype, hidden, pl.vec_elems, pl.vecs_per_thread, add, pl.warps_per_row};
      if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
    }
  }
  return out;
}

Status rms_norm_jit_warmup(const RmsNormJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms) {
  return family().warm(variant_key(v), rms_norm_jit_spec(v), device, arch, origin, ms);
}

int64_t rms_norm_jit_launch_count() { return family().launch_count(); }

Status launch_rms_norm_jit(const RmsNormProblem& p, const RmsNormLaunchPlan& plan, Stream stream) {
#ifdef ENCORE_WITH_CUDA
  const RmsNormJitVariant v = rms_norm_jit_variant(p, plan);
  void* fn = nullptr;
  ENCORE_RETURN_IF_ERROR(family().function(variant_key(v), p.device_index, stream, [&] { return rms_norm_jit_spec(v); }, &fn));
  alignas(16) unsigned char params[cuda::kRmsNormParamsMaxBytes];
  cuda::rms_norm_kernel_params(p, plan, params);
  return family().launch(fn, plan.grid, 32 * plan.warps_per_row * plan.rows_per_block, p.device_index, stream, params);
#else
  (void)p, (void)plan, (void)stream;
  return Status::unsupported("rms_norm jit: encore was built without CUDA");
#endif
}

}  // namespace encore::norm
