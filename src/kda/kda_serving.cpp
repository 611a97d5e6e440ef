// KDA serving (include/encore/kda_serving.hpp): the recurrent step and the chunked prefill over a state
// pool. Validation (shapes, dtypes, the pool's layout, index values where they are on the host), then
// the CPU reference (kda_prepare + kda_recurrent_sequence, fp64) or, on CUDA tensors, the decode kernel
// for the recurrent step (src/kda/cuda/kda_decode.cu) and the CUDA chunked forward with the pool for the
// prefill (kda/pool_forward.hpp: kda.cpp's launches, the state kernel reading and writing the slots;
// K or V > 128: the decode kernel, which takes any length) (docs/kda_serving.md).
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "core/device_memory.hpp"
#include "encore/core/device_info.hpp"
#include "encore/kda_serving.hpp"
#include "kda/plan.hpp"
#include "kda/pool_forward.hpp"
#include "kda/problem.hpp"
#include "kda/reference/kda_ref.hpp"
#include "kda/testing.hpp"  // the run overload on an explicit decode plan, defined here
#ifdef ENCORE_WITH_CUDA
#include "kda/cuda/kda_decode.hpp"
#include "kda/cuda/launch.hpp"  // host-only: kda_use_recurrent
#endif

namespace encore {
namespace {

const std::initializer_list<DType> kFloat = {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP64};
const std::initializer_list<DType> kStateTypes = {DType::kBF16, DType::kFP32, DType::kFP64};
const std::initializer_list<DType> kIndexTypes = {DType::kInt32, DType::kInt64};

using Named = std::pair<const char*, const TensorView*>;

std::string str(int64_t x) { return std::to_string(x); }

using kda::store_dense;

// t[i] (1-D) or t[i, j] (2-D) of an int32 / int64 host view.
int64_t index_at(const TensorView& t, int64_t i, int64_t j = 0) {
  const int64_t off = i * t.strides[0] + (t.ndim == 2 ? j * t.strides[1] : 0);
  return t.dtype == DType::kInt32 ? static_cast<const int32_t*>(t.data)[off] : static_cast<const int64_t*>(t.data)[off];
}

// A state tensor [rows, HV, K, V] (rows < 0: any, a pool): each row's [HV, K, V] contiguous, rows disjoint.
Status validate_states(const char* name, const TensorView& t, int64_t rows, const kda::KdaProblem& p, const TensorView& q) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  const bool vf = p.opts.state_v_first;  // [.., HV, V, K]: each state stored transposed
  const char* layout = vf ? (rows < 0 ? "[P, HV, V, K] (state_v_first)" : "[N, HV, V, K] (state_v_first)")
                          : (rows < 0 ? "[P, HV, K, V]" : "[N, HV, K, V]");
  const int64_t d2 = vf ? p.V : p.K, d3 = vf ? p.K : p.V;
  if (t.ndim != 4 || (rows >= 0 && t.shape[0] != rows) || t.shape[1] != p.H || t.shape[2] != d2 || t.shape[3] != d3)
    return Status::invalid(std::string(name) + ": expected " + layout + " = [" + (rows < 0 ? std::string("P") : str(rows)) + ", " +
                           str(p.H) + ", " + str(d2) + ", " + str(d3) + "], got " + t.shape_string());
  ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, t, kStateTypes));
  ENCORE_RETURN_IF_ERROR(checks::same_device(name, t, "q", q));
  const int64_t slot = p.H * p.K * p.V;
  if (t.strides[3] != 1 || t.strides[2] != d3 || t.strides[1] != p.K * p.V || (t.shape[0] > 1 && t.strides[0] < slot))
    return Status::invalid(std::string(name) + ": each slot's " + (vf ? "[HV, V, K]" : "[HV, K, V]") +
                           " must be contiguous and the slot stride at least HV * K * V = " +
                           str(slot) + ", got strides [" + str(t.strides[0]) + ", " + str(t.strides[1]) + ", " + str(t.strides[2]) + ", " +
                           str(t.strides[3]) + "]");
  return Status::ok();
}

// An index tensor on the host or on q's device.
Status validate_indices(const char* name, const TensorView& t, const TensorView& q) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, t, kIndexTypes));
  if (t.device.is_cuda() && !(t.device == q.device))
    return Status::invalid(std::string(name) + ": on " + t.device.to_string() + ", expected the host or q's device " + q.device.to_string());
  return Status::ok();
}

