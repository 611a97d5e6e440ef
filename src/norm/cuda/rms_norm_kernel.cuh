// RMSNorm and fused residual-add + RMSNorm, one row per team of warps.
//
// Math:  h = x (+ residual, rounded to T, written to h);  y = h * rsqrt(mean(h^2) + eps) * (w + offset)
// Shapes: x, residual, y, h [rows, hidden] with row strides; w [hidden]; T in {bf16, fp16, fp32}.
// Mapping: a block holds rows_per_block teams of 32 * warps_per_row threads; team t owns row
//   blockIdx.x * rows_per_block + t and walks it in packs of kVec elements (16 bytes when
//   vectorized, 32 bytes on sm_100+ where the plan widens them: one 256-bit access; else 1
//   element), pack j of the row going to thread j % team_size (coalesced).
// kCached > 0: each thread keeps its kCached packs of h in registers between the reduction and the
//   output (one read, one write per element). kCached == 0: streaming, h is re-read for the output
//   (for rows too long to cache; the re-read mostly hits L1/L2), 4 packs per thread at a time.
// kAdd: residual add (reads residual, writes h) or plain RMSNorm.
// Aliasing: h may be x or residual and y may be x — each element is read, then written, by one thread.
// kHidden > 0: the hidden size is a compile-time constant (the JIT specialization, src/norm/rms_norm_jit.cpp;
//   p.hidden must equal it); 0: read from p.hidden (the ahead-of-time kernels). kWarpsPerRow > 0: the
//   team size too (p.warps_per_row must equal it), so each thread's pack offsets are immediates: a
//   constant hidden alone (run-time team size) needs more registers than the AOT kernel and spills at
//   the 128-register cap of 512-thread blocks (bf16 hidden 5184 / 3000 with 8 cached packs: 128
//   registers + 104 bytes of stack against 117 and none; with the team size constant 111 / 93, none).
// Constraints (checked in validate / plan): kVec > 1 needs 16-byte aligned pointers and hidden and
//   row strides that are multiples of kVec; block size <= 512.
// One source, two ways in: rms_norm.cu #includes this file; the build embeds it as a string that
//   NVRTC compiles (__CUDACC_RTC__: no host headers, int64_t from the JIT prelude).
#pragma once
#ifndef __CUDACC_RTC__
#include <cstdint>
#endif

#include "common/cuda/reduce.cuh"
#include "common/cuda/vector_io.cuh"
#ifndef __CUDACC_RTC__
#include "norm/problem.hpp"
#endif

