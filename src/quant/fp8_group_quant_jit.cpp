// FP8 group quantization run-time specializations (src/quant/jit.hpp): fp8_group_quant_kernel with
// K / 128 baked in, the policy and the launch, on the shared pieces of jit/family.hpp.
#include <algorithm>

#include "quant/jit.hpp"
#ifdef ENCORE_WITH_CUDA
#include "quant/cuda/launch.hpp"
#endif

namespace encore::quant {
namespace {

jit::Family& family() {
  static jit::Family f("fp8_group_quant");
  return f;
}

// Injective: K < 2^40, group size < 2^10, groups per thread < 2^4, packs per lane 1 or 2.
uint64_t variant_key(const Fp8QuantJitVariant& v) {
  return (uint64_t(v.cols) << 24) | (uint64_t(v.group_size & 0x3ff) << 14) | (uint64_t(int(v.dtype) & 0xff) << 6) |
         (uint64_t(v.groups_per_thread & 0xf) << 2) | (uint64_t((v.packs_per_lane - 1) & 1) << 1) | uint64_t(v.tiled);
}

}  // namespace

jit::KernelSpec fp8_group_quant_jit_spec(const Fp8QuantJitVariant& v) {
  // The kernel's group size is kFp8GroupSize (validate accepts 128 only); it is in the name for the reader.
  return jit::embedded_spec(
      std::string("fp8_group_quant-") + dtype_name(v.dtype) + "-k" + std::to_string(v.cols) + "-g" + std::to_string(v.group_size) +
          "-t" + std::to_string(v.groups_per_thread) + "-p" + std::to_string(v.packs_per_lane) + (v.tiled ? "-tiled" : ""),
      "quant/cuda/fp8_group_quant_kernel.cuh",
      {"core/host_device.hpp", "core/fast_div.hpp", "encore/core/dtype.hpp", "common/cuda/reduce.cuh", "common/cuda/vector_io.cuh",
       "core/fp8.hpp", "common/cuda/fp8_pack.cuh", "quant/fp8_scale.hpp", "quant/problem.hpp", "quant/cuda/fp8_group_quant_kernel.cuh"},
      std::string("&encore::cuda::fp8_group_quant_kernel<") + jit::device_type_name(v.dtype) + ", " +
          std::to_string(v.groups_per_thread) + ", " + std::to_string(v.packs_per_lane) + ", " + (v.tiled ? "true" : "false") + ", " +
          std::to_string(v.cols / v.group_size) + ">");
}

Fp8QuantJitVariant fp8_group_quant_jit_variant(const Fp8QuantProblem& p, const Fp8QuantLaunchPlan& plan) {
  return Fp8QuantJitVariant{p.dtype, p.cols, p.group_size, plan.groups_per_thread, plan.packs_per_lane, plan.tile_rows > 1};
}

bool fp8_group_quant_cols_in_aot_list(int64_t cols) {
  static constexpr int64_t kList[] = {1024, 1536, 2048, 3072, 4096, 5120, 6144, 7168, 8192, 12288, 14336, 16384, 18432};
  return std::find(std::begin(kList), std::end(kList), cols) != std::end(kList);
}

jit::Family& fp8_group_quant_jit_family() { return family(); }
void set_fp8_group_quant_jit_policy(JitPolicy policy) { family().set_policy(policy); }

bool fp8_group_quant_uses_jit(const Fp8QuantProblem& p) {
  if (p.group_size != kFp8GroupSize || p.cols > kFp8QuantJitMaxCols) return false;
  return family().uses_jit(fp8_group_quant_cols_in_aot_list(p.cols));
}

std::vector<Fp8QuantJitVariant> fp8_group_quant_jit_variants(DType dtype, int64_t cols, int sm_count) {
  std::vector<Fp8QuantJitVariant> out;
  for (bool column_major : {false, true}) {
    for (int64_t rows = 1; rows <= (int64_t(1) << 20); rows *= 2) {
      Fp8QuantProblem p;
      p.rows = rows;
      p.cols = cols;
      p.dtype = dtype;
      p.scale_stride_m = column_major ? 1 : cols / kFp8GroupSize;
      p.scale_stride_g = column_major ? rows : 1;
      if (rows * (cols / kFp8GroupSize) >= (int64_t(1) << 31)) break;  // validate refuses it
      const Fp8QuantJitVariant v = fp8_group_quant_jit_variant(p, plan_fp8_group_quant(p, sm_count));
      if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
    }
  }
  return out;
}

Status fp8_group_quant_jit_warmup(const Fp8QuantJitVariant& v, int device, const std::string& arch, jit::Origin* origin, double* ms) {
  return family().warm(variant_key(v), fp8_group_quant_jit_spec(v), device, arch, origin, ms);
}

int64_t fp8_group_quant_jit_launch_count() { return family().launch_count(); }

Status launch_fp8_group_quant_jit(const Fp8QuantProblem& p, const Fp8QuantLaunchPlan& plan, Stream stream) {
#ifdef ENCORE_WITH_CUDA
  const Fp8QuantJitVariant v = fp8_group_quant_jit_variant(p, plan);
  void* fn = nullptr;
  ENCORE_RETURN_IF_ERROR(family().function(variant_key(v), p.device_index, stream, [&] { return fp8_group_quant_jit_spec(v); }, &fn));
  alignas(16) unsigned char params[cuda::kFp8QuantParamsMaxBytes];
  ENCORE_RETURN_IF_ERROR(cuda::fp8_group_quant_kernel_params(p, plan, params));
  return family().launch(fn, plan.grid, plan.threads, p.device_index, stream, params);
#else
  (void)p, (void)plan, (void)stream;
  return Status::unsupported("fp8_group_quant jit: encore was built without CUDA");
#endif
}

}  // namespace encore::quant
