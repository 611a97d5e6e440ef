// Device helpers shared by the second CUDA KDA backward's kernels (kda_bwd2.cu: K0 prep, K1 scan;
// kda_bwd2_grad.cu: K2a state products; kda_bwd2_wy.cu: K2b): the workspace pointers, bf16 pair stores and one warp's
// tensor-core product over shared-memory tiles (mma.sync m16n8k16, bf16 operands, fp32 accumulation).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kda/cuda/kda_bwd2.hpp"
#include "kda/cuda/kda_bwd_device.cuh"

namespace encore::cuda::kda2 {

using kdabwd::ChunkInfo;
using kdabwd::chunk_info;
using kdabwd::kC;
using kdabwd::ld_or0;
using kdabwd::ldg_or0;
using kdabwd::load_any_or0;
using kdabwd::load_or0;
using kdabwd::store_out;
using kdabwd::tok;

constexpr int kD = kKda2D;              // padded channels
constexpr int kLd = kD + 8;             // bf16 row stride of [*][128] shared tiles (ldmatrix rows on distinct banks)
constexpr int kLdC = kdabwd::kC + 8;    // of [*][64] tiles

struct Ptrs {  // the intermediates in the workspace (Kda2Layout)
  __nv_bfloat16 *qg, *kg, *wn, *dvl, *dsp, *dvn, *dw, *daqk, *daqk_lo, *da;
  float *egc, *dqi, *dki, *sd, *gp;
};

inline Ptrs ptrs_of(const Kda2Layout& l, void* workspace) {
  auto* base = static_cast<unsigned char*>(workspace);
  auto bf = [&](size_t at) { return reinterpret_cast<__nv_bfloat16*>(base + at); };
  auto f32 = [&](size_t at) { return reinterpret_cast<float*>(base + at); };
  return Ptrs{bf(l.qg), bf(l.kg), bf(l.wn), bf(l.dvl), bf(l.dsp), bf(l.dvn), bf(l.dw), bf(l.daqk), bf(l.daqk_lo), bf(l.da),
              f32(l.egc), f32(l.dqi), f32(l.dki), f32(l.sd), f32(l.gp)};
}

// Four bf16 channels c0 .. c0 + 3 of a workspace row (8 bytes) when ok, else zeros; channels at or
// past `limit` zero too (K1 writes dVnew only for the value-column slices it runs). Straight-line: the
// load always issues (at the row's start when !ok), so a row loop keeps its loads in flight.
__device__ __forceinline__ uint2 load4_or0(const __nv_bfloat16* row, int c0, bool ok, int limit = kD) {
  uint2 u = *reinterpret_cast<const uint2*>(row + (ok ? c0 : 0));
  if (!ok) u = make_uint2(0u, 0u);
  const uint32_t lo = c0 + 1 < limit ? 0xffffffffu : c0 < limit ? 0x0000ffffu : 0u;
  const uint32_t hi = c0 + 3 < limit ? 0xffffffffu : c0 + 2 < limit ? 0x0000ffffu : 0u;
  return make_uint2(u.x & lo, u.y & hi);
}
// Two bf16 values (4 bytes) at x + off when ok, else zeros; straight-line.
__device__ __forceinline__ uint32_t load2_or0(const __nv_bfloat16* x, int64_t off, bool ok) {
  const uint32_t u = *reinterpret_cast<const uint32_t*>(x + (ok ? off : 0));
  return ok ? u : 0u;
}
// One bf16 value as float when ok, else 0; straight-line.
__device__ __forceinline__ float loadbf_or0(const __nv_bfloat16* x, int64_t off, bool ok) {
  const float v = __bfloat162float(x[ok ? off : 0]);
  return ok ? v : 0.f;
}

// The rows t0 + i (i < 64) of one chunk of an input tensor [B, T, H, C] at batch b, head h: the
// address of row 0 computed once a block, a row one multiply-add away (the staging loops' address
// arithmetic, 64-bit per tensor and row through KdaTensor, dominated them).
struct Rows {
  const unsigned char* base;  // row 0, channel 0
  int64_t step;               // bytes from a row to the next
  int shift;                  // log2 of the element size: 2 fp32, 1 bf16 / fp16
  DType dtype;
};
__device__ __forceinline__ Rows rows_of(const KdaTensor& x, int b, int t0, int h) {
  const int shift = x.dtype == DType::kFP32 ? 2 : 1;
  return Rows{static_cast<const unsigned char*>(x.data) + ((int64_t(b) * x.sb + int64_t(t0) * x.st + int64_t(h) * x.sh) << shift),
              x.st << shift, shift, x.dtype};
}
// Element c of row i as float (bf16 / fp16 / fp32), 0 when !ok; straight-line (the load issues at row
// 0, channel 0 when !ok).
__device__ __forceinline__ float load1(const Rows& r, int i, int c, bool ok) {
  const unsigned char* at = r.base + (ok ? int64_t(i) * r.step + (int64_t(c) << r.shift) : 0);
  float v;
  if (r.shift == 2) {
    v = __ldg(reinterpret_cast<const float*>(at));
  } else {
    const unsigned short n = __ldg(reinterpret_cast<const unsigned short*>(at));
    v = r.dtype == DType::kBF16 ? __uint_as_float(uint32_t(n) << 16) : __half2float(__ushort_as_half(n));
  }
  return ok ? v : 0.f;
}
// Channels c0 .. c0 + 3 of row i (zeros at or past `limit`, or all when !valid): one 8- or 16-byte
// load where the four are in range and aligned, else one load each. Pass i = 0 when !valid.
__device__ __forceinline__ void load4(const Rows& r, int i, int c0, int limit, bool valid, float (&out)[4]) {
  const unsigned char* at = r.base + int64_t(i) * r.step + (int64_t(c0) << r.shift);
  if (c0 + 3 < limit && (reinterpret_cast<uintptr_t>(at) & ((4u << r.shift) - 1)) == 0) {
    if (r.shift == 2) {
      const float4 f = __ldg(reinterpret_cast<const float4*>(at));
      out[0] = f.x, out[1] = f.y, out[2] = f.z, out[3] = f.w;
    } else {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(at));
      const uint32_t w[2] = {u.x, u.y};
      if (r.dtype == DType::kBF16) {
#pragma unroll
        for (int e = 0; e < 4; ++e) out[e] = __uint_as_float(e & 1 ? w[e >> 1] & 0xffff0000u : w[e >> 1] << 16);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) out[e] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[e >> 1] >> (16 * (e & 1)))));
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = valid ? out[e] : 0.f;
    return;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) out[e] = load1(r, i, c0 + e, valid && c0 + e < limit);
}

