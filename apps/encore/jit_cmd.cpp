// encore jit warmup [--config FILE] [--arch sm_XY] [--device N] [--sms N]
//   Compiles (or loads from the disk cache) the run-time specializations listed in FILE, one per
//   line (the forms in src/jit/warmup.hpp: rms_norm, qk_norm, fp8_group_quant, mxfp8_quant, nvfp4_quant,
//   moe_routing, moe_dispatch, moe_combine); without --config
//   the built-in list (jit::default_warmup_config). Every launch-plan variant (batch sizes 1 .. 2^20)
//   of each line is compiled; prints each one's origin and time. With a GPU the kernels are also
//   loaded; without one (or with --arch) only the cubins are cached, for --sms multiprocessors
//   (default 132, H200).
// encore jit info: the same lines as in `encore info`.
#include "jit_cmd.hpp"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "encore/core/device_info.hpp"
#include "jit/jit.hpp"
#include "jit/warmup.hpp"

namespace encore::app {
namespace {

int warmup(const std::vector<std::string>& args) {
  std::string config, arch;
  int device = 0, sms = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config" && i + 1 < args.size()) config = args[++i];
    else if (args[i] == "--arch" && i + 1 < args.size()) arch = args[++i];
    else if (args[i] == "--device" && i + 1 < args.size()) device = std::stoi(args[++i]);
    else if (args[i] == "--sms" && i + 1 < args.size()) sms = std::stoi(args[++i]);
    else {
      std::fprintf(stderr, "usage: encore jit warmup [--config FILE] [--arch sm_XY] [--device N] [--sms N]\n");
      return 2;
    }
  }
  std::vector<jit::WarmupLine> lines;
  if (config.empty()) {
    std::istringstream in(jit::default_warmup_config());
    (void)jit::parse_warmup_config(in, &lines);
  } else {
    std::ifstream in(config);
    if (!in) {
      std::fprintf(stderr, "encore jit warmup: cannot open %s\n", config.c_str());
      return 2;
    }
    if (Status st = jit::parse_warmup_config(in, &lines); !st) {
      std::fprintf(stderr, "encore jit warmup: %s: %s\n", config.c_str(), st.message().c_str());
      return 2;
    }
  }
  if (!jit::nvrtc_info().available) {
    std::fprintf(stderr, "encore jit warmup: NVRTC is not available (%s)\n", jit::nvrtc_info().library.c_str());
    return 1;
  }
  const bool gpu = arch.empty() && cuda_device_count() > device;
  if (gpu) {
    const DeviceInfo* d = nullptr;
    Status st = get_device_info(device, &d);
    if (!st || !jit::device_arch(device, &arch)) {
      std::fprintf(stderr, "encore jit warmup: device %d: %s\n", device, st.to_string().c_str());
      return 1;
    }
    if (sms == 0) sms = d->sm_count;
  }
  if (arch.empty()) arch = "sm_90a";
  if (sms == 0) sms = 132;
  std::printf("encore jit warmup: %s, %d SMs, %s, cache %s\n", arch.c_str(), sms, gpu ? "loading on the GPU" : "cubins only (no GPU)",
              jit::Jit::global().disk().dir().empty() ? "(memory only)" : jit::Jit::global().disk().dir().c_str());
  int failures = 0;
  double total = 0;
  for (const jit::WarmupLine& l : lines) {
    for (const jit::WarmupItem& item : jit::warmup_items(l, sms)) {
      jit::Origin o{};
      double ms = 0;
      Status st = item.run(gpu ? device : -1, arch, &o, &ms);
      if (!st) {
        ++failures;
        std::printf("  %-44s FAILED: %s\n", item.name.c_str(), st.to_string().c_str());
        continue;
      }
      total += ms;
      std::printf("  %-44s %-8s %9.2f ms\n", item.name.c_str(), jit::origin_name(o), ms);
    }
  }
  std::printf("  total %.1f ms%s\n", total, failures ? ", with failures" : "");
  return failures ? 1 : 0;
}

}  // namespace

void print_jit_info() {
  const jit::NvrtcInfo& n = jit::nvrtc_info();
  jit::Jit& j = jit::Jit::global();
  const char* mode = j.mode() == jit::JitMode::kOff       ? "off: ahead-of-time kernels only (ENCORE_JIT=0)"
                     : j.mode() == jit::JitMode::kAlways  ? "on, every shape (ENCORE_JIT=always)"
                     : j.mode() == jit::JitMode::kDefault ? "on, shapes outside the ahead-of-time list (the default; ENCORE_JIT=0 turns it off)"
                                                          : "on, shapes outside the ahead-of-time list (ENCORE_JIT=1)";
  std::printf("  JIT:             %s%s\n", mode, j.mode() != jit::JitMode::kOff && !n.available ? "; inactive: no NVRTC" : "");
  if (n.available) std::printf("  NVRTC:           %d.%d (%s, headers %s)\n", n.major, n.minor, n.library.c_str(), n.include_dir.empty() ? "not found" : n.include_dir.c_str());
  else std::printf("  NVRTC:           %s: ahead-of-time kernels only\n", n.library.c_str());
  const std::string& dir = j.disk().dir();
  if (dir.empty()) {
    std::printf("  JIT cache:       memory only (ENCORE_JIT_CACHE_DIR is empty)\n");
  } else {
    const jit::CacheStats s = j.disk().stats();
    std::printf("  JIT cache:       %s: %lld kernels, %.2f MB (ENCORE_JIT_CACHE_DIR)\n", dir.c_str(), (long long)s.files, s.bytes / 1e6);
  }
}

int run_jit(const std::vector<std::string>& args) {
  if (!args.empty() && args[0] == "warmup") return warmup(std::vector<std::string>(args.begin() + 1, args.end()));
  if (!args.empty() && args[0] == "info") {
    print_jit_info();
    return 0;
  }
  std::fprintf(stderr, "usage: encore jit warmup [--config FILE] [--arch sm_XY] [--device N] [--sms N] | encore jit info\n");
  return 2;
}

}  // namespace encore::app
