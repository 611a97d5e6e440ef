// QK-norm dispatch: validate -> problem + plan -> CPU reference or CUDA kernel.
#include <atomic>
#include <cmath>

#include "core/checks.hpp"
#include "core/device_memory.hpp"
#include "encore/core/device_info.hpp"
#include "encore/norm.hpp"
#include "norm/jit.hpp"
#include "norm/problem.hpp"
#include "norm/reference/norm_ref.hpp"
#ifdef ENCORE_WITH_CUDA
#include "norm/cuda/launch.hpp"
#endif

namespace encore {
namespace {

Status validate_weight(const char* name, const TensorView& w, const TensorView& qkv, int head_dim) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, w));
  ENCORE_RETURN_IF_ERROR(checks::ndim(name, w, 1, "[head_dim]"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals(name, w, 0, head_dim, "head_dim"));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride(name, w));
  ENCORE_RETURN_IF_ERROR(checks::same_dtype(name, w, "qkv", qkv));
  ENCORE_RETURN_IF_ERROR(checks::same_device(name, w, "qkv", qkv));
  if (!checks::aligned(w.data, 16)) return Status::invalid(std::string(name) + ": data pointer must be 16-byte aligned");
  ENCORE_RETURN_IF_ERROR(checks::no_overlap(name, w, "qkv", qkv));
  return Status::ok();
}

std::atomic<int64_t> g_wide_plans{0};

// 32-byte lane accesses (the sm_100+ plan) need qkv, its token rows and both weights 32-byte aligned
// (a head is D * element bytes >= 128 bytes, whole 32-byte packs).
bool aligned32(const norm::QkNormProblem& p) {
  return checks::aligned(p.qkv, 32) && checks::aligned(p.q_weight, 32) && checks::aligned(p.k_weight, 32) &&
         (p.tokens == 1 || (p.token_stride * int64_t(dtype_size(p.dtype))) % 32 == 0);
}

}  // namespace

Status validate(const QkNormArgs& a, const QkNormOptions& o) {
  if (o.head_dim != 64 && o.head_dim != 128 && o.head_dim != 256)
    return Status::invalid("head_dim: must be 64, 128 or 256, got " + std::to_string(o.head_dim));
  if (o.num_q_heads < 1) return Status::invalid("num_q_heads: must be >= 1, got " + std::to_string(o.num_q_heads));
  if (o.num_kv_heads < 1) return Status::invalid("num_kv_heads: must be >= 1, got " + std::to_string(o.num_kv_heads));
  if (!(o.eps >= 0.0f) || !std::isfinite(o.eps)) return Status::invalid("eps: must be finite and >= 0");
  if (!std::isfinite(o.weight_offset)) return Status::invalid("weight_offset: must be finite");
  ENCORE_RETURN_IF_ERROR(checks::present("qkv", a.qkv));
  ENCORE_RETURN_IF_ERROR(checks::ndim("qkv", a.qkv, 2, "[tokens, (num_q_heads + 2*num_kv_heads) * head_dim]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("qkv", a.qkv, {DType::kBF16, DType::kFP16}));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("qkv", a.qkv));
  const int64_t width = (int64_t(o.num_q_heads) + 2 * int64_t(o.num_kv_heads)) * o.head_dim;
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("qkv", a.qkv, 1, width, "(num_q_heads + 2*num_kv_heads) * head_dim"));
  ENCORE_RETURN_IF_ERROR(checks::rows_disjoint("qkv", a.qkv));
  if (!checks::aligned(a.qkv.data, 16)) return Status::invalid("qkv: data pointer must be 16-byte aligned");
  if (a.qkv.shape[0] > 1 && (a.qkv.strides[0] * int64_t(a.qkv.element_size())) % 16 != 0)
    return Status::invalid("qkv: token stride " + std::to_string(a.qkv.strides[0]) +
                           " must be a multiple of 16 bytes (8 elements) so every head is 16-byte aligned");
  if (a.qkv.shape[0] * (int64_t(o.num_q_heads) + o.num_kv_heads) >= (int64_t(1) << 31))
    return Status::unsupported("qkv: tokens * (num_q_heads + num_kv_heads) must be < 2^31");
  // CUDA: a head's column offset within its token row is 32-bit (head index * head_dim).
  if (a.qkv.device.is_cuda() && width >= (int64_t(1) << 31))
    return Status::unsupported("qkv: " + std::to_string(width) + " columns; the CUDA kernels take rows of fewer than 2^31 elements");
  ENCORE_RETURN_IF_ERROR(validate_weight("q_weight", a.q_weight, a.qkv, o.head_dim));
  ENCORE_RETURN_IF_ERROR(validate_weight("k_weight", a.k_weight, a.qkv, o.head_dim));
  return Status::ok();
}

size_t workspace_bytes(const QkNormArgs&, const QkNormOptions&) { return 0; }

Status run(const QkNormArgs& a, const QkNormOptions& o, void*, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  ENCORE_RETURN_IF_ERROR(checks::device_memory({{"qkv", &a.qkv}, {"q_weight", &a.q_weight}, {"k_weight", &a.k_weight}}));  // CUDA views only
  norm::QkNormProblem p;
  p.qkv = a.qkv.data;
  p.token_stride = a.qkv.strides[0];
  p.q_weight = a.q_weight.data;
  p.k_weight = a.k_weight.data;
  p.tokens = a.qkv.shape[0];
  p.num_q_heads = o.num_q_heads;
  p.num_kv_heads = o.num_kv_heads;
  p.head_dim = o.head_dim;
  p.dtype = a.qkv.dtype;
  p.eps = o.eps;
  p.weight_offset = o.weight_offset;
  p.device_index = a.qkv.device.index;
  if (!a.qkv.device.is_cuda()) {
    reference::qk_norm(p);
    return Status::ok();
  }
#ifdef ENCORE_WITH_CUDA
  const DeviceInfo* info = nullptr;
  ENCORE_RETURN_IF_ERROR(get_device_info(a.qkv.device.index, &info));
  norm::QkNormLaunchPlan plan = norm::plan_qk_norm(p.tokens, p.num_q_heads + p.num_kv_heads, p.head_dim, p.dtype, info->sm_count);
  if (norm::norm_wide_packs(info->cc_major) && aligned32(p)) {
    plan = norm::widen_qk_norm_plan(plan, p.tokens, p.num_q_heads + p.num_kv_heads, p.head_dim, p.dtype);
    if (plan.pack_bytes == 32) g_wide_plans.fetch_add(1, std::memory_order_relaxed);
  }
  if (norm::qk_norm_uses_jit(p)) {  // docs/jit.md: the head layout baked in
    Status st = norm::launch_qk_norm_jit(p, plan, stream);
    if (norm::qk_norm_jit_family().handled(st, stream)) return st;  // ran, or refused during a graph capture
  }
  return cuda::launch_qk_norm(p, plan, stream);
#else
  (void)stream;
  return Status::unsupported("qkv: on " + a.qkv.device.to_string() + " but encore was built without CUDA (ENCORE_CUDA=OFF)");
#endif
}

int64_t norm::qk_norm_wide_plan_count() { return g_wide_plans.load(); }

}  // namespace encore
