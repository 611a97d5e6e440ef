// EP intranode dispatch / combine on CPU threads (ep_emulation.hpp has the memory layout and the
// cells). Each "GPU:" comment names the instruction the CUDA version uses at that point.
#include "moe/reference/ep_emulation.hpp"

#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>

#include "moe/problem.hpp"
#include "moe/reference/moe_ref.hpp"

namespace encore::moe::ep {
namespace {

constexpr size_t kAlign = 16;
constexpr uint64_t kOk = 1;

size_t up16(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
uint64_t cell(uint32_t epoch, uint32_t value) { return uint64_t(epoch) << 32 | value; }
uint32_t cell_epoch(uint64_t v) { return uint32_t(v >> 32); }
uint32_t cell_value(uint64_t v) { return uint32_t(v); }
std::string show(uint64_t v) { return "{epoch " + std::to_string(cell_epoch(v)) + ", value " + std::to_string(cell_value(v)) + "}"; }

// GPU: ld.acquire.sys.global.u64
uint64_t load_acquire(const uint64_t* p) { return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(p)).load(std::memory_order_acquire); }
// GPU: st.release.sys.global.u64
void store_release(uint64_t* p, uint64_t v) { std::atomic_ref<uint64_t>(*p).store(v, std::memory_order_release); }
// GPU: atom.add.release.sys.global.u64
void add_release(uint64_t* p, uint64_t v) { std::atomic_ref<uint64_t>(*p).fetch_add(v, std::memory_order_release); }

size_t row_bytes(const EpConfig& c) { return size_t(c.hidden) * dtype_size(c.dtype); }
size_t local_experts(const EpConfig& c) { return size_t(c.num_experts / c.world); }

Status check_2d(const char* name, const TensorView& v, DType dt, int64_t rows, int64_t cols, const char* shape) {
  if (!v.defined() || (v.data == nullptr && v.ndim == 2 && v.shape[0] * v.shape[1] > 0)) return Status::invalid(std::string(name) + ": required, " + shape);
  if (v.ndim != 2) return Status::invalid(std::string(name) + ": must be 2-d " + shape + ", got " + v.shape_string());
  if (v.dtype != dt) return Status::invalid(std::string(name) + ": dtype must be " + dtype_name(dt) + ", got " + dtype_name(v.dtype));
  if (v.device.is_cuda()) return Status::invalid(std::string(name) + ": the EP emulation takes host memory");
  if ((rows >= 0 && v.shape[0] != rows) || v.shape[1] != cols)
    return Status::invalid(std::string(name) + ": shape must be " + shape + " = [" + (rows >= 0 ? std::to_string(rows) : "m") + ", " +
                           std::to_string(cols) + "], got " + v.shape_string());
  if (!v.is_contiguous()) return Status::invalid(std::string(name) + ": must be contiguous");
  return Status::ok();
}

}  // namespace

Status validate(const EpConfig& c) {
  if (c.world < 1) return Status::invalid("world: must be >= 1, got " + std::to_string(c.world));
  if (c.num_experts < c.world || c.num_experts % c.world != 0)
    return Status::invalid("num_experts: must be a positive multiple of world = " + std::to_string(c.world) + ", got " +
                           std::to_string(c.num_experts));
  if (c.top_k < 1 || c.top_k > c.num_experts)
    return Status::invalid("top_k: must be in [1, num_experts = " + std::to_string(c.num_experts) + "], got " + std::to_string(c.top_k));
  if (c.hidden < 1) return Status::invalid("hidden: must be >= 1, got " + std::to_string(c.hidden));
  if (c.max_tokens < 1 || c.max_tokens > (int64_t(1) << 24))
    return Status::invalid("max_tokens: must be in [1, 2^24], got " + std::to_string(c.max_tokens));
  if (c.dtype != DType::kBF16 && c.dtype != DType::kFP16 && c.dtype != DType::kFP32 && c.dtype != DType::kFP8E4M3)
    return Status::invalid(std::string("dtype: must be bf16, fp16, fp32 or fp8_e4m3, got ") + dtype_name(c.dtype));
  const DType cd = combine_dtype_of(c);
  if (cd != DType::kBF16 && cd != DType::kFP16 && cd != DType::kFP32)
    return Status::invalid(std::string(c.combine_dtype ? "combine_dtype" : "dtype") + ": the combine's expert outputs must be bf16, fp16 or fp32, got " +
                           dtype_name(cd) + (c.combine_dtype ? "" : " (fp8 rows need a combine_dtype)"));
  if (c.scale_bytes < 0) return Status::invalid("scale_bytes: must be >= 0, got " + std::to_string(c.scale_bytes));
  if (c.timeout.count() <= 0) return Status::invalid("timeout: must be positive");
  return Status::ok();
}

size_t ep_region_header_bytes(const EpConfig& c) { return up16(16 + 8 * local_experts(c)); }
DType combine_dtype_of(const EpConfig& c) { return c.combine_dtype.value_or(c.dtype); }
size_t ep_combine_row_bytes(const EpConfig& c) { return up16(size_t(c.hidden) * dtype_size(combine_dtype_of(c))); }
size_t ep_combine_header_bytes(const EpConfig& c) { return up16(8 * size_t(c.max_tokens)); }
size_t ep_token_stride(const EpConfig& c) { return up16(row_bytes(c) + size_t(c.scale_bytes) + 4); }
size_t ep_region_bytes(const EpConfig& c) { return ep_region_header_bytes(c) + local_experts(c) * size_t(c.max_tokens) * ep_token_stride(c); }
size_t ep_rank_bytes(const EpConfig& c) {
  return size_t(c.world) * ep_region_bytes(c) + ep_combine_header_bytes(c) + size_t(c.max_tokens * c.top_k) * ep_combine_row_bytes(c);
}

void EpGroup::Free::operator()(uint8_t* p) const { ::operator delete[](p, std::align_val_t(kAlign)); }

Status EpGroup::create(const EpConfig& c, std::unique_ptr<EpGroup>* out) {
  ENCORE_RETURN_IF_ERROR(validate(c));
  auto g = std::unique_ptr<EpGroup>(new EpGroup());
  g->cfg_ = c;
  g->messages_.resize(size_t(c.world));
  for (int r = 0; r < c.world; ++r) {
    auto* p = static_cast<uint8_t*>(::operator new[](ep_rank_bytes(c), std::align_val_t(kAlign)));
    std::memset(p, 0, ep_rank_bytes(c));  // every cell {epoch 0}: matches no round
    g->mem_.emplace_back(p);
  }
  *out = std::move(g);
  return Status::ok();
}

EpAllToAll::EpAllToAll(EpGroup* g, int rank) : g_(g), cfg_(g->cfg_), rank_(rank), e_local_(int(local_experts(g->cfg_))) {}

Status EpAllToAll::create(EpGroup* group, int rank, std::unique_ptr<EpAllToAll>* out) {
  if (!group) return Status::invalid("group: required");
  if (rank < 0 || rank >= group->cfg_.world)
    return Status::invalid("rank: must be in [0, world = " + std::to_string(group->cfg_.world) + "), got " + std::to_string(rank));
  out->reset(new EpAllToAll(group, rank));
  return Status::ok();
}

uint8_t* EpAllToAll::region(int owner, int sender) const { return g_->memory(owner) + size_t(sender) * ep_region_bytes(cfg_); }
uint64_t* EpAllToAll::counter(int owner, int64_t t) const {
  return reinterpret_cast<uint64_t*>(g_->memory(owner) + size_t(cfg_.world) * ep_region_bytes(cfg_)) + t;
}
uint8_t* EpAllToAll::combine_row(int owner, int64_t slot) const {
  return g_->memory(owner) + size_t(cfg_.world) * ep_region_bytes(cfg_) + ep_combine_header_bytes(cfg_) + size_t(slot) * ep_combine_row_bytes(cfg_);
}

Status EpAllToAll::fail(const std::string& phase, Status s) {
  Status e(s.code(), "ep rank " + std::to_string(rank_) + ": " + phase + ": " + s.message());
  uint64_t expected = 0;
  if (g_->abort_.load(std::memory_order_acquire) == 0) {
    g_->messages_[size_t(rank_)] = e.to_string();  // read by peers only after the CAS below succeeds
    g_->abort_.compare_exchange_strong(expected, cell(epoch_, uint32_t(rank_ + 1)), std::memory_order_release, std::memory_order_relaxed);
  }
  return e;
}

Status EpAllToAll::aborted(const std::string& phase) const {
  const uint64_t v = g_->abort_.load(std::memory_order_acquire);
  if (v == 0) return Status::ok();
  const int who = int(cell_value(v)) - 1;
  return Status::internal("ep rank " + std::to_string(rank_) + ": " + phase + ": aborted (round " + std::to_string(cell_epoch(v)) +
                          ") because rank " + std::to_string(who) + " failed: " + g_->messages_[size_t(who)]);
}

// Spins on one cell until done(value); gives up on a peer's abort or after the timeout, naming the
// cell (describe()) and the last value seen. GPU: the same loop on %globaltimer, then __trap().
template <class Done, class Describe>
Status EpAllToAll::spin(const std::string& phase, const uint64_t* c, Done done, Describe describe) {
  const auto start = std::chrono::steady_clock::now();
  for (uint32_t it = 0;; ++it) {
    const uint64_t v = load_acquire(c);
    if (done(v)) return Status::ok();
    if ((it & 15) == 15) {
      ENCORE_RETURN_IF_ERROR(aborted(phase));
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited > cfg_.timeout)
        return fail(phase, Status::internal("timed out after " + std::to_string(cfg_.timeout.count()) + " ms waiting for " + describe() +
                                            ", saw " + show(v)));
      if (it > 1024) std::this_thread::sleep_for(std::chrono::microseconds(50));
      else std::this_thread::yield();
    }
  }
}

