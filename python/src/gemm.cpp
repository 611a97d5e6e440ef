// Bindings of the GEMM-epilogue family and its finishers.
#include <utility>

#include "convert.hpp"
#include "encore/gemm.hpp"

namespace encore::python {

void bind_gemm(nb::module_& m) {
  // Enums from the catalogue (encore/gemm_epilogues.def): Python names its epilogues and tiles;
  // anything else is refused by nanobind's type check.
  nb::enum_<Epilogue> epilogue(m, "Epilogue");
  for (int i = 0; i < gemm_epilogue_count(); ++i) {
    const GemmEpilogueInfo* info = gemm_epilogue_info(Epilogue(i));
    epilogue.value(info->name, info->epilogue);
  }
  nb::enum_<GemmTile> tile(m, "GemmTile");
  for (GemmTile t : {GemmTile::kAuto, GemmTile::kCooperative128x256, GemmTile::kPingpong128x128, GemmTile::kPingpong64x256})
    tile.value(gemm_tile_name(t), t);
  // GemmOperand flags by name, and (operands, tiles) per epilogue.
  nb::dict operand_flags;
  for (auto [name, flag] : {std::pair<const char*, uint32_t>{"d", kOperandD}, {"d_optional", kOperandDOptional}, {"aux", kOperandAux},
                            {"aux_half", kOperandAuxHalf}, {"c", kOperandC}, {"gamma", kOperandGamma}, {"row_scale", kOperandRowScale},
                            {"row_scale_optional", kOperandRowScaleOptional}, {"pos", kOperandPos}, {"freq", kOperandFreq},
                            {"alpha", kOperandAlpha}, {"tile_partials", kOperandTilePartials}, {"head_partials", kOperandHeadPartials},
                            {"target", kOperandTarget}, {"column_pairs", kOperandColumnPairs},
                            {"weight_kn", kOperandWeightKN}, {"c_pairs", kOperandCPairs}, {"aux_double", kOperandAuxDouble},
                            {"c2_optional", kOperandC2Optional}, {"zdz", kOperandZdz}, {"alpha_optional", kOperandAlphaOptional},
                            {"column_partials", kOperandColumnPartials}, {"a_transposed", kOperandATransposed}, {"lse", kOperandLse}})
    operand_flags[name] = flag;
  m.attr("gemm_operand_flags") = operand_flags;
  m.def("gemm_epilogue_operands", [](Epilogue e) { return gemm_epilogue_info(e)->operands; });

  m.def("gemm_epilogue_out",
        [](Epilogue epilogue, Array a, Array w, Opt d, Opt aux, Opt c, Opt c2, Opt zdz, Opt gamma, Opt row_scale, Opt pos, Opt freq, Opt alpha, Opt partials,
           Opt target, Opt target_logit, Opt lse, int partial_tile_n, int head_dim, int ignore_index, GemmTile tile, uintptr_t stream) {
          GemmEpilogueArgs g;
          g.a = to_view(a, "a");
          g.w = to_view(w, "w");
          g.d = opt_view(d, "d");
          g.aux = opt_view(aux, "aux");
          g.c = opt_view(c, "c");
          g.c2 = opt_view(c2, "c2");
          g.zdz = opt_view(zdz, "zdz");
          g.gamma = opt_view(gamma, "gamma");
          g.row_scale = opt_view(row_scale, "row_scale");
          g.pos = opt_view(pos, "pos");
          g.freq = opt_view(freq, "freq");
          g.alpha = opt_view(alpha, "alpha");
          g.partials = opt_view(partials, "partials");
          g.target = opt_view(target, "target");
          g.target_logit = opt_view(target_logit, "target_logit");
          g.lse = opt_view(lse, "lse");
          GemmEpilogueOptions o;
          o.epilogue = epilogue;
          o.partial_tile_n = partial_tile_n;
          o.head_dim = head_dim;
          o.ignore_index = ignore_index;
          o.tile = tile;
          raise_if_error(run(g, o, nullptr, as_stream(stream)));
        },
        nb::arg("epilogue"), nb::arg("a"), nb::arg("w"), nb::arg("d").none(), nb::arg("aux").none(), nb::arg("c").none(),
        nb::arg("c2").none(), nb::arg("zdz").none(), nb::arg("gamma").none(), nb::arg("row_scale").none(), nb::arg("pos").none(), nb::arg("freq").none(), nb::arg("alpha").none(),
        nb::arg("partials").none(), nb::arg("target").none(), nb::arg("target_logit").none(), nb::arg("lse").none(), nb::arg("partial_tile_n"),
        nb::arg("head_dim"), nb::arg("ignore_index"), nb::arg("tile"), nb::arg("stream"));
  m.def("gemm_partial_tile_n", [](Epilogue e, int64_t M, int64_t N, int64_t K) { return gemm_partial_tile_n(e, M, N, K); });

  m.def("rms_final_reduce_out",
        [](Array partials, Array r, int64_t hidden, float eps, uintptr_t stream) {
          raise_if_error(run(RmsFinalReduceArgs{to_view(partials, "partials"), to_view(r, "r")}, hidden, eps, as_stream(stream)));
        },
        nb::arg("partials"), nb::arg("r"), nb::arg("hidden"), nb::arg("eps"), nb::arg("stream"));
  // Deterministic sums of the backward epilogues' partials: per row (zdz) or per column (dγ).
  m.def("partials_sum_out",
        [](Array partials, Array out, bool per_column, float scale, uintptr_t stream) {
          raise_if_error(run(PartialsSumArgs{to_view(partials, "partials"), to_view(out, "out")},
                             per_column ? PartialsSum::kPerColumn : PartialsSum::kPerRow, scale, as_stream(stream)));
        },
        nb::arg("partials"), nb::arg("out"), nb::arg("per_column"), nb::arg("scale"), nb::arg("stream"));
  m.def("lse_finish_out",
        [](Array partials, Array lse, Opt target, Opt target_logit, Opt loss, int ignore_index, uintptr_t stream) {
          LseFinishArgs a{to_view(partials, "partials"), to_view(lse, "lse"), opt_view(target, "target"), opt_view(target_logit, "target_logit"),
                          opt_view(loss, "loss")};
          raise_if_error(run(a, ignore_index, as_stream(stream)));
        },
        nb::arg("partials"), nb::arg("lse"), nb::arg("target").none(), nb::arg("target_logit").none(), nb::arg("loss").none(),
        nb::arg("ignore_index"), nb::arg("stream"));
  // Cross-entropy backward on stored logits: dlogits = alpha·(softmax − one-hot), in place when dlogits is logits.
  m.def("cross_entropy_bwd_out",
        [](Array logits, Array lse, Array target, Opt alpha, Array dlogits, int ignore_index, uintptr_t stream) {
          CrossEntropyBwdArgs a{to_view(logits, "logits"), to_view(lse, "lse"), to_view(target, "target"), opt_view(alpha, "alpha"),
                                to_view(dlogits, "dlogits")};
          raise_if_error(run(a, ignore_index, as_stream(stream)));
        },
        nb::arg("logits"), nb::arg("lse"), nb::arg("target"), nb::arg("alpha").none(), nb::arg("dlogits"), nb::arg("ignore_index"),
        nb::arg("stream"));
  m.def("qk_norm_rope_",
        [](Array qkv, Array partials, Array q_weight, Array k_weight, Array pos, Array freq, int num_q_heads, int num_kv_heads,
           int head_dim, float eps, uintptr_t stream) {
          QkNormRopeArgs a{to_view(qkv, "qkv"), to_view(partials, "partials"), to_view(q_weight, "q_weight"), to_view(k_weight, "k_weight"),
                           to_view(pos, "pos"), to_view(freq, "freq")};
          raise_if_error(run(a, QkNormRopeOptions{num_q_heads, num_kv_heads, head_dim, eps}, as_stream(stream)));
        },
        nb::arg("qkv"), nb::arg("partials"), nb::arg("q_weight"), nb::arg("k_weight"), nb::arg("pos"), nb::arg("freq"),
        nb::arg("num_q_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"), nb::arg("eps"), nb::arg("stream"));
  // QK-norm + RoPE backward: dx (may be dy), dq_weight, dk_weight from the forward's input x and partials.
  m.def("qk_norm_rope_bwd_workspace_bytes",
        [](Array dy, int num_q_heads, int num_kv_heads, int head_dim) {
          QkNormRopeBwdArgs a;
          a.dy = to_view(dy, "dy");
          return workspace_bytes(a, QkNormRopeOptions{num_q_heads, num_kv_heads, head_dim, 0.0f});
        },
        nb::arg("dy"), nb::arg("num_q_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"));
  m.def("qk_norm_rope_bwd_out",
        [](Array dy, Array x, Array partials, Array q_weight, Array k_weight, Array pos, Array freq, Array dx, Array dq_weight,
           Array dk_weight, int num_q_heads, int num_kv_heads, int head_dim, float eps, Opt workspace, uintptr_t stream) {
          QkNormRopeBwdArgs a{to_view(dy, "dy"),         to_view(x, "x"),       to_view(partials, "partials"),   to_view(q_weight, "q_weight"),
                              to_view(k_weight, "k_weight"), to_view(pos, "pos"), to_view(freq, "freq"),       to_view(dx, "dx"),
                              to_view(dq_weight, "dq_weight"), to_view(dk_weight, "dk_weight")};
          void* ws = workspace ? workspace->data() : nullptr;
          raise_if_error(run(a, QkNormRopeOptions{num_q_heads, num_kv_heads, head_dim, eps}, ws, as_stream(stream)));
        },
        nb::arg("dy"), nb::arg("x"), nb::arg("partials"), nb::arg("q_weight"), nb::arg("k_weight"), nb::arg("pos"), nb::arg("freq"),
        nb::arg("dx"), nb::arg("dq_weight"), nb::arg("dk_weight"), nb::arg("num_q_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"),
        nb::arg("eps"), nb::arg("workspace").none(), nb::arg("stream"));
  m.def("rope_freq_turns_out",
        [](int num_heads, int rotary_heads, int head_dim, double base, Array freq) {
          raise_if_error(rope_freq_turns(num_heads, rotary_heads, head_dim, base, to_view(freq, "freq")));
        },
        nb::arg("num_heads"), nb::arg("rotary_heads"), nb::arg("head_dim"), nb::arg("base"), nb::arg("freq"));
  m.def("interleave_gate_up_out",
        [](Array gate, Array up, Array out) { raise_if_error(interleave_gate_up(to_view(gate, "gate"), to_view(up, "up"), to_view(out, "out"))); },
        nb::arg("gate"), nb::arg("up"), nb::arg("out"));
}

}  // namespace encore::python
