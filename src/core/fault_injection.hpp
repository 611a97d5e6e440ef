// Launch-path failures (internal): the one message format every launch path uses for a failed CUDA,
// CUTLASS, NVRTC, driver or NCCL call ("<what>: <step> failed: <code name> (<code>): <description>"),
// and the test seam that makes one of those steps fail on purpose. The seam is host state only
// (consulted before the call it stands for, so a failed step leaves the outputs untouched); it is
// armed only from tests (src/testing/fault_injection.hpp) and costs one relaxed atomic load otherwise.
#pragma once
#include <cstdint>
#include <string>

#include "encore/core/status.hpp"

namespace encore::fault {

// The steps a launch path can fail at.
enum class Step : uint8_t {
  kPointerCheck,         // a CUDA view's memory is not device memory of its device (core/device_memory.hpp)
  kCutlassCanImplement,  // CUTLASS can_implement
  kCutlassParams,        // CUTLASS Params (to_underlying_arguments / initialize: the TMA descriptors)
  kCutlassLaunch,        // the CUTLASS kernel's launch
  kKernelLaunch,         // any other kernel launch (<<<>>>, cudaLaunchKernel*, cuLaunchKernel)
  kNvrtcCompile,         // NVRTC compilation of a JIT kernel
  kModuleLoad,           // cuModuleLoadData / cuModuleGetFunction of a JIT kernel
  kNccl,                 // an NCCL call
};
constexpr int kStepCount = 8;

// "pointer check", "CUTLASS can_implement", ... (what the messages say).
const char* step_name(Step s);

// Whether the armed seam fails `step` for the call named `what` now (consumes one armed failure).
// False at the cost of one relaxed atomic load when nothing is armed.
bool inject(Step step, const char* what);

// The Status of an injected failure: "<what>: <step> failed: injected fault (test seam)", with the
// code the real failure of that step returns (invalid argument for the pointer check, unsupported for
// can_implement, internal for NVRTC and NCCL, cuda error for the others).
Status injected(Step step, const char* what);

// "<what>: <step> failed: <code_name> (<code>): <description>" (code_name or description may be null).
std::string failure_message(const char* what, const char* step, const char* code_name, long long code, const char* description);

}  // namespace encore::fault
