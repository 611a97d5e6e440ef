// encore._encore: one converter (convert.hpp: DLPack ndarray -> TensorView) and one line per op,
// in one binding file per family. Outputs are allocated by the Python caller; streams arrive as
// integers. Status errors become ValueError (invalid argument) or RuntimeError (anything else)
// carrying the C++ message.
#include "convert.hpp"
#include "encore/core/device_info.hpp"

namespace encore::python {
void bind_norm(nb::module_& m);
void bind_quant(nb::module_& m);
void bind_gemm(nb::module_& m);
void bind_blocks(nb::module_& m);
void bind_kda(nb::module_& m);
void bind_moe(nb::module_& m);
void bind_moe_ep(nb::module_& m);
}  // namespace encore::python

NB_MODULE(_encore, m) {
  using namespace encore::python;
  nb::set_leak_warnings(false);  // options cached by the Python side live until interpreter exit
  m.doc() = "encore: fused transformer kernels (CPU reference backend + CUDA sm_90a)";
  m.attr("__version__") = ENCORE_VERSION;  // project(encore VERSION ...), python/CMakeLists.txt
  m.def("built_with_cuda", &encore::built_with_cuda);
  m.def("cuda_device_count", &encore::cuda_device_count);
  bind_norm(m);
  bind_quant(m);
  bind_gemm(m);
  bind_blocks(m);
  bind_kda(m);
  bind_moe(m);
  bind_moe_ep(m);
}