// Which slot each sequence starts from and which slots its tokens write, from host index values.
struct SlotPlan {
  std::vector<int64_t> read;  // per sequence: the slot of its initial state; -1: padding (or no tokens: nothing touched)
  bool per_token = false;     // [N, S] indices: token t of sequence n writes slot write[n][t] (< 0: not written)
  std::vector<std::vector<int64_t>> write;
};

// The pool's slots of a call: start column col_n (num_accepted_tokens[n] - 1, or 0), range [0, P), no slot
// used twice. Index values are read only from host memory (CUDA views: not checked here; plan left empty).
Status plan_slots(const kda::KdaProblem& p, const TensorView& idx, const TensorView& nat, int64_t P, SlotPlan* plan) {
  const int64_t N = int64_t(p.seqs.size());
  const bool two_d = idx.ndim == 2;
  const int64_t S = two_d ? idx.shape[1] : 1;
  plan->per_token = two_d;
  plan->read.assign(size_t(N), -1);
  plan->write.assign(size_t(N), {});
  if (idx.device.is_cuda() || (nat.defined() && nat.device.is_cuda())) return Status::ok();
  std::map<int64_t, std::pair<int64_t, int64_t>> seen;  // slot -> the entry (n, column) using it
  auto use = [&](int64_t n, int64_t c) -> Status {
    const int64_t s = index_at(idx, n, c);
    const std::string at = two_d ? "[" + str(n) + ", " + str(c) + "]" : "[" + str(n) + "]";
    if (s < 0) return Status::ok();
    if (s >= P) return Status::invalid("state_indices: entry " + at + " = " + str(s) + " is out of the pool's range [0, " + str(P) + ")");
    auto [it, fresh] = seen.emplace(s, std::make_pair(n, c));
    if (!fresh && it->second != std::make_pair(n, c)) {
      const auto [m, d] = it->second;
      return Status::invalid("state_indices: slot " + str(s) + " is used twice in one call (entries " +
                             (two_d ? "[" + str(m) + ", " + str(d) + "]" : "[" + str(m) + "]") + " and " + at +
                             "); a call's non-negative indices must be distinct");
    }
    return Status::ok();
  };
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = p.seqs[size_t(n)].end - p.seqs[size_t(n)].begin;
    int64_t col = 0;
    if (nat.defined()) {
      const int64_t a = index_at(nat, n);
      if (a < 1 || a > S)
        return Status::invalid("num_accepted_tokens: entry [" + str(n) + "] = " + str(a) + " must lie in [1, S = " + str(S) +
                               "] (it picks the start slot state_indices[n, num_accepted_tokens[n] - 1])");
      col = a - 1;
    }
    if (len == 0) continue;  // no tokens: nothing read or written
    const int64_t r = index_at(idx, n, col);
    if (r < 0) continue;  // padding
    ENCORE_RETURN_IF_ERROR(use(n, col));
    plan->read[size_t(n)] = r;
    if (two_d) {
      for (int64_t t = 0; t < len; ++t) {
        ENCORE_RETURN_IF_ERROR(use(n, t));
        plan->write[size_t(n)].push_back(index_at(idx, n, t));
      }
    }
  }
  return Status::ok();
}

// The outputs (written) overlap no input and not each other.
Status no_overlaps(std::initializer_list<Named> outputs, std::initializer_list<Named> inputs) {
  for (auto [oname, out] : outputs) {
    if (!out->defined()) continue;
    for (auto [iname, in] : inputs)
      if (in->defined()) ENCORE_RETURN_IF_ERROR(checks::no_overlap(oname, *out, iname, *in));
  }
  for (auto a = outputs.begin(); a != outputs.end(); ++a)
    for (auto b = a + 1; b != outputs.end(); ++b)
      if (a->second->defined() && b->second->defined()) ENCORE_RETURN_IF_ERROR(checks::no_overlap(a->first, *a->second, b->first, *b->second));
  return Status::ok();
}

KdaForwardArgs forward_view(const KdaRecurrentArgs& a) {
  KdaForwardArgs f;
  f.q = a.q, f.k = a.k, f.v = a.v, f.g = a.g, f.beta = a.beta, f.A_log = a.A_log, f.dt_bias = a.dt_bias, f.cu_seqlens = a.cu_seqlens;
  return f;
}

KdaOptions forward_options(const KdaRecurrentOptions& o) {
  KdaOptions k;
  k.scale = o.scale, k.use_qk_l2norm = o.use_qk_l2norm, k.use_gate_in_kernel = o.use_gate_in_kernel;
  k.use_lower_bound = o.use_lower_bound, k.lower_bound = o.lower_bound, k.state_v_first = o.state_v_first;
  return k;
}

