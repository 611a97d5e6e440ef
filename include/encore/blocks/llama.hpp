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

}  // namespace encore