Status EpAllToAll::validate_dispatch(const TensorView& x, const TensorView& ids, const TensorView& scales) const {
  if (phase_ != Phase::kIdle) return Status::invalid("dispatch called twice without a combine between them");
  if (!x.defined() || x.ndim != 2) return Status::invalid("x: must be 2-d [m, H], got " + x.shape_string());
  const int64_t m = x.shape[0];
  if (m > cfg_.max_tokens)
    return Status::invalid("x: m = " + std::to_string(m) + " tokens exceeds max_tokens = " + std::to_string(cfg_.max_tokens));
  ENCORE_RETURN_IF_ERROR(check_2d("x", x, cfg_.dtype, m, cfg_.hidden, "[m, H]"));
  ENCORE_RETURN_IF_ERROR(check_2d("topk_ids", ids, DType::kInt32, m, cfg_.top_k, "[m, k]"));
  if (cfg_.scale_bytes > 0) ENCORE_RETURN_IF_ERROR(check_2d("scales", scales, DType::kUInt8, m, cfg_.scale_bytes, "[m, scale_bytes]"));
  else if (scales.defined()) return Status::invalid("scales: given but the config has scale_bytes = 0");
  const auto* id = static_cast<const int32_t*>(ids.data);
  for (int64_t t = 0; t < m; ++t)
    for (int j = 0; j < cfg_.top_k; ++j) {
      const int32_t e = id[t * cfg_.top_k + j];
      if (e < 0 || e >= cfg_.num_experts)
        return Status::invalid("topk_ids: entry [" + std::to_string(t) + ", " + std::to_string(j) + "] = " + std::to_string(e) +
                               " is outside [0, num_experts = " + std::to_string(cfg_.num_experts) + ")");
      for (int i = 0; i < j; ++i)
        if (id[t * cfg_.top_k + i] == e)
          return Status::invalid("topk_ids: token " + std::to_string(t) + " lists expert " + std::to_string(e) + " twice");
    }
  return Status::ok();
}