Status validate_recurrent(const KdaRecurrentArgs& a, const KdaRecurrentOptions& o, kda::KdaProblem* out, SlotPlan* plan) {
  if (o.allow_neg_eigval && !o.use_beta_sigmoid)
    return Status::invalid("allow_neg_eigval: needs use_beta_sigmoid (beta = 2 sigmoid(beta))");
  kda::KdaProblem& p = *out;
  ENCORE_RETURN_IF_ERROR(kda::make_problem(forward_view(a), forward_options(o), &p));
  ENCORE_RETURN_IF_ERROR(checks::present("o", a.o));
  if (a.o.ndim != 4 || a.o.shape != a.v.shape)
    return Status::invalid("o: shape " + a.o.shape_string() + " must equal v's " + a.v.shape_string());
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("o", a.o, kFloat));
  ENCORE_RETURN_IF_ERROR(checks::same_device("o", a.o, "q", a.q));
  const int64_t N = int64_t(p.seqs.size());
  const bool pooled = a.state_indices.defined();
  if (pooled) {
    ENCORE_RETURN_IF_ERROR(validate_indices("state_indices", a.state_indices, a.q));
    if ((a.state_indices.ndim != 1 && a.state_indices.ndim != 2) || a.state_indices.shape[0] != N)
      return Status::invalid("state_indices: expected [N] or [N, S] with N = " + str(N) + " sequences, got " + a.state_indices.shape_string());
    if (a.state_indices.ndim == 2)
      for (int64_t n = 0; n < N; ++n)
        if (p.seqs[size_t(n)].end - p.seqs[size_t(n)].begin > a.state_indices.shape[1])
          return Status::invalid("state_indices: [N, S] holds S = " + str(a.state_indices.shape[1]) +
                                 " slots per sequence (one per token), but sequence " +
                                 str(n) + " has " + str(p.seqs[size_t(n)].end - p.seqs[size_t(n)].begin) + " tokens");
    if (!a.initial_state.defined())
      return Status::invalid("initial_state: the pool [P, HV, K, V] is required with state_indices");
    ENCORE_RETURN_IF_ERROR(validate_states("initial_state", a.initial_state, -1, p, a.q));
    if (a.final_state.defined())
      return Status::invalid("final_state: must be absent with state_indices (the pool, initial_state, is updated in place)");
    if (a.num_accepted_tokens.defined()) {
      ENCORE_RETURN_IF_ERROR(validate_indices("num_accepted_tokens", a.num_accepted_tokens, a.q));
      if (a.state_indices.ndim != 2)
        return Status::invalid("num_accepted_tokens: needs state_indices [N, S] (one slot per token: speculative decoding)");
      if (a.num_accepted_tokens.ndim != 1 || a.num_accepted_tokens.shape[0] != N)
        return Status::invalid("num_accepted_tokens: expected [N] = [" + str(N) + "], got " + a.num_accepted_tokens.shape_string());
    }
  } else {
    if (a.num_accepted_tokens.defined())
      return Status::invalid("num_accepted_tokens: needs state_indices [N, S] (one slot per token: speculative decoding)");
    if (a.initial_state.defined()) ENCORE_RETURN_IF_ERROR(validate_states("initial_state", a.initial_state, N, p, a.q));
    if (a.final_state.defined()) ENCORE_RETURN_IF_ERROR(validate_states("final_state", a.final_state, N, p, a.q));
  }
  // Outputs: o, and the pool (pooled) or final_state (which may be initial_state itself: in place).
  const TensorView& fin = a.final_state;
  const bool in_place = fin.defined() && a.initial_state.defined() && fin.data == a.initial_state.data && fin.shape == a.initial_state.shape &&
                        fin.strides == a.initial_state.strides && fin.dtype == a.initial_state.dtype;
  if (!pooled && !in_place && fin.defined() && a.initial_state.defined()) {
    Status st = checks::no_overlap("final_state", fin, "initial_state", a.initial_state);
    if (!st) return Status::invalid(st.message() + " (only exactly, as the same array: the state updated in place)");
  }
  const TensorView none;
  const TensorView& written = pooled ? a.initial_state : fin;
  const char* written_name = pooled ? "initial_state" : "final_state";
  ENCORE_RETURN_IF_ERROR(no_overlaps({{"o", &a.o}, {written_name, &written}},
                                     {{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"g", &a.g}, {"beta", &a.beta}, {"A_log", &a.A_log},
                                      {"dt_bias", &a.dt_bias}, {"cu_seqlens", &a.cu_seqlens}, {"state_indices", &a.state_indices},
                                      {"num_accepted_tokens", &a.num_accepted_tokens},
                                      {"initial_state", pooled || in_place ? &none : &a.initial_state}}));
  if (pooled) return plan_slots(p, a.state_indices, a.num_accepted_tokens, a.initial_state.shape[0], plan);
  return Status::ok();
}

