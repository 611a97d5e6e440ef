// Instantiations and launch of the FP8 group-quantization kernel, T in {bf16, fp16, fp32} x groups
// per thread {1, 2, 4, 8}; the variants the plan does not pick are there for the quant_plans sweep.
// The rule is in plan_fp8_group_quant.
#include <cuda_runtime.h>

#include "cuda/common/device_guard.hpp"
#include "cuda/quant/fp8_group_quant_kernel.cuh"
#include "cuda/quant/fp8_group_quant_launch.hpp"

namespace encore::cuda {
namespace {

template <typename T>
Status launch_typed(const quant::Fp8QuantProblem& p, const Fp8QuantLaunchPlan& plan, cudaStream_t stream) {
  Fp8QuantParams<T> k{};
  k.x = static_cast<const T*>(p.x);
  k.x_stride = p.x_stride;
  k.q = p.q;
  k.q_stride = p.q_stride;
  k.scales = p.scales;
  k.scale_stride_m = p.scale_stride_m;
  k.scale_stride_g = p.scale_stride_g;
  k.groups_per_row = uint32_t(p.cols / kFp8GroupSize);
  k.row_of_group = FastDiv31(k.groups_per_row);
  k.num_groups = uint32_t(p.rows) * k.groups_per_row;
  k.power_of_two = p.power_of_two;
  k.eps = p.eps;
  void (*fn)(Fp8QuantParams<T>) = fp8_group_quant_kernel<T, 1>;
  if (plan.groups_per_thread == 2) fn = fp8_group_quant_kernel<T, 2>;
  if (plan.groups_per_thread == 4) fn = fp8_group_quant_kernel<T, 4>;
  if (plan.groups_per_thread == 8) fn = fp8_group_quant_kernel<T, 8>;
  fn<<<dim3(unsigned(plan.grid)), dim3(plan.threads), 0, stream>>>(k);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status::cuda_error(std::string("fp8_group_quant launch: ") + cudaGetErrorString(e));
  return Status::ok();
}

}  // namespace

Fp8QuantLaunchPlan plan_fp8_group_quant(int64_t num_groups, DType dtype, int sm_count) {
  Fp8QuantLaunchPlan plan;
  const int lanes = kFp8GroupSize / int(16 / dtype_size(dtype));
  plan.threads = 256;
  // Two groups per lane group from a few waves up: the quant_plans sweeps (H200,
  // bench/results/2026-11-29-h200-quant-qk_norm-fastdiv-4bc53df.json) measured 256 x 2 within 1%
  // of the best plan at 4096 x 7168 (25.38 us, 128 x 2: 25.34) and 16384 x 7168.
  plan.groups_per_thread = num_groups * lanes >= int64_t(sm_count) * 2048 ? 2 : 1;
  const int64_t per_block = int64_t(plan.threads / lanes) * plan.groups_per_thread;
  plan.grid = (num_groups + per_block - 1) / per_block;
  return plan;
}

Status launch_fp8_group_quant(const quant::Fp8QuantProblem& p, const Fp8QuantLaunchPlan& plan, Stream stream) {
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