// The output side: rows t0 + i of a [B, T, H, C] output (bf16 / fp16 / fp32) at batch b, head h.
struct OutRows {
  unsigned char* base;
  int64_t step;
  int shift;
  DType dtype;
};
__device__ __forceinline__ OutRows out_rows(const KdaOutTensor& o, int b, int t0, int h) {
  const int shift = o.dtype == DType::kFP32 ? 2 : 1;
  return OutRows{static_cast<unsigned char*>(o.data) + ((int64_t(b) * o.sb + int64_t(t0) * o.st + int64_t(h) * o.sh) << shift), o.st << shift,
                 shift, o.dtype};
}
__device__ __forceinline__ void store1(const OutRows& r, int i, int c, float x) {
  kda::store(r.base + int64_t(i) * r.step, r.dtype, c, x);
}
// Channels c, c + 1 of row i (the second only when `both`): one 4- or 8-byte store where aligned.
__device__ __forceinline__ void store2(const OutRows& r, int i, int c, float x, float y, bool both) {
  unsigned char* at = r.base + int64_t(i) * r.step + (int64_t(c) << r.shift);
  if (both && (reinterpret_cast<uintptr_t>(at) & ((2u << r.shift) - 1)) == 0) {
    if (r.shift == 2) *reinterpret_cast<float2*>(at) = make_float2(x, y);
    else if (r.dtype == DType::kBF16) *reinterpret_cast<uint32_t*>(at) = kda::pack_bf16(x, y);
    else *reinterpret_cast<__half2*>(at) = __floats2half2_rn(x, y);
    return;
  }
  store1(r, i, c, x);
  if (both) store1(r, i, c + 1, y);
}