// State element offsets: slot s, value head h, the [K, V] block from its start.
int64_t slot_offset(const TensorView& t, int64_t s, int64_t h) { return s * t.strides[0] + h * t.strides[1]; }

// Element i = k V + v of the [K, V] state; with state_v_first (t is [.., V, K]) it lies at v K + k.
int64_t state_elem(int64_t i, int64_t K, int64_t V, bool v_first) { return v_first ? (i % V) * K + i / V : i; }

void load_state(const TensorView& t, int64_t s, int64_t h, const kda::KdaProblem& p, double* dst) {
  const int64_t base = slot_offset(t, s, h), KV = p.K * p.V;
  for (int64_t i = 0; i < KV; ++i) dst[i] = load_as_double(t.data, t.dtype, base + state_elem(i, p.K, p.V, p.opts.state_v_first));
}

void store_state(const TensorView& t, int64_t s, int64_t h, const kda::KdaProblem& p, const std::vector<double>& S) {
  const int64_t base = slot_offset(t, s, h);
  for (size_t i = 0; i < S.size(); ++i)
    store_from_double(t.data, t.dtype, base + state_elem(int64_t(i), p.K, p.V, p.opts.state_v_first), S[i]);
}

[[maybe_unused]] Status no_cuda(const char* op, const TensorView& q) {
  return Status::unsupported(std::string(op) + ": on " + q.device.to_string() + " tensors, but encore was built without CUDA (ENCORE_CUDA=OFF)");
}

#ifdef ENCORE_WITH_CUDA
// What the CUDA recurrent step (kda_decode.cu) takes beyond validate(): 16- or 32-bit floats, o with a
// unit last stride, fp32 contiguous gate parameters, fp32 / bf16 states, the indices in q's device memory
// (the kernel reads them there: no host read, no sync), sizes that the kernel counts in int.
Status validate_recurrent_cuda(const KdaRecurrentArgs& a, const kda::KdaProblem& p) {
  for (auto [name, t] : {Named{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"g", &a.g}, {"beta", &a.beta}, {"o", &a.o}})
    ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, *t, {DType::kBF16, DType::kFP16, DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("o", a.o));
  for (auto [name, t] : {Named{"A_log", &a.A_log}, {"dt_bias", &a.dt_bias}}) {
    if (!t->defined()) continue;
    ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, *t, {DType::kFP32}));
    if (!t->is_contiguous()) return Status::invalid(std::string(name) + ": must be contiguous on CUDA");
  }
  for (auto [name, t] : {Named{"initial_state", &a.initial_state}, {"final_state", &a.final_state}})
    if (t->defined()) ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, *t, {DType::kBF16, DType::kFP32}));
  for (auto [name, t] : {Named{"state_indices", &a.state_indices}, {"num_accepted_tokens", &a.num_accepted_tokens}})
    if (t->defined() && !t->device.is_cuda())
      return Status::invalid(std::string(name) + ": in host memory, but q is on " + a.q.device.to_string() +
                             ": the CUDA kernel reads the indices from device memory (no host read or sync: capturable in a CUDA "
                             "graph); pass them on " + a.q.device.to_string());
  const int64_t tiles = (p.V + 31) / 32;
  if (p.T >= (int64_t(1) << 31)) return Status::unsupported("q: T must be < 2^31 on CUDA");
  if (int64_t(p.seqs.size()) * p.H * tiles >= (int64_t(1) << 31))
    return Status::unsupported("v: N * HV * ceil(V / 32) = " + str(int64_t(p.seqs.size()) * p.H * tiles) + " blocks; must be < 2^31 on CUDA");
  if (a.state_indices.defined() && a.state_indices.ndim == 2 && a.state_indices.shape[1] >= (int64_t(1) << 31))
    return Status::unsupported("state_indices: S must be < 2^31 on CUDA");
  return checks::device_memory({{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"g", &a.g}, {"beta", &a.beta}, {"A_log", &a.A_log},
                                {"dt_bias", &a.dt_bias}, {"initial_state", &a.initial_state}, {"state_indices", &a.state_indices},
                                {"num_accepted_tokens", &a.num_accepted_tokens}, {"o", &a.o}, {"final_state", &a.final_state}});
}

