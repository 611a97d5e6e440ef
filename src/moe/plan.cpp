// Launch plan of the CUDA MoE dispatch: the maps in one block for decode-sized batches, count-then-scatter
// otherwise (thresholds from public code for now, docs/moe.md; to be measured on the H200); the gather
// on the whole GPU in both cases. Also which path the expert GEMMs take (moe_fused_swiglu,
// moe_wide_tile, moe_decode_gemv).
#include <algorithm>
#include <cstdlib>
#include <string>

#include "moe/problem.hpp"

namespace encore::moe {

DispatchPlan plan_moe_dispatch(int64_t tokens, int top_k, int num_experts, int sm_count, DispatchPath path) {
  DispatchPlan plan;
  const int64_t pairs = tokens * top_k;
  plan.path = path;
  plan.threads = 256;
  plan.chunks = (long long)((pairs + kDispatchChunkPairs - 1) / kDispatchChunkPairs);
  if (plan.chunks < 1) plan.chunks = 1;
  // The gather (both paths) runs on its own grid, sized at launch from the rows that can be in use
  // (a warp per 2 KB of a row); plan.grid caps it at the blocks resident on the device at once.
  plan.grid = sm_count > 0 ? (long long)kDispatchGatherBlocksPerSm * sm_count : 1024;
  const size_t cursors = size_t(num_experts) * sizeof(int32_t);
  const size_t hist = size_t(num_experts) * size_t(plan.chunks) * sizeof(int32_t);
  plan.workspace_bytes = round_up_bytes(cursors > hist ? cursors : hist);
  return plan;
}

DispatchPlan plan_moe_dispatch(int64_t tokens, int top_k, int num_experts, int sm_count) {
  // vLLM's moe_align_block_size keeps one block below 1024 (token, k) pairs with E <= 64;
  // TRT-LLM / flashinfer route up to 256 tokens in one block. Shared memory holds E counters.
  const int64_t pairs = tokens * top_k;
  const DispatchPath path = pairs < 1024 && num_experts <= 256 ? DispatchPath::kSingleBlock : DispatchPath::kCountThenScatter;
  return plan_moe_dispatch(tokens, top_k, num_experts, sm_count, path);
}

bool moe_decode_gemv(int64_t tokens, int64_t hidden, int64_t intermediate) {
  const char* v = std::getenv("ENCORE_MOE_DECODE");
  const bool unset = v == nullptr || *v == '\0';
  if (!unset && std::string(v) == "0") return false;
  const int64_t max_rows = unset ? kDecodeDefaultRows : kDecodeMaxRows;
  return tokens >= 1 && tokens <= max_rows && tokens * std::max(hidden, intermediate) * 2 <= kDecodeMaxSmem;
}

bool moe_wide_tile(int64_t tokens) {
  const char* v = std::getenv("ENCORE_MOE_GEMM_TILE");
  const std::string tile = v != nullptr ? v : "";
  if (tile == "128x256") return true;
  if (tile == "128x128") return false;
  return tokens >= kWideTileMinTokens;
}

bool moe_fused_swiglu() {
  const char* v = std::getenv("ENCORE_MOE_FUSED_SWIGLU");
  if (v == nullptr) return false;
  const std::string s = v;
  return !s.empty() && s != "auto" && s != "0";
}

}  // namespace encore::moe
