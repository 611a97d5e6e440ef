// KDA argument validation: shapes, dtypes, devices, cu_seqlens, gate options.
#include "kda/problem.hpp"

#include <cmath>
#include <utility>

#include "core/checks.hpp"

namespace encore::kda {

int64_t strided_offset(const TensorView& t, int64_t i) {
  int64_t off = 0;
  for (int d = t.ndim - 1; d >= 0; --d) {
    off += (i % t.shape[d]) * t.strides[d];
    i /= t.shape[d];
  }
  return off;
}

TensorView state_kv_view(const TensorView& t) {
  if (!t.defined() || t.ndim < 2) return t;
  TensorView r = t;
  std::swap(r.shape[size_t(t.ndim - 1)], r.shape[size_t(t.ndim - 2)]);
  std::swap(r.strides[size_t(t.ndim - 1)], r.strides[size_t(t.ndim - 2)]);
  return r;
}

std::vector<double> load_dense(const TensorView& t) {
  std::vector<double> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) out[size_t(i)] = load_as_double(t.data, t.dtype, strided_offset(t, i));
  return out;
}

void store_dense(const TensorView& t, const std::vector<double>& src) {
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data, t.dtype, strided_offset(t, i), src[size_t(i)]);
}

namespace {

const std::initializer_list<DType> kFloat = {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP64};
const std::initializer_list<DType> kState = {DType::kFP32, DType::kFP64};

Status expect_shape(const char* name, const TensorView& t, std::initializer_list<int64_t> shape, const char* layout,
                    const TensorView& q) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  ENCORE_RETURN_IF_ERROR(checks::ndim(name, t, int(shape.size()), layout));
  int d = 0;
  for (int64_t s : shape) {
    if (t.shape[d] != s)
      return Status::invalid(std::string(name) + ": expected shape " + layout + " = " + [&] {
        std::string r = "[";
        int i = 0;
        for (int64_t v : shape) r += (i++ ? ", " : "") + std::to_string(v);
        return r + "]";
      }() + ", got " + t.shape_string());
    ++d;
  }
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride(name, t));
  ENCORE_RETURN_IF_ERROR(checks::same_device(name, t, "q", q));
  return Status::ok();
}

int64_t read_index(const TensorView& t, int64_t i) {
  return t.dtype == DType::kInt32 ? static_cast<const int32_t*>(t.data)[i * t.strides[0]]
                                  : static_cast<const int64_t*>(t.data)[i * t.strides[0]];
}

}  // namespace

