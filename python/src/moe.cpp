// Bindings of the moe family (routing, dispatch, combine, the layer); CPU backend only for now.
#include "convert.hpp"
#include "encore/moe.hpp"

namespace encore::python {
namespace {

MoeRoutingOptions routing_opts(int top_k, bool sigmoid, bool renormalize, int n_group, int topk_group, float scale) {
  return {top_k, sigmoid ? MoeScoring::kSigmoid : MoeScoring::kSoftmax, renormalize, n_group, topk_group, scale};
}

}  // namespace

void bind_moe(nb::module_& m) {
  m.def("moe_routing_out",
        [](Array logits, Opt bias, Array ids, Array weights, int top_k, bool sigmoid, bool renormalize, int n_group, int topk_group,
           float scale, uintptr_t stream) {
          raise_if_error(run(MoeRoutingArgs{to_view(logits, "logits"), opt_view(bias, "correction_bias"), to_view(ids, "topk_ids"),
                                            to_view(weights, "topk_weights")},
                             routing_opts(top_k, sigmoid, renormalize, n_group, topk_group, scale), nullptr, as_stream(stream)));
        },
        nb::arg("logits"), nb::arg("bias").none(), nb::arg("ids"), nb::arg("weights"), nb::arg("top_k"), nb::arg("sigmoid"),
        nb::arg("renormalize"), nb::arg("n_group"), nb::arg("topk_group"), nb::arg("scale"), nb::arg("stream"));

  m.def("moe_permuted_rows", &moe_permuted_rows, nb::arg("tokens"), nb::arg("top_k"), nb::arg("num_experts"), nb::arg("align_m"));

  m.def("moe_dispatch_workspace_bytes",
        [](Array ids, int num_experts, int align_m) {
          return workspace_bytes(MoeDispatchArgs{to_view(ids, "topk_ids")}, MoeDispatchOptions{num_experts, align_m});
        },
        nb::arg("ids"), nb::arg("num_experts"), nb::arg("align_m"));

  // x_scales given: x_permuted holds raw e4m3 bytes (the fused FP8 gather).
  m.def("moe_dispatch_out",
        [](Array ids, Opt x, Array counts, Array offsets, Array slot_rows, Array row_slots, Opt x_permuted, Opt x_scales, Array workspace,
           int num_experts, int align_m, bool power_of_two, uintptr_t stream) {
          MoeDispatchArgs a{to_view(ids, "topk_ids"), opt_view(x, "x"), to_view(counts, "expert_counts"),
                            to_view(offsets, "expert_offsets"), to_view(slot_rows, "slot_rows"), to_view(row_slots, "row_slots"),
                            x_scales ? TensorView{} : opt_view(x_permuted, "x_permuted")};
          if (x_scales) {
            a.x_permuted = x_permuted ? to_fp8_view(*x_permuted, "x_permuted") : TensorView{};
            a.x_scales = to_view(*x_scales, "x_scales");
          }
          MoeDispatchOptions o{num_experts, align_m};
          o.fp8_power_of_two_scales = power_of_two;
          raise_if_error(run(a, o, workspace.data(), as_stream(stream)));
        },
        nb::arg("ids"), nb::arg("x").none(), nb::arg("counts"), nb::arg("offsets"), nb::arg("slot_rows"), nb::arg("row_slots"),
        nb::arg("x_permuted").none(), nb::arg("x_scales").none(), nb::arg("workspace"), nb::arg("num_experts"), nb::arg("align_m"),
        nb::arg("power_of_two"), nb::arg("stream"));

  m.def("moe_combine_out",
        [](Array expert_out, Array slot_rows, Array weights, Array out, uintptr_t stream) {
          raise_if_error(run(MoeCombineArgs{to_view(expert_out, "expert_out"), to_view(slot_rows, "slot_rows"),
                                            to_view(weights, "topk_weights"), to_view(out, "out")},
                             MoeCombineOptions{}, nullptr, as_stream(stream)));
        },
        nb::arg("expert_out"), nb::arg("slot_rows"), nb::arg("weights"), nb::arg("out"), nb::arg("stream"));

  // The layer: `buffers` is one uint8 array of moe_buffers_bytes(...) bytes from a 256-byte aligned
  // address, carved into MoeBuffers for max_tokens tokens (persistent across calls).
  m.def("moe_buffers_bytes",
        [](int64_t max_tokens, int64_t hidden, int64_t intermediate, int num_experts, Array like, int top_k, int align_m) {
          MoeOptions o;
          o.routing.top_k = top_k;
          o.align_m = align_m;
          return moe_buffers_bytes({max_tokens, hidden, intermediate, num_experts, to_view(like, "x").dtype}, o);
        },
        nb::arg("max_tokens"), nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"), nb::arg("like"), nb::arg("top_k"),
        nb::arg("align_m"));

  m.def("moe_forward_out",
        [](Array x, Array logits, Opt bias, Array w13, Array w2, Array buffers, int64_t max_tokens, Array out, int top_k, bool sigmoid,
           bool renormalize, int n_group, int topk_group, float scale, int align_m, uintptr_t stream) {
          MoeOptions o{routing_opts(top_k, sigmoid, renormalize, n_group, topk_group, scale), align_m};
          const TensorView xv = to_view(x, "x"), w13v = to_view(w13, "w13"), lv = to_view(logits, "logits");
          const TensorView bv = to_view_raw(buffers, "buffers");
          if (xv.ndim != 2 || w13v.ndim != 3 || lv.ndim != 2) raise_if_error(Status::invalid("x: expected [T, D], logits [T, E], w13 [E, 2F, D]"));
          MoeBuffers b;
          raise_if_error(moe_buffers_carve({max_tokens, xv.shape[1], w13v.shape[1] / 2, int(lv.shape[1]), xv.dtype}, o, bv.data,
                                           size_t(bv.shape[0]), bv.device, &b));
          raise_if_error(run(MoeForwardArgs{xv, lv, opt_view(bias, "correction_bias"), w13v, to_view(w2, "w2"), b, to_view(out, "out")}, o,
                             nullptr, as_stream(stream)));
        },
        nb::arg("x"), nb::arg("logits"), nb::arg("bias").none(), nb::arg("w13"), nb::arg("w2"), nb::arg("buffers"), nb::arg("max_tokens"),
        nb::arg("out"), nb::arg("top_k"), nb::arg("sigmoid"), nb::arg("renormalize"), nb::arg("n_group"), nb::arg("topk_group"),
        nb::arg("scale"), nb::arg("align_m"), nb::arg("stream"));
}

}  // namespace encore::python
