// The MoE layer: routing -> dispatch -> per-expert SwiGLU MLP -> combine, through the caller's
// persistent buffers (moe_buffers_bytes / moe_buffers_carve); no allocation (and on CUDA no sync) in
// run. CPU: the reference; CUDA: the family's kernels and the grouped GEMMs (cuda/grouped_gemm.cu).
#include <algorithm>
#include <string>

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
  take(&b->gate_up, DType::kFP32, {R, 2 * s.intermediate});
  take(&b->gemm_workspace, DType::kUInt8, {int64_t(moe::grouped_gemm_workspace_bytes(E))});
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

// A 16-byte aligned base pointer and row strides (every stride but the unit last one) of 8 elements.
Status tma_rows(const char* name, const TensorView& t) {
  bool ok = checks::aligned(t.data, 16);
  for (int i = 0; i + 1 < t.ndim; ++i) ok = ok && t.strides[i] % 8 == 0;
  if (!ok)
    return Status::unsupported(std::string(name) + ": moe_forward on CUDA needs a 16-byte aligned base and row strides that are multiples of "
                               "8 elements (TMA)");
  return Status::ok();
}

// The CUDA layer's limits: bf16, D and F multiples of 8, the kernels' expert limits, the GEMM buffers.
Status validate_cuda(const MoeForwardArgs& a, int64_t T, int64_t D, int64_t F, int64_t E) {
#ifdef ENCORE_WITH_CUDA
  const MoeBuffers& b = a.buffers;
  if (a.x.dtype != DType::kBF16)
    return Status::unsupported(std::string("x: moe_forward on CUDA takes bf16 (its grouped GEMMs), got ") + dtype_name(a.x.dtype));
  if (D % 8 != 0 || F % 8 != 0)
    return Status::unsupported("x: moe_forward on CUDA needs the hidden size D and the intermediate size F to be multiples of 8 (16-byte "
                               "rows for TMA), got D = " + std::to_string(D) + ", F = " + std::to_string(F));
  if (E > moe::kCudaRoutingMaxExperts)
    return Status::unsupported("router_logits: E = " + std::to_string(E) + " experts; moe_forward on CUDA takes at most " +
                               std::to_string(moe::kCudaRoutingMaxExperts) + " (the routing kernel)");
  if (D >= (int64_t(1) << 31) || 2 * F >= (int64_t(1) << 31)) return Status::unsupported("x: D and 2F must be < 2^31 on CUDA");
  const int64_t R = b.x_permuted.shape[0];
  ENCORE_RETURN_IF_ERROR(checks::present("buffers.gate_up", b.gate_up));
  ENCORE_RETURN_IF_ERROR(checks::ndim("buffers.gate_up", b.gate_up, 2, "[R, 2F]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("buffers.gate_up", b.gate_up, {DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("buffers.gate_up", b.gate_up, 0, R, "x_permuted's rows R"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("buffers.gate_up", b.gate_up, 1, 2 * F, "2F"));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("buffers.gate_up", b.gate_up));
  ENCORE_RETURN_IF_ERROR(checks::same_device("buffers.gate_up", b.gate_up, "x", a.x));
  if (!checks::aligned(b.gate_up.data, 16) || b.gate_up.strides[0] % 4 != 0)
    return Status::unsupported("buffers.gate_up: needs a 16-byte aligned base and a row stride that is a multiple of 4 elements");
  ENCORE_RETURN_IF_ERROR(moe::check_vector("buffers.gemm_workspace", b.gemm_workspace, DType::kUInt8,
                                           int64_t(moe::grouped_gemm_workspace_bytes(int(E))), true, "moe::grouped_gemm_workspace_bytes(E)",
                                           "x", a.x));
  if (!checks::aligned(b.gemm_workspace.data, moe::kBufferAlign)) return Status::invalid("buffers.gemm_workspace: must be 256-byte aligned");
  ENCORE_RETURN_IF_ERROR(tma_rows("w13", a.w13));
  ENCORE_RETURN_IF_ERROR(tma_rows("w2", a.w2));
  ENCORE_RETURN_IF_ERROR(tma_rows("buffers.x_permuted", b.x_permuted));
  ENCORE_RETURN_IF_ERROR(tma_rows("buffers.activation", b.activation));
  ENCORE_RETURN_IF_ERROR(tma_rows("buffers.expert_out", b.expert_out));
  ENCORE_RETURN_IF_ERROR(moe::no_overlaps({{"gate_up", &b.gate_up}, {"gemm_workspace", &b.gemm_workspace}, {"out", &a.out}, {"x", &a.x},
                                           {"router_logits", &a.router_logits}, {"w13", &a.w13}, {"w2", &a.w2},
                                           {"correction_bias", &a.correction_bias}, {"topk_ids", &b.topk_ids}, {"topk_weights", &b.topk_weights},
                                           {"expert_counts", &b.expert_counts}, {"expert_offsets", &b.expert_offsets}, {"slot_rows", &b.slot_rows},
                                           {"row_slots", &b.row_slots}, {"x_permuted", &b.x_permuted}, {"activation", &b.activation},
                                           {"expert_out", &b.expert_out}, {"dispatch_workspace", &b.dispatch_workspace}}));
  (void)T;
  return Status::ok();
#else
  (void)T, (void)D, (void)F, (void)E;
  return Status::unsupported("x: on " + a.x.device.to_string() + " but encore was built without CUDA (ENCORE_CUDA=OFF)");
#endif
}

moe::ExpertMlpProblem mlp_problem(const MoeForwardArgs& a, const Parts& p, const moe::DispatchProblem& d) {
  const MoeBuffers& b = a.buffers;
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
  return m;
}

#ifdef ENCORE_WITH_CUDA
// routing -> dispatch -> grouped gate/up + SwiGLU + grouped down -> combine, all on `stream`.
Status run_cuda(const MoeForwardArgs& a, const MoeOptions& o, const Parts& p, Stream stream) {
  const MoeBuffers& b = a.buffers;
  const int dev = a.x.device.index;
  ENCORE_RETURN_IF_ERROR(checks::device_memory(
      {{"x", &a.x}, {"router_logits", &a.router_logits}, {"correction_bias", &a.correction_bias}, {"w13", &a.w13}, {"w2", &a.w2}, {"out", &a.out},
       {"buffers.topk_ids", &b.topk_ids}, {"buffers.topk_weights", &b.topk_weights}, {"buffers.expert_counts", &b.expert_counts},
       {"buffers.expert_offsets", &b.expert_offsets}, {"buffers.slot_rows", &b.slot_rows}, {"buffers.row_slots", &b.row_slots},
       {"buffers.x_permuted", &b.x_permuted}, {"buffers.activation", &b.activation}, {"buffers.expert_out", &b.expert_out},
       {"buffers.dispatch_workspace", &b.dispatch_workspace}, {"buffers.gate_up", &b.gate_up}, {"buffers.gemm_workspace", &b.gemm_workspace}}));
  const DeviceInfo* info = nullptr;
  ENCORE_RETURN_IF_ERROR(get_device_info(dev, &info));
  const int64_t T = a.x.shape[0];
  const int k = o.routing.top_k, E = p.dispatch_opts.num_experts;
  ENCORE_RETURN_IF_ERROR(moe::cuda_routing(moe::make_routing_problem(p.routing, o.routing), dev, stream));
  const moe::DispatchProblem d = moe::make_dispatch_problem(p.dispatch, p.dispatch_opts, b.dispatch_workspace.data);
  ENCORE_RETURN_IF_ERROR(moe::cuda_dispatch(d, moe::plan_moe_dispatch(T, k, E, info->sm_count), dev, stream));
  moe::ExpertGemmProblem g;
  g.mlp = mlp_problem(a, p, d);
  g.gate_up = static_cast<float*>(b.gate_up.data);
  g.gate_up_stride = b.gate_up.strides[0];
  g.workspace = b.gemm_workspace.data;
  g.workspace_bytes = size_t(b.gemm_workspace.shape[0]);
  g.rows_bound = moe_permuted_rows(T, k, E, o.align_m);
  g.sm_count = info->sm_count;
  g.fused_swiglu = moe::moe_fused_swiglu();
  g.wide_tile = moe::moe_wide_tile(T);
  if (moe::moe_decode_gemv(T, g.mlp.hidden, p.intermediate))
    ENCORE_RETURN_IF_ERROR(cuda::launch_moe_decode_mlp(g.mlp, T, std::min<int64_t>(E, T * k), dev, stream));
  else
    ENCORE_RETURN_IF_ERROR(cuda::launch_moe_expert_gemms(g, dev, stream));
  return moe::cuda_combine(moe::make_combine_problem(p.combine), b.expert_out.shape[0], dev, stream);
}
#endif

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
  if (a.x.device.is_cuda()) return validate_cuda(a, T, D, F, E);
  return Status::ok();
}

size_t workspace_bytes(const MoeForwardArgs&, const MoeOptions&) { return 0; }

Status run(const MoeForwardArgs& a, const MoeOptions& o, void*, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  const Parts p = parts_of(a, o);
  const MoeBuffers& b = a.buffers;
  if (a.x.device.is_cuda()) {
#ifdef ENCORE_WITH_CUDA
    return run_cuda(a, o, p, stream);
#endif
  }
  (void)stream;
  reference::moe_routing(moe::make_routing_problem(p.routing, o.routing));
  const moe::DispatchProblem d = moe::make_dispatch_problem(p.dispatch, p.dispatch_opts, b.dispatch_workspace.data);
  reference::moe_dispatch(d);
  const moe::ExpertMlpProblem m = mlp_problem(a, p, d);
  reference::moe_expert_mlp(m);
  reference::moe_combine(moe::make_combine_problem(p.combine));
  return Status::ok();
}

}  // namespace encore
