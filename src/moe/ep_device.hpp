// The expert-parallel all-to-all on CUDA (issue 33's peer-memory path): the CPU emulation's protocol and
// layout (reference/ep_emulation.hpp) run by the kernels of cuda/ep_kernels.cu on every rank's memory.
// EpDeviceGroup owns every rank's memory; today only on one GPU (create_on_one_device: the protocol's
// single-GPU test bed, each rank's kernels on its own stream); the multi-GPU mapping (cuMem VMM
// allocations exported as POSIX file descriptors and mapped by every peer) is not built yet, nor the
// NCCL fallback inside this class (the collective path is encore.moe_forward_ep in Python and
// moe_forward_ep of encore/moe_ep.hpp in C++).
// EpDeviceAllToAll is one rank's end (pplx-kernels' AllToAll shape): dispatch and combine are enqueued
// on the caller's stream (no allocation, no synchronization; every call of a rank on the same stream,
// so a dispatch never overtakes the previous combine's final wait); a failure anywhere in the group (a bad
// topk_ids entry, a timeout) is recorded on the device, every rank's kernels give up, and status() reads
// the record as a message naming the rank, the round and the cell, once the caller has synchronized.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "moe/problem.hpp"
#include "moe/reference/ep_emulation.hpp"

namespace encore::moe::ep {

class EpDeviceGroup {
 public:
  // Every rank's ep_rank_bytes(c) and the error record on CUDA device `device`, zeroed. world <= 8;
  // H * dtype bytes a multiple of 16; num_experts < 2^30; world * max_tokens * min(k, E_l) < 2^31.
  static Status create_on_one_device(const EpConfig& c, int device, std::unique_ptr<EpDeviceGroup>* out);
  // This process's rank of a group of c.world processes on one node (one GPU each, or several on one
  // GPU), each calling it with the same config and `name` (unique per group on the node): its memory
  // allocated as peer memory (ep_vmm.cu), the descriptors exchanged (ep_exchange_fds, within c.timeout)
  // and every peer's memory mapped here; the error record is rank 0's. Tear down after the last
  // combine on every rank (no rank may still write into a peer's memory).
  static Status create_ipc(const EpConfig& c, int rank, int device, const std::string& name, std::unique_ptr<EpDeviceGroup>* out);
  ~EpDeviceGroup();
  EpDeviceGroup(const EpDeviceGroup&) = delete;
  EpDeviceGroup& operator=(const EpDeviceGroup&) = delete;
  const EpConfig& config() const { return cfg_; }
  int device() const { return device_; }
  uint8_t* memory(int rank) const { return mem_[rank]; }
  EpErrorRecord* error_record() const { return err_; }
  int ipc_rank() const { return ipc_rank_; }  // create_ipc's rank; -1 for create_on_one_device
  // ok while healthy, else the group's first failure as rank `asking` reports it (reads device memory:
  // call after synchronizing every rank's stream).
  Status status(int asking) const;

 private:
  EpDeviceGroup() = default;
  EpConfig cfg_;
  int device_ = 0;
  int ipc_rank_ = -1;
  void* block_ = nullptr;  // create_on_one_device: the error record, then every rank's memory
  EpPeerMemory peer_[kEpMaxWorld] = {};  // create_ipc: each rank's [error record | memory], this process's mapping
  uint8_t* mem_[kEpMaxWorld] = {};
  EpErrorRecord* err_ = nullptr;
};

// Sends my_fd to every other process of the group and receives theirs (abstract Unix sockets named
// after `name`, SCM_RIGHTS): peer_fds[r] = rank r's descriptor (my_fd at `rank`), owned by the caller.
// Every rank passes the same `tag` (a hash of its config): a peer with another is refused. Names of at
// most 80 characters.
Status ep_exchange_fds(const std::string& name, int rank, int world, int my_fd, uint64_t tag, std::chrono::milliseconds timeout,
                       std::vector<int>* peer_fds);

// What a rank received in its last dispatch (device memory, valid until the next dispatch):
// counts [E_l], offsets [E_l + 1], counts_from [W, E_l], src_rank / src_slot [max_rows] (origin rank,
// t * k + j), x [max_rows, H] (config dtype), scales [max_rows, scale_bytes]; rows [offsets[E_l],
// max_rows) unwritten. Row order as EpReceived: expert-contiguous, then (source rank, source token).
struct EpDeviceReceived {
  const int32_t *counts = nullptr, *offsets = nullptr, *counts_from = nullptr, *src_rank = nullptr, *src_slot = nullptr;
  const uint8_t *x = nullptr, *scales = nullptr;
  int64_t max_rows = 0;  // world * max_tokens * min(k, E_l)
};

class EpDeviceAllToAll {
 public:
  static Status create(EpDeviceGroup* group, int rank, std::unique_ptr<EpDeviceAllToAll>* out);
  ~EpDeviceAllToAll();
  EpDeviceAllToAll(const EpDeviceAllToAll&) = delete;
  EpDeviceAllToAll& operator=(const EpDeviceAllToAll&) = delete;

