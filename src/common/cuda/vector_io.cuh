// Vector I/O helpers: an aligned pack of kN elements loaded/stored with one instruction
// (16 bytes for kN * sizeof(T) == 16), and fp32 conversions for bf16/fp16/fp32.
// 256-bit global accesses: on sm_100 and later (ENCORE_GLOBAL_256) 32 bytes move with one
// ld/st.global.v8.b32 when the address is 32-byte aligned; elsewhere (sm_90, or a 16-byte aligned
// address) as two 128-bit accesses, the code the sm_90 build always had.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define ENCORE_GLOBAL_256 1
#else
#define ENCORE_GLOBAL_256 0
#endif

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

// ---- 32-byte global accesses ----
struct alignas(32) Bits256 {
  uint4 lo, hi;
};

__device__ __forceinline__ bool aligned32(const void* p) { return (reinterpret_cast<unsigned long long>(p) & 31ull) == 0; }

#if ENCORE_GLOBAL_256
// One 256-bit access (sm_100+; p global and 32-byte aligned). kCache: kCacheDefault, kCacheStreaming
// (.cs, evict-first), kCacheReadOnly (loads: .nc, the read-only path of __ldg).
constexpr int kCacheDefault = 0, kCacheStreaming = 1, kCacheReadOnly = 2;
#define ENCORE_LD_V8(op)                                                                                                    \
  asm volatile(op " {%0, %1, %2, %3, %4, %5, %6, %7}, [%8];"                                                              \
               : "=r"(r.lo.x), "=r"(r.lo.y), "=r"(r.lo.z), "=r"(r.lo.w), "=r"(r.hi.x), "=r"(r.hi.y), "=r"(r.hi.z), "=r"(r.hi.w) \
               : "l"(p))
template <int kCache>
__device__ __forceinline__ Bits256 ld_global_v8(const void* p) {
  Bits256 r;
  if constexpr (kCache == kCacheStreaming) ENCORE_LD_V8("ld.global.cs.v8.b32");
  else if constexpr (kCache == kCacheReadOnly) ENCORE_LD_V8("ld.global.nc.v8.b32");
  else ENCORE_LD_V8("ld.global.v8.b32");
  return r;
}
#undef ENCORE_LD_V8
// kStreaming: st.global.cs.
template <bool kStreaming>
__device__ __forceinline__ void st_global_v8(void* p, const Bits256& v) {
  if constexpr (kStreaming)
    asm volatile("st.global.cs.v8.b32 [%0], {%1, %2, %3, %4, %5, %6, %7, %8};" ::"l"(p), "r"(v.lo.x), "r"(v.lo.y), "r"(v.lo.z), "r"(v.lo.w),
                 "r"(v.hi.x), "r"(v.hi.y), "r"(v.hi.z), "r"(v.hi.w)
                 : "memory");
  else
    asm volatile("st.global.v8.b32 [%0], {%1, %2, %3, %4, %5, %6, %7, %8};" ::"l"(p), "r"(v.lo.x), "r"(v.lo.y), "r"(v.lo.z), "r"(v.lo.w),
                 "r"(v.hi.x), "r"(v.hi.y), "r"(v.hi.z), "r"(v.hi.w)
                 : "memory");
}
#endif

// 32 bytes at a 16-byte aligned global address, streaming (evict-first loads, streaming stores).
__device__ __forceinline__ Bits256 load_global_32_once(const void* p) {
#if ENCORE_GLOBAL_256
  if (aligned32(p)) return ld_global_v8<kCacheStreaming>(p);
#endif
  const uint4* q = static_cast<const uint4*>(p);
  return Bits256{__ldcs(q), __ldcs(q + 1)};
}
__device__ __forceinline__ void store_global_32_once(void* p, const Bits256& v) {
#if ENCORE_GLOBAL_256
  if (aligned32(p)) return st_global_v8<true>(p, v);
#endif
  uint4* q = static_cast<uint4*>(p);
  __stcs(q, v.lo);
  __stcs(q + 1, v.hi);
}

