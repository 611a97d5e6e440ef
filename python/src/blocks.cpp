// Bindings of the compositions (the LLaMA block forward and backward, the first layer's QKV-norm backward,
// the last layer + loss forward and backward): each Args struct with its tensor fields by name (in the
// C++ field order), the Options structs, and per op <op>_workspace / <op>_run (convert.hpp; the two
// backwards without an Options struct take none).
#include <cstddef>
#include <utility>

#include "convert.hpp"
#include "encore/blocks/llama.hpp"
#include "encore/blocks/llama_last.hpp"

namespace encore::python {

namespace {

// One TensorView field of an Args struct: its C++ name (the keyword) and member.
template <class Args>
struct Field {
  const char* name;
  TensorView Args::*member;
};

template <class T, size_t>
using Each = T;

// Args.__init__(<field>=array or None, ...) over `fields` (static storage), in their order.
template <class Args, size_t n, size_t... i>
void bind_fields(nb::class_<Args>& cls, const Field<Args> (&fields)[n], std::index_sequence<i...>) {
  const Field<Args>* f = fields;
  cls.def(
      "__init__",
      [f](Args* p, const Each<Opt, i>&... arrays) {
        Args a{};
        ((a.*f[i].member = opt_view(arrays, f[i].name)), ...);
        new (p) Args(a);
      },
      nb::arg(fields[i].name).none()...);
}

template <class Args, size_t n>
void bind_args(nb::module_& m, const char* name, const Field<Args> (&fields)[n]) {
  nb::class_<Args> cls(m, name);
  bind_fields(cls, fields, std::make_index_sequence<n>());
}

// An op whose C++ API takes no Options struct: <name>_workspace(args) -> bytes (validates first) and
// <name>_run(args, workspace, stream) (an absent workspace where one is needed is refused, naming the size).
template <class A>
void bind_op_without_options(nb::module_& m, const char* workspace_name, const char* run_name) {
  m.def(
      workspace_name,
      [](const A& a) {
        raise_if_error(validate(a));
        return workspace_bytes(a);
      },
      nb::arg("args"));
  m.def(
      run_name,
      [](const A& a, const Opt& workspace, uintptr_t stream) {
        if (!workspace) {
          const size_t need = workspace_bytes(a);
          if (need) throw nb::value_error(("workspace: this call needs " + std::to_string(need) + " bytes (query <op>_workspace)").c_str());
        }
        raise_if_error(run(a, opt_ptr(workspace), as_stream(stream)));
      },
      nb::arg("args"), nb::arg("workspace").none(), nb::arg("stream") = 0);
}

using F = LlamaBlockArgs;
constexpr Field<F> kBlockFields[] = {{"y0", &F::y0},         {"x0", &F::x0},         {"w0", &F::w0},   {"w1", &F::w1},
                                     {"w2", &F::w2},         {"w3", &F::w3},         {"gamma0", &F::gamma0}, {"gamma1", &F::gamma1},
                                     {"pos", &F::pos},       {"freq", &F::freq},     {"x1", &F::x1},   {"x2", &F::x2},
                                     {"z1", &F::z1},         {"qkv", &F::qkv},       {"r1", &F::r1},   {"r2", &F::r2}};
using B = LlamaBlockBwdArgs;
constexpr Field<B> kBlockBwdFields[] = {
    {"y0", &B::y0},         {"w0", &B::w0},       {"w1", &B::w1},         {"w2", &B::w2},   {"w3", &B::w3},   {"gamma0", &B::gamma0},
    {"gamma1", &B::gamma1}, {"pos", &B::pos},     {"freq", &B::freq},     {"x1", &B::x1},   {"x2", &B::x2},   {"z1", &B::z1},
    {"qkv", &B::qkv},       {"r1", &B::r1},       {"r2", &B::r2},         {"d_qkv", &B::d_qkv}, {"d_x2", &B::d_x2}, {"d_y0", &B::d_y0},
    {"d_x0", &B::d_x0},     {"dw0", &B::dw0},     {"dw1", &B::dw1},       {"dw2", &B::dw2}, {"dw3", &B::dw3}, {"dgamma0", &B::dgamma0},
    {"dgamma1", &B::dgamma1}};
using Q = QkvNormBwdArgs;
constexpr Field<Q> kQkvNormBwdFields[] = {{"x", &Q::x},     {"gamma", &Q::gamma}, {"w3", &Q::w3},       {"pos", &Q::pos},
                                          {"freq", &Q::freq}, {"r", &Q::r},       {"qkv", &Q::qkv},     {"d_qkv", &Q::d_qkv},
                                          {"d_x_prev", &Q::d_x_prev}, {"dx", &Q::dx}, {"dw3", &Q::dw3}, {"dgamma", &Q::dgamma}};
using L = LlamaLastBlockArgs;
constexpr Field<L> kLastFields[] = {{"y0", &L::y0},   {"x0", &L::x0},   {"w0", &L::w0},   {"w1", &L::w1},   {"w2", &L::w2},
                                    {"gamma0", &L::gamma0}, {"gamma_final", &L::gamma_final}, {"w_lm", &L::w_lm}, {"target", &L::target},
                                    {"x1", &L::x1},   {"x2", &L::x2},   {"z1", &L::z1},   {"h2", &L::h2},   {"r1", &L::r1},
                                    {"r2", &L::r2},   {"lse", &L::lse}, {"loss", &L::loss}};
using LB = LlamaLastBlockBwdArgs;
constexpr Field<LB> kLastBwdFields[] = {
    {"y0", &LB::y0},       {"w0", &LB::w0},         {"w1", &LB::w1},     {"w2", &LB::w2},           {"gamma0", &LB::gamma0},
    {"gamma_final", &LB::gamma_final}, {"w_lm", &LB::w_lm}, {"target", &LB::target}, {"x1", &LB::x1}, {"x2", &LB::x2},
    {"z1", &LB::z1},       {"h2", &LB::h2},         {"r1", &LB::r1},     {"r2", &LB::r2},           {"lse", &LB::lse},
    {"d_loss", &LB::d_loss}, {"d_y0", &LB::d_y0},   {"d_x0", &LB::d_x0}, {"dw0", &LB::dw0},         {"dw1", &LB::dw1},
    {"dw2", &LB::dw2},     {"dw_lm", &LB::dw_lm},   {"dgamma0", &LB::dgamma0}, {"dgamma_final", &LB::dgamma_final}};

}  // namespace

void bind_blocks(nb::module_& m) {
  // The shifted LLaMA block.
  nb::class_<LlamaBlockOptions>(m, "LlamaBlockOptions")
      .def("__init__", [](LlamaBlockOptions* p, float eps) { new (p) LlamaBlockOptions{eps}; }, nb::arg("eps") = 1e-5f)
      .def_rw("eps", &LlamaBlockOptions::eps);
  bind_args(m, "LlamaBlockArgs", kBlockFields);
  ENCORE_BIND_OP(m, "llama_block_forward", LlamaBlockArgs, LlamaBlockOptions);
  bind_args(m, "LlamaBlockBwdArgs", kBlockBwdFields);
  bind_op_without_options<LlamaBlockBwdArgs>(m, "llama_block_backward_workspace", "llama_block_backward_run");
  // The first layer's QKV-norm backward (d_x_prev may be None).
  bind_args(m, "QkvNormBwdArgs", kQkvNormBwdFields);
  bind_op_without_options<QkvNormBwdArgs>(m, "qkv_norm_backward_workspace", "qkv_norm_backward_run");

  // The last layer + loss.
  nb::class_<LlamaLastBlockOptions>(m, "LlamaLastBlockOptions")
      .def(
          "__init__", [](LlamaLastBlockOptions* p, float eps, int ignore_index) { new (p) LlamaLastBlockOptions{eps, ignore_index}; },
          nb::arg("eps") = 1e-5f, nb::arg("ignore_index") = -100)
      .def_rw("eps", &LlamaLastBlockOptions::eps)
      .def_rw("ignore_index", &LlamaLastBlockOptions::ignore_index);
  bind_args(m, "LlamaLastBlockArgs", kLastFields);
  ENCORE_BIND_OP(m, "llama_last_block_forward", LlamaLastBlockArgs, LlamaLastBlockOptions);
  nb::class_<LlamaLastBlockBwdOptions>(m, "LlamaLastBlockBwdOptions")
      .def("__init__", [](LlamaLastBlockBwdOptions* p, int ignore_index) { new (p) LlamaLastBlockBwdOptions{ignore_index}; },
           nb::arg("ignore_index") = -100)
      .def_rw("ignore_index", &LlamaLastBlockBwdOptions::ignore_index);
  bind_args(m, "LlamaLastBlockBwdArgs", kLastBwdFields);
  ENCORE_BIND_OP(m, "llama_last_block_backward", LlamaLastBlockBwdArgs, LlamaLastBlockBwdOptions);
}

}  // namespace encore::python
