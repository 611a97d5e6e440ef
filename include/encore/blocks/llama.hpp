// encore LLaMA block forward on GEMM epilogues (docs/blocks.md): the *shifted* block, from the
// attention output projection of layer l to the QKV projection of layer l+1, as 4 GEMM-epilogue
// kernels and 2 finishers:
//
//   1  x1 = y0·w0ᵀ + x0,  h1 = x1 ⊙ γ0,  r1 = rsqrt(mean(x1²) + eps)        residual_sqsum_aux + rms_final_reduce
//   2  z1 = r1 ⊙ (h1·w1ᵀ) [M, 2F] (gate/up interleaved),  y1 = silu(gate)·up [M, F]          swiglu
//   3  x2 = y1·w2ᵀ + x1,  h2 = x2 ⊙ γ1,  r2                                 residual_sqsum_aux + rms_final_reduce
//   4  qkv = RoPE(r2 ⊙ (h2·w3ᵀ)) with positions pos and frequencies freq     rope
//
// which equals the textbook block  x1 = o-proj + x0;  z1 = rmsnorm(x1)·γ0 @ w1;  y1 = swiglu(z1);
// x2 = down-proj + x1;  qkv = RoPE(rmsnorm(x2)·γ1 @ w3)  (the deferred row-scale identity).
// Saved for the backward: x1, x2, z1, qkv, r1, r2 (outputs). h1, y1, h2 and the partials live in
// the workspace. Every tensor in A's dtype (bf16/fp16; fp32 on the CPU backend) except r1, r2
// (fp32), pos (int32), freq (fp32 (hi, lo) pairs, see rope_freq_turns). Same backend rules as
// encore/gemm.hpp (all tensors on one device).
#pragma once
#include <cstddef>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore {

struct LlamaBlockArgs {
  // inputs
  TensorView y0;      // [M, d] attention output of layer l
  TensorView x0;      // [M, d] residual stream into the block
  TensorView w0;      // [d, d] o-proj
  TensorView w1;      // [2F, d] gate/up, rows interleaved (interleave_gate_up)
  TensorView w2;      // [d, F] down-proj
  TensorView w3;      // [Nqkv, d] next layer's fused QKV
  TensorView gamma0;  // [d] this layer's ffn_norm
  TensorView gamma1;  // [d] next layer's attention_norm
  TensorView pos;     // [M] int32
  TensorView freq;    // [Nqkv] fp32
  // outputs
  TensorView x1, x2;  // [M, d]
  TensorView z1;      // [M, 2F]
  TensorView qkv;     // [M, Nqkv]
  TensorView r1, r2;  // [M] fp32
};

struct LlamaBlockOptions {
  float eps = 1e-5f;
};

Status validate(const LlamaBlockArgs& args, const LlamaBlockOptions& opts);
// h1, y1, h2 (A's dtype) and the two partials buffers, on the tensors' device.
size_t workspace_bytes(const LlamaBlockArgs& args, const LlamaBlockOptions& opts);
// workspace: workspace_bytes(args, opts) bytes on the tensors' device (host memory for CPU tensors),
// 256-byte aligned. Launches 6 kernels on `stream` (CUDA); no allocation, no synchronization.
Status run(const LlamaBlockArgs& args, const LlamaBlockOptions& opts, void* workspace, Stream stream = nullptr);
// One step of run() alone (step 0-3 as numbered 1-4 above, with its rms_final_reduce), over the
// same workspace; running steps 0, 1, 2, 3 in order is run(). For timing the steps one by one.
Status run_step(const LlamaBlockArgs& args, const LlamaBlockOptions& opts, void* workspace, int step, Stream stream = nullptr);

