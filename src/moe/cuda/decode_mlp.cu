// moe_forward's expert MLP at decode sizes (few tokens: each expert holds at most T rows), as two
// weight-streaming GEMV kernels instead of the grouped GEMMs, whose 128-row tiles are mostly padding
// there and whose grid leaves most SMs without weights to read (docs/moe.md, "decode").
// Math (group e = the rows [offsets[e], offsets[e] + counts[e]) of the permuted buffers):
//   act[r, n] = bf16(silu_mul(x[r] . w13[e][n], x[r] . w13[e][F + n]))     (kernel 1, fp32 dots)
//   y[r, d]   = bf16(act[r] . w2[e][d])                                      (kernel 2)
//   padding rows [offsets[e] + counts[e], offsets[e + 1]) of act and y are zeroed.
// Mapping: block (slot j, column block): slot j is the j-th expert with counts > 0 (found by a block
//   scan of the counts), the block's kCols output columns are split over its 8 warps, two per warp;
//   the expert's rows are staged in shared memory (bf16, [counts][K]); a lane streams 16-byte packs of
//   the weight rows (four rows in flight) and multiplies them with every staged row; the sums are
//   reduced across the warp by butterflies in a fixed order (deterministic). Grid: min(E, T k) x
//   ceil(columns / kCols); slots past the number of active experts exit.
// Constraints (moe_decode_gemv, plan.cpp): bf16, D and F multiples of 8 with 16-byte aligned rows (the
//   layer's CUDA contract), counts <= rows_max <= kDecodeMaxRows, rows_max * max(D, F) * 2 bytes of
//   shared memory <= kDecodeMaxSmem. The default at T <= 4 (moe_decode_gemv, plan.cpp).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "common/cuda/reduce.cuh"
#include "moe/cuda/launch.hpp"
#include "moe/cuda/silu_mul.cuh"

namespace encore::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kColsPerWarp = 2;
constexpr int kCols = kWarps * kColsPerWarp;  // output columns per block

// The expert of active slot j (the j-th e with counts[e] > 0), or -1; every thread of the block calls it.
__device__ int active_expert(const int32_t* counts, int E, int j) {
  __shared__ int s_warp[kWarps];
  __shared__ int s_found;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) s_found = -1;
  const int per = (E + kThreads - 1) / kThreads, e0 = tid * per;  // this thread's experts [e0, e0 + per)
  int mine = 0;
  for (int e = e0; e < e0 + per && e < E; ++e) mine += counts[e] > 0;
  const int incl = warp_inclusive_sum(mine);  // inclusive scan over the block, warp by warp
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  int before = 0;
  for (int w = 0; w < warp; ++w) before += s_warp[w];
  int k = before + incl - mine;  // active experts before e0
  if (j >= k && j < k + mine)
    for (int e = e0; e < e0 + per && e < E; ++e)
      if (counts[e] > 0 && k++ == j) s_found = e;
  __syncthreads();
  return s_found;
}

