// MoE combine on CUDA: one thread per (token, pack of kVec consecutive columns) item, 128-thread blocks,
// a grid-stride loop over the T * D / kVec items (kVec = 8 when every row of expert_out and out is
// aligned to 8 elements, else 1); consecutive lanes take consecutive packs of a token, so each slot's
// row is read coalesced. Each thread accumulates out[t, d] = fma(w[t, j], y[slot_rows[t, j], d], acc)
// in fp32 for j = 0..k-1 in order, from acc = 0, then rounds once to out's dtype: the CPU reference's
// chain (one fma per slot, inputs widened exactly to fp32), so the result is bit-equal to it. The
// loads of kBatch slots are issued before their fmas (the order of the fmas is unchanged), so a thread
// has up to kBatch rows in flight. Slot rows outside [0, R) (not scanned on the host for device
// tensors) contribute nothing.
// NOTES: the previous launch shape, one block per token with a loop over slots, had one load in flight
// per thread: 11-33 us at T <= 64 on the H200 (one or a few blocks on 132 SMs).
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

constexpr int kBatch = 8;  // slots whose loads are in flight together

template <typename TI, typename TO, int kVec>
__global__ void __launch_bounds__(kThreads) moe_combine_kernel(CombineParams p) {
  const TI* eo = static_cast<const TI*>(p.eo);
  TO* out = static_cast<TO*>(p.out);
  const int64_t packs = p.hidden / kVec;
  const int64_t items = p.tokens * packs;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t it = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; it < items; it += stride) {
    const int64_t t = it / packs, c = it - t * packs;
    const int32_t* rows = p.slot_rows + t * p.slot_stride;
    const float* w = p.weights + t * p.weights_stride;
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
    for (int j0 = 0; j0 < p.k; j0 += kBatch) {
      Pack<TI, kVec> y[kBatch];
      float wj[kBatch];
      bool use[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int j = j0 + b;
        const int32_t r = j < p.k ? __ldg(rows + j) : -1;
        use[b] = r >= 0 && r < p.eo_rows;
        wj[b] = j < p.k ? __ldg(w + j) : 0.0f;
        if (use[b]) y[b] = load_pack<TI, kVec>(eo + int64_t(r) * p.eo_stride + c * kVec);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (!use[b]) continue;
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = __fmaf_rn(wj[b], to_float<TI>(y[b].v[i]), acc[i]);
      }
    }
    Pack<TO, kVec> o;
#pragma unroll
    for (int i = 0; i < kVec; ++i) o.v[i] = from_float<TO>(acc[i]);
    store_pack<TO, kVec>(out + t * p.out_stride + c * kVec, o);
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
  const int64_t items = p.tokens * (vec ? p.hidden / 8 : p.hidden);
  const int64_t cap = int64_t(1) << 20;  // blocks; a grid-stride loop beyond
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  const unsigned grid = unsigned(blocks < cap ? blocks : cap);
  void* args[] = {&k};
  cudaError_t e = cudaLaunchKernel(fn, dim3(grid), dim3(kThreads), args, 0, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return Status::cuda_error(std::string("moe combine launch: ") + cudaGetErrorString(e));
  return Status::ok();
}

}  // namespace encore::cuda
