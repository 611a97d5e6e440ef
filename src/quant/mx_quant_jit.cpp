// MXFP8 / NVFP4 quantization run-time specializations (src/quant/jit.hpp): mxfp8_quant_kernel /
// nvfp4_quant_kernel with K / 8 baked in, the policy and the launch after the AOT prologue.
#include "quant/jit.hpp"
#ifdef ENCORE_WITH_CUDA
#include "quant/cuda/launch.hpp"
#endif

namespace encore::quant {
namespace {

jit::Family& family() {
  static jit::Family f("mx_quant");
  return f;
}

// Injective: K < 2^48, dtype and kind 8 bits each.
uint64_t variant_key(const MxQuantJitVariant& v) {
  return (uint64_t(v.cols) << 16) | (uint64_t(int(v.dtype) & 0xff) << 8) | uint64_t(int(v.kind) & 0xff);
}

}  // namespace

jit::KernelSpec mx_quant_jit_spec(const MxQuantJitVariant& v) {
  const char* kernel = v.kind == MxKind::kMxfp8 ? "mxfp8_quant" : "nvfp4_quant";
  return jit::embedded_spec(std::string(kernel) + "-" + dtype_name(v.dtype) + "-k" + std::to_string(v.cols), "quant/cuda/mx_quant_kernel.cuh",
                            {"core/host_device.hpp", "core/fast_div.hpp", "common/cuda/reduce.cuh", "common/cuda/vector_io.cuh",
                             "core/fp8.hpp", "common/cuda/fp8_pack.cuh", "quant/fp8_scale.hpp", "quant/cuda/mx_quant_kernel.cuh"},
                            std::string("&encore::cuda::") + kernel + "_kernel<" + jit::device_type_name(v.dtype) + ", " +
                                std::to_string(v.cols / 8) + ">");
}

MxQuantJitVariant mx_quant_jit_variant(const MxProblem& p) { return MxQuantJitVariant{p.kind, p.dtype, p.cols}; }

bool mx_quant_cols_in_aot_list(int64_t cols) { return fp8_group_quant_cols_in_aot_list(cols); }

jit::Family& mx_quant_jit_family() { return family(); }
void set_mx_quant_jit_policy(JitPolicy policy) { family().set_policy(policy); }

bool mx_quant_uses_jit(const MxProblem& p) {
  if (p.cols > kMxQuantJitMaxCols || p.cols % 8 != 0) return false;
  return family().uses_jit(mx_quant_cols_in_aot_list(p.cols));
}

Status mx_quant_jit_warmup(const MxQuantJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms) {
  return family().warm(variant_key(v), mx_quant_jit_spec(v), device, arch, origin, ms);
}

int64_t mx_quant_jit_launch_count() { return family().launch_count(); }

Status launch_mx_quant_jit(const MxProblem& p, int device_index, Stream stream) {
#ifdef ENCORE_WITH_CUDA
  const MxQuantJitVariant v = mx_quant_jit_variant(p);
  void* fn = nullptr;
  ENCORE_RETURN_IF_ERROR(family().function(variant_key(v), device_index, stream, [&] { return mx_quant_jit_spec(v); }, &fn));
  alignas(16) unsigned char params[cuda::kMxParamsMaxBytes];
  uint32_t threads = 0;
  ENCORE_RETURN_IF_ERROR(cuda::mx_quant_prologue(p, device_index, stream, params, &threads));
  if (threads == 0) return Status::ok();
  const long long grid = (static_cast<long long>(threads) + cuda::kMxQuantThreads - 1) / cuda::kMxQuantThreads;
  return family().launch(fn, grid, cuda::kMxQuantThreads, device_index, stream, params);
#else
  (void)p, (void)device_index, (void)stream;
  return Status::unsupported("mx_quant jit: encore was built without CUDA");
#endif
}

}  // namespace encore::quant
