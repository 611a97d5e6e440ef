// The shared launch check of every CUDA kernel launch in encore: the test seam before the launch
// (core/fault_injection.hpp; an injected failure enqueues nothing), then the launch's own error
// without a sync (cudaGetLastError after <<<>>>, or the cudaError_t a launch API returned), as a
// Status::cuda_error "<kernel>: kernel launch failed: cudaErrorX (code): description". A failed
// call's error is cleared from the thread's last-error slot so that a later check does not report it
// again (a sticky error stays: every later call reports it).
#pragma once
#include <cuda_runtime.h>

#include <string>

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

// The seam, then `enqueue()` returning a launch API's cudaError_t, then its status.
template <class F>
Status launch_api(const char* what, F&& enqueue) {
  ENCORE_RETURN_IF_ERROR(launch_gate(what));
  return launch_result(what, enqueue());
}

// cudaFuncSetAttribute(kernel, MaxDynamicSharedMemorySize, bytes), checked; with max_carveout also the
// largest shared-memory carveout (kernels that count on several blocks an SM at their size).
template <class Kernel>
Status set_dynamic_smem(const char* what, Kernel* kernel, size_t bytes, bool max_carveout = false) {
  const void* f = (const void*)kernel;  // a __global__ function or an untyped kernel pointer
  cudaError_t e = cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (e != cudaSuccess) return cuda_failure(what, "setting the dynamic shared-memory size", e);
  if (max_carveout) e = cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  return e == cudaSuccess ? Status::ok() : cuda_failure(what, "setting the shared-memory carveout", e);
}

// A stream-ordered call's result (cudaMemsetAsync, cudaMemcpyAsync, ...).
inline Status call_result(const char* what, const char* call, cudaError_t e) { return e == cudaSuccess ? Status::ok() : cuda_failure(what, call, e); }

}  // namespace encore::cuda
