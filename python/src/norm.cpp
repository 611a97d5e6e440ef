// Bindings of the norm family (rms_norm, add_rms_norm, qk_norm).
#include "convert.hpp"
#include "encore/norm.hpp"

namespace encore::python {

void bind_norm(nb::module_& m) {
  m.def("rms_norm_out",
        [](Array x, Array weight, Array y, float eps, float weight_offset, uintptr_t stream) {
          RmsNormArgs a{to_view(x, "x"), to_view(weight, "weight"), to_view(y, "y")};
          raise_if_error(run(a, RmsNormOptions{eps, weight_offset}, nullptr, as_stream(stream)));
        },
        nb::arg("x"), nb::arg("weight"), nb::arg("y"), nb::arg("eps"), nb::arg("weight_offset"), nb::arg("stream"));

  m.def("add_rms_norm_out",
        [](Array x, Array residual, Array weight, Array y, Array h, float eps, float weight_offset, uintptr_t stream) {
          AddRmsNormArgs a{to_view(x, "x"), to_view(residual, "residual"), to_view(weight, "weight"), to_view(y, "y"),
                           to_view(h, "h")};
          raise_if_error(run(a, RmsNormOptions{eps, weight_offset}, nullptr, as_stream(stream)));
        },
        nb::arg("x"), nb::arg("residual"), nb::arg("weight"), nb::arg("y"), nb::arg("h"), nb::arg("eps"),
        nb::arg("weight_offset"), nb::arg("stream"));

  m.def("qk_norm_",
        [](Array qkv, Array q_weight, Array k_weight, int num_q_heads, int num_kv_heads, int head_dim, float eps,
           float weight_offset, uintptr_t stream) {
          QkNormArgs a{to_view(qkv, "qkv"), to_view(q_weight, "q_weight"), to_view(k_weight, "k_weight")};
          raise_if_error(run(a, QkNormOptions{num_q_heads, num_kv_heads, head_dim, eps, weight_offset}, nullptr, as_stream(stream)));
        },
        nb::arg("qkv"), nb::arg("q_weight"), nb::arg("k_weight"), nb::arg("num_q_heads"), nb::arg("num_kv_heads"),
        nb::arg("head_dim"), nb::arg("eps"), nb::arg("weight_offset"), nb::arg("stream"));
}

}  // namespace encore::python
