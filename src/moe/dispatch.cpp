// MoE dispatch: validate -> problem + plan -> CPU reference or CUDA kernels (counts, padded offsets,
// slot maps, gather; src/moe/cuda/dispatch.cu).
#include <cmath>
#include <string>
#include <tuple>

#include "core/checks.hpp"
#include "core/device_memory.hpp"
#include "encore/moe.hpp"
#include "moe/args.hpp"
#include "moe/problem.hpp"
#include "moe/reference/moe_ref.hpp"
#ifdef ENCORE_WITH_CUDA
#include "encore/core/device_info.hpp"
#include "moe/cuda/launch.hpp"
#include "moe/jit.hpp"
#endif

namespace encore {

int64_t moe_permuted_rows(int64_t tokens, int top_k, int num_experts, int align_m) {
  const int64_t pairs = tokens * top_k;
  return pairs + (pairs < num_experts ? pairs : num_experts) * (align_m - 1);
}

namespace moe {
namespace {

// x_permuted fp8 e4m3 [R, D] and x_scales fp32 [R, D / 128] for the fused FP8 gather.
Status validate_fp8_gather(const MoeDispatchArgs& a, const MoeDispatchOptions& o) {
  const int64_t R = a.row_slots.shape[0], D = a.x.shape[1];
  if (D % 128 != 0)
    return Status::invalid("x_scales: the fused FP8 quantization takes groups of 128 columns: D must be a multiple of 128, got D = " +
                           std::to_string(D));
  if (!(o.fp8_eps > 0.0f) || !std::isfinite(o.fp8_eps)) return Status::invalid("fp8_eps: must be finite and > 0");
  for (auto [name, t, dt, cols] : {std::tuple<const char*, const TensorView*, DType, int64_t>{"x_permuted", &a.x_permuted, DType::kFP8E4M3, D},
                                   {"x_scales", &a.x_scales, DType::kFP32, D / 128}}) {
    ENCORE_RETURN_IF_ERROR(checks::present(name, *t));
    ENCORE_RETURN_IF_ERROR(checks::ndim(name, *t, 2, cols == D ? "[R, D]" : "[R, D / 128]"));
    ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, *t, {dt}));
    ENCORE_RETURN_IF_ERROR(checks::dim_equals(name, *t, 0, R, "the rows of row_slots"));
    ENCORE_RETURN_IF_ERROR(checks::dim_equals(name, *t, 1, cols, cols == D ? "x's columns" : "x's groups of 128 columns"));
    ENCORE_RETURN_IF_ERROR(checks::unit_last_stride(name, *t));
    ENCORE_RETURN_IF_ERROR(checks::rows_disjoint(name, *t));
    ENCORE_RETURN_IF_ERROR(checks::same_device(name, *t, "x", a.x));
  }
  return Status::ok();
}

}  // namespace

Status validate_dispatch_shapes(const MoeDispatchArgs& a, const MoeDispatchOptions& o) {
  if (o.num_experts < 1 || o.num_experts >= (1 << 20))
    return Status::invalid("num_experts: must be in [1, 2^20), got " + std::to_string(o.num_experts));
  if (o.align_m < 1 || o.align_m > 1024 || (o.align_m & (o.align_m - 1)) != 0)
    return Status::invalid("align_m: must be a power of two in [1, 1024], got " + std::to_string(o.align_m));
  const TensorView& ids = a.topk_ids;
  ENCORE_RETURN_IF_ERROR(checks::present("topk_ids", ids));
  ENCORE_RETURN_IF_ERROR(checks::ndim("topk_ids", ids, 2, "[T, k]"));
  const int64_t T = ids.shape[0], k = ids.shape[1], E = o.num_experts;
  if (k > E) return Status::invalid("topk_ids: k = " + std::to_string(k) + " columns, but must be in [1, num_experts = " + std::to_string(E) + "]");
  ENCORE_RETURN_IF_ERROR(check_map("topk_ids", ids, DType::kInt32, T, k, "[T, k]", "topk_ids", ids));
  const int64_t R = moe_permuted_rows(T, int(k), int(E), o.align_m);
  if (R >= (int64_t(1) << 31)) return Status::unsupported("topk_ids: the permuted buffer would need " + std::to_string(R) + " rows (>= 2^31)");
  ENCORE_RETURN_IF_ERROR(check_vector("expert_counts", a.expert_counts, DType::kInt32, E, false, "[E]", "topk_ids", ids));
  ENCORE_RETURN_IF_ERROR(check_vector("expert_offsets", a.expert_offsets, DType::kInt32, E + 1, false, "[E + 1]", "topk_ids", ids));
  ENCORE_RETURN_IF_ERROR(check_map("slot_rows", a.slot_rows, DType::kInt32, T, k, "[T, k]", "topk_ids", ids));
  const std::string need = "moe_permuted_rows(T, k, E, align_m) = " + std::to_string(R);
  ENCORE_RETURN_IF_ERROR(check_vector("row_slots", a.row_slots, DType::kInt32, R, true, need.c_str(), "topk_ids", ids));
  if (a.row_slots.shape[0] >= (int64_t(1) << 31)) return Status::unsupported("row_slots: at most 2^31 - 1 rows");
  if (a.x.defined() != a.x_permuted.defined())
    return Status::invalid(std::string(a.x.defined() ? "x_permuted" : "x") + ": x and x_permuted are given together or not at all");
  if (a.x_scales.defined() && !a.x.defined()) return Status::invalid("x_scales: given without x and x_permuted (the fused FP8 gather needs both)");
  if (a.x.defined()) {
    ENCORE_RETURN_IF_ERROR(check_rows("x", a.x, T, a.x.ndim == 2 ? a.x.shape[1] : 0, "[T, D]", "topk_ids", ids));
    if (a.x_scales.defined()) ENCORE_RETURN_IF_ERROR(validate_fp8_gather(a, o));
    else ENCORE_RETURN_IF_ERROR(check_rows("x_permuted", a.x_permuted, a.row_slots.shape[0], a.x.shape[1], "[R, D]", "x", a.x, &a.x.dtype));
  }
  ENCORE_RETURN_IF_ERROR(no_overlaps({{"expert_counts", &a.expert_counts}, {"expert_offsets", &a.expert_offsets}, {"slot_rows", &a.slot_rows},
                                      {"row_slots", &a.row_slots}, {"x_permuted", &a.x_permuted}, {"topk_ids", &a.topk_ids}, {"x", &a.x},
                                      {"x_scales", &a.x_scales}}));
  return Status::ok();
}

}  // namespace moe

