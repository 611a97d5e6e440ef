// Shared argument checks of the moe family (args.hpp).
#include "moe/args.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "core/checks.hpp"

namespace encore::moe {

Status check_map(const char* name, const TensorView& t, DType dtype, int64_t rows, int64_t cols, const char* layout,
                 const char* ref_name, const TensorView& ref) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  ENCORE_RETURN_IF_ERROR(checks::ndim(name, t, 2, layout));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, t, {dtype}));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals(name, t, 0, rows, "the number of tokens T"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals(name, t, 1, cols, "top_k"));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride(name, t));
  ENCORE_RETURN_IF_ERROR(checks::rows_disjoint(name, t));
  return checks::same_device(name, t, ref_name, ref);
}

Status check_vector(const char* name, const TensorView& t, DType dtype, int64_t n, bool at_least, const char* what,
                    const char* ref_name, const TensorView& ref) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  ENCORE_RETURN_IF_ERROR(checks::ndim(name, t, 1, what));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, t, {dtype}));
  if (at_least ? t.shape[0] < n : t.shape[0] != n)
    return Status::invalid(std::string(name) + ": " + std::to_string(t.shape[0]) + " elements, expected " +
                           (at_least ? "at least " : "") + std::to_string(n) + " (" + what + ")");
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride(name, t));
  return checks::same_device(name, t, ref_name, ref);
}

Status check_rows(const char* name, const TensorView& t, int64_t rows, int64_t cols, const char* layout, const char* ref_name,
                  const TensorView& ref, const DType* dtype) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  ENCORE_RETURN_IF_ERROR(checks::ndim(name, t, 2, layout));
  if (dtype) {
    ENCORE_RETURN_IF_ERROR(checks::same_dtype(name, t, ref_name, ref));
  } else {
    ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, t, {DType::kBF16, DType::kFP16, DType::kFP32}));
  }
  if (rows >= 0) ENCORE_RETURN_IF_ERROR(checks::dim_equals(name, t, 0, rows, "the rows it needs"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals(name, t, 1, cols, "the hidden (or intermediate) size"));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride(name, t));
  ENCORE_RETURN_IF_ERROR(checks::rows_disjoint(name, t));
  return checks::same_device(name, t, ref_name, ref);
}

Status no_overlaps(std::initializer_list<std::pair<const char*, const TensorView*>> views) {
  const std::vector<std::pair<const char*, const TensorView*>> v(views);
  for (size_t i = 0; i < v.size(); ++i)
    for (size_t j = i + 1; j < v.size(); ++j)
      if (v[i].second->defined() && v[j].second->defined())
        ENCORE_RETURN_IF_ERROR(checks::no_overlap(v[i].first, *v[i].second, v[j].first, *v[j].second));
  return Status::ok();
}

TensorView first_rows(TensorView t, int64_t n) {
  if (t.ndim >= 1 && n <= t.shape[0]) t.shape[0] = n;
  return t;
}

Status validate_routing_options(const MoeRoutingOptions& o, int64_t E) {
  const std::string es = std::to_string(E);
  if (o.scoring != MoeScoring::kSoftmax && o.scoring != MoeScoring::kSigmoid) return Status::invalid("scoring: must be softmax or sigmoid");
  if (o.top_k < 1 || o.top_k > E)
    return Status::invalid("top_k: must be in [1, E = " + es + "] (E from logits' last dimension), got " + std::to_string(o.top_k));
  if (o.n_group < 1 || E % o.n_group != 0)
    return Status::invalid("n_group: " + std::to_string(o.n_group) + " must be >= 1 and divide the number of experts E = " + es);
  if (o.topk_group < 1 || o.topk_group > o.n_group)
    return Status::invalid("topk_group: must be in [1, n_group = " + std::to_string(o.n_group) + "], got " + std::to_string(o.topk_group));
  const int64_t reachable = int64_t(o.topk_group) * (E / o.n_group);
  if (o.top_k > reachable)
    return Status::invalid("top_k: " + std::to_string(o.top_k) + " exceeds the experts of the kept groups, topk_group * E / n_group = " +
                           std::to_string(reachable));
  if (!(o.routed_scaling_factor > 0.0f) || !std::isfinite(o.routed_scaling_factor))
    return Status::invalid("routed_scaling_factor: must be finite and > 0");
  return Status::ok();
}

