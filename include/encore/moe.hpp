// encore moe family: mixture-of-experts routing, dispatch, combine and the layer (single GPU, TP = 1).
//
// T tokens, E experts, k experts per token, D hidden, F expert intermediate size.
//
//   routing   s[t, e]  = softmax_e(logits[t, :]) or sigmoid(logits[t, e])          (fp64 in the reference)
//             c[t, e]  = s[t, e] + bias[e]                 (bias optional: DeepSeek-V3's correction bias)
//             groups   (n_group > 1): E / n_group consecutive experts per group; a group's score is the
//                      sum of its two largest c (its largest when the group has one expert) with a bias, its
//                      largest c without; the topk_group best groups stay, the others' experts are excluded
//             ids[t]   = the k experts of largest c (kept groups only), in descending order of c; ties
//                      go to the lower expert (or group) index, so the result is deterministic
//             w[t, j]  = s[t, ids[t, j]]  (unbiased), / sum_j w[t, j] if renormalize, * routed_scaling_factor
//   dispatch  counts[e]   = #{(t, j) : ids[t, j] = e}
//             offsets[e]  = sum_{e' < e} round_up(counts[e'], align_m); offsets[E] = the rows in use
//             slot_rows[t, j] = offsets[e] + rank of (t, j) among e's slots in row-major (t, j) order
//             row_slots[r]    = t * k + j for the row of (t, j); -1 for every row that holds no token
//             x_perm[slot_rows[t, j]] = x[t]; the padding rows of each expert's block are zeroed, rows from
//             offsets[E] on are left untouched
//   expert    y[r] = (silu(x_perm[r] . w13[e, 0:F]^T) * (x_perm[r] . w13[e, F:2F]^T)) . w2[e]^T for the rows r
//             of expert e: w13 [E, 2F, D] holds the gate rows then the up rows (h[:, :F], h[:, F:] of the
//             torch path of bench/peers/moe_peers.py), w2 [E, D, F]; the activation is rounded to x's dtype
//             before the down projection, y rounded to x's dtype; padding rows of y are zeroed
//   combine   out[t] = sum_{j = 0..k-1} w[t, j] * y[slot_rows[t, j]], accumulated in fp32 in slot order
//             j = 0..k-1 with one fused multiply-add per slot, then rounded to out's dtype: bit-reproducible
//             (no atomics). The routing weight is applied here, at combine, as in that torch path (which
//             rounds w and w * y to bf16 first; encore keeps both in fp32).
//
// Shapes and dtypes: logits [T, E] bf16/fp16/fp32; bias [E] fp32 or bf16; ids [T, k] int32; weights
// [T, k] fp32; counts [E] int32; offsets [E + 1] int32; slot_rows [T, k] int32; row_slots [R] int32 and
// x_perm [R, D] with R >= moe_permuted_rows(T, k, E, align_m); x, out [T, D] bf16/fp16/fp32; all with a
// unit last stride. The three ops run alone (serving engines own their GEMMs) or inside moe_forward,
// whose intermediate buffers the caller allocates once (moe_buffers_bytes, moe_buffers_carve).
// Backends: the CPU reference for every op; CUDA for all of them (src/moe/cuda). moe_forward on CUDA:
// routing -> dispatch -> one grouped gate/up GEMM (fp32 gate_up; 128x256 tiles from 2 tokens,
// ENCORE_MOE_GEMM_TILE) and a SwiGLU row kernel, or with ENCORE_MOE_FUSED_SWIGLU=1 a grouped gate GEMM
// (fp32 gate) and an up GEMM with the SwiGLU in its epilogue -> grouped down GEMM, or at T <= 4 a weight-streaming
// decode GEMV for both (ENCORE_MOE_DECODE=0 never, 1 up to T 16) -> combine, all enqueued on
// the stream (no allocation, no sync); bf16 only, D and
// F multiples of 8, E <= 512 (the routing kernel), on CUTLASS's Sm90 pointer-array grouped GEMM whose
// group sizes come from expert_offsets on the device (docs/moe.md). The GEMMs accumulate in fp32 (the
// reference in fp64), so CUDA results agree with the CPU backend to bf16 rounding, not bit for bit;
// reruns on CUDA are bit-identical.
#pragma once
#include <cstddef>
#include <cstdint>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore {

enum class MoeScoring : uint8_t { kSoftmax, kSigmoid };

struct MoeRoutingOptions {
  int top_k = 8;
  MoeScoring scoring = MoeScoring::kSoftmax;
  bool renormalize = true;
  int n_group = 1;     // expert groups (1: plain top-k); must divide E
  int topk_group = 1;  // groups kept per token, in [1, n_group]; k <= topk_group * E / n_group
  float routed_scaling_factor = 1.0f;
};

struct MoeRoutingArgs {
  TensorView logits;           // [T, E]
  TensorView correction_bias;  // [E], optional (undefined view = no bias)
  TensorView topk_ids;         // [T, k] int32, output
  TensorView topk_weights;     // [T, k] fp32, output
};

Status validate(const MoeRoutingArgs& args, const MoeRoutingOptions& opts);
size_t workspace_bytes(const MoeRoutingArgs& args, const MoeRoutingOptions& opts);  // 0
Status run(const MoeRoutingArgs& args, const MoeRoutingOptions& opts, void* workspace = nullptr, Stream stream = nullptr);

struct MoeDispatchOptions {
  int num_experts = 0;
  int align_m = 1;  // each expert's block padded to a multiple of align_m rows (a power of two, e.g. 1, 8, 64, 128)
  // With x_scales: the FP8 quantization fused into the gather, as fp8_group_quant (encore/quant.hpp)
  // would quantize x_permuted: power-of-two scales or not, the amax floor.
  bool fp8_power_of_two_scales = false;
  float fp8_eps = 1e-10f;
};

