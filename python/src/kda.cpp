// Bindings of the Kimi Delta Attention family: the structs of encore/kda.hpp and encore/kda_cp.hpp with
// named fields (KdaBackwardArgs and KdaCpSummaryArgs nest the forward's arguments as `fwd`, KdaForwardArgs
// the residuals as `residuals`; every array field defaults to None = absent), per op the two calls
// <op>_workspace and <op>_run (convert.hpp), and the calls of other shapes with named arguments: the chunk
// count query and the context-parallel summaries, merge and split.
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "convert.hpp"
#include "encore/kda.hpp"
#include "encore/kda_cp.hpp"
#include "encore/kda_serving.hpp"

namespace encore::python {

namespace {

// An array argument that may be None (absent), and is by default.
auto opt_arg(const char* name) { return nb::arg(name).none() = nb::none(); }

// The two calls of a CP summary: <name>_workspace(args, opts) -> bytes (0 on the CPU backend or for
// arguments that do not validate) and <name>_run(args, opts, workspace, stream).
template <size_t (*Bytes)(const KdaCpSummaryArgs&, const KdaOptions&),
          Status (*Run)(const KdaCpSummaryArgs&, const KdaOptions&, void*, Stream)>
void bind_cp_summary(nb::module_& m, const std::string& name) {
  m.def((name + "_workspace").c_str(), Bytes, nb::arg("args"), nb::arg("opts"));
  m.def((name + "_run").c_str(),
        [](const KdaCpSummaryArgs& a, const KdaOptions& o, const Opt& workspace, uintptr_t stream) {
          raise_if_error(Run(a, o, opt_ptr(workspace), as_stream(stream)));
        },
        nb::arg("args"), nb::arg("opts"), opt_arg("workspace"), nb::arg("stream") = 0);
}

}  // namespace

void bind_kda(nb::module_& m) {
  nb::class_<KdaOptions>(m, "KdaOptions")
      .def(
          "__init__",
          [](KdaOptions* p, double scale, bool output_final_state, bool use_qk_l2norm, bool use_gate_in_kernel, bool use_lower_bound,
             double lower_bound, bool state_v_first) {
            new (p) KdaOptions{scale, output_final_state, use_qk_l2norm, use_gate_in_kernel, use_lower_bound, lower_bound, state_v_first};
          },
          nb::arg("scale") = 0.0, nb::arg("output_final_state") = false, nb::arg("use_qk_l2norm") = false,
          nb::arg("use_gate_in_kernel") = false, nb::arg("use_lower_bound") = false, nb::arg("lower_bound") = -5.0,
          nb::arg("state_v_first") = false)
      .def_rw("scale", &KdaOptions::scale)
      .def_rw("output_final_state", &KdaOptions::output_final_state)
      .def_rw("use_qk_l2norm", &KdaOptions::use_qk_l2norm)
      .def_rw("use_gate_in_kernel", &KdaOptions::use_gate_in_kernel)
      .def_rw("use_lower_bound", &KdaOptions::use_lower_bound)
      .def_rw("lower_bound", &KdaOptions::lower_bound)
      .def_rw("state_v_first", &KdaOptions::state_v_first);
  nb::class_<KdaResiduals>(m, "KdaResiduals")
      .def(
          "__init__",
          [](KdaResiduals* p, Opt G, Opt Aqk, Opt Akk, Opt h) {
            new (p) KdaResiduals{opt_view(G, "residuals.G"), opt_view(Aqk, "residuals.Aqk"), opt_view(Akk, "residuals.Akk"),
                                 opt_view(h, "residuals.h")};
          },
          opt_arg("G"), opt_arg("Aqk"), opt_arg("Akk"), opt_arg("h"));
  nb::class_<KdaForwardArgs>(m, "KdaForwardArgs")
      .def(
          "__init__",
          [](KdaForwardArgs* p, Opt q, Opt k, Opt v, Opt g, Opt beta, Opt initial_state, Opt A_log, Opt dt_bias, Opt cu_seqlens, Opt o,
             Opt final_state, const KdaResiduals* residuals) {
            new (p) KdaForwardArgs{opt_view(q, "q"),
                                   opt_view(k, "k"),
                                   opt_view(v, "v"),
                                   opt_view(g, "g"),
                                   opt_view(beta, "beta"),
                                   opt_view(initial_state, "initial_state"),
                                   opt_view(A_log, "A_log"),
                                   opt_view(dt_bias, "dt_bias"),
                                   opt_view(cu_seqlens, "cu_seqlens"),
                                   opt_view(o, "o"),
                                   opt_view(final_state, "final_state"),
                                   residuals ? *residuals : KdaResiduals{}};
          },
          opt_arg("q"), opt_arg("k"), opt_arg("v"), opt_arg("g"),
          opt_arg("beta"), opt_arg("initial_state"), opt_arg("A_log"),
          opt_arg("dt_bias"), opt_arg("cu_seqlens"), opt_arg("o"),
          opt_arg("final_state"), opt_arg("residuals"));
  nb::class_<KdaBackwardArgs>(m, "KdaBackwardArgs")
      .def(
          "__init__",
          [](KdaBackwardArgs* p, const KdaForwardArgs& fwd, Opt d_o, Opt d_final_state, Opt dq, Opt dk, Opt dv, Opt dg, Opt dbeta, Opt dh0,
             Opt dA_log, Opt ddt_bias) {
            new (p) KdaBackwardArgs{fwd,
                                    opt_view(d_o, "d_o"),
                                    opt_view(d_final_state, "d_final_state"),
                                    opt_view(dq, "dq"),
                                    opt_view(dk, "dk"),
                                    opt_view(dv, "dv"),
                                    opt_view(dg, "dg"),
                                    opt_view(dbeta, "dbeta"),
                                    opt_view(dh0, "dh0"),
                                    opt_view(dA_log, "dA_log"),
                                    opt_view(ddt_bias, "ddt_bias")};
          },
          nb::arg("fwd"), opt_arg("d_o"), opt_arg("d_final_state"), opt_arg("dq"),
          opt_arg("dk"), opt_arg("dv"), opt_arg("dg"), opt_arg("dbeta"),
          opt_arg("dh0"), opt_arg("dA_log"), opt_arg("ddt_bias"));

  // Serving (encore/kda_serving.hpp): the recurrent step and the prefill on a state pool.
  nb::class_<KdaRecurrentOptions>(m, "KdaRecurrentOptions")
      .def(
          "__init__",
          [](KdaRecurrentOptions* p, double scale, bool use_qk_l2norm, bool use_gate_in_kernel, bool use_lower_bound, double lower_bound,
             bool use_beta_sigmoid, bool allow_neg_eigval, bool state_v_first) {
            new (p) KdaRecurrentOptions{scale, use_qk_l2norm, use_gate_in_kernel, use_lower_bound, lower_bound, use_beta_sigmoid,
                                        allow_neg_eigval, state_v_first};
          },
          nb::arg("scale") = 0.0, nb::arg("use_qk_l2norm") = false, nb::arg("use_gate_in_kernel") = false,
          nb::arg("use_lower_bound") = false, nb::arg("lower_bound") = -5.0, nb::arg("use_beta_sigmoid") = false,
          nb::arg("allow_neg_eigval") = false, nb::arg("state_v_first") = false)
      .def_rw("state_v_first", &KdaRecurrentOptions::state_v_first);
  nb::class_<KdaRecurrentArgs>(m, "KdaRecurrentArgs")
      .def(
          "__init__",
          [](KdaRecurrentArgs* p, Opt q, Opt k, Opt v, Opt g, Opt beta, Opt A_log, Opt dt_bias, Opt cu_seqlens, Opt initial_state,
             Opt state_indices, Opt num_accepted_tokens, Opt o, Opt final_state) {
            new (p) KdaRecurrentArgs{opt_view(q, "q"),
                                     opt_view(k, "k"),
                                     opt_view(v, "v"),
                                     opt_view(g, "g"),
                                     opt_view(beta, "beta"),
                                     opt_view(A_log, "A_log"),
                                     opt_view(dt_bias, "dt_bias"),
                                     opt_view(cu_seqlens, "cu_seqlens"),
                                     opt_view(initial_state, "initial_state"),
                                     opt_view(state_indices, "state_indices"),
                                     opt_view(num_accepted_tokens, "num_accepted_tokens"),
                                     opt_view(o, "o"),
                                     opt_view(final_state, "final_state")};
          },
          opt_arg("q"), opt_arg("k"), opt_arg("v"), opt_arg("g"), opt_arg("beta"), opt_arg("A_log"), opt_arg("dt_bias"),
          opt_arg("cu_seqlens"), opt_arg("initial_state"), opt_arg("state_indices"), opt_arg("num_accepted_tokens"), opt_arg("o"),
          opt_arg("final_state"));
  nb::class_<KdaPoolForwardArgs>(m, "KdaPoolForwardArgs")
      .def(
          "__init__",
          [](KdaPoolForwardArgs* p, const KdaForwardArgs& fwd, Opt pool, Opt state_indices) {
            new (p) KdaPoolForwardArgs{fwd, opt_view(pool, "pool"), opt_view(state_indices, "state_indices")};
          },
          nb::arg("fwd"), opt_arg("pool"), opt_arg("state_indices"));
  ENCORE_BIND_OP(m, "kda_recurrent", KdaRecurrentArgs, KdaRecurrentOptions);
  ENCORE_BIND_OP(m, "kda_forward_pool", KdaPoolForwardArgs, KdaOptions);

  ENCORE_BIND_OP(m, "kda_forward", KdaForwardArgs, KdaOptions);
  ENCORE_BIND_OP(m, "kda_backward", KdaBackwardArgs, KdaOptions);
  // NT, the rows of residuals.h (asked only where h is returned).
  m.def(
      "kda_chunk_count",
      [](const KdaForwardArgs& args, const KdaOptions& opts) {
        int64_t chunks = 0;
        raise_if_error(kda_chunk_count(args, opts, &chunks));
        return chunks;
      },
      nb::arg("args"), nb::arg("opts"));

  // Context parallelism: the summaries of one local piece, their merge, the split of a batch over ranks.
  nb::class_<KdaCpSummaryArgs>(m, "KdaCpSummaryArgs")
      .def(
          "__init__",
          [](KdaCpSummaryArgs* p, const KdaForwardArgs& fwd, Opt d_o, int64_t piece, Opt S, Opt M) {
            new (p) KdaCpSummaryArgs{fwd, opt_view(d_o, "d_o"), piece, opt_view(S, "S"), opt_view(M, "M")};
          },
          nb::arg("fwd"), opt_arg("d_o"), nb::arg("piece") = 0, opt_arg("S"), opt_arg("M"));
  bind_cp_summary<&cp_forward_summary_workspace_bytes, &run_cp_forward_summary>(m, "kda_cp_forward_summary");
  bind_cp_summary<&cp_backward_summary_workspace_bytes, &run_cp_backward_summary>(m, "kda_cp_backward_summary");
  m.def(
      "kda_cp_merge_run",
      [](Array S, Array M, Array out, uintptr_t stream) {
        raise_if_error(run_cp_merge(to_view(S, "S"), to_view(M, "M"), to_view(out, "out"), as_stream(stream)));
      },
      nb::arg("S"), nb::arg("M"), nb::arg("out"), nb::arg("stream") = 0);
  // Per rank: (local cu_seqlens, pre_num_ranks, post_num_ranks).
  m.def(
      "kda_cp_split",
      [](const std::vector<int64_t>& cu, const std::vector<int64_t>& bounds) {
        std::vector<KdaCpRankSplit> split;
        raise_if_error(kda_cp_split(cu, bounds, &split));
        std::vector<std::tuple<std::vector<int64_t>, int, int>> out;
        for (const auto& r : split) out.emplace_back(r.cu, r.pre_num_ranks, r.post_num_ranks);
        return out;
      },
      nb::arg("cu"), nb::arg("bounds"));
}

}  // namespace encore::python
