// KDA dispatch: validate -> launch plan (plan.cpp) -> CUDA forward (src/kda/cuda), or the CPU reference.
#include <algorithm>
#include <numeric>
#include <vector>
#include <utility>

#include "core/checks.hpp"
#include "core/device_memory.hpp"
#include "encore/core/device_info.hpp"
#include "encore/kda.hpp"
#include "kda/plan.hpp"
#include "kda/pool_forward.hpp"
#include "kda/problem.hpp"
#include "kda/testing.hpp"  // the run overload on an explicit plan, defined here
#include "kda/cuda/launch.hpp"  // host-only declarations and limits
#include "kda/cuda/kda_bwd2.hpp"
#include "kda/cuda/kda_bwd_launch.hpp"
#include "kda/reference/kda_chunked_bwd.hpp"
#include "kda/reference/kda_ref.hpp"

namespace encore {
namespace {

const std::initializer_list<DType> kFloat = {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP64};
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
  const bool vf = p.opts.state_v_first;  // [N, HV, V, K]: each state stored transposed
  const int64_t d2 = vf ? p.V : p.K, d3 = vf ? p.K : p.V;
  if (t.ndim != 4 || t.shape[0] != n || t.shape[1] != p.H || t.shape[2] != d2 || t.shape[3] != d3)
    return Status::invalid(std::string(name) + (vf ? ": expected [N, HV, V, K] (state_v_first) = [" : ": expected [N, HV, K, V] = [") +
                           std::to_string(n) + ", " + std::to_string(p.H) + ", " + std::to_string(d2) + ", " + std::to_string(d3) +
                           "], got " + t.shape_string());
  ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, t, kState));
  ENCORE_RETURN_IF_ERROR(checks::same_device(name, t, "q", q));
  return Status::ok();
}

using kda::chunk_count;
using kda::seq_chunks;

// The optional residual outputs: shapes, dtypes, devices.
Status validate_residuals(const KdaForwardArgs& a, const kda::KdaProblem& p) {
  const KdaResiduals& r = a.residuals;
  auto check = [&](const char* name, const TensorView& t, std::initializer_list<int64_t> shape, const char* layout,
                   std::initializer_list<DType> dtypes) -> Status {
    if (!t.defined()) return Status::ok();
    ENCORE_RETURN_IF_ERROR(checks::present(name, t));
    if (t.ndim != int(shape.size()) || !std::equal(shape.begin(), shape.end(), t.shape.begin())) {
      std::string w = "[";
      for (int64_t s : shape) w += (w.size() > 1 ? ", " : "") + std::to_string(s);
      return Status::invalid(std::string(name) + ": expected " + layout + " = " + w + "], got " + t.shape_string());
    }
    ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, t, dtypes));
    ENCORE_RETURN_IF_ERROR(checks::same_device(name, t, "q", a.q));
    return Status::ok();
  };
  const std::initializer_list<DType> lo = {DType::kBF16, DType::kFP32, DType::kFP64};
  ENCORE_RETURN_IF_ERROR(check("residuals.G", r.G, {p.B, p.T, p.H, p.K}, "[B, T, HV, K]", {DType::kFP32, DType::kFP64}));
  ENCORE_RETURN_IF_ERROR(check("residuals.Aqk", r.Aqk, {p.B, p.T, p.H, kda::kChunk}, "[B, T, HV, 64]", lo));
  ENCORE_RETURN_IF_ERROR(check("residuals.Akk", r.Akk, {p.B, p.T, p.H, kda::kChunk}, "[B, T, HV, 64]", lo));
  if (r.h.defined()) ENCORE_RETURN_IF_ERROR(check("residuals.h", r.h, {chunk_count(p), p.H, p.K, p.V}, "[NT, HV, K, V]", lo));
  return Status::ok();
}

// The forward's CUDA views are device memory of q's device (core/device_memory.hpp; cu_seqlens is a host
// tensor, skipped as every CPU view).
[[maybe_unused]] Status device_memory(const KdaForwardArgs& a) {
  const KdaResiduals& r = a.residuals;
  return checks::device_memory({{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"g", &a.g}, {"beta", &a.beta}, {"initial_state", &a.initial_state},
                                {"A_log", &a.A_log}, {"dt_bias", &a.dt_bias}, {"cu_seqlens", &a.cu_seqlens}, {"o", &a.o},
                                {"final_state", &a.final_state}, {"residuals.G", &r.G}, {"residuals.Aqk", &r.Aqk}, {"residuals.Akk", &r.Akk},
                                {"residuals.h", &r.h}});
}

// The CUDA kernels take H as int and count (head, channel) pairs H * K, work items N * H * column
// tiles and (chunk, head) items chunks * H in int: each must be < 2^31 (issue 48).
Status cuda_head_counts(const kda::KdaProblem& p) {
  const int64_t chunks = chunk_count(p);
  const int64_t col_tiles = (std::max(p.K, p.V) + 31) / 32;  // kda_recurrent.cuh col_tiles, K or V
  const int64_t items = std::max({p.H * std::max(p.K, p.V), chunks * p.H, int64_t(p.seqs.size()) * p.H * col_tiles});
  if (items >= (int64_t(1) << 31))
    return Status::unsupported("v: H = " + std::to_string(p.H) + " heads; the CUDA KDA kernels count H * max(K, V), chunks * H and "
                               "sequences * H * ceil(max(K, V) / 32) in int, here " + std::to_string(items) + " (must be < 2^31)");
  return Status::ok();
}

