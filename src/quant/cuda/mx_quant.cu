// Launch of the MXFP8 / NVFP4 kernels (mx_quant_kernel.cuh): T in {bf16, fp16, fp32} for the
// quantization, {fp32, bf16} for the dequantization; 256 threads, one thread per 8 elements (NVFP4
// quantization: per 16, one scale block).
// NVFP4 with a computed global scale is four stream operations: zero the global (memset), amax over
// the finite elements (atomicMax on its bits), global = amax / 2688 or 1, quantization. The
// swizzled layout's padding is zeroed by its own small kernel (only when there is padding).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "quant/cuda/launch.hpp"
#include "quant/cuda/mx_quant_kernel.cuh"

namespace encore::cuda {
namespace {

constexpr int kThreads = 256;

MxParams make_params(const quant::MxProblem& p) {
  MxParams k{};
  k.x = p.x;
  k.x_stride = p.x_stride;
  k.q = p.q;
  k.q_stride = p.q_stride;
  k.scales = p.scales;
  k.scale_stride = p.scale_stride;
  k.units = uint32_t(p.rows * p.cols / 8);
  k.units_per_row = uint32_t(p.cols / 8);
  k.row_of_unit = FastDiv31(k.units_per_row);
  k.scale_cols = uint32_t(p.cols / (p.kind == quant::MxKind::kMxfp8 ? quant::kMxfp8Block : quant::kNvfp4Block));
  k.swizzled = p.swizzled;
  k.rceil = p.rceil;
  return k;
}

unsigned grid_of(uint32_t units) { return unsigned((uint64_t(units) + kThreads - 1) / kThreads); }

// The quantization kernel's threads: one per unit of 8 (MXFP8), one per NVFP4 block of 16.
uint32_t quant_threads(const quant::MxProblem& p, const MxParams& k) { return p.kind == quant::MxKind::kMxfp8 ? k.units : k.units / 2; }

Status zero_padding(const quant::MxProblem& p, const MxParams& k, cudaStream_t s) {
  if (!p.swizzled) return Status::ok();
  const int64_t n = quant::mx_padded_rows(p.rows) * quant::mx_padded_scale_cols(k.scale_cols) - p.rows * int64_t(k.scale_cols);
  if (n == 0) return Status::ok();
  return launch("mx_zero_padding", [&] {
    mx_zero_padding_kernel<<<unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 4096)), kThreads, 0, s>>>(
        p.scales, p.rows, int64_t(k.scale_cols));
  });
}

// Everything before the quantization kernel: the swizzled padding and NVFP4's global scale.
template <typename T>
Status prologue_typed(const quant::MxProblem& p, cudaStream_t s, MxParams* out) {
  MxParams& k = *out;
  k = make_params(p);
  ENCORE_RETURN_IF_ERROR(zero_padding(p, k, s));
  if (k.units == 0 || p.kind == quant::MxKind::kMxfp8) return Status::ok();
  if (p.given_global > 0.0f) {
    k.global_value = p.given_global;
    k.global_out = p.global_scale;
  } else {
    ENCORE_RETURN_IF_ERROR(launch_gate("nvfp4 global scale"));  // the seam before the first write to an output
    ENCORE_RETURN_IF_ERROR(call_result("nvfp4 global scale", "cudaMemsetAsync", cudaMemsetAsync(p.global_scale, 0, sizeof(float), s)));
    ENCORE_RETURN_IF_ERROR(launch("nvfp4_amax", [&] {
      nvfp4_amax_kernel<T><<<std::min(grid_of(k.units), 2048u), kThreads, 0, s>>>(k, reinterpret_cast<unsigned int*>(p.global_scale));
    }));
    ENCORE_RETURN_IF_ERROR(launch("nvfp4_global", [&] { nvfp4_global_kernel<<<1, 1, 0, s>>>(p.global_scale); }));
    k.global_in = p.global_scale;
  }
  return Status::ok();
}

template <typename T>
Status quant_typed(const quant::MxProblem& p, cudaStream_t s) {
  MxParams k;
  ENCORE_RETURN_IF_ERROR(prologue_typed<T>(p, s, &k));
  if (k.units == 0) return Status::ok();
  if (p.kind == quant::MxKind::kMxfp8) {
    return launch("mxfp8_quant", [&] { mxfp8_quant_kernel<T><<<grid_of(quant_threads(p, k)), kThreads, 0, s>>>(k); });
  }
  return launch("nvfp4_quant", [&] { nvfp4_quant_kernel<T><<<grid_of(quant_threads(p, k)), kThreads, 0, s>>>(k); });
}

template <typename O>
Status dequant_typed(const quant::MxProblem& p, cudaStream_t s) {
  MxParams k = make_params(p);
  if (k.units == 0) return Status::ok();
  k.global_in = p.global_scale;
  return launch("mx_dequant", [&] {
    if (p.kind == quant::MxKind::kMxfp8) mx_dequant_kernel<O, false><<<grid_of(k.units), kThreads, 0, s>>>(k);
    else mx_dequant_kernel<O, true><<<grid_of(k.units), kThreads, 0, s>>>(k);
  });
}

}  // namespace

Status launch_mx_quant(const quant::MxProblem& p, int device_index, Stream stream) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kBF16: return quant_typed<__nv_bfloat16>(p, s);
    case DType::kFP16: return quant_typed<__half>(p, s);
    case DType::kFP32: return quant_typed<float>(p, s);
    default: return Status::internal(std::string("mx_quant: no CUDA kernel for dtype ") + dtype_name(p.dtype));
  }
}

Status mx_quant_prologue(const quant::MxProblem& p, int device_index, Stream stream, void* params, uint32_t* threads) {
  static_assert(sizeof(MxParams) <= kMxParamsMaxBytes && kThreads == kMxQuantThreads);
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  MxParams k{};
  switch (p.dtype) {
    case DType::kBF16: ENCORE_RETURN_IF_ERROR(prologue_typed<__nv_bfloat16>(p, s, &k)); break;
    case DType::kFP16: ENCORE_RETURN_IF_ERROR(prologue_typed<__half>(p, s, &k)); break;
    case DType::kFP32: ENCORE_RETURN_IF_ERROR(prologue_typed<float>(p, s, &k)); break;
    default: return Status::internal(std::string("mx_quant: no CUDA kernel for dtype ") + dtype_name(p.dtype));
  }
  std::memcpy(params, &k, sizeof(k));
  *threads = quant_threads(p, k);
  return Status::ok();
}

Status launch_mx_dequant(const quant::MxProblem& p, int device_index, Stream stream) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFP32: return dequant_typed<float>(p, s);
    case DType::kBF16: return dequant_typed<__nv_bfloat16>(p, s);
    default: return Status::internal(std::string("mx_dequant: no CUDA kernel for dtype ") + dtype_name(p.dtype));
  }
}

}  // namespace encore::cuda