// One 16-byte pack of 8 bf16 as floats.
__device__ __forceinline__ void unpack(const uint4& u, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x, f[2 * i + 1] = v.y;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct DecodeParams {
  const __nv_bfloat16* a;  // the rows' input: x_permuted (kernel 1) or act (kernel 2)
  int64_t a_stride;
  const __nv_bfloat16* w;  // w13 [E, 2F, D] or w2 [E, D, F]
  int64_t w_stride_e, w_stride_n;
  __nv_bfloat16* out;      // act [R, F] or y [R, D]
  int64_t out_stride;
  const int32_t* counts;
  const int32_t* offsets;
  int E, K, N;             // reduction length (D or F), output columns (F or D)
  int64_t up_offset;       // kernel 1: F (the up rows of w13 start at row F); 0: kernel 2
};

// kSwiglu: out[r, n] = silu_mul(a[r] . w[n], a[r] . w[n + F]); else out[r, n] = a[r] . w[n]. kRows >= the
// expert's rows (a power of two <= kDecodeMaxRows): every row's sums stay in registers, so each weight
// pack is read once for all of them.
template <bool kSwiglu, int kRows>
__global__ void __launch_bounds__(kThreads) moe_decode_gemv_kernel(DecodeParams p) {
  extern __shared__ uint4 s_rows[];  // [rows][K / 8] packs
  const int e = active_expert(p.counts, p.E, blockIdx.x);
  if (e < 0) return;
  const int r0 = p.offsets[e], rows = min(p.counts[e], kRows), pad_end = p.offsets[e + 1], packs = p.K / 8;
  for (int i = threadIdx.x; i < rows * packs; i += kThreads) {
    const int r = i / packs, c = i - r * packs;
    s_rows[i] = __ldg(reinterpret_cast<const uint4*>(p.a + int64_t(r0 + r) * p.a_stride) + c);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = blockIdx.y * kCols + warp * kColsPerWarp;
  const __nv_bfloat16* we = p.w + int64_t(e) * p.w_stride_e;
  // The weight rows read together: the warp's two columns (and, SwiGLU, their up rows).
  constexpr int kW = kSwiglu ? 2 * kColsPerWarp : kColsPerWarp;
  const uint4* wrow[kW];
  bool live[kColsPerWarp];
#pragma unroll
  for (int c = 0; c < kColsPerWarp; ++c) {
    live[c] = n0 + c < p.N;
    const int n = live[c] ? n0 + c : 0;
    wrow[c] = reinterpret_cast<const uint4*>(we + int64_t(n) * p.w_stride_n);
    if (kSwiglu) wrow[kColsPerWarp + c] = reinterpret_cast<const uint4*>(we + int64_t(n + p.up_offset) * p.w_stride_n);
  }
  float acc[kRows][kW];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int i = 0; i < kW; ++i) acc[r][i] = 0.f;
#pragma unroll 2
  for (int c8 = lane; c8 < packs; c8 += 32) {
    uint4 wp[kW];
#pragma unroll
    for (int i = 0; i < kW; ++i) wp[i] = __ldg(wrow[i] + c8);
#pragma unroll
    for (int i = 0; i < kW; ++i) {
      float w[8];
      unpack(wp[i], w);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r >= rows) break;
        float x[8];
        unpack(s_rows[r * packs + c8], x);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[r][i] = fmaf(x[k], w[k], acc[r][i]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r >= rows) break;  // uniform over the warp
    float v[kW];
#pragma unroll
    for (int i = 0; i < kW; ++i) v[i] = warp_sum(acc[r][i]);
    if (lane == 0)
#pragma unroll
      for (int c = 0; c < kColsPerWarp; ++c)
        if (live[c]) p.out[int64_t(r0 + r) * p.out_stride + n0 + c] = __float2bfloat16_rn(kSwiglu ? silu_mul(v[c], v[kColsPerWarp + c]) : v[c]);
  }
  if (lane == 0)  // the padding rows of these columns
    for (int r = r0 + rows; r < pad_end; ++r)
#pragma unroll
      for (int c = 0; c < kColsPerWarp; ++c)
        if (live[c]) p.out[int64_t(r) * p.out_stride + n0 + c] = __float2bfloat16_rn(0.f);
}

template <bool kSwiglu>
void* decode_kernel(int rows_max) {
  if (rows_max <= 1) return reinterpret_cast<void*>(moe_decode_gemv_kernel<kSwiglu, 1>);
  if (rows_max <= 2) return reinterpret_cast<void*>(moe_decode_gemv_kernel<kSwiglu, 2>);
  if (rows_max <= 4) return reinterpret_cast<void*>(moe_decode_gemv_kernel<kSwiglu, 4>);
  if (rows_max <= 8) return reinterpret_cast<void*>(moe_decode_gemv_kernel<kSwiglu, 8>);
  return reinterpret_cast<void*>(moe_decode_gemv_kernel<kSwiglu, moe::kDecodeMaxRows>);
}

}  // namespace

Status launch_moe_decode_mlp(const moe::ExpertMlpProblem& m, int64_t rows_max, int64_t active_max, int device_index, Stream stream) {
  if (m.dtype != DType::kBF16) return Status::unsupported("moe decode GEMV: bf16 only");
  if (rows_max < 1 || rows_max > moe::kDecodeMaxRows) return Status::internal("moe decode GEMV: rows_max outside [1, kDecodeMaxRows]");
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t D = m.hidden, F = m.intermediate;
  auto launch = [&](const char* what, void* kernel, DecodeParams p, int64_t columns) -> Status {
    const size_t smem = size_t(rows_max) * size_t(p.K) * sizeof(__nv_bfloat16);
    ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kernel, smem));
    void* args[] = {&p};
    return launch_api(what, [&] {
      return cudaLaunchKernel(kernel, dim3(unsigned(active_max), unsigned((columns + kCols - 1) / kCols)), dim3(kThreads), args, smem, s);
    });
  };
  DecodeParams up{static_cast<const __nv_bfloat16*>(m.x_permuted), m.xp_stride, static_cast<const __nv_bfloat16*>(m.w13), m.w13_stride_e,
                  m.w13_stride_n, static_cast<__nv_bfloat16*>(m.act), m.act_stride, m.counts, m.offsets, m.num_experts, int(D), int(F), F};
  ENCORE_RETURN_IF_ERROR(launch("moe decode GEMV (gate/up + SwiGLU)", decode_kernel<true>(int(rows_max)), up, F));
  DecodeParams down{static_cast<const __nv_bfloat16*>(m.act), m.act_stride, static_cast<const __nv_bfloat16*>(m.w2), m.w2_stride_e,
                    m.w2_stride_n, static_cast<__nv_bfloat16*>(m.y), m.y_stride, m.counts, m.offsets, m.num_experts, int(F), int(D), 0};
  return launch("moe decode GEMV (down)", decode_kernel<false>(int(rows_max)), down, D);
}

}  // namespace encore::cuda
