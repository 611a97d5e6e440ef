// QK-norm run-time specializations (src/norm/jit.hpp): qk_norm_kernel with the head layout (Hq + Hkv,
// Hq) baked in, the policy and the launch, on the shared pieces of jit/family.hpp.
#include <algorithm>

#include "norm/jit.hpp"
#ifdef ENCORE_WITH_CUDA
#include "norm/cuda/launch.hpp"
#endif

namespace encore::norm {
namespace {

jit::Family& family() {
  static jit::Family f("qk_norm");
  return f;
}

// Injective: heads < 2^16 (kQkNormJitMaxHeads), head_dim < 2^10, heads per thread < 2^4, packs 16 / 32.
uint64_t variant_key(const QkNormJitVariant& v) {
  return (uint64_t(v.q_heads & 0xffff) << 40) | (uint64_t(v.kv_heads & 0xffff) << 24) | (uint64_t(v.head_dim & 0x3ff) << 14) |
         (uint64_t(int(v.dtype) & 0xff) << 6) | (uint64_t(v.pack_bytes == 32) << 5) | (uint64_t(v.heads_per_thread & 0xf) << 1) |
         uint64_t(v.offset);
}

}  // namespace

jit::KernelSpec qk_norm_jit_spec(const QkNormJitVariant& v) {
  return jit::embedded_spec(
      std::string("qk_norm-") + dtype_name(v.dtype) + "-d" + std::to_string(v.head_dim) + "-q" + std::to_string(v.q_heads) + "-kv" +
          std::to_string(v.kv_heads) + "-t" + std::to_string(v.heads_per_thread) + (v.offset ? "-off" : "") + (v.pack_bytes == 32 ? "-p32" : ""),
      "norm/cuda/qk_norm_kernel.cuh",
      {"core/host_device.hpp", "core/fast_div.hpp", "common/cuda/reduce.cuh", "common/cuda/vector_io.cuh", "norm/cuda/qk_norm_kernel.cuh"},
      std::string("&encore::cuda::qk_norm_kernel<") + jit::device_type_name(v.dtype) + ", " + std::to_string(v.head_dim) + ", " +
          (v.offset ? "true" : "false") + ", " + std::to_string(v.heads_per_thread) + ", " + std::to_string(v.q_heads + v.kv_heads) +
          ", " + std::to_string(v.q_heads) + (v.pack_bytes == 32 ? ", 32>" : ">"));
}

QkNormJitVariant qk_norm_jit_variant(const QkNormProblem& p, const QkNormLaunchPlan& plan) {
  return QkNormJitVariant{p.dtype, p.head_dim, p.num_q_heads, p.num_kv_heads, p.weight_offset != 0.0f, plan.heads_per_thread, plan.pack_bytes};
}

bool qk_norm_heads_in_aot_list(int head_dim, int q_heads, int kv_heads) {
  // (Hq, Hkv) at head_dim 128: Qwen3 0.6B-4B (16/8, 32/8), 8B-14B (32/8, 40/8), 32B (64/8), the bench's 64/4.
  static constexpr std::pair<int, int> kList[] = {{16, 8}, {32, 8}, {40, 8}, {64, 8}, {64, 4}};
  return head_dim == 128 && std::find(std::begin(kList), std::end(kList), std::make_pair(q_heads, kv_heads)) != std::end(kList);
}

jit::Family& qk_norm_jit_family() { return family(); }
void set_qk_norm_jit_policy(JitPolicy policy) { family().set_policy(policy); }

bool qk_norm_uses_jit(const QkNormProblem& p) {
  if (p.num_q_heads + p.num_kv_heads > kQkNormJitMaxHeads) return false;
  return family().uses_jit(qk_norm_heads_in_aot_list(p.head_dim, p.num_q_heads, p.num_kv_heads));
}

std::vector<QkNormJitVariant> qk_norm_jit_variants(DType dtype, int head_dim, int q_heads, int kv_heads, bool offset, int sm_count) {
  std::vector<QkNormJitVariant> out;
  for (int64_t tokens = 1; tokens <= (int64_t(1) << 20); tokens *= 2) {
    const QkNormLaunchPlan plan = plan_qk_norm(tokens, q_heads + kv_heads, head_dim, dtype, sm_count);
    for (int pack_bytes : {16, 32}) {  // 32: the sm_100+ plan (widen_qk_norm_plan)
      const QkNormJitVariant v{dtype, head_dim, q_heads, kv_heads, offset, plan.heads_per_thread, pack_bytes};
      if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
    }
  }
  return out;
}

Status qk_norm_jit_warmup(const QkNormJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms) {
  return family().warm(variant_key(v), qk_norm_jit_spec(v), device, arch, origin, ms);
}

int64_t qk_norm_jit_launch_count() { return family().launch_count(); }

Status launch_qk_norm_jit(const QkNormProblem& p, const QkNormLaunchPlan& plan, Stream stream) {
#ifdef ENCORE_WITH_CUDA
  const QkNormJitVariant v = qk_norm_jit_variant(p, plan);
  void* fn = nullptr;
  ENCORE_RETURN_IF_ERROR(family().function(variant_key(v), p.device_index, stream, [&] { return qk_norm_jit_spec(v); }, &fn));
  alignas(16) unsigned char params[cuda::kQkNormParamsMaxBytes];
  cuda::qk_norm_kernel_params(p, params);
  return family().launch(fn, plan.grid, plan.threads, p.device_index, stream, params);
#else
  (void)p, (void)plan, (void)stream;
  return Status::unsupported("qk_norm jit: encore was built without CUDA");
#endif
}

}  // namespace encore::norm
