// The CUDA expert-parallel all-to-all's host side (ep_device.hpp): memory, validation, the kernel
// argument, and the device error record turned into a message.
#include "moe/ep_device.hpp"

#include <unistd.h>

#include <algorithm>
#include <string>

#include "core/checks.hpp"
#include "core/device_memory.hpp"
#ifdef ENCORE_WITH_CUDA
#include "moe/cuda/launch.hpp"
#endif

namespace encore::moe::ep {
namespace {

size_t up256(size_t n) { return (n + 255) / 256 * 256; }
std::string show(unsigned long long v) {
  return "{epoch " + std::to_string(v >> 32) + ", value " + std::to_string(uint32_t(v)) + "}";
}
const char* phase_name(uint32_t p) {
  switch (p) {
    case kEpPhaseDispatch: return "dispatch";
    case kEpPhaseReceive: return "dispatch (receive)";
    case kEpPhaseCombine: return "combine";
    case kEpPhaseSync: return "combine (sync)";
    default: return "?";
  }
}

// The record's failure in words, as the failing rank reports it.
std::string describe(const EpErrorDetail& r, const EpConfig& c) {
  const int k = c.top_k;
  switch (r.what) {
    case kEpBadExpert:
      return "topk_ids: entry [" + std::to_string(r.index / k) + ", " + std::to_string(r.index % k) + "] = " + std::to_string(int32_t(r.seen)) +
             " is outside [0, num_experts = " + std::to_string(c.num_experts) + ")";
    case kEpDuplicateExpert:
      return "topk_ids: token " + std::to_string(r.index / k) + " lists expert " + std::to_string(int32_t(r.seen)) + " twice";
    case kEpTimeoutCount:
      return "timed out after " + std::to_string(c.timeout.count()) + " ms waiting for rank " + std::to_string(r.peer) + "'s count of expert " +
             std::to_string(r.index) + " (expected {epoch " + std::to_string(r.expected >> 32) + ", count + 1 >= 1}), saw " + show(r.seen);
    case kEpBadCount:
      if (r.peer < 0) return std::to_string(r.seen) + " rows received in all, above the buffers' max_rows = " + std::to_string(r.expected);
      return "rank " + std::to_string(r.peer) + "'s count of expert " + std::to_string(r.index) + " is " + show(r.seen) + ", above max_tokens + 1";
    case kEpBadSlot:
      return "received row " + std::to_string(r.index) + " from rank " + std::to_string(r.peer) + " has source slot " + std::to_string(r.seen) +
             ", outside [0, max_tokens * k)";
    case kEpTimeoutToken:
      return "timed out after " + std::to_string(c.timeout.count()) + " ms waiting for token " + std::to_string(r.index) +
             "'s combine counter (expected " + show(r.expected) + ": all top_k outputs), saw " + show(r.seen);
    case kEpBadTokenCount:
      return "token_count: the device count is " + std::to_string(int32_t(uint32_t(r.seen))) + ", outside [0, m = " + std::to_string(r.expected) +
             "] (x's rows)";
    case kEpTimeoutFlag:
      return "timed out after " + std::to_string(c.timeout.count()) + " ms waiting for rank " + std::to_string(r.peer) +
             "'s combine flag (expected " + show(r.expected) + "), saw " + show(r.seen);
    default: return "unknown failure " + std::to_string(r.what);
  }
}

// The emulation's config checks and the CUDA kernels' limits.
Status validate_for_cuda(const EpConfig& c) {
  ENCORE_RETURN_IF_ERROR(validate(c));
  if (c.world > kEpMaxWorld) return Status::unsupported("world: at most " + std::to_string(kEpMaxWorld) + " ranks, got " + std::to_string(c.world));
  for (DType dt : {c.dtype, combine_dtype_of(c)})
    if ((size_t(c.hidden) * dtype_size(dt)) % 16 != 0)
      return Status::unsupported("hidden: H * dtype bytes must be a multiple of 16 on CUDA (the rows' and the expert outputs'), got " +
                                 std::to_string(c.hidden) + " x " + std::to_string(dtype_size(dt)));
  // Issue 48: the kernels count experts in int loops (E < 2^30 leaves them room) and the received rows in
  // int32 (the row table, offsets and counts, each row's source slot t * k + j <= max_rows): at most
  // 2^31 - 1 rows, world * max_tokens * min(k, E_l), which bounds max_tokens * k too.
  if (c.num_experts >= (1 << 30))
    return Status::unsupported("num_experts: " + std::to_string(c.num_experts) + " experts; the CUDA all-to-all takes fewer than 2^30");
  const int64_t max_rows = int64_t(c.world) * c.max_tokens * std::min(c.top_k, c.num_experts / c.world);
  if (max_rows >= (int64_t(1) << 31))
    return Status::unsupported("max_tokens: world * max_tokens * min(top_k, E_l) = " + std::to_string(max_rows) +
                               " received rows at most; the CUDA all-to-all takes fewer than 2^31");
  return Status::ok();
}

Status device_tensor(const char* name, const TensorView& v, DType dt, int64_t rows, int64_t cols, const char* shape, int device) {
  if (!v.defined() || v.ndim != 2) return Status::invalid(std::string(name) + ": must be 2-d " + shape + ", got " + v.shape_string());
  if (v.dtype != dt) return Status::invalid(std::string(name) + ": dtype must be " + dtype_name(dt) + ", got " + dtype_name(v.dtype));
  if (!v.device.is_cuda() || v.device.index != device)
    return Status::invalid(std::string(name) + ": must be on CUDA device " + std::to_string(device) + " (the group's)");
  if ((rows >= 0 && v.shape[0] != rows) || v.shape[1] != cols)
    return Status::invalid(std::string(name) + ": shape must be " + shape + " = [" + std::to_string(rows) + ", " + std::to_string(cols) + "], got " +
                           v.shape_string());
  if (!v.is_contiguous()) return Status::invalid(std::string(name) + ": must be contiguous");
  if (v.shape[0] * v.shape[1] > 0 && !checks::aligned(v.data, 16)) return Status::invalid(std::string(name) + ": must be 16-byte aligned");
  return checks::device_memory(name, v);
}

}  // namespace

EpDeviceGroup::~EpDeviceGroup() {
#ifdef ENCORE_WITH_CUDA
  cuda::ep_device_free(block_);
  for (EpPeerMemory& m : peer_) cuda::ep_peer_memory_release(&m);
#endif
}

Status EpDeviceGroup::create_ipc(const EpConfig& c, int rank, int device, const std::string& name, std::unique_ptr<EpDeviceGroup>* out) {
  ENCORE_RETURN_IF_ERROR(validate_for_cuda(c));
  if (!out) return Status::invalid("out: required");
  if (rank < 0 || rank >= c.world) return Status::invalid("rank: must be in [0, world = " + std::to_string(c.world) + "), got " + std::to_string(rank));
  if (name.empty()) return Status::invalid("name: required (unique per group on the node)");
#ifdef ENCORE_WITH_CUDA
  std::unique_ptr<EpDeviceGroup> g(new EpDeviceGroup());
  g->cfg_ = c;
  g->device_ = device;
  g->ipc_rank_ = rank;
  const size_t bytes = kEpErrorRecordBytes + up256(ep_rank_bytes(c));
  ENCORE_RETURN_IF_ERROR(cuda::ep_peer_memory_create(bytes, device, &g->peer_[rank]));
  // The tag every rank must share: its rounded allocation size and the config (a peer built with other
  // shapes would map too much or too little).
  uint64_t tag = uint64_t(g->peer_[rank].bytes);
  for (int64_t v : {int64_t(c.world), int64_t(c.num_experts), int64_t(c.top_k), c.hidden, c.max_tokens, int64_t(c.dtype), c.scale_bytes,
                    int64_t(combine_dtype_of(c))})
    tag = (tag ^ uint64_t(v)) * 0x100000001B3ull;
  std::vector<int> fds;
  ENCORE_RETURN_IF_ERROR(ep_exchange_fds(name, rank, c.world, g->peer_[rank].fd, tag, c.timeout, &fds));
  Status s = Status::ok();
  for (int r = 0; r < c.world; ++r) {
    if (r == rank) continue;
    if (s) s = cuda::ep_peer_memory_import(fds[size_t(r)], g->peer_[rank].bytes, device, &g->peer_[r]);
    close(fds[size_t(r)]);
  }
  ENCORE_RETURN_IF_ERROR(s);
  for (int r = 0; r < c.world; ++r) g->mem_[r] = static_cast<uint8_t*>(g->peer_[r].ptr) + kEpErrorRecordBytes;
  g->err_ = static_cast<EpErrorRecord*>(g->peer_[0].ptr);
  *out = std::move(g);
  return Status::ok();
#else
  (void)device;
  return Status::unsupported("EpDeviceGroup: encore was built without CUDA");
#endif
}

Status EpDeviceGroup::create_on_one_device(const EpConfig& c, int device, std::unique_ptr<EpDeviceGroup>* out) {
  ENCORE_RETURN_IF_ERROR(validate_for_cuda(c));
  if (!out) return Status::invalid("out: required");
#ifdef ENCORE_WITH_CUDA
  std::unique_ptr<EpDeviceGroup> g(new EpDeviceGroup());
  g->cfg_ = c;
  g->device_ = device;
  const size_t rank_bytes = up256(ep_rank_bytes(c));
  ENCORE_RETURN_IF_ERROR(cuda::ep_device_alloc(kEpErrorRecordBytes + size_t(c.world) * rank_bytes, device, &g->block_));
  auto* base = static_cast<uint8_t*>(g->block_);
  g->err_ = reinterpret_cast<EpErrorRecord*>(base);
  for (int r = 0; r < c.world; ++r) g->mem_[r] = base + kEpErrorRecordBytes + size_t(r) * rank_bytes;
  *out = std::move(g);
  return Status::ok();
#else
  (void)device;
  return Status::unsupported("EpDeviceGroup: encore was built without CUDA");
#endif
}

Status EpDeviceGroup::status(int asking) const {
  EpErrorRecord r{};
#ifdef ENCORE_WITH_CUDA
  ENCORE_RETURN_IF_ERROR(cuda::ep_device_read(&r, err_, sizeof(r)));
#endif
  if (r.abort == 0) return Status::ok();
  const int who = int(uint32_t(r.abort)) - 1;
  if (who < 0 || who >= cfg_.world) return Status::internal("ep: corrupt error record (abort " + show(r.abort) + ")");
  const EpErrorDetail& d = r.detail[who];
  const std::string round = std::to_string(r.abort >> 32);
  const std::string what = "ep rank " + std::to_string(who) + ": " + phase_name(d.phase) + " round " + round + ": " + describe(d, cfg_);
  if (who == asking) return Status::internal(what);
  return Status::internal("ep rank " + std::to_string(asking) + ": aborted (round " + round + ") because rank " + std::to_string(who) + " failed: " + what);
}

EpDeviceAllToAll::~EpDeviceAllToAll() {
#ifdef ENCORE_WITH_CUDA
  cuda::ep_device_free(block_);
#endif
}

Status EpDeviceAllToAll::create(EpDeviceGroup* group, int rank, std::unique_ptr<EpDeviceAllToAll>* out) {
  if (!group) return Status::invalid("group: required");
  if (!out) return Status::invalid("out: required");
  const EpConfig& c = group->config();
  if (rank < 0 || rank >= c.world) return Status::invalid("rank: must be in [0, world = " + std::to_string(c.world) + "), got " + std::to_string(rank));
  if (group->ipc_rank() >= 0 && rank != group->ipc_rank())
    return Status::invalid("rank: this process's IPC group is rank " + std::to_string(group->ipc_rank()) + "'s, got " + std::to_string(rank));
#ifdef ENCORE_WITH_CUDA
  std::unique_ptr<EpDeviceAllToAll> a(new EpDeviceAllToAll());
  a->g_ = group;
  a->rank_ = rank;
  const int W = c.world, El = c.num_experts / c.world;
  const int64_t rows = int64_t(W) * c.max_tokens * std::min(c.top_k, El);
  const size_t rb = size_t(c.hidden) * dtype_size(c.dtype), sb = size_t(c.scale_bytes);
  const size_t ints = size_t(El) + size_t(El + 1) + size_t(W * El) + size_t(W * El + 1) + 2 * size_t(rows);
  const size_t bytes = up256(ints * 4) + up256(size_t(rows) * rb) + up256(size_t(rows) * sb) + 256;  // + the device round
  ENCORE_RETURN_IF_ERROR(cuda::ep_load_kernels(group->device()));
  ENCORE_RETURN_IF_ERROR(cuda::ep_device_alloc(bytes, group->device(), &a->block_));
  auto* i32 = static_cast<int32_t*>(a->block_);
  EpDeviceReceived& r = a->recv_;
  r.counts = i32;
  r.offsets = r.counts + El;
  r.counts_from = r.offsets + El + 1;
  a->table_ = const_cast<int32_t*>(r.counts_from) + W * El;
  r.src_rank = a->table_ + W * El + 1;
  r.src_slot = r.src_rank + rows;
  r.x = static_cast<const uint8_t*>(a->block_) + up256(ints * 4);
  r.scales = r.x + up256(size_t(rows) * rb);
  r.max_rows = rows;
  a->epoch_dev_ = reinterpret_cast<uint32_t*>(const_cast<uint8_t*>(r.scales) + up256(size_t(rows) * sb));  // zeroed: round 0
  *out = std::move(a);
  return Status::ok();
#else
  return Status::unsupported("EpDeviceAllToAll: encore was built without CUDA");
#endif
}

EpDeviceParams EpDeviceAllToAll::params() const {
  const EpConfig& c = g_->config();
  EpDeviceParams p;
  for (int r = 0; r < c.world; ++r) p.mem[r] = g_->memory(r);
  p.err = g_->error_record();
  p.world = c.world;
  p.rank = rank_;
  p.e_local = c.num_experts / c.world;
  p.top_k = c.top_k;
  p.num_experts = c.num_experts;
  p.epoch_dev = epoch_dev_;
  p.timeout_ns = static_cast<unsigned long long>(c.timeout.count()) * 1000000ull;
  p.max_tokens = c.max_tokens;
  p.m = m_;
  p.m_dev = m_dev_;
  p.row_bytes = int64_t(size_t(c.hidden) * dtype_size(c.dtype));
  p.scale_bytes = c.scale_bytes;
  p.token_stride = int64_t(ep_token_stride(c));
  p.region_bytes = int64_t(ep_region_bytes(c));
  p.region_header = int64_t(ep_region_header_bytes(c));
  p.combine_header = int64_t(ep_combine_header_bytes(c));
  p.combine_row_bytes = int64_t(ep_combine_row_bytes(c));
  p.y_row_bytes = int64_t(size_t(c.hidden) * dtype_size(combine_dtype_of(c)));
  p.dtype = combine_dtype_of(c);
  p.counts = const_cast<int32_t*>(recv_.counts);
  p.offsets = const_cast<int32_t*>(recv_.offsets);
  p.counts_from = const_cast<int32_t*>(recv_.counts_from);
  p.table = table_;
  p.src_rank = const_cast<int32_t*>(recv_.src_rank);
  p.src_slot = const_cast<int32_t*>(recv_.src_slot);
  p.rx = const_cast<uint8_t*>(recv_.x);
  p.rscales = const_cast<uint8_t*>(recv_.scales);
  p.max_rows = recv_.max_rows;
  p.grid = 132;
  return p;
}

Status EpDeviceAllToAll::dispatch(const TensorView& x, const TensorView& ids, const TensorView& scales, Stream stream,
                                   const int32_t* token_count) {
  ENCORE_RETURN_IF_ERROR(dispatch_send(x, ids, scales, stream, token_count));
  return dispatch_recv(stream);
}

std::string EpDeviceAllToAll::phase_prefix(const char* what, uint32_t round) const {
  return "ep rank " + std::to_string(rank_) + ": " + what + " round " + std::to_string(round) + ": ";
}

Status EpDeviceAllToAll::dispatch_send(const TensorView& x, const TensorView& ids, const TensorView& scales, Stream stream,
                                        const int32_t* token_count) {
  const EpConfig& c = g_->config();
  const std::string phase = phase_prefix("dispatch", epoch_ + 1);
  if (phase_ != Phase::kIdle) return Status::invalid(phase + "dispatch called twice without a combine between them");
  if (!x.defined() || x.ndim != 2) return Status::invalid(phase + "x: must be 2-d [m, H], got " + x.shape_string());
  const int64_t m = x.shape[0];
  if (m > c.max_tokens) return Status::invalid(phase + "x: m = " + std::to_string(m) + " tokens exceeds max_tokens = " + std::to_string(c.max_tokens));
  const int dev = g_->device();
  Status s = device_tensor("x", x, c.dtype, m, c.hidden, "[m, H]", dev);
  if (s) s = device_tensor("topk_ids", ids, DType::kInt32, m, c.top_k, "[m, k]", dev);
  if (s && c.scale_bytes > 0) s = device_tensor("scales", scales, DType::kUInt8, m, c.scale_bytes, "[m, scale_bytes]", dev);
  else if (s && scales.defined()) s = Status::invalid("scales: given but the config has scale_bytes = 0");
  if (!s) return Status(s.code(), phase + s.message());
#ifdef ENCORE_WITH_CUDA
  if (token_count) ENCORE_RETURN_IF_ERROR(cuda::ep_check_device_int(token_count, dev, stream, (phase + "token_count").c_str()));
  ++epoch_;
  m_ = m;
  m_dev_ = token_count;
  phase_ = Phase::kSent;
  EpDeviceParams p = params();
  p.x = static_cast<const uint8_t*>(x.data);
  p.ids = static_cast<const int32_t*>(ids.data);
  p.scales = static_cast<const uint8_t*>(scales.data);
  return cuda::launch_ep_dispatch_send(p, dev, stream);
#else
  (void)stream, (void)token_count;
  return Status::unsupported("EpDeviceAllToAll: encore was built without CUDA");
#endif
}

Status EpDeviceAllToAll::dispatch_recv(Stream stream) {
  if (phase_ != Phase::kSent) return Status::invalid(phase_prefix("dispatch", epoch_) + "dispatch_recv called without a dispatch_send before it");
#ifdef ENCORE_WITH_CUDA
  phase_ = Phase::kReceived;
  return cuda::launch_ep_dispatch_recv(params(), g_->device(), stream);
#else
  (void)stream;
  return Status::unsupported("EpDeviceAllToAll: encore was built without CUDA");
#endif
}

Status EpDeviceAllToAll::check_combine_send(const TensorView& y) const {
  const std::string phase = phase_prefix("combine", epoch_);
  if (phase_ != Phase::kReceived) return Status::invalid(phase + "combine called without a dispatch (send and receive) before it");
  const Status s = device_tensor("expert_out", y, combine_dtype_of(g_->config()), recv_.max_rows, g_->config().hidden, "[max_rows, H]", g_->device());
  return s ? s : Status(s.code(), phase + s.message());
}

Status EpDeviceAllToAll::check_combine_recv(const TensorView& w, const TensorView& out) const {
  const EpConfig& c = g_->config();
  const int dev = g_->device();
  Status s = device_tensor("topk_weights", w, DType::kFP32, m_, c.top_k, "[m, k]", dev);
  if (s && out.defined() && out.dtype != DType::kBF16 && out.dtype != DType::kFP16 && out.dtype != DType::kFP32)
    s = Status::invalid(std::string("out: dtype must be bf16, fp16 or fp32, got ") + dtype_name(out.dtype));
  if (s) s = device_tensor("out", out, out.dtype, m_, c.hidden, "[m, H]", dev);
  return s ? s : Status(s.code(), phase_prefix("combine", epoch_) + s.message());
}

Status EpDeviceAllToAll::combine(const TensorView& y, const TensorView& w, const TensorView& out, Stream stream) {
  ENCORE_RETURN_IF_ERROR(check_combine_send(y));
  ENCORE_RETURN_IF_ERROR(check_combine_recv(w, out));
  ENCORE_RETURN_IF_ERROR(enqueue_combine_send(y, stream));
  return enqueue_combine_recv(w, out, stream);
}

Status EpDeviceAllToAll::combine_send(const TensorView& y, Stream stream) {
  ENCORE_RETURN_IF_ERROR(check_combine_send(y));
  return enqueue_combine_send(y, stream);
}

Status EpDeviceAllToAll::combine_recv(const TensorView& w, const TensorView& out, Stream stream) {
  if (phase_ != Phase::kCombineSent) return Status::invalid(phase_prefix("combine", epoch_) + "combine_recv called without a combine_send before it");
  ENCORE_RETURN_IF_ERROR(check_combine_recv(w, out));
  return enqueue_combine_recv(w, out, stream);
}

Status EpDeviceAllToAll::enqueue_combine_send(const TensorView& y, Stream stream) {
#ifdef ENCORE_WITH_CUDA
  phase_ = Phase::kCombineSent;
  EpDeviceParams p = params();
  p.y = static_cast<const uint8_t*>(y.data);
  return cuda::launch_ep_combine_send(p, g_->device(), stream);
#else
  (void)y, (void)stream;
  return Status::unsupported("EpDeviceAllToAll: encore was built without CUDA");
#endif
}

Status EpDeviceAllToAll::enqueue_combine_recv(const TensorView& w, const TensorView& out, Stream stream) {
#ifdef ENCORE_WITH_CUDA
  phase_ = Phase::kIdle;
  EpDeviceParams p = params();
  p.weights = static_cast<const float*>(w.data);
  p.out = out.data;
  p.out_dtype = out.dtype;
  return cuda::launch_ep_combine_recv(p, g_->device(), stream);
#else
  (void)w, (void)out, (void)stream;
  return Status::unsupported("EpDeviceAllToAll: encore was built without CUDA");
#endif
}

}  // namespace encore::moe::ep
