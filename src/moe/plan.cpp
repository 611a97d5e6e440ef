// Launch plan of the coming CUDA MoE dispatch: one block for decode-sized batches, count-then-scatter
// otherwise (thresholds from public code for now, docs/moe.md; to be measured on the H200).
#include "moe/problem.hpp"

namespace encore::moe {

DispatchPlan plan_moe_dispatch(int64_t tokens, int top_k, int num_experts, int sm_count) {
  DispatchPlan plan;
  const int64_t pairs = tokens * top_k;
  // vLLM's moe_align_block_size keeps one block below 1024 (token, k) pairs with E <= 64;
  // TRT-LLM / flashinfer route up to 256 tokens in one block. Shared memory holds E counters.
  plan.path = pairs < 1024 && num_experts <= 256 ? DispatchPath::kSingleBlock : DispatchPath::kCountThenScatter;
  plan.threads = 256;
  if (plan.path == DispatchPath::kSingleBlock) {
    plan.grid = 1;
  } else {
    // The gather moves pairs rows of hidden elements: a warp per row, at most a few waves.
    const int64_t warps = pairs, per_block = plan.threads / 32;
    const long long cap = sm_count > 0 ? 4LL * sm_count : 1024;
    plan.grid = (long long)((warps + per_block - 1) / per_block);
    if (plan.grid > cap) plan.grid = cap;
  }
  plan.workspace_bytes = round_up_bytes(size_t(num_experts) * sizeof(int32_t));
  return plan;
}

}  // namespace encore::moe
