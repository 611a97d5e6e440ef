// Bindings of the norm family: the Args / Options structs with named fields, and per op the two
// calls <op>_workspace and <op>_run (convert.hpp).
#include "convert.hpp"
#include "encore/norm.hpp"

namespace encore::python {

void bind_norm(nb::module_& m) {
  nb::class_<RmsNormOptions>(m, "RmsNormOptions")
      .def(
          "__init__", [](RmsNormOptions* p, float eps, float weight_offset) { new (p) RmsNormOptions{eps, weight_offset}; },
          nb::arg("eps") = 1e-6f, nb::arg("weight_offset") = 0.0f)
      .def_rw("eps", &RmsNormOptions::eps)
      .def_rw("weight_offset", &RmsNormOptions::weight_offset);
  nb::class_<RmsNormArgs>(m, "RmsNormArgs")
      .def(
          "__init__",
          [](RmsNormArgs* p, Opt x, Opt weight, Opt y) {
            new (p) RmsNormArgs{opt_view(x, "x"), opt_view(weight, "weight"), opt_view(y, "y")};
          },
          nb::arg("x").none(), nb::arg("weight").none(), nb::arg("y").none());
  nb::class_<AddRmsNormArgs>(m, "AddRmsNormArgs")
      .def(
          "__init__",
          [](AddRmsNormArgs* p, Opt x, Opt residual, Opt weight, Opt y, Opt h) {
            new (p) AddRmsNormArgs{opt_view(x, "x"), opt_view(residual, "residual"), opt_view(weight, "weight"), opt_view(y, "y"),
                                   opt_view(h, "h")};
          },
          nb::arg("x").none(), nb::arg("residual").none(), nb::arg("weight").none(), nb::arg("y").none(), nb::arg("h").none());
  nb::class_<QkNormOptions>(m, "QkNormOptions")
      .def(
          "__init__",
          [](QkNormOptions* p, int num_q_heads, int num_kv_heads, int head_dim, float eps, float weight_offset) {
            new (p) QkNormOptions{num_q_heads, num_kv_heads, head_dim, eps, weight_offset};
          },
          nb::arg("num_q_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim") = 128, nb::arg("eps") = 1e-6f,
          nb::arg("weight_offset") = 0.0f);
  nb::class_<QkNormArgs>(m, "QkNormArgs")
      .def(
          "__init__",
          [](QkNormArgs* p, Opt qkv, Opt q_weight, Opt k_weight) {
            new (p) QkNormArgs{opt_view(qkv, "qkv"), opt_view(q_weight, "q_weight"), opt_view(k_weight, "k_weight")};
          },
          nb::arg("qkv").none(), nb::arg("q_weight").none(), nb::arg("k_weight").none());

  ENCORE_BIND_OP(m, "rms_norm", RmsNormArgs, RmsNormOptions);
  ENCORE_BIND_OP(m, "add_rms_norm", AddRmsNormArgs, RmsNormOptions);
  ENCORE_BIND_OP(m, "qk_norm", QkNormArgs, QkNormOptions);
}

}  // namespace encore::python
