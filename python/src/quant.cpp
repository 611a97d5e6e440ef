// Bindings of the quant family: the Args / Options structs with named fields, per op the two calls
// <op>_workspace and <op>_run (convert.hpp), and the CPU/CUDA inverses (run without a workspace).
// fp8 e4m3 tensors arrive as their bytes (uint8 arrays: opt_fp8_view).
#include "convert.hpp"
#include "encore/quant.hpp"

namespace encore::python {

void bind_quant(nb::module_& m) {
  nb::class_<Fp8GroupQuantOptions>(m, "Fp8GroupQuantOptions")
      .def(
          "__init__",
          [](Fp8GroupQuantOptions* p, int group_size, bool power_of_two_scales, float eps) {
            new (p) Fp8GroupQuantOptions{group_size, power_of_two_scales, eps};
          },
          nb::arg("group_size") = 128, nb::arg("power_of_two_scales") = false, nb::arg("eps") = 1e-10f)
      .def_rw("group_size", &Fp8GroupQuantOptions::group_size)
      .def_rw("power_of_two_scales", &Fp8GroupQuantOptions::power_of_two_scales)
      .def_rw("eps", &Fp8GroupQuantOptions::eps);
  nb::class_<Fp8GroupQuantArgs>(m, "Fp8GroupQuantArgs")
      .def(
          "__init__",
          [](Fp8GroupQuantArgs* p, Opt x, Opt q, Opt scales) {
            new (p) Fp8GroupQuantArgs{opt_view(x, "x"), opt_fp8_view(q, "q"), opt_view(scales, "scales")};
          },
          nb::arg("x").none(), nb::arg("q").none(), nb::arg("scales").none());
  nb::class_<Fp8GroupDequantArgs>(m, "Fp8GroupDequantArgs")
      .def(
          "__init__",
          [](Fp8GroupDequantArgs* p, Opt q, Opt scales, Opt x) {
            new (p) Fp8GroupDequantArgs{opt_fp8_view(q, "q"), opt_view(scales, "scales"), opt_view(x, "x")};
          },
          nb::arg("q").none(), nb::arg("scales").none(), nb::arg("x").none());

  // MXFP8 / NVFP4: scales as raw bytes (MXFP8's e8m0 as uint8, NVFP4's e4m3 through opt_fp8_view).
  nb::enum_<MxScaleLayout>(m, "MxScaleLayout").value("row_major", MxScaleLayout::kRowMajor).value("swizzled", MxScaleLayout::kSwizzled);
  nb::enum_<MxScaleRounding>(m, "MxScaleRounding").value("floor", MxScaleRounding::kFloor).value("rceil", MxScaleRounding::kRceil);
  nb::class_<MxQuantOptions>(m, "MxQuantOptions")
      .def(
          "__init__",
          [](MxQuantOptions* p, MxScaleLayout scale_layout, MxScaleRounding rounding, float global_scale) {
            new (p) MxQuantOptions{scale_layout, rounding, global_scale};
          },
          nb::arg("scale_layout") = MxScaleLayout::kRowMajor, nb::arg("rounding") = MxScaleRounding::kFloor, nb::arg("global_scale") = 0.0f)
      .def_rw("scale_layout", &MxQuantOptions::scale_layout)
      .def_rw("rounding", &MxQuantOptions::rounding)
      .def_rw("global_scale", &MxQuantOptions::global_scale);
  nb::class_<Mxfp8QuantArgs>(m, "Mxfp8QuantArgs")
      .def(
          "__init__",
          [](Mxfp8QuantArgs* p, Opt x, Opt q, Opt scales) {
            new (p) Mxfp8QuantArgs{opt_view(x, "x"), opt_fp8_view(q, "q"), opt_view(scales, "scales")};
          },
          nb::arg("x").none(), nb::arg("q").none(), nb::arg("scales").none());
  nb::class_<Nvfp4QuantArgs>(m, "Nvfp4QuantArgs")
      .def(
          "__init__",
          [](Nvfp4QuantArgs* p, Opt x, Opt q, Opt scales, Opt global_scale) {
            new (p) Nvfp4QuantArgs{opt_view(x, "x"), opt_view(q, "q"), opt_fp8_view(scales, "scales"), opt_view(global_scale, "global_scale")};
          },
          nb::arg("x").none(), nb::arg("q").none(), nb::arg("scales").none(), nb::arg("global_scale").none());
  nb::class_<Mxfp8DequantArgs>(m, "Mxfp8DequantArgs")
      .def(
          "__init__",
          [](Mxfp8DequantArgs* p, Opt q, Opt scales, Opt x) {
            new (p) Mxfp8DequantArgs{opt_fp8_view(q, "q"), opt_view(scales, "scales"), opt_view(x, "x")};
          },
          nb::arg("q").none(), nb::arg("scales").none(), nb::arg("x").none());
  nb::class_<Nvfp4DequantArgs>(m, "Nvfp4DequantArgs")
      .def(
          "__init__",
          [](Nvfp4DequantArgs* p, Opt q, Opt scales, Opt global_scale, Opt x) {
            new (p) Nvfp4DequantArgs{opt_view(q, "q"), opt_fp8_view(scales, "scales"), opt_view(global_scale, "global_scale"), opt_view(x, "x")};
          },
          nb::arg("q").none(), nb::arg("scales").none(), nb::arg("global_scale").none(), nb::arg("x").none());

  ENCORE_BIND_OP(m, "fp8_group_quant", Fp8GroupQuantArgs, Fp8GroupQuantOptions);
  ENCORE_BIND_OP(m, "mxfp8_quant", Mxfp8QuantArgs, MxQuantOptions);
  ENCORE_BIND_OP(m, "nvfp4_quant", Nvfp4QuantArgs, MxQuantOptions);
  // The inverses: run(args, opts[, stream]) only (no validate / workspace).
  m.def(
      "fp8_group_dequant_run",
      [](const Fp8GroupDequantArgs& args, const Fp8GroupQuantOptions& opts) { raise_if_error(run(args, opts)); }, nb::arg("args"),
      nb::arg("opts"));
  m.def(
      "mxfp8_dequant_run",
      [](const Mxfp8DequantArgs& args, const MxQuantOptions& opts, uintptr_t stream) { raise_if_error(run(args, opts, as_stream(stream))); },
      nb::arg("args"), nb::arg("opts"), nb::arg("stream") = 0);
  m.def(
      "nvfp4_dequant_run",
      [](const Nvfp4DequantArgs& args, const MxQuantOptions& opts, uintptr_t stream) { raise_if_error(run(args, opts, as_stream(stream))); },
      nb::arg("args"), nb::arg("opts"), nb::arg("stream") = 0);
}

}  // namespace encore::python
