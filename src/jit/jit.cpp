// JIT front (docs/jit.md): keys, the in-process cache, disk cache, NVRTC, driver-API loading.
#include "jit/jit.hpp"

#include <chrono>
#include <cstring>

#ifdef ENCORE_WITH_CUDA
#include <cuda.h>
#include <cuda_runtime.h>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/driver_entry.hpp"
#endif
#include "core/fault_injection.hpp"

namespace encore::jit {
namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Disk payload: u32 length of the lowered name, the name, the cubin.
std::vector<char> pack(const Cubin& c) {
  std::vector<char> p(4 + c.lowered_name.size() + c.image.size());
  const uint32_t n = uint32_t(c.lowered_name.size());
  std::memcpy(p.data(), &n, 4);
  std::memcpy(p.data() + 4, c.lowered_name.data(), n);
  if (!c.image.empty()) std::memcpy(p.data() + 4 + n, c.image.data(), c.image.size());
  return p;
}
bool unpack(const std::vector<char>& p, Cubin* c) {
  uint32_t n = 0;
  if (p.size() < 4) return false;
  std::memcpy(&n, p.data(), 4);
  if (p.size() < 4 + size_t(n) + 1) return false;
  c->lowered_name.assign(p.data() + 4, n);
  c->image.assign(p.begin() + 4 + n, p.end());
  return true;
}

#ifdef ENCORE_WITH_CUDA
using ModuleLoadData = CUresult (*)(CUmodule*, const void*);
using ModuleGetFunction = CUresult (*)(CUfunction*, CUmodule, const char*);
using LaunchKernel = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  CUstream, void**, void**);
using CtxGetCurrent = CUresult (*)(CUcontext*);
struct Driver {
  CtxGetCurrent ctx = cuda::driver_entry<CtxGetCurrent>("cuCtxGetCurrent");
  ModuleLoadData load = cuda::driver_entry<ModuleLoadData>("cuModuleLoadData");
  ModuleGetFunction get = cuda::driver_entry<ModuleGetFunction>("cuModuleGetFunction");
  LaunchKernel launch = cuda::driver_entry<LaunchKernel>("cuLaunchKernel");
};
const Driver& driver() {
  static const Driver d;
  return d;
}
#endif

}  // namespace

const char* origin_name(Origin o) {
  return o == Origin::kMemory ? "memory" : o == Origin::kDisk ? "disk" : "compiled";
}

Toolchain current_toolchain() {
  Toolchain tc;
  const NvrtcInfo& n = nvrtc_info();
  tc.nvrtc_major = n.major;
  tc.nvrtc_minor = n.minor;
#ifdef ENCORE_WITH_CUDA
  int v = 0;
  if (cudaDriverGetVersion(&v) == cudaSuccess) tc.driver_version = v;
#endif
  tc.encore_version = encore_version();
  return tc;
}

uint64_t cache_key(const KernelSpec& spec, const std::string& arch, const Toolchain& tc) {
  Hasher h;
  h.add("encore-jit-key-v1").add(spec.source).add(uint64_t(spec.headers.size()));
  for (const auto& [name, text] : spec.headers) h.add(name).add(text);
  h.add(spec.name_expression).add(uint64_t(spec.options.size()));
  for (const auto& o : spec.options) h.add(o);
  h.add(arch).add(uint64_t(tc.nvrtc_major)).add(uint64_t(tc.nvrtc_minor)).add(uint64_t(tc.driver_version));
  return h.add(tc.encore_version).value();
}

Jit::Jit(std::string cache_dir, JitMode mode) : mode_(mode), disk_(std::move(cache_dir)), toolchain_(current_toolchain()) {}

Jit& Jit::global() {
  static Jit* g = new Jit(default_cache_dir(), mode_from_env());  // never destroyed: loaded modules live as long as the process
  return *g;
}

std::shared_ptr<Jit::Slot> Jit::slot(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& s = slots_[key];
  if (!s) s = std::make_shared<Slot>();
  return s;
}

Status Jit::get_cubin(const KernelSpec& spec, const std::string& arch, std::shared_ptr<const Cubin>* out, Origin* origin,
                      double* ms) {
  const double t0 = now_ms();
  const uint64_t key = cache_key(spec, arch, toolchain_);
  std::shared_ptr<Slot> s = slot(key);
  std::lock_guard<std::mutex> lock(s->mu);
  Origin o = Origin::kMemory;
  if (!s->cubin) {
    auto c = std::make_shared<Cubin>();
    auto payload = disk_.load(spec.name, key);
    if (payload && unpack(*payload, c.get())) {
      o = Origin::kDisk;
    } else {
      if (!nvrtc_info().available) return Status::unsupported("jit: NVRTC is not available (" + nvrtc_info().library + ")");
      CompileRequest req{spec.source, spec.headers, spec.name_expression, spec.options};
      req.options.push_back("--gpu-architecture=" + arch);
      CompileResult r;
      ENCORE_RETURN_IF_ERROR(nvrtc_compile(req, &r));
      c->image = std::move(r.cubin);
      c->lowered_name = std::move(r.lowered_name);
      disk_.store(spec.name, key, pack(*c));  // failure: memory only (said once by DiskCache)
      o = Origin::kCompiled;
    }
    s->cubin = std::move(c);
  }
  *out = s->cubin;
  if (origin) *origin = o;
  if (ms) *ms = now_ms() - t0;
  return Status::ok();
}

