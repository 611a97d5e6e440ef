// KDA forward for large head dims (128 < K or V <= 256; kda_recurrent.cuh has the recurrence and
// the block layout): two launches, no workspace.
//   1 kda_recurrent_fwd_kernel: o, the final state and residuals.h (the chunk-start states, every
//     64 tokens of a sequence, in residuals' dtype), one block per (sequence, value head, 32 value
//     columns), the tokens in order;
//   2 kda_recurrent_residuals_kernel (only when G, Aqk or Akk is asked for): per (chunk slot, value
//     head) the chunked path's residuals from the inputs, in fp32 with per-pair exp2 (exact for any
//     gate):  G_i = log2 e · Σ_{s <= i} g_s (chunk-local),
//     Aqk_ij = Σ_c q̃_ic k̂_jc 2^(G_ic − G_jc) (j <= i),  L_ij = β_i Σ_c k̂_ic k̂_jc 2^(G_ic − G_jc) (j < i),
//     Akk = (I + L)^-1 by forward substitution, a thread per column. Shared memory: the channels in
//     slices of 64 (G, q̃, k̂ [64][65] fp32) and L, A [64][65]: 84 KB.
// Constraints (dispatch): K, V <= 256, bf16/fp16/fp32 inputs, contiguous fp32 states.
#include <string>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "kda/cuda/kda_recurrent.cuh"

namespace encore::cuda {
namespace kda_rec {
namespace {

constexpr int kLd = kChunk + 1;  // [64][65] fp32 tiles: row-wise and column-wise walks conflict-free
constexpr int kTile = kChunk * kLd;
constexpr int kSlice = 64;       // channels per slice
constexpr size_t kResSmem = size_t(5 * kTile + 3 * kChunk) * sizeof(float);

__global__ void __launch_bounds__(kThreads) kda_recurrent_residuals_kernel(const __grid_constant__ KdaCudaProblem p) {
  extern __shared__ __align__(16) float smem[];
  float *Gs = smem, *qs = Gs + kTile, *ks = qs + kTile, *Ls = ks + kTile, *As = Ls + kTile;
  float *rq = As + kTile, *rk = rq + kChunk, *bs = rk + kChunk;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int slot = blockIdx.x, h = blockIdx.y, hq = h / p.group, K = p.K;
  const int n = kda::find_seq(p, slot), b = p.varlen ? 0 : n;
  const int t0 = p.seq_begin[n] + (slot - p.chunk_start[n]) * kChunk, rows = min(kChunk, p.seq_end[n] - t0);
  // L2-norm factors and β per row (a warp per row, lanes over channels).
  for (int i = warp; i < kChunk; i += kWarps) {
    float sq = 0.f, sk = 0.f;
    if (i < rows && p.l2norm)
      for (int c = lane; c < K; c += 32) {
        const float x = load(p.q, b, t0 + i, hq, c), y = load(p.k, b, t0 + i, hq, c);
        sq += x * x;
        sk += y * y;
      }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    if (lane == 0) {
      rq[i] = p.l2norm ? 1.f / sqrtf(sq + 1e-6f) : 1.f;
      rk[i] = p.l2norm ? 1.f / sqrtf(sk + 1e-6f) : 1.f;
      bs[i] = i < rows ? load(p.beta, b, t0 + i, h, 0) : 0.f;
    }
  }
  // Thread (i, jj) accumulates the pairs (i, jj + 4 m), m < 16.
  const int pi = tid >> 2, pj = tid & 3;
  float aqk[16], l[16];
#pragma unroll
  for (int m = 0; m < 16; ++m) aqk[m] = l[m] = 0.f;
  for (int c0 = 0; c0 < K; c0 += kSlice) {
    __syncthreads();  // rq, rk ready; the previous slice's readers done
    for (int e = tid; e < kChunk * kSlice; e += kThreads) {
      const int i = e / kSlice, cc = e % kSlice, c = c0 + cc;
      const bool ok = i < rows && c < K;
      qs[i * kLd + cc] = ok ? p.scale * load(p.q, b, t0 + i, hq, c) * rq[i] : 0.f;
      ks[i * kLd + cc] = ok ? load(p.k, b, t0 + i, hq, c) * rk[i] : 0.f;
      Gs[i * kLd + cc] = ok ? gate_act(p, load(p.g, b, t0 + i, h, c), h, c) * kLog2e : 0.f;
    }
    __syncthreads();
    if (tid < kSlice) {  // the chunk-local cumsum, a thread per channel
      float acc = 0.f;
      for (int i = 0; i < kChunk; ++i) {
        acc += Gs[i * kLd + tid];
        Gs[i * kLd + tid] = acc;
        if (p.res_G && i < rows && c0 + tid < K) p.res_G[((int64_t(b) * p.T + t0 + i) * p.H + h) * K + c0 + tid] = acc;
      }
    }
    __syncthreads();
    const float* Gi = Gs + pi * kLd;
    const float* qi = qs + pi * kLd;
    const float* ki = ks + pi * kLd;
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      const int j = pj + 4 * m;
      if (j > pi) continue;
      const float* Gj = Gs + j * kLd;
      const float* kj = ks + j * kLd;
      float sa = aqk[m], sl = l[m];
      for (int cc = 0; cc < kSlice; ++cc) {
        const float d = exp2f(Gi[cc] - Gj[cc]) * kj[cc];  // G_i <= G_j for j <= i: d <= |k_j|
        sa = fmaf(qi[cc], d, sa);
        sl = fmaf(ki[cc], d, sl);
      }
      aqk[m] = sa, l[m] = sl;
    }
  }
  const int64_t row = (int64_t(b) * p.T + t0 + pi) * p.H + h;  // this thread's residual row (pi < rows)
#pragma unroll
  for (int m = 0; m < 16; ++m) {
    const int j = pj + 4 * m;
    if (p.res_Aqk && pi < rows) kda::store(p.res_Aqk, p.res_dtype, row * kChunk + j, j <= pi ? aqk[m] : 0.f);
    Ls[pi * kLd + j] = j < pi ? bs[pi] * l[m] : 0.f;
  }
  __syncthreads();
  if (tid < kChunk) {  // column j of A = (I + L)^-1: x_i = δ_ij − Σ_{j <= m < i} L_im x_m
    const int j = tid;
    for (int i = 0; i < kChunk; ++i) {
      float x = i == j ? 1.f : 0.f;
      for (int m = j; m < i; ++m) x = fmaf(-Ls[i * kLd + m], As[m * kLd + j], x);
      As[i * kLd + j] = i >= j ? x : 0.f;
    }
  }
  __syncthreads();
  if (p.res_Akk)
    for (int e = tid; e < rows * kChunk; e += kThreads) {
      const int i = e / kChunk, j = e % kChunk;
      kda::store(p.res_Akk, p.res_dtype, ((int64_t(b) * p.T + t0 + i) * p.H + h) * kChunk + j, As[i * kLd + j]);
    }
}

}  // namespace
}  // namespace kda_rec

