// dlopen'ed NVRTC: prototypes declared here (the ABI of nvrtc.h, stable across 12.x / 13.x).
#include "jit/nvrtc.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <vector>

#include "core/fault_injection.hpp"

namespace encore::jit {
namespace {

using nvrtcProgram = struct _nvrtcProgram*;
using nvrtcResult = int;
struct Api {
  const char* (*GetErrorString)(nvrtcResult);
  nvrtcResult (*Version)(int*, int*);
  nvrtcResult (*CreateProgram)(nvrtcProgram*, const char*, const char*, int, const char* const*, const char* const*);
  nvrtcResult (*DestroyProgram)(nvrtcProgram*);
  nvrtcResult (*CompileProgram)(nvrtcProgram, int, const char* const*);
  nvrtcResult (*GetCUBINSize)(nvrtcProgram, size_t*);
  nvrtcResult (*GetCUBIN)(nvrtcProgram, char*);
  nvrtcResult (*GetProgramLogSize)(nvrtcProgram, size_t*);
  nvrtcResult (*GetProgramLog)(nvrtcProgram, char*);
  nvrtcResult (*AddNameExpression)(nvrtcProgram, const char*);
  nvrtcResult (*GetLoweredName)(nvrtcProgram, const char*, const char**);
};
Api g_api{};
NvrtcInfo g_info;

bool has_bf16(const std::string& dir) { return !dir.empty() && std::filesystem::exists(dir + "/cuda_bf16.h"); }

std::string find_include_dir(void* any_symbol) {
  for (const char* env : {"ENCORE_CUDA_INCLUDE", "CUDA_HOME", "CUDA_PATH"}) {
    if (const char* v = std::getenv(env); v && *v) {
      std::string d = std::string(v) + (std::string(env) == "ENCORE_CUDA_INCLUDE" ? "" : "/include");
      if (has_bf16(d)) return d;
    }
  }
  Dl_info dl{};
  if (any_symbol && dladdr(any_symbol, &dl) && dl.dli_fname) {  // <root>/lib64/libnvrtc.so -> <root>/include
    std::filesystem::path lib = std::filesystem::weakly_canonical(dl.dli_fname);
    for (auto d : {lib.parent_path().parent_path() / "include", lib.parent_path().parent_path().parent_path() / "include"})
      if (has_bf16(d.string())) return d.string();
  }
  for (const char* d : {"/usr/local/cuda/include", "/usr/include"})
    if (has_bf16(d)) return d;
  return "";
}

void load() {
  void* h = nullptr;
  // The loader path first, then the toolkit's lib64 (often not on the loader path).
  std::vector<std::string> names = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
  for (const char* env : {"CUDA_HOME", "CUDA_PATH"})
    if (const char* v = std::getenv(env); v && *v) names.push_back(std::string(v) + "/lib64/libnvrtc.so.13");
  names.push_back("/usr/local/cuda/lib64/libnvrtc.so.13");
  names.push_back("/usr/local/cuda/lib64/libnvrtc.so.12");
  for (const std::string& name : names) {
    h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h) {
      g_info.library = name;
      break;
    }
  }
  if (!h) {
    g_info.library = std::string("not found (") + dlerror() + ")";
    return;
  }
  bool ok = true;
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
    ok = ok && fn != nullptr;
  };
  sym(g_api.GetErrorString, "nvrtcGetErrorString");
  sym(g_api.Version, "nvrtcVersion");
  sym(g_api.CreateProgram, "nvrtcCreateProgram");
  sym(g_api.DestroyProgram, "nvrtcDestroyProgram");
  sym(g_api.CompileProgram, "nvrtcCompileProgram");
  sym(g_api.GetCUBINSize, "nvrtcGetCUBINSize");
  sym(g_api.GetCUBIN, "nvrtcGetCUBIN");
  sym(g_api.GetProgramLogSize, "nvrtcGetProgramLogSize");
  sym(g_api.GetProgramLog, "nvrtcGetProgramLog");
  sym(g_api.AddNameExpression, "nvrtcAddNameExpression");
  sym(g_api.GetLoweredName, "nvrtcGetLoweredName");
  if (!ok || g_api.Version(&g_info.major, &g_info.minor) != 0) {
    g_info.library += " (missing symbols)";
    return;
  }
  g_info.include_dir = find_include_dir(reinterpret_cast<void*>(g_api.Version));
  g_info.available = true;
}

}  // namespace