RoutingProblem make_routing_problem(const MoeRoutingArgs& a, const MoeRoutingOptions& o) {
  RoutingProblem p;
  p.logits = a.logits.data;
  p.logits_dtype = a.logits.dtype;
  p.logits_stride = a.logits.strides[0];
  if (a.correction_bias.defined()) {
    p.bias = a.correction_bias.data;
    p.bias_dtype = a.correction_bias.dtype;
    p.bias_stride = a.correction_bias.strides[0];
  }
  p.topk_ids = static_cast<int32_t*>(a.topk_ids.data);
  p.ids_stride = a.topk_ids.strides[0];
  p.topk_weights = static_cast<float*>(a.topk_weights.data);
  p.weights_stride = a.topk_weights.strides[0];
  p.tokens = a.logits.shape[0];
  p.num_experts = int(a.logits.shape[1]);
  p.top_k = o.top_k;
  p.sigmoid = o.scoring == MoeScoring::kSigmoid;
  p.renormalize = o.renormalize;
  p.n_group = o.n_group;
  p.topk_group = o.topk_group;
  p.routed_scaling_factor = o.routed_scaling_factor;
  return p;
}

DispatchProblem make_dispatch_problem(const MoeDispatchArgs& a, const MoeDispatchOptions& o, void* workspace) {
  DispatchProblem p;
  p.topk_ids = static_cast<const int32_t*>(a.topk_ids.data);
  p.ids_stride = a.topk_ids.strides[0];
  p.tokens = a.topk_ids.shape[0];
  p.top_k = int(a.topk_ids.shape[1]);
  p.num_experts = o.num_experts;
  p.align_m = o.align_m;
  p.counts = static_cast<int32_t*>(a.expert_counts.data);
  p.offsets = static_cast<int32_t*>(a.expert_offsets.data);
  p.slot_rows = static_cast<int32_t*>(a.slot_rows.data);
  p.slot_stride = a.slot_rows.strides[0];
  p.row_slots = static_cast<int32_t*>(a.row_slots.data);
  p.rows = a.row_slots.shape[0];
  if (a.x.defined()) {
    p.x = a.x.data;
    p.x_stride = a.x.strides[0];
    p.x_permuted = a.x_permuted.data;
    p.xp_stride = a.x_permuted.strides[0];
    p.hidden = a.x.shape[1];
    p.dtype = a.x.dtype;
    if (a.x_scales.defined()) {
      p.x_scales = static_cast<float*>(a.x_scales.data);
      p.scales_stride = a.x_scales.strides[0];
      p.fp8_power_of_two = o.fp8_power_of_two_scales;
      p.fp8_eps = o.fp8_eps;
    }
  }
  p.cursors = static_cast<int32_t*>(workspace);
  return p;
}

CombineProblem make_combine_problem(const MoeCombineArgs& a) {
  CombineProblem p;
  p.expert_out = a.expert_out.data;
  p.eo_stride = a.expert_out.strides[0];
  p.eo_dtype = a.expert_out.dtype;
  p.slot_rows = static_cast<const int32_t*>(a.slot_rows.data);
  p.slot_stride = a.slot_rows.strides[0];
  p.weights = static_cast<const float*>(a.topk_weights.data);
  p.weights_stride = a.topk_weights.strides[0];
  p.out = a.out.data;
  p.out_stride = a.out.strides[0];
  p.out_dtype = a.out.dtype;
  p.tokens = a.out.shape[0];
  p.hidden = a.out.shape[1];
  p.top_k = int(a.slot_rows.shape[1]);
  return p;
}

}  // namespace encore::moe
