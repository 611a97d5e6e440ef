// Instantiations and launch of the FP8 group-quantization kernel, T in {bf16, fp16, fp32} x groups
// per thread {1, 2, 4, 8} x 16-byte packs per lane {1, 2} x {row order, row tiles}; the variants the
// plan does not pick are there for the quant_plans sweep.
// The rule is in quant::plan_fp8_group_quant (quant/plan.cpp).
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "quant/cuda/fp8_group_quant_kernel.cuh"
#include "quant/cuda/launch.hpp"

namespace encore::cuda {
namespace {

template <typename T, int kPacks, bool kTiled>
void (*pick_kernel(int groups_per_thread))(Fp8QuantParams<T>) {
  switch (groups_per_thread) {
    case 1: return fp8_group_quant_kernel<T, 1, kPacks, kTiled>;
    case 2: return fp8_group_quant_kernel<T, 2, kPacks, kTiled>;
    case 4: return fp8_group_quant_kernel<T, 4, kPacks, kTiled>;
    case 8: return fp8_group_quant_kernel<T, 8, kPacks, kTiled>;
    default: return nullptr;
  }
}

template <typename T, bool kTiled>
void (*pick_kernel(int groups_per_thread, int packs_per_lane))(Fp8QuantParams<T>) {
  if (packs_per_lane == 1) return pick_kernel<T, 1, kTiled>(groups_per_thread);
  if (packs_per_lane == 2) return pick_kernel<T, 2, kTiled>(groups_per_thread);
  return nullptr;
}

template <typename T>
Status make_params(const quant::Fp8QuantProblem& p, const quant::Fp8QuantLaunchPlan& plan, Fp8QuantParams<T>* out) {
  Fp8QuantParams<T>& k = *out;
  k = Fp8QuantParams<T>{};
  k.x = static_cast<const T*>(p.x);
  k.x_stride = p.x_stride;
  k.q = p.q;
  k.q_stride = p.q_stride;
  k.scales = p.scales;
  k.scale_stride_m = p.scale_stride_m;
  k.scale_stride_g = p.scale_stride_g;
  k.groups_per_row = uint32_t(p.cols / kFp8GroupSize);
  k.rows = uint32_t(p.rows);
  k.tile_rows_log2 = 0;
  while ((1 << k.tile_rows_log2) < plan.tile_rows) ++k.tile_rows_log2;
  if ((1 << k.tile_rows_log2) != plan.tile_rows || plan.tile_rows > 64)
    return Status::internal("fp8_group_quant: tile_rows must be a power of two <= 64, got " + std::to_string(plan.tile_rows));
  const int64_t padded = quant::fp8_numbered_groups(p.rows, p.cols, plan.tile_rows);
  if (padded >= (int64_t(1) << 31))
    return Status::internal("fp8_group_quant: " + std::to_string(padded) + " numbered groups with tile_rows " +
                            std::to_string(plan.tile_rows) + " (must be < 2^31)");
  k.tile_of_group = FastDiv31(k.groups_per_row << k.tile_rows_log2);
  k.num_groups = uint32_t(padded);
  k.power_of_two = p.power_of_two;
  k.eps = p.eps;
  return Status::ok();
}

template <typename T>
Status launch_typed(const quant::Fp8QuantProblem& p, const quant::Fp8QuantLaunchPlan& plan, cudaStream_t stream) {
  Fp8QuantParams<T> k;
  ENCORE_RETURN_IF_ERROR(make_params(p, plan, &k));
  void (*fn)(Fp8QuantParams<T>) = plan.tile_rows > 1 ? pick_kernel<T, true>(plan.groups_per_thread, plan.packs_per_lane)
                                                     : pick_kernel<T, false>(plan.groups_per_thread, plan.packs_per_lane);
  if (!fn)
    return Status::internal("fp8_group_quant: no kernel for " + std::to_string(plan.groups_per_thread) + " groups per thread, " +
                            std::to_string(plan.packs_per_lane) + " packs per lane");
  return launch("fp8_group_quant", [&] { fn<<<dim3(unsigned(plan.grid)), dim3(plan.threads), 0, stream>>>(k); });
}

}  // namespace

Status fp8_group_quant_kernel_params(const quant::Fp8QuantProblem& p, const quant::Fp8QuantLaunchPlan& plan, void* out) {
  using Params = Fp8QuantParams<float>;  // the same layout for every T: pointers and scalars only
  static_assert(sizeof(Params) == sizeof(Fp8QuantParams<__nv_bfloat16>) && sizeof(Params) <= kFp8QuantParamsMaxBytes);
  Params k;
  ENCORE_RETURN_IF_ERROR(make_params(p, plan, &k));
  std::memcpy(out, &k, sizeof(k));
  return Status::ok();
}

Status launch_fp8_group_quant(const quant::Fp8QuantProblem& p, const quant::Fp8QuantLaunchPlan& plan, Stream stream) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(p.device_index));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kBF16: return launch_typed<__nv_bfloat16>(p, plan, s);
    case DType::kFP16: return launch_typed<__half>(p, plan, s);
    case DType::kFP32: return launch_typed<float>(p, plan, s);
    default: return Status::internal(std::string("fp8_group_quant: no CUDA kernel for dtype ") + dtype_name(p.dtype));
  }
}

}  // namespace encore::cuda
