// Launch heuristics of the norm family's CUDA kernels (docs/norm.md has the sweeps behind them).
#include <cstdlib>
#include <string>

#include "norm/problem.hpp"

namespace encore::norm {
namespace {

// Launch-plan constants, from the norm_plans sweep on an H200 (docs/norm.md): one row per block
// always won; plain RMSNorm runs best with 8 cached packs per thread, add-RMSNorm (twice the loads
// per pack) with 1; rows that cannot fill the GPU get more warps each, down to 2 packs per thread.
constexpr int kMaxWarpsPerRow = 16;  // 512 threads: the kernel's block limit
constexpr int kTargetPacksPlain = 8;
constexpr int kTargetPacksAdd = 1;
constexpr int kSmallBatchPacks = 2;
constexpr int kMaxCachedPacks = 8;
constexpr int kShortRowsPerBlock = 8;
// add-RMSNorm rows of 513-1024 packs (16 warps would cache 2 each): 8 warps x 4 cached packs instead.
// norm_plans at 1ab7984 (bf16): 1.16-1.21x faster at hidden 5120 / 5184 / 6144, 1.04x at 7168, level
// at 8192 (docs/norm.md). Measured for 16-bit rows in 16-byte packs only: fp32 and unvectorized rows
// keep 16 warps.
constexpr int kAddTwoPackWarps = 8;
constexpr int kAddTwoPackVecElems = 8;

}  // namespace

RmsNormLaunchPlan plan_rms_norm(int64_t rows, int64_t hidden, DType dtype, bool vectorized, bool add, int sm_count) {
  RmsNormLaunchPlan plan;
  plan.vec_elems = vectorized ? int(16 / dtype_size(dtype)) : 1;
  const int64_t packs = (hidden + plan.vec_elems - 1) / plan.vec_elems;
  const int64_t target = add ? kTargetPacksAdd : kTargetPacksPlain;
  // Fewest warps per row that keep each thread at <= target packs.
  int wpr = 1;
  while (wpr < kMaxWarpsPerRow && packs > int64_t(32) * wpr * target) wpr *= 2;
  if (add && plan.vec_elems == kAddTwoPackVecElems && wpr == kMaxWarpsPerRow && packs > int64_t(32) * wpr && packs <= int64_t(32) * wpr * 2) wpr = kAddTwoPackWarps;
  // Too few rows to give every SM ~4 row-teams: more warps per row shorten each row's latency.
  while (wpr < kMaxWarpsPerRow && rows * wpr < int64_t(4) * sm_count && packs > int64_t(32) * wpr * kSmallBatchPacks) wpr *= 2;
  plan.warps_per_row = wpr;
  const int64_t per_thread = (packs + 32 * wpr - 1) / (32 * wpr);
  int cached = 1;
  while (cached < per_thread) cached *= 2;
  plan.vecs_per_thread = cached <= kMaxCachedPacks ? cached : 0;
  // Short rows (one pack per lane or less, e.g. per-head norms over [tokens * heads, 128]): a
  // one-warp block per row caps an SM at 32 blocks = half occupancy; pack 8 rows per block.
  plan.rows_per_block = (wpr == 1 && packs <= 32 && rows >= int64_t(8) * sm_count) ? kShortRowsPerBlock : 1;
  plan.grid = (rows + plan.rows_per_block - 1) / plan.rows_per_block;
  return plan;
}

RmsNormLaunchPlan widen_rms_norm_plan(const RmsNormLaunchPlan& plan, DType dtype) {
  RmsNormLaunchPlan w = plan;
  if (plan.vec_elems == int(16 / dtype_size(dtype)) && plan.vecs_per_thread >= 2) {
    w.vec_elems = 2 * plan.vec_elems;
    w.vecs_per_thread = plan.vecs_per_thread / 2;
  }
  return w;
}

bool norm_wide_packs(int cc_major) {
  const char* v = std::getenv("ENCORE_NORM_PACK_BYTES");
  if (v != nullptr && std::string(v) == "16") return false;
  if (v != nullptr && std::string(v) == "32") return true;
  return cc_major >= 10;
}

// Blocks for `heads` heads, each lane group (lanes per head) taking heads_per_thread of them.
static long long qk_norm_grid(int64_t heads, int threads, int lanes, int heads_per_thread) {
  const int64_t per_block = int64_t(threads / lanes) * heads_per_thread;
  return (heads + per_block - 1) / per_block;
}

QkNormLaunchPlan widen_qk_norm_plan(const QkNormLaunchPlan& plan, int64_t tokens, int heads_per_token, int head_dim, DType dtype) {
  QkNormLaunchPlan w = plan;
  const int lanes = int(int64_t(head_dim) * int64_t(dtype_size(dtype)) / 32);
  if (lanes < 1) return plan;
  w.pack_bytes = 32;
  w.grid = qk_norm_grid(tokens * heads_per_token, w.threads, lanes, w.heads_per_thread);
  return w;
}

QkNormLaunchPlan plan_qk_norm(int64_t tokens, int heads_per_token, int head_dim, DType dtype, int sm_count) {
  QkNormLaunchPlan plan;
  const int lanes = int(int64_t(head_dim) * int64_t(dtype_size(dtype)) / 16);
  const int64_t heads = tokens * heads_per_token;
  const int64_t threads_needed = heads * lanes;
  // Measured with the qk_norm_plans sweep (H200, 32 q + 8 kv heads x 128,
  // bench/results/2026-11-29-h200-qk_norm-qk_norm_plans-f16a313.json): one head per lane group is
  // fastest at 1 and 64 tokens (64 tokens: 2.18 us against 2.31 with two heads); 128 threads with
  // two heads per lane group is the best or within 1% of it from 4096 tokens up (4096: 22.4 us,
  // 65536: 326 us, against 22.9 / 330 us for 256 x 4).
  if (threads_needed >= int64_t(sm_count) * 1024) {
    plan.threads = 128;
    plan.heads_per_thread = 2;
  } else {
    plan.threads = 128;
    plan.heads_per_thread = 1;
  }
  plan.grid = qk_norm_grid(heads, plan.threads, lanes, plan.heads_per_thread);
  return plan;
}

}  // namespace encore::norm