cuda::KdaDecodeTensor decode_tensor(const TensorView& t) {
  return {t.data, t.dtype, t.strides[0], t.strides[1], t.ndim > 2 ? t.strides[2] : 0};
}

// A state tensor's vector accesses of `elems` columns are aligned: base, row stride and V multiples of elems.
bool state_aligned(const TensorView& t, int64_t elems) {
  const size_t es = dtype_size(t.dtype);
  return checks::aligned(t.data, size_t(elems) * es) && (t.shape[0] <= 1 || t.strides[0] % elems == 0) && t.shape[3] % elems == 0;
}
bool state_vec(const TensorView& t) { return state_aligned(t, 4); }
bool state_16b(const TensorView& t) { return !t.defined() || state_aligned(t, int64_t(16 / dtype_size(t.dtype))); }

// The compile-time kernels' conditions (kda_decode.hpp, KdaDecodeParams::fast).
bool decode_fast(const KdaRecurrentArgs& a, const kda::KdaProblem& p) {
  const DType dt = a.q.dtype;
  if (p.K != 128 || p.V != 128 || (dt != DType::kBF16 && dt != DType::kFP32)) return false;
  const int64_t per16 = int64_t(16 / dtype_size(dt));  // elements per 16 bytes
  for (const TensorView* t : {&a.q, &a.k, &a.v, &a.g}) {
    if (t->dtype != dt || !checks::aligned(t->data, 16)) return false;
    for (int d = 0; d < 3; ++d)
      if (t->strides[d] % per16 != 0) return false;
  }
  if (a.beta.dtype != dt) return false;
  const TensorView& s0 = a.initial_state.defined() ? a.initial_state : a.final_state;
  for (const TensorView* t : {&a.initial_state, &a.final_state})
    if (t->defined() && (!state_vec(*t) || t->dtype != s0.dtype)) return false;
  return true;
}

