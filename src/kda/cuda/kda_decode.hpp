// Host entry of the CUDA KDA decode kernel (kda_decode.cu; no CUDA types): the recurrent step of
// include/encore/kda_serving.hpp (fla-core 0.6.0's fused_recurrent_kda_fwd) over a state pool or
// per-sequence states. The dispatch (src/kda/kda_serving.cpp) has validated the arguments; sequences
// come from host-side cu_seqlens (or the fixed-length batch) and travel as launch parameters, index
// values stay in device memory and are read by the kernel: no host memory read, no synchronization,
// no allocation, so a launch is capturable in a CUDA graph.
#pragma once
#include <cstdint>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore::cuda {

constexpr int kKdaDecodeMaxHeadDim = 256;  // K and V
constexpr int kKdaDecodeSeqTable = 1024;   // varlen sequences per launch (the token table is a launch parameter)
constexpr int kKdaDecodeSeqTableSmall = 64;  // the table of launches with at most this many sequences (a smaller parameter)
// Resident blocks an SM the single-token kernels are built for (their launch bounds; the plan's waves and
// the prefetch distance): 32 columns a block with bf16 / fp32 states, 64 columns.
constexpr int kKdaDecodeResident32Bf16 = 8, kKdaDecodeResident32Fp32 = 5, kKdaDecodeResident64 = 4;
// The whole-head kernel's blocks an SM (its shared memory: the head's state and ~4.6 KB): bf16, fp32 states.
constexpr int kKdaDecodeResidentHeadsBf16 = 6, kKdaDecodeResidentHeadsFp32 = 3;

// [B, T, heads, C] (beta: [B, T, heads]) with element strides; the last stride is 1. bf16, fp16 or fp32.
struct KdaDecodeTensor {
  const void* data = nullptr;
  DType dtype = DType::kFP32;
  int64_t sb = 0, st = 0, sh = 0;
};

// The single-token kernels of a fast launch (K = V = 128, every sequence <= 1 token; kda/plan.hpp's
// kda_decode_plan chooses): a block per (sequence, head, 32 columns) or (.., 64 columns), load, compute,
// store, exit; or a block per (sequence, head) whose state moves between the pool and shared memory by
// one bulk copy each way (kda_decode_heads.cu). A launch whose states' 8-column accesses are not 16-byte
// aligned takes 32 columns.
enum class KdaDecodeKernel : int { kColumns32 = 0, kColumns64 = 1, kHeads = 2 };

// A launch's plan: the single-token kernel and whether the launch is a programmatic dependent launch
// (sm_90 PDL: its blocks may be scheduled while the stream's previous kernel drains; each block waits
// for that kernel's completion and memory before it reads anything, and lets the next PDL launch in
// once every block of this one has started).
// prefetch (the single-token kernels, [N] slots or rows without indices, 16-byte aligned states):
// each block also prefetches into L2 the state slice of the block one wave after it (blockIdx + SMs x
// resident blocks), so that block's loads find it there.
struct KdaDecodePlan {
  KdaDecodeKernel kernel = KdaDecodeKernel::kColumns32;
  bool pdl = false;
  bool prefetch = false;
};

// How sequence n finds its states (include/encore/kda_serving.hpp's three modes).
enum class KdaDecodeMode : int {
  kStates = 0,      // initial_state row n (or zeros) -> final_state row n (either may be absent; may be the same array)
  kSlots = 1,       // state_indices [N]: pool slot idx[n] read and written back
  kTokenSlots = 2,  // state_indices [N, S]: read slot idx[n, num_accepted_tokens[n] - 1], token t writes idx[n, t]
};

