// encore._encore_torch, the KDA forward: C++ CompositeExplicitAutograd kernels of torch.ops.encore.kda_forward
// (the op chunk_kda's autograd Function runs) and kda_forward_out, as python/encore/kda.py's
// _kda_forward_launch does them: o and final_state (float32, float64 for float64 inputs) allocated on the
// inputs' device, the requested residuals (G float32; Aqk, Akk, h in the residual dtype of the options word;
// h's rows from the C++ chunk count), cu_seqlens copied to the host when it is a CUDA tensor, the CUDA workspace
// allocated by ATen (16-byte aligned) or the caller's checked, and the launcher's ValueError messages. The options
// word `flags` (_kda_args.py _op_flags): final state, q/k L2 norm, in-kernel gate, state_v_first (the states
// [N, HV, V, K], final_state allocated so), bf16 residuals and the residuals to return.
#include <algorithm>
#include <array>

#include "common.hpp"
#include "encore/kda.hpp"

namespace {

using namespace encore_torch;

constexpr int64_t kChunk = 64;  // tokens per chunk (kda::kChunk)
// In inference (no input requires grad), the CUDA forward's workspace of a small problem (<= 1 MiB: <= 10
// chunk records) rides in o's allocation: one caching-allocator call less a call. o then holds it while it
// lives (and its storage, as torch.save writes it, is that much larger); where o may be saved for a
// backward, the workspace is its own allocation, freed when the call returns.
constexpr size_t kWorkspaceInOutput = size_t(1) << 20;

// _kda_args.py's options word (_op_flags / _op_options): the options, the residual dtype and, for kda_forward,
// the residuals to return (bit kResidualG << i for KdaResiduals' field i: G, Aqk, Akk, h, returned in that order).
constexpr int64_t kFinalState = 1, kQkL2norm = 2, kGateInKernel = 4, kStateVFirst = 8, kResidualsBf16 = 16, kResidualG = 32;
constexpr int64_t kWordEnd = 512, kOutWordEnd = 32;  // kda_forward's words; kda_forward_out's (no residuals)
void check_flags(int64_t flags, int64_t end) {
  TORCH_CHECK_VALUE(flags >= 0 && flags < end, "flags: expected an options word in [0, ", end, ") (kda._op_flags), got ", flags);
}

// _kda_args.py _opts: scale None (0 here) is K^-1/2; a given one must be positive and finite.
encore::KdaOptions kda_options(std::optional<double> scale, bool use_qk_l2norm, bool use_gate_in_kernel,
                               std::optional<double> lower_bound, bool output_final_state, bool state_v_first) {
  TORCH_CHECK_VALUE(!scale || (*scale > 0 && std::isfinite(*scale)), "scale: must be positive and finite (None: K ** -0.5), got ",
                    py_repr(scale.value_or(0.0)));
  encore::KdaOptions o;
  o.scale = scale.value_or(0.0);
  o.output_final_state = output_final_state;
  o.use_qk_l2norm = use_qk_l2norm;
  o.use_gate_in_kernel = use_gate_in_kernel;
  o.use_lower_bound = lower_bound.has_value();
  o.lower_bound = lower_bound.value_or(-5.0);
  o.state_v_first = state_v_first;
  return o;
}

// The launcher's shared part: the inputs' views, o and final_state given (final_state undefined when not
// output_final_state), the residuals given where requested; the workspace the caller's (checked) or allocated here.
struct Forward {
  const at::Tensor &q, &k, &v, &g, &beta;
  const OptTensor &initial_state, &A_log, &dt_bias;
  OptTensor cu;  // on the host
  int64_t b, t, kd, h, vd;
};

// kda.py: q and v checked 4-D, cu_seqlens on the host (_host_cu).
Forward inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
               const OptTensor& initial_state, const OptTensor& A_log, const OptTensor& dt_bias, const OptTensor& cu_seqlens) {
  check_dims(q, "q", 4, "[B, T, H, K]");
  check_dims(v, "v", 4, "[B, T, HV, V]");
  OptTensor cu = cu_seqlens && cu_seqlens->defined() ? cu_seqlens : std::nullopt;
  if (cu && cu->is_cuda()) cu = cu->cpu();
  return {q, k, v, g, beta, initial_state, A_log, dt_bias, cu, q.size(0), q.size(1), q.size(3), v.size(2), v.size(3)};
}

// The sequences N: B, or len(cu_seqlens) - 1.
int64_t sequences(const Forward& f) {
  if (!f.cu) return f.b;
  TORCH_CHECK_TYPE(f.cu->dim() > 0, "len() of a 0-d tensor");
  return f.cu->size(0) - 1;
}

