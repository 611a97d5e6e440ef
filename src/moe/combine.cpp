// MoE combine: validate -> problem -> CPU reference or CUDA kernel (fp32, slot order, one fma per slot;
// src/moe/cuda/combine.cu, bit-equal to the reference).
#include <string>

#include "core/checks.hpp"
#include "core/device_memory.hpp"
#include "encore/moe.hpp"
#include "moe/args.hpp"
#include "moe/problem.hpp"
#include "moe/reference/moe_ref.hpp"
#ifdef ENCORE_WITH_CUDA
#include "moe/cuda/launch.hpp"
#include "moe/jit.hpp"
#endif

namespace encore {

Status moe::validate_combine_shapes(const MoeCombineArgs& a) {
  ENCORE_RETURN_IF_ERROR(check_rows("expert_out", a.expert_out, -1, a.expert_out.ndim == 2 ? a.expert_out.shape[1] : 0, "[R, D]",
                                    "expert_out", a.expert_out));
  const int64_t D = a.expert_out.shape[1];
  ENCORE_RETURN_IF_ERROR(checks::present("slot_rows", a.slot_rows));
  ENCORE_RETURN_IF_ERROR(checks::ndim("slot_rows", a.slot_rows, 2, "[T, k]"));
  const int64_t T = a.slot_rows.shape[0], k = a.slot_rows.shape[1];
  ENCORE_RETURN_IF_ERROR(check_map("slot_rows", a.slot_rows, DType::kInt32, T, k, "[T, k]", "expert_out", a.expert_out));
  ENCORE_RETURN_IF_ERROR(check_map("topk_weights", a.topk_weights, DType::kFP32, T, k, "[T, k]", "expert_out", a.expert_out));
  ENCORE_RETURN_IF_ERROR(check_rows("out", a.out, T, D, "[T, D]", "expert_out", a.expert_out));
  return no_overlaps({{"out", &a.out}, {"expert_out", &a.expert_out}, {"slot_rows", &a.slot_rows}, {"topk_weights", &a.topk_weights}});
}

Status validate(const MoeCombineArgs& a, const MoeCombineOptions&) {
  ENCORE_RETURN_IF_ERROR(moe::validate_combine_shapes(a));
  if (a.expert_out.device.is_cuda()) {
#ifdef ENCORE_WITH_CUDA
    return Status::ok();  // device slot rows are not scanned (no sync): the kernel skips rows outside [0, R)
#else
    return Status::unsupported("expert_out: on " + a.expert_out.device.to_string() + " but encore was built without CUDA (ENCORE_CUDA=OFF)");
#endif
  }
  const auto* rows = static_cast<const int32_t*>(a.slot_rows.data);
  const int64_t R = a.expert_out.shape[0];
  for (int64_t t = 0; t < a.slot_rows.shape[0]; ++t)
    for (int64_t j = 0; j < a.slot_rows.shape[1]; ++j) {
      const int32_t r = rows[t * a.slot_rows.strides[0] + j];
      if (r < 0 || r >= R)
        return Status::invalid("slot_rows: entry [" + std::to_string(t) + ", " + std::to_string(j) + "] = " + std::to_string(r) +
                               " is outside expert_out's rows [0, " + std::to_string(R) + ")");
    }
  return Status::ok();
}

size_t workspace_bytes(const MoeCombineArgs&, const MoeCombineOptions&) { return 0; }

Status run(const MoeCombineArgs& a, const MoeCombineOptions& o, void*, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  if (a.expert_out.device.is_cuda()) {
    ENCORE_RETURN_IF_ERROR(checks::device_memory({{"expert_out", &a.expert_out}, {"slot_rows", &a.slot_rows}, {"topk_weights", &a.topk_weights},
                                                  {"out", &a.out}}));
#ifdef ENCORE_WITH_CUDA
    return moe::cuda_combine(moe::make_combine_problem(a), a.expert_out.shape[0], a.expert_out.device.index, stream);
#endif
  }
  (void)stream;
  reference::moe_combine(moe::make_combine_problem(a));
  return Status::ok();
}

}  // namespace encore
