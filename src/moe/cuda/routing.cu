// MoE routing on CUDA: the ahead-of-time instantiations of moe_routing_kernel (routing_kernel.cuh,
// also the JIT's source) and their launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "moe/cuda/launch.hpp"
#include "moe/cuda/routing_kernel.cuh"

namespace encore::cuda {
namespace {

static_assert(kMoeRoutingBlock == kRoutingWarps * 32, "launch.hpp's block size");

template <typename TL>
void* pick(int per_lane) {
  switch (per_lane) {
    case 1: return reinterpret_cast<void*>(moe_routing_kernel<1, TL>);
    case 2: return reinterpret_cast<void*>(moe_routing_kernel<2, TL>);
    case 4: return reinterpret_cast<void*>(moe_routing_kernel<4, TL>);
    case 8: return reinterpret_cast<void*>(moe_routing_kernel<8, TL>);
    case 16: return reinterpret_cast<void*>(moe_routing_kernel<16, TL>);
    default: return nullptr;
  }
}

RoutingParams make_params(const moe::RoutingProblem& p) {
  RoutingParams k{};
  k.logits = p.logits;
  k.logits_stride = p.logits_stride;
  k.bias = p.bias;
  k.bias_bf16 = p.bias_dtype == DType::kBF16;
  k.bias_stride = p.bias_stride;
  k.ids = p.topk_ids;
  k.ids_stride = p.ids_stride;
  k.weights = p.topk_weights;
  k.weights_stride = p.weights_stride;
  k.tokens = p.tokens;
  k.E = p.num_experts;
  k.k = p.top_k;
  k.sigmoid = p.sigmoid;
  k.renormalize = p.renormalize;
  k.n_group = p.n_group;
  k.topk_group = p.topk_group;
  k.scale = p.routed_scaling_factor;
  return k;
}

}  // namespace

size_t moe_routing_smem_bytes(int num_experts) { return size_t(kRoutingWarps) * size_t(num_experts) * (sizeof(double) + sizeof(int)); }
long long moe_routing_grid(int64_t tokens) { return (tokens + kRoutingWarps - 1) / kRoutingWarps; }

size_t moe_routing_kernel_params(const moe::RoutingProblem& p, void* out) {
  static_assert(sizeof(RoutingParams) <= kMoeRoutingParamsMaxBytes);
  const RoutingParams k = make_params(p);
  std::memcpy(out, &k, sizeof(k));
  return sizeof(k);
}

Status launch_moe_routing(const moe::RoutingProblem& p, int device_index, Stream stream) {
  if (p.tokens == 0) return Status::ok();
  if (p.num_experts < 1 || p.num_experts > moe::kCudaRoutingMaxExperts)
    return Status::unsupported("moe routing: E = " + std::to_string(p.num_experts) + " experts; the CUDA kernel takes at most " +
                               std::to_string(moe::kCudaRoutingMaxExperts));
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  RoutingParams k = make_params(p);
  const int per_lane = moe::routing_per_lane(p.num_experts);
  void* fn = nullptr;
  switch (p.logits_dtype) {
    case DType::kFP32: fn = pick<float>(per_lane); break;
    case DType::kBF16: fn = pick<__nv_bfloat16>(per_lane); break;
    case DType::kFP16: fn = pick<__half>(per_lane); break;
    default: break;
  }
  if (!fn) return Status::internal(std::string("moe routing: no CUDA kernel for logits dtype ") + dtype_name(p.logits_dtype));
  const size_t smem = moe_routing_smem_bytes(p.num_experts);
  const unsigned grid = unsigned(moe_routing_grid(p.tokens));
  void* args[] = {&k};
  return launch_api("moe routing", [&] {
    return cudaLaunchKernel(fn, dim3(grid), dim3(kRoutingWarps * 32), args, smem, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace encore::cuda
