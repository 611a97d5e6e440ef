// MoE routing dispatch: validate -> problem -> CPU reference or CUDA kernel (src/moe/cuda/routing.cu).
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

Status validate(const MoeRoutingArgs& a, const MoeRoutingOptions& o) {
  ENCORE_RETURN_IF_ERROR(checks::present("logits", a.logits));
  ENCORE_RETURN_IF_ERROR(checks::ndim("logits", a.logits, 2, "[T, E]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("logits", a.logits, {DType::kBF16, DType::kFP16, DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("logits", a.logits));
  const int64_t T = a.logits.shape[0], E = a.logits.shape[1];
  if (E >= (int64_t(1) << 20)) return Status::unsupported("logits: E = " + std::to_string(E) + " experts; at most 2^20 are supported");
  ENCORE_RETURN_IF_ERROR(moe::validate_routing_options(o, E));
  if (a.correction_bias.defined()) {
    ENCORE_RETURN_IF_ERROR(checks::present("correction_bias", a.correction_bias));
    ENCORE_RETURN_IF_ERROR(checks::ndim("correction_bias", a.correction_bias, 1, "[E]"));
    ENCORE_RETURN_IF_ERROR(checks::dtype_in("correction_bias", a.correction_bias, {DType::kFP32, DType::kBF16}));
    ENCORE_RETURN_IF_ERROR(checks::dim_equals("correction_bias", a.correction_bias, 0, E, "the number of experts E"));
    ENCORE_RETURN_IF_ERROR(checks::same_device("correction_bias", a.correction_bias, "logits", a.logits));
  }
  ENCORE_RETURN_IF_ERROR(moe::check_map("topk_ids", a.topk_ids, DType::kInt32, T, o.top_k, "[T, k]", "logits", a.logits));
  ENCORE_RETURN_IF_ERROR(moe::check_map("topk_weights", a.topk_weights, DType::kFP32, T, o.top_k, "[T, k]", "logits", a.logits));
  ENCORE_RETURN_IF_ERROR(moe::no_overlaps({{"topk_ids", &a.topk_ids}, {"topk_weights", &a.topk_weights}, {"logits", &a.logits},
                                           {"correction_bias", &a.correction_bias}}));
  if (a.logits.device.is_cuda()) {
    // One warp per token, the grid a 32-bit count of blocks (the token offsets are 64-bit).
    if (T >= (int64_t(1) << 31))
      return Status::unsupported("logits: T = " + std::to_string(T) + " tokens; the CUDA kernels take fewer than 2^31");
#ifdef ENCORE_WITH_CUDA
    if (E > moe::kCudaRoutingMaxExperts)
      return Status::unsupported("logits: E = " + std::to_string(E) + " experts; CUDA routing takes at most " +
                                 std::to_string(moe::kCudaRoutingMaxExperts) + " (one warp per token)");
#else
    return Status::unsupported("logits: on " + a.logits.device.to_string() + " but encore was built without CUDA (ENCORE_CUDA=OFF)");
#endif
  }
  return Status::ok();
}

size_t workspace_bytes(const MoeRoutingArgs&, const MoeRoutingOptions&) { return 0; }

Status run(const MoeRoutingArgs& a, const MoeRoutingOptions& o, void*, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  if (a.logits.device.is_cuda()) {
    ENCORE_RETURN_IF_ERROR(checks::device_memory({{"logits", &a.logits}, {"correction_bias", &a.correction_bias}, {"topk_ids", &a.topk_ids},
                                                  {"topk_weights", &a.topk_weights}}));
#ifdef ENCORE_WITH_CUDA
    return moe::cuda_routing(moe::make_routing_problem(a, o), a.logits.device.index, stream);
#endif
  }
  (void)stream;
  reference::moe_routing(moe::make_routing_problem(a, o));
  return Status::ok();
}

}  // namespace encore
