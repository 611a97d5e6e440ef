// KDA context-parallel summaries and merge (encore/kda_cp.hpp): validation, then the fp64 CPU
// reference (src/kda/reference/kda_cp.cpp) or, for CUDA tensors, the composition of the CUDA forward and
// backward (kda_cp_compose.cpp) and the merge kernel (cuda/kda_cp_fill.cu).
#include "encore/kda_cp.hpp"

#include <string>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "core/device_memory.hpp"
#include "kda/cuda/kda_cp_fill.hpp"
#include "kda/kda_cp_compose.hpp"
#include "kda/problem.hpp"
#include "kda/reference/kda_cp.hpp"

namespace encore {
namespace {

Status shaped(const char* name, const TensorView& t, std::initializer_list<int64_t> want, const char* layout) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  std::vector<int64_t> w(want);
  bool ok = t.ndim == int(w.size());
  for (size_t i = 0; ok && i < w.size(); ++i) ok = t.shape[i] == w[i];
  if (!ok) {
    std::string s = "[";
    for (size_t i = 0; i < w.size(); ++i) s += (i ? ", " : "") + std::to_string(w[i]);
    return Status::invalid(std::string(name) + ": expected " + layout + " = " + s + "], got " + t.shape_string());
  }
  return checks::dtype_in(name, t, {DType::kFP32, DType::kFP64});
}

void store(const TensorView& t, const std::vector<double>& v) {  // a contiguous-or-strided 3-D/4-D write in index order
  int64_t i = 0;
  const int64_t d0 = t.shape[0], d1 = t.shape[1], d2 = t.shape[2];
  for (int64_t a = 0; a < d0; ++a)
    for (int64_t b = 0; b < d1; ++b)
      for (int64_t c = 0; c < d2; ++c) store_from_double(t.data, t.dtype, a * t.strides[0] + b * t.strides[1] + c * t.strides[2], v[size_t(i++)]);
}
double at(const TensorView& t, int64_t a, int64_t b, int64_t c, int64_t d) {
  return load_as_double(t.data, t.dtype, a * t.strides[0] + b * t.strides[1] + c * t.strides[2] + d * t.strides[3]);
}

}  // namespace

namespace kda {

Status cp_summary_problem(const KdaCpSummaryArgs& a, const KdaOptions& o, bool backward, KdaProblem* out) {
  KdaProblem& p = *out;
  if (o.state_v_first) return Status::unsupported("state_v_first: the context-parallel summaries take the [K, V] state layout only");
  ENCORE_RETURN_IF_ERROR(make_problem(a.fwd, o, &p));
  if (a.piece < 0 || a.piece >= int64_t(p.seqs.size()))
    return Status::invalid("piece: expected a local sequence in [0, " + std::to_string(p.seqs.size()) + "), got " + std::to_string(a.piece));
  ENCORE_RETURN_IF_ERROR(shaped("S", a.S, {p.H, p.K, p.V}, "[HV, K, V]"));
  ENCORE_RETURN_IF_ERROR(shaped("M", a.M, {p.H, p.K, p.K}, "[HV, K, K]"));
  if (backward) {
    ENCORE_RETURN_IF_ERROR(checks::present("d_o", a.d_o));
    if (a.d_o.ndim != 4 || a.d_o.shape[0] != p.B || a.d_o.shape[1] != p.T || a.d_o.shape[2] != p.H || a.d_o.shape[3] != p.V)
      return Status::invalid("d_o: expected [B, T, HV, V], got " + a.d_o.shape_string());
    ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("d_o", a.d_o));
  }
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"S", &a.S}, {"M", &a.M}, {"d_o", &a.d_o}})
    if (t->defined()) ENCORE_RETURN_IF_ERROR(checks::same_device(name, *t, "q", a.fwd.q));
  return Status::ok();
}

}  // namespace kda

namespace {

Status summary(const KdaCpSummaryArgs& a, const KdaOptions& o, bool backward, void* workspace, Stream stream) {
  if (a.fwd.q.defined() && a.fwd.q.device.is_cuda()) return kda::cp_compose_summary(a, o, backward, workspace, stream);
  kda::KdaProblem p;
  ENCORE_RETURN_IF_ERROR(kda::cp_summary_problem(a, o, backward, &p));
  const reference::KdaInputs in = reference::kda_prepare(p, a.fwd);
  reference::KdaCpSummary s;
  if (backward) {
    std::vector<double> d_o(size_t(p.B * p.T * p.H * p.V));
    size_t i = 0;
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t t = 0; t < p.T; ++t)
        for (int64_t h = 0; h < p.H; ++h)
          for (int64_t c = 0; c < p.V; ++c) d_o[i++] = at(a.d_o, b, t, h, c);
    s = reference::kda_cp_backward_summary(p, in, d_o, a.piece);
  } else {
    s = reference::kda_cp_forward_summary(p, in, a.piece);
  }
  store(a.S, s.S);
  store(a.M, s.M);
  return Status::ok();
}

}  // namespace

