// Instantiations and launch of the FP8 group-quantization kernel, T in {bf16, fp16, fp32} x groups
// per thread {1, 2, 4, 8} x 16-byte packs per lane {1, 2} x {row order, row tiles}; the variants the
// plan does not pick are there for the quant_plans sweep.
// The rule is in plan_fp8_group_quant.
#include <cuda_runtime.h>

#include <string>

#include "cuda/common/device_guard.hpp"
#include "cuda/quant/fp8_group_quant_kernel.cuh"
#include "cuda/quant/fp8_group_quant_launch.hpp"

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
  k.rows = uint32_t(p.rows);
  k.tile_rows_log2 = 0;
  while ((1 << k.tile_rows_log2) < plan.tile_rows) ++k.tile_rows_log2;
  if ((1 << k.tile_rows_log2) != plan.tile_rows || plan.tile_rows > 64)
    return Status::internal("fp8_group_quant: tile_rows must be a power of two <= 64, got " + std::to_string(plan.tile_rows));
  const int64_t padded = fp8_numbered_groups(p.rows, p.cols, plan.tile_rows);
  if (padded >= (int64_t(1) << 31))
    return Status::internal("fp8_group_quant: " + std::to_string(padded) + " numbered groups with tile_rows " +
                            std::to_string(plan.tile_rows) + " (must be < 2^31)");
  k.tile_of_group = FastDiv31(k.groups_per_row << k.tile_rows_log2);
  k.num_groups = uint32_t(padded);
  k.power_of_two = p.power_of_two;
  k.eps = p.eps;
  void (*fn)(Fp8QuantParams<T>) = plan.tile_rows > 1 ? pick_kernel<T, true>(plan.groups_per_thread, plan.packs_per_lane)
                                                     : pick_kernel<T, false>(plan.groups_per_thread, plan.packs_per_lane);
  if (!fn)
    return Status::internal("fp8_group_quant: no kernel for " + std::to_string(plan.groups_per_thread) + " groups per thread, " +
                            std::to_string(plan.packs_per_lane) + " packs per lane");
  fn<<<dim3(unsigned(plan.grid)), dim3(plan.threads), 0, stream>>>(k);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status::cuda_error(std::string("fp8_group_quant launch: ") + cudaGetErrorString(e));
  return Status::ok();
}

}  // namespace

int64_t fp8_numbered_groups(int64_t rows, int64_t cols, int tile_rows) {
  return (rows + tile_rows - 1) / tile_rows * tile_rows * (cols / kFp8GroupSize);
}

long long fp8_full_grid(const Fp8QuantLaunchPlan& plan, DType dtype, int64_t numbered_groups) {
  const int64_t per_block = int64_t(plan.threads / fp8_lanes_per_group(dtype, plan.packs_per_lane)) * plan.groups_per_thread;
  return (numbered_groups + per_block - 1) / per_block;
}

Fp8QuantLaunchPlan plan_fp8_group_quant(const quant::Fp8QuantProblem& p, int sm_count) {
  Fp8QuantLaunchPlan plan;
  // Column-major scales (consecutive rows adjacent): groups numbered by tiles of 16 rows, so a
  // block's scale stores fill whole sectors; row order otherwise (and below 16 rows).
  const bool column_major = p.scale_stride_m == 1 && p.scale_stride_g != 1;
  plan.tile_rows = column_major && p.rows >= 16 && fp8_numbered_groups(p.rows, p.cols, 16) < (int64_t(1) << 31) ? 16 : 1;
  const int64_t num_groups = fp8_numbered_groups(p.rows, p.cols, plan.tile_rows);
  // From a few waves up two 16-byte packs per lane (8 lanes per bf16 group, 16-byte stores) and one
  // group per lane group in 128-thread blocks: quant_plans sweep at 4096 x 7168 86.1% of copy vs
  // 84.7% with 256 threads and 82.6% for the best one-pack plan; 92.5% at 16384 x 7168
  // (bench/results/2026-11-29-h200-quant-quant_plans-packs2-b891e0e.json).
  const bool large = num_groups * fp8_lanes_per_group(p.dtype, 1) >= int64_t(sm_count) * 2048;
  plan.packs_per_lane = large && p.dtype != DType::kFP32 ? 2 : 1;
  plan.threads = large ? 128 : 256;
  plan.groups_per_thread = 1;
  plan.grid = fp8_full_grid(plan, p.dtype, num_groups);
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
