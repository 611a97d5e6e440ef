// moe_forward_ep over a MoeEpComm (encore/moe_ep.hpp): the collective expert-parallel layer on the
// family's own ops (routing, dispatch, moe_forward, combine), and the host-memory group of threads that
// tests it on the CPU backend. The NCCL communicator is ep_nccl.cpp.
//
// Per call and rank: validate; routing over all E and a dispatch with align_m 1 (the (t, j) pairs
// expert-contiguous, hence grouped by destination rank r = e / E_l); one all-to-all of a fixed-size meta
// record per peer ([flag, E, D, F, k, dtype, world, T] then the E_l counts of that peer's experts); the
// host waits for it (the only wait), checks every rank's flag and shape, then sends each destination its
// rows (x_permuted [offsets[r E_l], offsets[(r+1) E_l])), runs moe_forward on the received rows with
// one-hot logits (top-1, weight exactly 1: each row's expert output, rounded), sends the rows back into
// the sender's dispatch order and combines them with the routing weights (fp32, j order).
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "core/fault_injection.hpp"
#include "encore/moe_ep.hpp"
#include "moe/args.hpp"
#include "moe/problem.hpp"
#ifdef ENCORE_WITH_CUDA
#include <cuda_runtime.h>

#include "moe/cuda/launch.hpp"
#endif

namespace encore {
namespace {

constexpr int kMetaHeader = 8;
constexpr int kMetaMaxExperts = 512;  // local experts per rank (the routing kernel's bound on E)
constexpr int kMetaInts = kMetaHeader + kMetaMaxExperts;
enum Meta { kFlag, kExperts, kHidden, kInter, kTopK, kDtype, kWorld, kTokens };

// ---- the host group -------------------------------------------------------------------------------

struct HostGroupState {
  std::mutex m;
  std::condition_variable cv;
  int world = 0, arrived = 0;
  uint64_t generation = 0;
  struct Post {
    const char* send = nullptr;
    const int64_t *send_offsets = nullptr, *send_bytes = nullptr;
  };
  std::vector<Post> posts;
};

class HostComm final : public MoeEpComm {
 public:
  HostComm(std::shared_ptr<HostGroupState> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world() const override { return g_->world; }
  Device device() const override { return Device{}; }

  Status all_to_all_v(const void* send, const int64_t* send_offsets, const int64_t* send_bytes, void* recv, const int64_t* recv_offsets,
                      const int64_t* recv_bytes, Stream) override {
    {
      std::lock_guard<std::mutex> l(g_->m);
      g_->posts[size_t(rank_)] = {static_cast<const char*>(send), send_offsets, send_bytes};
    }
    ENCORE_RETURN_IF_ERROR(barrier());
    Status st = Status::ok();
    for (int s = 0; s < g_->world; ++s) {
      const HostGroupState::Post& p = g_->posts[size_t(s)];
      if (p.send_bytes[rank_] != recv_bytes[s]) {
        st = Status::internal("moe_forward_ep: rank " + std::to_string(rank_) + " expected " + std::to_string(recv_bytes[s]) +
                              " bytes from rank " + std::to_string(s) + ", which sends " + std::to_string(p.send_bytes[rank_]));
        continue;
      }
      if (recv_bytes[s] > 0) std::memcpy(static_cast<char*>(recv) + recv_offsets[s], p.send + p.send_offsets[rank_], size_t(recv_bytes[s]));
    }
    ENCORE_RETURN_IF_ERROR(barrier());  // no rank reuses its send buffer before every peer has copied
    return st;
  }
  Status synchronize(Stream, std::chrono::milliseconds) override { return Status::ok(); }
  void set_timeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }

 private:
  Status barrier() {
    std::unique_lock<std::mutex> l(g_->m);
    const uint64_t gen = g_->generation;
    if (++g_->arrived == g_->world) {
      g_->arrived = 0;
      ++g_->generation;
      g_->cv.notify_all();
      return Status::ok();
    }
    if (g_->cv.wait_for(l, timeout_, [&] { return g_->generation != gen; })) return Status::ok();
    --g_->arrived;
    return Status::internal("moe_forward_ep: rank " + std::to_string(rank_) + " timed out after " + std::to_string(timeout_.count()) +
                            " ms waiting for the other ranks of its host group");
  }
  std::shared_ptr<HostGroupState> g_;
  int rank_;
  std::chrono::milliseconds timeout_{60000};
};

// ---- the layer --------------------------------------------------------------------------------------

struct Layout {
  int64_t T = 0, D = 0, F = 0, R = 0, Rr = 0;  // R: local pair rows (T k); Rr: received rows bound
  int E = 0, El = 0, k = 0, W = 1;
  MoeOptions local;  // the received rows' moe_forward: top-1 over E_l, the caller's align_m
  MoeLayerShape local_shape;
  size_t ids = 0, weights = 0, counts = 0, offsets = 0, slot_rows = 0, row_slots = 0, x_perm = 0, dispatch_ws = 0, y_perm = 0,
         send_meta = 0, recv_meta = 0, starts = 0, recv_x = 0, onehot = 0, recv_y = 0, local_buffers = 0, bytes = 0;
};

Status make_layout(const MoeEpShape& s, const MoeEpOptions& o, Layout* L) {
  if (s.max_tokens < 0 || s.hidden < 1 || s.intermediate < 1 || s.num_experts < 1 || s.world < 1)
    return Status::invalid("shape: max_tokens >= 0, hidden, intermediate, num_experts and world >= 1 required");
  if (s.num_experts % s.world != 0)
    return Status::invalid("shape: num_experts " + std::to_string(s.num_experts) + " is not a multiple of world " + std::to_string(s.world));
  L->E = s.num_experts, L->W = s.world, L->El = s.num_experts / s.world, L->k = o.moe.routing.top_k;
  if (L->El > kMetaMaxExperts) return Status::invalid("shape: " + std::to_string(L->El) + " experts per rank, more than 512");
  ENCORE_RETURN_IF_ERROR(moe::validate_routing_options(o.moe.routing, s.num_experts));
  L->T = std::max<int64_t>(s.max_tokens, 1), L->D = s.hidden, L->F = s.intermediate;
  L->R = L->T * L->k;
  L->Rr = int64_t(L->W) * L->T * std::min(L->k, L->El);  // a token's k experts are distinct
  // Issue 48: the meta record carries D and F as int32; the received rows (>= T k) are the local experts'
  // tokens, int32 rows in their dispatch; and the layout's byte counts below stay far from 2^64.
  for (auto [name, v] : {std::pair<const char*, int64_t>{"hidden", s.hidden}, {"intermediate", s.intermediate}})
    if (v >= (int64_t(1) << 31))
      return Status::unsupported(std::string("shape.") + name + ": " + std::to_string(v) + "; moe_forward_ep takes fewer than 2^31");
  if (L->Rr >= (int64_t(1) << 31))
    return Status::unsupported("shape.max_tokens: world * max_tokens * min(top_k, E_l) = " + std::to_string(L->Rr) +
                               " received rows at most; moe_forward_ep takes fewer than 2^31");
  if (static_cast<long double>(L->Rr) * static_cast<long double>(L->D) * dtype_size(s.dtype) >= static_cast<long double>(int64_t(1) << 60))
    return Status::unsupported("shape: the received rows' buffers (world * max_tokens * min(top_k, E_l) = " + std::to_string(L->Rr) +
                               " rows of hidden = " + std::to_string(L->D) + ") would take 2^60 bytes or more");
  L->local = MoeOptions{};
  L->local.routing.top_k = 1;
  L->local.align_m = o.moe.align_m;
  L->local_shape = MoeLayerShape{L->Rr, s.hidden, s.intermediate, L->El, s.dtype};
  const size_t local_bytes = moe_buffers_bytes(L->local_shape, L->local);
  if (local_bytes == 0) return Status::invalid("opts.moe.align_m: " + std::to_string(o.moe.align_m) + " is not a power of two");
  const size_t es = dtype_size(s.dtype);
  const size_t dws = moe::plan_moe_dispatch(L->T, L->k, L->E, 0).workspace_bytes;
  size_t at = 0;
  auto take = [&](size_t* field, size_t n) {
    *field = at;
    at += moe::round_up_bytes(std::max<size_t>(n, 1));
  };
  take(&L->ids, size_t(L->R) * 4);
  take(&L->weights, size_t(L->R) * 4);
  take(&L->counts, size_t(L->E) * 4);
  take(&L->offsets, size_t(L->E + 1) * 4);
  take(&L->slot_rows, size_t(L->R) * 4);
  take(&L->row_slots, size_t(L->R) * 4);
  take(&L->x_perm, size_t(L->R * L->D) * es);
  take(&L->dispatch_ws, dws);
  take(&L->y_perm, size_t(L->R * L->D) * es);
  take(&L->send_meta, size_t(L->W) * kMetaInts * 4);
  take(&L->recv_meta, size_t(L->W) * kMetaInts * 4);
  take(&L->starts, size_t(L->W * L->El + 1) * sizeof(int64_t));
  take(&L->recv_x, size_t(L->Rr * L->D) * es);
  take(&L->onehot, size_t(L->Rr * L->El) * 4);
  take(&L->recv_y, size_t(L->Rr * L->D) * es);
  take(&L->local_buffers, local_bytes);
  L->bytes = at;
  return Status::ok();
}

Status copy(void* dst, const void* src, size_t n, Device dev, Stream stream) {
  if (n == 0) return Status::ok();
  if (!dev.is_cuda()) {
    std::memmove(dst, src, n);
    return Status::ok();
  }
#ifdef ENCORE_WITH_CUDA
  const cudaError_t e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, static_cast<cudaStream_t>(stream));
  if (e == cudaSuccess) return Status::ok();
  (void)cudaGetLastError();
  return Status::cuda_error(fault::failure_message("moe_forward_ep", "cudaMemcpyAsync", cudaGetErrorName(e), int(e), cudaGetErrorString(e)));
#else
  (void)stream;
  return Status::unsupported("moe_forward_ep: a CUDA device in a build without CUDA");
#endif
}

// logits [rows, El] fp32: 1 at the row's local expert, 0 elsewhere; block b = (source, expert) holds
// rows [starts[b], starts[b + 1]).
Status one_hot(float* logits, int64_t* starts_dev, const std::vector<int64_t>& starts, int El, int64_t rows, Device dev, Stream stream) {
  if (!dev.is_cuda()) {
    std::fill(logits, logits + rows * El, 0.0f);
    for (size_t b = 0; b + 1 < starts.size(); ++b)
      for (int64_t r = starts[b]; r < starts[b + 1]; ++r) logits[r * El + int64_t(b % size_t(El))] = 1.0f;
    return Status::ok();
  }
#ifdef ENCORE_WITH_CUDA
  ENCORE_RETURN_IF_ERROR(copy(starts_dev, starts.data(), starts.size() * sizeof(int64_t), dev, stream));
  return cuda::launch_ep_one_hot_logits(logits, starts_dev, int(starts.size()), El, rows, dev.index, stream);
#else
  (void)stream, (void)starts_dev;
  return Status::unsupported("moe_forward_ep: a CUDA device in a build without CUDA");
#endif
}

Status validate_args(const MoeEpArgs& a, const MoeEpShape& s, const Layout& L, Device dev) {
  if (a.x.ndim != 2 || a.x.shape[1] != s.hidden) return Status::invalid("x: must be [T, " + std::to_string(s.hidden) + "]");
  if (a.x.dtype != s.dtype) return Status::invalid(std::string("x: dtype ") + dtype_name(a.x.dtype) + ", the shape says " + dtype_name(s.dtype));
  if (a.x.shape[0] > s.max_tokens)
    return Status::invalid("x: " + std::to_string(a.x.shape[0]) + " tokens, more than shape.max_tokens = " + std::to_string(s.max_tokens));
  if (!(a.x.device == dev)) return Status::invalid("x: on " + a.x.device.to_string() + ", the communicator's device is " + dev.to_string());
  const int64_t T = a.x.shape[0];
  if (a.router_logits.ndim != 2 || a.router_logits.shape[0] != T || a.router_logits.shape[1] != L.E)
    return Status::invalid("router_logits: must be [T, E] = [" + std::to_string(T) + ", " + std::to_string(L.E) + "] (all ranks' experts)");
  if (a.w13.ndim != 3 || a.w13.shape[0] != L.El || a.w13.shape[1] != 2 * s.intermediate || a.w13.shape[2] != s.hidden)
    return Status::invalid("w13: must be [E_l, 2F, D] = [" + std::to_string(L.El) + ", " + std::to_string(2 * s.intermediate) + ", " +
                           std::to_string(s.hidden) + "] (this rank's experts)");
  if (a.w2.ndim != 3 || a.w2.shape[0] != L.El || a.w2.shape[1] != s.hidden || a.w2.shape[2] != s.intermediate)
    return Status::invalid("w2: must be [E_l, D, F] = [" + std::to_string(L.El) + ", " + std::to_string(s.hidden) + ", " +
                           std::to_string(s.intermediate) + "]");
  if (a.out.ndim != 2 || a.out.shape[0] != T || a.out.shape[1] != s.hidden || a.out.dtype != s.dtype)
    return Status::invalid("out: must be [T, D] in x's dtype");
  return Status::ok();
}

TensorView view(char* base, size_t off, DType t, std::initializer_list<int64_t> shape, Device dev) {
  return TensorView::contiguous(base + off, t, shape, dev);
}

// The received rows' moe_forward, on `rows` rows of the workspace.
MoeForwardArgs local_forward(const MoeEpArgs& a, const MoeEpShape& s, const Layout& L, char* ws, size_t ws_bytes, int64_t rows, Device dev,
                             Status* st) {
  MoeBuffers b;
  *st = moe_buffers_carve(L.local_shape, L.local, ws + L.local_buffers, ws_bytes - L.local_buffers, dev, &b);
  return {view(ws, L.recv_x, s.dtype, {rows, L.D}, dev), view(ws, L.onehot, DType::kFP32, {rows, L.El}, dev), TensorView{}, a.w13, a.w2, b,
          view(ws, L.recv_y, s.dtype, {rows, L.D}, dev)};
}

}  // namespace

