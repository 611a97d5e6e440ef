// encore._encore: one converter (DLPack ndarray -> TensorView) and one line per op. Outputs are
// allocated by the Python caller; streams arrive as integers. Status errors become ValueError
// (invalid argument) or RuntimeError (anything else) carrying the C++ message.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>

#include "encore/core/device_info.hpp"
#include "encore/gemm_epilogue.hpp"
#include "encore/kda.hpp"
#include "encore/llama_block.hpp"
#include "encore/norm.hpp"
#include "encore/quant.hpp"

namespace nb = nanobind;
using namespace encore;

namespace {

using Array = nb::ndarray<>;  // any dtype, device and strides

DType to_dtype(const nb::dlpack::dtype& t, const char* name) {
  using C = nb::dlpack::dtype_code;
  const auto code = C(t.code);
  if (t.lanes == 1) {
    if (code == C::Bfloat && t.bits == 16) return DType::kBF16;
    if (code == C::Float && t.bits == 16) return DType::kFP16;
    if (code == C::Float && t.bits == 32) return DType::kFP32;
    if (code == C::Float && t.bits == 64) return DType::kFP64;
    if (code == C::Int && t.bits == 32) return DType::kInt32;
    if (code == C::Int && t.bits == 64) return DType::kInt64;
  }
  throw nb::value_error((std::string(name) + ": unsupported array dtype (code " + std::to_string(t.code) + ", " +
                         std::to_string(t.bits) + " bits)").c_str());
}

// Data, device, shape and strides; the dtype is left to the caller.
TensorView to_view_raw(const Array& a, const char* name) {
  if (a.ndim() > size_t(TensorView::kMaxDims))
    throw nb::value_error((std::string(name) + ": more than 6 dimensions").c_str());
  TensorView v;
  v.data = a.data();
  const int dev = a.device_type();
  if (dev == nb::device::cpu::value) v.device = {DeviceType::kCPU, 0};
  else if (dev == nb::device::cuda::value) v.device = {DeviceType::kCUDA, int(a.device_id())};
  else throw nb::value_error((std::string(name) + ": arrays must live on the CPU or a CUDA device").c_str());
  v.ndim = int(a.ndim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = int64_t(a.shape(i));
    v.strides[i] = int64_t(a.stride(i));
  }
  return v;
}

TensorView to_view(const Array& a, const char* name) {
  TensorView v = to_view_raw(a, name);
  v.dtype = to_dtype(a.dtype(), name);
  return v;
}

// An fp8 e4m3 tensor arrives as raw bytes (uint8 / int8 arrays: numpy has no fp8 dtype, and the
// Python side passes torch float8 tensors as uint8 views).
TensorView to_fp8_view(const Array& a, const char* name) {
  const auto t = a.dtype();
  using C = nb::dlpack::dtype_code;
  if (!((C(t.code) == C::UInt || C(t.code) == C::Int) && t.bits == 8 && t.lanes == 1))
    throw nb::value_error((std::string(name) + ": expected the fp8 e4m3 bytes as a uint8 array").c_str());
  TensorView v = to_view_raw(a, name);
  v.dtype = DType::kFP8E4M3;
  return v;
}

void raise_if_error(const Status& st) {
  if (st.is_ok()) return;
  if (st.code() == StatusCode::kInvalidArgument) throw nb::value_error(st.message().c_str());
  throw std::runtime_error(st.to_string());
}

Stream as_stream(uintptr_t s) { return reinterpret_cast<Stream>(s); }

using Opt = std::optional<Array>;
TensorView opt_view(const Opt& a, const char* name) { return a ? to_view(*a, name) : TensorView{}; }
void* opt_ptr(const Opt& a) { return a ? a->data() : nullptr; }

}  // namespace

