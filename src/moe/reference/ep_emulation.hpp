// Expert-parallel (EP) intranode dispatch / combine, emulated on CPU threads (docs/moe.md, "Expert
// parallel: the exchange protocol"). Each rank is a thread, "peer memory" is one host allocation per
// rank that every rank reads and writes, and every publication is a std::atomic_ref release store or
// release add read by acquire loads, at exactly the places where the CUDA version uses .sys-scope
// st.release / atom.add.release / ld.acquire. It is the protocol's executable specification and its
// test bed; nothing here runs on a GPU.
//
// Memory of rank r (EpGroup): world receive regions, region s written by sender s,
//   [dispatch flag u64 | combine flag u64 | counts[E_local] u64 | pad to 16 | tokens[E_local][max_tokens]]
// with a token row of round_up(H * dtype bytes + scale_bytes + 4, 16) bytes (payload, scales, int32
// source slot t * k + j); then r's combine area as the origin of its tokens:
//   [counters[max_tokens] u64 | rows[max_tokens * k] of round_up(H * dtype bytes, 16)].
// Every cell is 64-bit and epoch-tagged, {epoch << 32 | value}, published by one release store (or
// release add); epochs start at 1, so a zeroed buffer never matches. In region s of rank r:
//   dispatch flag {n | 1}        s has written all its rows and counts for r in round n
//   counts[le]   {n | count + 1} rows of local expert le from s (count + 1: 0 never means "arrived")
//   combine flag {n | 1}        s has consumed the dispatch r sent it and returned every output
// and counters[t] of rank r are armed to {n | 0} by r before it publishes round n, then incremented
// by each expert holder after writing token t's output row; r sums the token once the value is
// {n | k}. A rank waits for every peer's combine flag before its next dispatch, so it never overwrites
// a region its peer has not read.
//
// Ranks call dispatch, combine, dispatch, ... in lockstep. Every spin loop has a timeout and reports
// rank, cell, expected and seen value. Any error (bad shape, timeout) aborts the whole group: the peers
// stop waiting and fail with the first error's message, and every later call fails the same way (a
// group does not recover; the CUDA version traps).
#pragma once
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore::moe::ep {

struct EpConfig {
  int world = 1;                  // ranks; experts are split evenly: rank r owns [r * E_local, (r + 1) * E_local)
  int num_experts = 0;            // E, a multiple of world
  int top_k = 0;                  // k experts per token (distinct within a token)
  int64_t hidden = 0;             // H
  int64_t max_tokens = 0;         // tokens per rank and call, at most
  DType dtype = DType::kBF16;     // dispatched token rows (bf16, fp16, fp32, or fp8_e4m3 with its scales)
  int64_t scale_bytes = 0;        // per-token scale bytes moved with the row (0: none)
  std::chrono::milliseconds timeout{10000};  // every spin loop gives up after this
  std::optional<DType> combine_dtype;  // the combine's expert outputs (bf16, fp16, fp32); unset: dtype (fp8 rows need it)
};

Status validate(const EpConfig& c);
DType combine_dtype_of(const EpConfig& c);   // the expert outputs' dtype: dtype, or combine_dtype
size_t ep_token_stride(const EpConfig& c);   // bytes of a token row in a receive region
size_t ep_region_bytes(const EpConfig& c);   // one per-sender receive region
size_t ep_rank_bytes(const EpConfig& c);     // world regions + the combine area
size_t ep_region_header_bytes(const EpConfig& c);   // flags + counts, before a region's token rows
size_t ep_combine_header_bytes(const EpConfig& c);  // the combine counters, before the combine rows
size_t ep_combine_row_bytes(const EpConfig& c);     // one combine row (H * combine dtype bytes, to 16)

// The mapped peer memory of all ranks (on GPUs: cuMem allocations exported as POSIX FDs and mapped by
// every peer) and the group's abort cell.
class EpGroup {
 public:
  static Status create(const EpConfig& c, std::unique_ptr<EpGroup>* out);
  const EpConfig& config() const { return cfg_; }
  uint8_t* memory(int rank) { return mem_[size_t(rank)].get(); }

 private:
  friend class EpAllToAll;
  struct Free { void operator()(uint8_t* p) const; };
  EpConfig cfg_;
  std::vector<std::unique_ptr<uint8_t, Free>> mem_;
  std::atomic<uint64_t> abort_{0};      // {epoch << 32 | failing rank + 1}, 0 while healthy
  std::vector<std::string> messages_;   // [world]: written by its rank before its release CAS on abort_
};

// What a rank received in one dispatch, expert-contiguous: local expert le's rows are
// [offsets[le], offsets[le + 1]), ordered by (source rank, source token) (the stable slot order).
struct EpReceived {
  int first_expert = 0, local_experts = 0;
  std::vector<int32_t> counts;       // [E_local]
  std::vector<int32_t> offsets;      // [E_local + 1]
  std::vector<int32_t> counts_from;  // [world, E_local]: rows from each sender
  std::vector<int32_t> src_rank, src_token, src_k;  // per row: the origin (rank, token, k slot)
  std::vector<uint8_t> x;            // [rows, H] in the config's dtype
  std::vector<uint8_t> scales;       // [rows, scale_bytes]
  int64_t rows() const { return int64_t(src_rank.size()); }
};

// One rank's end of the all-to-all (pplx-kernels' AllToAll shape: built once, reused every layer call).
class EpAllToAll {
 public:
  static Status create(EpGroup* group, int rank, std::unique_ptr<EpAllToAll>* out);

  // x [m, H] (config dtype), topk_ids [m, k] int32 in [0, E), scales [m, scale_bytes] uint8 when
  // scale_bytes > 0 (else undefined); m in [0, max_tokens]. Fills `out` with this rank's rows.
  // = dispatch_send then dispatch_recv.
  Status dispatch(const TensorView& x, const TensorView& topk_ids, const TensorView& scales, EpReceived* out);
  // expert_out [rows, H] (combine dtype) in the order of the last dispatch's EpReceived; topk_weights
  // [m, k] fp32 and out [m, H] bf16/fp16/fp32 for this rank's m tokens of that dispatch:
  // out[t] = sum_{j = 0..k-1} w[t, j] * y(t, j), fp32, one fma per j in j order (the single-GPU
  // reference combine, so the result equals the single-GPU layer bit for bit). Every argument is
  // checked before anything is sent; = combine_send then combine_recv.
  Status combine(const TensorView& expert_out, const TensorView& topk_weights, const TensorView& out);

  // The two halves of each, for overlap (other work of the rank between a send and its receive):
  // dispatch_send writes this rank's rows into the owners' regions and publishes the counts;
  // dispatch_recv waits for every sender and fills `out`; combine_send returns the expert outputs to
  // their origins; combine_recv waits for this rank's tokens, sums them and waits for every peer to
  // have consumed this rank's rows. In that order, once each per round (else a clear error).
  Status dispatch_send(const TensorView& x, const TensorView& topk_ids, const TensorView& scales);
  Status dispatch_recv(EpReceived* out);
  Status combine_send(const TensorView& expert_out);
  Status combine_recv(const TensorView& topk_weights, const TensorView& out);

  int rank() const { return rank_; }
  uint32_t epoch() const { return epoch_; }

 private:
  EpAllToAll(EpGroup* g, int rank);
  uint8_t* region(int owner, int sender) const;  // owner's receive region written by sender
  uint64_t* counter(int owner, int64_t t) const;
  uint8_t* combine_row(int owner, int64_t slot) const;
  Status fail(const std::string& phase, Status s);  // records s, aborts the group, returns it prefixed
  Status aborted(const std::string& phase) const;   // ok while the group is healthy
  template <class Done, class Describe>
  Status spin(const std::string& phase, const uint64_t* cell, Done done, Describe describe);
  Status validate_dispatch(const TensorView& x, const TensorView& ids, const TensorView& scales) const;
  Status validate_combine_send(const TensorView& y) const;
  Status validate_combine_recv(const TensorView& w, const TensorView& out) const;

  EpGroup* g_;
  EpConfig cfg_;
  int rank_, e_local_;
  uint32_t epoch_ = 0;
  enum class Phase { kIdle, kSent, kReceived, kCombineSent };
  Phase phase_ = Phase::kIdle;  // where this rank is in the round
  int64_t m_ = 0;          // this rank's tokens in the current round
  std::vector<int32_t> recv_rank_, recv_slot_;  // the current round's rows: origin rank and slot t * k + j
};

}  // namespace encore::moe::ep