Status EpAllToAll::dispatch(const TensorView& x, const TensorView& ids, const TensorView& scales, EpReceived* out) {
  if (!out) return fail("dispatch round " + std::to_string(epoch_ + 1), Status::invalid("out: required"));
  ENCORE_RETURN_IF_ERROR(dispatch_send(x, ids, scales));
  return dispatch_recv(out);
}

Status EpAllToAll::dispatch_send(const TensorView& x, const TensorView& ids, const TensorView& scales) {
  const std::string phase = "dispatch round " + std::to_string(epoch_ + 1);
  ENCORE_RETURN_IF_ERROR(aborted(phase));
  if (Status s = validate_dispatch(x, ids, scales); !s) return fail(phase, s);
  const uint32_t n = ++epoch_;
  const int k = cfg_.top_k, E_l = e_local_, W = cfg_.world;
  const int64_t m = x.shape[0], T = cfg_.max_tokens;
  const size_t rb = row_bytes(cfg_), sb = size_t(cfg_.scale_bytes), stride = ep_token_stride(cfg_);
  m_ = m;
  phase_ = Phase::kSent;

  // Arm this rank's combine counters before any peer can see round n (program order before the
  // release stores below, so a peer's add always lands on the armed value).
  for (int64_t t = 0; t < m; ++t) store_release(counter(rank_, t), cell(n, 0));

  // Send: slots per (destination, local expert) in token order (ids are distinct within a token), so
  // the layout is (source rank, token) ordered and reproducible. GPU: a warp per (token, k), 16-byte
  // stores into the peer's region, the slot from a stable rank instead of an atomicAdd.
  std::vector<uint32_t> cursor(size_t(W * E_l), 0);
  const auto* xs = static_cast<const uint8_t*>(x.data);
  const auto* sc = static_cast<const uint8_t*>(scales.data);
  const auto* id = static_cast<const int32_t*>(ids.data);
  for (int64_t t = 0; t < m; ++t)
    for (int j = 0; j < k; ++j) {
      const int e = id[t * k + j], dest = e / E_l, le = e % E_l;
      const uint32_t slot = cursor[size_t(dest * E_l + le)]++;
      uint8_t* row = region(dest, rank_) + ep_region_header_bytes(cfg_) + (size_t(le) * size_t(T) + slot) * stride;
      std::memcpy(row, xs + size_t(t) * rb, rb);
      if (sb) std::memcpy(row + rb, sc + size_t(t) * sb, sb);
      const int32_t src = int32_t(t * k + j);
      std::memcpy(row + rb + sb, &src, 4);
    }
  // Publish: counts as count + 1, then the dispatch flag, each one release store into the peer.
  for (int dest = 0; dest < W; ++dest) {
    auto* cells = reinterpret_cast<uint64_t*>(region(dest, rank_));
    for (int le = 0; le < E_l; ++le) store_release(cells + 2 + le, cell(n, cursor[size_t(dest * E_l + le)] + 1));
    store_release(cells + 0, cell(n, kOk));
  }
  return Status::ok();
}

