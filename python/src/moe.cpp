// Bindings of the moe family (routing, dispatch, combine, the layer): the Args / Options structs with
// named fields and per op the two calls <op>_workspace and <op>_run (convert.hpp); the layer's buffers
// through MoeLayerShape, moe_buffers_bytes and moe_buffers_carve.
#include <string>

#include "convert.hpp"
#include "encore/core/dtype.hpp"
#include "encore/moe.hpp"

namespace encore::python {
namespace {

// A DType by encore's name (dtype_name: "bf16", "fp16", "fp32", ...).
DType dtype_named(const std::string& name) {
  for (int i = 0; i <= int(DType::kUInt8); ++i)
    if (name == dtype_name(DType(i))) return DType(i);
  throw nb::value_error(("dtype: unknown name '" + name + "' (bf16, fp16, fp32, fp64, fp8_e4m3, int32, int64, uint8)").c_str());
}

}  // namespace

void bind_moe(nb::module_& m) {
  nb::enum_<MoeScoring>(m, "MoeScoring").value("softmax", MoeScoring::kSoftmax).value("sigmoid", MoeScoring::kSigmoid);
  nb::class_<MoeRoutingOptions>(m, "MoeRoutingOptions")
      .def(
          "__init__",
          [](MoeRoutingOptions* p, int top_k, MoeScoring scoring, bool renormalize, int n_group, int topk_group, float routed_scaling_factor) {
            new (p) MoeRoutingOptions{top_k, scoring, renormalize, n_group, topk_group, routed_scaling_factor};
          },
          nb::arg("top_k") = 8, nb::arg("scoring") = MoeScoring::kSoftmax, nb::arg("renormalize") = true, nb::arg("n_group") = 1,
          nb::arg("topk_group") = 1, nb::arg("routed_scaling_factor") = 1.0f)
      .def_rw("top_k", &MoeRoutingOptions::top_k)
      .def_rw("scoring", &MoeRoutingOptions::scoring)
      .def_rw("renormalize", &MoeRoutingOptions::renormalize)
      .def_rw("n_group", &MoeRoutingOptions::n_group)
      .def_rw("topk_group", &MoeRoutingOptions::topk_group)
      .def_rw("routed_scaling_factor", &MoeRoutingOptions::routed_scaling_factor);
  nb::class_<MoeRoutingArgs>(m, "MoeRoutingArgs")
      .def(
          "__init__",
          [](MoeRoutingArgs* p, Opt logits, Opt correction_bias, Opt topk_ids, Opt topk_weights) {
            new (p) MoeRoutingArgs{opt_view(logits, "logits"), opt_view(correction_bias, "correction_bias"), opt_view(topk_ids, "topk_ids"),
                                   opt_view(topk_weights, "topk_weights")};
          },
          nb::arg("logits").none(), nb::arg("correction_bias").none(), nb::arg("topk_ids").none(), nb::arg("topk_weights").none());

  nb::class_<MoeDispatchOptions>(m, "MoeDispatchOptions")
      .def(
          "__init__",
          [](MoeDispatchOptions* p, int num_experts, int align_m, bool fp8_power_of_two_scales, float fp8_eps) {
            new (p) MoeDispatchOptions{num_experts, align_m, fp8_power_of_two_scales, fp8_eps};
          },
          nb::arg("num_experts") = 0, nb::arg("align_m") = 1, nb::arg("fp8_power_of_two_scales") = false, nb::arg("fp8_eps") = 1e-10f)
      .def_rw("num_experts", &MoeDispatchOptions::num_experts)
      .def_rw("align_m", &MoeDispatchOptions::align_m)
      .def_rw("fp8_power_of_two_scales", &MoeDispatchOptions::fp8_power_of_two_scales)
      .def_rw("fp8_eps", &MoeDispatchOptions::fp8_eps);
  // With x_scales, x_permuted holds the e4m3 bytes (the fused FP8 gather).
  nb::class_<MoeDispatchArgs>(m, "MoeDispatchArgs")
      .def(
          "__init__",
          [](MoeDispatchArgs* p, Opt topk_ids, Opt x, Opt expert_counts, Opt expert_offsets, Opt slot_rows, Opt row_slots, Opt x_permuted,
             Opt x_scales) {
            new (p) MoeDispatchArgs{opt_view(topk_ids, "topk_ids"), opt_view(x, "x"), opt_view(expert_counts, "expert_counts"),
                                    opt_view(expert_offsets, "expert_offsets"), opt_view(slot_rows, "slot_rows"), opt_view(row_slots, "row_slots"),
                                    x_scales ? opt_fp8_view(x_permuted, "x_permuted") : opt_view(x_permuted, "x_permuted"),
                                    opt_view(x_scales, "x_scales")};
          },
          nb::arg("topk_ids").none(), nb::arg("x").none() = nb::none(), nb::arg("expert_counts").none() = nb::none(),
          nb::arg("expert_offsets").none() = nb::none(), nb::arg("slot_rows").none() = nb::none(), nb::arg("row_slots").none() = nb::none(),
          nb::arg("x_permuted").none() = nb::none(), nb::arg("x_scales").none() = nb::none());

  nb::class_<MoeCombineOptions>(m, "MoeCombineOptions").def(nb::init<>());
  nb::class_<MoeCombineArgs>(m, "MoeCombineArgs")
      .def(
          "__init__",
          [](MoeCombineArgs* p, Opt expert_out, Opt slot_rows, Opt topk_weights, Opt out) {
            new (p) MoeCombineArgs{opt_view(expert_out, "expert_out"), opt_view(slot_rows, "slot_rows"), opt_view(topk_weights, "topk_weights"),
                                   opt_view(out, "out")};
          },
          nb::arg("expert_out").none(), nb::arg("slot_rows").none(), nb::arg("topk_weights").none(), nb::arg("out").none());

  m.def("moe_permuted_rows", &moe_permuted_rows, nb::arg("tokens"), nb::arg("top_k"), nb::arg("num_experts"), nb::arg("align_m"));

  // The layer: MoeOptions, the shape its buffers are sized for, and the buffers carved from one uint8
  // array of moe_buffers_bytes(shape, opts) bytes from a 256-byte aligned address (persistent across calls).
  nb::class_<MoeOptions>(m, "MoeOptions")
      .def(
          "__init__", [](MoeOptions* p, const MoeRoutingOptions& routing, int align_m) { new (p) MoeOptions{routing, align_m}; },
          nb::arg("routing") = MoeRoutingOptions{}, nb::arg("align_m") = 1)
      .def_rw("routing", &MoeOptions::routing)
      .def_rw("align_m", &MoeOptions::align_m);
  nb::class_<MoeLayerShape>(m, "MoeLayerShape")
      .def(
          "__init__",
          [](MoeLayerShape* p, int64_t max_tokens, int64_t hidden, int64_t intermediate, int num_experts, const std::string& dtype) {
            new (p) MoeLayerShape{max_tokens, hidden, intermediate, num_experts, dtype_named(dtype)};
          },
          nb::arg("max_tokens"), nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"), nb::arg("dtype") = "bf16")
      .def_rw("max_tokens", &MoeLayerShape::max_tokens)
      .def_rw("hidden", &MoeLayerShape::hidden)
      .def_rw("intermediate", &MoeLayerShape::intermediate)
      .def_rw("num_experts", &MoeLayerShape::num_experts)
      .def_prop_rw(
          "dtype", [](const MoeLayerShape& s) { return std::string(dtype_name(s.dtype)); },
          [](MoeLayerShape& s, const std::string& name) { s.dtype = dtype_named(name); });
  nb::class_<MoeBuffers>(m, "MoeBuffers");  // made by moe_buffers_carve; views into the caller's array
  m.def(
      "moe_buffers_bytes", [](const MoeLayerShape& shape, const MoeOptions& opts) { return moe_buffers_bytes(shape, opts); }, nb::arg("shape"),
      nb::arg("opts"));
  m.def(
      "moe_buffers_carve",
      [](const MoeLayerShape& shape, const MoeOptions& opts, Array buffers) {
        const TensorView b = to_view_raw(buffers, "buffers");
        if (b.ndim != 1) raise_if_error(Status::invalid("buffers: expected a 1-D uint8 array"));
        MoeBuffers out;
        raise_if_error(moe_buffers_carve(shape, opts, b.data, size_t(b.shape[0]), b.device, &out));
        return out;
      },
      nb::arg("shape"), nb::arg("opts"), nb::arg("buffers"), nb::keep_alive<0, 3>());
  nb::class_<MoeForwardArgs>(m, "MoeForwardArgs")
      .def(
          "__init__",
          [](MoeForwardArgs* p, Opt x, Opt router_logits, Opt correction_bias, Opt w13, Opt w2, const MoeBuffers& buffers, Opt out) {
            new (p) MoeForwardArgs{opt_view(x, "x"), opt_view(router_logits, "router_logits"), opt_view(correction_bias, "correction_bias"),
                                   opt_view(w13, "w13"), opt_view(w2, "w2"), buffers, opt_view(out, "out")};
          },
          nb::arg("x").none(), nb::arg("router_logits").none(), nb::arg("correction_bias").none(), nb::arg("w13").none(), nb::arg("w2").none(),
          nb::arg("buffers"), nb::arg("out").none());

  ENCORE_BIND_OP(m, "moe_routing", MoeRoutingArgs, MoeRoutingOptions);
  ENCORE_BIND_OP(m, "moe_dispatch", MoeDispatchArgs, MoeDispatchOptions);
  ENCORE_BIND_OP(m, "moe_combine", MoeCombineArgs, MoeCombineOptions);
  ENCORE_BIND_OP(m, "moe_forward", MoeForwardArgs, MoeOptions);
}

}  // namespace encore::python
