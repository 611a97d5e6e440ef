// encore KDA family: Kimi Delta Attention (per-channel gated delta rule), following the widely
// used chunk_kda contract (fla's chunk_kda: the same tensors, gates and options; docs/kda.md).
//
//   per sequence and head, state S_t in R^{K x V}:
//     Sbar_t = Diag(exp g_t) S_{t-1};  e_t = v_t - Sbar_t^T k_t;  S_t = Sbar_t + beta_t k_t e_t^T
//     o_t = scale * S_t^T q_t        (the updated state: token t sees its own write)
//
// Tensors: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; initial_state
// [N, HV, K, V] fp32; cu_seqlens [N + 1] int32/int64 (varlen, B = 1); o [B, T, HV, V]; final_state
// [N, HV, K, V] fp32. HV, the value heads, is a multiple of H (grouped value heads, fla's GVA; HV = H
// the plain case): value head h reads q/k head h / (HV / H); every other tensor is per value head.
// g is the log-decay (natural log, <= 0), or, with use_gate_in_kernel, the raw gate x:
//   softplus:     g = -exp(A_log[h]) * softplus(x + dt_bias[h, k])     (A_log [HV], dt_bias [HV * K])
//   lower bound:  g = lower_bound * sigmoid(exp(A_log[h]) * (x + dt_bias[h, k]))   (A_log optional)
// use_qk_l2norm: q and k are divided by sqrt(sum_k x^2 + 1e-6) per head first.
//
// Backends: the CPU reference (fp64 arithmetic on any float input; fp64 tensors are accepted too,
// for finite-difference tests). CUDA forward (src/kda/cuda/, tensor cores: bf16 operands, fp32
// accumulation and state; relative RMS error ~3e-3 against fp64 in the contractive regime
// β|k|² < 2, docs/kda.md): bf16/fp16/fp32 q, k, v, g, beta, o (fp16 converted on load); K, V <= 128 on
// the chunked tensor-core kernels, K or V in (128, 256] on a token-recurrent fp32 path (docs/kda.md
// "Large head dims"; its forward needs no workspace), > 256 refused; fp32 contiguous
// initial/final state, A_log, dt_bias; cu_seqlens on the host (<= 1024 sequences), as for the CPU
// backend; needs workspace_bytes(args, opts) bytes of device workspace (96.5 KB + 8 bytes per chunk of 64
// tokens and head).
// Backward: CPU (the chunked backward reading the forward's residuals when given, else the token-level
// BPTT) and CUDA (deterministic; K, V <= 128: the chunked backwards on tensor cores, the second
// (kda_bwd2*.cu) for bf16 inputs and for fp16 inputs with saved states, the first (kda_backward.cu)
// otherwise; K or V > 128: the token-level BPTT by windows, kda_recurrent_bwd.cu, reading h at most).
// The first CUDA backward needs the forward's residuals Aqk, Akk; the second re-runs the forward inside
// the backward for whichever of Aqk, Akk and h is absent, writing them into the workspace (bf16 inputs
// with none of them saved: chunk_kda's default, nothing kept but the inputs); G is recomputed from g when
// absent; without h the first backward rematerializes the chunk-start states by its fp32 recurrence. They
// take bf16/fp16/fp32 q, k, v, g, beta, d_o and gradients (residuals bf16/fp32), fp32 contiguous
// states, A_log, dt_bias and their gradients, and workspace_bytes(args, opts) bytes of device
// workspace (per chunk of 64 tokens and value head at K = V = 128: the second backward 218 KB with
// saved h, 282 KB rematerializing without G, 298 KB rematerializing Aqk and Akk too; the first 274 KB
// saved-h, 338 KB rematerializing; 32 KB more where G is recomputed with saved h or in the first; with
// HV > H the first also 8 · K bytes per token and value head of dq, dk partials). dq, dk are the sums over each q/k head's value heads, in a fixed
// order (deterministic).
#pragma once
#include <cstddef>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore {

struct KdaOptions {
  double scale = 0.0;               // <= 0: K^-1/2
  bool output_final_state = false;
  bool use_qk_l2norm = false;
  bool use_gate_in_kernel = false;
  bool use_lower_bound = false;     // with use_gate_in_kernel: the lower-bound gate
  double lower_bound = -5.0;        // in [-5, 0)
  // fla's state_v_first: initial_state, final_state, d_final_state and dh0 are [N, HV, V, K] (each
  // state stored transposed, S^T; the math is unchanged). The residuals' h stays [NT, HV, K, V].
  bool state_v_first = false;
};

// What the forward saves for a chunked backward (docs/kda.md, "Residuals for the backward"), all optional:
// (per value head: HV heads)
//   G    [B, T, HV, K] fp32: the chunk-local inclusive cumsum of the activated gate, in log2;
//   Aqk  [B, T, HV, 64]: row t holds Aqk[t, j] for the rows j of t's chunk (scale included, 0 for j > t);
//   Akk  [B, T, HV, 64]: the rows of A = (I + L)^-1 (unit lower triangular);
//   h    [NT, HV, K, V]: the chunk-start states, chunks of all sequences in order (NT =
//        kda_chunk_count); given = the saved-h mode, absent = the rematerialize mode.
// Aqk, Akk, h take bf16 or fp32 (or fp64 on the CPU backend); on CUDA contiguous and in one dtype.
struct KdaResiduals {
  TensorView G, Aqk, Akk, h;
  bool any() const { return G.defined() || Aqk.defined() || Akk.defined() || h.defined(); }
};

struct KdaForwardArgs {
  TensorView q, k, v, g, beta;
  TensorView initial_state;  // optional
  TensorView A_log;          // [HV] fp32; required for the softplus gate, optional for the lower bound
  TensorView dt_bias;        // optional [HV * K] fp32
  TensorView cu_seqlens;     // optional [N + 1]
  TensorView o;              // output [B, T, HV, V]
  TensorView final_state;    // output [N, HV, K, V] when output_final_state
  KdaResiduals residuals;    // optional outputs for the backward
};

// Chunks of 64 rows over all sequences (each sequence starts a new chunk): NT of KdaResiduals::h.
Status kda_chunk_count(const KdaForwardArgs& args, const KdaOptions& opts, int64_t* chunks);

Status validate(const KdaForwardArgs& args, const KdaOptions& opts);
size_t workspace_bytes(const KdaForwardArgs& args, const KdaOptions& opts);
Status run(const KdaForwardArgs& args, const KdaOptions& opts, void* workspace = nullptr, Stream stream = nullptr);

// Gradients of loss = sum(o * d_o) + sum(final_state * d_final_state), on the tensors' device. dg is with respect to the g that was passed in (raw gate with
// use_gate_in_kernel); dq, dk with respect to q, k before the L2 norm.
struct KdaBackwardArgs {
  KdaForwardArgs fwd;          // the forward's inputs (its o and final_state are not read)
  TensorView d_o;              // [B, T, HV, V]
  TensorView d_final_state;    // optional [N, HV, K, V]
  TensorView dq, dk, dv, dg, dbeta;  // outputs, shaped like q, k, v, g, beta (dq, dk: summed over each group)
  TensorView dh0;              // output [N, HV, K, V] when initial_state is given (optional)
  TensorView dA_log;           // output [HV] when A_log is given (optional)
  TensorView ddt_bias;         // output [HV * K] when dt_bias is given (optional)
};

Status validate(const KdaBackwardArgs& args, const KdaOptions& opts);
// Device workspace of the CUDA backward (0 on the CPU backend or for arguments that do not validate).
size_t workspace_bytes(const KdaBackwardArgs& args, const KdaOptions& opts);
// CPU: workspace and stream unused. CUDA: never allocates or synchronizes; `workspace` 16-byte aligned.
Status run(const KdaBackwardArgs& args, const KdaOptions& opts, void* workspace = nullptr, Stream stream = nullptr);

}  // namespace encore