Status kda_cp_split(const std::vector<int64_t>& cu, const std::vector<int64_t>& bounds, std::vector<KdaCpRankSplit>* out) {
  if (cu.size() < 2 || cu.front() != 0) return Status::invalid("cu_seqlens: expected [N + 1] offsets from 0");
  for (size_t i = 0; i + 1 < cu.size(); ++i)
    if (cu[i + 1] < cu[i]) return Status::invalid("cu_seqlens: must be non-decreasing");
  if (bounds.size() < 2 || bounds.front() != 0 || bounds.back() != cu.back())
    return Status::invalid("bounds: expected [R + 1] offsets from 0 to the total token count " + std::to_string(cu.back()));
  for (size_t i = 0; i + 1 < bounds.size(); ++i)
    if (bounds[i + 1] <= bounds[i]) return Status::invalid("bounds: every rank must hold at least one token (strictly increasing)");
  out->clear();
  for (const auto& r : reference::kda_cp_split(cu, bounds)) out->push_back({r.cu, r.pre_num_ranks, r.post_num_ranks});
  return Status::ok();
}

size_t cp_forward_summary_workspace_bytes(const KdaCpSummaryArgs& a, const KdaOptions& o) {
  return a.fwd.q.defined() && a.fwd.q.device.is_cuda() ? kda::cp_compose_workspace_bytes(a, o, false) : 0;
}
size_t cp_backward_summary_workspace_bytes(const KdaCpSummaryArgs& a, const KdaOptions& o) {
  return a.fwd.q.defined() && a.fwd.q.device.is_cuda() ? kda::cp_compose_workspace_bytes(a, o, true) : 0;
}
Status run_cp_forward_summary(const KdaCpSummaryArgs& a, const KdaOptions& o, void* workspace, Stream stream) {
  return summary(a, o, false, workspace, stream);
}
Status run_cp_backward_summary(const KdaCpSummaryArgs& a, const KdaOptions& o, void* workspace, Stream stream) {
  return summary(a, o, true, workspace, stream);
}

Status run_cp_merge(const TensorView& S, const TensorView& M, const TensorView& out, Stream stream) {
  ENCORE_RETURN_IF_ERROR(checks::present("S", S));
  if (S.ndim != 4) return Status::invalid("S: expected [n, HV, K, V], got " + S.shape_string());
  const int64_t n = S.shape[0], H = S.shape[1], K = S.shape[2], V = S.shape[3];
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("S", S, {DType::kFP32, DType::kFP64}));
  ENCORE_RETURN_IF_ERROR(checks::present("M", M));
  if (M.ndim != 4 || M.shape[0] != n || M.shape[1] != H || M.shape[2] != K || M.shape[3] != K)
    return Status::invalid("M: expected [n, HV, K, K] matching S " + S.shape_string() + ", got " + M.shape_string());
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("M", M, {DType::kFP32, DType::kFP64}));
  ENCORE_RETURN_IF_ERROR(shaped("out", out, {H, K, V}, "[HV, K, V]"));
  ENCORE_RETURN_IF_ERROR(checks::same_device("M", M, "S", S));
  ENCORE_RETURN_IF_ERROR(checks::same_device("out", out, "S", S));
  if (S.device.is_cuda()) {
    for (auto [name, t] : {std::pair<const char*, const TensorView*>{"S", &S}, {"M", &M}, {"out", &out}}) {
      ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, *t, {DType::kFP32}));
      if (!t->is_contiguous()) return Status::invalid(std::string(name) + ": must be contiguous on CUDA");
    }
    ENCORE_RETURN_IF_ERROR(checks::device_memory({{"S", &S}, {"M", &M}, {"out", &out}}));
#ifdef ENCORE_WITH_CUDA
    return cuda::kda_cp_merge(static_cast<const float*>(S.data), static_cast<const float*>(M.data), static_cast<float*>(out.data), n, H, K,
                              V, S.device.index, stream);
#else
    (void)stream;
    return Status::unsupported("S: on " + S.device.to_string() + " but encore was built without CUDA (ENCORE_CUDA=OFF)");
#endif
  }
  std::vector<reference::KdaCpSummary> sums(static_cast<size_t>(n));
  std::vector<const reference::KdaCpSummary*> chain;
  for (int64_t j = 0; j < n; ++j) {
    reference::KdaCpSummary& s = sums[size_t(j)];
    s.S.resize(size_t(H * K * V));
    s.M.resize(size_t(H * K * K));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t x = 0; x < K; ++x) {
        for (int64_t c = 0; c < V; ++c) s.S[size_t((h * K + x) * V + c)] = at(S, j, h, x, c);
        for (int64_t c = 0; c < K; ++c) s.M[size_t((h * K + x) * K + c)] = at(M, j, h, x, c);
      }
    chain.push_back(&s);
  }
  store(out, reference::kda_cp_merge(chain, H, K, V));
  return Status::ok();
}

}  // namespace encore
