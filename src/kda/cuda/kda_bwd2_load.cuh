// The second CUDA KDA backward's layout-specialized row loader (K0 kda2_prep_kernel, K2a
// kda2_state_grads_kernel; docs/kda.md, "As built"): 16-byte cp.async.cg units straight into the
// kernels' padded bf16 shared tiles, rows past a chunk's end and channels past K / V zero-filled by the
// copy itself (source size 0..16 bytes), in commit groups in the order of use.
//
// RowPath, chosen on the host per launch (row_path): kBf16 / kFp16 when q, k, v, dO and beta are one
// 16-bit dtype whose rows start 16-byte aligned (data 16-byte aligned, batch / token / head strides
// multiples of 8 elements; the channel stride is 1 by validation), G's rows come in 16-byte units
// (K % 4 == 0, G 16-byte aligned) and the residuals Akk, Aqk, h are bf16 and 16-byte aligned (h's rows
// too: V % 8 == 0). Then the input rows land in shared memory as raw 16-bit values (fp16 converted to
// bf16 there, the exact rounding of the generic path) and the per-row math runs on them; kGeneric keeps
// the per-element dtype / alignment loads (kda_bwd2_device.cuh) for every other layout. Both paths feed
// the same expressions with the same values, so every output is bit-identical between them.
// The workspace tiles (-W, dVnew, dS': bf16, 256-byte rows) take cp.async on both paths.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kda/cuda/kda_bwd2_device.cuh"