// plan: the decode plan requested (tests, benchmarks), null: the rule's (kda_decode_plan).
Status run_recurrent_cuda(const KdaRecurrentArgs& a, const KdaRecurrentOptions& o, const kda::KdaProblem& p, Stream stream,
                          const cuda::KdaDecodePlan* plan = nullptr) {
  cuda::KdaDecodeParams d;
  d.T = int(p.T), d.H = int(p.H), d.group = int(p.group()), d.K = int(p.K), d.V = int(p.V);
  d.scale = float(p.scale);
  d.l2norm = o.use_qk_l2norm, d.gate_in_kernel = o.use_gate_in_kernel, d.lower_bound_gate = o.use_lower_bound;
  d.lower_bound = float(o.lower_bound);
  d.beta_sigmoid = o.use_beta_sigmoid, d.beta_scale = o.allow_neg_eigval ? 2.f : 1.f;
  d.q = decode_tensor(a.q), d.k = decode_tensor(a.k), d.v = decode_tensor(a.v), d.g = decode_tensor(a.g), d.beta = decode_tensor(a.beta);
  d.A_log = static_cast<const float*>(a.A_log.data);
  d.dt_bias = static_cast<const float*>(a.dt_bias.data);
  d.o = a.o.data, d.o_dtype = a.o.dtype, d.o_sb = a.o.strides[0], d.o_st = a.o.strides[1], d.o_sh = a.o.strides[2];
  const bool pooled = a.state_indices.defined();
  const TensorView& fin = pooled ? a.initial_state : a.final_state;
  d.mode = !pooled ? cuda::KdaDecodeMode::kStates
                   : a.state_indices.ndim == 2 ? cuda::KdaDecodeMode::kTokenSlots : cuda::KdaDecodeMode::kSlots;
  if (a.initial_state.defined()) {
    d.init = a.initial_state.data, d.init_dtype = a.initial_state.dtype, d.init_stride = a.initial_state.strides[0];
    d.init_vec = state_vec(a.initial_state);
    d.P = a.initial_state.shape[0];
  }
  if (fin.defined()) {
    d.fin = fin.data, d.fin_dtype = fin.dtype, d.fin_stride = fin.strides[0];
    d.fin_vec = state_vec(fin);
  }
  if (pooled) {
    d.idx = a.state_indices.data, d.idx64 = a.state_indices.dtype == DType::kInt64;
    d.idx_s0 = a.state_indices.strides[0];
    d.idx_s1 = a.state_indices.ndim == 2 ? a.state_indices.strides[1] : 0;
    d.S = a.state_indices.ndim == 2 ? int(a.state_indices.shape[1]) : 1;
    if (a.num_accepted_tokens.defined()) {
      d.nat = a.num_accepted_tokens.data, d.nat64 = a.num_accepted_tokens.dtype == DType::kInt64;
      d.nat_s0 = a.num_accepted_tokens.strides[0];
    }
  }
  d.state_v_first = o.state_v_first;  // the runtime-dtype kernel's scalar state accesses
  d.fast = decode_fast(a, p) && !o.state_v_first;
  d.states16 = state_16b(a.initial_state) && state_16b(fin);
  const DeviceInfo* info = nullptr;  // cached per device
  ENCORE_RETURN_IF_ERROR(get_device_info(a.q.device.index, &info));
  d.sm_count = info->sm_count;
  const DType states = a.initial_state.defined() ? a.initial_state.dtype : fin.dtype;
  // No state read or written (kStates without either): the rule's 32 columns, not a whole head of zeros.
  const bool any_state = a.initial_state.defined() || fin.defined();
  auto choose = [&](int64_t n) {
    const cuda::KdaDecodePlan c = plan ? *plan : kda::kda_decode_plan(n, p.H, states, d.states16 && any_state, d.sm_count);
    d.kernel = c.kernel, d.pdl = c.pdl, d.prefetch = c.prefetch && d.states16;
    // A named plan (tests, benchmarks) whose kernel this launch cannot take is an error, not a silent
    // fallback to 32 columns: the compile-time single-token kernels (K = V = 128, aligned inputs of one
    // dtype, 16-byte aligned states of one dtype, at most one token a sequence).
    if (plan && c.kernel != cuda::KdaDecodeKernel::kColumns32 && !cuda::kda_decode_wide_kernels_apply(d))
      return Status::invalid("plan.kernel: this launch cannot take the named single-token kernel (needs K = V = 128, aligned inputs of "
                             "one dtype, 16-byte aligned states of one dtype and at most one token a sequence)");
    return Status::ok();
  };
  d.varlen = a.cu_seqlens.defined();
  const int64_t N = int64_t(p.seqs.size());
  if (!d.varlen) {
    d.N = int(N), d.max_len = int(p.T);
    ENCORE_RETURN_IF_ERROR(choose(N));
    return cuda::launch_kda_decode(d, nullptr, a.q.device.index, stream);
  }
  int32_t begin[cuda::kKdaDecodeSeqTable + 1];  // ~4 KB on the stack: run does not allocate
  for (int64_t n0 = 0; n0 < N; n0 += cuda::kKdaDecodeSeqTable) {  // the token table holds 1024 sequences per launch
    const int64_t count = std::min<int64_t>(cuda::kKdaDecodeSeqTable, N - n0);
    d.n0 = int(n0), d.N = int(count), d.max_len = 0;
    for (int64_t i = 0; i < count; ++i) {
      const kda::Sequence& q = p.seqs[size_t(n0 + i)];
      begin[i] = int32_t(q.begin);
      d.max_len = std::max(d.max_len, int(q.end - q.begin));
    }
    begin[count] = int32_t(p.seqs[size_t(n0 + count - 1)].end);
    ENCORE_RETURN_IF_ERROR(choose(count));
    ENCORE_RETURN_IF_ERROR(cuda::launch_kda_decode(d, begin, a.q.device.index, stream));
  }
  return Status::ok();
}
#endif

}  // namespace

Status validate(const KdaRecurrentArgs& a, const KdaRecurrentOptions& o) {
  kda::KdaProblem p;
  SlotPlan plan;
  return validate_recurrent(a, o, &p, &plan);
}

size_t workspace_bytes(const KdaRecurrentArgs&, const KdaRecurrentOptions&) { return 0; }