Status EpAllToAll::dispatch_recv(EpReceived* out) {
  const std::string phase = "dispatch round " + std::to_string(epoch_);
  ENCORE_RETURN_IF_ERROR(aborted(phase));
  if (phase_ != Phase::kSent) return fail(phase, Status::invalid("dispatch_recv called without a dispatch_send before it"));
  if (!out) return fail(phase, Status::invalid("out: required"));
  phase_ = Phase::kReceived;
  const uint32_t n = epoch_;
  const int k = cfg_.top_k, E_l = e_local_, W = cfg_.world;
  const int64_t T = cfg_.max_tokens;
  const size_t rb = row_bytes(cfg_), sb = size_t(cfg_.scale_bytes), stride = ep_token_stride(cfg_);

  // Receive: every sender's flag, then its counts, then copy the rows out (rows of expert le ordered
  // by (sender, slot)). GPU: one block per sender polls with ld.acquire.sys.
  EpReceived& r = *out;
  r = EpReceived{};
  r.first_expert = rank_ * E_l;
  r.local_experts = E_l;
  r.counts.assign(size_t(E_l), 0);
  r.counts_from.assign(size_t(W * E_l), 0);
  for (int s = 0; s < W; ++s) {
    const auto* cells = reinterpret_cast<const uint64_t*>(region(rank_, s));
    ENCORE_RETURN_IF_ERROR(spin(phase, cells + 0, [&](uint64_t v) { return v == cell(n, kOk); },
                                [&] { return "rank " + std::to_string(s) + "'s dispatch flag (expected " + show(cell(n, kOk)) + ")"; }));
    for (int le = 0; le < E_l; ++le) {
      const uint64_t v = load_acquire(cells + 2 + le);
      if (cell_epoch(v) != n || cell_value(v) == 0 || cell_value(v) - 1 > uint64_t(T))
        return fail(phase, Status::internal("rank " + std::to_string(s) + "'s count of expert " + std::to_string(r.first_expert + le) +
                                            " is " + show(v) + " after its dispatch flag; expected {epoch " + std::to_string(n) +
                                            ", count + 1 in [1, " + std::to_string(T + 1) + "]}"));
      r.counts_from[size_t(s * E_l + le)] = int32_t(cell_value(v) - 1);
      r.counts[size_t(le)] += int32_t(cell_value(v) - 1);
    }
  }
  r.offsets.assign(size_t(E_l + 1), 0);
  for (int le = 0; le < E_l; ++le) r.offsets[size_t(le + 1)] = r.offsets[size_t(le)] + r.counts[size_t(le)];
  const size_t rows = size_t(r.offsets[size_t(E_l)]);
  r.x.resize(rows * rb);
  r.scales.resize(rows * sb);
  r.src_rank.resize(rows);
  r.src_token.resize(rows);
  r.src_k.resize(rows);
  recv_rank_.resize(rows);
  recv_slot_.resize(rows);
  size_t i = 0;
  for (int le = 0; le < E_l; ++le)
    for (int s = 0; s < W; ++s) {
      const uint8_t* base = region(rank_, s) + ep_region_header_bytes(cfg_) + size_t(le) * size_t(T) * stride;
      for (int32_t q = 0; q < r.counts_from[size_t(s * E_l + le)]; ++q, ++i) {
        const uint8_t* row = base + size_t(q) * stride;
        std::memcpy(r.x.data() + i * rb, row, rb);
        if (sb) std::memcpy(r.scales.data() + i * sb, row + rb, sb);
        int32_t src;
        std::memcpy(&src, row + rb + sb, 4);
        if (src < 0 || src >= T * k)
          return fail(phase, Status::internal("row " + std::to_string(q) + " of expert " + std::to_string(r.first_expert + le) + " from rank " +
                                              std::to_string(s) + " has source slot " + std::to_string(src) + ", outside [0, max_tokens * k)"));
        r.src_rank[i] = recv_rank_[i] = s;
        recv_slot_[i] = src;
        r.src_token[i] = src / k;
        r.src_k[i] = src % k;
      }
    }
  return Status::ok();
}

