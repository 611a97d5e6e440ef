// Bindings of the compositions (the LLaMA block forward).
#include "convert.hpp"
#include "encore/blocks/llama.hpp"
#include "encore/gemm.hpp"

namespace encore::python {

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
}

}  // namespace encore::python
