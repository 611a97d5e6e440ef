// The shared launch check of every CUDA kernel launch in encore: the test seam before the launch
// (core/fault_injection.hpp; an injected failure enqueues nothing), then the launch's own error
// without a sync (cudaGetLastError after <<<>>>, or the cudaError_t a launch API returned), as a
// Status::cuda_error "<kernel>: kernel launch failed: cudaErrorX (code): description". A failed
// call's error is cleared from the thread's last-error slot so that a later check does not report it
// again (a sticky error stays: every later call reports it).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "core/fault_injection.hpp"
#include "encore/core/status.hpp"

namespace encore::cuda {

// "<what>: <step> failed: <cudaGetErrorName> (<code>): <cudaGetErrorString>".
inline Status cuda_failure(const char* what, const char* step, cudaError_t e) {
  (void)cudaGetLastError();
  return Status::cuda_error(fault::failure_message(what, step, cudaGetErrorName(e), int(e), cudaGetErrorString(e)));
}
inline Status cuda_failure(const std::string& what, const char* step, cudaError_t e) { return cuda_failure(what.c_str(), step, e); }

// The test seam of a kernel launch (before it): OK unless a test armed Step::kKernelLaunch.
inline Status launch_gate(const char* what) {
  return fault::inject(fault::Step::kKernelLaunch, what) ? fault::injected(fault::Step::kKernelLaunch, what) : Status::ok();
}

// After a <<<>>> launch: its error, if any (no sync).
inline Status launch_status(const char* what) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::ok() : cuda_failure(what, "kernel launch", e);
}

// The result of a launch API (cudaLaunchKernel, cudaLaunchKernelEx, ...).
inline Status launch_result(const char* what, cudaError_t e) { return e == cudaSuccess ? Status::ok() : cuda_failure(what, "kernel launch", e); }

// The seam, then `enqueue()` (one <<<>>> launch), then its status.
template <class F>
Status launch(const char* what, F&& enqueue) {
  ENCORE_RETURN_IF_ERROR(launch_gate(what));
  enqueue();
  return launch_status(what);
}

// A cudaLaunchKernelEx configuration (grid, block, dynamic shared memory, stream), a programmatic
// dependent launch when `pdl` (the kernel's side: common/cuda/pdl.cuh); `attr` holds the attribute and
// must outlive the launch call.
inline cudaLaunchConfig_t pdl_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl, cudaLaunchAttribute& attr) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = stream;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = pdl ? &attr : nullptr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cfg;
}

// The seam, then `enqueue()` returning a launch API's cudaError_t, then its status.
template <class F>
Status launch_api(const char* what, F&& enqueue) {
  ENCORE_RETURN_IF_ERROR(launch_gate(what));
  return launch_result(what, enqueue());
}

namespace detail {
// The shared-memory attributes set so far, per (kernel, device): the largest size and whether the
// carveout was set. cudaFuncSetAttribute costs about a microsecond a call; a launch path sets each
// kernel's attributes once per device, not on every call.
struct SmemAttribute {
  const void* kernel;
  int device;
  size_t bytes;
  bool carveout;
};
inline std::mutex& smem_attribute_mutex() {
  static std::mutex m;
  return m;
}
inline std::vector<SmemAttribute>& smem_attributes() {
  static std::vector<SmemAttribute> set;
  return set;
}
}  // namespace detail

// cudaFuncSetAttribute(kernel, MaxDynamicSharedMemorySize, bytes) on the current device, checked; with
// max_carveout also the largest shared-memory carveout (kernels that count on several blocks an SM at
// their size). Once per kernel and device: a later call asking no more than what is set returns at once.
template <class Kernel>
Status set_dynamic_smem(const char* what, Kernel* kernel, size_t bytes, bool max_carveout = false) {
  const void* f = (const void*)kernel;  // a __global__ function or an untyped kernel pointer
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return cuda_failure(what, "reading the current device", e);
  std::lock_guard<std::mutex> lock(detail::smem_attribute_mutex());
  std::vector<detail::SmemAttribute>& set = detail::smem_attributes();
  auto it = std::find_if(set.begin(), set.end(), [&](const detail::SmemAttribute& a) { return a.kernel == f && a.device == device; });
  if (it != set.end() && it->bytes >= bytes && (it->carveout || !max_carveout)) return Status::ok();
  const size_t want = it != set.end() ? std::max(it->bytes, bytes) : bytes;
  e = cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, int(want));
  if (e != cudaSuccess) return cuda_failure(what, "setting the dynamic shared-memory size", e);
  const bool carveout = max_carveout || (it != set.end() && it->carveout);
  if (max_carveout) e = cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (e != cudaSuccess) return cuda_failure(what, "setting the shared-memory carveout", e);
  if (it != set.end()) *it = {f, device, want, carveout};
  else set.push_back({f, device, want, carveout});
  return Status::ok();
}

// A stream-ordered call's result (cudaMemsetAsync, cudaMemcpyAsync, ...).
inline Status call_result(const char* what, const char* call, cudaError_t e) { return e == cudaSuccess ? Status::ok() : cuda_failure(what, call, e); }

}  // namespace encore::cuda
