// Bindings of the Kimi Delta Attention family.
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "convert.hpp"
#include "encore/kda.hpp"
#include "encore/kda_cp.hpp"

namespace encore::python {

void bind_kda(nb::module_& m) {
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
  auto bwd_args = [kda_args, kda_residuals](Array q, Array k, Array v, Array g, Array beta, const Opt& h0, const Opt& A_log,
                                             const Opt& dt_bias, const Opt& cu, Array d_o, const Opt& d_fin, Array dq, Array dk, Array dv,
                                             Array dg, Array dbeta, const Opt& dh0, const Opt& dA_log, const Opt& ddt_bias, const Opt& rG,
                                             const Opt& rAqk, const Opt& rAkk, const Opt& rh) {
    KdaBackwardArgs a;
    a.fwd = kda_args(q, k, v, g, beta, h0, A_log, dt_bias, cu, {}, {});
    a.fwd.residuals = kda_residuals(rG, rAqk, rAkk, rh);
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
    return a;
  };
  // kda_backward_workspace_bytes / kda_backward_out take the same arguments (+ workspace, stream for _out).
  m.def("kda_backward_workspace_bytes",
        [bwd_args, kda_opts](Array q, Array k, Array v, Array g, Array beta, Opt h0, Opt A_log, Opt dt_bias, Opt cu, Array d_o, Opt d_fin,
                             double scale, bool l2, bool gate_in_kernel, bool lower, double lb, Array dq, Array dk, Array dv, Array dg,
                             Array dbeta, Opt dh0, Opt dA_log, Opt ddt_bias, Opt rG, Opt rAqk, Opt rAkk, Opt rh) {
          const KdaBackwardArgs a = bwd_args(q, k, v, g, beta, h0, A_log, dt_bias, cu, d_o, d_fin, dq, dk, dv, dg, dbeta, dh0, dA_log,
                                             ddt_bias, rG, rAqk, rAkk, rh);
          const KdaOptions opts = kda_opts(scale, false, l2, gate_in_kernel, lower, lb);
          raise_if_error(validate(a, opts));
          return workspace_bytes(a, opts);
        },
        nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::arg("h0").none(), nb::arg("A_log").none(),
        nb::arg("dt_bias").none(), nb::arg("cu").none(), nb::arg("d_o"), nb::arg("d_fin").none(), nb::arg("scale"), nb::arg("l2"),
        nb::arg("gate_in_kernel"), nb::arg("lower"), nb::arg("lb"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("dg"),
        nb::arg("dbeta"), nb::arg("dh0").none(), nb::arg("dA_log").none(), nb::arg("ddt_bias").none(), nb::arg("rG").none(),
        nb::arg("rAqk").none(), nb::arg("rAkk").none(), nb::arg("rh").none());
  m.def("kda_backward_out",
        [bwd_args, kda_opts](Array q, Array k, Array v, Array g, Array beta, Opt h0, Opt A_log, Opt dt_bias, Opt cu, Array d_o, Opt d_fin,
                             double scale, bool l2, bool gate_in_kernel, bool lower, double lb, Array dq, Array dk, Array dv, Array dg,
                             Array dbeta, Opt dh0, Opt dA_log, Opt ddt_bias, Opt rG, Opt rAqk, Opt rAkk, Opt rh, Opt workspace,
                             uintptr_t stream) {
          const KdaBackwardArgs a = bwd_args(q, k, v, g, beta, h0, A_log, dt_bias, cu, d_o, d_fin, dq, dk, dv, dg, dbeta, dh0, dA_log,
                                             ddt_bias, rG, rAqk, rAkk, rh);
          raise_if_error(run(a, kda_opts(scale, false, l2, gate_in_kernel, lower, lb), opt_ptr(workspace), as_stream(stream)));
        },
        nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::arg("h0").none(), nb::arg("A_log").none(),
        nb::arg("dt_bias").none(), nb::arg("cu").none(), nb::arg("d_o"), nb::arg("d_fin").none(), nb::arg("scale"), nb::arg("l2"),
        nb::arg("gate_in_kernel"), nb::arg("lower"), nb::arg("lb"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("dg"),
        nb::arg("dbeta"), nb::arg("dh0").none(), nb::arg("dA_log").none(), nb::arg("ddt_bias").none(), nb::arg("rG").none(),
        nb::arg("rAqk").none(), nb::arg("rAkk").none(), nb::arg("rh").none(), nb::arg("workspace").none(), nb::arg("stream"));
  // Context parallelism (encore/kda_cp.hpp): the summaries of one local piece (d_o given: the backward's) and the merge.
  auto cp_args = [kda_args](Array q, Array k, Array v, Array g, Array beta, const Opt& A_log, const Opt& dt_bias, const Opt& cu,
                            const Opt& d_o, int64_t piece, Array S, Array M) {
    KdaCpSummaryArgs a;
    a.fwd = kda_args(q, k, v, g, beta, {}, A_log, dt_bias, cu, {}, {});
    a.d_o = opt_view(d_o, "d_o");
    a.piece = piece;
    a.S = to_view(S, "S");
    a.M = to_view(M, "M");
    return a;
  };
  m.def("kda_cp_summary_workspace_bytes",
        [cp_args, kda_opts](Array q, Array k, Array v, Array g, Array beta, Opt A_log, Opt dt_bias, Opt cu, Opt d_o, int64_t piece,
                            double scale, bool l2, bool gate_in_kernel, bool lower, double lb, Array S, Array M) {
          const KdaCpSummaryArgs a = cp_args(q, k, v, g, beta, A_log, dt_bias, cu, d_o, piece, S, M);
          const KdaOptions o = kda_opts(scale, false, l2, gate_in_kernel, lower, lb);
          return d_o ? cp_backward_summary_workspace_bytes(a, o) : cp_forward_summary_workspace_bytes(a, o);
        },
        nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::arg("A_log").none(), nb::arg("dt_bias").none(),
        nb::arg("cu").none(), nb::arg("d_o").none(), nb::arg("piece"), nb::arg("scale"), nb::arg("l2"), nb::arg("gate_in_kernel"),
        nb::arg("lower"), nb::arg("lb"), nb::arg("S"), nb::arg("M"));
  m.def("kda_cp_summary_out",
        [cp_args, kda_opts](Array q, Array k, Array v, Array g, Array beta, Opt A_log, Opt dt_bias, Opt cu, Opt d_o, int64_t piece,
                            double scale, bool l2, bool gate_in_kernel, bool lower, double lb, Array S, Array M, Opt workspace,
                            uintptr_t stream) {
          const KdaCpSummaryArgs a = cp_args(q, k, v, g, beta, A_log, dt_bias, cu, d_o, piece, S, M);
          const KdaOptions o = kda_opts(scale, false, l2, gate_in_kernel, lower, lb);
          void* ws = opt_ptr(workspace);
          raise_if_error(d_o ? run_cp_backward_summary(a, o, ws, as_stream(stream)) : run_cp_forward_summary(a, o, ws, as_stream(stream)));
        },
        nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::arg("A_log").none(), nb::arg("dt_bias").none(),
        nb::arg("cu").none(), nb::arg("d_o").none(), nb::arg("piece"), nb::arg("scale"), nb::arg("l2"), nb::arg("gate_in_kernel"),
        nb::arg("lower"), nb::arg("lb"), nb::arg("S"), nb::arg("M"), nb::arg("workspace").none() = nb::none(), nb::arg("stream") = 0);
  // The split of a varlen batch over ranks: per rank (local cu_seqlens, pre_num_ranks, post_num_ranks).
  m.def("kda_cp_split",
        [](const std::vector<int64_t>& cu, const std::vector<int64_t>& bounds) {
          std::vector<KdaCpRankSplit> split;
          raise_if_error(kda_cp_split(cu, bounds, &split));
          std::vector<std::tuple<std::vector<int64_t>, int, int>> out;
          for (const auto& r : split) out.emplace_back(r.cu, r.pre_num_ranks, r.post_num_ranks);
          return out;
        },
        nb::arg("cu"), nb::arg("bounds"));
  m.def("kda_cp_merge_out",
        [](Array S, Array M, Array out, uintptr_t stream) {
          raise_if_error(run_cp_merge(to_view(S, "S"), to_view(M, "M"), to_view(out, "out"), as_stream(stream)));
        },
        nb::arg("S"), nb::arg("M"), nb::arg("out"), nb::arg("stream") = 0);
}

}  // namespace encore::python
