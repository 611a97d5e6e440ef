// The norm family's bottom: validated RMSNorm / add-RMSNorm and QK-norm problems, shared by the CPU
// and CUDA backends, and the CUDA launch plans (computed in plan.cpp).
#pragma once
#include <cstddef>
#include <cstdint>

#include "encore/core/dtype.hpp"

namespace encore::norm {

struct RmsNormProblem {
  const void* x = nullptr;
  int64_t x_stride = 0;          // row strides in elements
  const void* residual = nullptr;  // null for plain RMSNorm
  int64_t residual_stride = 0;
  const void* weight = nullptr;  // [hidden]
  void* y = nullptr;
  int64_t y_stride = 0;
  void* h = nullptr;             // null for plain RMSNorm
  int64_t h_stride = 0;
  int64_t rows = 0;
  int64_t hidden = 0;
  DType dtype = DType::kFP32;
  float eps = 1e-6f;
  float weight_offset = 0.0f;
  int device_index = 0;
};

// Split-row decode paths: blocks of kSplitRowThreads threads, each owning one 16-byte pack of every
// row; workspace = barrier state (kSplitRowBarrierBytes) + fp32 partials [rows, slices].
constexpr int kSplitRowThreads = 64;
constexpr int64_t kSplitRowMaxRows = 16;
constexpr size_t kSplitRowBarrierBytes = 16;

inline int split_row_slices(int64_t hidden, DType dtype) {
  const int64_t packs = hidden / (16 / int64_t(dtype_size(dtype)));
  return int((packs + kSplitRowThreads - 1) / kSplitRowThreads);
}

inline size_t split_row_workspace_bytes(int64_t rows, int64_t hidden, DType dtype) {
  return kSplitRowBarrierBytes + size_t(rows) * size_t(split_row_slices(hidden, dtype)) * sizeof(float);
}

struct QkNormProblem {
  void* qkv = nullptr;
  int64_t token_stride = 0;  // elements
  const void* q_weight = nullptr;
  const void* k_weight = nullptr;
  int64_t tokens = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  DType dtype = DType::kBF16;
  float eps = 1e-6f;
  float weight_offset = 0.0f;
  int device_index = 0;
};

// How the CUDA RMSNorm kernel splits the work.
struct RmsNormLaunchPlan {
  int vec_elems = 1;         // elements per access (16 bytes / element size, or 1)
  int warps_per_row = 1;     // warps cooperating on one row
  int rows_per_block = 1;    // rows handled by one block
  int vecs_per_thread = 0;   // register-cached accesses per thread; 0 = streaming (re-read)
  long long grid = 0;        // blocks
};
// Plan for `rows` x `hidden` elements of `dtype` on a device with `sm_count` multiprocessors;
// `vectorized`: whether 16-byte packs are allowed (alignment, hidden and strides permitting);
// `add`: the residual-add variant.
RmsNormLaunchPlan plan_rms_norm(int64_t rows, int64_t hidden, DType dtype, bool vectorized, bool add, int sm_count);
// The same plan in 32-byte packs (sm_100+: one 256-bit access each): twice the elements per pack, half
// the cached packs per thread, so every thread holds the same elements; only for a 16-byte-pack plan
// with >= 2 cached packs (others unchanged). The caller checks that hidden and the rows are whole
// 32-byte packs, 32-byte aligned.
RmsNormLaunchPlan widen_rms_norm_plan(const RmsNormLaunchPlan& plan, DType dtype);
// Whether the RMSNorm and QK-norm dispatchers take 32-byte packs on a device of compute capability `cc_major`:
// ENCORE_NORM_PACK_BYTES, read at every call: "16" never, "32" on any device (the test hook that runs
// them on Hopper, as two 128-bit accesses), unset or anything else from compute capability 10 on.
bool norm_wide_packs(int cc_major);
// Calls whose CUDA plan the RMSNorm / QK-norm dispatchers widened to 32-byte packs, per process (tests
// check which plan ran).
int64_t rms_norm_wide_plan_count();
int64_t qk_norm_wide_plan_count();

// How the CUDA QK-norm kernel covers the heads.
struct QkNormLaunchPlan {
  int threads = 128;         // per block
  int heads_per_thread = 1;  // heads each lane group normalizes (loads of all issued together)
  long long grid = 0;
  int pack_bytes = 16;       // bytes per lane access: 16, or 32 (widen_qk_norm_plan, sm_100+)
};
QkNormLaunchPlan plan_qk_norm(int64_t tokens, int heads_per_token, int head_dim, DType dtype, int sm_count);
// The same plan with 32-byte lane accesses (sm_100+: one 256-bit access each): half the lanes a head,
// so twice the heads a block and half the grid. The caller checks 32-byte aligned rows and weights.
QkNormLaunchPlan widen_qk_norm_plan(const QkNormLaunchPlan& plan, int64_t tokens, int heads_per_token, int head_dim, DType dtype);

}  // namespace encore::norm