// What the CUDA forward takes beyond validate().
Status validate_cuda(const KdaForwardArgs& a, const kda::KdaProblem& p) {
  constexpr int64_t kMaxDim = cuda::kKdaRecurrentMaxHeadDim, kMaxSeqs = cuda::kKdaMaxSeqs;
  if (p.K > kMaxDim || p.V > kMaxDim)
    return Status::unsupported("q: the CUDA KDA forward takes K, V <= " + std::to_string(kMaxDim) + " (above " +
                               std::to_string(cuda::kKdaMaxHeadDim) + " the token-recurrent fp32 path), got K = " + std::to_string(p.K) +
                               ", V = " + std::to_string(p.V));
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"g", &a.g}, {"beta", &a.beta},
                         {"o", &a.o}})
    ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, *t, {DType::kBF16, DType::kFP16, DType::kFP32}));
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"initial_state", &a.initial_state}, {"final_state", &a.final_state},
                         {"A_log", &a.A_log}, {"dt_bias", &a.dt_bias}}) {
    if (!t->defined()) continue;
    ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, *t, {DType::kFP32}));
    if (!t->is_contiguous()) return Status::invalid(std::string(name) + ": must be contiguous on CUDA");
    ENCORE_RETURN_IF_ERROR(checks::same_device(name, *t, "q", a.q));
  }
  ENCORE_RETURN_IF_ERROR(checks::same_device("o", a.o, "q", a.q));
  if (int64_t(p.seqs.size()) > kMaxSeqs)
    return Status::unsupported("cu_seqlens: the CUDA KDA forward takes at most " + std::to_string(kMaxSeqs) + " sequences per call, got " +
                               std::to_string(p.seqs.size()));
  if (p.T >= (int64_t(1) << 31)) return Status::unsupported("q: T must be < 2^31");
  ENCORE_RETURN_IF_ERROR(cuda_head_counts(p));
  const KdaResiduals& r = a.residuals;
  DType res_dtype = DType::kFP32;
  bool first = true;
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"residuals.Aqk", &r.Aqk}, {"residuals.Akk", &r.Akk}, {"residuals.h", &r.h}}) {
    if (!t->defined()) continue;
    ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, *t, {DType::kBF16, DType::kFP32}));
    if (!first && t->dtype != res_dtype) return Status::invalid(std::string(name) + ": the CUDA forward writes Aqk, Akk and h in one dtype");
    res_dtype = t->dtype;
    first = false;
  }
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"residuals.G", &r.G}, {"residuals.Aqk", &r.Aqk}, {"residuals.Akk", &r.Akk},
                         {"residuals.h", &r.h}})
    if (t->defined() && !t->is_contiguous()) return Status::invalid(std::string(name) + ": must be contiguous on CUDA");
  if (r.G.defined()) ENCORE_RETURN_IF_ERROR(checks::dtype_in("residuals.G", r.G, {DType::kFP32}));
  return Status::ok();
}

using kda::load_dense;
using kda::store_dense;

// validate() that also hands back the problem (run needs it; built once per call).
Status validate_forward(const KdaForwardArgs& a, const KdaOptions& o, kda::KdaProblem* out) {
  kda::KdaProblem& p = *out;
  ENCORE_RETURN_IF_ERROR(kda::make_problem(a, o, &p));
  ENCORE_RETURN_IF_ERROR(validate_like("o", a.o, a.v, "v", kFloat));
  if (o.output_final_state) {
    ENCORE_RETURN_IF_ERROR(validate_state("final_state", a.final_state, p, a.q));
  } else if (a.final_state.defined()) {
    return Status::invalid("final_state: given but output_final_state is false");
  }
  // The outputs overlap no input and not each other (the CUDA kernels read the inputs while they write
  // o and final_state); final_state may be initial_state itself (the state updated in place: each
  // state element is read before it is written, by the same thread).
  const std::pair<const char*, const TensorView*> inputs[] = {{"q", &a.q},         {"k", &a.k},         {"v", &a.v},
                                                              {"g", &a.g},         {"beta", &a.beta},   {"initial_state", &a.initial_state},
                                                              {"A_log", &a.A_log}, {"dt_bias", &a.dt_bias}, {"cu_seqlens", &a.cu_seqlens}};
  const TensorView& fin = a.final_state;
  for (auto [name, t] : inputs) {
    if (!t->defined()) continue;
    ENCORE_RETURN_IF_ERROR(checks::no_overlap("o", a.o, name, *t));
    const bool in_place = t == &a.initial_state && fin.data == t->data && fin.ndim == t->ndim && fin.shape == t->shape && fin.strides == t->strides;
    if (fin.defined() && !in_place) {
      Status st = checks::no_overlap("final_state", fin, name, *t);
      if (!st && t == &a.initial_state) return Status::invalid(st.message() + " (only exactly, as the same array: the state updated in place)");
      ENCORE_RETURN_IF_ERROR(st);
    }
  }
  if (fin.defined()) ENCORE_RETURN_IF_ERROR(checks::no_overlap("final_state", fin, "o", a.o));
  return validate_residuals(a, p);
}

