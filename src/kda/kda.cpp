// KDA dispatch: validate -> CPU reference (the CUDA forward is not implemented yet).
#include "core/checks.hpp"
#include "encore/kda.hpp"
#include "kda/kda_problem.hpp"
#include "reference/kda_ref.hpp"

namespace encore {
namespace {

const std::initializer_list<DType> kFloat = {DType::kBF16, DType::kFP32, DType::kFP64};
const std::initializer_list<DType> kState = {DType::kFP32, DType::kFP64};

// An output of exactly `like`'s shape.
Status validate_like(const char* name, const TensorView& t, const TensorView& like, const char* like_name,
                     std::initializer_list<DType> dtypes) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  if (t.ndim != like.ndim || t.shape != like.shape)
    return Status::invalid(std::string(name) + ": shape " + t.shape_string() + " must equal " + like_name + "'s " + like.shape_string());
  ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, t, dtypes));
  ENCORE_RETURN_IF_ERROR(checks::same_device(name, t, like_name, like));
  return Status::ok();
}

Status validate_state(const char* name, const TensorView& t, const kda::KdaProblem& p, const TensorView& q) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  const int64_t n = int64_t(p.seqs.size());
  if (t.ndim != 4 || t.shape[0] != n || t.shape[1] != p.H || t.shape[2] != p.K || t.shape[3] != p.V)
    return Status::invalid(std::string(name) + ": expected [N, H, K, V] = [" + std::to_string(n) + ", " + std::to_string(p.H) + ", " +
                           std::to_string(p.K) + ", " + std::to_string(p.V) + "], got " + t.shape_string());
  ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, t, kState));
  ENCORE_RETURN_IF_ERROR(checks::same_device(name, t, "q", q));
  return Status::ok();
}

Status cpu_only(const TensorView& q) {
  if (q.device.is_cuda())
    return Status::unsupported("q: on " + q.device.to_string() + ": the CUDA KDA kernels are not implemented yet (CPU backend only)");
  return Status::ok();
}

// Element offset of the i-th element (row-major order over the shape) of a strided view.
int64_t strided_offset(const TensorView& t, int64_t i) {
  int64_t off = 0;
  for (int d = t.ndim - 1; d >= 0; --d) {
    off += (i % t.shape[d]) * t.strides[d];
    i /= t.shape[d];
  }
  return off;
}

// Writes a dense row-major fp64 array into a strided view / reads one from it.
void store_dense(const TensorView& t, const std::vector<double>& src) {
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data, t.dtype, strided_offset(t, i), src[size_t(i)]);
}

std::vector<double> load_dense(const TensorView& t) {
  std::vector<double> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) out[size_t(i)] = load_as_double(t.data, t.dtype, strided_offset(t, i));
  return out;
}

}  // namespace

Status validate(const KdaForwardArgs& a, const KdaOptions& o) {
  kda::KdaProblem p;
  ENCORE_RETURN_IF_ERROR(kda::make_problem(a, o, &p));
  ENCORE_RETURN_IF_ERROR(validate_like("o", a.o, a.v, "v", kFloat));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("o", a.o, "q", a.q));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("o", a.o, "k", a.k));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("o", a.o, "v", a.v));
  if (o.output_final_state) {
    ENCORE_RETURN_IF_ERROR(validate_state("final_state", a.final_state, p, a.q));
  } else if (a.final_state.defined()) {
    return Status::invalid("final_state: given but output_final_state is false");
  }
  return Status::ok();
}

size_t workspace_bytes(const KdaForwardArgs&, const KdaOptions&) { return 0; }

Status run(const KdaForwardArgs& a, const KdaOptions& o, void*, Stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  ENCORE_RETURN_IF_ERROR(cpu_only(a.q));
  kda::KdaProblem p;
  ENCORE_RETURN_IF_ERROR(kda::make_problem(a, o, &p));
  const reference::KdaInputs in = reference::kda_prepare(p, a);
  std::vector<double> out, final_state;
  reference::kda_recurrent_forward(p, in, out, final_state);
  store_dense(a.o, out);
  if (o.output_final_state) store_dense(a.final_state, final_state);
  return Status::ok();
}

Status validate(const KdaBackwardArgs& a, const KdaOptions& o) {
  kda::KdaProblem p;
  ENCORE_RETURN_IF_ERROR(kda::make_problem(a.fwd, o, &p));
  ENCORE_RETURN_IF_ERROR(validate_like("d_o", a.d_o, a.fwd.v, "v", kFloat));
  if (a.d_final_state.defined()) ENCORE_RETURN_IF_ERROR(validate_state("d_final_state", a.d_final_state, p, a.fwd.q));
  ENCORE_RETURN_IF_ERROR(validate_like("dq", a.dq, a.fwd.q, "q", kFloat));
  ENCORE_RETURN_IF_ERROR(validate_like("dk", a.dk, a.fwd.k, "k", kFloat));
  ENCORE_RETURN_IF_ERROR(validate_like("dv", a.dv, a.fwd.v, "v", kFloat));
  ENCORE_RETURN_IF_ERROR(validate_like("dg", a.dg, a.fwd.g, "g", kFloat));
  ENCORE_RETURN_IF_ERROR(validate_like("dbeta", a.dbeta, a.fwd.beta, "beta", kFloat));
  if (a.dh0.defined()) {
    if (!a.fwd.initial_state.defined()) return Status::invalid("dh0: given but the forward has no initial_state");
    ENCORE_RETURN_IF_ERROR(validate_state("dh0", a.dh0, p, a.fwd.q));
  }
  if (a.dA_log.defined()) {
    if (!a.fwd.A_log.defined()) return Status::invalid("dA_log: given but the forward has no A_log");
    ENCORE_RETURN_IF_ERROR(validate_like("dA_log", a.dA_log, a.fwd.A_log, "A_log", kState));
  }
  if (a.ddt_bias.defined()) {
    if (!a.fwd.dt_bias.defined()) return Status::invalid("ddt_bias: given but the forward has no dt_bias");
    ENCORE_RETURN_IF_ERROR(validate_like("ddt_bias", a.ddt_bias, a.fwd.dt_bias, "dt_bias", kState));
  }
  return Status::ok();
}

Status run(const KdaBackwardArgs& a, const KdaOptions& o) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  ENCORE_RETURN_IF_ERROR(cpu_only(a.fwd.q));
  kda::KdaProblem p;
  ENCORE_RETURN_IF_ERROR(kda::make_problem(a.fwd, o, &p));
  const reference::KdaInputs in = reference::kda_prepare(p, a.fwd);
  const std::vector<double> d_o = load_dense(a.d_o);
  const std::vector<double> d_final = a.d_final_state.defined() ? load_dense(a.d_final_state) : std::vector<double>{};
  const reference::KdaGrads g = reference::kda_backward(p, a.fwd, in, d_o, d_final);
  store_dense(a.dq, g.dq);
  store_dense(a.dk, g.dk);
  store_dense(a.dv, g.dv);
  store_dense(a.dg, g.dg);
  store_dense(a.dbeta, g.dbeta);
  if (a.dh0.defined()) store_dense(a.dh0, g.dh0);
  if (a.dA_log.defined()) store_dense(a.dA_log, g.dA_log);
  if (a.ddt_bias.defined()) store_dense(a.ddt_bias, g.ddt_bias);
  return Status::ok();
}

}  // namespace encore