// ---- backward (docs/math/gemm_epilogues.md §5; docs/blocks.md "Backward") ---------------------------
//
// llama_block_backward: the shifted block's backward from the gradients arriving at its two outputs,
// d_qkv (from the attention of layer l+1) and d_x2 (the residual gradient from block l+1), as 4
// fused kernels, 5 plain GEMMs and 3 partials sums (x̂ = r·x, zdz[m] = (1/d)·Σ_j z·dz):
//   (a) rope_bwd_zdz(qkv, d_qkv)                       dz2 = Rᵀ·d_qkv, zdz2
//       rmsnorm_bwd(dz2, w3, x2, c2 = d_x2, γ1, r2)     dx = grad at x2, h2 = x̂2⊙γ1, dγ1 partials
//       wgrad dw3 = dz2ᵀ·h2;  dγ1 = Σ partials
//   (b) swiglu_bwd(dx, w2, z1)                          dz1 [M, 2F] (pairs like z1), y1 recomputed, zdz1 partials
//       zdz1 = (1/d)·Σ partials;  wgrad dw2 = dxᵀ·y1
//   (c) rmsnorm_bwd(dz1, w1, x1, c2 = dx, γ0, r1)       d_x0 = dx1 = grad at x1, h1 = x̂1⊙γ0, dγ0 partials
//       wgrad dw1 = dz1ᵀ·h1;  dγ0 = Σ partials
//   (d) dgrad d_y0 = d_x0·w0;  wgrad dw0 = d_x0ᵀ·y0     (x0 reaches x1 through the residual: d_x0 = dx1)
// Inputs: the forward's (LlamaBlockArgs: y0, weights, γ, pos, freq; x0 is not read) and its saved
// outputs x1, x2, z1, qkv, r1, r2, unchanged. Every matrix in y0's dtype (bf16/fp16 on CUDA; also fp32
// on the CPU backend); r1, r2, dgamma0, dgamma1 fp32; the weight gradients in the weights' shapes.
// d_x0 may be the very tensor d_x2 (same data, shape and strides: the residual gradient updated in
// place; d_x2 is read by stage (a) only); no other output may overlap an input or another output.
// dz2, dx, dz1, y1, h1/h2, zdz and the partials live in the workspace. CUDA limits: those of the
// GEMM epilogues (encore/gemm.hpp): d, F, Nqkv multiples of 8, 16-byte aligned rows; M any. validate()
// checks shapes, dtypes, devices and overlaps; a CUDA limit is refused by the step that meets it
// (a Status error naming the stage; earlier steps have run).
struct LlamaBlockBwdArgs {
  // the forward's inputs (x0 is not needed)
  TensorView y0;      // [M, d]
  TensorView w0;      // [d, d]
  TensorView w1;      // [2F, d] gate/up interleaved
  TensorView w2;      // [d, F]
  TensorView w3;      // [Nqkv, d]
  TensorView gamma0;  // [d]
  TensorView gamma1;  // [d]
  TensorView pos;     // [M] int32
  TensorView freq;    // [Nqkv] fp32
  // the forward's saved outputs
  TensorView x1, x2;  // [M, d]
  TensorView z1;      // [M, 2F]
  TensorView qkv;     // [M, Nqkv]
  TensorView r1, r2;  // [M] fp32
  // incoming gradients
  TensorView d_qkv;   // [M, Nqkv]
  TensorView d_x2;    // [M, d]
  // outputs
  TensorView d_y0;    // [M, d] to the attention backward of layer l
  TensorView d_x0;    // [M, d] the residual gradient into the block (may be d_x2 itself)
  TensorView dw0;     // [d, d]
  TensorView dw1;     // [2F, d]
  TensorView dw2;     // [d, F]
  TensorView dw3;     // [Nqkv, d]
  TensorView dgamma0; // [d] fp32
  TensorView dgamma1; // [d] fp32
};

Status validate(const LlamaBlockBwdArgs& args);
// dz2, dx, dz1, y1, h (shared by stages (a) and (c)), zdz2, zdz1 and the partials; 0 when invalid.
size_t workspace_bytes(const LlamaBlockBwdArgs& args);
// workspace: workspace_bytes(args) bytes on the tensors' device (host memory for CPU tensors), 256-byte
// aligned. Launches 15 kernels on `stream` (CUDA); no allocation, no synchronization. Deterministic.
Status run(const LlamaBlockBwdArgs& args, void* workspace, Stream stream = nullptr);

// The first layer's backward (docs/math/gemm_epilogues.md §5 "First layer"): qkv = RoPE(rmsnorm(x)·γ @
// w3ᵀ) alone, i.e. stage (a) of the block backward: rope_bwd_zdz, rmsnorm_bwd (accumulating d_x_prev, the
// residual gradient of x from the layers above, when given), wgrad dw3, dγ. x, r, qkv: the forward's
// input, row scale rsqrt(mean(x²) + eps) and output. No output may overlap an input or another output.
struct QkvNormBwdArgs {
  TensorView x;         // [M, d]
  TensorView gamma;     // [d]
  TensorView w3;        // [Nqkv, d]
  TensorView pos;       // [M] int32
  TensorView freq;      // [Nqkv] fp32
  TensorView r;         // [M] fp32
  TensorView qkv;       // [M, Nqkv]
  TensorView d_qkv;     // [M, Nqkv]
  TensorView d_x_prev;  // [M, d], optional
  // outputs
  TensorView dx;        // [M, d]
  TensorView dw3;       // [Nqkv, d]
  TensorView dgamma;    // [d] fp32
};
Status validate(const QkvNormBwdArgs& args);
size_t workspace_bytes(const QkvNormBwdArgs& args);  // dz2, h, zdz and the partials
Status run(const QkvNormBwdArgs& args, void* workspace, Stream stream = nullptr);

}  // namespace encore