#ifdef ENCORE_WITH_CUDA
// The launch parameters of the CUDA forward (sequences and their first chunk slots by value).
cuda::KdaTensor kda_tensor(const TensorView& t) { return cuda::KdaTensor{t.data, t.dtype, t.strides[0], t.strides[1], t.strides[2]}; }

// The fields the forward's and the backward's launch parameters share: sizes, options, the inputs.
template <class CudaProblem>
void fill_common(const KdaForwardArgs& a, const KdaOptions& o, const kda::KdaProblem& p, CudaProblem& cp) {
  cp.B = int(p.B);
  cp.T = int(p.T);
  cp.H = int(p.H);
  cp.K = int(p.K);
  cp.V = int(p.V);
  cp.group = int(p.group());
  cp.N = int(p.seqs.size());
  cp.scale = float(p.scale);
  cp.l2norm = o.use_qk_l2norm;
  cp.gate_in_kernel = o.use_gate_in_kernel;
  cp.lower_bound_gate = o.use_lower_bound;
  cp.lower_bound = float(o.lower_bound);
  cp.q = kda_tensor(a.q);
  cp.k = kda_tensor(a.k);
  cp.v = kda_tensor(a.v);
  cp.g = kda_tensor(a.g);
  cp.beta = kda_tensor(a.beta);
  cp.A_log = static_cast<const float*>(a.A_log.data);
  cp.dt_bias = static_cast<const float*>(a.dt_bias.data);
  cp.h0 = static_cast<const float*>(a.initial_state.data);
  cp.state_v_first = o.state_v_first;  // the kernels' state loads / stores index [.., V, K]
}

template <class CudaProblem>  // cuda::KdaCudaProblem or KdaCudaProblemFew (p's sequences fit its tables)
void fill_cuda_problem(const KdaForwardArgs& a, const KdaOptions& o, const kda::KdaProblem& p, CudaProblem& cp) {
  fill_common(a, o, p, cp);
  cp.o = a.o.data;
  cp.o_dtype = a.o.dtype;
  cp.o_sb = a.o.strides[0];
  cp.o_st = a.o.strides[1];
  cp.o_sh = a.o.strides[2];
  cp.final_state = o.output_final_state ? static_cast<float*>(a.final_state.data) : nullptr;
  cp.varlen = a.cu_seqlens.defined();
  cp.res_G = static_cast<float*>(a.residuals.G.data);
  cp.res_Aqk = a.residuals.Aqk.data;
  cp.res_Akk = a.residuals.Akk.data;
  cp.res_h = a.residuals.h.data;
  for (const TensorView* t : {&a.residuals.Aqk, &a.residuals.Akk, &a.residuals.h})
    if (t->defined()) cp.res_dtype = t->dtype;
  int32_t chunk = 0;
  for (size_t n = 0; n < p.seqs.size(); ++n) {
    cp.seq_begin[n] = int32_t(p.seqs[n].begin);
    cp.seq_end[n] = int32_t(p.seqs[n].end);
    cp.chunk_start[n] = chunk;
    chunk += int32_t(seq_chunks(p.seqs[n]));
  }
  cp.chunk_start[p.seqs.size()] = chunk;
  // Longest first, ties in index order (a total order, so std::sort needs no stable buffer), sorted in
  // place: no allocation per call.
  int32_t* order = cp.seq_by_length;
  std::iota(order, order + p.seqs.size(), 0);
  std::sort(order, order + p.seqs.size(), [&](int32_t x, int32_t y) {
    const int32_t lx = cp.chunk_start[x + 1] - cp.chunk_start[x], ly = cp.chunk_start[y + 1] - cp.chunk_start[y];
    return lx != ly ? lx > ly : x < y;
  });
  cp.device = a.q.device.index;
}

// The prefill on a state pool (validated by the serving dispatch): the pool and its device indices.
template <class CudaProblem>
void fill_pool(const TensorView& pool, const TensorView& indices, CudaProblem& cp) {
  cp.pool = pool.data;
  cp.pool_dtype = pool.dtype;
  cp.pool_stride = pool.strides[0];
  cp.pool_slots = pool.shape[0];
  cp.pool_idx = indices.data;
  cp.pool_idx64 = indices.dtype == DType::kInt64;
  cp.pool_idx_stride = indices.strides[0];
}
#endif

