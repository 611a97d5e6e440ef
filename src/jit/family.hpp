// What every JIT-specialized kernel family shares (docs/jit.md, "Policy"): the policy (ENCORE_JIT or
// a test hook), the dispatcher's (variant, device) -> function map with remembered failures, the
// launch with its counter, the graph-capture rule and the once-per-family fallback message; and
// KernelSpec construction from the embedded headers. A family owns one static Family.
#pragma once
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "encore/core/dtype.hpp"
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "jit/jit.hpp"

namespace encore::jit {

// kEnv reads ENCORE_JIT (0 off; unset or 1 auto = JIT for shapes outside the AOT list; 2 / always =
// every shape); the others override it for the process (tests, bench).
enum class JitPolicy { kEnv, kOff, kAuto, kAlways };

// The CUDA spelling of a kernel element type: __nv_bfloat16, __half, float.
const char* device_type_name(DType t);

// A spec compiling `name_expression` from a two-line translation unit that includes `main_header`;
// `headers` (include paths as the kernels write them) are taken from the embedded sources (one
// missing from this build becomes an #error naming it), plus stand-ins for the few host headers
// the kernels include (<cstdint>, <cstddef>, <cmath>, <type_traits>: NVRTC has none of them).
KernelSpec embedded_spec(std::string name, const std::string& main_header, std::initializer_list<const char*> headers,
                         std::string name_expression);
// The stand-in host headers (include name, contents).
const std::vector<std::pair<std::string, std::string>>& rtc_std_headers();

class Family {
 public:
  explicit Family(std::string name) : name_(std::move(name)) {}
  const std::string& name() const { return name_; }

  void set_policy(JitPolicy p) { policy_ = p; }
  // The policy in force (kEnv resolved from ENCORE_JIT; never kEnv).
  JitPolicy policy() const;
  // Whether the dispatcher takes the JIT path: JIT on, NVRTC present, and the shape outside the
  // ahead-of-time list (auto) or any shape (always).
  bool uses_jit(bool shape_in_aot_list) const;

  // The loaded function of a variant on `device`: `variant_key` identifies the variant within the
  // family (an injective packing of its fields); `make_spec()` is called only on a miss. A failure
  // is remembered (not retried per call) unless the stream was capturing a graph.
  template <typename MakeSpec>
  Status function(uint64_t variant_key, int device, Stream stream, MakeSpec&& make_spec, void** fn, Origin* origin = nullptr,
                  double* ms = nullptr) {
    Status found;
    if (lookup(variant_key, device, fn, &found, origin, ms)) return found;
    return load(variant_key, device, stream, make_spec(), fn, origin, ms);
  }
  // Warm-up: device >= 0 loads on that device (into the map above); device < 0 compiles the cubin
  // for `arch` only (no GPU needed).
  Status warm(uint64_t variant_key, const KernelSpec& spec, int device, const std::string& arch, Origin* origin, double* ms);

  // cuLaunchKernel of `fn` with one by-value kernel argument at `params` and `smem` bytes of dynamic
  // shared memory, with `device` current; counts the launch.
  Status launch(void* fn, long long grid, int block, int device, Stream stream, void* params, size_t smem = 0);
  int64_t launch_count() const { return launches_.load(); }

  // The dispatcher's step after a JIT launch returned `st`: true when it must return `st` (the JIT
  // kernel ran, or it was refused during a graph capture under an explicit JIT policy, whose message
  // names `encore jit warmup`); false after a failure, or a capture refusal under the default policy
  // (ENCORE_JIT unset), each printed once per family: run the ahead-of-time kernel.
  bool handled(const Status& st, Stream stream);

 private:
  bool capture_falls_back() const;  // policy kEnv with ENCORE_JIT unset (JitMode::kDefault)
  bool lookup(uint64_t key, int device, void** fn, Status* st, Origin* origin, double* ms);
  Status load(uint64_t key, int device, Stream stream, const KernelSpec& spec, void** fn, Origin* origin, double* ms);

  std::string name_;
  std::atomic<JitPolicy> policy_{JitPolicy::kEnv};
  std::atomic<int64_t> launches_{0};
  std::once_flag fallback_said_;
  std::once_flag capture_said_;
  std::mutex mu_;
  std::map<std::pair<uint64_t, int>, void*> functions_;
  std::map<std::pair<uint64_t, int>, Status> failures_;
};

}  // namespace encore::jit
