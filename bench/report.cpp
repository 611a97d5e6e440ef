#include "bench/report.hpp"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace encore::bench {

double Record::metric(const std::string& key) const {
  for (const auto& [k, v] : metrics)
    if (k == key) return v;
  return NAN;
}

void Report::print_table() const {
  std::printf("\nGPU %s (%d SMs), driver %s, SM clock %s MHz (max %s), commit %s\n", env.gpu.c_str(), env.sm_count,
              env.driver.c_str(), env.sm_clock_mhz.c_str(), env.max_sm_clock_mhz.c_str(), env.commit.c_str());
  std::printf("ceilings: copy %.0f GB/s (memcpy %.0f, copy kernel %.0f), cuBLAS bf16 GEMM %dx%dx%d %.0f TFLOP/s\n", ceilings.copy_gbps, ceilings.memcpy_gbps,
              ceilings.copy_kernel_gbps, ceilings.gemm_m,
              ceilings.gemm_n, ceilings.gemm_k, ceilings.gemm_tflops);
  std::string suite;
  for (const Record& r : records) {
    if (r.suite != suite) {
      suite = r.suite;
      std::printf("\n[%s]\n", suite.c_str());
    }
    std::ostringstream line;
    line << r.name;
    for (const auto& [k, v] : r.params) line << "  " << k << "=" << v;
    char buf[64];
    for (const auto& [k, v] : r.metrics) {
      std::snprintf(buf, sizeof buf, "  %s=%.4g", k.c_str(), v);
      line << buf;
    }
    std::printf("%s\n", line.str().c_str());
  }
}

namespace {
std::string quote(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (c == '\n') { o += "\\n"; continue; }
    o += c;
  }
  return o + "\"";
}
std::string num(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}
}  // namespace

bool Report::write_json(const std::string& path) const {
  std::ofstream f(path);
  if (!f) return false;
  f << "{\n  \"environment\": {\"gpu\": " << quote(env.gpu) << ", \"sm_count\": " << env.sm_count
    << ", \"l2_mb\": " << num(env.l2_mb) << ", \"driver\": " << quote(env.driver) << ", \"cuda_runtime\": "
    << quote(env.cuda_runtime) << ", \"sm_clock_mhz\": " << quote(env.sm_clock_mhz) << ", \"mem_clock_mhz\": "
    << quote(env.mem_clock_mhz) << ", \"max_sm_clock_mhz\": " << quote(env.max_sm_clock_mhz) << ", \"commit\": "
    << quote(env.commit) << ", \"timestamp\": " << quote(env.timestamp) << "},\n";
  f << "  \"ceilings\": {\"copy_gbps\": " << num(ceilings.copy_gbps) << ", \"memcpy_gbps\": " << num(ceilings.memcpy_gbps)
    << ", \"copy_kernel_gbps\": " << num(ceilings.copy_kernel_gbps) << ", \"copy_bytes\": " << num(ceilings.copy_bytes)
    << ", \"gemm_tflops\": " << num(ceilings.gemm_tflops) << ", \"gemm_shape\": [" << ceilings.gemm_m << ", "
    << ceilings.gemm_n << ", " << ceilings.gemm_k << "]},\n";
  f << "  \"records\": [\n";
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    f << "    {\"suite\": " << quote(r.suite) << ", \"name\": " << quote(r.name);
    for (const auto& [k, v] : r.params) f << ", " << quote(k) << ": " << quote(v);
    for (const auto& [k, v] : r.metrics) f << ", " << quote(k) << ": " << num(v);
    f << "}" << (i + 1 < records.size() ? "," : "") << "\n";
  }
  f << "  ]\n}\n";
  return bool(f);
}

}  // namespace encore::bench
