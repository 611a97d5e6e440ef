// Split-row RMSNorm / add-RMSNorm for decode batches (a few long rows): every block owns one slice
// of blockDim.x 16-byte packs of every row, so a row's memory traffic spreads over many SMs.
//
// Math: as rms_norm_kernel.cuh. Phases:
//   kPartial: h = x (+ residual, written); partials[r * slices + slice] = sum over the slice of h^2
//   kFinish:  rstd_r = rsqrt(sum_s partials[r * slices + s] / hidden + eps); y = h * rstd_r * (w + off)
//   kFused:   both, separated by a grid barrier (cooperative launch: all blocks co-resident)
// Shapes: rows <= norm::kSplitRowMaxRows; grid = slices = ceil(hidden / kVec / blockDim.x); partials fp32
//   [rows, slices] in the workspace. h (or x) is re-read in the finish phase by the thread that
//   wrote it (L2-resident); partials written by other blocks are read with ld.global.cg (L2).
#pragma once
#include <cstdint>

#include "common/cuda/grid_barrier.cuh"
#include "common/cuda/reduce.cuh"
#include "common/cuda/vector_io.cuh"
#include "norm/cuda/rms_norm_kernel.cuh"
#include "norm/problem.hpp"

namespace encore::cuda {

enum class SplitPhase { kPartial, kFinish, kFused };
constexpr int kSplitThreads = norm::kSplitRowThreads;

template <typename T, bool kAdd, SplitPhase kPhase>
__global__ void __launch_bounds__(kSplitThreads) rms_norm_split_kernel(RmsNormParams<T> p, float* partials,
                                                                      GridBarrierState* barrier) {
  constexpr int kVec = 16 / int(sizeof(T));
  using P = Pack<T, kVec>;
  __shared__ float scratch[kSplitThreads / 32];
  __shared__ float row_total;
  const int slices = gridDim.x;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;  // this thread's pack of every row
  const bool active = j < p.hidden / kVec;
  constexpr int kWarps = kSplitThreads / 32;

  if constexpr (kPhase != SplitPhase::kFinish) {
    for (int64_t r = 0; r < p.rows; ++r) {
      float ss = 0.f;
      if (active) {
        P v = load_pack<T, kVec>(p.x + r * p.x_stride + j * kVec);
        if constexpr (kAdd) {
          v = add_rounded(v, load_pack<T, kVec>(p.residual + r * p.residual_stride + j * kVec));
          store_pack(p.h + r * p.h_stride + j * kVec, v);
        }
        ss = pack_sumsq(v);
      }
      ss = team_sum(ss, kWarps, scratch, 0);
      if (threadIdx.x == 0) partials[r * slices + blockIdx.x] = ss;
      __syncthreads();  // scratch is reused by the next row
    }
  }
  if constexpr (kPhase == SplitPhase::kFused) grid_barrier(barrier);
  if constexpr (kPhase != SplitPhase::kPartial) {
    const P w = active ? load_pack<T, kVec>(p.weight + j * kVec) : P{};
    for (int64_t r = 0; r < p.rows; ++r) {
      if (threadIdx.x < 32) {
        float t = 0.f;
        for (int s = threadIdx.x; s < slices; s += 32) t += __ldcg(partials + r * slices + s);
        t = group_sum<32>(t);
        if (threadIdx.x == 0) row_total = t;
      }
      __syncthreads();
      const float rstd = rsqrtf(row_total / float(p.hidden) + p.eps);
      if (active) {
        const T* src = kAdd ? p.h + r * p.h_stride : p.x + r * p.x_stride;
        store_pack(p.y + r * p.y_stride + j * kVec, normalize(load_pack<T, kVec>(src + j * kVec), w, rstd, p.weight_offset));
      }
      __syncthreads();  // row_total is rewritten for the next row
    }
  }
}

}  // namespace encore::cuda
