// encore norm family: RMSNorm and fused residual-add + RMSNorm over [rows, hidden].
//
//   rms_norm:      y[r,:] = x[r,:] * rsqrt(mean(x[r,:]^2) + eps) * (w + weight_offset)
//   add_rms_norm:  h = x + residual (rounded to the dtype, written to h);  y = rms_norm(h)
//
// Tensors are 2-D [rows, hidden] with a unit last stride and any row stride (>= hidden); x, y,
// residual and h share one dtype (bf16, fp16 or fp32) and weight has that dtype too, shape [hidden].
// Math is fp32. h may alias x or residual (each element is read before it is written, by the same
// thread); y must not overlap the inputs. Data pointers must be aligned to the element size; when
// every pointer is 16-byte aligned and hidden and the row strides are multiples of 16 bytes the
// CUDA backend moves 16 bytes per access, otherwise it takes an element-wise path (same results).
//
// Contract (every op, README.md): validate -> workspace_bytes -> run. run neither allocates nor
// synchronizes; the backend is chosen by the tensors' device (all tensors on one device).
#pragma once
#include <cstddef>
#include <cstdint>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore {

// How the CUDA backend covers the rows. kAuto is kRowPerBlock (docs/norm.md has the measurement
// that decided it). The split-row paths spread each row over many blocks for decode batches
// (rows <= 16, 16-byte aligned rows); they need a workspace (workspace_bytes) and, for
// kSplitRowBarrier, initialize_workspace once before the first run.
enum class RmsNormPath {
  kAuto,
  kRowPerBlock,        // a team of warps per row (the default kernel)
  kSplitRowTwoLaunch,  // partial sums of squares, then a second launch that finishes
  kSplitRowBarrier,    // one cooperative launch with a grid barrier between the two phases
};

struct RmsNormOptions {
  float eps = 1e-6f;
  float weight_offset = 0.0f;  // 1.0 for models storing (w - 1), e.g. Gemma
  RmsNormPath path = RmsNormPath::kAuto;
};

struct RmsNormArgs {
  TensorView x;       // [rows, hidden]
  TensorView weight;  // [hidden]
  TensorView y;       // [rows, hidden], output
};

struct AddRmsNormArgs {
  TensorView x;         // [rows, hidden]
  TensorView residual;  // [rows, hidden]
  TensorView weight;    // [hidden]
  TensorView y;         // [rows, hidden], output: normalized
  TensorView h;         // [rows, hidden], output: x + residual (may alias x or residual)
};

Status validate(const RmsNormArgs& args, const RmsNormOptions& opts);
size_t workspace_bytes(const RmsNormArgs& args, const RmsNormOptions& opts);
Status run(const RmsNormArgs& args, const RmsNormOptions& opts, void* workspace = nullptr,
           Stream stream = nullptr);

// Zeroes the grid-barrier state in a workspace (kSplitRowBarrier; a no-op otherwise). Once per
// workspace: every run leaves the state zero again.
Status initialize_workspace(const RmsNormArgs& args, const RmsNormOptions& opts, void* workspace, Stream stream = nullptr);

Status validate(const AddRmsNormArgs& args, const RmsNormOptions& opts);
size_t workspace_bytes(const AddRmsNormArgs& args, const RmsNormOptions& opts);
Status run(const AddRmsNormArgs& args, const RmsNormOptions& opts, void* workspace = nullptr,
           Stream stream = nullptr);
Status initialize_workspace(const AddRmsNormArgs& args, const RmsNormOptions& opts, void* workspace, Stream stream = nullptr);

// ---- QK-norm -----------------------------------------------------------------------------------
// Per-head RMSNorm of the Q and K heads of a fused QKV buffer, in place, one launch:
//   for each token t and head j < num_q_heads + num_kv_heads (Q heads, then K heads):
//     u = qkv[t, j*D : (j+1)*D];  u <- u * rsqrt(mean(u^2) + eps) * (w + weight_offset)
//   with w = q_weight for Q heads and k_weight for K heads. V heads are not touched.
// qkv: [tokens, (num_q_heads + 2*num_kv_heads) * head_dim], bf16 or fp16, unit last stride, any
// token stride that keeps rows 16-byte aligned (a multiple of 8 elements); head_dim 64, 128 or 256.
struct QkNormOptions {
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 128;
  float eps = 1e-6f;
  float weight_offset = 0.0f;  // 1.0 for (1 + w) weights
};

struct QkNormArgs {
  TensorView qkv;       // [tokens, (Hq + 2*Hkv) * head_dim], normalized in place
  TensorView q_weight;  // [head_dim]
  TensorView k_weight;  // [head_dim]
};

Status validate(const QkNormArgs& args, const QkNormOptions& opts);
size_t workspace_bytes(const QkNormArgs& args, const QkNormOptions& opts);
Status run(const QkNormArgs& args, const QkNormOptions& opts, void* workspace = nullptr, Stream stream = nullptr);

}  // namespace encore