  // x [m, H] (config dtype), topk_ids [m, k] int32 (in [0, E), distinct per token: checked on the
  // device), scales [m, scale_bytes] uint8 when scale_bytes > 0; CUDA tensors on the group's device,
  // contiguous, 16-byte aligned; m in [0, max_tokens].
  // = dispatch_send then dispatch_recv. token_count (optional, an int32 in device memory of the group's
  // device, read once at the round's start): the round's live tokens, the first token_count rows of x /
  // topk_ids / scales (and of topk_weights / out at the combine), so one CUDA graph captured with x [m, H]
  // serves any count in [0, m]; a count outside it fails the group (status() names it). Null: all m rows.
  // Every half of a round and every round of a rank go on one stream (or streams ordered after it): the
  // kernels read the round from the device.
  Status dispatch(const TensorView& x, const TensorView& topk_ids, const TensorView& scales, Stream stream,
                  const int32_t* token_count = nullptr);
  const EpDeviceReceived& received() const { return recv_; }
  // expert_out [max_rows, H] (config dtype; its first offsets[E_l] rows in the received order),
  // topk_weights [m, k] fp32, out [m, H] bf16 / fp16 / fp32: out[t] = sum_j w[t, j] y(t, j) in fp32, one
  // fma per j in j order (the single-GPU combine, so the layer equals it bit for bit).
  // Every argument checked before anything is enqueued; = combine_send then combine_recv.
  Status combine(const TensorView& expert_out, const TensorView& topk_weights, const TensorView& out, Stream stream);
  // The halves, for overlap (the emulation's, moe/reference/ep_emulation.hpp): other work of the rank may
  // go on its stream (or others) between a send and its receive. In order, once each per round, all on
  // one stream per rank; out of order: a clear error, nothing enqueued.
  Status dispatch_send(const TensorView& x, const TensorView& topk_ids, const TensorView& scales, Stream stream,
                       const int32_t* token_count = nullptr);
  Status dispatch_recv(Stream stream);
  Status combine_send(const TensorView& expert_out, Stream stream);
  Status combine_recv(const TensorView& topk_weights, const TensorView& out, Stream stream);
  Status status() const { return g_->status(rank_); }
  int rank() const { return rank_; }
  uint32_t epoch() const { return epoch_; }  // the host's count of dispatches (CUDA-graph replays not included)

 private:
  EpDeviceAllToAll() = default;
  EpDeviceParams params() const;  // the layout, the group's pointers and this rank's buffers
  std::string phase_prefix(const char* what, uint32_t round) const;  // "ep rank r: dispatch round n: "
  Status check_combine_send(const TensorView& expert_out) const;
  Status check_combine_recv(const TensorView& topk_weights, const TensorView& out) const;
  Status enqueue_combine_send(const TensorView& expert_out, Stream stream);  // checked: the phase moves on
  Status enqueue_combine_recv(const TensorView& topk_weights, const TensorView& out, Stream stream);
  EpDeviceGroup* g_ = nullptr;
  int rank_ = 0;
  uint32_t epoch_ = 0;
  enum class Phase { kIdle, kSent, kReceived, kCombineSent };
  Phase phase_ = Phase::kIdle;
  int64_t m_ = 0;                     // x's rows this round
  const int32_t* m_dev_ = nullptr;    // this round's device token count (or null)
  uint32_t* epoch_dev_ = nullptr;     // the round on the device (in block_)
  void* block_ = nullptr;  // the received buffers
  EpDeviceReceived recv_;
  int32_t* table_ = nullptr;
};

}  // namespace encore::moe::ep
