// The host steps of a CUTLASS 3.x Sm90 GEMM (the GEMM-epilogue family's and MoE's grouped GEMMs), each
// failure a Status naming the kernel, the step and the code, with the test seam before each step
// (core/fault_injection.hpp):
//   can_implement -> Params (the TMA descriptors checked: CUTLASS's descriptor creation only prints
//   "Failed to initialize the TMA descriptor" and leaves the descriptor zero) -> launch.
// The launch is encore's own cudaLaunchKernelExC of cutlass::device_kernel (the cluster shape as a
// launch attribute), so the launch's error comes back: GemmUniversalAdapter::run reads and clears it.
#pragma once
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "common/cuda/launch_check.hpp"
#include "core/fault_injection.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "encore/core/status.hpp"

namespace encore::cuda::cutlass_steps {

// "<what>: <step> failed: <cutlass status> (<n>)" plus the CUDA error CUTLASS left, if any.
inline Status failure(const char* what, const char* step, cutlass::Status s, StatusCode code = StatusCode::kCudaError) {
  const cudaError_t e = cudaGetLastError();
  const std::string cuda = e == cudaSuccess ? "" : std::string("CUDA ") + cudaGetErrorName(e) + " (" + std::to_string(int(e)) + "): " +
                                                       cudaGetErrorString(e);
  return Status(code, fault::failure_message(what, step, cutlass::cutlassGetStatusString(s), int(s), cuda.c_str()));
}

// Adapter::can_implement(args).
template <class Adapter>
Status can_implement(const typename Adapter::Arguments& args, const char* what) {
  if (fault::inject(fault::Step::kCutlassCanImplement, what)) return fault::injected(fault::Step::kCutlassCanImplement, what);
  const cutlass::Status s = Adapter::can_implement(args);
  if (s != cutlass::Status::kSuccess)
    return failure(what, "CUTLASS can_implement (alignment or shape of this problem)", s, StatusCode::kUnsupported);
  return Status::ok();
}

// Whether a TMA descriptor was written (a failed cuTensorMapEncodeTiled leaves CUTLASS's zero-initialized one).
inline bool tma_encoded(const void* desc) {
  const auto* b = static_cast<const unsigned char*>(desc);
  for (size_t i = 0; i < sizeof(cute::TmaDescriptor); ++i)
    if (b[i] != 0) return true;
  return false;
}

// The Params' TMA descriptors of A and B, and of C and D where the arguments give them.
template <class Kernel>
Status check_tma_descriptors(const typename Kernel::Params& params, const typename Kernel::Arguments& args, const char* what) {
  using Epilogue = typename Kernel::CollectiveEpilogue;
  using Params = typename Kernel::Params;
  const char* bad = nullptr;
  if constexpr (requires(const Params& q) { q.mainloop.tma_load_a.get_tma_descriptor(); }) {
    if (!tma_encoded(params.mainloop.tma_load_a.get_tma_descriptor())) bad = "A";
    else if (!tma_encoded(params.mainloop.tma_load_b.get_tma_descriptor())) bad = "B";
  }
  if constexpr (requires(const Params& q) { q.epilogue.tma_load_c.get_tma_descriptor(); Epilogue::is_source_supported; }) {
    if constexpr (Epilogue::is_source_supported)
      if (bad == nullptr && args.epilogue.ptr_C != nullptr && !tma_encoded(params.epilogue.tma_load_c.get_tma_descriptor())) bad = "C";
  }
  if constexpr (requires(const Params& q) { q.epilogue.tma_store_d.get_tma_descriptor(); Epilogue::is_destination_supported; }) {
    if constexpr (Epilogue::is_destination_supported)
      if (bad == nullptr && args.epilogue.ptr_D != nullptr && !tma_encoded(params.epilogue.tma_store_d.get_tma_descriptor())) bad = "D";
  }
  if (bad == nullptr) return Status::ok();
  return Status::cuda_error(std::string(what) + ": CUTLASS params failed: the TMA descriptor of " + bad +
                            " was not encoded (cuTensorMapEncodeTiled refused it: an operand outside the device memory of the "
                            "current device, or no current context)");
}

// Kernel::to_underlying_arguments(args) into *out, descriptors checked.
template <class Kernel>
Status make_params(const typename Kernel::Arguments& args, typename Kernel::Params* out, const char* what) {
  if (fault::inject(fault::Step::kCutlassParams, what)) return fault::injected(fault::Step::kCutlassParams, what);
  *out = Kernel::to_underlying_arguments(args, nullptr);
  return check_tma_descriptors<Kernel>(*out, args, what);
}

// adapter.initialize(args, workspace, stream) (Params built into the adapter, its workspace set up),
// descriptors checked.
template <class Adapter>
Status initialize(Adapter& adapter, const typename Adapter::Arguments& args, void* workspace, cudaStream_t stream, const char* what) {
  if (fault::inject(fault::Step::kCutlassParams, what)) return fault::injected(fault::Step::kCutlassParams, what);
  const cutlass::Status s = adapter.initialize(args, workspace, stream);
  if (s != cutlass::Status::kSuccess) return failure(what, "CUTLASS params (initialize)", s);
  return check_tma_descriptors<typename Adapter::GemmKernel>(adapter.params(), args, what);
}

// cutlass::device_kernel<Kernel> on `stream`: the adapter's grid, the kernel's block and shared
// memory (the dynamic shared-memory attribute already set), the cluster shape as a launch attribute.
template <class Kernel>
Status launch(const typename Kernel::Params& params, cudaStream_t stream, const char* what) {
  if (fault::inject(fault::Step::kCutlassLaunch, what)) return fault::injected(fault::Step::kCutlassLaunch, what);
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Cluster = typename Kernel::DispatchPolicy::ClusterShape;
  constexpr unsigned cx = cute::size<0>(Cluster{}), cy = cute::size<1>(Cluster{}), cz = cute::size<2>(Cluster{});
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = Adapter::get_grid_shape(params);
  cfg.blockDim = Kernel::get_block_shape();
  cfg.dynamicSmemBytes = Kernel::SharedStorageSize;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if constexpr (cx * cy * cz > 1) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cx;
    attr[0].val.clusterDim.y = cy;
    attr[0].val.clusterDim.z = cz;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  void* kernel_args[] = {const_cast<void*>(static_cast<const void*>(&params))};
  const cudaError_t e = cudaLaunchKernelExC(&cfg, reinterpret_cast<const void*>(cutlass::device_kernel<Kernel>), kernel_args);
  return e == cudaSuccess ? Status::ok() : cuda_failure(what, "CUTLASS launch", e);
}

}  // namespace encore::cuda::cutlass_steps
