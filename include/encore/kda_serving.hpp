// encore KDA for serving engines (docs/kda_serving.md): the recurrent (decode) step over a pool of
// per-request states, with continuous batching and speculative tokens (fla-core 0.6.0's
// fused_recurrent_kda_fwd), and the chunked prefill that reads and writes the same pool in place.
//
// The state pool: `pool` [P, HV, K, V] fp32 or bf16 (fp64 too on the CPU backend), one slot per
// request, each slot's [HV, K, V] contiguous (the slot stride, stride(0), at least HV * K * V: a pool
// may be a view into a larger cache). A call names the slots of its N sequences by index; an index
// < 0 is a padding sequence: it reads and writes nothing in the pool and its outputs are zero. The
// slots a call touches (the non-negative indices it uses) are distinct; every other slot is left
// bit-identical. Indices out of [0, P) and duplicates are refused before anything is written where the
// indices are in host memory (the CPU backend).
//
// Backends: the CPU reference (fp64 arithmetic, the token recurrence of include/encore/kda.hpp; the
// pool is read once per sequence and written in its dtype). CUDA (the recurrent step;
// docs/kda_serving.md): the decode kernels (src/kda/cuda/kda_decode.cu, kda_decode_heads.cu): a block
// per (sequence, value head, 32 or 64 value columns) holding its state slice in registers, or per
// (sequence, value head) staging the whole state in shared memory, read once from the pool and written once;
// bf16 / fp16 / fp32 q, k, v, g, beta, o; fp32 or bf16 states; fp32 A_log, dt_bias; K, V <= 256. No
// workspace, allocation or synchronization: capturable in a CUDA graph. The indices must be in q's
// device memory (host-memory indices are refused); their values are not checked on the host: a
// sequence whose start or per-token index is >= P or whose num_accepted_tokens is outside [1, S]
// writes nothing to the pool and gets NaN rows in o; duplicate slots are the caller's contract (not
// checked). cu_seqlens is host memory. The chunked prefill on the pool: the CUDA forward of kda.hpp
// (chunk and state kernels; workspace_bytes as the forward's) whose state kernel reads each sequence's
// initial state from its slot and writes the final state back there (no gather / scatter copies), with
// the same device index contract; K or V > 128: the decode kernel over the sequence's tokens (no
// workspace; o with a unit last stride). fp32 / bf16 pools, indices in q's device memory; no allocation
// or synchronization in run().
#pragma once
#include <cstddef>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "encore/kda.hpp"

namespace encore {

// The gate and normalization options of the recurrent step (fla's in-kernel options).
struct KdaRecurrentOptions {
  double scale = 0.0;              // <= 0: K^-1/2
  bool use_qk_l2norm = false;
  bool use_gate_in_kernel = false;
  bool use_lower_bound = false;    // with use_gate_in_kernel: the lower-bound gate
  double lower_bound = -5.0;       // in [-5, 0)
  bool use_beta_sigmoid = false;   // beta = sigmoid(beta as passed)
  bool allow_neg_eigval = false;   // with use_beta_sigmoid: beta = 2 sigmoid(beta) (in (0, 2))
  // fla's state_v_first: initial_state, final_state and the pool are [N or P, HV, V, K] (each state
  // stored transposed, S^T; each slot's [HV, V, K] contiguous). The math is unchanged.
  bool state_v_first = false;
};

// The recurrent step (fla's fused_recurrent_kda_fwd): per sequence n and value head, the token
// recurrence of kda.hpp over its T_n tokens (1 to a few when decoding; any length is accepted).
//   q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; A_log, dt_bias as for the
//   forward; cu_seqlens optional [N + 1] (B = 1, host memory), else N = B sequences of T tokens.
// States, three modes:
//   - no state_indices: initial_state optional [N, HV, K, V] (absent: zeros); final_state optional
//     [N, HV, K, V] output; final_state may be initial_state itself (fla's inplace_final_state).
//   - state_indices [N] (continuous batching): initial_state is the pool; sequence n starts from slot
//     state_indices[n] and its state after its last token is written back there; final_state absent.
//   - state_indices [N, S] (speculative decoding, one slot per token, T_n <= S): sequence n starts
//     from slot state_indices[n, num_accepted_tokens[n] - 1] (column 0 without num_accepted_tokens)
//     and the state after its token t is written to slot state_indices[n, t] (skipped where < 0);
//     num_accepted_tokens optional [N], each in [1, S]. The sequence is padding when its start index
//     is < 0. A sequence with no tokens reads and writes nothing.
// o [B, T, HV, V] output (rows of padding sequences zero). No workspace.
struct KdaRecurrentArgs {
  TensorView q, k, v, g, beta;
  TensorView A_log;                // [HV] (softplus gate; optional for the lower bound)
  TensorView dt_bias;              // optional [HV * K]
  TensorView cu_seqlens;           // optional [N + 1] int32/int64, host memory
  TensorView initial_state;        // optional [N, HV, K, V]; with state_indices the pool [P, HV, K, V]
  TensorView state_indices;        // optional [N] or [N, S] int32/int64
  TensorView num_accepted_tokens;  // optional [N] int32/int64, with [N, S] state_indices
  TensorView o;                    // output [B, T, HV, V]
  TensorView final_state;          // optional output [N, HV, K, V] (no state_indices)
};

Status validate(const KdaRecurrentArgs& args, const KdaRecurrentOptions& opts);
size_t workspace_bytes(const KdaRecurrentArgs& args, const KdaRecurrentOptions& opts);  // 0
// CPU: the reference. CUDA: the decode kernel, asynchronous on `stream` (workspace unused).
Status run(const KdaRecurrentArgs& args, const KdaRecurrentOptions& opts, void* workspace = nullptr, Stream stream = nullptr);

// The chunked prefill on the pool (chunk_kda's forward, inference): sequence n starts from slot
// state_indices[n] of `pool` and its final state is written back there, in place (< 0: padding, o
// rows zero). fwd holds q ... o, A_log, dt_bias, cu_seqlens as for run(KdaForwardArgs); its
// initial_state, final_state and residuals are absent; opts.output_final_state is not read.
struct KdaPoolForwardArgs {
  KdaForwardArgs fwd;
  TensorView pool;           // [P, HV, K, V] ([P, HV, V, K] with opts.state_v_first), read and written in place
  TensorView state_indices;  // [N] int32/int64
};

Status validate(const KdaPoolForwardArgs& args, const KdaOptions& opts);
// The CUDA forward's workspace (workspace_bytes(args.fwd, opts): one record per (chunk, value head));
// 0 for the CPU backend and for K or V > 128.
size_t workspace_bytes(const KdaPoolForwardArgs& args, const KdaOptions& opts);
// CPU: the reference. CUDA: the chunked forward with the pool in its state kernel (K, V <= 128; above, the
// decode kernel), asynchronous on `stream`; `workspace` 16-byte aligned device memory of
// workspace_bytes(args, opts) bytes (null when that is 0).
Status run(const KdaPoolForwardArgs& args, const KdaOptions& opts, void* workspace = nullptr, Stream stream = nullptr);

}  // namespace encore