Status launch_kda_recurrent_forward(const KdaCudaProblem& p, Stream stream) {
  using namespace kda_rec;
  if (p.pool) return Status::internal("kda recurrent forward: takes no state pool (the prefill on a pool runs on the decode kernel at K or V > 128)");
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(p.device));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int items = p.N * p.H * col_tiles(p.V);
  RecurrentOut out;
  out.o = p.o;
  out.o_dtype = p.o_dtype;
  out.o_sb = p.o_sb, out.o_st = p.o_st, out.o_sh = p.o_sh;
  out.final_state = p.final_state;
  out.h = p.res_h;
  out.h_dtype = p.res_dtype;
  if (items > 0)
    ENCORE_RETURN_IF_ERROR(launch("kda recurrent forward (kda_recurrent_fwd_kernel)",
                                  [&] { kda_recurrent_fwd_kernel<KdaCudaProblem><<<items, kThreads, 0, s>>>(p, out); }));
  const int chunks = p.chunk_start[p.N];
  if (chunks > 0 && (p.res_G || p.res_Aqk || p.res_Akk)) {
    constexpr const char* what = "kda recurrent forward: residuals (kda_recurrent_residuals_kernel)";
    ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kda_recurrent_residuals_kernel, kResSmem));
    return launch(what, [&] { kda_recurrent_residuals_kernel<<<dim3(unsigned(chunks), unsigned(p.H)), kThreads, kResSmem, s>>>(p); });
  }
  return Status::ok();
}

}  // namespace encore::cuda
