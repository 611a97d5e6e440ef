// Bindings of the GEMM-epilogue family and its finishers: the Args / Options structs with named fields
// (convert.hpp), gemm_epilogue_workspace / gemm_epilogue_run over GemmEpilogueArgs and
// GemmEpilogueOptions, and one binding per finisher (its C++ run takes scalars, not an Options struct).
#include <utility>

#include "convert.hpp"
#include "encore/gemm.hpp"

namespace encore::python {

namespace {

// The catalogue's enums and operand flags: Python names epilogues, tiles and raster orders; anything else
// is refused by nanobind's type check.
void bind_catalogue(nb::module_& m) {
  nb::enum_<Epilogue> epilogue(m, "Epilogue");
  for (int i = 0; i < gemm_epilogue_count(); ++i) {
    const GemmEpilogueInfo* info = gemm_epilogue_info(Epilogue(i));
    epilogue.value(info->name, info->epilogue);
  }
  nb::enum_<GemmTile> tile(m, "GemmTile");
  for (GemmTile t : {GemmTile::kAuto, GemmTile::kCooperative128x256, GemmTile::kPingpong128x128, GemmTile::kPingpong64x256})
    tile.value(gemm_tile_name(t), t);
  nb::enum_<GemmRaster>(m, "GemmRaster")
      .value("auto", GemmRaster::kAuto)
      .value("along_m", GemmRaster::kAlongM)
      .value("along_n", GemmRaster::kAlongN);
  nb::enum_<PartialsSum>(m, "PartialsSum").value("per_row", PartialsSum::kPerRow).value("per_column", PartialsSum::kPerColumn);
  // GemmOperand flags by name, and the operands of each epilogue.
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
  m.def("gemm_epilogue_operands", [](Epilogue epilogue) { return gemm_epilogue_info(epilogue)->operands; }, nb::arg("epilogue"));
  m.def("gemm_partial_tile_n", &gemm_partial_tile_n, nb::arg("epilogue"), nb::arg("M"), nb::arg("N"), nb::arg("K"));
}

// The generic entry: every tensor field of GemmEpilogueArgs by name (absent: None), every option field.
void bind_gemm_epilogue(nb::module_& m) {
  nb::class_<GemmEpilogueOptions>(m, "GemmEpilogueOptions")
      .def(
          "__init__",
          [](GemmEpilogueOptions* p, Epilogue epilogue, int partial_tile_n, int head_dim, int ignore_index, GemmTile tile, int swizzle,
             GemmRaster raster, int n_slices) {
            new (p) GemmEpilogueOptions{epilogue, partial_tile_n, head_dim, ignore_index, tile, swizzle, raster, n_slices};
          },
          nb::arg("epilogue"), nb::arg("partial_tile_n") = 0, nb::arg("head_dim") = 128, nb::arg("ignore_index") = -100,
          nb::arg("tile") = GemmTile::kAuto, nb::arg("swizzle") = 0, nb::arg("raster") = GemmRaster::kAuto, nb::arg("n_slices") = 0)
      .def_rw("epilogue", &GemmEpilogueOptions::epilogue)
      .def_rw("partial_tile_n", &GemmEpilogueOptions::partial_tile_n)
      .def_rw("head_dim", &GemmEpilogueOptions::head_dim)
      .def_rw("ignore_index", &GemmEpilogueOptions::ignore_index)
      .def_rw("tile", &GemmEpilogueOptions::tile)
      .def_rw("swizzle", &GemmEpilogueOptions::swizzle)
      .def_rw("raster", &GemmEpilogueOptions::raster)
      .def_rw("n_slices", &GemmEpilogueOptions::n_slices);
  nb::class_<GemmEpilogueArgs>(m, "GemmEpilogueArgs")
      .def(
          "__init__",
          [](GemmEpilogueArgs* p, Opt a, Opt w, Opt d, Opt aux, Opt c, Opt c2, Opt zdz, Opt gamma, Opt row_scale, Opt pos, Opt freq,
             Opt alpha, Opt partials, Opt target, Opt target_logit, Opt lse) {
            new (p) GemmEpilogueArgs{opt_view(a, "a"),         opt_view(w, "w"),         opt_view(d, "d"),
                                     opt_view(aux, "aux"),     opt_view(c, "c"),         opt_view(c2, "c2"),
                                     opt_view(zdz, "zdz"),     opt_view(gamma, "gamma"), opt_view(row_scale, "row_scale"),
                                     opt_view(pos, "pos"),     opt_view(freq, "freq"),   opt_view(alpha, "alpha"),
                                     opt_view(partials, "partials"), opt_view(target, "target"),
                                     opt_view(target_logit, "target_logit"), opt_view(lse, "lse")};
          },
          nb::arg("a").none(), nb::arg("w").none(), nb::arg("d").none() = nb::none(), nb::arg("aux").none() = nb::none(),
          nb::arg("c").none() = nb::none(), nb::arg("c2").none() = nb::none(), nb::arg("zdz").none() = nb::none(),
          nb::arg("gamma").none() = nb::none(), nb::arg("row_scale").none() = nb::none(), nb::arg("pos").none() = nb::none(),
          nb::arg("freq").none() = nb::none(), nb::arg("alpha").none() = nb::none(), nb::arg("partials").none() = nb::none(),
          nb::arg("target").none() = nb::none(), nb::arg("target_logit").none() = nb::none(), nb::arg("lse").none() = nb::none());
  ENCORE_BIND_OP(m, "gemm_epilogue", GemmEpilogueArgs, GemmEpilogueOptions);
}

// The finishers: their Args structs by name, and <name>_run(args, <the C++ run's scalars>, stream).
void bind_finishers(nb::module_& m) {
  nb::class_<RmsFinalReduceArgs>(m, "RmsFinalReduceArgs")
      .def(
          "__init__",
          [](RmsFinalReduceArgs* p, Opt partials, Opt r) { new (p) RmsFinalReduceArgs{opt_view(partials, "partials"), opt_view(r, "r")}; },
          nb::arg("partials").none(), nb::arg("r").none());
  m.def(
      "rms_final_reduce_run",
      [](const RmsFinalReduceArgs& args, int64_t hidden, float eps, uintptr_t stream) {
        raise_if_error(run(args, hidden, eps, as_stream(stream)));
      },
      nb::arg("args"), nb::arg("hidden"), nb::arg("eps"), nb::arg("stream") = 0);

  nb::class_<LseFinishArgs>(m, "LseFinishArgs")
      .def(
          "__init__",
          [](LseFinishArgs* p, Opt partials, Opt lse, Opt target, Opt target_logit, Opt loss) {
            new (p) LseFinishArgs{opt_view(partials, "partials"), opt_view(lse, "lse"), opt_view(target, "target"),
                                  opt_view(target_logit, "target_logit"), opt_view(loss, "loss")};
          },
          nb::arg("partials").none(), nb::arg("lse").none(), nb::arg("target").none() = nb::none(),
          nb::arg("target_logit").none() = nb::none(), nb::arg("loss").none() = nb::none());
  m.def(
      "lse_finish_run",
      [](const LseFinishArgs& args, int ignore_index, uintptr_t stream) { raise_if_error(run(args, ignore_index, as_stream(stream))); },
      nb::arg("args"), nb::arg("ignore_index") = -100, nb::arg("stream") = 0);

  // Deterministic sums of the backward epilogues' partials: per row (zdz) or per column (dγ).
  nb::class_<PartialsSumArgs>(m, "PartialsSumArgs")
      .def(
          "__init__",
          [](PartialsSumArgs* p, Opt partials, Opt out) { new (p) PartialsSumArgs{opt_view(partials, "partials"), opt_view(out, "out")}; },
          nb::arg("partials").none(), nb::arg("out").none());
  m.def(
      "partials_sum_run",
      [](const PartialsSumArgs& args, PartialsSum axis, float scale, uintptr_t stream) {
        raise_if_error(run(args, axis, scale, as_stream(stream)));
      },
      nb::arg("args"), nb::arg("axis"), nb::arg("scale") = 1.0f, nb::arg("stream") = 0);

  // Cross-entropy backward on stored logits: dlogits = alpha·(softmax − one-hot), in place when dlogits is logits.
  nb::class_<CrossEntropyBwdArgs>(m, "CrossEntropyBwdArgs")
      .def(
          "__init__",
          [](CrossEntropyBwdArgs* p, Opt logits, Opt lse, Opt target, Opt alpha, Opt dlogits) {
            new (p) CrossEntropyBwdArgs{opt_view(logits, "logits"), opt_view(lse, "lse"), opt_view(target, "target"),
                                        opt_view(alpha, "alpha"), opt_view(dlogits, "dlogits")};
          },
          nb::arg("logits").none(), nb::arg("lse").none(), nb::arg("target").none(), nb::arg("alpha").none() = nb::none(),
          nb::arg("dlogits").none() = nb::none());
  m.def(
      "cross_entropy_bwd_run",
      [](const CrossEntropyBwdArgs& args, int ignore_index, uintptr_t stream) {
        raise_if_error(run(args, ignore_index, as_stream(stream)));
      },
      nb::arg("args"), nb::arg("ignore_index") = -100, nb::arg("stream") = 0);
}

// QK-norm + RoPE after kQkvHeadSqsum, forward (in place) and backward (dx, dq_weight, dk_weight; a CUDA workspace).
void bind_qk_norm_rope(nb::module_& m) {
  nb::class_<QkNormRopeOptions>(m, "QkNormRopeOptions")
      .def(
          "__init__",
          [](QkNormRopeOptions* p, int num_q_heads, int num_kv_heads, int head_dim, float eps) {
            new (p) QkNormRopeOptions{num_q_heads, num_kv_heads, head_dim, eps};
          },
          nb::arg("num_q_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim") = 128, nb::arg("eps") = 1e-6f)
      .def_rw("num_q_heads", &QkNormRopeOptions::num_q_heads)
      .def_rw("num_kv_heads", &QkNormRopeOptions::num_kv_heads)
      .def_rw("head_dim", &QkNormRopeOptions::head_dim)
      .def_rw("eps", &QkNormRopeOptions::eps);
  nb::class_<QkNormRopeArgs>(m, "QkNormRopeArgs")
      .def(
          "__init__",
          [](QkNormRopeArgs* p, Opt qkv, Opt partials, Opt q_weight, Opt k_weight, Opt pos, Opt freq) {
            new (p) QkNormRopeArgs{opt_view(qkv, "qkv"),           opt_view(partials, "partials"), opt_view(q_weight, "q_weight"),
                                   opt_view(k_weight, "k_weight"), opt_view(pos, "pos"),           opt_view(freq, "freq")};
          },
          nb::arg("qkv").none(), nb::arg("partials").none(), nb::arg("q_weight").none(), nb::arg("k_weight").none(), nb::arg("pos").none(),
          nb::arg("freq").none());
  m.def(
      "qk_norm_rope_run",
      [](const QkNormRopeArgs& args, const QkNormRopeOptions& opts, uintptr_t stream) {
        raise_if_error(run(args, opts, as_stream(stream)));
      },
      nb::arg("args"), nb::arg("opts"), nb::arg("stream") = 0);

  nb::class_<QkNormRopeBwdArgs>(m, "QkNormRopeBwdArgs")
      .def(
          "__init__",
          [](QkNormRopeBwdArgs* p, Opt dy, Opt x, Opt partials, Opt q_weight, Opt k_weight, Opt pos, Opt freq, Opt dx, Opt dq_weight,
             Opt dk_weight) {
            new (p) QkNormRopeBwdArgs{opt_view(dy, "dy"),         opt_view(x, "x"),       opt_view(partials, "partials"),
                                      opt_view(q_weight, "q_weight"), opt_view(k_weight, "k_weight"), opt_view(pos, "pos"),
                                      opt_view(freq, "freq"),     opt_view(dx, "dx"),     opt_view(dq_weight, "dq_weight"),
                                      opt_view(dk_weight, "dk_weight")};
          },
          nb::arg("dy").none(), nb::arg("x").none(), nb::arg("partials").none(), nb::arg("q_weight").none(), nb::arg("k_weight").none(),
          nb::arg("pos").none(), nb::arg("freq").none(), nb::arg("dx").none(), nb::arg("dq_weight").none(), nb::arg("dk_weight").none());
  // (its validate is internal to run: _workspace gives the bytes only)
  m.def(
      "qk_norm_rope_backward_workspace",
      [](const QkNormRopeBwdArgs& args, const QkNormRopeOptions& opts) { return workspace_bytes(args, opts); }, nb::arg("args"),
      nb::arg("opts"));
  m.def(
      "qk_norm_rope_backward_run",
      [](const QkNormRopeBwdArgs& args, const QkNormRopeOptions& opts, const Opt& workspace, uintptr_t stream) {
        raise_if_error(run(args, opts, opt_ptr(workspace), as_stream(stream)));
      },
      nb::arg("args"), nb::arg("opts"), nb::arg("workspace").none(), nb::arg("stream") = 0);
}

}  // namespace

void bind_gemm(nb::module_& m) {
  bind_catalogue(m);
  bind_gemm_epilogue(m);
  bind_finishers(m);
  bind_qk_norm_rope(m);
  // Host-side weight preparation (CPU arrays).
  m.def(
      "rope_freq_turns",
      [](int num_heads, int rotary_heads, int head_dim, double base, Array freq) {
        raise_if_error(rope_freq_turns(num_heads, rotary_heads, head_dim, base, to_view(freq, "freq")));
      },
      nb::arg("num_heads"), nb::arg("rotary_heads"), nb::arg("head_dim"), nb::arg("base"), nb::arg("freq"));
  m.def(
      "interleave_gate_up",
      [](Opt gate, Opt up, Opt out) {
        raise_if_error(interleave_gate_up(opt_view(gate, "gate"), opt_view(up, "up"), opt_view(out, "out")));
      },
      nb::arg("gate").none(), nb::arg("up").none(), nb::arg("out").none());
}

}  // namespace encore::python