encore::KdaForwardArgs forward_args(const Forward& f, const at::Tensor& o, const at::Tensor& fin,
                                    const std::array<at::Tensor, 4>& res) {
  encore::KdaResiduals r;
  if (res[0].defined() || res[1].defined() || res[2].defined() || res[3].defined())
    r = {view(OptTensor(res[0]), "residuals.G"), view(OptTensor(res[1]), "residuals.Aqk"), view(OptTensor(res[2]), "residuals.Akk"),
         view(OptTensor(res[3]), "residuals.h")};
  return {view(f.q, "q"),
          view(f.k, "k"),
          view(f.v, "v"),
          view(f.g, "g"),
          view(f.beta, "beta"),
          view(f.initial_state, "initial_state"),
          view(f.A_log, "A_log"),
          view(f.dt_bias, "dt_bias"),
          view(f.cu, "cu_seqlens"),
          view(OptTensor(o), "o"),
          view(OptTensor(fin), "final_state"),
          r};
}

// NT, the rows of residuals.h: the chunks of 64 tokens of all sequences (the C++ rule, default options).
int64_t chunk_count(const Forward& f) {
  encore::KdaForwardArgs a;
  a.q = view(f.q, "q");
  a.k = view(f.k, "k");
  a.v = view(f.v, "v");
  a.g = view(f.g, "g");
  a.beta = view(f.beta, "beta");
  a.cu_seqlens = view(f.cu, "cu_seqlens");
  int64_t nt = 0;
  check(encore::kda_chunk_count(a, encore::KdaOptions{}, &nt));
  return nt;
}

// The CUDA forward's workspace bytes; 0 on the CPU. Not validated here: run validates every argument and
// names the one it refuses, so the host path validates once, not twice. Without cu_seqlens the bytes follow
// from B, T, HV, K and V alone (the chunk and head counts; K and V choose the path), so each thread keeps
// the last nonzero answer and reuses it while those sizes and the device repeat, as they do call after call
// in a training or serving loop: the workspace query's problem build is skipped (~0.2 us of a call).
size_t workspace_need(const Forward& f, const encore::KdaForwardArgs& args, const encore::KdaOptions& opts) {
  if (!f.q.is_cuda()) return 0;
  if (f.cu) return encore::workspace_bytes(args, opts);
  struct Last {
    std::array<int64_t, 6> sizes{-1, -1, -1, -1, -1, -1};
    size_t bytes = 0;
  };
  thread_local Last last;
  const std::array<int64_t, 6> sizes{f.b, f.t, f.h, f.kd, f.vd, int64_t(f.q.get_device())};
  if (sizes == last.sizes) return last.bytes;
  const size_t bytes = encore::workspace_bytes(args, opts);
  if (bytes > 0) last = {sizes, bytes};
  return bytes;
}

// A workspace of `bytes` on q's device with room for the 16-byte alignment (_core.workspace); *aligned: its start.
at::Tensor new_workspace(const at::Tensor& q, size_t bytes, void** aligned) {
  at::Tensor ws = new_empty(q, {int64_t(bytes) + 16}, at::kByte);
  *aligned = align16(reinterpret_cast<uintptr_t>(ws.data_ptr()));
  return ws;
}

// The run, with the binding's check that a needed workspace is there.
void run_forward(const encore::KdaForwardArgs& args, const encore::KdaOptions& opts, void* workspace, const at::Tensor& q) {
  if (workspace == nullptr) {
    const size_t need = encore::workspace_bytes(args, opts);
    TORCH_CHECK_VALUE(need == 0, "workspace: this call needs ", need, " bytes (query <op>_workspace)");
  }
  check(encore::run(args, opts, workspace, stream_of(q)));
}

