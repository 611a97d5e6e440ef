// KDA context-parallel summaries composed from the public forward and backward on the piece's tokens
// (kda_cp_compose.hpp): a plan carves the scratch views (zero v, identity h0, the runs' discarded outputs,
// the backward's residuals and the runs' own workspace) out of one workspace, then up to three runs and
// two fills, all on one stream: no allocation, no synchronization.
#include "kda/kda_cp_compose.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/carve.hpp"
#include "core/checks.hpp"
#include "core/device_memory.hpp"
#include "kda/cuda/kda_cp_fill.hpp"
#include "kda/cuda/launch.hpp"

namespace encore::kda {
namespace {

// Sequence s's tokens of a [B, T, ...] tensor as a [1, len, ...] view.
TensorView piece_rows(const TensorView& t, const Sequence& s) {
  TensorView r = t;
  r.data = static_cast<char*>(t.data) + (s.batch * t.strides[0] + s.begin * t.strides[1]) * int64_t(t.element_size());
  r.shape[0] = 1;
  r.shape[1] = s.end - s.begin;
  return r;
}

// [a, b, c] as [1, a, b, c] (a state of one sequence).
TensorView one_state(const TensorView& t) {
  TensorView r = t;
  r.ndim = 4;
  for (int d = 3; d >= 1; --d) {
    r.shape[d] = t.shape[d - 1];
    r.strides[d] = t.strides[d - 1];
  }
  r.shape[0] = 1;
  r.strides[0] = t.shape[0] * t.strides[0];
  return r;
}

struct Plan {
  KdaForwardArgs fs, fm;  // S_ext (from 0; with residuals for the backward), M (v = 0, from I)
  KdaOptions os, om;
  KdaBackwardArgs b;      // dS_ext = dh0
  void* zero = nullptr;   // v = 0 (and the backward's h0 = 0)
  size_t zero_bytes = 0;
  TensorView eye, m_tmp;  // h0 = I; the backward's M before the transpose
  void* ws = nullptr;     // the runs' own workspace (shared: they run one after the other)
  size_t total = 0;
};

Plan make_plan(const KdaCpSummaryArgs& a, const KdaOptions& o, bool backward, const KdaProblem& p, void* base) {
  const Sequence& s = p.seqs[size_t(a.piece)];
  const int64_t len = s.end - s.begin, H = p.H, K = p.K, V = p.V;
  const bool cuda = a.fwd.q.device.is_cuda();
  const DType st = cuda ? DType::kFP32 : DType::kFP64;  // states, residuals (fp64: the CPU backend's exact mode)
  Carve c{static_cast<char*>(base), 0, a.fwd.q.device};
  Plan pl;
  KdaForwardArgs in;
  in.q = piece_rows(a.fwd.q, s);
  in.k = piece_rows(a.fwd.k, s);
  in.v = piece_rows(a.fwd.v, s);
  in.g = piece_rows(a.fwd.g, s);
  in.beta = piece_rows(a.fwd.beta, s);
  in.A_log = a.fwd.A_log;
  in.dt_bias = a.fwd.dt_bias;
  const TensorView zero_v = c.take(a.fwd.q.dtype, {1, len, H, K});  // v's dtype is q's
  const TensorView zero_h0 = backward ? c.take(st, {1, H, K, V}) : TensorView{};
  pl.zero = zero_v.data;
  pl.zero_bytes = c.off - size_t(reinterpret_cast<uintptr_t>(zero_v.data) - reinterpret_cast<uintptr_t>(c.base));
  pl.eye = c.take(st, {1, H, K, K});
  void* o_buf = c.bytes(size_t(len * H * std::max(K, V)) * dtype_size(a.fwd.v.dtype));

  pl.fs = in;
  pl.fs.o = TensorView::contiguous(o_buf, a.fwd.v.dtype, {1, len, H, V}, c.dev);
  pl.os = o;
  pl.os.output_final_state = !backward;
  if (!backward) pl.fs.final_state = one_state(a.S);
  pl.fm = in;
  pl.fm.v = zero_v;
  pl.fm.initial_state = pl.eye;
  pl.fm.o = TensorView::contiguous(o_buf, a.fwd.v.dtype, {1, len, H, K}, c.dev);
  pl.om = o;
  pl.om.output_final_state = true;
  size_t ws = std::max(workspace_bytes(pl.fs, pl.os), workspace_bytes(pl.fm, pl.om));
  if (backward) {
    pl.m_tmp = c.take(st, {1, H, K, K});
    pl.fm.final_state = pl.m_tmp;
    pl.fs.initial_state = zero_h0;
    KdaResiduals& r = pl.fs.residuals;
    r.G = c.take(st, {1, len, H, K});
    r.Aqk = c.take(st, {1, len, H, kChunk});
    r.Akk = c.take(st, {1, len, H, kChunk});
    r.h = c.take(st, {(len + kChunk - 1) / kChunk, H, K, V});
    KdaBackwardArgs& b = pl.b;
    b.fwd = pl.fs;
    b.d_o = piece_rows(a.d_o, s);
    b.dq = c.take(a.fwd.q.dtype, {1, len, p.Hq, K});
    b.dk = c.take(a.fwd.k.dtype, {1, len, p.Hq, K});
    b.dv = c.take(a.fwd.v.dtype, {1, len, H, V});
    b.dg = c.take(a.fwd.g.dtype, {1, len, H, K});
    b.dbeta = c.take(a.fwd.beta.dtype, {1, len, H});
    b.dh0 = one_state(a.S);
    ws = std::max(ws, workspace_bytes(b, o));
  } else {
    pl.fm.final_state = one_state(a.M);
  }
  pl.ws = c.bytes(ws);
  pl.total = c.off;
  return pl;
}

Status with_context(Status s, const char* what) {
  if (s) return s;
  return Status(s.code(), std::string(what) + ": " + s.message());
}

// The fills, on q's device: CUDA kernels / memsets, or host loops over (possibly strided) views.
Status fill_zero(void* p, size_t bytes, const Device& d, Stream stream) {
#ifdef ENCORE_WITH_CUDA
  if (d.is_cuda()) return cuda::kda_cp_zero(p, bytes, d.index, stream);
#endif
  (void)d;
  (void)stream;
  if (bytes) std::memset(p, 0, bytes);
  return Status::ok();
}

// t [.., a, b, c] with the leading dims merged into a: t[h, x, y] = f(h, x, y) (CPU).
template <class F>
void store3(const TensorView& t, F f) {
  const int n = t.ndim;
  const int64_t A = t.numel() / (t.shape[n - 1] * t.shape[n - 2]);
  for (int64_t h = 0; h < A; ++h)
    for (int64_t x = 0; x < t.shape[n - 2]; ++x)
      for (int64_t y = 0; y < t.shape[n - 1]; ++y)
        store_from_double(t.data, t.dtype, h * t.strides[n - 3] + x * t.strides[n - 2] + y * t.strides[n - 1], f(h, x, y));
}

Status fill_identity(const TensorView& t, int64_t H, int64_t K, Stream stream) {
#ifdef ENCORE_WITH_CUDA
  if (t.device.is_cuda()) return cuda::kda_cp_identity(static_cast<float*>(t.data), H, K, t.device.index, stream);
#endif
  (void)H;
  (void)K;
  (void)stream;
  store3(t, [](int64_t, int64_t x, int64_t y) { return x == y ? 1.0 : 0.0; });
  return Status::ok();
}

// dst [H, K, K] = srcᵀ per head (src contiguous [1, H, K, K]).
Status transpose(const TensorView& src, const TensorView& dst, int64_t H, int64_t K, Stream stream) {
#ifdef ENCORE_WITH_CUDA
  if (dst.device.is_cuda())
    return cuda::kda_cp_transpose(static_cast<const float*>(src.data), static_cast<float*>(dst.data), H, K, dst.device.index, stream);
#endif
  (void)H;
  (void)stream;
  store3(dst, [&](int64_t h, int64_t x, int64_t y) { return load_as_double(src.data, src.dtype, (h * K + y) * K + x); });
  return Status::ok();
}

// What the composition takes beyond cp_summary_problem: the CUDA forward's head-dim limit, the outputs'
// device and, on CUDA, fp32 contiguous S and M (the forward's final-state layout).
Status validate_compose(const KdaCpSummaryArgs& a, const KdaProblem& p, const char* what) {
  const bool cuda = a.fwd.q.device.is_cuda();
#ifndef ENCORE_WITH_CUDA
  if (cuda) return Status::unsupported(std::string(what) + ": q on " + a.fwd.q.device.to_string() + " but encore was built without CUDA");
#endif
  if (cuda && (p.K > cuda::kKdaMaxHeadDim || p.V > cuda::kKdaMaxHeadDim))
    return Status::unsupported(std::string(what) + ": CUDA takes K, V <= " + std::to_string(cuda::kKdaMaxHeadDim) +
                               " (the CUDA forward's limit; M runs it with V = K), got K = " + std::to_string(p.K) + ", V = " +
                               std::to_string(p.V));
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"S", &a.S}, {"M", &a.M}, {"d_o", &a.d_o}}) {
    if (!t->defined()) continue;
    ENCORE_RETURN_IF_ERROR(checks::same_device(name, *t, "q", a.fwd.q));
    if (cuda && t != &a.d_o) {
      ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, *t, {DType::kFP32}));
      if (!t->is_contiguous()) return Status::invalid(std::string(name) + ": must be contiguous on CUDA");
    }
  }
  return Status::ok();
}

}  // namespace

