// NVRTC, loaded at run time with dlopen (libnvrtc.so.13, then libnvrtc.so): a machine without it
// still loads encore and runs the ahead-of-time kernels (docs/jit.md). No CUDA headers needed.
#pragma once
#include <string>
#include <vector>

#include "encore/core/status.hpp"

namespace encore::jit {

struct NvrtcInfo {
  bool available = false;
  int major = 0, minor = 0;
  std::string library;       // the soname that loaded, or why none did
  std::string include_dir;   // the toolkit headers (cuda_bf16.h ...) passed as -I; not in the cache key
};
const NvrtcInfo& nvrtc_info();  // loads on first call (thread-safe)

struct CompileRequest {
  std::string source;                                        // the generated translation unit
  std::vector<std::pair<std::string, std::string>> headers;  // (include name, contents), e.g. embedded .cuh
  std::string name_expression;                               // e.g. "&ns::kernel<float, 4>"
  std::vector<std::string> options;                          // e.g. --gpu-architecture=sm_90a, -std=c++17
};
struct CompileResult {
  std::vector<char> cubin;
  std::string lowered_name;  // the mangled symbol of name_expression
  std::string log;
};
Status nvrtc_compile(const CompileRequest& req, CompileResult* out);

}  // namespace encore::jit
