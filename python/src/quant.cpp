// Bindings of the quant family (FP8 group quantization; MXFP8 / NVFP4 on the CPU backend).
#include "convert.hpp"
#include "encore/quant.hpp"

namespace encore::python {

void bind_quant(nb::module_& m) {
  m.def("fp8_group_quant_out",
        [](Array x, Array q, Array scales, bool power_of_two, float eps, uintptr_t stream) {
          Fp8GroupQuantOptions o;
          o.power_of_two_scales = power_of_two;
          o.eps = eps;
          raise_if_error(run(Fp8GroupQuantArgs{to_view(x, "x"), to_fp8_view(q, "q"), to_view(scales, "scales")}, o, nullptr,
                             as_stream(stream)));
        },
        nb::arg("x"), nb::arg("q"), nb::arg("scales"), nb::arg("power_of_two"), nb::arg("eps"), nb::arg("stream"));

  m.def("fp8_group_dequant_out",
        [](Array q, Array scales, Array x) {
          raise_if_error(run(Fp8GroupDequantArgs{to_fp8_view(q, "q"), to_view(scales, "scales"), to_view(x, "x")}, Fp8GroupQuantOptions{}));
        },
        nb::arg("q"), nb::arg("scales"), nb::arg("x"));

  // MXFP8 / NVFP4: the scales arrive as raw bytes (uint8; NVFP4's e4m3 scales through to_fp8_view).
  auto mx_options = [](bool swizzled, bool rceil, float global) {
    MxQuantOptions o;
    o.scale_layout = swizzled ? MxScaleLayout::kSwizzled : MxScaleLayout::kRowMajor;
    o.rounding = rceil ? MxScaleRounding::kRceil : MxScaleRounding::kFloor;
    o.global_scale = global;
    return o;
  };
  m.def("mxfp8_quant_out",
        [=](Array x, Array q, Array scales, bool swizzled, bool rceil) {
          raise_if_error(run(Mxfp8QuantArgs{to_view(x, "x"), to_fp8_view(q, "q"), to_view(scales, "scales")}, mx_options(swizzled, rceil, 0.f)));
        },
        nb::arg("x"), nb::arg("q"), nb::arg("scales"), nb::arg("swizzled"), nb::arg("rceil"));
  m.def("mxfp8_dequant_out",
        [=](Array q, Array scales, Array x, bool swizzled) {
          raise_if_error(run(Mxfp8DequantArgs{to_fp8_view(q, "q"), to_view(scales, "scales"), to_view(x, "x")}, mx_options(swizzled, false, 0.f)));
        },
        nb::arg("q"), nb::arg("scales"), nb::arg("x"), nb::arg("swizzled"));
  m.def("nvfp4_quant_out",
        [=](Array x, Array q, Array scales, Array global_scale, bool swizzled, float given_global) {
          raise_if_error(run(Nvfp4QuantArgs{to_view(x, "x"), to_view(q, "q"), to_fp8_view(scales, "scales"), to_view(global_scale, "global_scale")},
                             mx_options(swizzled, false, given_global)));
        },
        nb::arg("x"), nb::arg("q"), nb::arg("scales"), nb::arg("global_scale"), nb::arg("swizzled"), nb::arg("given_global"));
  m.def("nvfp4_dequant_out",
        [=](Array q, Array scales, Array global_scale, Array x, bool swizzled) {
          raise_if_error(run(Nvfp4DequantArgs{to_view(q, "q"), to_fp8_view(scales, "scales"), to_view(global_scale, "global_scale"), to_view(x, "x")},
                             mx_options(swizzled, false, 0.f)));
        },
        nb::arg("q"), nb::arg("scales"), nb::arg("global_scale"), nb::arg("x"), nb::arg("swizzled"));
}

}  // namespace encore::python
