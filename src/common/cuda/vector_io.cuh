// Vector I/O helpers: an aligned pack of kN elements loaded/stored with one instruction
// (16 bytes for kN * sizeof(T) == 16), and fp32 conversions for bf16/fp16/fp32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace encore::cuda {

template <typename T, int kN>
struct alignas(sizeof(T) * kN) Pack {
  T v[kN];
};

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T, int kN>
__device__ __forceinline__ Pack<T, kN> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, kN>*>(p);
}

template <typename T, int kN>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, kN>& v) {
  *reinterpret_cast<Pack<T, kN>*>(p) = v;
}

// Sum of squares of a pack's elements, in fp32.
template <typename T, int kN>
__device__ __forceinline__ float pack_sumsq(const Pack<T, kN>& a) {
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < kN; ++e) s += to_float(a.v[e]) * to_float(a.v[e]);
  return s;
}

// Streaming variants for data touched once: loads marked evict-first (ld.global.cs), stores
// streaming (st.global.cs), so single-use rows do not push reused data (weights) out of L2.
template <typename T, int kN>
__device__ __forceinline__ Pack<T, kN> load_pack_once(const T* p) {
  if constexpr (sizeof(Pack<T, kN>) == 16) {
    uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
    return *reinterpret_cast<Pack<T, kN>*>(&u);
  } else {
    return load_pack<T, kN>(p);
  }
}

template <typename T, int kN>
__device__ __forceinline__ void store_pack_once(T* p, const Pack<T, kN>& v) {
  if constexpr (sizeof(Pack<T, kN>) == 16) {
    __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&v));
  } else {
    store_pack(p, v);
  }
}

}  // namespace encore::cuda