Status device_arch(int device, std::string* arch) {
#ifdef ENCORE_WITH_CUDA
  int major = 0, minor = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::cuda_error(fault::failure_message(("jit: the compute capability of cuda:" + std::to_string(device)).c_str(),
                                                     "cudaDeviceGetAttribute", cudaGetErrorName(e), int(e), cudaGetErrorString(e)));
  }
  *arch = "sm_" + std::to_string(major) + std::to_string(minor) + ((major == 9 || major == 10) && minor == 0 ? "a" : "");
  return Status::ok();
#else
  (void)device;
  (void)arch;
  return Status::unsupported("jit: encore was built without CUDA");
#endif
}

bool is_capture_refusal(const Status& st) {
  return st.code() == StatusCode::kUnsupported && st.message().find(kCaptureRefusal) != std::string::npos;
}

bool stream_capturing(Stream stream) {
#ifdef ENCORE_WITH_CUDA
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;  // the query itself is refused during a global-mode capture: treat as capturing
  }
  return st != cudaStreamCaptureStatusNone;
#else
  (void)stream;
  return false;
#endif
}

Status Jit::get_function(const KernelSpec& spec, int device, Stream stream, void** function, Origin* origin, double* ms) {
#ifdef ENCORE_WITH_CUDA
  const double t0 = now_ms();
  std::string arch;
  ENCORE_RETURN_IF_ERROR(device_arch(device, &arch));
  const uint64_t key = cache_key(spec, arch, toolchain_);
  std::shared_ptr<Slot> s = slot(key);
  {
    std::lock_guard<std::mutex> lock(s->mu);
    auto it = s->functions.find(device);
    if (it != s->functions.end()) {
      *function = it->second;
      if (origin) *origin = Origin::kMemory;
      if (ms) *ms = now_ms() - t0;
      return Status::ok();
    }
  }
  if (stream_capturing(stream))
    return Status::unsupported("jit: kernel " + spec.name + kCaptureRefusal + "; "
                               "compile before capture: run the op once outside the capture, or `encore jit warmup`");
  std::shared_ptr<const Cubin> cubin;
  Origin o = Origin::kMemory;
  ENCORE_RETURN_IF_ERROR(get_cubin(spec, arch, &cubin, &o));
  const Driver& d = driver();
  if (!d.load || !d.get || !d.launch) return Status::cuda_error("jit: driver entry points cuModuleLoadData / cuLaunchKernel not found");
  cuda::DeviceGuard guard;  // also the device's primary context current for the driver calls
  ENCORE_RETURN_IF_ERROR(guard.set(device));
  std::lock_guard<std::mutex> lock(s->mu);
  auto it = s->functions.find(device);
  if (it == s->functions.end()) {
    const std::string what = "jit: " + spec.name;
    if (fault::inject(fault::Step::kModuleLoad, spec.name.c_str())) return fault::injected(fault::Step::kModuleLoad, what.c_str());
    CUmodule mod = nullptr;
    CUfunction fn = nullptr;
    CUresult r = d.load(&mod, cubin->image.data());
    if (r != CUDA_SUCCESS) return Status::cuda_error(cuda::driver_failure_message(what, "module load (cuModuleLoadData)", r));
    r = d.get(&fn, mod, cubin->lowered_name.c_str());
    if (r != CUDA_SUCCESS)
      return Status::cuda_error(cuda::driver_failure_message(what + " (" + cubin->lowered_name + ")", "module load (cuModuleGetFunction)", r));
    it = s->functions.emplace(device, reinterpret_cast<void*>(fn)).first;
  } else {
    o = Origin::kMemory;
  }
  *function = it->second;
  if (origin) *origin = o;
  if (ms) *ms = now_ms() - t0;
  return Status::ok();
#else
  (void)spec, (void)device, (void)stream, (void)function, (void)origin, (void)ms;
  return Status::unsupported("jit: encore was built without CUDA");
#endif
}

Status launch(void* function, unsigned grid, unsigned block, unsigned smem, Stream stream, void** args) {
#ifdef ENCORE_WITH_CUDA
  const Driver& d = driver();
  if (!d.launch || !d.ctx) return Status::cuda_error("jit: cuLaunchKernel / cuCtxGetCurrent entry points not found");
  CUcontext ctx = nullptr;
  // A thread that has made no runtime call yet has no current context: bind the device's primary one.
  if (d.ctx(&ctx) != CUDA_SUCCESS || ctx == nullptr) {
    if (const cudaError_t e = cudaFree(nullptr); e != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::cuda_error(fault::failure_message("jit: launch", "cudaFree(nullptr) (context creation)", cudaGetErrorName(e), int(e),
                                                       cudaGetErrorString(e)));
    }
  }
  CUresult r = d.launch(static_cast<CUfunction>(function), grid, 1, 1, block, 1, 1, smem, static_cast<CUstream>(stream), args, nullptr);
  if (r != CUDA_SUCCESS) return Status::cuda_error(cuda::driver_failure_message("jit", "kernel launch (cuLaunchKernel)", r));
  return Status::ok();
#else
  (void)function, (void)grid, (void)block, (void)smem, (void)stream, (void)args;
  return Status::unsupported("jit: encore was built without CUDA");
#endif
}

}  // namespace encore::jit
