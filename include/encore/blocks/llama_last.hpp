// encore LLaMA last layer + loss (docs/math/gemm_epilogues.md §5 "Last layer + loss"; docs/blocks.md):
// the shifted block's steps 1-3 with the final norm's γ in step 3, then the LM head and the mean
// cross-entropy:
//
//   1  x1 = y0·w0ᵀ + x0,  h1 = x1 ⊙ γ0,  r1                                    residual_sqsum_aux + rms_final_reduce
//   2  z1 = r1 ⊙ (h1·w1ᵀ) [M, 2F],  y1 = silu(gate)·up                          swiglu
//   3  x2 = y1·w2ᵀ + x1,  h2 = x2 ⊙ γf,  r2                                    residual_sqsum_aux + rms_final_reduce
//   4  logits z = r2 ⊙ (h2·W_lmᵀ) [M, V] (never stored): per-tile log-sum-exp, z[m, target[m]]   lse
//      lse[m], loss_m = lse − z_target (lse_finish);  loss = Σ loss_m / n over the n rows whose target
//      is not ignore_index, 0 when n = 0 (ce_mean)
//
// The backward, from d_loss (the gradient of the mean loss, a device scalar like every α):
//      α = d_loss / n (ce_mean);  dℓ = α·(softmax(z) − onehot) [M, V] with z recomputed (ce_bwd), rows of
//      round_up(V, 8) in the workspace, and per (row, 128 columns) Σ z·dℓ;  zdz = (1/d)·Σ_t
//      rmsnorm_bwd(dℓ, W_lm, x2, γf, r2, zdz)   dx at x2, h = x̂2⊙γf, dγf partials;  wgrad dW_lm = dℓᵀ·h
//      then stages (b), (c), (d) of llama_block_backward (encore/blocks/llama.hpp).
// Saved by the forward for the backward: x1, x2, z1, h2, r1, r2, lse (outputs); h2 is the LM head's
// input, so the backward's logits are the forward's GEMM again. Every matrix in y0's dtype (bf16/fp16;
// also fp32 on the CPU backend); r1, r2, lse, loss, d_loss, dgamma0, dgamma_final fp32; target int32.
// The CPU backend refuses a target outside [0, V) other than ignore_index (validate); on CUDA (device
// data) such a row gives NaN. CUDA limits: those of the GEMM epilogues (encore/gemm.hpp): d, F multiples
// of 8, 16-byte aligned rows; V and M any. A limit is refused by the step that meets it (a Status
// naming the step; earlier steps have run). run() neither allocates nor synchronizes.
#pragma once
#include <cstddef>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore {

struct LlamaLastBlockArgs {
  // inputs
  TensorView y0;           // [M, d] attention output of the last layer
  TensorView x0;           // [M, d] residual stream into it
  TensorView w0;           // [d, d] o-proj
  TensorView w1;           // [2F, d] gate/up, rows interleaved (interleave_gate_up)
  TensorView w2;           // [d, F] down-proj
  TensorView gamma0;       // [d] the layer's ffn_norm
  TensorView gamma_final;  // [d] the final norm
  TensorView w_lm;         // [V, d] LM head
  TensorView target;       // [M] int32 class indices (ignore_index: the row counts nothing)
  // outputs
  TensorView x1, x2;  // [M, d]
  TensorView z1;      // [M, 2F]
  TensorView h2;      // [M, d] x2 ⊙ γf, the LM head's input
  TensorView r1, r2;  // [M] fp32
  TensorView lse;     // [M] fp32 log-sum-exp of the logits
  TensorView loss;    // [1] fp32 mean over the rows whose target is not ignore_index (0 when none)
};

struct LlamaLastBlockOptions {
  float eps = 1e-5f;
  int ignore_index = -100;
};

Status validate(const LlamaLastBlockArgs& args, const LlamaLastBlockOptions& opts);
// h1, y1, the partials, the target logits and per-row losses; 0 when invalid.
size_t workspace_bytes(const LlamaLastBlockArgs& args, const LlamaLastBlockOptions& opts);
// workspace: workspace_bytes(args, opts) bytes on the tensors' device (host memory for CPU tensors),
// 256-byte aligned. Launches 8 kernels on `stream` (CUDA; the LM-head GEMM may run in N-slices, encore/gemm.hpp);
// no allocation, no synchronization.
Status run(const LlamaLastBlockArgs& args, const LlamaLastBlockOptions& opts, void* workspace, Stream stream = nullptr);

struct LlamaLastBlockBwdArgs {
  // the forward's inputs (x0 is not needed)
  TensorView y0;           // [M, d]
  TensorView w0;           // [d, d]
  TensorView w1;           // [2F, d]
  TensorView w2;           // [d, F]
  TensorView gamma0;       // [d]
  TensorView gamma_final;  // [d]
  TensorView w_lm;         // [V, d]
  TensorView target;       // [M] int32
  // the forward's saved outputs
  TensorView x1, x2;  // [M, d]
  TensorView z1;      // [M, 2F]
  TensorView h2;      // [M, d]
  TensorView r1, r2;  // [M] fp32
  TensorView lse;     // [M] fp32
  // incoming gradient
  TensorView d_loss;  // [1] fp32 (device memory on CUDA)
  // outputs
  TensorView d_y0;          // [M, d] to the attention backward
  TensorView d_x0;          // [M, d] the residual gradient into the layer
  TensorView dw0;           // [d, d]
  TensorView dw1;           // [2F, d]
  TensorView dw2;           // [d, F]
  TensorView dw_lm;         // [V, d]
  TensorView dgamma0;       // [d] fp32
  TensorView dgamma_final;  // [d] fp32
};

struct LlamaLastBlockBwdOptions {
  int ignore_index = -100;
};

// Shapes (a saved tensor of another forward fails here), dtypes, devices, overlaps (no output may overlap
// an input or another output), the CPU targets.
Status validate(const LlamaLastBlockBwdArgs& args, const LlamaLastBlockBwdOptions& opts = {});
// α, dℓ (rows of round_up(V, 8)), its zdz partials and zdz, dx, h, and stages (b)-(d)'s; 0 when invalid.
size_t workspace_bytes(const LlamaLastBlockBwdArgs& args, const LlamaLastBlockBwdOptions& opts = {});
// workspace: workspace_bytes(args, opts) bytes on the tensors' device, 256-byte aligned. Launches 14
// kernels on `stream` (CUDA); no allocation, no synchronization. Deterministic.
Status run(const LlamaLastBlockBwdArgs& args, const LlamaLastBlockBwdOptions& opts, void* workspace, Stream stream = nullptr);

}  // namespace encore
