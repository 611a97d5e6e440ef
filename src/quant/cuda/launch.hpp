// Host entries of the quant family's CUDA kernels (no CUDA types).
#pragma once
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "quant/problem.hpp"

namespace encore::cuda {

Status launch_fp8_group_quant(const quant::Fp8QuantProblem& p, const quant::Fp8QuantLaunchPlan& plan, Stream stream);
// The kernel argument (Fp8QuantParams<T>, the same layout for every T) of a JIT-compiled
// fp8_group_quant_kernel, written to `out` (at least kFp8QuantParamsMaxBytes bytes).
constexpr size_t kFp8QuantParamsMaxBytes = 128;
Status fp8_group_quant_kernel_params(const quant::Fp8QuantProblem& p, const quant::Fp8QuantLaunchPlan& plan, void* out);

// MXFP8 / NVFP4 (src/quant/cuda/mx_quant.cu): the quantization of a validated problem (NVFP4 with
// p.given_global == 0: amax pass, global scale, quantization pass), or its inverse; asynchronous on
// `stream`, no allocation.
Status launch_mx_quant(const quant::MxProblem& p, int device_index, Stream stream);
Status launch_mx_dequant(const quant::MxProblem& p, int device_index, Stream stream);

}  // namespace encore::cuda
