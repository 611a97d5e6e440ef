// The MoE layer on the CPU backend: routing -> dispatch -> per-expert SwiGLU MLP -> combine, through
// the caller's persistent buffers (moe_buffers_bytes / moe_buffers_carve); no allocation in run.
#include <string>

#include "core/checks.hpp"
#include "encore/moe.hpp"
#include "moe/args.hpp"
#include "moe/problem.hpp"
#include "moe/reference/moe_ref.hpp"

namespace encore {
namespace {

// Lays the buffers out from `base` (views filled when out != nullptr); returns the bytes used.
size_t lay_out(const MoeLayerShape& s, const MoeOptions& o, char* base, Device dev, MoeBuffers* out) {
  const int k = o.routing.top_k, E = s.num_experts;
  const int64_t R = moe_permuted_rows(s.max_tokens, k, E, o.align_m);
  const size_t ws = moe::plan_moe_dispatch(s.max_tokens, k, E, 0).workspace_bytes;
  size_t at = 0;
  auto take = [&](TensorView* v, DType t, std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    if (out) *v = TensorView::contiguous(base + at, t, shape, dev);
    at += moe::round_up_bytes(size_t(n) * dtype_size(t));
  };
  MoeBuffers scratch;
  MoeBuffers* b = out ? out : &scratch;
  take(&b->topk_ids, DType::kInt32, {s.max_tokens, k});
  take(&b->topk_weights, DType::kFP32, {s.max_tokens, k});
  take(&b->expert_counts, DType::kInt32, {E});
  take(&b->expert_offsets, DType::kInt32, {E + 1});
  take(&b->slot_rows, DType::kInt32, {s.max_tokens, k});
  take(&b->row_slots, DType::kInt32, {R});
  take(&b->x_permuted, s.dtype, {R, s.hidden});
  take(&b->activation, s.dtype, {R, s.intermediate});
  take(&b->expert_out, s.dtype, {R, s.hidden});
  take(&b->dispatch_workspace, DType::kInt32, {int64_t(ws / sizeof(int32_t))});
  return at;
}

Status validate_shape(const MoeLayerShape& s, const MoeOptions& o) {
  if (s.max_tokens < 1 || s.hidden < 1 || s.intermediate < 1 || s.num_experts < 1)
    return Status::invalid("shape: max_tokens, hidden, intermediate and num_experts must all be >= 1");
  if (s.dtype != DType::kBF16 && s.dtype != DType::kFP16 && s.dtype != DType::kFP32)
    return Status::invalid(std::string("shape: dtype must be bf16, fp16 or fp32, got ") + dtype_name(s.dtype));
  ENCORE_RETURN_IF_ERROR(moe::validate_routing_options(o.routing, s.num_experts));
  MoeDispatchArgs none;
  MoeDispatchOptions d{s.num_experts, o.align_m};
  const Status st = moe::validate_dispatch_shapes(none, d);  // the option checks come first
  return st.message().rfind("topk_ids", 0) == 0 ? Status::ok() : st;
}

Status rows_at_least(const char* name, const TensorView& t, int64_t T) {
  if (t.ndim >= 1 && t.shape[0] < T)
    return Status::invalid(std::string("buffers.") + name + ": " + std::to_string(t.shape[0]) + " rows, fewer than the call's T = " +
                           std::to_string(T) + " tokens (size the buffers for max_tokens >= T)");
  return Status::ok();
}

struct Parts {
  MoeRoutingArgs routing;
  MoeDispatchArgs dispatch;
  MoeDispatchOptions dispatch_opts;
  MoeCombineArgs combine;
  int64_t intermediate = 0;
};

Parts parts_of(const MoeForwardArgs& a, const MoeOptions& o) {
  const int64_t T = a.x.shape[0];
  const MoeBuffers& b = a.buffers;
  Parts p;
  const TensorView ids = moe::first_rows(b.topk_ids, T), w = moe::first_rows(b.topk_weights, T), slots = moe::first_rows(b.slot_rows, T);
  p.routing = {a.router_logits, a.correction_bias, ids, w};
  p.dispatch = {ids, a.x, b.expert_counts, b.expert_offsets, slots, b.row_slots, b.x_permuted};
  p.dispatch_opts = {int(a.router_logits.shape[1]), o.align_m};
  p.combine = {b.expert_out, slots, w, a.out};
  p.intermediate = a.w13.ndim == 3 ? a.w13.shape[1] / 2 : 0;
  return p;
}

}  // namespace

size_t moe_buffers_bytes(const MoeLayerShape& shape, const MoeOptions& opts) {
  if (!validate_shape(shape, opts)) return 0;
  return lay_out(shape, opts, nullptr, Device{}, nullptr);
}

Status moe_buffers_carve(const MoeLayerShape& shape, const MoeOptions& opts, void* base, size_t bytes, Device device, MoeBuffers* out) {
  ENCORE_RETURN_IF_ERROR(validate_shape(shape, opts));
  if (out == nullptr) return Status::invalid("out: null MoeBuffers pointer");
  if (base == nullptr || !checks::aligned(base, moe::kBufferAlign)) return Status::invalid("base: must be non-null and 256-byte aligned");
  const size_t need = lay_out(shape, opts, nullptr, device, nullptr);
  if (bytes < need) return Status::invalid("bytes: " + std::to_string(bytes) + " < moe_buffers_bytes(shape, opts) = " + std::to_string(need));
  lay_out(shape, opts, static_cast<char*>(base), device, out);
  return Status::ok();
}

Status validate(const MoeForwardArgs& a, const MoeOptions& o) {
  ENCORE_RETURN_IF_ERROR(moe::check_rows("x", a.x, -1, a.x.ndim == 2 ? a.x.shape[1] : 0, "[T, D]", "x", a.x));
  const int64_t T = a.x.shape[0], D = a.x.shape[1];
  ENCORE_RETURN_IF_ERROR(checks::present("router_logits", a.router_logits));
  ENCORE_RETURN_IF_ERROR(checks::ndim("router_logits", a.router_logits, 2, "[T, E]"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("router_logits", a.router_logits, 0, T, "x's tokens T"));
  const MoeBuffers& b = a.buffers;
  ENCORE_RETURN_IF_ERROR(rows_at_least("topk_ids", b.topk_ids, T));
  ENCORE_RETURN_IF_ERROR(rows_at_least("topk_weights", b.topk_weights, T));
  ENCORE_RETURN_IF_ERROR(rows_at_least("slot_rows", b.slot_rows, T));
  const Parts p = parts_of(a, o);
  ENCORE_RETURN_IF_ERROR(validate(p.routing, o.routing));
  const int64_t E = a.router_logits.shape[1], F = p.intermediate;
  ENCORE_RETURN_IF_ERROR(checks::present("w13", a.w13));
  ENCORE_RETURN_IF_ERROR(checks::ndim("w13", a.w13, 3, "[E, 2F, D]"));
  ENCORE_RETURN_IF_ERROR(checks::same_dtype("w13", a.w13, "x", a.x));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("w13", a.w13, 0, E, "the number of experts E"));
  if (a.w13.shape[1] % 2 != 0) return Status::invalid("w13: dimension 1 is " + std::to_string(a.w13.shape[1]) + " but must be even (2F)");
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("w13", a.w13, 2, D, "x's hidden size D"));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("w13", a.w13));
  ENCORE_RETURN_IF_ERROR(checks::same_device("w13", a.w13, "x", a.x));
  ENCORE_RETURN_IF_ERROR(checks::present("w2", a.w2));
  ENCORE_RETURN_IF_ERROR(checks::ndim("w2", a.w2, 3, "[E, D, F]"));
  ENCORE_RETURN_IF_ERROR(checks::same_dtype("w2", a.w2, "x", a.x));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("w2", a.w2, 0, E, "the number of experts E"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("w2", a.w2, 1, D, "x's hidden size D"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("w2", a.w2, 2, F, "w13's intermediate size F"));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("w2", a.w2));
  ENCORE_RETURN_IF_ERROR(checks::same_device("w2", a.w2, "x", a.x));
  ENCORE_RETURN_IF_ERROR(moe::validate_dispatch_shapes(p.dispatch, p.dispatch_opts));
  const int64_t R = b.x_permuted.shape[0];
  ENCORE_RETURN_IF_ERROR(moe::check_rows("activation", b.activation, R, F, "[R, F]", "x", a.x, &a.x.dtype));
  ENCORE_RETURN_IF_ERROR(moe::check_rows("expert_out", b.expert_out, R, D, "[R, D]", "x", a.x, &a.x.dtype));
  const size_t ws = workspace_bytes(p.dispatch, p.dispatch_opts);
  ENCORE_RETURN_IF_ERROR(moe::check_vector("dispatch_workspace", b.dispatch_workspace, DType::kInt32, int64_t(ws / 4), true,
                                           "the dispatch's workspace_bytes / 4", "x", a.x));
  ENCORE_RETURN_IF_ERROR(moe::validate_combine_shapes(p.combine));
  ENCORE_RETURN_IF_ERROR(checks::same_dtype("out", a.out, "x", a.x));
  ENCORE_RETURN_IF_ERROR(moe::no_overlaps({{"out", &a.out}, {"x", &a.x}, {"router_logits", &a.router_logits}, {"w13", &a.w13}, {"w2", &a.w2},
                                           {"correction_bias", &a.correction_bias}, {"topk_ids", &b.topk_ids}, {"topk_weights", &b.topk_weights},
                                           {"expert_counts", &b.expert_counts}, {"expert_offsets", &b.expert_offsets}, {"slot_rows", &b.slot_rows},
                                           {"row_slots", &b.row_slots}, {"x_permuted", &b.x_permuted}, {"activation", &b.activation},
                                           {"expert_out", &b.expert_out}, {"dispatch_workspace", &b.dispatch_workspace}}));
  if (a.x.device.is_cuda()) return moe::not_yet_on_cuda("x", a.x);
  return Status::ok();
}

