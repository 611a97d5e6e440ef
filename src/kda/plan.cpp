// The CUDA KDA launch plans (plan.hpp): the forward's rule and the checks of a requested plan; the
// backward's kernels.
#include "kda/plan.hpp"

#include <string>

#include "kda/cuda/launch.hpp"  // host-only declarations and limits

namespace encore::kda {
namespace {

constexpr int kStateColumnWidths[] = {16, 32, 64};  // the state kernel's instantiations (kda/cuda/kda_state.cu)

// Blocks of the state kernel over V value columns at `columns` per block (kda_device.cuh's
// state_column_blocks).
int64_t column_blocks(int64_t V, int columns) { return (V + columns - 1) / columns; }

// The rule's state columns: the narrowest of 16, 32 whose grid fits one wave, else 64.
int rule_state_columns(const KdaProblem& p, const DeviceInfo& device) {
  const int64_t seq_heads = int64_t(p.seqs.size()) * p.H;
  for (int c : {16, 32})
    if (seq_heads * column_blocks(p.V, c) <= device.sm_count) return c;
  return 64;
}

int rule_chunk_blocks(const DeviceInfo& device) { return device.sm_count > 0 ? device.sm_count : 1; }

}  // namespace

bool one_launch_fits(const KdaProblem& p, int state_columns, const DeviceInfo& device) {
  const int64_t seqs = int64_t(p.seqs.size());
  return state_columns <= 32 && seqs <= cuda::kKdaFewSeqs && seqs * p.H * column_blocks(p.V, state_columns) <= device.sm_count &&
         chunk_count(p) * p.H <= device.sm_count;
}

KdaLaunchPlan kda_plan(const KdaProblem& p, const DeviceInfo& device) {
  KdaLaunchPlan plan;
  plan.chunk_blocks = rule_chunk_blocks(device);
  plan.state_columns = rule_state_columns(p, device);
  plan.launches = one_launch_fits(p, plan.state_columns, device) ? 1 : 2;
  return plan;
}

Status check_plan(const KdaLaunchPlan& plan) {
  bool width_ok = plan.state_columns == 0;
  for (int c : kStateColumnWidths) width_ok = width_ok || plan.state_columns == c;
  if (!width_ok)
    return Status::invalid("plan.state_columns: must be 16, 32 or 64 (value columns per state-kernel block), or 0 for the rule; got " +
                           std::to_string(plan.state_columns));
  if (plan.launches < 0 || plan.launches > 2)
    return Status::invalid("plan.launches: must be 1 (one kernel), 2 (the chunk then the state kernel) or 0 for the rule; got " +
                           std::to_string(plan.launches));
  if (plan.chunk_blocks < 0)
    return Status::invalid("plan.chunk_blocks: must be >= 1 (blocks of the chunk kernel), or 0 for one per SM; got " +
                           std::to_string(plan.chunk_blocks));
  return Status::ok();
}

Status resolve_plan(const KdaLaunchPlan& requested, const KdaProblem& p, const DeviceInfo& device, KdaLaunchPlan* out) {
  ENCORE_RETURN_IF_ERROR(check_plan(requested));
  out->state_columns = requested.state_columns != 0 ? requested.state_columns : rule_state_columns(p, device);
  out->chunk_blocks = requested.chunk_blocks != 0 ? requested.chunk_blocks : rule_chunk_blocks(device);
  const bool fits = one_launch_fits(p, out->state_columns, device);
  out->launches = requested.launches != 0 ? requested.launches : fits ? 1 : 2;
  if (out->launches == 1 && !fits)
    return Status::invalid("plan.launches: 1 needs <= " + std::to_string(cuda::kKdaFewSeqs) +
                           " sequences and the chunk items and state blocks each within one block an SM (" + std::to_string(device.sm_count) +
                           ")");
  return Status::ok();
}

cuda::KdaDecodePlan kda_decode_plan(int64_t N, int64_t H, DType states, bool states16, int sm_count) {
  const int64_t sms = sm_count > 0 ? sm_count : 1;
  const int64_t blocks32 = N * H * 4;  // the grid at 32 columns a block
  cuda::KdaDecodePlan plan;
  plan.pdl = true;
  plan.kernel = cuda::KdaDecodeKernel::kColumns32;
  if (!states16) return plan;
  const int64_t resident_heads = states == DType::kBF16 ? cuda::kKdaDecodeResidentHeadsBf16 : cuda::kKdaDecodeResidentHeadsFp32;
  if (N * H >= 2 * resident_heads * sms) {  // two waves of the whole-head grid
    plan.kernel = cuda::KdaDecodeKernel::kHeads;
    return plan;
  }
  if (states != DType::kBF16) {
    plan.prefetch = true;
  } else if (blocks32 >= 2 * cuda::kKdaDecodeResident32Bf16 * sms) {  // two waves of the 32-column grid
    plan.kernel = cuda::KdaDecodeKernel::kColumns64;  // (its prefetch paid from 16 waves: whole heads by then)
  }
  return plan;
}

KdaBackwardKernels kda_backward_kernels(const KdaProblem& p, bool saved_h, DType inputs) {
  if (cuda::kda_use_recurrent(p.K, p.V)) return KdaBackwardKernels::kRecurrent;
  if (inputs == DType::kBF16 || (saved_h && inputs == DType::kFP16)) return KdaBackwardKernels::kSecond;
  return KdaBackwardKernels::kFirst;
}

}  // namespace encore::kda