namespace {

// The CPU reference of the recurrent step (validated: p and plan from validate_recurrent, or the same from
// validate_pool_forward for the prefill on a pool, [N] slots).
Status run_recurrent_cpu(const KdaRecurrentArgs& a, const KdaRecurrentOptions& o, const kda::KdaProblem& p, const SlotPlan& plan) {
  reference::KdaInputs in = reference::kda_prepare(p, forward_view(a));
  if (o.use_beta_sigmoid)
    for (double& b : in.beta) b = (o.allow_neg_eigval ? 2.0 : 1.0) / (1.0 + std::exp(-b));
  const bool pooled = a.state_indices.defined();
  const int64_t N = int64_t(p.seqs.size()), KV = p.K * p.V;
  // Every initial state is read before anything is written (the pool and final_state may alias initial_state).
  for (int64_t n = 0; n < N; ++n) {
    const int64_t slot = pooled ? plan.read[size_t(n)] : (a.initial_state.defined() ? n : -1);
    if (slot >= 0)
      for (int64_t h = 0; h < p.H; ++h) load_state(a.initial_state, slot, h, p, &in.h0[size_t((n * p.H + h) * KV)]);
  }
  std::vector<double> out(size_t(p.B * p.T * p.H * p.V), 0.0), S(static_cast<size_t>(KV));
  std::vector<std::vector<double>> token_states;
  for (int64_t n = 0; n < N; ++n) {
    if (pooled && plan.read[size_t(n)] < 0) continue;  // padding (or no tokens): o rows zero, the pool untouched
    for (int64_t h = 0; h < p.H; ++h) {
      std::copy(in.h0.begin() + (n * p.H + h) * KV, in.h0.begin() + (n * p.H + h + 1) * KV, S.begin());
      token_states.clear();
      reference::kda_recurrent_sequence(p, in, size_t(n), h, S, out, [&](int64_t, const std::vector<double>& st) {
        if (plan.per_token) token_states.push_back(st);
      });
      if (pooled && plan.per_token) {
        for (size_t t = 0; t < token_states.size(); ++t)
          if (plan.write[size_t(n)][t] >= 0) store_state(a.initial_state, plan.write[size_t(n)][t], h, p, token_states[t]);
      } else if (pooled) {
        store_state(a.initial_state, plan.read[size_t(n)], h, p, S);
      } else if (a.final_state.defined()) {
        store_state(a.final_state, n, h, p, S);
      }
    }
  }
  store_dense(a.o, out);
  return Status::ok();
}

// run, on the decode plan `decode` (null: the rule's) on CUDA.
Status run_recurrent(const KdaRecurrentArgs& a, const KdaRecurrentOptions& o, const cuda::KdaDecodePlan* decode, Stream stream) {
  kda::KdaProblem p;
  SlotPlan plan;
  ENCORE_RETURN_IF_ERROR(validate_recurrent(a, o, &p, &plan));
  if (a.q.device.is_cuda()) {
#ifdef ENCORE_WITH_CUDA
    ENCORE_RETURN_IF_ERROR(validate_recurrent_cuda(a, p));
    return run_recurrent_cuda(a, o, p, stream, decode);
#else
    (void)stream, (void)decode;
    return no_cuda("kda_recurrent", a.q);
#endif
  }
  return run_recurrent_cpu(a, o, p, plan);
}

}  // namespace

Status run(const KdaRecurrentArgs& a, const KdaRecurrentOptions& o, void*, Stream stream) { return run_recurrent(a, o, nullptr, stream); }

Status kda::run(const KdaRecurrentArgs& a, const KdaRecurrentOptions& o, const cuda::KdaDecodePlan& plan, Stream stream) {
  return run_recurrent(a, o, &plan, stream);
}