NB_MODULE(_encore, m) {
  m.doc() = "encore: fused transformer kernels (CPU reference backend + CUDA sm_90a)";
  m.def("built_with_cuda", &built_with_cuda);
  m.def("cuda_device_count", &cuda_device_count);

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

  m.def("fp8_group_quant_out",
        [](Array x, Array q, Array scales, bool power_of_two, float eps, uintptr_t stream) {
          Fp8GroupQuantOptions o;
          o.power_of_two_scales = power_of_two;
          o.eps = eps;
          raise_if_error(run(Fp8GroupQuantArgs{to_view(x, "x"), to_fp8_view(q, "q"), to_view(scales, "scales")}, o, nullptr,
                             as_stream(stream)));
        },
        nb::arg("x"), nb::arg("q"), nb::arg("scales"), nb::arg("power_of_two"), nb::arg("eps"), nb::arg("stream"));

  m.def("gemm_epilogue_out",
        [](int epilogue, Array a, Array w, Opt d, Opt aux, Opt c, Opt gamma, Opt row_scale, Opt pos, Opt freq, Opt alpha, Opt partials,
           Opt target, Opt target_logit, int partial_tile_n, int head_dim, int ignore_index, int tile, uintptr_t stream) {
          GemmEpilogueArgs g;
          g.a = to_view(a, "a");
          g.w = to_view(w, "w");
          g.d = opt_view(d, "d");
          g.aux = opt_view(aux, "aux");
          g.c = opt_view(c, "c");
          g.gamma = opt_view(gamma, "gamma");
          g.row_scale = opt_view(row_scale, "row_scale");
          g.pos = opt_view(pos, "pos");
          g.freq = opt_view(freq, "freq");
          g.alpha = opt_view(alpha, "alpha");
          g.partials = opt_view(partials, "partials");
          g.target = opt_view(target, "target");
          g.target_logit = opt_view(target_logit, "target_logit");
          GemmEpilogueOptions o;
          o.epilogue = Epilogue(epilogue);
          o.partial_tile_n = partial_tile_n;
          o.head_dim = head_dim;
          o.ignore_index = ignore_index;
          o.tile = GemmTile(tile);
          raise_if_error(run(g, o, nullptr, as_stream(stream)));
        },
        nb::arg("epilogue"), nb::arg("a"), nb::arg("w"), nb::arg("d").none(), nb::arg("aux").none(), nb::arg("c").none(),
        nb::arg("gamma").none(), nb::arg("row_scale").none(), nb::arg("pos").none(), nb::arg("freq").none(), nb::arg("alpha").none(),
        nb::arg("partials").none(), nb::arg("target").none(), nb::arg("target_logit").none(), nb::arg("partial_tile_n"),
        nb::arg("head_dim"), nb::arg("ignore_index"), nb::arg("tile"), nb::arg("stream"));
  m.def("gemm_partial_tile_n", [](int e, int64_t M, int64_t N, int64_t K) { return gemm_partial_tile_n(Epilogue(e), M, N, K); });

  m.def("rms_final_reduce_out",
        [](Array partials, Array r, int64_t hidden, float eps, uintptr_t stream) {
          raise_if_error(run(RmsFinalReduceArgs{to_view(partials, "partials"), to_view(r, "r")}, hidden, eps, as_stream(stream)));
        },
        nb::arg("partials"), nb::arg("r"), nb::arg("hidden"), nb::arg("eps"), nb::arg("stream"));
  m.def("lse_finish_out",
        [](Array partials, Array lse, Opt target, Opt target_logit, Opt loss, int ignore_index, uintptr_t stream) {
          LseFinishArgs a{to_view(partials, "partials"), to_view(lse, "lse"), opt_view(target, "target"), opt_view(target_logit, "target_logit"),
                          opt_view(loss, "loss")};
          raise_if_error(run(a, ignore_index, as_stream(stream)));
        },
        nb::arg("partials"), nb::arg("lse"), nb::arg("target").none(), nb::arg("target_logit").none(), nb::arg("loss").none(),
        nb::arg("ignore_index"), nb::arg("stream"));
  m.def("qk_norm_rope_",
        [](Array qkv, Array partials, Array q_weight, Array k_weight, Array pos, Array freq, int num_q_heads, int num_kv_heads,
           int head_dim, float eps, uintptr_t stream) {
          QkNormRopeArgs a{to_view(qkv, "qkv"), to_view(partials, "partials"), to_view(q_weight, "q_weight"), to_view(k_weight, "k_weight"),
                           to_view(pos, "pos"), to_view(freq, "freq")};
          raise_if_error(run(a, QkNormRopeOptions{num_q_heads, num_kv_heads, head_dim, eps}, as_stream(stream)));
        },
        nb::arg("qkv"), nb::arg("partials"), nb::arg("q_weight"), nb::arg("k_weight"), nb::arg("pos"), nb::arg("freq"),
        nb::arg("num_q_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"), nb::arg("eps"), nb::arg("stream"));
  m.def("rope_freq_turns_out",
        [](int num_heads, int rotary_heads, int head_dim, double base, Array freq) {
          raise_if_error(rope_freq_turns(num_heads, rotary_heads, head_dim, base, to_view(freq, "freq")));
        },
        nb::arg("num_heads"), nb::arg("rotary_heads"), nb::arg("head_dim"), nb::arg("base"), nb::arg("freq"));
  m.def("interleave_gate_up_out",
        [](Array gate, Array up, Array out) { raise_if_error(interleave_gate_up(to_view(gate, "gate"), to_view(up, "up"), to_view(out, "out"))); },
        nb::arg("gate"), nb::arg("up"), nb::arg("out"));

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

  auto kda_args = [](Array q, Array k, Array v, Array g, Array beta, const Opt& h0, const Opt& A_log, const Opt& dt_bias, const Opt& cu,
                     const Opt& o, const Opt& fin) {
    KdaForwardArgs a;
    a.q = to_view(q, "q");
    a.k = to_view(k, "k");
    a.v = to_view(v, "v");
    a.g = to_view(g, "g");
    a.beta = to_view(beta, "beta");
    a.initial_state = opt_view(h0, "initial_state");
    a.A_log = opt_view(A_log, "A_log");
    a.dt_bias = opt_view(dt_bias, "dt_bias");
    a.cu_seqlens = opt_view(cu, "cu_seqlens");
    a.o = opt_view(o, "o");
    a.final_state = opt_view(fin, "final_state");
    return a;
  };
  auto kda_residuals = [](const Opt& G, const Opt& Aqk, const Opt& Akk, const Opt& h) {
    return KdaResiduals{opt_view(G, "residuals.G"), opt_view(Aqk, "residuals.Aqk"), opt_view(Akk, "residuals.Akk"), opt_view(h, "residuals.h")};
  };
  auto kda_opts = [](double scale, bool final_state, bool l2, bool gate_in_kernel, bool lower, double lb) {
    KdaOptions o;
    o.scale = scale;
    o.output_final_state = final_state;
    o.use_qk_l2norm = l2;
    o.use_gate_in_kernel = gate_in_kernel;
    o.use_lower_bound = lower;
    o.lower_bound = lb;
    return o;
  };
  m.def("kda_chunk_count",
        [kda_args, kda_opts](Array q, Array k, Array v, Array g, Array beta, Opt cu) {
          int64_t chunks = 0;
          raise_if_error(kda_chunk_count(kda_args(q, k, v, g, beta, {}, {}, {}, cu, {}, {}), kda_opts(0.0, false, false, false, false, -5.0),
                                         &chunks));
          return chunks;
        },
        nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::arg("cu").none());
  m.def("kda_forward_workspace_bytes",
        [kda_args, kda_opts, kda_residuals](Array q, Array k, Array v, Array g, Array beta, Opt h0, Opt A_log, Opt dt_bias, Opt cu, Array o,
                                            Opt fin, double scale, bool l2, bool gate_in_kernel, bool lower, double lb, Opt rG, Opt rAqk,
                                            Opt rAkk, Opt rh) {
          KdaForwardArgs a = kda_args(q, k, v, g, beta, h0, A_log, dt_bias, cu, o, fin);
          a.residuals = kda_residuals(rG, rAqk, rAkk, rh);
          const KdaOptions opts = kda_opts(scale, fin.has_value(), l2, gate_in_kernel, lower, lb);
          raise_if_error(validate(a, opts));
          return workspace_bytes(a, opts);
        },
        nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::arg("h0").none(), nb::arg("A_log").none(),
        nb::arg("dt_bias").none(), nb::arg("cu").none(), nb::arg("o"), nb::arg("fin").none(), nb::arg("scale"), nb::arg("l2"),
        nb::arg("gate_in_kernel"), nb::arg("lower"), nb::arg("lb"), nb::arg("rG").none(), nb::arg("rAqk").none(), nb::arg("rAkk").none(),
        nb::arg("rh").none());
  m.def("kda_forward_out",
        [kda_args, kda_opts, kda_residuals](Array q, Array k, Array v, Array g, Array beta, Opt h0, Opt A_log, Opt dt_bias, Opt cu, Array o,
                                            Opt fin, double scale, bool l2, bool gate_in_kernel, bool lower, double lb, Opt rG, Opt rAqk,
                                            Opt rAkk, Opt rh, Opt workspace, uintptr_t stream) {
          KdaForwardArgs a = kda_args(q, k, v, g, beta, h0, A_log, dt_bias, cu, o, fin);
          a.residuals = kda_residuals(rG, rAqk, rAkk, rh);
          raise_if_error(run(a, kda_opts(scale, fin.has_value(), l2, gate_in_kernel, lower, lb), opt_ptr(workspace), as_stream(stream)));
        },
        nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::arg("h0").none(), nb::arg("A_log").none(),
        nb::arg("dt_bias").none(), nb::arg("cu").none(), nb::arg("o"), nb::arg("fin").none(), nb::arg("scale"), nb::arg("l2"),
        nb::arg("gate_in_kernel"), nb::arg("lower"), nb::arg("lb"), nb::arg("rG").none(), nb::arg("rAqk").none(), nb::arg("rAkk").none(),
        nb::arg("rh").none(), nb::arg("workspace").none(), nb::arg("stream"));
  m.def("kda_backward_out",
        [kda_args, kda_opts](Array q, Array k, Array v, Array g, Array beta, Opt h0, Opt A_log, Opt dt_bias, Opt cu, Array d_o, Opt d_fin,
                             double scale, bool l2, bool gate_in_kernel, bool lower, double lb, Array dq, Array dk, Array dv, Array dg,
                             Array dbeta, Opt dh0, Opt dA_log, Opt ddt_bias) {
          KdaBackwardArgs a;
          a.fwd = kda_args(q, k, v, g, beta, h0, A_log, dt_bias, cu, {}, {});
          a.d_o = to_view(d_o, "d_o");
          a.d_final_state = opt_view(d_fin, "d_final_state");
          a.dq = to_view(dq, "dq");
          a.dk = to_view(dk, "dk");
          a.dv = to_view(dv, "dv");
          a.dg = to_view(dg, "dg");
          a.dbeta = to_view(dbeta, "dbeta");
          a.dh0 = opt_view(dh0, "dh0");
          a.dA_log = opt_view(dA_log, "dA_log");
          a.ddt_bias = opt_view(ddt_bias, "ddt_bias");
          raise_if_error(run(a, kda_opts(scale, false, l2, gate_in_kernel, lower, lb)));
        },
        nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::arg("h0").none(), nb::arg("A_log").none(),
        nb::arg("dt_bias").none(), nb::arg("cu").none(), nb::arg("d_o"), nb::arg("d_fin").none(), nb::arg("scale"), nb::arg("l2"),
        nb::arg("gate_in_kernel"), nb::arg("lower"), nb::arg("lb"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("dg"),
        nb::arg("dbeta"), nb::arg("dh0").none(), nb::arg("dA_log").none(), nb::arg("ddt_bias").none());

  m.def("fp8_group_dequant_out",
        [](Array q, Array scales, Array x) {
          raise_if_error(run(Fp8GroupDequantArgs{to_fp8_view(q, "q"), to_view(scales, "scales"), to_view(x, "x")}, Fp8GroupQuantOptions{}));
        },
        nb::arg("q"), nb::arg("scales"), nb::arg("x"));
}
