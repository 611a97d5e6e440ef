// Bindings of the quant family (FP8 group quantization).
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
}

}  // namespace encore::python