size_t workspace_bytes(const MoeForwardArgs&, const MoeOptions&) { return 0; }

Status run(const MoeForwardArgs& a, const MoeOptions& o, void*, Stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  const Parts p = parts_of(a, o);
  const MoeBuffers& b = a.buffers;
  reference::moe_routing(moe::make_routing_problem(p.routing, o.routing));
  const moe::DispatchProblem d = moe::make_dispatch_problem(p.dispatch, p.dispatch_opts, b.dispatch_workspace.data);
  reference::moe_dispatch(d);
  moe::ExpertMlpProblem m;
  m.x_permuted = b.x_permuted.data;
  m.xp_stride = b.x_permuted.strides[0];
  m.act = b.activation.data;
  m.act_stride = b.activation.strides[0];
  m.y = b.expert_out.data;
  m.y_stride = b.expert_out.strides[0];
  m.w13 = a.w13.data;
  m.w13_stride_e = a.w13.strides[0];
  m.w13_stride_n = a.w13.strides[1];
  m.w2 = a.w2.data;
  m.w2_stride_e = a.w2.strides[0];
  m.w2_stride_n = a.w2.strides[1];
  m.counts = d.counts;
  m.offsets = d.offsets;
  m.num_experts = d.num_experts;
  m.hidden = a.x.shape[1];
  m.intermediate = p.intermediate;
  m.dtype = a.x.dtype;
  reference::moe_expert_mlp(m);
  reference::moe_combine(moe::make_combine_problem(p.combine));
  return Status::ok();
}

}  // namespace encore
