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
// The JIT's split of launch_mx_quant (quant/mx_quant_jit.cpp): everything before the quantization
// kernel (zeroing the swizzled padding; NVFP4's global-scale passes) on `stream`, and that kernel's
// argument (MxParams) written to `params` (at least kMxParamsMaxBytes bytes). *threads: the kernel's
// threads, one per 8 elements for MXFP8 and per 16 for NVFP4 (0: nothing to quantize), in blocks of
// kMxQuantThreads.
constexpr size_t kMxParamsMaxBytes = 128;
constexpr int kMxQuantThreads = 256;
Status mx_quant_prologue(const quant::MxProblem& p, int device_index, Stream stream, void* params, uint32_t* threads);

}  // namespace encore::cuda
