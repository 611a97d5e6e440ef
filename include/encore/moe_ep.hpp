// encore moe, expert parallel over a communicator (issue 33's collective path for C++ users): the layer
// of encore/moe.hpp with the E experts split over `world` ranks, rank r holding experts
// [r·E_l, (r+1)·E_l) (E_l = E / world), each rank its own T_r tokens (T_r may differ, 0 included).
//
//   per rank   routing (all E) and a dispatch over all E (align_m 1): the (t, j) pairs grouped by expert,
//              so by destination rank; counts per (destination, local expert) exchanged (one small
//              all-to-all, with an error flag: a rank whose input is bad makes every rank fail)
//   exchange   the rows of each destination's experts sent in that order (one all-to-all-v); the
//              receiver holds them source-major, expert-ascending within a source
//   experts    moe_forward on the received rows with a one-hot top-1 routing (weight exactly 1), so each
//              output row is that expert's rounded SwiGLU MLP output of its own row
//   return     the output rows sent back the same way (all-to-all-v), in the sender's dispatch order
//   combine    out[t] = sum_j w[t, j] * y[(t, j)] in fp32 in j order, rounded once (moe_combine)
//
// So every rank's out equals moe_forward on all ranks' tokens in one process, up to the expert GEMMs'
// row grouping (bit-equal where each GEMM row is computed independently of its neighbours, as on the
// CPU backend; tests/moe/test_moe_ep_comm_cpu.cpp). The host waits once per call, for the counts (the
// split sizes of the all-to-all-v), within MoeEpOptions::timeout.
//
// Communicators: moe_ep_host_group (ranks as threads of one process over host memory, the CPU backend:
// tests and reference) and, in CUDA builds with NCCL, moe_ep_nccl_comm over a caller's ncclComm_t (or
// one built from an ncclUniqueId); the NCCL one has not run across GPUs yet (docs/moe.md).
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "encore/moe.hpp"

typedef struct ncclComm* ncclComm_t;  // as nccl.h declares it

namespace encore {

// One rank's end of a group. Buffers are on this rank's device (host memory for the host group).
class MoeEpComm {
 public:
  virtual ~MoeEpComm() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  virtual Device device() const = 0;
  // Every rank at once: to each rank r, send_bytes[r] bytes from send + send_offsets[r]; from each r,
  // recv_bytes[r] bytes into recv + recv_offsets[r] (the byte counts agree pairwise: this rank's
  // send_bytes[r] is rank r's recv_bytes[rank]). Enqueued on stream (host group: done on return).
  virtual Status all_to_all_v(const void* send, const int64_t* send_offsets, const int64_t* send_bytes, void* recv,
                              const int64_t* recv_offsets, const int64_t* recv_bytes, Stream stream) = 0;
  // Waits for the work enqueued on stream, at most `timeout`; on timeout the group is aborted and an
  // error names the rank.
  virtual Status synchronize(Stream stream, std::chrono::milliseconds timeout) = 0;
  // The bound on waits inside all_to_all_v itself (the host group's barriers; NCCL enqueues only).
  virtual void set_timeout(std::chrono::milliseconds) {}
};

// `world` ranks of one process over host memory (threads; each rank's calls on its own thread).
std::vector<std::unique_ptr<MoeEpComm>> moe_ep_host_group(int world);

// NCCL (CUDA builds with NCCL; else an error saying so): a caller's communicator (not owned; its rank,
// size and device are read from it), or one this object creates from an ncclUniqueId's 128 bytes and
// owns (every rank calls it with the same id and world, its own rank, on its own GPU).
Status moe_ep_nccl_comm(ncclComm_t comm, std::unique_ptr<MoeEpComm>* out);
Status moe_ep_nccl_unique_id(void* unique_id);  // ncclGetUniqueId into 128 bytes (rank 0 makes it, shares it)
Status moe_ep_nccl_comm_from_unique_id(const void* unique_id, int world, int rank, int device, std::unique_ptr<MoeEpComm>* out);
bool moe_ep_have_nccl();

struct MoeEpOptions {
  MoeOptions moe;  // routing (top_k over all E) and the local experts' align_m
  std::chrono::milliseconds timeout{60000};
};

// What the workspace is sized for, per rank: at most max_tokens tokens on any rank.
struct MoeEpShape {
  int64_t max_tokens = 0;
  int64_t hidden = 0;        // D
  int64_t intermediate = 0;  // F
  int num_experts = 0;       // E, all ranks' (a multiple of world)
  int world = 1;
  DType dtype = DType::kBF16;
};
size_t moe_ep_workspace_bytes(const MoeEpShape& shape, const MoeEpOptions& opts);

struct MoeEpArgs {
  TensorView x;                // [T, D], T <= max_tokens (0 allowed)
  TensorView router_logits;    // [T, E] over all experts
  TensorView correction_bias;  // [E], optional
  TensorView w13;              // [E_l, 2F, D]: this rank's experts
  TensorView w2;               // [E_l, D, F]
  TensorView out;              // [T, D], output
};
// Every rank calls it with the same shape and options; workspace of moe_ep_workspace_bytes, 256-byte
// aligned, on the comm's device. Bad input on any rank fails every rank (after the counts exchange) with
// a message naming the rank.
Status moe_forward_ep(const MoeEpArgs& args, const MoeEpShape& shape, const MoeEpOptions& opts, MoeEpComm& comm, void* workspace,
                      size_t workspace_bytes, Stream stream = nullptr);

}  // namespace encore