// What the CUDA backward takes beyond validate(KdaBackwardArgs): the forward's residuals, dtypes,
// contiguity and the CUDA limits.
Status validate_cuda_backward(const KdaBackwardArgs& b, const kda::KdaProblem& p) {
  const KdaForwardArgs& a = b.fwd;
  const KdaResiduals& r = a.residuals;
  // The first backward (fp32 inputs, fp16 without h) reads the caller's Aqk and Akk; the second (bf16, fp16 with h)
  // re-runs the forward for whichever of Aqk, Akk, h is absent; the token-recurrent path (K or V > 128) reads h at
  // most; G absent: recomputed.
  std::string missing;
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"Aqk", &r.Aqk}, {"Akk", &r.Akk}})
    if (!t->defined()) missing += std::string(missing.empty() ? "" : ", ") + name;
  if (!missing.empty() && kda::kda_backward_kernels(p, r.h.defined(), a.q.dtype) == kda::KdaBackwardKernels::kFirst)
    return Status::invalid("residuals: the CUDA backward needs the forward's residuals Aqk, Akk for fp32 inputs and for fp16 inputs without h "
                           "(G is recomputed when absent; for bf16 inputs, and fp16 with h, absent Aqk, Akk and h are recomputed by the "
                           "forward re-run inside the backward); missing: " + missing);
  constexpr int64_t kMaxDim = cuda::kKdaRecurrentMaxHeadDim, kMaxSeqs = cuda::kKdaMaxSeqs;
  if (p.K > kMaxDim || p.V > kMaxDim)
    return Status::unsupported("q: the CUDA KDA backward takes K, V <= " + std::to_string(kMaxDim) + " (above " +
                               std::to_string(cuda::kKdaMaxHeadDim) + " the token-recurrent fp32 path), got K = " + std::to_string(p.K) +
                               ", V = " + std::to_string(p.V));
  if (int64_t(p.seqs.size()) > kMaxSeqs)
    return Status::unsupported("cu_seqlens: the CUDA KDA backward takes at most " + std::to_string(kMaxSeqs) + " sequences per call, got " +
                               std::to_string(p.seqs.size()));
  if (p.T >= (int64_t(1) << 31)) return Status::unsupported("q: T must be < 2^31");
  ENCORE_RETURN_IF_ERROR(cuda_head_counts(p));
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"g", &a.g}, {"beta", &a.beta},
                         {"d_o", &b.d_o}, {"dq", &b.dq}, {"dk", &b.dk}, {"dv", &b.dv}, {"dg", &b.dg}, {"dbeta", &b.dbeta}}) {
    ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, *t, {DType::kBF16, DType::kFP16, DType::kFP32}));
    ENCORE_RETURN_IF_ERROR(checks::same_device(name, *t, "q", a.q));
    if (t->ndim == 4) ENCORE_RETURN_IF_ERROR(checks::unit_last_stride(name, *t));
  }
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"initial_state", &a.initial_state}, {"A_log", &a.A_log},
                         {"dt_bias", &a.dt_bias}, {"d_final_state", &b.d_final_state}, {"dh0", &b.dh0}, {"dA_log", &b.dA_log},
                         {"ddt_bias", &b.ddt_bias}, {"residuals.G", &r.G}}) {
    if (!t->defined()) continue;
    ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, *t, {DType::kFP32}));
    if (!t->is_contiguous()) return Status::invalid(std::string(name) + ": must be contiguous on CUDA");
    ENCORE_RETURN_IF_ERROR(checks::same_device(name, *t, "q", a.q));
  }
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"residuals.Aqk", &r.Aqk}, {"residuals.Akk", &r.Akk}, {"residuals.h", &r.h}}) {
    if (!t->defined()) continue;
    ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, *t, {DType::kBF16, DType::kFP32}));
    if (!t->is_contiguous()) return Status::invalid(std::string(name) + ": must be contiguous on CUDA");
  }
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"dq", &b.dq}, {"dk", &b.dk}, {"dv", &b.dv}, {"dg", &b.dg}, {"dbeta", &b.dbeta}})
    for (auto [iname, in] : {std::pair<const char*, const TensorView*>{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"g", &a.g}, {"beta", &a.beta},
                             {"d_o", &b.d_o}})
      ENCORE_RETURN_IF_ERROR(checks::no_overlap(name, *t, iname, *in));
  return Status::ok();
}

#ifdef ENCORE_WITH_CUDA
void fill_cuda_backward(const KdaBackwardArgs& b, const KdaOptions& o, const kda::KdaProblem& p, cuda::KdaBwdCudaProblem& cp) {
  const KdaForwardArgs& a = b.fwd;
  fill_common(a, o, p, cp);
  auto out = [](const TensorView& t) { return cuda::KdaOutTensor{t.data, t.dtype, t.strides[0], t.strides[1], t.strides[2]}; };
  cp.d_o = kda_tensor(b.d_o);
  cp.dht = static_cast<const float*>(b.d_final_state.data);
  const KdaResiduals& r = a.residuals;
  cp.G = static_cast<const float*>(r.G.data);
  cp.Aqk = r.Aqk.data;
  cp.aqk_dtype = r.Aqk.dtype;
  cp.Akk = r.Akk.data;
  cp.akk_dtype = r.Akk.dtype;
  cp.h = r.h.defined() ? r.h.data : nullptr;
  cp.h_dtype = r.h.defined() ? r.h.dtype : DType::kFP32;
  cp.dq = out(b.dq);
  cp.dk = out(b.dk);
  cp.dv = out(b.dv);
  cp.dg = out(b.dg);
  cp.dbeta = out(b.dbeta);
  cp.dh0 = static_cast<float*>(b.dh0.data);
  cp.dA_log = static_cast<float*>(b.dA_log.data);
  cp.ddt_bias = static_cast<float*>(b.ddt_bias.data);
  cp.ws = cuda::kda_bwd_layout(p.K, p.V, !r.h.defined());
  cp.varlen = a.cu_seqlens.defined();
  int32_t chunk = 0;
  for (size_t n = 0; n < p.seqs.size(); ++n) {
    cp.seq_begin[n] = int32_t(p.seqs[n].begin);
    cp.seq_end[n] = int32_t(p.seqs[n].end);
    cp.chunk_start[n] = chunk;
    chunk += int32_t(seq_chunks(p.seqs[n]));
  }
  cp.chunk_start[p.seqs.size()] = chunk;
  cp.device = a.q.device.index;
}
#endif

}  // namespace

