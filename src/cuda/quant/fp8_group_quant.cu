// Instantiations and launch of the FP8 group-quantization kernels, T in {bf16, fp16, fp32}: the
// register kernel (groups per thread 1, 2, 4, 8; 4 and 8 for the quant_plans sweep) and the bulk-copy
// streaming kernel (groups per lane group 1, 2, 4); the plan's rule is in plan_fp8_group_quant.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common/device_guard.hpp"
#include "cuda/quant/fp8_group_quant_bulk_kernel.cuh"
#include "cuda/quant/fp8_group_quant_kernel.cuh"
#include "cuda/quant/fp8_group_quant_launch.hpp"

namespace encore::cuda {
namespace {

template <typename T>
void (*bulk_kernel(int groups_per_lane_group))(Fp8QuantParams<T>, int) {
  if (groups_per_lane_group == 4) return fp8_group_quant_bulk_kernel<T, 4>;
  if (groups_per_lane_group == 2) return fp8_group_quant_bulk_kernel<T, 2>;
  return fp8_group_quant_bulk_kernel<T, 1>;
}

template <typename T>
int bulk_smem(int groups_per_lane_group, int slots) {
  if (groups_per_lane_group == 4) return Fp8BulkShape<T, 4>::smem_bytes(slots);
  if (groups_per_lane_group == 2) return Fp8BulkShape<T, 2>::smem_bytes(slots);
  return Fp8BulkShape<T, 1>::smem_bytes(slots);
}

template <typename T>
int bulk_blocks_per_sm(int groups_per_lane_group, int slots) {
  const int smem = bulk_smem<T>(groups_per_lane_group, slots);
  void (*fn)(Fp8QuantParams<T>, int) = bulk_kernel<T>(groups_per_lane_group);
  if (smem > 48 * 1024 && cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, 256, smem) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return blocks;
}

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
  k.num_groups = uint32_t(p.rows) * k.groups_per_row;
  k.power_of_two = p.power_of_two;
  k.eps = p.eps;
  if (plan.bulk) {
    void (*fn)(Fp8QuantParams<T>, int) = bulk_kernel<T>(plan.groups_per_thread);
    const int smem = bulk_smem<T>(plan.groups_per_thread, plan.slots);
    if (smem > 48 * 1024) {
      cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e != cudaSuccess) return Status::cuda_error(std::string("fp8_group_quant (bulk) smem attribute: ") + cudaGetErrorString(e));
    }
    fn<<<dim3(unsigned(plan.grid)), dim3(256), smem, stream>>>(k, plan.slots);
  } else {
    void (*fn)(Fp8QuantParams<T>) = fp8_group_quant_kernel<T, 1>;
    if (plan.groups_per_thread == 2) fn = fp8_group_quant_kernel<T, 2>;
    if (plan.groups_per_thread == 4) fn = fp8_group_quant_kernel<T, 4>;
    if (plan.groups_per_thread == 8) fn = fp8_group_quant_kernel<T, 8>;
    fn<<<dim3(unsigned(plan.grid)), dim3(plan.threads), 0, stream>>>(k);
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status::cuda_error(std::string("fp8_group_quant launch: ") + cudaGetErrorString(e));
  return Status::ok();
}

}  // namespace

int fp8_bulk_blocks_per_sm(DType dtype, int groups_per_thread, int slots) {
  switch (dtype) {
    case DType::kBF16: return bulk_blocks_per_sm<__nv_bfloat16>(groups_per_thread, slots);
    case DType::kFP16: return bulk_blocks_per_sm<__half>(groups_per_thread, slots);
    case DType::kFP32: return bulk_blocks_per_sm<float>(groups_per_thread, slots);
    default: return 0;
  }
}

Fp8QuantLaunchPlan plan_fp8_group_quant(int64_t num_groups, DType dtype, int sm_count) {
  Fp8QuantLaunchPlan plan;
  const int lanes = kFp8GroupSize / int(16 / dtype_size(dtype));
  plan.threads = 256;
  if (num_groups * lanes >= int64_t(sm_count) * 2048) {
    // From a few waves up: the bulk-copy streaming kernel, persistent over the resident blocks.
    // (To be confirmed by the quant_plans sweep on the H200; before it, the register kernel's best
    // plan, 256 x 2, measured 79% / 85% of copy at 4096 / 16384 x 7168.)
    plan.bulk = true;
    plan.groups_per_thread = 2;
    plan.slots = 4;
    const int per_sm = fp8_bulk_blocks_per_sm(dtype, plan.groups_per_thread, plan.slots);
    if (per_sm > 0) {
      const int64_t stage_groups = int64_t(plan.threads / lanes) * plan.groups_per_thread;
      plan.grid = std::min<int64_t>((num_groups + stage_groups - 1) / stage_groups, int64_t(sm_count) * per_sm);
      return plan;
    }
    plan.bulk = false;  // no occupancy answer: the register kernel below
  }
  plan.groups_per_thread = 1;
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
