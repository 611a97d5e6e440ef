// Host entry of the CUDA KDA forward (no CUDA types). The dispatch (src/kda/kda.cpp) has validated
// the problem and chosen the launch plan (kda/plan.hpp); sequences come from host-side cu_seqlens (or
// the fixed-length batch) and travel to the kernels as launch parameters, so a launch reads no host
// memory and never synchronizes. Also the chunk kernel's raw-input report and phase profile (tests and
// benchmarks, through kda/testing.hpp). The same launches run the prefill on a state pool
// (include/encore/kda_serving.hpp's KdaPoolForwardArgs): the pool fields of KdaCudaProblemT, read by
// the state kernel only.
#pragma once
#include <cstddef>
#include <cstdint>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "kda/plan.hpp"

namespace encore::cuda {

constexpr int kKdaMaxSeqs = 1024;    // sequences per launch (the table is a launch parameter)
// A launch of at most this many sequences carries tables of this capacity (~1 KB of parameters
// instead of ~16 KB: a launch's host cost grows with its parameter bytes).
constexpr int kKdaFewSeqs = 64;
constexpr int kKdaMaxHeadDim = 128;  // K and V of the chunked (tensor-core) path on CUDA
constexpr int kKdaRecurrentMaxHeadDim = 256;  // K and V of the token-recurrent path (kda_recurrent.cu)
// Problems with K or V above kKdaMaxHeadDim take the token-recurrent path.
constexpr bool kda_use_recurrent(int64_t K, int64_t V) { return K > kKdaMaxHeadDim || V > kKdaMaxHeadDim; }

struct KdaTensor {  // [B, T, H, C] (or [B, T, H] with C = 1): element strides; dtype bf16 or fp32
  const void* data = nullptr;
  DType dtype = DType::kFP32;
  int64_t sb = 0, st = 0, sh = 0;
};

template <int kSeqs>
struct KdaCudaProblemT {
  static constexpr int kCapacity = kSeqs;
  int B = 0, T = 0, H = 0, K = 0, V = 0, N = 0;  // H: value heads (v, g, beta, o, states, residuals)
  int group = 1;                                 // value heads per q/k head: q, k have H / group heads
  float scale = 1.0f;
  bool l2norm = false, gate_in_kernel = false, lower_bound_gate = false;
  float lower_bound = -5.0f;
  KdaTensor q, k, v, g, beta;
  const float* A_log = nullptr;    // [H] fp32 or null
  const float* dt_bias = nullptr;  // [H * K] fp32 or null
  const float* h0 = nullptr;       // [N, H, K, V] fp32 contiguous or null
  void* o = nullptr;               // [B, T, H, V], dtype o_dtype, strides like KdaTensor
  DType o_dtype = DType::kFP32;
  int64_t o_sb = 0, o_st = 0, o_sh = 0;
  float* final_state = nullptr;    // [N, H, K, V] fp32 contiguous or null
  // fla's state_v_first: h0, final_state and the pool's slots are [.., H, V, K] (state element (k, v) at
  // v K + k of its head's block instead of k V + v); the state kernel's loads and stores only.
  bool state_v_first = false;
  // Residuals for the backward (contiguous; null = not saved): G fp32 [B, T, H, K]; Aqk, Akk
  // [B, T, H, 64] and h [NT, H, K, V] in res_dtype (bf16 or fp32).
  float* res_G = nullptr;
  void* res_Aqk = nullptr;
  void* res_Akk = nullptr;
  void* res_h = nullptr;
  DType res_dtype = DType::kFP32;
  // The prefill on a state pool (null pool: h0 / final_state above, which are then null): sequence n
  // starts from slot idx[n] of pool [P, H, K, V] (fp32 or bf16; each slot's [H, K, V] contiguous at
  // slot * pool_stride elements) and its final state is written back there in the pool's dtype. idx:
  // int32 / int64 in device memory (element stride pool_idx_stride), read once per state-kernel block
  // (no host read, no sync). The device contract (kda_state.cu): idx < 0 is padding (o rows 0), idx >= P
  // an error shown as NaN o rows; either way nothing of the pool is read or written; a sequence with no
  // tokens reads nothing (not even its index) and writes nothing.
  void* pool = nullptr;
  DType pool_dtype = DType::kFP32;
  int64_t pool_stride = 0, pool_slots = 0;
  const void* pool_idx = nullptr;
  int64_t pool_idx_stride = 1;
  bool pool_idx64 = false;
  bool varlen = false;             // sequence n is in batch row 0 (varlen) or n (fixed length)
  int32_t seq_begin[kSeqs];  // tokens [begin, end) of sequence n
  int32_t seq_end[kSeqs];
  int32_t chunk_start[kSeqs + 1];  // first chunk slot of sequence n; [N] = total chunks
  // Sequences by chunk count, longest first (ties in index order): the state kernel's blocks start
  // in this order, so the longest serial passes never wait for a free SM behind short ones.
  int32_t seq_by_length[kSeqs];
  int device = 0;
  // Filled by launch_kda_forward: the chunk kernel's TMA descriptors (CUtensorMap, 128 bytes each) of
  // q, k, g, v as [B, T, H, C] bf16 tensors with boxes of 64 channels x 64 tokens, and the inputs
  // that have one (bit t; the others are read from global memory by the threads).
  alignas(128) unsigned char tmap[4][128];
  int raw_fast = 0;
};
using KdaCudaProblem = KdaCudaProblemT<kKdaMaxSeqs>;     // any launch
using KdaCudaProblemFew = KdaCudaProblemT<kKdaFewSeqs>;  // launches of <= kKdaFewSeqs sequences

// Workspace of the forward: one record per (chunk, head) with the head dims padded to 128
// (kda_device.cuh's WsLayout, 96.5 KB), then one 8-byte flag per (chunk, head) (the one-launch kernel's),
// so it depends on the chunk and head counts only.
size_t kda_forward_workspace_bytes(int64_t chunks, int64_t H);
// The chunked forward on `plan` (resolved: state_columns 16, 32 or 64, chunk_blocks >= 1; others are
// refused). Fills p.tmap, p.raw_fast.
template <class P>  // KdaCudaProblem or KdaCudaProblemFew (instantiated for both)
Status launch_kda_forward(P& p, const ::encore::kda::KdaLaunchPlan& plan, void* workspace, Stream stream);
// The token-recurrent forward for large head dims (kda_recurrent.cu; no workspace): o, the final state,
// residuals.h from the recurrence, G, Aqk, Akk by a per-(chunk, head) kernel. No pool (Status::internal
// with p.pool set: the serving dispatch runs the prefill on a pool at these sizes on the decode kernel).
Status launch_kda_recurrent_forward(const KdaCudaProblem& p, Stream stream);

// The chunk kernel's hooks for tests and benchmarks (kda_chunk.cu). Process-wide; not for concurrent use.
// Phase profile (bench suite kda_phases only): while enabled, thread 0 of every block adds the
// clock64() cycles of each barrier-separated phase to device counters (the phases: kda/testing.hpp);
// read() returns the sums and the number of items and resets them. Off, the kernel only tests the switch.
constexpr int kKdaChunkPhases = 8;
Status kda_chunk_profile_enable(bool on);
Status kda_chunk_profile_read(unsigned long long cycles[kKdaChunkPhases], unsigned long long* blocks);
// Which inputs the last chunk kernel read as raw TMA tiles (bit t: q, k, g, v; 0 for all where a
// block's shared memory was not 1024-byte aligned since the previous call, which resets that).
// Synchronizes.
Status kda_chunk_raw_inputs(int* mask);
// The kernels the last chunked forward with chunks launched: 1 (kda_one_launch_kernel) or 2 (the chunk, then
// the state kernel); 0 before any.
int kda_forward_launches();

}  // namespace encore::cuda