Status validate(const KdaForwardArgs& a, const KdaOptions& o) {
  kda::KdaProblem p;
  return validate_forward(a, o, &p);
}

Status kda_chunk_count(const KdaForwardArgs& a, const KdaOptions& o, int64_t* chunks) {
  kda::KdaProblem p;
  ENCORE_RETURN_IF_ERROR(kda::make_problem(a, o, &p));
  *chunks = chunk_count(p);
  return Status::ok();
}

size_t workspace_bytes(const KdaForwardArgs& a, const KdaOptions& o) {
  kda::KdaProblem p;
  if (!a.q.defined() || !a.q.device.is_cuda() || !kda::make_problem(a, o, &p)) return 0;
#ifdef ENCORE_WITH_CUDA
  if (cuda::kda_use_recurrent(p.K, p.V)) return 0;  // the token-recurrent forward needs none
  return cuda::kda_forward_workspace_bytes(chunk_count(p), p.H);
#else
  return 0;
#endif
}

namespace {

// The CUDA runs' workspace: given whenever there is a chunk to work on, 16-byte aligned.
[[maybe_unused]] Status check_cuda_workspace(const void* workspace, const kda::KdaProblem& p, const char* pass) {
  if (workspace == nullptr && chunk_count(p) > 0)
    return Status::invalid(std::string("workspace: the CUDA KDA ") + pass + " needs workspace_bytes(args, opts) bytes, got a null pointer");
  if (!checks::aligned(workspace, 16)) return Status::invalid("workspace: must be 16-byte aligned");
  return Status::ok();
}

[[maybe_unused]] Status no_cuda(const TensorView& q) {
  return Status::unsupported("q: on " + q.device.to_string() + " but encore was built without CUDA (ENCORE_CUDA=OFF)");
}

#ifdef ENCORE_WITH_CUDA
// The CUDA forward after validate_cuda: the workspace and device-memory checks, the launch parameters,
// the launches. pool / indices: the prefill on a state pool (kda/pool_forward.hpp; null: a's
// initial_state / final_state).
Status run_cuda(const KdaForwardArgs& a, const KdaOptions& o, const kda::KdaProblem& p, const kda::KdaLaunchPlan& plan,
                const TensorView* pool, const TensorView* indices, void* workspace, Stream stream) {
  const bool recurrent = cuda::kda_use_recurrent(p.K, p.V);  // the token-recurrent forward needs no workspace
  if (recurrent && pool)
    return Status::internal("kda forward on a pool: the chunked CUDA path takes K, V <= " + std::to_string(cuda::kKdaMaxHeadDim));
  if (!recurrent) ENCORE_RETURN_IF_ERROR(check_cuda_workspace(workspace, p, "forward"));
  ENCORE_RETURN_IF_ERROR(device_memory(a));  // the last check: the driver's view of the CUDA views
  if (pool) ENCORE_RETURN_IF_ERROR(checks::device_memory({{"pool", pool}, {"state_indices", indices}}));
  if (!recurrent) ENCORE_RETURN_IF_ERROR(checks::device_pointer("workspace", workspace, a.q.device));
  if (recurrent) {
    cuda::KdaCudaProblem cp{};  // ~17 KB, on the stack: run does not allocate
    fill_cuda_problem(a, o, p, cp);
    return cuda::launch_kda_recurrent_forward(cp, stream);
  }
  const DeviceInfo* info = nullptr;  // cached per device: no driver query per call
  ENCORE_RETURN_IF_ERROR(get_device_info(a.q.device.index, &info));
  kda::KdaLaunchPlan chosen;
  ENCORE_RETURN_IF_ERROR(kda::resolve_plan(plan, p, *info, &chosen));
  // The launch parameters: the few-sequence form (~1.5 KB) where the sequences fit it, else ~17 KB.
  auto launch = [&](auto& cp) {
    fill_cuda_problem(a, o, p, cp);
    if (pool) fill_pool(*pool, *indices, cp);
    return cuda::launch_kda_forward(cp, chosen, workspace, stream);
  };
  if (p.seqs.size() <= size_t(cuda::kKdaFewSeqs)) {
    cuda::KdaCudaProblemFew cp{};
    return launch(cp);
  }
  cuda::KdaCudaProblem cp{};
  return launch(cp);
}
#endif

}  // namespace

Status run(const KdaForwardArgs& a, const KdaOptions& o, void* workspace, Stream stream) {
  return kda::run(a, o, kda::KdaLaunchPlan{}, workspace, stream);  // the rule's plan
}

