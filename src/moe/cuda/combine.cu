// MoE combine on CUDA: one 128-thread block per token (a grid-stride loop over tokens); each thread
// owns packs of kVec consecutive columns (kVec = 8 when every row of expert_out and out is aligned to
// 8 elements, else 1) and accumulates out[t, d] = fma(w[t, j], y[slot_rows[t, j], d], acc) in fp32
// for j = 0..k-1 in order, from acc = 0, then rounds once to out's dtype: the CPU reference's chain
// (one fma per slot, inputs widened exactly to fp32), so the result is bit-equal to it. Slot rows
// outside [0, R) (not scanned on the host for device tensors) contribute nothing.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/vector_io.cuh"
#include "moe/cuda/launch.hpp"

namespace encore::cuda {
namespace {

constexpr int kThreads = 128;

struct CombineParams {
  const void* eo;
  int64_t eo_stride;
  int64_t eo_rows;
  const int32_t* slot_rows;
  int64_t slot_stride;
  const float* weights;
  int64_t weights_stride;
  void* out;
  int64_t out_stride;
  int64_t tokens, hidden;
  int k;
};

template <typename TI, typename TO, int kVec>
__global__ void __launch_bounds__(kThreads) moe_combine_kernel(CombineParams p) {
  const TI* eo = static_cast<const TI*>(p.eo);
  TO* out = static_cast<TO*>(p.out);
  const int64_t packs = p.hidden / kVec;
  for (int64_t t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    const int32_t* rows = p.slot_rows + t * p.slot_stride;
    const float* w = p.weights + t * p.weights_stride;
    for (int64_t c = threadIdx.x; c < packs; c += blockDim.x) {
      float acc[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
      for (int j = 0; j < p.k; ++j) {
        const int32_t r = __ldg(rows + j);
        if (r < 0 || r >= p.eo_rows) continue;
        const float wj = __ldg(w + j);
        const Pack<TI, kVec> y = load_pack<TI, kVec>(eo + int64_t(r) * p.eo_stride + c * kVec);
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = __fmaf_rn(wj, to_float<TI>(y.v[i]), acc[i]);
      }
      Pack<TO, kVec> o;
#pragma unroll
      for (int i = 0; i < kVec; ++i) o.v[i] = from_float<TO>(acc[i]);
      store_pack<TO, kVec>(out + t * p.out_stride + c * kVec, o);
    }
  }
}

template <typename TI, typename TO>
void* pick(bool vec) {
  return vec ? reinterpret_cast<void*>(moe_combine_kernel<TI, TO, 8>) : reinterpret_cast<void*>(moe_combine_kernel<TI, TO, 1>);
}

template <typename TI>
void* pick_out(DType out, bool vec) {
  switch (out) {
    case DType::kFP32: return pick<TI, float>(vec);
    case DType::kBF16: return pick<TI, __nv_bfloat16>(vec);
    case DType::kFP16: return pick<TI, __half>(vec);
    default: return nullptr;
  }
}

bool aligned_rows(const void* base, int64_t stride, DType t, int64_t hidden) {
  const size_t esz = dtype_size(t), bytes = 8 * esz;
  return hidden % 8 == 0 && (size_t(stride) * esz) % bytes == 0 && reinterpret_cast<uintptr_t>(base) % bytes == 0;
}

}  // namespace

Status launch_moe_combine(const moe::CombineProblem& p, int64_t eo_rows, int device_index, Stream stream) {
  if (p.tokens == 0 || p.hidden == 0) return Status::ok();
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  CombineParams k{};
  k.eo = p.expert_out;
  k.eo_stride = p.eo_stride;
  k.eo_rows = eo_rows;
  k.slot_rows = p.slot_rows;
  k.slot_stride = p.slot_stride;
  k.weights = p.weights;
  k.weights_stride = p.weights_stride;
  k.out = p.out;
  k.out_stride = p.out_stride;
  k.tokens = p.tokens;
  k.hidden = p.hidden;
  k.k = p.top_k;
  const bool vec = aligned_rows(p.expert_out, p.eo_stride, p.eo_dtype, p.hidden) && aligned_rows(p.out, p.out_stride, p.out_dtype, p.hidden);
  void* fn = nullptr;
  switch (p.eo_dtype) {
    case DType::kFP32: fn = pick_out<float>(p.out_dtype, vec); break;
    case DType::kBF16: fn = pick_out<__nv_bfloat16>(p.out_dtype, vec); break;
    case DType::kFP16: fn = pick_out<__half>(p.out_dtype, vec); break;
    default: break;
  }
  if (!fn) return Status::internal(std::string("moe combine: no CUDA kernel for ") + dtype_name(p.eo_dtype) + " -> " + dtype_name(p.out_dtype));
  const long long cap = 1LL << 20;
  const unsigned grid = unsigned(p.tokens < cap ? p.tokens : cap);
  void* args[] = {&k};
  cudaError_t e = cudaLaunchKernel(fn, dim3(grid), dim3(kThreads), args, 0, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return Status::cuda_error(std::string("moe combine launch: ") + cudaGetErrorString(e));
  return Status::ok();
}

}  // namespace encore::cuda
