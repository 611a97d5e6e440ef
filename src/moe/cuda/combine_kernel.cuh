// MoE combine kernel: one thread per (token, pack of kVec consecutive columns) item, 128-thread blocks,
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
// Specializations: TI, TO, kVec; the JIT (docs/jit.md) also bakes in k and D (0 in the ahead-of-time
//   kernels: read from the params): the slot loop has a constant trip count and the item's (token,
//   pack) split is a division by a constant. Same fmas in the same order: bit-identical output.
// sm_100+: an fp32 pack (32 bytes) is one 256-bit load / store (vector_io.cuh's load_pack_global).
// One source, two ways in: combine.cu #includes this file; the build embeds it for NVRTC.
#pragma once
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda/vector_io.cuh"

namespace encore::cuda {

constexpr int kCombineThreads = 128;

struct CombineParams {  // the same layout for every dtype pair
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

constexpr int kCombineBatch = 8;  // slots whose loads are in flight together

// kTopK, kHidden: 0 in the ahead-of-time kernels (read from p), k and D in a JIT specialization.
template <typename TI, typename TO, int kVec, int kTopK = 0, int kHidden = 0>
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(CombineParams p) {
  static_assert(kHidden % kVec == 0 && kTopK >= 0, "JIT combine: D a multiple of the pack");
  const TI* eo = static_cast<const TI*>(p.eo);
  TO* out = static_cast<TO*>(p.out);
  const int K = kTopK ? kTopK : p.k;
  const int64_t packs = kHidden ? int64_t(kHidden / kVec) : p.hidden / kVec;
  const int64_t items = p.tokens * packs;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t it = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; it < items; it += stride) {
    const int64_t t = it / packs, c = it - t * packs;
    const int32_t* rows = p.slot_rows + t * p.slot_stride;
    const float* w = p.weights + t * p.weights_stride;
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
    for (int j0 = 0; j0 < K; j0 += kCombineBatch) {
      Pack<TI, kVec> y[kCombineBatch];
      float wj[kCombineBatch];
      bool use[kCombineBatch];
#pragma unroll
      for (int b = 0; b < kCombineBatch; ++b) {
        const int j = j0 + b;
        const int32_t r = j < K ? __ldg(rows + j) : -1;
        use[b] = r >= 0 && r < p.eo_rows;
        wj[b] = j < K ? __ldg(w + j) : 0.0f;
        if (use[b]) y[b] = load_pack_global<TI, kVec>(eo + int64_t(r) * p.eo_stride + c * kVec);
      }
#pragma unroll
      for (int b = 0; b < kCombineBatch; ++b) {
        if (!use[b]) continue;
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = __fmaf_rn(wj[b], to_float<TI>(y[b].v[i]), acc[i]);
      }
    }
    Pack<TO, kVec> o;
#pragma unroll
    for (int i = 0; i < kVec; ++i) o.v[i] = from_float<TO>(acc[i]);
    store_pack_global<TO, kVec>(out + t * p.out_stride + c * kVec, o);  // fp32: one 256-bit access on sm_100+
  }
}

}  // namespace encore::cuda