struct KdaDecodeParams {
  int N = 0;      // sequences of this launch: global sequences n0 .. n0 + N - 1
  int n0 = 0;
  int T = 0;      // tokens per batch row (fixed length; varlen: the table below)
  int H = 0;      // value heads (v, g, beta, o, states, A_log, dt_bias)
  int group = 1;  // value heads per q/k head
  int K = 0, V = 0;
  float scale = 1.f;
  bool l2norm = false, gate_in_kernel = false, lower_bound_gate = false, beta_sigmoid = false;
  float lower_bound = -5.f;
  float beta_scale = 1.f;  // beta = beta_scale * sigmoid(beta) with beta_sigmoid (2: allow_neg_eigval)
  KdaDecodeTensor q, k, v, g, beta;
  const float* A_log = nullptr;    // [H] or null
  const float* dt_bias = nullptr;  // [H * K] or null
  void* o = nullptr;               // [B, T, H, V], last stride 1
  DType o_dtype = DType::kFP32;
  int64_t o_sb = 0, o_st = 0, o_sh = 0;
  KdaDecodeMode mode = KdaDecodeMode::kStates;
  // States [rows, H, K, V], fp32 or bf16, each row's [H, K, V] contiguous at row * stride elements. With
  // indices both are the pool. *_vec: 4-column vector loads / stores are aligned (base, stride and V).
  const void* init = nullptr;
  DType init_dtype = DType::kFP32;
  int64_t init_stride = 0;
  bool init_vec = false;
  void* fin = nullptr;
  DType fin_dtype = DType::kFP32;
  int64_t fin_stride = 0;
  bool fin_vec = false;
  int64_t P = 0;  // pool slots (indices >= P are out of range)
  // fla's state_v_first: both are [rows, H, V, K] (element (k, v) at v K + k of its head's block); the
  // runtime-dtype kernel only (the compile-time kernels are not taken), scalar state accesses.
  bool state_v_first = false;
  // state_indices [N] or [N, S] and num_accepted_tokens [N] (optional), int32 or int64, device memory.
  const void* idx = nullptr;
  bool idx64 = false;
  int64_t idx_s0 = 0, idx_s1 = 0;
  int S = 1;
  const void* nat = nullptr;
  bool nat64 = false;
  int64_t nat_s0 = 0;
  // K = V = 128, q, k, v, g and beta of one dtype (bf16 or fp32), every vector access of them, of
  // dt_bias and of the states aligned (the states of one dtype): the compile-time kernels (o may be any
  // dtype and alignment: its stores check both).
  bool fast = false;
  bool states16 = false;  // the states' 8-column accesses are 16-byte aligned (base, slot stride, V): the 64-column kernels
  int sm_count = 0;       // the device's SMs (the prefetch distance)
  KdaDecodeKernel kernel = KdaDecodeKernel::kColumns32;  // the single-token kernel (fast launches, max_len <= 1)
  bool pdl = false;                                      // a programmatic dependent launch (KdaDecodePlan)
  bool prefetch = false;                                 // the L2 prefetch one wave ahead (KdaDecodePlan; needs states16)
  int max_len = 0;      // the most tokens of one sequence in this launch (<= 1: the single-token kernels)
  bool varlen = false;  // batch row 0, tokens [begin[i], begin[i + 1]) for sequence n0 + i; else row n, tokens [0, T)
};

// One launch over the N sequences of `p` (none: nothing launched). begin: varlen, the N + 1 token offsets of
// its sequences in host memory (N <= kKdaDecodeSeqTable; they travel as a launch parameter sized to N); fixed
// length: null. Asynchronous on `stream`.
Status launch_kda_decode(const KdaDecodeParams& p, const int32_t* begin, int device, Stream stream);

// Whether a launch can take the 64-column or whole-head single-token kernels (launch_kda_decode routes it
// there when p.kernel names one): a fast launch (K = V = 128, aligned inputs of one dtype, not
// state_v_first) of sequences with at most one token, 16-byte aligned states of one dtype.
inline bool kda_decode_wide_kernels_apply(const KdaDecodeParams& p) {
  const bool same = p.mode != KdaDecodeMode::kStates || !p.init || !p.fin || p.init_dtype == p.fin_dtype;
  return p.fast && !p.state_v_first && p.states16 && same && p.max_len <= 1;
}

// The whole-head kernel (kda_decode_heads.cu) on the current device, for a launch where
// kda_decode_wide_kernels_apply holds (else Status::invalid).
Status launch_kda_decode_heads(const KdaDecodeParams& p, const int32_t* begin, Stream stream);

}  // namespace encore::cuda