// [o, final_state if output_final_state, *residuals in the order G, Aqk, Akk, h]
std::vector<at::Tensor> kda_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                    const at::Tensor& beta, int64_t flags, const OptTensor& initial_state, const OptTensor& A_log,
                                    const OptTensor& dt_bias, const OptTensor& cu_seqlens, std::optional<double> scale,
                                    std::optional<double> lower_bound) {
  check_flags(flags, kWordEnd);
  const bool output_final_state = flags & kFinalState, state_v_first = flags & kStateVFirst;
  std::vector<int> names;  // the residuals asked for, indices into KdaResiduals' fields
  for (int i = 0; i < 4; ++i)
    if (flags & (kResidualG << i)) names.push_back(i);
  const Forward f = inputs(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens);
  const int64_t n = sequences(f);
  const at::ScalarType state = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor fin = !output_final_state ? at::Tensor()
                   : state_v_first     ? new_empty(q, {n, f.h, f.vd, f.kd}, state)
                                       : new_empty(q, {n, f.h, f.kd, f.vd}, state);
  std::array<at::Tensor, 4> res;
  if (!names.empty()) {
    const at::ScalarType kind = (flags & kResidualsBf16) ? at::kBFloat16 : at::kFloat;
    const int64_t nt = std::find(names.begin(), names.end(), 3) != names.end() ? chunk_count(f) : 0;
    for (int i : names) {
      if (i == 0) res[0] = new_empty(q, {f.b, f.t, f.h, f.kd}, at::kFloat);
      else if (i == 3) res[3] = new_empty(q, {nt, f.h, f.kd, f.vd}, kind);
      else res[size_t(i)] = new_empty(q, {f.b, f.t, f.h, kChunk}, kind);
    }
  }
  // The workspace's size reads shapes only: v stands in for o (o has v's shape and dtype) until o exists.
  encore::KdaForwardArgs args = forward_args(f, v, fin, res);
  const encore::KdaOptions opts =
      kda_options(scale, flags & kQkL2norm, flags & kGateInKernel, lower_bound, output_final_state, state_v_first);
  const size_t nbytes = workspace_need(f, args, opts);
  at::Tensor o, ws;
  void* wp = nullptr;
  const bool grad = q.requires_grad() || k.requires_grad() || v.requires_grad() || g.requires_grad() || beta.requires_grad() ||
                    (initial_state && initial_state->requires_grad()) || (A_log && A_log->requires_grad()) ||
                    (dt_bias && dt_bias->requires_grad());
  if (nbytes > 0 && nbytes <= kWorkspaceInOutput && !grad) {  // one allocation: o, then the workspace
    o = empty_with_tail(v, {f.b, f.t, f.h, f.vd}, nbytes, &wp);
  } else {
    o = new_empty(v, {f.b, f.t, f.h, f.vd});
    if (nbytes) ws = new_workspace(q, nbytes, &wp);
  }
  args.o = view(OptTensor(o), "o");
  run_forward(args, opts, wp, q);
  std::vector<at::Tensor> outs{o};
  if (fin.defined()) outs.push_back(fin);
  for (int i : names) outs.push_back(res[size_t(i)]);
  return outs;
}

void kda_forward_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                     int64_t flags, const OptTensor& initial_state, const OptTensor& A_log, const OptTensor& dt_bias,
                     const OptTensor& cu_seqlens, std::optional<double> scale, std::optional<double> lower_bound, const at::Tensor& o,
                     const OptTensor& final_state, const OptTensor& workspace) {
  check_flags(flags, kOutWordEnd);
  const bool output_final_state = flags & kFinalState, state_v_first = flags & kStateVFirst;
  const bool use_qk_l2norm = flags & kQkL2norm, use_gate_in_kernel = flags & kGateInKernel;
  const Forward f = inputs(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens);
  (void)sequences(f);  // (the launcher takes len(cu_seqlens) before looking at out)
  const at::Tensor fin = final_state && final_state->defined() ? *final_state : at::Tensor();
  TORCH_CHECK_VALUE(fin.defined() == output_final_state, "out: final_state must be an array exactly when output_final_state is set");
  const encore::KdaForwardArgs args = forward_args(f, o, fin, {});
  const encore::KdaOptions opts = kda_options(scale, use_qk_l2norm, use_gate_in_kernel, lower_bound, output_final_state, state_v_first);
  const size_t nbytes = workspace_need(f, args, opts);
  void* wp = nullptr;
  at::Tensor own;
  if (workspace && workspace->defined()) {  // _core.workspace: the caller's, checked
    const at::Tensor& ws = *workspace;
    TORCH_CHECK_VALUE(ws.dim() == 1 && ws.scalar_type() == at::kByte, "workspace: expected a 1-D uint8 array");
    TORCH_CHECK_VALUE(ws.device() == q.device(), "workspace: expected an array on the inputs' framework and device");
    void* const aligned = align16(reinterpret_cast<uintptr_t>(ws.data_ptr()));
    const int64_t skip = static_cast<unsigned char*>(aligned) - static_cast<unsigned char*>(ws.data_ptr());
    TORCH_CHECK_VALUE(ws.size(0) >= int64_t(nbytes) + skip, "workspace: ", ws.size(0), " bytes, this call needs ", nbytes,
                      " from a 16-byte aligned address (allocate kda_forward_workspace_bytes(...) bytes)");
    if (nbytes) wp = aligned;
  } else if (nbytes) {
    own = new_workspace(q, nbytes, &wp);
  }
  run_forward(args, opts, wp, q);
}

}  // namespace

TORCH_LIBRARY_IMPL(encore, CompositeExplicitAutograd, m) {
  m.impl("kda_forward", &kda_forward);
  m.impl("kda_forward_out", &kda_forward_out);
}