// Streaming variants for data touched once: loads marked evict-first (ld.global.cs), stores
// streaming (st.global.cs), so single-use rows do not push reused data (weights) out of L2.
// A 32-byte pack (its type 32-byte aligned): one 256-bit access on sm_100+, two 128-bit ones elsewhere.
template <typename T, int kN>
__device__ __forceinline__ Pack<T, kN> load_pack_once(const T* p) {
  if constexpr (sizeof(Pack<T, kN>) == 16) {
    uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
    return *reinterpret_cast<Pack<T, kN>*>(&u);
  } else if constexpr (sizeof(Pack<T, kN>) == 32) {
#if ENCORE_GLOBAL_256
    const Bits256 b = ld_global_v8<kCacheStreaming>(p);  // the pack's type is 32-byte aligned
#else
    const Bits256 b = load_global_32_once(p);
#endif
    return *reinterpret_cast<const Pack<T, kN>*>(&b);
  } else {
    return load_pack<T, kN>(p);
  }
}

template <typename T, int kN>
__device__ __forceinline__ void store_pack_once(T* p, const Pack<T, kN>& v) {
  if constexpr (sizeof(Pack<T, kN>) == 16) {
    __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&v));
  } else if constexpr (sizeof(Pack<T, kN>) == 32) {
#if ENCORE_GLOBAL_256
    st_global_v8<true>(p, *reinterpret_cast<const Bits256*>(&v));
#else
    store_global_32_once(p, *reinterpret_cast<const Bits256*>(&v));
#endif
  } else {
    store_pack(p, v);
  }
}

// A pack in global memory with default caching: a 32-byte pack is one 256-bit access on sm_100+
// (its type is 32-byte aligned); every other pack, and every pack elsewhere, is load_pack / store_pack.
template <typename T, int kN>
__device__ __forceinline__ Pack<T, kN> load_pack_global(const T* p) {
#if ENCORE_GLOBAL_256
  if constexpr (sizeof(Pack<T, kN>) == 32) {
    const Bits256 b = ld_global_v8<kCacheDefault>(p);
    return *reinterpret_cast<const Pack<T, kN>*>(&b);
  }
#endif
  return load_pack<T, kN>(p);
}
template <typename T, int kN>
__device__ __forceinline__ void store_pack_global(T* p, const Pack<T, kN>& v) {
#if ENCORE_GLOBAL_256
  if constexpr (sizeof(Pack<T, kN>) == 32) return st_global_v8<false>(p, *reinterpret_cast<const Bits256*>(&v));
#endif
  store_pack<T, kN>(p, v);
}

// kN consecutive elements (whole 16-byte packs) at a 16-byte aligned global address, streaming:
// 32 bytes per access on sm_100+ when the address is 32-byte aligned, else 16-byte load_pack_once.
template <typename T, int kN>
__device__ __forceinline__ Pack<T, kN> load_span_once(const T* p) {
  constexpr int kVec = 16 / int(sizeof(T));
  static_assert(kN % kVec == 0, "whole 16-byte packs");
  Pack<T, kN> r;
#if ENCORE_GLOBAL_256
  if constexpr ((kN * sizeof(T)) % 32 == 0) {
    if (aligned32(p)) {
#pragma unroll
      for (int j = 0; j < kN / (2 * kVec); ++j) reinterpret_cast<Bits256*>(&r)[j] = ld_global_v8<kCacheStreaming>(p + j * 2 * kVec);
      return r;
    }
  }
#endif
#pragma unroll
  for (int j = 0; j < kN / kVec; ++j) {
    const Pack<T, kVec> h = load_pack_once<T, kVec>(p + j * kVec);
#pragma unroll
    for (int e = 0; e < kVec; ++e) r.v[j * kVec + e] = h.v[e];
  }
  return r;
}

}  // namespace encore::cuda
