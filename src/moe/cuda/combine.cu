// MoE combine on CUDA: the ahead-of-time instantiations of moe_combine_kernel (combine_kernel.cuh, also
// the JIT's source) and their launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "moe/cuda/combine_kernel.cuh"
#include "moe/cuda/launch.hpp"

namespace encore::cuda {
namespace {

static_assert(kMoeCombineBlock == kCombineThreads, "launch.hpp's block size");

template <typename TI, typename TO>
void* pick(bool vec) {
  return vec ? reinterpret_cast<void*>(moe_combine_kernel<TI, TO, 8>) : reinterpret_cast<void*>(moe_combine_kernel<TI, TO, 1>);
}

template <typename TI>
void* pick_out(DType out, bool vec) {
  switch (out) {
    case DType::kFP32: return pick<TI, float>(vec);
    case DType::kBF16: return pick<TI, __nv_bfloat16>(vec);
    case DType::kFP16: return pick<TI, __half>(vec);
    default: return nullptr;
  }
}

bool aligned_rows(const void* base, int64_t stride, DType t, int64_t hidden) {
  const size_t esz = dtype_size(t), bytes = 8 * esz;
  return hidden % 8 == 0 && (size_t(stride) * esz) % bytes == 0 && reinterpret_cast<uintptr_t>(base) % bytes == 0;
}

CombineParams make_params(const moe::CombineProblem& p, int64_t eo_rows) {
  CombineParams k{};
  k.eo = p.expert_out;
  k.eo_stride = p.eo_stride;
  k.eo_rows = eo_rows;
  k.slot_rows = p.slot_rows;
  k.slot_stride = p.slot_stride;
  k.weights = p.weights;
  k.weights_stride = p.weights_stride;
  k.out = p.out;
  k.out_stride = p.out_stride;
  k.tokens = p.tokens;
  k.hidden = p.hidden;
  k.k = p.top_k;
  return k;
}

}  // namespace

bool moe_combine_vectorized(const moe::CombineProblem& p) {
  return aligned_rows(p.expert_out, p.eo_stride, p.eo_dtype, p.hidden) && aligned_rows(p.out, p.out_stride, p.out_dtype, p.hidden);
}

long long moe_combine_grid(const moe::CombineProblem& p, bool vec) {
  const int64_t items = p.tokens * (vec ? p.hidden / 8 : p.hidden);
  const int64_t cap = int64_t(1) << 20;  // blocks; a grid-stride loop beyond
  const int64_t blocks = (items + kCombineThreads - 1) / kCombineThreads;
  return blocks < cap ? blocks : cap;
}

size_t moe_combine_kernel_params(const moe::CombineProblem& p, int64_t eo_rows, void* out) {
  static_assert(sizeof(CombineParams) <= kMoeCombineParamsMaxBytes);
  const CombineParams k = make_params(p, eo_rows);
  std::memcpy(out, &k, sizeof(k));
  return sizeof(k);
}

Status launch_moe_combine(const moe::CombineProblem& p, int64_t eo_rows, int device_index, Stream stream) {
  if (p.tokens == 0 || p.hidden == 0) return Status::ok();
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  CombineParams k = make_params(p, eo_rows);
  const bool vec = moe_combine_vectorized(p);
  void* fn = nullptr;
  switch (p.eo_dtype) {
    case DType::kFP32: fn = pick_out<float>(p.out_dtype, vec); break;
    case DType::kBF16: fn = pick_out<__nv_bfloat16>(p.out_dtype, vec); break;
    case DType::kFP16: fn = pick_out<__half>(p.out_dtype, vec); break;
    default: break;
  }
  if (!fn) return Status::internal(std::string("moe combine: no CUDA kernel for ") + dtype_name(p.eo_dtype) + " -> " + dtype_name(p.out_dtype));
  const unsigned grid = unsigned(moe_combine_grid(p, vec));
  void* args[] = {&k};
  return launch_api("moe combine", [&] { return cudaLaunchKernel(fn, dim3(grid), dim3(kCombineThreads), args, 0, static_cast<cudaStream_t>(stream)); });
}

}  // namespace encore::cuda