Status make_problem(const KdaForwardArgs& a, const KdaOptions& o, KdaProblem* out) {
  KdaProblem p;
  ENCORE_RETURN_IF_ERROR(checks::present("q", a.q));
  ENCORE_RETURN_IF_ERROR(checks::ndim("q", a.q, 4, "[B, T, H, K]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("q", a.q, kFloat));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("q", a.q));
  p.B = a.q.shape[0];
  p.T = a.q.shape[1];
  p.Hq = a.q.shape[2];
  p.K = a.q.shape[3];
  if (p.K > kMaxHeadDim) return Status::unsupported("q: head dim K = " + std::to_string(p.K) + " exceeds 256");
  ENCORE_RETURN_IF_ERROR(expect_shape("k", a.k, {p.B, p.T, p.Hq, p.K}, "[B, T, H, K]", a.q));
  ENCORE_RETURN_IF_ERROR(checks::same_dtype("k", a.k, "q", a.q));
  ENCORE_RETURN_IF_ERROR(checks::present("v", a.v));
  ENCORE_RETURN_IF_ERROR(checks::ndim("v", a.v, 4, "[B, T, HV, V]"));
  p.V = a.v.shape[3];
  p.H = a.v.shape[2];  // value heads
  if (p.V > kMaxHeadDim) return Status::unsupported("v: head dim V = " + std::to_string(p.V) + " exceeds 256");
  if (a.v.shape[0] != p.B || a.v.shape[1] != p.T || (p.Hq > 0 ? p.H < p.Hq || p.H % p.Hq != 0 : p.H != 0))
    return Status::invalid("v: expected [B, T, HV, V] with B = " + std::to_string(p.B) + ", T = " + std::to_string(p.T) +
                           " and HV a multiple of H = " + std::to_string(p.Hq) + " (q's heads), got " + a.v.shape_string());
  ENCORE_RETURN_IF_ERROR(expect_shape("v", a.v, {p.B, p.T, p.H, p.V}, "[B, T, HV, V]", a.q));
  ENCORE_RETURN_IF_ERROR(checks::same_dtype("v", a.v, "q", a.q));
  ENCORE_RETURN_IF_ERROR(expect_shape("g", a.g, {p.B, p.T, p.H, p.K}, "[B, T, HV, K]", a.q));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("g", a.g, kFloat));
  ENCORE_RETURN_IF_ERROR(expect_shape("beta", a.beta, {p.B, p.T, p.H}, "[B, T, HV]", a.q));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("beta", a.beta, kFloat));

  // Sequences.
  if (a.cu_seqlens.defined()) {
    ENCORE_RETURN_IF_ERROR(checks::present("cu_seqlens", a.cu_seqlens));
    ENCORE_RETURN_IF_ERROR(checks::ndim("cu_seqlens", a.cu_seqlens, 1, "[N + 1]"));
    ENCORE_RETURN_IF_ERROR(checks::dtype_in("cu_seqlens", a.cu_seqlens, {DType::kInt32, DType::kInt64}));
    if (a.cu_seqlens.device.is_cuda())
      return Status::unsupported("cu_seqlens: must be a host tensor (the CPU backend reads it; a host copy also avoids syncs)");
    if (p.B != 1) return Status::invalid("q: B must be 1 with cu_seqlens (varlen sequences are flattened), got B = " + std::to_string(p.B));
    const int64_t n = a.cu_seqlens.shape[0] - 1;
    if (n < 1) return Status::invalid("cu_seqlens: needs at least 2 entries [0, ..., T]");
    if (read_index(a.cu_seqlens, 0) != 0) return Status::invalid("cu_seqlens: must start at 0, got " + std::to_string(read_index(a.cu_seqlens, 0)));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = read_index(a.cu_seqlens, i), e = read_index(a.cu_seqlens, i + 1);
      if (e < b)
        return Status::invalid("cu_seqlens: must be non-decreasing, but entry " + std::to_string(i + 1) + " (" + std::to_string(e) +
                               ") < entry " + std::to_string(i) + " (" + std::to_string(b) + ")");
      p.seqs.push_back({0, b, e});
    }
    if (read_index(a.cu_seqlens, n) != p.T)
      return Status::invalid("cu_seqlens: must end at T = " + std::to_string(p.T) + ", got " + std::to_string(read_index(a.cu_seqlens, n)));
  } else {
    for (int64_t b = 0; b < p.B; ++b) p.seqs.push_back({b, 0, p.T});
  }
  const int64_t N = int64_t(p.seqs.size());

  if (a.initial_state.defined()) {
    if (o.state_v_first)
      ENCORE_RETURN_IF_ERROR(expect_shape("initial_state", a.initial_state, {N, p.H, p.V, p.K}, "[N, HV, V, K] (state_v_first)", a.q));
    else
      ENCORE_RETURN_IF_ERROR(expect_shape("initial_state", a.initial_state, {N, p.H, p.K, p.V}, "[N, HV, K, V]", a.q));
    ENCORE_RETURN_IF_ERROR(checks::dtype_in("initial_state", a.initial_state, kState));
  }
  // Gates.
  if (o.use_lower_bound && !o.use_gate_in_kernel) return Status::invalid("use_lower_bound: needs use_gate_in_kernel");
  if (o.use_lower_bound && !(o.lower_bound >= -5.0 && o.lower_bound < 0.0))
    return Status::invalid("lower_bound: must lie in [-5, 0), got " + std::to_string(o.lower_bound));
  if (a.A_log.defined()) {
    if (!o.use_gate_in_kernel) return Status::invalid("A_log: only used with use_gate_in_kernel");
    ENCORE_RETURN_IF_ERROR(expect_shape("A_log", a.A_log, {p.H}, "[HV]", a.q));
    ENCORE_RETURN_IF_ERROR(checks::dtype_in("A_log", a.A_log, kState));
  } else if (o.use_gate_in_kernel && !o.use_lower_bound) {
    return Status::invalid("A_log: required by the softplus in-kernel gate");
  }
  if (a.dt_bias.defined()) {
    if (!o.use_gate_in_kernel) return Status::invalid("dt_bias: only used with use_gate_in_kernel");
    ENCORE_RETURN_IF_ERROR(expect_shape("dt_bias", a.dt_bias, {p.H * p.K}, "[HV * K]", a.q));
    ENCORE_RETURN_IF_ERROR(checks::dtype_in("dt_bias", a.dt_bias, kState));
  }
  if (!std::isfinite(o.scale)) return Status::invalid("scale: must be finite");
  p.scale = o.scale > 0.0 ? o.scale : 1.0 / std::sqrt(double(p.K));
  p.opts = o;
  *out = std::move(p);
  return Status::ok();
}

}  // namespace encore::kda
