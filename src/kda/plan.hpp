// Launch plan of the CUDA KDA forward (chunked path): the persistent chunk kernel's grid and the state
// kernel's value columns per block, chosen in one place (plan.cpp) and passed down to the launchers
// (kda/cuda/launch.hpp). The dispatch runs the chosen plan; tests and benchmarks set one through
// kda/testing.hpp's run overload.
#pragma once
#include <cstdint>

#include "encore/core/device_info.hpp"
#include "encore/core/dtype.hpp"
#include "encore/core/status.hpp"
#include "kda/cuda/kda_decode.hpp"  // host-only: the decode kernels
#include "kda/problem.hpp"

namespace encore::kda {

struct KdaLaunchPlan {
  int state_columns = 0;  // value columns per state-kernel block: 16, 32 or 64; 0 = the rule (kda_plan)
  int chunk_blocks = 0;   // blocks of the persistent chunk kernel, >= 1; 0 = one per SM
  int launches = 0;       // 1: the whole forward in one kernel (one_launch_fits), 2: the chunk then the state kernel; 0 = the rule
};

// Whether the one-launch forward takes `p` with `state_columns` on `device`: 16 or 32 columns (at 64 the
// one kernel spills), <= kKdaFewSeqs sequences and both the chunk items (chunks x H) and the state blocks
// (N x H x column blocks) within one wave (one block an SM).
bool one_launch_fits(const KdaProblem& p, int state_columns, const DeviceInfo& device);

// The plan for problem `p` on `device`: the chunk kernel on one block per SM; the state kernel on the
// narrowest of 16, 32, 64 value columns whose grid (sequences x heads x column blocks) fits one wave,
// else 64 (narrower blocks finish a serial step sooner, a second wave doubles the path); one launch
// where one_launch_fits (a launch's host time and one kernel boundary less on small problems).
KdaLaunchPlan kda_plan(const KdaProblem& p, const DeviceInfo& device);

// Checks a requested plan's fields (0 = the rule's choice): Status::invalid naming the field and what
// it takes. Needs no device.
Status check_plan(const KdaLaunchPlan& plan);

// `requested` with its 0 fields replaced by kda_plan's choice, after check_plan.
Status resolve_plan(const KdaLaunchPlan& requested, const KdaProblem& p, const DeviceInfo& device, KdaLaunchPlan* out);

// The decode step's plan (kda/cuda/kda_decode.hpp) for N sequences x H value heads at K = V = 128, from
// `encore bench kda_decode_plans` on an H100 (H 32, batch 1-1024, docs/kda_serving.md): every launch a
// programmatic dependent launch (0.4-0.6 us less at batch 1, level elsewhere). From two waves of the
// whole-head grid (N x H >= 2 x 6 blocks an SM with bf16 states, 2 x 3 with fp32) the whole-head kernel
// (13% faster than the best column plan with bf16 states from batch 64, 3.5% with fp32). Under that:
// fp32 states 32 columns a block with the L2 prefetch one wave ahead (7% at batch 8); bf16 states 32
// columns (15% faster than 64 at batch 8), 64 columns once the 32-column grid takes two waves (8
// blocks an SM), without the prefetch (it paid from 16 waves of that grid, past the whole-head
// switch). States whose 8-column
// accesses are not 16-byte aligned: 32 columns, no prefetch.
cuda::KdaDecodePlan kda_decode_plan(int64_t N, int64_t H, DType states, bool states16, int sm_count);

// The CUDA backward's kernels for a problem with K, V <= 128: the second backward (K0 prep, K1 scan,
// K2a, K2b: single-pass bf16 tensor-core products) for bf16 inputs, with the forward's saved
// chunk-start states or without them (rematerialize: the forward re-run first writes them into the
// workspace), and for fp16 inputs with saved states; the first (fp32 records, hi + lo products) for
// fp32 inputs (its fp32 accuracy) and fp16 inputs without saved states (its fp32 states keep fp16's
// precision; the second's bf16 operands cost fp16 inputs dA_log accuracy). K or V above 128: the
// token-recurrent backward.
enum class KdaBackwardKernels { kSecond, kFirst, kRecurrent };
KdaBackwardKernels kda_backward_kernels(const KdaProblem& p, bool saved_h, DType inputs);

}  // namespace encore::kda