std::vector<std::unique_ptr<MoeEpComm>> moe_ep_host_group(int world) {
  auto g = std::make_shared<HostGroupState>();
  g->world = std::max(world, 1);
  g->posts.resize(size_t(g->world));
  std::vector<std::unique_ptr<MoeEpComm>> ranks;
  for (int r = 0; r < g->world; ++r) ranks.push_back(std::make_unique<HostComm>(g, r));
  return ranks;
}

size_t moe_ep_workspace_bytes(const MoeEpShape& shape, const MoeEpOptions& opts) {
  Layout L;
  return make_layout(shape, opts, &L) ? L.bytes : 0;
}

Status moe_forward_ep(const MoeEpArgs& a, const MoeEpShape& s, const MoeEpOptions& o, MoeEpComm& comm, void* workspace,
                      size_t workspace_bytes, Stream stream) {
  Layout L;
  ENCORE_RETURN_IF_ERROR(make_layout(s, o, &L));
  if (comm.world() != s.world)
    return Status::invalid("shape.world: " + std::to_string(s.world) + ", the communicator has " + std::to_string(comm.world()) + " ranks");
  if (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % moe::kBufferAlign != 0 || workspace_bytes < L.bytes)
    return Status::invalid("workspace: needs " + std::to_string(L.bytes) + " bytes (moe_ep_workspace_bytes), 256-byte aligned");
  comm.set_timeout(o.timeout);
  const Device dev = comm.device();
  const int me = comm.rank(), W = L.W, El = L.El, k = L.k;
  char* ws = static_cast<char*>(workspace);
  const int64_t es = int64_t(dtype_size(s.dtype)), row_bytes = L.D * es;

  // 1. Validate, route and dispatch locally (enqueued).
  Status mine = validate_args(a, s, L, dev);
  if (mine) {  // the weights as this rank's experts will take them (dtype, device, the CUDA kernels' limits)
    Status carve;
    const MoeForwardArgs fa = local_forward(a, s, L, ws, workspace_bytes, 1, dev, &carve);
    mine = carve ? validate(fa, L.local) : carve;
  }
  const int64_t T = mine ? a.x.shape[0] : 0;
  const TensorView weights = view(ws, L.weights, DType::kFP32, {std::max<int64_t>(T, 1), k}, dev);
  const TensorView slot_rows = view(ws, L.slot_rows, DType::kInt32, {std::max<int64_t>(T, 1), k}, dev);
  Status local = Status::ok();
  if (mine && T > 0) {
    MoeRoutingArgs ra{a.router_logits, a.correction_bias, view(ws, L.ids, DType::kInt32, {T, k}, dev), view(ws, L.weights, DType::kFP32, {T, k}, dev)};
    local = run(ra, o.moe.routing, nullptr, stream);
    MoeDispatchArgs da{ra.topk_ids, a.x, view(ws, L.counts, DType::kInt32, {L.E}, dev), view(ws, L.offsets, DType::kInt32, {L.E + 1}, dev),
                       view(ws, L.slot_rows, DType::kInt32, {T, k}, dev), view(ws, L.row_slots, DType::kInt32, {T * k}, dev),
                       view(ws, L.x_perm, s.dtype, {T * k, L.D}, dev)};
    if (local) local = run(da, MoeDispatchOptions{L.E, 1}, ws + L.dispatch_ws, stream);
  }
  // 2. The meta records (the header from the host, each peer's E_l counts copied on the stream from the
  // dispatch's), exchanged; then the one wait, bounded by opts.timeout.
  std::vector<int32_t> meta(size_t(W) * kMetaInts, 0), got(meta.size(), 0), offsets(size_t(L.E + 1), 0);
  for (int r = 0; r < W; ++r) {
    int32_t* m = &meta[size_t(r) * kMetaInts];
    m[kFlag] = !mine ? 1 : !local ? 2 : 0, m[kExperts] = L.E, m[kHidden] = int32_t(L.D), m[kInter] = int32_t(L.F), m[kTopK] = k;
    m[kDtype] = int32_t(s.dtype), m[kWorld] = W, m[kTokens] = int32_t(T);
  }
  ENCORE_RETURN_IF_ERROR(copy(ws + L.send_meta, meta.data(), meta.size() * 4, dev, stream));
  if (mine && local && T > 0)
    for (int r = 0; r < W; ++r)
      ENCORE_RETURN_IF_ERROR(copy(ws + L.send_meta + (size_t(r) * kMetaInts + kMetaHeader) * 4, ws + L.counts + size_t(r) * El * 4, size_t(El) * 4, dev, stream));
  std::vector<int64_t> meta_off(static_cast<size_t>(W)), meta_bytes(static_cast<size_t>(W), int64_t(kMetaInts) * 4);
  for (int r = 0; r < W; ++r) meta_off[size_t(r)] = int64_t(r) * kMetaInts * 4;
  ENCORE_RETURN_IF_ERROR(comm.all_to_all_v(ws + L.send_meta, meta_off.data(), meta_bytes.data(), ws + L.recv_meta, meta_off.data(),
                                           meta_bytes.data(), stream));
  ENCORE_RETURN_IF_ERROR(comm.synchronize(stream, o.timeout));
  ENCORE_RETURN_IF_ERROR(copy(got.data(), ws + L.recv_meta, got.size() * 4, dev, stream));  // the stream is idle: no wait
  if (T > 0) ENCORE_RETURN_IF_ERROR(copy(offsets.data(), ws + L.offsets, offsets.size() * 4, dev, stream));
  ENCORE_RETURN_IF_ERROR(comm.synchronize(stream, o.timeout));
  if (!mine) return mine;
  if (!local) return local;
  for (int r = 0; r < W; ++r) {
    const int32_t* m = &got[size_t(r) * kMetaInts];
    if (m[kFlag] != 0)
      return Status::invalid("moe_forward_ep: rank " + std::to_string(r) + (m[kFlag] == 1 ? " refused its input" : " failed its routing or dispatch") +
                             " (its own error says why); no rank ran its experts");
    if (m[kExperts] != L.E || m[kHidden] != L.D || m[kInter] != L.F || m[kTopK] != k || m[kDtype] != int32_t(s.dtype) || m[kWorld] != W)
      return Status::invalid("moe_forward_ep: rank " + std::to_string(r) + " called with another shape (E, D, F, top_k, dtype or world) than rank " +
                             std::to_string(me));
  }

  // 3. Rows out: destination r gets x_perm [offsets[r El], offsets[(r+1) El]); rows in, source-major.
  const size_t nw = static_cast<size_t>(W);
  std::vector<int64_t> send_off(nw), send_bytes(nw), recv_off(nw), recv_bytes(nw);
  std::vector<int64_t> starts(1, 0);  // (source, expert) blocks of the received rows
  for (int r = 0; r < W; ++r) {
    send_off[size_t(r)] = int64_t(offsets[size_t(r * El)]) * row_bytes;
    send_bytes[size_t(r)] = int64_t(offsets[size_t((r + 1) * El)] - offsets[size_t(r * El)]) * row_bytes;
    recv_off[size_t(r)] = starts.back() * row_bytes;
    for (int e = 0; e < El; ++e) starts.push_back(starts.back() + got[size_t(r) * kMetaInts + kMetaHeader + e]);
    recv_bytes[size_t(r)] = starts.back() * row_bytes - recv_off[size_t(r)];
  }
  const int64_t rows = starts.back();
  if (rows > L.Rr) return Status::internal("moe_forward_ep: " + std::to_string(rows) + " rows received, more than the bound " + std::to_string(L.Rr));
  ENCORE_RETURN_IF_ERROR(comm.all_to_all_v(ws + L.x_perm, send_off.data(), send_bytes.data(), ws + L.recv_x, recv_off.data(), recv_bytes.data(), stream));

  // 4. This rank's experts on the received rows: one-hot top-1 routing, weight exactly 1.
  if (rows > 0) {
    ENCORE_RETURN_IF_ERROR(one_hot(reinterpret_cast<float*>(ws + L.onehot), reinterpret_cast<int64_t*>(ws + L.starts), starts, El, rows, dev, stream));
    Status carve;
    const MoeForwardArgs fa = local_forward(a, s, L, ws, workspace_bytes, rows, dev, &carve);
    ENCORE_RETURN_IF_ERROR(carve);
    ENCORE_RETURN_IF_ERROR(run(fa, L.local, nullptr, stream));
  }

  // 5. Rows back into the dispatch order, then the weighted combine.
  ENCORE_RETURN_IF_ERROR(comm.all_to_all_v(ws + L.recv_y, recv_off.data(), recv_bytes.data(), ws + L.y_perm, send_off.data(), send_bytes.data(), stream));
  if (T == 0) return Status::ok();
  const MoeCombineArgs ca{view(ws, L.y_perm, s.dtype, {T * k, L.D}, dev), slot_rows, weights, a.out};
  return run(ca, MoeCombineOptions{}, nullptr, stream);
}

}  // namespace encore
