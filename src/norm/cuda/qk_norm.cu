// Instantiations and launch of qk_norm_kernel: T in {bf16, fp16} x head_dim {64, 128, 256} x
// {no offset, offset} x heads per thread {1, 2, 4} x {16-byte, 32-byte lane accesses (the sm_100+
// plan, widen_qk_norm_plan)}. norm::plan_qk_norm (src/norm/plan.cpp) picks one.
#include <cuda_runtime.h>

#include <cstring>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "norm/cuda/qk_norm_kernel.cuh"
#include "norm/cuda/launch.hpp"

namespace encore::cuda {
namespace {

template <typename T>
using KernelFn = void (*)(QkNormParams<T>);

template <typename T, int kHeadDim, bool kOffset, int kPackBytes>
KernelFn<T> pick_heads(int heads_per_thread) {
  switch (heads_per_thread) {
    case 1: return qk_norm_kernel<T, kHeadDim, kOffset, 1, 0, 0, kPackBytes>;
    case 2: return qk_norm_kernel<T, kHeadDim, kOffset, 2, 0, 0, kPackBytes>;
    case 4: return qk_norm_kernel<T, kHeadDim, kOffset, 4, 0, 0, kPackBytes>;
    default: return nullptr;
  }
}

template <typename T, int kHeadDim, int kPackBytes>
KernelFn<T> pick_offset(bool offset, int heads_per_thread) {
  return offset ? pick_heads<T, kHeadDim, true, kPackBytes>(heads_per_thread) : pick_heads<T, kHeadDim, false, kPackBytes>(heads_per_thread);
}

template <typename T, int kHeadDim>
KernelFn<T> pick(bool offset, int heads_per_thread, int pack_bytes) {
  if (pack_bytes == 32) return pick_offset<T, kHeadDim, 32>(offset, heads_per_thread);
  return pack_bytes == 16 ? pick_offset<T, kHeadDim, 16>(offset, heads_per_thread) : nullptr;
}

template <typename T>
QkNormParams<T> make_params(const norm::QkNormProblem& p) {
  QkNormParams<T> k{};
  k.qkv = static_cast<T*>(p.qkv);
  k.token_stride = p.token_stride;
  k.q_weight = static_cast<const T*>(p.q_weight);
  k.k_weight = static_cast<const T*>(p.k_weight);
  k.heads_per_token = uint32_t(p.num_q_heads + p.num_kv_heads);
  k.token_of_head = FastDiv31(k.heads_per_token);
  k.num_heads_total = uint32_t(p.tokens * k.heads_per_token);
  k.num_q_heads = p.num_q_heads;
  k.eps = p.eps;
  k.weight_offset = p.weight_offset;
  return k;
}

template <typename T>
Status launch_typed(const norm::QkNormProblem& p, const norm::QkNormLaunchPlan& plan, cudaStream_t stream) {
  const QkNormParams<T> k = make_params<T>(p);
  const bool offset = p.weight_offset != 0.0f;
  KernelFn<T> fn = nullptr;
  switch (p.head_dim) {
    case 64: fn = pick<T, 64>(offset, plan.heads_per_thread, plan.pack_bytes); break;
    case 128: fn = pick<T, 128>(offset, plan.heads_per_thread, plan.pack_bytes); break;
    case 256: fn = pick<T, 256>(offset, plan.heads_per_thread, plan.pack_bytes); break;
  }
  if (!fn) return Status::internal("qk_norm: no kernel for head_dim " + std::to_string(p.head_dim) + ", heads/thread " +
                                   std::to_string(plan.heads_per_thread) + ", " + std::to_string(plan.pack_bytes) + "-byte packs");
  return launch("qk_norm", [&] { fn<<<dim3(unsigned(plan.grid)), dim3(plan.threads), 0, stream>>>(k); });
}

}  // namespace

size_t qk_norm_kernel_params(const norm::QkNormProblem& p, void* out) {
  using Params = QkNormParams<__nv_bfloat16>;  // the same layout for __half: pointers and scalars only
  static_assert(sizeof(Params) == sizeof(QkNormParams<__half>) && sizeof(Params) <= kQkNormParamsMaxBytes);
  const Params k = make_params<__nv_bfloat16>(p);
  std::memcpy(out, &k, sizeof(k));
  return sizeof(k);
}

Status launch_qk_norm(const norm::QkNormProblem& p, const norm::QkNormLaunchPlan& plan, Stream stream) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(p.device_index));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kBF16: return launch_typed<__nv_bfloat16>(p, plan, s);
    case DType::kFP16: return launch_typed<__half>(p, plan, s);
    default: return Status::internal(std::string("qk_norm: no CUDA kernel for dtype ") + dtype_name(p.dtype));
  }
}

}  // namespace encore::cuda