Status validate(const MoeDispatchArgs& a, const MoeDispatchOptions& o) {
  ENCORE_RETURN_IF_ERROR(moe::validate_dispatch_shapes(a, o));
  if (a.topk_ids.device.is_cuda()) {
    // The gather kernels take a row's byte offsets as int: x's rows must be < 2^31 bytes.
    if (a.x.defined() && a.x.shape[1] * int64_t(a.x.element_size()) >= (int64_t(1) << 31))
      return Status::unsupported("x: rows of " + std::to_string(a.x.shape[1] * int64_t(a.x.element_size())) +
                                 " bytes; the CUDA kernels take rows of fewer than 2^31 bytes");
#ifdef ENCORE_WITH_CUDA
    // Device ids are not scanned here (that would synchronize): the kernels skip ids outside [0, E).
    if (o.num_experts > moe::kCudaDispatchMaxExperts)
      return Status::unsupported("num_experts: " + std::to_string(o.num_experts) + "; CUDA dispatch takes at most " +
                                 std::to_string(moe::kCudaDispatchMaxExperts) + " experts");
    if (a.x_scales.defined())  // the fused FP8 gather moves 16-byte packs
      for (auto [name, t] : {std::pair<const char*, const TensorView*>{"x", &a.x}, {"x_permuted", &a.x_permuted}})
        if (!checks::aligned(t->data, 16) || (t->strides[0] * int64_t(t->element_size())) % 16 != 0)
          return Status::unsupported(std::string(name) + ": the fused FP8 gather on CUDA needs 16-byte aligned rows (data and row stride)");
    return Status::ok();
#else
    return Status::unsupported("topk_ids: on " + a.topk_ids.device.to_string() + " but encore was built without CUDA (ENCORE_CUDA=OFF)");
#endif
  }
  const auto* ids = static_cast<const int32_t*>(a.topk_ids.data);
  for (int64_t t = 0; t < a.topk_ids.shape[0]; ++t)
    for (int64_t j = 0; j < a.topk_ids.shape[1]; ++j) {
      const int32_t e = ids[t * a.topk_ids.strides[0] + j];
      if (e < 0 || e >= o.num_experts)
        return Status::invalid("topk_ids: entry [" + std::to_string(t) + ", " + std::to_string(j) + "] = " + std::to_string(e) +
                               " is outside [0, num_experts = " + std::to_string(o.num_experts) + ")");
    }
  return Status::ok();
}

size_t workspace_bytes(const MoeDispatchArgs& a, const MoeDispatchOptions& o) {
  const int64_t T = a.topk_ids.ndim == 2 ? a.topk_ids.shape[0] : 0;
  const int k = a.topk_ids.ndim == 2 ? int(a.topk_ids.shape[1]) : 0;
  return moe::plan_moe_dispatch(T, k, o.num_experts < 0 ? 0 : o.num_experts, 0).workspace_bytes;
}

Status run(const MoeDispatchArgs& a, const MoeDispatchOptions& o, void* workspace, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  if (workspace == nullptr || !checks::aligned(workspace, 16))
    return Status::invalid("workspace: a 16-byte aligned buffer of workspace_bytes(args, opts) = " + std::to_string(workspace_bytes(a, o)) +
                           " bytes is required");
  if (a.topk_ids.device.is_cuda()) {
    ENCORE_RETURN_IF_ERROR(checks::device_memory({{"topk_ids", &a.topk_ids}, {"x", &a.x}, {"expert_counts", &a.expert_counts},
                                                  {"expert_offsets", &a.expert_offsets}, {"slot_rows", &a.slot_rows}, {"row_slots", &a.row_slots},
                                                  {"x_permuted", &a.x_permuted}, {"x_scales", &a.x_scales}}));
    ENCORE_RETURN_IF_ERROR(checks::device_pointer("workspace", workspace, a.topk_ids.device));
#ifdef ENCORE_WITH_CUDA
    const DeviceInfo* info = nullptr;
    ENCORE_RETURN_IF_ERROR(get_device_info(a.topk_ids.device.index, &info));
    const moe::DispatchPlan plan = moe::plan_moe_dispatch(a.topk_ids.shape[0], int(a.topk_ids.shape[1]), o.num_experts, info->sm_count);
    return moe::cuda_dispatch(moe::make_dispatch_problem(a, o, workspace), plan, a.topk_ids.device.index, stream);
#endif
  }
  (void)stream;
  reference::moe_dispatch(moe::make_dispatch_problem(a, o, workspace));
  return Status::ok();
}

}  // namespace encore