namespace encore::cuda::kda2 {

enum class RowPath : int { kGeneric = 0, kBf16 = 1, kFp16 = 2 };

// Host: the path for problem p (K2a reads h: with_h adds h's conditions).
inline RowPath row_path(const KdaBwdCudaProblem& p, bool with_h) {
  auto a16 = [](const void* x) { return (reinterpret_cast<uintptr_t>(x) & 15u) == 0; };
  const DType dt = p.q.dtype;
  if (dt != DType::kBF16 && dt != DType::kFP16) return RowPath::kGeneric;
  for (const KdaTensor* x : {&p.q, &p.k, &p.v, &p.d_o})
    if (x->dtype != dt || !a16(x->data) || x->sb % 8 != 0 || x->st % 8 != 0 || x->sh % 8 != 0) return RowPath::kGeneric;
  if (p.beta.dtype != dt || p.K % 4 != 0 || !a16(p.G)) return RowPath::kGeneric;
  if (p.akk_dtype != DType::kBF16 || p.aqk_dtype != DType::kBF16 || !a16(p.Akk) || !a16(p.Aqk)) return RowPath::kGeneric;
  if (with_h && (p.h_dtype != DType::kBF16 || !a16(p.h) || p.V % 8 != 0)) return RowPath::kGeneric;
  return dt == DType::kBF16 ? RowPath::kBf16 : RowPath::kFp16;
}

// 16 bytes global -> shared, the last 16 - bytes zero (bytes 0: all zero, src not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) { cp_async16(dst, src, valid ? 16 : 0); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Rows i < kRows of 16-bit values at base + i * step bytes into dst[i * ld + c] (c < 128) by the
// block's kN threads: channels c < C copied where i < rows, the rest zero. base and step 16-byte
// aligned. No commit. Thread x's units are (row x / 16 + kN / 16 u, 8 channels from 8 (x % 16)): its
// channels, their count and its first source address once, then one step of kN / 16 rows a unit; a unit
// of source size 0 reads nothing and points at base.
template <int kN, int kRows = kdabwd::kC>
__device__ __forceinline__ void copy_rows(__nv_bfloat16* dst, int ld, const unsigned char* base, int64_t step, int rows, int C) {
  static_assert(kN % 16 == 0 && kRows * 16 % kN == 0, "whole units a thread, whole rows a pass");
  constexpr int kStep = kN / 16;  // rows between a thread's units
  const int i0 = int(threadIdx.x >> 4), c = 8 * int(threadIdx.x & 15), nc = min(max(C - c, 0), 8);
  const unsigned char* src = base + int64_t(i0) * step + 2 * c;
  const int64_t ustep = int64_t(kStep) * step;
#pragma unroll
  for (int u = 0; u < kRows / kStep; ++u) {
    const int i = i0 + kStep * u, n = i < rows ? nc : 0;  // elements copied
    cp_async16(dst + i * ld + c, n > 0 ? src + u * ustep : base, 2 * n);
  }
}
// The chunk's rows i < 64 of a [tokens][HV][64] bf16 residual (Akk, Aqk) from row0 (the chunk's first
// token, its head), `stride` elements a row: columns j <= i copied where i < rows (the lower triangle
// with the diagonal, as the generic path's masks), the rest zero. Thread x's units: row x / 8 + kN / 8 u,
// columns from 8 (x % 8).
template <int kN>
__device__ __forceinline__ void copy_tri(__nv_bfloat16* dst, int ld, const __nv_bfloat16* row0, int64_t stride, int rows) {
  static_assert(kN % 8 == 0 && kdabwd::kC * 8 % kN == 0, "whole units a thread, whole rows a pass");
  constexpr int kStep = kN / 8;
  const int i0 = int(threadIdx.x >> 3), c = 8 * int(threadIdx.x & 7);
  const __nv_bfloat16* src = row0 + int64_t(i0) * stride + c;
  const int64_t ustep = int64_t(kStep) * stride;
#pragma unroll
  for (int u = 0; u < kdabwd::kC / kStep; ++u) {
    const int i = i0 + kStep * u, n = i < rows ? min(max(i + 1 - c, 0), 8) : 0;
    cp_async16(dst + i * ld + c, n > 0 ? src + u * ustep : row0, 2 * n);
  }
}

// A raw 16-bit value of RowPath P as float (exact).
template <RowPath P>
__device__ __forceinline__ float cvt16(uint32_t bits) {
  if constexpr (P == RowPath::kBf16) return __uint_as_float(bits << 16);
  else return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}
// Channels c0 .. c0 + 3 of a raw 16-bit shared row (8 bytes) as floats.
template <RowPath P>
__device__ __forceinline__ void raw4(const __nv_bfloat16* at, float (&out)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(at);
  out[0] = cvt16<P>(u.x & 0xffffu), out[1] = cvt16<P>(u.x >> 16), out[2] = cvt16<P>(u.y & 0xffffu), out[3] = cvt16<P>(u.y >> 16);
}
// Element (b, t, h) of a [B, T, H] 16-bit input (beta) as float, 0 when !ok; straight-line.
template <RowPath P>
__device__ __forceinline__ float scalar16(const KdaTensor& x, int b, int t, int h, bool ok) {
  const int64_t off = ok ? int64_t(b) * x.sb + int64_t(t) * x.st + int64_t(h) * x.sh : 0;
  const float v = cvt16<P>(__ldg(static_cast<const unsigned short*>(x.data) + off));
  return ok ? v : 0.f;
}
// Channels c0 .. c0 + 3 of G [tokens][K] fp32 at `row` (K % 4 == 0, 16-byte aligned: one load), 0 when !ok.
__device__ __forceinline__ void g4(const float* G, int64_t row, int K, int c0, bool ok, float (&out)[4]) {
  const float4 f = __ldg(reinterpret_cast<const float4*>(G + (ok ? row * K + c0 : 0)));
  out[0] = ok ? f.x : 0.f, out[1] = ok ? f.y : 0.f, out[2] = ok ? f.z : 0.f, out[3] = ok ? f.w : 0.f;
}
// fp16 -> bf16 in place over dst's [64][ld] tile, 4 channels a lane of row i (the generic path's
// float -> bf16 rounding of its fp16 loads).
__device__ __forceinline__ void fp16_to_bf16(__nv_bfloat16* at) {
  float x[4];
  raw4<RowPath::kFp16>(at, x);
  *reinterpret_cast<uint2*>(at) = make_uint2(kda::pack_bf16(x[0], x[1]), kda::pack_bf16(x[2], x[3]));
}

}  // namespace encore::cuda::kda2