namespace {

Status validate_pool_forward(const KdaPoolForwardArgs& a, const KdaOptions& o, kda::KdaProblem* out, SlotPlan* plan) {
  const KdaForwardArgs& f = a.fwd;
  if (f.initial_state.defined()) return Status::invalid("fwd.initial_state: must be absent (each sequence starts from pool[state_indices[n]])");
  if (f.final_state.defined()) return Status::invalid("fwd.final_state: must be absent (each final state is written to pool[state_indices[n]])");
  if (f.residuals.any()) return Status::invalid("fwd.residuals: must be absent (the forward on a state pool is inference only)");
  KdaOptions opts = o;
  opts.output_final_state = false;
  ENCORE_RETURN_IF_ERROR(validate(f, opts));
  kda::KdaProblem& p = *out;
  ENCORE_RETURN_IF_ERROR(kda::make_problem(f, opts, &p));
  const int64_t N = int64_t(p.seqs.size());
  ENCORE_RETURN_IF_ERROR(validate_indices("state_indices", a.state_indices, f.q));
  if (a.state_indices.ndim != 1 || a.state_indices.shape[0] != N)
    return Status::invalid("state_indices: expected [N] with N = " + str(N) + " sequences, got " + a.state_indices.shape_string());
  ENCORE_RETURN_IF_ERROR(validate_states("pool", a.pool, -1, p, f.q));
  ENCORE_RETURN_IF_ERROR(no_overlaps({{"pool", &a.pool}, {"fwd.o", &f.o}},
                                     {{"q", &f.q}, {"k", &f.k}, {"v", &f.v}, {"g", &f.g}, {"beta", &f.beta}, {"A_log", &f.A_log},
                                      {"dt_bias", &f.dt_bias}, {"cu_seqlens", &f.cu_seqlens}, {"state_indices", &a.state_indices}}));
  return plan_slots(p, a.state_indices, TensorView{}, a.pool.shape[0], plan);
}

KdaOptions pool_forward_options(const KdaOptions& o) {
  KdaOptions k = o;
  k.output_final_state = false;  // the final states go to the pool
  return k;
}

// The prefill on a pool as the recurrent step with [N] slots over all of each sequence's tokens (the same
// math: the token recurrence from the slot's state, the final state back into it).
void pool_as_recurrent(const KdaPoolForwardArgs& a, const KdaOptions& o, KdaRecurrentArgs* r, KdaRecurrentOptions* ro) {
  const KdaForwardArgs& f = a.fwd;
  r->q = f.q, r->k = f.k, r->v = f.v, r->g = f.g, r->beta = f.beta, r->A_log = f.A_log, r->dt_bias = f.dt_bias, r->cu_seqlens = f.cu_seqlens;
  r->o = f.o, r->initial_state = a.pool, r->state_indices = a.state_indices;
  ro->scale = o.scale, ro->use_qk_l2norm = o.use_qk_l2norm, ro->use_gate_in_kernel = o.use_gate_in_kernel;
  ro->use_lower_bound = o.use_lower_bound, ro->lower_bound = o.lower_bound, ro->state_v_first = o.state_v_first;
}

#ifdef ENCORE_WITH_CUDA
// The CUDA prefill on a pool beyond validate(): an fp32 / bf16 pool and the indices in q's device memory
// (read by the kernels: no host read, no sync). K, V <= 128: the chunked forward with the pool in its
// state kernel; above: the decode kernel (the recurrent step's [N] slots over all the tokens of each
// sequence, the same index contract; o with a unit last stride there).
Status run_pool_forward_cuda(const KdaPoolForwardArgs& a, const KdaOptions& o, const kda::KdaProblem& p, void* workspace, Stream stream) {
  const TensorView& q = a.fwd.q;
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("pool", a.pool, {DType::kBF16, DType::kFP32}));
  if (!a.state_indices.device.is_cuda())
    return Status::invalid("state_indices: in host memory, but q is on " + q.device.to_string() +
                           ": the CUDA kernels read the indices from device memory (no host read or sync: capturable in a CUDA graph); pass "
                           "them on " + q.device.to_string());
  if (!cuda::kda_use_recurrent(p.K, p.V)) {
    for (size_t n = 0; n < p.seqs.size(); ++n)  // the state kernel counts a sequence's o elements of a block (64 columns) in int
      if (p.seqs[n].end - p.seqs[n].begin >= (int64_t(1) << 25))
        return Status::unsupported("cu_seqlens: the CUDA prefill on a pool takes sequences of < 2^25 tokens, sequence " + str(int64_t(n)) +
                                   " has " + str(p.seqs[n].end - p.seqs[n].begin));
    return kda::run_cuda_on_pool(a.fwd, pool_forward_options(o), p, a.pool, a.state_indices, workspace, stream);
  }
  KdaRecurrentArgs r;
  KdaRecurrentOptions ro;
  pool_as_recurrent(a, o, &r, &ro);
  ENCORE_RETURN_IF_ERROR(validate_recurrent_cuda(r, p));
  return run_recurrent_cuda(r, ro, p, stream);
}
#endif

}  // namespace

Status validate(const KdaPoolForwardArgs& a, const KdaOptions& o) {
  kda::KdaProblem p;
  SlotPlan plan;
  return validate_pool_forward(a, o, &p, &plan);
}

size_t workspace_bytes(const KdaPoolForwardArgs& a, const KdaOptions& o) { return workspace_bytes(a.fwd, pool_forward_options(o)); }

Status run(const KdaPoolForwardArgs& a, const KdaOptions& o, void* workspace, Stream stream) {
  kda::KdaProblem p;
  SlotPlan plan;
  ENCORE_RETURN_IF_ERROR(validate_pool_forward(a, o, &p, &plan));
  if (a.fwd.q.device.is_cuda()) {
#ifdef ENCORE_WITH_CUDA
    return run_pool_forward_cuda(a, o, p, workspace, stream);
#else
    (void)workspace, (void)stream;
    return no_cuda("kda_forward_pool", a.fwd.q);
#endif
  }
  KdaRecurrentArgs r;
  KdaRecurrentOptions ro;
  pool_as_recurrent(a, o, &r, &ro);
  return run_recurrent_cpu(r, ro, p, plan);
}

}  // namespace encore