// Two residual values (bf16 or fp32, kda_bwd_device.cuh's load_any_or0) at x[off], x[off + 1], off
// even: one 4- or 8-byte load; each value zero where its flag is false. Straight-line.
__device__ __forceinline__ void load2_any_or0(const void* x, DType dt, int64_t off, bool ok0, bool ok1, float (&out)[2]) {
  off = ok0 || ok1 ? off : 0;
  float v0, v1;
  if (dt == DType::kBF16) {
    const uint32_t u = __ldg(reinterpret_cast<const unsigned int*>(static_cast<const __nv_bfloat16*>(x) + off));
    v0 = __uint_as_float(u << 16), v1 = __uint_as_float(u & 0xffff0000u);
  } else {
    const float2 f = __ldg(reinterpret_cast<const float2*>(static_cast<const float*>(x) + off));
    v0 = f.x, v1 = f.y;
  }
  out[0] = ok0 ? v0 : 0.f, out[1] = ok1 ? v1 : 0.f;
}

// Channels c0 .. c0 + 3 of token t, head h of an input tensor (the Rows load4 at that one row; pass an
// in-range t even when !valid), and of G [tokens][K] fp32 at `row`: one 16-byte load where the four
// are in range and aligned, else one each.
__device__ __forceinline__ void load4(const KdaTensor& x, int b, int t, int h, int c0, int limit, bool valid, float (&out)[4]) {
  load4(rows_of(x, b, t, h), 0, c0, limit, valid, out);
}
__device__ __forceinline__ void load_g4(const float* G, int64_t row, int K, int c0, bool valid, float (&out)[4]) {
  const float* at = G + (valid ? row * K : 0) + c0;
  if (c0 + 3 < K && (reinterpret_cast<uintptr_t>(at) & 15u) == 0) {
    const float4 f = __ldg(reinterpret_cast<const float4*>(at));
    out[0] = valid ? f.x : 0.f, out[1] = valid ? f.y : 0.f, out[2] = valid ? f.z : 0.f, out[3] = valid ? f.w : 0.f;
    return;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) out[e] = kdabwd::ldg_or0(G, row * K + c0 + e, valid && c0 + e < K);
}

// A token row's L2-norm factor 1 / sqrt(sum x^2 + 1e-6) (1 without the norm), x the lane's four
// channels of a row held by the whole warp.
__device__ __forceinline__ float row_rnorm(const float (&x)[4], bool l2) {
  float s = x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return l2 ? rsqrtf(s + 1e-6f) : 1.f;
}

__device__ __forceinline__ void store_pair(__nv_bfloat16* dst, float x, float y) {
  *reinterpret_cast<uint32_t*>(dst) = kda::pack_bf16(x, y);
}

// acc[NT][4] += A (16 rows m0.., k 0..KD) x B (k 0..KD, 8 NT columns n0..), one warp; fragment
// element e of n-tile j is (row m0 + g8 + 8 (e >> 1), column n0 + 8 j + 2 t4 + (e & 1)) with
// g8 = lane / 4, t4 = lane % 4. A is stored [m][k] (kTransA: [k][m]); B [k][n] (kBkn) or [n][k].
template <int KD, int NT, bool kTransA, bool kBkn>
__device__ __forceinline__ void warp_mma(float (&acc)[NT][4], const __nv_bfloat16* a, int lda, int m0, const __nv_bfloat16* b, int ldb,
                                         int n0) {
  static_assert(KD % 16 == 0 && NT % 2 == 0, "k in steps of 16, n-tiles in pairs");
  const int lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
#pragma unroll
  for (int ks = 0; ks < KD / 16; ++ks) {
    uint32_t af[4];
    if constexpr (kTransA) kda::ldmatrix_x4_trans(af, a + (16 * ks + 8 * (mi >> 1) + r) * lda + m0 + 8 * (mi & 1));
    else kda::ldmatrix_x4(af, a + (m0 + r + 8 * (mi & 1)) * lda + 16 * ks + 8 * (mi >> 1));
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      uint32_t bf[4];  // (k 0-7, tile j) (k 8-15, tile j) (k 0-7, tile j+1) (k 8-15, tile j+1)
      if constexpr (kBkn) kda::ldmatrix_x4_trans(bf, b + (16 * ks + 8 * (mi & 1) + r) * ldb + n0 + 8 * j + 8 * (mi >> 1));
      else kda::ldmatrix_x4(bf, b + (n0 + 8 * j + 8 * (mi >> 1) + r) * ldb + 16 * ks + 8 * (mi & 1));
      const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
      kda::mma_bf16(acc[j], af, b0);
      kda::mma_bf16(acc[j + 1], af, b1);
    }
  }
}

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
}

}  // namespace encore::cuda::kda2