Status EpAllToAll::validate_combine_send(const TensorView& y) const {
  if (phase_ != Phase::kReceived) return Status::invalid("combine called without a dispatch (send and receive) before it");
  return check_2d("expert_out", y, combine_dtype_of(cfg_), int64_t(recv_rank_.size()), cfg_.hidden, "[received rows, H]");
}

Status EpAllToAll::validate_combine_recv(const TensorView& w, const TensorView& out) const {
  ENCORE_RETURN_IF_ERROR(check_2d("topk_weights", w, DType::kFP32, m_, cfg_.top_k, "[m, k]"));
  if (out.defined() && out.dtype != DType::kBF16 && out.dtype != DType::kFP16 && out.dtype != DType::kFP32)
    return Status::invalid(std::string("out: dtype must be bf16, fp16 or fp32, got ") + dtype_name(out.dtype));
  return check_2d("out", out, out.dtype, m_, cfg_.hidden, "[m, H]");
}

Status EpAllToAll::combine(const TensorView& y, const TensorView& w, const TensorView& out) {
  const std::string phase = "combine round " + std::to_string(epoch_);
  ENCORE_RETURN_IF_ERROR(aborted(phase));
  if (Status s = validate_combine_send(y); !s) return fail(phase, s);
  if (Status s = validate_combine_recv(w, out); !s) return fail(phase, s);
  ENCORE_RETURN_IF_ERROR(combine_send(y));
  return combine_recv(w, out);
}