Status kda::run(const KdaForwardArgs& a, const KdaOptions& o, const KdaLaunchPlan& plan, void* workspace, Stream stream) {
  kda::KdaProblem p;
  ENCORE_RETURN_IF_ERROR(validate_forward(a, o, &p));
  ENCORE_RETURN_IF_ERROR(kda::check_plan(plan));
  if (a.q.device.is_cuda()) {
    ENCORE_RETURN_IF_ERROR(validate_cuda(a, p));
#ifdef ENCORE_WITH_CUDA
    return run_cuda(a, o, p, plan, nullptr, nullptr, workspace, stream);
#else
    (void)workspace;
    (void)stream;
    return no_cuda(a.q);
#endif
  }
  KdaForwardArgs kv = a;  // state_v_first: the states as [N, HV, K, V] views of the same elements
  if (o.state_v_first) kv.initial_state = kda::state_kv_view(a.initial_state), kv.final_state = kda::state_kv_view(a.final_state);
  const reference::KdaInputs in = reference::kda_prepare(p, kv);
  std::vector<double> out, final_state;
  if (a.residuals.any()) {  // the chunked reference exposes them (equal to the recurrence to ~1e-12)
    reference::KdaChunkTrace trace;
    reference::kda_chunked_forward(p, in, out, final_state, &trace);
    const KdaResiduals& r = a.residuals;
    if (r.G.defined()) store_dense(r.G, trace.G);
    if (r.Aqk.defined()) store_dense(r.Aqk, trace.Aqk);
    if (r.Akk.defined()) store_dense(r.Akk, trace.A);
    if (r.h.defined()) store_dense(r.h, trace.h);
  } else {
    reference::kda_recurrent_forward(p, in, out, final_state);
  }
  store_dense(a.o, out);
  if (o.output_final_state) store_dense(kv.final_state, final_state);
  return Status::ok();
}

Status kda::run_cuda_on_pool(const KdaForwardArgs& a, const KdaOptions& o, const KdaProblem& p, const TensorView& pool,
                             const TensorView& indices, void* workspace, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate_cuda(a, p));
#ifdef ENCORE_WITH_CUDA
  return run_cuda(a, o, p, KdaLaunchPlan{}, &pool, &indices, workspace, stream);
#else
  (void)o, (void)pool, (void)indices, (void)workspace, (void)stream;
  return no_cuda(a.q);
#endif
}

