// The per-family JIT dispatcher pieces (jit/family.hpp): policy, function map, launch, fallback.
#include "jit/family.hpp"

#include <cstdio>

#include "core/fault_injection.hpp"

#ifdef ENCORE_WITH_CUDA
#include "common/cuda/device_guard.hpp"
#endif

namespace encore::jit {

const char* device_type_name(DType t) {
  switch (t) {
    case DType::kBF16: return "__nv_bfloat16";
    case DType::kFP16: return "__half";
    default: return "float";
  }
}

const std::vector<std::pair<std::string, std::string>>& rtc_std_headers() {
  // NVRTC resolves #include <name> to a header given by that name. Only what the kernel headers use:
  // fixed-width integers (long long as in RMSNorm's prelude), size_t, the device math built-ins, and
  // the two type traits the kernels test.
  static const std::vector<std::pair<std::string, std::string>> kHeaders = {
      {"cstdint",
       "#pragma once\ntypedef signed char int8_t; typedef unsigned char uint8_t; typedef short int16_t;\n"
       "typedef unsigned short uint16_t; typedef int int32_t; typedef unsigned int uint32_t;\n"
       "typedef long long int64_t; typedef unsigned long long uint64_t;\n"
       "namespace std { using ::int8_t; using ::uint8_t; using ::int16_t; using ::uint16_t; using ::int32_t;\n"
       "using ::uint32_t; using ::int64_t; using ::uint64_t; }\n"},
      {"cstddef", "#pragma once\nnamespace std { using ::size_t; }\n"},
      {"cmath", "#pragma once\n"},  // fmaxf, frexpf, ldexpf ... are NVRTC built-ins
      {"type_traits",
       "#pragma once\nnamespace std {\n"
       "template <class A, class B> struct is_same { static constexpr bool value = false; };\n"
       "template <class A> struct is_same<A, A> { static constexpr bool value = true; };\n"
       "template <class A, class B> inline constexpr bool is_same_v = is_same<A, B>::value;\n"
       "template <bool C, class A, class B> struct conditional { using type = A; };\n"
       "template <class A, class B> struct conditional<false, A, B> { using type = B; };\n"
       "template <bool C, class A, class B> using conditional_t = typename conditional<C, A, B>::type;\n"
       "}  // namespace std\n"},
  };
  return kHeaders;
}

KernelSpec embedded_spec(std::string name, const std::string& main_header, std::initializer_list<const char*> headers,
                         std::string name_expression) {
  KernelSpec s;
  s.name = std::move(name);
  s.source = "#include \"" + main_header + "\"\n";
  s.headers = rtc_std_headers();
  for (const char* h : headers) {
    const char* text = embedded_source(h);
    s.headers.emplace_back(h, text ? text : std::string("#error \"encore jit: ") + h + " is not embedded in this build\"\n");
  }
  s.name_expression = std::move(name_expression);
  // -default-device: the host-only helpers of the shared headers (FastDiv31's constructor, dtype.hpp's
  // declarations, quant/problem.hpp's plan helpers) compile as device functions that nothing calls.
  s.options = {"-std=c++17", "-default-device"};
  return s;
}

JitPolicy Family::policy() const {
  const JitPolicy p = policy_.load(std::memory_order_relaxed);
  if (p != JitPolicy::kEnv) return p;
  const JitMode m = Jit::global().mode();
  return m == JitMode::kOff ? JitPolicy::kOff : m == JitMode::kAlways ? JitPolicy::kAlways : JitPolicy::kAuto;
}

bool Family::capture_falls_back() const {
  return policy_.load(std::memory_order_relaxed) == JitPolicy::kEnv && Jit::global().mode() == JitMode::kDefault;
}

bool Family::uses_jit(bool shape_in_aot_list) const {
  const JitPolicy p = policy();
  if (p == JitPolicy::kOff || !nvrtc_info().available) return false;
  return p == JitPolicy::kAlways || !shape_in_aot_list;
}

bool Family::lookup(uint64_t key, int device, void** fn, Status* st, Origin* origin, double* ms) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = functions_.find({key, device});
  if (it != functions_.end()) {
    *fn = it->second;
    if (origin) *origin = Origin::kMemory;
    if (ms) *ms = 0.0;
    *st = Status::ok();
    return true;
  }
  auto failed = failures_.find({key, device});
  if (failed == failures_.end()) return false;
  *st = failed->second;
  return true;
}

Status Family::load(uint64_t key, int device, Stream stream, const KernelSpec& spec, void** fn, Origin* origin, double* ms) {
  Status st = Jit::global().get_function(spec, device, stream, fn, origin, ms);
  std::lock_guard<std::mutex> lock(mu_);
  if (!st) {
    if (!stream_capturing(stream)) failures_.emplace(std::make_pair(key, device), st);
    return st;
  }
  functions_.emplace(std::make_pair(key, device), *fn);
  return Status::ok();
}

Status Family::warm(uint64_t key, const KernelSpec& spec, int device, const std::string& arch, Origin* origin, double* ms) {
  if (device < 0) {
    std::shared_ptr<const Cubin> cubin;
    return Jit::global().get_cubin(spec, arch, &cubin, origin, ms);
  }
  void* fn = nullptr;
  return function(key, device, nullptr, [&] { return spec; }, &fn, origin, ms);
}

Status Family::launch(void* fn, long long grid, int block, int device, Stream stream, void* params, size_t smem) {
#ifdef ENCORE_WITH_CUDA
  void* args[] = {params};
  // A JIT function belongs to the device's primary context: launch with that device current.
  cuda::DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device));
  if (grid == 0) return Status::ok();  // nothing to do (an empty problem)
  if (grid < 0 || grid > 0x7fffffffLL) return Status::internal(name_ + " jit: grid " + std::to_string(grid) + " out of range");
  if (smem > 48 * 1024) return Status::internal(name_ + " jit: " + std::to_string(smem) + " bytes of shared memory (at most 48 KB without an opt-in)");
  const std::string what = name_ + " jit";
  if (fault::inject(fault::Step::kKernelLaunch, what.c_str())) return fault::injected(fault::Step::kKernelLaunch, what.c_str());
  if (Status st = jit::launch(fn, unsigned(grid), unsigned(block), unsigned(smem), stream, args); !st)
    return Status(st.code(), name_ + " " + st.message());  // "rms_norm jit: kernel launch (cuLaunchKernel) failed: ..."
  launches_.fetch_add(1, std::memory_order_relaxed);
  return Status::ok();
#else
  (void)fn, (void)grid, (void)block, (void)device, (void)stream, (void)params, (void)smem;
  return Status::unsupported(name_ + " jit: encore was built without CUDA");
#endif
}

bool Family::handled(const Status& st, Stream stream) {
  if (st) return true;
  if (stream_capturing(stream)) {  // never compile inside a graph capture
    // Under the default policy the refusal (nothing enqueued yet) falls back; any other failure, or
    // JIT asked for explicitly (the refusal says to warm up first), is returned.
    if (!capture_falls_back() || !is_capture_refusal(st)) return true;
    std::call_once(capture_said_, [&] {
      std::fprintf(stderr,
                   "encore: %s: a CUDA graph capture needed a JIT kernel not loaded yet; the graph records the ahead-of-time "
                   "kernel (to capture the specialization, run the op once before capturing, or `encore jit warmup`)\n",
                   name_.c_str());
    });
    return false;
  }
  std::call_once(fallback_said_, [&] {
    std::fprintf(stderr, "encore: %s JIT failed, using the ahead-of-time kernels: %s\n", name_.c_str(), st.to_string().c_str());
  });
  return false;
}

}  // namespace encore::jit