size_t cp_compose_workspace_bytes(const KdaCpSummaryArgs& a, const KdaOptions& o, bool backward) {
  KdaProblem p;
  if (!cp_summary_problem(a, o, backward, &p) || !validate_compose(a, p, "")) return 0;
  const Sequence& s = p.seqs[size_t(a.piece)];
  if (s.end == s.begin) return 0;
  return make_plan(a, o, backward, p, nullptr).total;
}

Status cp_compose_summary(const KdaCpSummaryArgs& a, const KdaOptions& o, bool backward, void* workspace, Stream stream) {
  const char* what = backward ? "kda cp backward summary" : "kda cp forward summary";
  KdaProblem p;
  ENCORE_RETURN_IF_ERROR(cp_summary_problem(a, o, backward, &p));
  ENCORE_RETURN_IF_ERROR(validate_compose(a, p, what));
  const Sequence& s = p.seqs[size_t(a.piece)];
  const Device dev = a.fwd.q.device;
  const bool empty = s.end == s.begin;
  if (!empty && workspace == nullptr)
    return Status::invalid(std::string("workspace: ") + what + " needs cp_*_summary_workspace_bytes(args, opts) bytes");
  if (!empty && !checks::aligned(workspace, 16)) return Status::invalid("workspace: must be 16-byte aligned");
  // Before the first fill: the views this composition writes or reads directly (the runs check theirs).
  ENCORE_RETURN_IF_ERROR(checks::device_memory({{"S", &a.S}, {"M", &a.M}, {"d_o", &a.d_o}, {"q", &a.fwd.q}}));
  if (!empty) ENCORE_RETURN_IF_ERROR(checks::device_pointer("workspace", workspace, dev));
  if (empty) {  // an empty piece: S_ext = 0 (dS_ext = 0), M = I (dM = I)
    if (dev.is_cuda()) ENCORE_RETURN_IF_ERROR(fill_zero(a.S.data, size_t(a.S.numel()) * a.S.element_size(), dev, stream));
    else store3(a.S, [](int64_t, int64_t, int64_t) { return 0.0; });
    return fill_identity(a.M, p.H, p.K, stream);
  }
  const Plan pl = make_plan(a, o, backward, p, workspace);
  ENCORE_RETURN_IF_ERROR(fill_zero(pl.zero, pl.zero_bytes, dev, stream));
  ENCORE_RETURN_IF_ERROR(fill_identity(pl.eye, p.H, p.K, stream));
  ENCORE_RETURN_IF_ERROR(with_context(run(pl.fs, pl.os, pl.ws, stream), backward ? "kda cp backward summary, the piece's forward"
                                                                                  : "kda cp forward summary, the piece's forward (S_ext)"));
  ENCORE_RETURN_IF_ERROR(with_context(run(pl.fm, pl.om, pl.ws, stream), backward ? "kda cp backward summary, the forward with v = 0 (M)"
                                                                                  : "kda cp forward summary, the forward with v = 0 (M)"));
  if (!backward) return Status::ok();
  ENCORE_RETURN_IF_ERROR(transpose(pl.m_tmp, a.M, p.H, p.K, stream));
  return with_context(run(pl.b, o, pl.ws, stream), "kda cp backward summary, the piece's backward (dS_ext = dh0)");
}

}  // namespace encore::kda
