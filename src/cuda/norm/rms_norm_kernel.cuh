// RMSNorm and fused residual-add + RMSNorm, one row per team of warps.
//
// Math:  h = x (+ residual, rounded to T, written to h);  y = h * rsqrt(mean(h^2) + eps) * (w + offset)
// Shapes: x, residual, y, h [rows, hidden] with row strides; w [hidden]; T in {bf16, fp16, fp32}.
// Mapping: a block holds rows_per_block teams of 32 * warps_per_row threads; team t owns row
//   blockIdx.x * rows_per_block + t and walks it in packs of kVec elements (16 bytes when
//   vectorized, else 1 element), pack j of the row going to thread j % team_size (coalesced).
// kCached > 0: each thread keeps its kCached packs of h in registers between the reduction and the
//   output (one read, one write per element). kCached == 0: streaming, h is re-read for the output
//   (for rows too long to cache; the re-read mostly hits L1/L2).
// Aliasing: h may be x or residual and y may be x — each element is read, then written, by one thread.
// Constraints (checked in validate / plan): kVec > 1 needs 16-byte aligned pointers and hidden and
//   row strides that are multiples of kVec; block size <= 512.
#pragma once
#include <cstdint>

#include "cuda/common/reduce.cuh"
#include "cuda/common/vector_io.cuh"

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

template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> add_rounded(const Pack<T, kVec>& a, const Pack<T, kVec>& b) {
  Pack<T, kVec> out;
#pragma unroll
  for (int e = 0; e < kVec; ++e) out.v[e] = from_float<T>(to_float(a.v[e]) + to_float(b.v[e]));
  return out;
}

template <typename T, int kVec>
__device__ __forceinline__ float pack_sumsq(const Pack<T, kVec>& a) {
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < kVec; ++e) s += to_float(a.v[e]) * to_float(a.v[e]);
  return s;
}

template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> normalize(const Pack<T, kVec>& hv, const Pack<T, kVec>& wv,
                                                   float rstd, float offset) {
  Pack<T, kVec> out;
#pragma unroll
  for (int e = 0; e < kVec; ++e) out.v[e] = from_float<T>(to_float(hv.v[e]) * rstd * (to_float(wv.v[e]) + offset));
  return out;
}

template <typename T, int kVec, int kCached>
__global__ void __launch_bounds__(kRmsNormMaxThreads) rms_norm_kernel(RmsNormParams<T> p) {
  __shared__ float scratch[kRmsNormMaxThreads / 32];
  const int team_size = 32 * p.warps_per_row;
  const int team = threadIdx.x / team_size;
  const int tid = threadIdx.x % team_size;
  const int64_t row = int64_t(blockIdx.x) * p.rows_per_block + team;
  const bool valid = row < p.rows;  // invalid teams still join the block-wide barrier
  const int num_packs = valid ? p.hidden / kVec : 0;

  const T* x = p.x + row * p.x_stride;
  const T* res = p.residual ? p.residual + row * p.residual_stride : nullptr;
  T* h = p.h ? p.h + row * p.h_stride : nullptr;
  T* y = p.y + row * p.y_stride;

  float sumsq = 0.f;
  Pack<T, kVec> cache[kCached > 0 ? kCached : 1];
  if constexpr (kCached > 0) {
#pragma unroll
    for (int i = 0; i < kCached; ++i) {
      const int j = tid + i * team_size;
      if (j < num_packs) cache[i] = load_pack<T, kVec>(x + j * kVec);
    }
    if (res) {
#pragma unroll
      for (int i = 0; i < kCached; ++i) {
        const int j = tid + i * team_size;
        if (j < num_packs) {
          cache[i] = add_rounded(cache[i], load_pack<T, kVec>(res + j * kVec));
          store_pack(h + j * kVec, cache[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kCached; ++i) {
      if (tid + i * team_size < num_packs) sumsq += pack_sumsq(cache[i]);
    }
  } else {
    for (int j = tid; j < num_packs; j += team_size) {
      Pack<T, kVec> v = load_pack<T, kVec>(x + j * kVec);
      if (res) {
        v = add_rounded(v, load_pack<T, kVec>(res + j * kVec));
        store_pack(h + j * kVec, v);
      }
      sumsq += pack_sumsq(v);
    }
  }

  sumsq = team_sum(sumsq, p.warps_per_row, scratch, team * p.warps_per_row);
  const float rstd = rsqrtf(sumsq / float(p.hidden) + p.eps);

  if constexpr (kCached > 0) {
#pragma unroll
    for (int i = 0; i < kCached; ++i) {
      const int j = tid + i * team_size;
      if (j < num_packs) {
        store_pack(y + j * kVec, normalize(cache[i], load_pack<T, kVec>(p.weight + j * kVec), rstd, p.weight_offset));
      }
    }
  } else {
    const T* src = h ? h : x;  // h was written by this same thread above
    for (int j = tid; j < num_packs; j += team_size) {
      store_pack(y + j * kVec, normalize(load_pack<T, kVec>(src + j * kVec), load_pack<T, kVec>(p.weight + j * kVec),
                                         rstd, p.weight_offset));
    }
  }
}

}  // namespace encore::cuda