namespace {

// Validates the backward's arguments and fills `out` (the forward's problem).
Status validate_backward(const KdaBackwardArgs& a, const KdaOptions& o, kda::KdaProblem* out) {
  kda::KdaProblem& p = *out;
  ENCORE_RETURN_IF_ERROR(kda::make_problem(a.fwd, o, &p));
  ENCORE_RETURN_IF_ERROR(validate_residuals(a.fwd, p));  // the forward's saved tensors, when given
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

}  // namespace

Status validate(const KdaBackwardArgs& a, const KdaOptions& o) {
  kda::KdaProblem p;
  return validate_backward(a, o, &p);
}

#ifdef ENCORE_WITH_CUDA
namespace {
size_t align256(size_t x) { return (x + 255) / 256 * 256; }

// What the chunked CUDA backwards (kSecond, kFirst) hold in the workspace beyond their own bytes (the
// second's layout, or the first's records), at 256-byte aligned offsets:
//   G without the caller's: the chunk-local cumulative gate, fp32 [B, T, HV, K], after the own bytes;
//   the second backward without the caller's h, Aqk or Akk: the forward runs first on the backward's inputs,
//     writing the absent ones in the residual dtype (the given residuals' dtype; else bf16 for bf16 inputs,
//     fp32 otherwise) after G: h [NT, HV, K, V], Aqk and Akk [B, T, HV, 64], and G itself where absent; the
//     forward's o (not read) and its workspace lie at the start of the second backward's region, which the
//     backward's kernels write before they read and the stream runs after the forward.
struct BackwardExtras {
  bool remat = false, gate = false;          // the forward re-run; G recomputed (by that forward, or the G pass)
  bool h = false, Aqk = false, Akk = false;  // written by the re-run
  DType residual = DType::kBF16;             // their dtype
  size_t G_at = 0, h_at = 0, Aqk_at = 0, Akk_at = 0, fwd = 0;  // offsets (o at 0)
  size_t bytes = 0;                                            // the workspace in all
};
BackwardExtras backward_extras(const KdaBackwardArgs& a, const kda::KdaProblem& p, kda::KdaBackwardKernels kernels) {
  const KdaResiduals& r = a.fwd.residuals;
  const bool second = kernels == kda::KdaBackwardKernels::kSecond;
  const size_t rows = size_t(p.B) * size_t(p.T) * size_t(p.H);
  const int64_t nt = chunk_count(p);
  const size_t own = second ? cuda::kda2_layout(p.B * p.T, nt, p.H).bytes
                            : cuda::kda_backward_workspace_bytes(nt, p.H, p.K, p.V, !r.h.defined(), p.B * p.T, p.group());
  BackwardExtras e;
  e.h = second && !r.h.defined();
  e.Aqk = second && !r.Aqk.defined();
  e.Akk = second && !r.Akk.defined();
  e.remat = e.h || e.Aqk || e.Akk;
  e.gate = !r.G.defined();
  e.residual = r.Aqk.defined() ? r.Aqk.dtype
               : r.Akk.defined() ? r.Akk.dtype
               : r.h.defined()   ? r.h.dtype
               : a.fwd.q.dtype == DType::kBF16 ? DType::kBF16
                                               : DType::kFP32;
  size_t at = own;
  if (e.remat) {
    e.fwd = align256(rows * size_t(p.V) * dtype_size(a.fwd.v.dtype));
    at = std::max(at, e.fwd + cuda::kda_forward_workspace_bytes(nt, p.H));
  }
  auto region = [&](bool on, size_t* offset, size_t bytes) {
    if (!on) return;
    *offset = align256(at);
    at = *offset + bytes;
  };
  region(e.gate, &e.G_at, rows * size_t(p.K) * sizeof(float));
  region(e.h, &e.h_at, size_t(nt) * size_t(p.H) * size_t(p.K) * size_t(p.V) * dtype_size(e.residual));
  region(e.Aqk, &e.Aqk_at, rows * size_t(kda::kChunk) * dtype_size(e.residual));
  region(e.Akk, &e.Akk_at, rows * size_t(kda::kChunk) * dtype_size(e.residual));
  e.bytes = at;
  return e;
}

// The re-run forward's arguments: the backward's inputs, o in the workspace, no final state, the absent
// residuals (G, h, Aqk, Akk) in the workspace.
KdaForwardArgs remat_forward_args(const KdaBackwardArgs& a, const kda::KdaProblem& p, const BackwardExtras& e, void* workspace) {
  auto* base = static_cast<unsigned char*>(workspace);
  const Device dev = a.fwd.q.device;
  KdaForwardArgs f = a.fwd;
  f.o = TensorView::contiguous(base, a.fwd.v.dtype, {p.B, p.T, p.H, p.V}, dev);
  f.final_state = TensorView{};
  f.residuals = KdaResiduals{};
  if (e.gate) f.residuals.G = TensorView::contiguous(base + e.G_at, DType::kFP32, {p.B, p.T, p.H, p.K}, dev);
  if (e.h) f.residuals.h = TensorView::contiguous(base + e.h_at, e.residual, {chunk_count(p), p.H, p.K, p.V}, dev);
  if (e.Aqk) f.residuals.Aqk = TensorView::contiguous(base + e.Aqk_at, e.residual, {p.B, p.T, p.H, kda::kChunk}, dev);
  if (e.Akk) f.residuals.Akk = TensorView::contiguous(base + e.Akk_at, e.residual, {p.B, p.T, p.H, kda::kChunk}, dev);
  return f;
}
}  // namespace
#endif

size_t workspace_bytes(const KdaBackwardArgs& a, const KdaOptions& o) {
  kda::KdaProblem p;
  if (!a.fwd.q.defined() || !a.fwd.q.device.is_cuda() || !kda::make_problem(a.fwd, o, &p)) return 0;
#ifdef ENCORE_WITH_CUDA
  const kda::KdaBackwardKernels kernels = kda::kda_backward_kernels(p, a.fwd.residuals.h.defined(), a.fwd.q.dtype);
  if (kernels == kda::KdaBackwardKernels::kRecurrent) {
    int64_t window_rows = 0;  // the backward's partials hold one chunk of every sequence
    for (const auto& sq : p.seqs) window_rows += std::min<int64_t>(kda::kChunk, sq.end - sq.begin);
    return cuda::kda_recurrent_backward_workspace_bytes(chunk_count(p), int64_t(p.seqs.size()), p.H, p.K, p.V, !a.fwd.residuals.h.defined(),
                                                        p.B * p.T, window_rows, o.use_gate_in_kernel);
  }
  return backward_extras(a, p, kernels).bytes;
#else
  return 0;
#endif
}

Status run(const KdaBackwardArgs& a, const KdaOptions& o, void* workspace, Stream stream) {
  kda::KdaProblem p;
  ENCORE_RETURN_IF_ERROR(validate_backward(a, o, &p));
  if (a.fwd.q.device.is_cuda()) {
    ENCORE_RETURN_IF_ERROR(validate_cuda_backward(a, p));
#ifdef ENCORE_WITH_CUDA
    ENCORE_RETURN_IF_ERROR(check_cuda_workspace(workspace, p, "backward"));
    ENCORE_RETURN_IF_ERROR(device_memory(a.fwd));  // the last checks: the driver's view of the CUDA views
    ENCORE_RETURN_IF_ERROR(checks::device_memory({{"d_o", &a.d_o}, {"d_final_state", &a.d_final_state}, {"dq", &a.dq}, {"dk", &a.dk},
                                                  {"dv", &a.dv}, {"dg", &a.dg}, {"dbeta", &a.dbeta}, {"dh0", &a.dh0}, {"dA_log", &a.dA_log},
                                                  {"ddt_bias", &a.ddt_bias}}));
    ENCORE_RETURN_IF_ERROR(checks::device_pointer("workspace", workspace, a.fwd.q.device));
    cuda::KdaBwdCudaProblem cp{};  // ~12 KB, on the stack: run does not allocate
    fill_cuda_backward(a, o, p, cp);
    const kda::KdaBackwardKernels kernels = kda::kda_backward_kernels(p, a.fwd.residuals.h.defined(), a.fwd.q.dtype);
    if (kernels != kda::KdaBackwardKernels::kRecurrent) {  // what the chunked backwards read beyond the caller's residuals
      const BackwardExtras e = backward_extras(a, p, kernels);
      auto* base = static_cast<unsigned char*>(workspace);
      if (e.gate) cp.G = reinterpret_cast<const float*>(base + e.G_at);
      if (e.remat) {  // the forward first: the absent ones of h, Aqk, Akk, G
        KdaOptions fo = o;
        fo.output_final_state = false;
        const KdaForwardArgs f = remat_forward_args(a, p, e, workspace);
        ENCORE_RETURN_IF_ERROR(run(f, fo, base + e.fwd, stream));
        if (e.h) cp.h = f.residuals.h.data, cp.h_dtype = e.residual;
        if (e.Aqk) cp.Aqk = f.residuals.Aqk.data, cp.aqk_dtype = e.residual;
        if (e.Akk) cp.Akk = f.residuals.Akk.data, cp.akk_dtype = e.residual;
      } else if (e.gate) {
        ENCORE_RETURN_IF_ERROR(cuda::launch_kda_gate_cumsum(cp, reinterpret_cast<float*>(base + e.G_at), int(chunk_count(p)), stream));
      }
    }
    switch (kernels) {
      case kda::KdaBackwardKernels::kSecond:
        return cuda::launch_kda2_backward(cp, cuda::kda2_layout(p.B * p.T, chunk_count(p), p.H), workspace, int(chunk_count(p)), stream);
      case kda::KdaBackwardKernels::kRecurrent:
        return cuda::launch_kda_recurrent_backward(cp, workspace, stream);
      case kda::KdaBackwardKernels::kFirst:
        break;
    }
    return cuda::launch_kda_backward(cp, workspace, stream);
#else
    (void)workspace;
    (void)stream;
    return no_cuda(a.fwd.q);
#endif
  }
  KdaBackwardArgs kv = a;  // state_v_first: the states as [N, HV, K, V] views of the same elements
  if (o.state_v_first) {
    kv.fwd.initial_state = kda::state_kv_view(a.fwd.initial_state);
    kv.d_final_state = kda::state_kv_view(a.d_final_state);
    kv.dh0 = kda::state_kv_view(a.dh0);
  }
  const reference::KdaInputs in = reference::kda_prepare(p, kv.fwd);
  const std::vector<double> d_o = load_dense(a.d_o);
  const std::vector<double> d_final = kv.d_final_state.defined() ? load_dense(kv.d_final_state) : std::vector<double>{};
  // With the forward's residuals: the chunked backward, reading them (the stages the CUDA backward
  // runs); without: the token-recurrent backward (equal to 2e-12, tests/kda/test_kda_chunked_bwd_cpu.cpp).
  reference::KdaGrads g;
  if (a.fwd.residuals.any()) {
    const reference::KdaSavedResiduals saved = reference::kda_load_residuals(a.fwd.residuals);
    g = reference::kda_chunked_backward(p, kv.fwd, in, d_o, d_final, &saved);
  } else {
    g = reference::kda_backward(p, kv.fwd, in, d_o, d_final);
  }
  store_dense(a.dq, g.dq);
  store_dense(a.dk, g.dk);
  store_dense(a.dv, g.dv);
  store_dense(a.dg, g.dg);
  store_dense(a.dbeta, g.dbeta);
  if (a.dh0.defined()) store_dense(kv.dh0, g.dh0);
  if (a.dA_log.defined()) store_dense(a.dA_log, g.dA_log);
  if (a.ddt_bias.defined()) store_dense(a.ddt_bias, g.ddt_bias);
  return Status::ok();
}

Status kda::bwd2_stages_workspace(const KdaBackwardArgs& a, const KdaOptions& o, size_t* bytes) {
  kda::KdaProblem p;
  ENCORE_RETURN_IF_ERROR(validate_backward(a, o, &p));
#ifdef ENCORE_WITH_CUDA
  *bytes = cuda::kda2_layout(p.B * p.T, chunk_count(p), p.H).bytes;
  return Status::ok();
#else
  *bytes = 0;
  return no_cuda(a.fwd.q);
#endif
}

Status kda::bwd2_stages(const KdaBackwardArgs& a, const KdaOptions& o, void* workspace, Stream stream, cuda::Kda2Layout* layout) {
  kda::KdaProblem p;
  ENCORE_RETURN_IF_ERROR(validate_backward(a, o, &p));
  if (!a.fwd.q.device.is_cuda()) return Status::invalid("q: the second backward's stages run on CUDA tensors");
  ENCORE_RETURN_IF_ERROR(validate_cuda_backward(a, p));
#ifdef ENCORE_WITH_CUDA
  if (!a.fwd.residuals.G.defined() || !a.fwd.residuals.Aqk.defined() || !a.fwd.residuals.Akk.defined())
    return Status::invalid("residuals: the second backward reads the forward's G, Aqk and Akk");
  cuda::KdaBwdCudaProblem cp{};
  fill_cuda_backward(a, o, p, cp);
  *layout = cuda::kda2_layout(p.B * p.T, chunk_count(p), p.H);
  if (!cp.h) return Status::invalid("residuals.h: the second backward runs the saved-h path");
  return cuda::launch_kda2_backward(cp, *layout, workspace, int(chunk_count(p)), stream);
#else
  (void)workspace;
  (void)stream;
  (void)layout;
  return no_cuda(a.fwd.q);
#endif
}

}  // namespace encore