Status EpAllToAll::combine_send(const TensorView& y) {
  const std::string phase = "combine round " + std::to_string(epoch_);
  ENCORE_RETURN_IF_ERROR(aborted(phase));
  if (Status s = validate_combine_send(y); !s) return fail(phase, s);
  phase_ = Phase::kCombineSent;
  const uint32_t n = epoch_;
  const int k = cfg_.top_k, W = cfg_.world;
  const size_t rb = size_t(cfg_.hidden) * dtype_size(combine_dtype_of(cfg_));

  // Return every received row to its origin's combine area, then one release add on that token's
  // counter. GPU: 16-byte stores into the peer, then atom.add.release.sys per token and expert.
  const auto* ys = static_cast<const uint8_t*>(y.data);
  for (size_t i = 0; i < recv_rank_.size(); ++i) {
    std::memcpy(combine_row(recv_rank_[i], recv_slot_[i]), ys + i * rb, rb);
    add_release(counter(recv_rank_[i], recv_slot_[i] / k), 1);
  }
  // Tell every sender its region here is consumed and its outputs are out (the next round's sync).
  for (int s = 0; s < W; ++s) store_release(reinterpret_cast<uint64_t*>(region(s, rank_)) + 1, cell(n, kOk));
  return Status::ok();
}

Status EpAllToAll::combine_recv(const TensorView& w, const TensorView& out) {
  const std::string phase = "combine round " + std::to_string(epoch_);
  ENCORE_RETURN_IF_ERROR(aborted(phase));
  if (phase_ != Phase::kCombineSent) return fail(phase, Status::invalid("combine_recv called without a combine_send before it"));
  if (Status s = validate_combine_recv(w, out); !s) return fail(phase, s);
  phase_ = Phase::kIdle;
  const uint32_t n = epoch_;
  const int k = cfg_.top_k, W = cfg_.world;

  // As the origin: sum each token once its k outputs are in, with the single-GPU reference combine
  // (fp32, one fma per slot in k order) on the token's k rows.
  std::vector<int32_t> slots(static_cast<size_t>(k));
  for (int j = 0; j < k; ++j) slots[size_t(j)] = j;
  const auto* ws = static_cast<const float*>(w.data);
  auto* os = static_cast<uint8_t*>(out.data);
  for (int64_t t = 0; t < m_; ++t) {
    ENCORE_RETURN_IF_ERROR(spin(phase, counter(rank_, t), [&](uint64_t v) { return v == cell(n, uint32_t(k)); }, [&] {
      return "token " + std::to_string(t) + "'s combine counter (expected " + show(cell(n, uint32_t(k))) + ": all top_k outputs)";
    }));
    CombineProblem p;
    p.expert_out = combine_row(rank_, t * k);
    p.eo_stride = int64_t(ep_combine_row_bytes(cfg_) / dtype_size(combine_dtype_of(cfg_)));
    p.eo_dtype = combine_dtype_of(cfg_);
    p.slot_rows = slots.data();
    p.slot_stride = k;
    p.weights = ws + t * k;
    p.weights_stride = k;
    p.out = os + size_t(t * cfg_.hidden) * dtype_size(out.dtype);
    p.out_stride = cfg_.hidden;
    p.out_dtype = out.dtype;
    p.tokens = 1;
    p.hidden = cfg_.hidden;
    p.top_k = k;
    reference::moe_combine(p);
  }
  // Sync: every peer has consumed what this rank dispatched, so the next dispatch may overwrite it.
  for (int s = 0; s < W; ++s) {
    const auto* cells = reinterpret_cast<const uint64_t*>(region(rank_, s));
    ENCORE_RETURN_IF_ERROR(spin(phase, cells + 1, [&](uint64_t v) { return v == cell(n, kOk); },
                                [&] { return "rank " + std::to_string(s) + "'s combine flag (expected " + show(cell(n, kOk)) + ")"; }));
  }
  return Status::ok();
}

}  // namespace encore::moe::ep
