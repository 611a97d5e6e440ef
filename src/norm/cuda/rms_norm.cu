// Instantiations and launch of rms_norm_kernel: T in {bf16, fp16, fp32} x ({16-byte packs, element-wise}
// x kCached in {0 (streaming), 1, 2, 4, 8}, and 32-byte packs (the sm_100+ plan, widen_rms_norm_plan)
// x kCached in {1, 2, 4}) x {plain, residual add}. The plan (src/norm/rms_norm.cpp) picks one.
#include <cuda_runtime.h>

#include <cstring>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "norm/cuda/rms_norm_kernel.cuh"
#include "norm/cuda/launch.hpp"

namespace encore::cuda {
namespace {

template <typename T>
using KernelFn = void (*)(RmsNormParams<T>);

// Index of kCached in the table below: 0 -> 0, 1 -> 1, 2 -> 2, 4 -> 3, 8 -> 4.
constexpr int cached_slot(int cached) { return cached == 0 ? 0 : cached == 1 ? 1 : cached == 2 ? 2 : cached == 4 ? 3 : 4; }

template <typename T, int kVec, bool kAdd>
KernelFn<T> pick(int cached) {
  constexpr KernelFn<T> table[] = {rms_norm_kernel<T, kVec, 0, kAdd>, rms_norm_kernel<T, kVec, 1, kAdd>,
                                   rms_norm_kernel<T, kVec, 2, kAdd>, rms_norm_kernel<T, kVec, 4, kAdd>,
                                   rms_norm_kernel<T, kVec, 8, kAdd>};
  return table[cached_slot(cached)];
}

// 32-byte packs: only the cached counts widen_rms_norm_plan gives (half of 2, 4, 8); null otherwise.
template <typename T, int kVec, bool kAdd>
KernelFn<T> pick_wide(int cached) {
  constexpr KernelFn<T> table[] = {nullptr, rms_norm_kernel<T, kVec, 1, kAdd>, rms_norm_kernel<T, kVec, 2, kAdd>,
                                   rms_norm_kernel<T, kVec, 4, kAdd>, nullptr};
  return table[cached_slot(cached)];
}

template <typename T, bool kAdd>
KernelFn<T> pick(int vec_elems, int cached) {
  constexpr int kPackElems = 16 / int(sizeof(T));
  if (vec_elems == 2 * kPackElems) return pick_wide<T, 2 * kPackElems, kAdd>(cached);
  return vec_elems == 1 ? pick<T, 1, kAdd>(cached) : pick<T, kPackElems, kAdd>(cached);
}

template <typename T>
Status launch_typed(const norm::RmsNormProblem& p, const norm::RmsNormLaunchPlan& plan, cudaStream_t stream) {
  RmsNormParams<T> k = make_rms_norm_params<T>(p);
  k.warps_per_row = plan.warps_per_row;
  k.rows_per_block = plan.rows_per_block;

  constexpr int kPackElems = 16 / int(sizeof(T));
  if (plan.vec_elems != 1 && plan.vec_elems != kPackElems && plan.vec_elems != 2 * kPackElems)
    return Status::internal("rms_norm plan: vec_elems " + std::to_string(plan.vec_elems) + " not instantiated");
  KernelFn<T> fn = p.residual ? pick<T, true>(plan.vec_elems, plan.vecs_per_thread)
                              : pick<T, false>(plan.vec_elems, plan.vecs_per_thread);
  if (fn == nullptr)
    return Status::internal("rms_norm plan: 32-byte packs with " + std::to_string(plan.vecs_per_thread) + " cached packs not instantiated");
  const int threads = 32 * plan.warps_per_row * plan.rows_per_block;
  if (threads > kRmsNormMaxThreads) return Status::internal("rms_norm plan: block of " + std::to_string(threads) + " threads");

  return launch("rms_norm", [&] { fn<<<dim3(unsigned(plan.grid)), dim3(threads), 0, stream>>>(k); });
}

Status launch_on_device(const norm::RmsNormProblem& p, const norm::RmsNormLaunchPlan& plan, cudaStream_t s) {
  switch (p.dtype) {
    case DType::kBF16: return launch_typed<__nv_bfloat16>(p, plan, s);
    case DType::kFP16: return launch_typed<__half>(p, plan, s);
    case DType::kFP32: return launch_typed<float>(p, plan, s);
    default: return Status::internal(std::string("rms_norm: no CUDA kernel for dtype ") + dtype_name(p.dtype));
  }
}

}  // namespace

size_t rms_norm_kernel_params(const norm::RmsNormProblem& p, const norm::RmsNormLaunchPlan& plan, void* out) {
  using Params = RmsNormParams<float>;  // the same layout for every T: pointers and scalars only
  static_assert(sizeof(Params) == sizeof(RmsNormParams<__nv_bfloat16>) && sizeof(Params) <= kRmsNormParamsMaxBytes);
  Params k = make_rms_norm_params<float>(p);
  k.warps_per_row = plan.warps_per_row;
  k.rows_per_block = plan.rows_per_block;
  std::memcpy(out, &k, sizeof(k));
  return sizeof(k);
}

Status launch_rms_norm(const norm::RmsNormProblem& p, const norm::RmsNormLaunchPlan& plan, Stream stream) {
  DeviceGuard guard;  // launch on the tensors' device
  ENCORE_RETURN_IF_ERROR(guard.set(p.device_index));
  return launch_on_device(p, plan, static_cast<cudaStream_t>(stream));
}

}  // namespace encore::cuda