namespace encore::cuda {

template <typename T>
struct RmsNormParams {
  const T* x;
  int64_t x_stride;
  const T* residual;  // null: plain RMSNorm
  int64_t residual_stride;
  const T* weight;
  T* y;
  int64_t y_stride;
  T* h;  // null: plain RMSNorm
  int64_t h_stride;
  int64_t rows;
  int hidden;
  int warps_per_row;
  int rows_per_block;
  float eps;
  float weight_offset;
};

constexpr int kRmsNormMaxThreads = 512;

#ifndef __CUDACC_RTC__
// Kernel parameters from a validated problem (the launch plan's fields are set by the caller).
template <typename T>
inline RmsNormParams<T> make_rms_norm_params(const norm::RmsNormProblem& p) {
  RmsNormParams<T> k{};
  k.x = static_cast<const T*>(p.x);
  k.x_stride = p.x_stride;
  k.residual = static_cast<const T*>(p.residual);
  k.residual_stride = p.residual_stride;
  k.weight = static_cast<const T*>(p.weight);
  k.y = static_cast<T*>(p.y);
  k.y_stride = p.y_stride;
  k.h = static_cast<T*>(p.h);
  k.h_stride = p.h_stride;
  k.rows = p.rows;
  k.hidden = int(p.hidden);
  k.warps_per_row = 1;
  k.rows_per_block = 1;
  k.eps = p.eps;
  k.weight_offset = p.weight_offset;
  return k;
}
#endif  // __CUDACC_RTC__

template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> add_rounded(const Pack<T, kVec>& a, const Pack<T, kVec>& b) {
  Pack<T, kVec> out;
#pragma unroll
  for (int e = 0; e < kVec; ++e) out.v[e] = from_float<T>(to_float(a.v[e]) + to_float(b.v[e]));
  return out;
}

template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> normalize(const Pack<T, kVec>& hv, const Pack<T, kVec>& wv,
                                                   float rstd, float offset) {
  Pack<T, kVec> out;
#pragma unroll
  for (int e = 0; e < kVec; ++e) out.v[e] = from_float<T>(to_float(hv.v[e]) * rstd * (to_float(wv.v[e]) + offset));
  return out;
}

// Loads of later packs must not wait behind stores of earlier ones (h and y may alias inputs, so
// the compiler keeps program order between them): every phase loads all of its packs first, then
// computes and stores.
template <typename T, int kVec, int kCached, bool kAdd, int kHidden = 0, int kWarpsPerRow = 0>
__global__ void __launch_bounds__(kRmsNormMaxThreads) rms_norm_kernel(RmsNormParams<T> p) {
  const int hidden = kHidden > 0 ? kHidden : p.hidden;
  constexpr int kBatch = kCached > 0 ? kCached : 4;  // packs per thread held at once
  using P = Pack<T, kVec>;
  __shared__ float scratch[kRmsNormMaxThreads / 32];
  const int warps_per_row = kWarpsPerRow > 0 ? kWarpsPerRow : p.warps_per_row;
  const int team_size = 32 * warps_per_row;
  const int team = threadIdx.x / team_size;
  const int tid = threadIdx.x % team_size;
  const int64_t row = int64_t(blockIdx.x) * p.rows_per_block + team;
  const bool valid = row < p.rows;  // invalid teams still join the block-wide barrier
  const int num_packs = valid ? hidden / kVec : 0;

  const T* x = p.x + row * p.x_stride;
  const T* res = kAdd ? p.residual + row * p.residual_stride : nullptr;
  T* h = kAdd ? p.h + row * p.h_stride : nullptr;
  T* y = p.y + row * p.y_stride;

  // Phase 1 over packs [j0, j0 + kBatch * team_size): load x (+ residual), form h, store h, sum h^2.
  P hv[kBatch];
  float sumsq = 0.f;
  auto load_h = [&](int j0) {
    P rv[kAdd ? kBatch : 1];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int j = j0 + tid + i * team_size;
      if (j < num_packs) {
        // Cached rows are read once: evict-first. Streamed rows are re-read: default caching.
        hv[i] = kCached > 0 ? load_pack_once<T, kVec>(x + j * kVec) : load_pack_global<T, kVec>(x + j * kVec);
        if constexpr (kAdd) rv[i] = load_pack_once<T, kVec>(res + j * kVec);
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int j = j0 + tid + i * team_size;
      if (j < num_packs) {
        if constexpr (kAdd) {
          hv[i] = add_rounded(hv[i], rv[i]);
          if constexpr (kCached > 0) store_pack_once(h + j * kVec, hv[i]);
          else store_pack_global(h + j * kVec, hv[i]);  // re-read below: keep it in L2
        }
        sumsq += pack_sumsq(hv[i]);
      }
    }
  };
  // Phase 2 over the same range: y = h * rstd * (w + offset), h from registers or re-read from src.
  auto store_y = [&](int j0, float rstd, const T* src) {
    P wv[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int j = j0 + tid + i * team_size;
      if (j < num_packs) {
        wv[i] = load_pack_global<T, kVec>(p.weight + j * kVec);
        if (src) hv[i] = load_pack_global<T, kVec>(src + j * kVec);
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int j = j0 + tid + i * team_size;
      if (j < num_packs) store_pack_once(y + j * kVec, normalize(hv[i], wv[i], rstd, p.weight_offset));
    }
  };

  if constexpr (kCached > 0) {
    load_h(0);
    const float rstd = rsqrtf(team_sum(sumsq, warps_per_row, scratch, team * warps_per_row) / float(hidden) + p.eps);
    store_y(0, rstd, nullptr);
  } else {
    const int step = kBatch * team_size;
    for (int j0 = 0; j0 < num_packs; j0 += step) load_h(j0);
    const float rstd = rsqrtf(team_sum(sumsq, warps_per_row, scratch, team * warps_per_row) / float(hidden) + p.eps);
    const T* src = kAdd ? h : x;  // h was written by this same thread above
    for (int j0 = 0; j0 < num_packs; j0 += step) store_y(j0, rstd, src);
  }
}

}  // namespace encore::cuda