struct MoeDispatchArgs {
  TensorView topk_ids;        // [T, k] int32, each in [0, E)
  TensorView x;               // [T, D], optional together with x_permuted (then only the maps are built)
  TensorView expert_counts;   // [E] int32, output
  TensorView expert_offsets;  // [E + 1] int32, output
  TensorView slot_rows;       // [T, k] int32, output: (t, j) -> row of the permuted buffer
  TensorView row_slots;       // [R] int32, output: row -> t * k + j, or -1
  TensorView x_permuted;      // [R, D] output: x's dtype, or fp8 e4m3 with x_scales
  // Optional [R, D / 128] fp32 output (D a multiple of 128): the FP8 1x128 quantization fused into the
  // gather (DeepGEMM's activation layout): x_permuted row r's group g of 128 columns is
  // e4m3(x * (1 / s)) with s = x_scales[r, g] = fp8_group_scale(max |x| over the group), bit for bit
  // what fp8_group_quant gives on the unquantized x_permuted; padding rows quantize a zero row
  // (q 0, s = fp8_eps / 448 or its power of two).
  TensorView x_scales;
};

// Rows the permuted buffer needs at most: T*k + min(E, T*k) * (align_m - 1).
int64_t moe_permuted_rows(int64_t tokens, int top_k, int num_experts, int align_m);

Status validate(const MoeDispatchArgs& args, const MoeDispatchOptions& opts);
// Per-expert scatter cursors (E int32, rounded up to 256 bytes); a workspace of this size is required.
size_t workspace_bytes(const MoeDispatchArgs& args, const MoeDispatchOptions& opts);
Status run(const MoeDispatchArgs& args, const MoeDispatchOptions& opts, void* workspace, Stream stream = nullptr);

struct MoeCombineOptions {};

struct MoeCombineArgs {
  TensorView expert_out;    // [R, D] bf16/fp16/fp32
  TensorView slot_rows;     // [T, k] int32, each in [0, R)
  TensorView topk_weights;  // [T, k] fp32
  TensorView out;           // [T, D] bf16/fp16/fp32, output
};

Status validate(const MoeCombineArgs& args, const MoeCombineOptions& opts);
size_t workspace_bytes(const MoeCombineArgs& args, const MoeCombineOptions& opts);  // 0
Status run(const MoeCombineArgs& args, const MoeCombineOptions& opts, void* workspace = nullptr, Stream stream = nullptr);

// ---- the layer -------------------------------------------------------------------------------------

struct MoeOptions {
  MoeRoutingOptions routing;
  int align_m = 1;  // as MoeDispatchOptions::align_m
};

// What the caller's persistent buffers are sized for: at most max_tokens tokens per call.
struct MoeLayerShape {
  int64_t max_tokens = 0;
  int64_t hidden = 0;        // D
  int64_t intermediate = 0;  // F
  int num_experts = 0;       // E
  DType dtype = DType::kBF16;  // x's dtype (x_permuted, activation and expert_out are stored in it)
};

// The layer's intermediate buffers, caller-allocated and reused across calls (R = moe_permuted_rows of
// max_tokens). After a run they hold that call's routing, maps and expert outputs (first T rows).
struct MoeBuffers {
  TensorView topk_ids;            // [max_tokens, k] int32
  TensorView topk_weights;        // [max_tokens, k] fp32
  TensorView expert_counts;       // [E] int32
  TensorView expert_offsets;      // [E + 1] int32
  TensorView slot_rows;           // [max_tokens, k] int32
  TensorView row_slots;           // [R] int32
  TensorView x_permuted;          // [R, D] dtype
  TensorView activation;          // [R, F] dtype: silu(gate) * up
  TensorView expert_out;          // [R, D] dtype
  TensorView dispatch_workspace;  // [W] int32: the dispatch's workspace (W * 4 = its workspace_bytes)
  TensorView gate_up;             // [R, 2F] fp32: x_permuted . w13[e]^T, only columns [0, F) (the gate) on the
                                  // fused-SwiGLU path (CUDA only; unused on the CPU)
  TensorView gemm_workspace;      // [G] uint8: the grouped GEMMs' per-expert arguments (CUDA only)
};

// Bytes of one allocation that moe_buffers_carve splits into MoeBuffers (each buffer 256-byte aligned).
size_t moe_buffers_bytes(const MoeLayerShape& shape, const MoeOptions& opts);
// Views into [base, base + bytes) (base 256-byte aligned, bytes >= moe_buffers_bytes) on `device`.
Status moe_buffers_carve(const MoeLayerShape& shape, const MoeOptions& opts, void* base, size_t bytes, Device device,
                         MoeBuffers* out);

struct MoeForwardArgs {
  TensorView x;                // [T, D] bf16/fp16/fp32, T <= the buffers' max_tokens
  TensorView router_logits;    // [T, E] (the router GEMM is the caller's)
  TensorView correction_bias;  // [E], optional
  TensorView w13;              // [E, 2F, D] x's dtype: gate rows then up rows
  TensorView w2;               // [E, D, F] x's dtype
  MoeBuffers buffers;
  TensorView out;              // [T, D] x's dtype, output
};

Status validate(const MoeForwardArgs& args, const MoeOptions& opts);
size_t workspace_bytes(const MoeForwardArgs& args, const MoeOptions& opts);  // 0: everything is in buffers
Status run(const MoeForwardArgs& args, const MoeOptions& opts, void* workspace = nullptr, Stream stream = nullptr);

}  // namespace encore