const NvrtcInfo& nvrtc_info() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (const char* v = std::getenv("ENCORE_JIT_NO_NVRTC"); v && *v && std::string(v) != "0") {
      g_info.library = "disabled (ENCORE_JIT_NO_NVRTC)";  // test hook: behave as if NVRTC were missing
      return;
    }
    load();
  });
  return g_info;
}

namespace {

// "jit: <call>(<what>) failed: NVRTC_ERROR_X (code)[: detail]" (nvrtcGetErrorString names the code).
Status nvrtc_failure(const char* call, const std::string& what, nvrtcResult r, const std::string& detail = "") {
  return Status::internal(fault::failure_message(("jit: " + what).c_str(), call, g_api.GetErrorString(r), r, detail.c_str()));
}

}  // namespace

Status nvrtc_compile(const CompileRequest& req, CompileResult* out) {
  const NvrtcInfo& info = nvrtc_info();
  if (!info.available) return Status::unsupported("jit: NVRTC is not available: " + info.library);
  const std::string what = req.name_expression.empty() ? std::string("encore_jit.cu") : req.name_expression;
  if (fault::inject(fault::Step::kNvrtcCompile, what.c_str())) return fault::injected(fault::Step::kNvrtcCompile, ("jit: " + what).c_str());
  std::vector<const char*> hnames, hsrcs, opts;
  for (const auto& [n, s] : req.headers) {
    hnames.push_back(n.c_str());
    hsrcs.push_back(s.c_str());
  }
  const std::string inc = "-I" + info.include_dir;
  for (const auto& o : req.options) opts.push_back(o.c_str());
  if (!info.include_dir.empty()) opts.push_back(inc.c_str());
  nvrtcProgram prog = nullptr;
  nvrtcResult r = g_api.CreateProgram(&prog, req.source.c_str(), "encore_jit.cu", int(hnames.size()), hsrcs.data(), hnames.data());
  if (r != 0) return nvrtc_failure("nvrtcCreateProgram", what, r);
  struct Destroy {
    nvrtcProgram* p;
    ~Destroy() { g_api.DestroyProgram(p); }
  } destroy{&prog};
  if (!req.name_expression.empty() && (r = g_api.AddNameExpression(prog, req.name_expression.c_str())) != 0)
    return nvrtc_failure("nvrtcAddNameExpression", what, r);
  const nvrtcResult cr = g_api.CompileProgram(prog, int(opts.size()), opts.data());
  size_t n = 0;
  if (g_api.GetProgramLogSize(prog, &n) == 0 && n > 1) {
    out->log.resize(n);
    if (g_api.GetProgramLog(prog, out->log.data()) == 0) out->log.resize(n - 1);
    else out->log = "(nvrtcGetProgramLog failed: no log)";
  }
  if (cr != 0) return nvrtc_failure("NVRTC compile (nvrtcCompileProgram)", what, cr, "\n" + out->log);
  if ((r = g_api.GetCUBINSize(prog, &n)) != 0) return nvrtc_failure("nvrtcGetCUBINSize", what, r);
  if (n == 0) return Status::internal("jit: " + what + ": nvrtcGetCUBINSize: no cubin (was a real sm_ arch given?)");
  out->cubin.resize(n);
  if ((r = g_api.GetCUBIN(prog, out->cubin.data())) != 0) return nvrtc_failure("nvrtcGetCUBIN", what, r);
  if (!req.name_expression.empty()) {
    const char* lowered = nullptr;
    if ((r = g_api.GetLoweredName(prog, req.name_expression.c_str(), &lowered)) != 0) return nvrtc_failure("nvrtcGetLoweredName", what, r);
    if (!lowered) return Status::internal("jit: " + what + ": nvrtcGetLoweredName returned no name");
    out->lowered_name = lowered;
  }
  return Status::ok();
}

}  // namespace encore::jit
