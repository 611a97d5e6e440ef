// Launch of the split-row RMSNorm paths: two launches (partial, finish) or one cooperative launch
// with a grid barrier. T in {bf16, fp16, fp32} x {plain, add} x 3 phases.
#include <cuda_runtime.h>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "norm/cuda/launch.hpp"
#include "norm/cuda/rms_norm_split_kernel.cuh"

namespace encore::cuda {
namespace {

template <typename T, bool kAdd>
Status launch_typed(const norm::RmsNormProblem& p, bool barrier, void* workspace, cudaStream_t stream) {
  const RmsNormParams<T> k = make_rms_norm_params<T>(p);
  auto* state = static_cast<GridBarrierState*>(workspace);
  float* partials = reinterpret_cast<float*>(static_cast<char*>(workspace) + norm::kSplitRowBarrierBytes);
  const unsigned slices = unsigned(norm::split_row_slices(p.hidden, p.dtype));
  if (barrier) {
    auto fn = rms_norm_split_kernel<T, kAdd, SplitPhase::kFused>;
    int per_sm = 0, sms = 0;
    ENCORE_RETURN_IF_ERROR(call_result("rms_norm split-row barrier", "cudaDeviceGetAttribute(MultiProcessorCount)",
                                       cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, p.device_index)));
    ENCORE_RETURN_IF_ERROR(call_result("rms_norm split-row barrier", "cudaOccupancyMaxActiveBlocksPerMultiprocessor",
                                       cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kSplitThreads, 0)));
    if (int64_t(slices) > int64_t(per_sm) * sms)
      return Status::unsupported("x: hidden " + std::to_string(p.hidden) + " needs " + std::to_string(slices) +
                                 " co-resident blocks for the grid barrier; at most " + std::to_string(per_sm * sms) + " fit");
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(slices);
    cfg.blockDim = dim3(kSplitThreads);
    cfg.stream = stream;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeCooperative;
    attr.val.cooperative = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    return launch_api("rms_norm split-row (cooperative, grid barrier)", [&] { return cudaLaunchKernelEx(&cfg, fn, k, partials, state); });
  }
  ENCORE_RETURN_IF_ERROR(launch("rms_norm split-row partial", [&] {
    rms_norm_split_kernel<T, kAdd, SplitPhase::kPartial><<<slices, kSplitThreads, 0, stream>>>(k, partials, state);
  }));
  return launch("rms_norm split-row finish", [&] {
    rms_norm_split_kernel<T, kAdd, SplitPhase::kFinish><<<slices, kSplitThreads, 0, stream>>>(k, partials, state);
  });
}

template <typename T>
Status launch_add_or_plain(const norm::RmsNormProblem& p, bool barrier, void* workspace, cudaStream_t s) {
  return p.residual ? launch_typed<T, true>(p, barrier, workspace, s) : launch_typed<T, false>(p, barrier, workspace, s);
}

}  // namespace

Status zero_split_barrier(void* workspace, int device_index, Stream stream) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  return call_result("rms_norm split-row barrier workspace", "cudaMemsetAsync",
                     cudaMemsetAsync(workspace, 0, norm::kSplitRowBarrierBytes, static_cast<cudaStream_t>(stream)));
}

Status launch_rms_norm_split(const norm::RmsNormProblem& p, bool barrier, void* workspace, Stream stream) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(p.device_index));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kBF16: return launch_add_or_plain<__nv_bfloat16>(p, barrier, workspace, s);
    case DType::kFP16: return launch_add_or_plain<__half>(p, barrier, workspace, s);
    case DType::kFP32: return launch_add_or_plain<float>(p, barrier, workspace, s);
    default: return Status::internal("rms_norm split-row: unsupported dtype");
  }
}

}  // namespace encore::cuda
