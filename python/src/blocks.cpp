// Bindings of the compositions (the LLaMA block forward and backward, the first layer's QKV-norm backward,
// the last layer + loss forward and backward).
#include <nanobind/stl/vector.h>

#include <vector>

#include "convert.hpp"
#include "encore/blocks/llama.hpp"
#include "encore/blocks/llama_last.hpp"
#include "encore/gemm.hpp"

namespace encore::python {

namespace {

// One TensorView member of an Args struct and its name (for the errors).
template <class Args>
struct Member {
  const char* name;
  TensorView Args::*field;
};

// Args from a list of arrays, one per member in `members` order.
template <class Args, size_t n>
Args args_from(const std::vector<Array>& arrays, const Member<Args> (&members)[n]) {
  if (arrays.size() != n) throw nb::value_error(("expected " + std::to_string(n) + " arrays, got " + std::to_string(arrays.size())).c_str());
  Args a;
  for (size_t i = 0; i < n; ++i) a.*members[i].field = to_view(arrays[i], members[i].name);
  return a;
}

using L = LlamaLastBlockArgs;
using B = LlamaLastBlockBwdArgs;
constexpr Member<L> kLastNames[] = {{"y0", &L::y0},   {"x0", &L::x0},   {"w0", &L::w0},   {"w1", &L::w1},   {"w2", &L::w2},
                                    {"gamma0", &L::gamma0}, {"gamma_final", &L::gamma_final}, {"w_lm", &L::w_lm}, {"target", &L::target},
                                    {"x1", &L::x1},   {"x2", &L::x2},   {"z1", &L::z1},   {"h2", &L::h2},   {"r1", &L::r1},
                                    {"r2", &L::r2},   {"lse", &L::lse}, {"loss", &L::loss}};
constexpr Member<B> kLastBwdNames[] = {
    {"y0", &B::y0},         {"w0", &B::w0},       {"w1", &B::w1},     {"w2", &B::w2},       {"gamma0", &B::gamma0}, {"gamma_final", &B::gamma_final},
    {"w_lm", &B::w_lm},     {"target", &B::target}, {"x1", &B::x1},   {"x2", &B::x2},       {"z1", &B::z1},         {"h2", &B::h2},
    {"r1", &B::r1},         {"r2", &B::r2},       {"lse", &B::lse},   {"d_loss", &B::d_loss}, {"d_y0", &B::d_y0},   {"d_x0", &B::d_x0},
    {"dw0", &B::dw0},       {"dw1", &B::dw1},     {"dw2", &B::dw2},   {"dw_lm", &B::dw_lm}, {"dgamma0", &B::dgamma0}, {"dgamma_final", &B::dgamma_final}};

// The last layer + loss: the forward's 17 arrays (9 inputs, 8 outputs) and the backward's 24 (16 inputs, 8
// outputs), each in LlamaLastBlockArgs / LlamaLastBlockBwdArgs order.
void bind_last_block(nb::module_& m) {
  m.def("llama_last_block_workspace_bytes", [](const std::vector<Array>& arrays, float eps, int ignore_index) {
    const auto a = args_from<LlamaLastBlockArgs>(arrays, kLastNames);
    raise_if_error(validate(a, LlamaLastBlockOptions{eps, ignore_index}));
    return workspace_bytes(a, LlamaLastBlockOptions{eps, ignore_index});
  });
  m.def("llama_last_block_forward_out", [](const std::vector<Array>& arrays, float eps, int ignore_index, Array workspace, uintptr_t stream) {
    const auto a = args_from<LlamaLastBlockArgs>(arrays, kLastNames);
    raise_if_error(run(a, LlamaLastBlockOptions{eps, ignore_index}, workspace.data(), as_stream(stream)));
  });
  m.def("llama_last_block_backward_workspace_bytes", [](const std::vector<Array>& arrays, int ignore_index) {
    const auto a = args_from<LlamaLastBlockBwdArgs>(arrays, kLastBwdNames);
    raise_if_error(validate(a, LlamaLastBlockBwdOptions{ignore_index}));
    return workspace_bytes(a, LlamaLastBlockBwdOptions{ignore_index});
  });
  m.def("llama_last_block_backward_out", [](const std::vector<Array>& arrays, int ignore_index, Array workspace, uintptr_t stream) {
    const auto a = args_from<LlamaLastBlockBwdArgs>(arrays, kLastBwdNames);
    raise_if_error(run(a, LlamaLastBlockBwdOptions{ignore_index}, workspace.data(), as_stream(stream)));
  });
}

}  // namespace

void bind_blocks(nb::module_& m) {
  auto block_args = [](Array y0, Array x0, Array w0, Array w1, Array w2, Array w3, Array gamma0, Array gamma1, Array pos, Array freq,
                       Array x1, Array x2, Array z1, Array qkv, Array r1, Array r2) {
    return LlamaBlockArgs{to_view(y0, "y0"), to_view(x0, "x0"), to_view(w0, "w0"), to_view(w1, "w1"), to_view(w2, "w2"),
                          to_view(w3, "w3"), to_view(gamma0, "gamma0"), to_view(gamma1, "gamma1"), to_view(pos, "pos"),
                          to_view(freq, "freq"), to_view(x1, "x1"), to_view(x2, "x2"), to_view(z1, "z1"), to_view(qkv, "qkv"),
                          to_view(r1, "r1"), to_view(r2, "r2")};
  };
  m.def("llama_block_workspace_bytes",
        [block_args](Array y0, Array x0, Array w0, Array w1, Array w2, Array w3, Array gamma0, Array gamma1, Array pos, Array freq, Array x1,
                     Array x2, Array z1, Array qkv, Array r1, Array r2, float eps) {
          LlamaBlockArgs a = block_args(y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, x1, x2, z1, qkv, r1, r2);
          raise_if_error(validate(a, LlamaBlockOptions{eps}));
          return workspace_bytes(a, LlamaBlockOptions{eps});
        });
  m.def("llama_block_forward_out",
        [block_args](Array y0, Array x0, Array w0, Array w1, Array w2, Array w3, Array gamma0, Array gamma1, Array pos, Array freq, Array x1,
                     Array x2, Array z1, Array qkv, Array r1, Array r2, float eps, Array workspace, uintptr_t stream) {
          LlamaBlockArgs a = block_args(y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, x1, x2, z1, qkv, r1, r2);
          raise_if_error(run(a, LlamaBlockOptions{eps}, workspace.data(), as_stream(stream)));
        });

  // The backward: 17 inputs (the forward's inputs but x0, its saved outputs, d_qkv, d_x2), then 8 outputs.
  auto bwd_args = [](Array y0, Array w0, Array w1, Array w2, Array w3, Array gamma0, Array gamma1, Array pos, Array freq, Array x1, Array x2,
                     Array z1, Array qkv, Array r1, Array r2, Array d_qkv, Array d_x2, Array d_y0, Array d_x0, Array dw0, Array dw1, Array dw2,
                     Array dw3, Array dgamma0, Array dgamma1) {
    LlamaBlockBwdArgs a;
    a.y0 = to_view(y0, "y0");
    a.w0 = to_view(w0, "w0");
    a.w1 = to_view(w1, "w1");
    a.w2 = to_view(w2, "w2");
    a.w3 = to_view(w3, "w3");
    a.gamma0 = to_view(gamma0, "gamma0");
    a.gamma1 = to_view(gamma1, "gamma1");
    a.pos = to_view(pos, "pos");
    a.freq = to_view(freq, "freq");
    a.x1 = to_view(x1, "x1");
    a.x2 = to_view(x2, "x2");
    a.z1 = to_view(z1, "z1");
    a.qkv = to_view(qkv, "qkv");
    a.r1 = to_view(r1, "r1");
    a.r2 = to_view(r2, "r2");
    a.d_qkv = to_view(d_qkv, "d_qkv");
    a.d_x2 = to_view(d_x2, "d_x2");
    a.d_y0 = to_view(d_y0, "d_y0");
    a.d_x0 = to_view(d_x0, "d_x0");
    a.dw0 = to_view(dw0, "dw0");
    a.dw1 = to_view(dw1, "dw1");
    a.dw2 = to_view(dw2, "dw2");
    a.dw3 = to_view(dw3, "dw3");
    a.dgamma0 = to_view(dgamma0, "dgamma0");
    a.dgamma1 = to_view(dgamma1, "dgamma1");
    return a;
  };
  m.def("llama_block_backward_workspace_bytes",
        [bwd_args](Array y0, Array w0, Array w1, Array w2, Array w3, Array gamma0, Array gamma1, Array pos, Array freq, Array x1, Array x2,
                   Array z1, Array qkv, Array r1, Array r2, Array d_qkv, Array d_x2, Array d_y0, Array d_x0, Array dw0, Array dw1, Array dw2,
                   Array dw3, Array dgamma0, Array dgamma1) {
          LlamaBlockBwdArgs a = bwd_args(y0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, x1, x2, z1, qkv, r1, r2, d_qkv, d_x2, d_y0, d_x0, dw0,
                                         dw1, dw2, dw3, dgamma0, dgamma1);
          raise_if_error(validate(a));
          return workspace_bytes(a);
        });
  m.def("llama_block_backward_out",
        [bwd_args](Array y0, Array w0, Array w1, Array w2, Array w3, Array gamma0, Array gamma1, Array pos, Array freq, Array x1, Array x2,
                   Array z1, Array qkv, Array r1, Array r2, Array d_qkv, Array d_x2, Array d_y0, Array d_x0, Array dw0, Array dw1, Array dw2,
                   Array dw3, Array dgamma0, Array dgamma1, Array workspace, uintptr_t stream) {
          LlamaBlockBwdArgs a = bwd_args(y0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, x1, x2, z1, qkv, r1, r2, d_qkv, d_x2, d_y0, d_x0, dw0,
                                         dw1, dw2, dw3, dgamma0, dgamma1);
          raise_if_error(run(a, workspace.data(), as_stream(stream)));
        });

  // The first layer's QKV-norm backward: x, gamma, w3, pos, freq, r, qkv, d_qkv, d_x_prev (optional), then dx, dw3, dgamma.
  auto qkv_args = [](Array x, Array gamma, Array w3, Array pos, Array freq, Array r, Array qkv, Array d_qkv, Opt d_x_prev, Array dx,
                     Array dw3, Array dgamma) {
    return QkvNormBwdArgs{to_view(x, "x"),         to_view(gamma, "gamma"),         to_view(w3, "w3"),   to_view(pos, "pos"),
                          to_view(freq, "freq"),   to_view(r, "r"),                 to_view(qkv, "qkv"), to_view(d_qkv, "d_qkv"),
                          opt_view(d_x_prev, "d_x_prev"), to_view(dx, "dx"), to_view(dw3, "dw3"), to_view(dgamma, "dgamma")};
  };
  m.def(
      "qkv_norm_backward_workspace_bytes",
      [qkv_args](Array x, Array gamma, Array w3, Array pos, Array freq, Array r, Array qkv, Array d_qkv, Opt d_x_prev, Array dx, Array dw3,
                 Array dgamma) {
        QkvNormBwdArgs a = qkv_args(x, gamma, w3, pos, freq, r, qkv, d_qkv, d_x_prev, dx, dw3, dgamma);
        raise_if_error(validate(a));
        return workspace_bytes(a);
      },
      nb::arg("x"), nb::arg("gamma"), nb::arg("w3"), nb::arg("pos"), nb::arg("freq"), nb::arg("r"), nb::arg("qkv"), nb::arg("d_qkv"),
      nb::arg("d_x_prev").none(), nb::arg("dx"), nb::arg("dw3"), nb::arg("dgamma"));
  m.def(
      "qkv_norm_backward_out",
      [qkv_args](Array x, Array gamma, Array w3, Array pos, Array freq, Array r, Array qkv, Array d_qkv, Opt d_x_prev, Array dx, Array dw3,
                 Array dgamma, Array workspace, uintptr_t stream) {
        QkvNormBwdArgs a = qkv_args(x, gamma, w3, pos, freq, r, qkv, d_qkv, d_x_prev, dx, dw3, dgamma);
        raise_if_error(run(a, workspace.data(), as_stream(stream)));
      },
      nb::arg("x"), nb::arg("gamma"), nb::arg("w3"), nb::arg("pos"), nb::arg("freq"), nb::arg("r"), nb::arg("qkv"), nb::arg("d_qkv"),
      nb::arg("d_x_prev").none(), nb::arg("dx"), nb::arg("dw3"), nb::arg("dgamma"), nb::arg("workspace"), nb::arg("stream"));

  bind_last_block(m);
}

}  // namespace encore::python
