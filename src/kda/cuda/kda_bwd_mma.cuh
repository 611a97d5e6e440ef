// Warp-level tensor-core products on fp32 shared-memory tiles for the CUDA KDA backward kernels:
// mma.sync m16n8k16 bf16 with both operands split into bf16 hi + lo (kda::mma_split: hi·hi + hi·lo +
// lo·hi, ~2^-16 relative, near fp32), each operand read in either orientation (k contiguous or
// strided), so that A^T B and A B^T products need no transposed copies. Tiles are zero-padded to
// multiples of 16 in k and of the warp's tile in m, n by the caller.
#pragma once

#include "kda/cuda/kda_bwd_device.cuh"

namespace encore::cuda::kdabwd {

using ::encore::cuda::kda::mma_split;
using ::encore::cuda::kda::split_pair;

constexpr int kLd = kMaxD + 4;  // fp32 row stride of [*][128] tiles (float2 fragment loads, few conflicts)
constexpr int kLdA = kC + 4;    // of [*][64] tiles

// The A fragment (16 x 16) of A(m, k) at a: kRow: a[m * ld + k] (k contiguous), else a[k * ld + m];
// as bf16 hi + lo.
template <bool kRow>
__device__ __forceinline__ void frag_a(const float* a, int ld, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int m = g + 8 * (q & 1), k = 2 * t + 8 * (q >> 1);
    float x, y;
    if constexpr (kRow) {
      const float2 v = *reinterpret_cast<const float2*>(a + m * ld + k);
      x = v.x, y = v.y;
    } else {
      x = a[k * ld + m], y = a[(k + 1) * ld + m];
    }
    split_pair(x, y, hi[q], lo[q]);
  }
}

// The B fragment (16 x 8, k x n) of B(k, n) at b: kNK: b[n * ld + k] (k contiguous), else b[k * ld + n].
template <bool kNK>
__device__ __forceinline__ void frag_b(const float* b, int ld, uint32_t (&hi)[2], uint32_t (&lo)[2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int k = 2 * t + 8 * q;
    float x, y;
    if constexpr (kNK) {
      const float2 v = *reinterpret_cast<const float2*>(b + g * ld + k);
      x = v.x, y = v.y;
    } else {
      x = b[k * ld + g], y = b[(k + 1) * ld + g];
    }
    split_pair(x, y, hi[q], lo[q]);
  }
}

// c[n] (16 x 8 tiles, columns 8 n ..) += A B over k in [0, 16 ksteps): a at the warp's first row
// (A(m, k) as frag_a<kRow>), b at its first column (B(k, n) as frag_b<kNK>).
template <int NT, bool kRow, bool kNK>
__device__ __forceinline__ void warp_gemm(float (&c)[NT][4], const float* a, int lda, const float* b, int ldb, int ksteps) {
#pragma unroll 1
  for (int ks = 0; ks < ksteps; ++ks) {
    uint32_t ahi[4], alo[4], bhi[NT][2], blo[NT][2];
    frag_a<kRow>(kRow ? a + 16 * ks : a + 16 * ks * lda, lda, ahi, alo);
#pragma unroll
    for (int n = 0; n < NT; ++n) frag_b<kNK>(kNK ? b + 8 * n * ldb + 16 * ks : b + 16 * ks * ldb + 8 * n, ldb, bhi[n], blo[n]);
    mma_split<NT>(c, ahi, alo, bhi, blo);
  }
}

template <int NT>
__device__ __forceinline__ void zero(float (&c)[NT][4]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
}

// dst[i * ld + c] = mult * acc (rows m0 + .., columns n0 + ..), columns c < C only.
template <int NT>
__device__ __forceinline__ void store_acc(const float (&c)[NT][4], float* dst, int ld, int m0, int n0, int C, float mult) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int i = m0 + g + 8 * (q >> 1), col = n0 + 8 * n + 2 * t + (q & 1);
      if (col < C) dst[i * ld + col] = mult * c[n][q];
    }
}

// dst(e, src(e)) for e in [0, n) over the block's kN threads, U loads in flight per thread before
// their stores (generic loads followed by shared stores would otherwise go one latency at a time).
// src is called on valid indices only (e clamped to n - 1; those values are dropped), so sources written
// with the *_or0 loads above are straight-line code.
template <int U, int kN, class Src, class Dst>
__device__ __forceinline__ void stage(int n, Src src, Dst dst) {
  for (int base = threadIdx.x; base < n; base += U * kN) {
    float r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int e = base + u * kN;
      r[u] = src(e < n ? e : n - 1);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int e = base + u * kN;
      if (e < n) dst(e, r[u]);
    }
  }
}

// Rows [t0, t0 + 64) of a [B, T, H, C] input, one warp per row with every load of the warp's rows in
// flight at once: rows i = warp + (kN / 32) r into dst[i * ld + c] (C <= 128; rows >= `rows` and,
// when pad, columns C..127 zero), L2-normalized when asked (y = x / sqrt(sum x^2 + 1e-6)), times mult;
// rstd[i] the row's factor (1 without the norm; null: not kept). kN / 32 * kRpw = 64.
template <int kN>
__device__ __forceinline__ void load_rows_batched(const KdaTensor& t, int b, int t0, int rows, int h, int C, bool l2, float mult,
                                                  float* dst, int ld, bool pad, float* rstd) {
  constexpr int kRpw = kC / (kN / 32);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float x[kRpw][kMaxD / 32];
#pragma unroll
  for (int r = 0; r < kRpw; ++r) {
    const int i = warp + (kN / 32) * r;
#pragma unroll
    for (int u = 0; u < kMaxD / 32; ++u) {
      const int c = lane + 32 * u;
      x[r][u] = load_or0(t, b, t0 + i, h, c, i < rows && c < C);
    }
  }
#pragma unroll
  for (int r = 0; r < kRpw; ++r) {
    const int i = warp + (kN / 32) * r;
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < kMaxD / 32; ++u) ss += x[r][u] * x[r][u];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float f = (l2 && i < rows) ? 1.0f / sqrtf(ss + 1e-6f) : 1.0f;
#pragma unroll
    for (int u = 0; u < kMaxD / 32; ++u) {
      const int c = lane + 32 * u;
      if (c < C || pad) dst[i * ld + c] = x[r][u] * (f * mult);
    }
    if (lane == 0 && rstd) rstd[i] = f;
  }
}

// A record tile x [64][K] (global) into s [64][kLd] (zero at channels >= K) by the block's kN threads,
// every thread's loads in flight (64 x 128 / kN of them): the staged serial kernels' operands.
template <int kN>
__device__ __forceinline__ void stage_record_tile(float* s, const float* __restrict__ x, int K) {
  stage<kC * kMaxD / kN, kN>(
      kC * kMaxD, [&](int e) { const int i = e >> 7, a = e & 127; return ldg_or0(x, i * K + a, a < K); },
      [&](int e, float v) { s[(e >> 7) * kLd + (e & 127)] = v; });
}

// One k-step of a state product, the A operand (Qg^T, W^T, Kg^T) from a record tile staged in shared
// memory, s [64][kLd] (rows of the chunk, channels; zero at channels >= K).
__device__ __forceinline__ void state_term(float (&c)[8][4], const float* s, int a0, int ks, const float* b, int ld) {
  uint32_t ahi[4], alo[4], bhi[8][2], blo[8][2];
  frag_a<false>(s + 16 * ks * kLd + a0, kLd, ahi, alo);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) frag_b<false>(b + 16 * ks * ld + 8 * nt, ld, bhi[nt], blo[nt]);
  mma_split<8>(c, ahi, alo, bhi, blo);
}

// The serial kernels' state step (states: S ← Diag(2^gC)·S + Kgᵀ·Vnew; dh: dS ← Diag(2^gC)·dS′ + Qgᵀ·dO +
// Wᵀ·(−dVnew)) on a [K][64] fp32 shared tile X (row stride ld), this warp's rows (channels) a0 .. a0 + 15,
// all 64 columns: the accumulators start at the decayed X (kDecay false: X as it is, sGc unread), `terms(c, ks)` adds the k-step ks (rows 16·ks ..
// of the chunk) of each product through state_term, and the rows < K go back into X.
template <bool kDecay = true, class Terms>
__device__ __forceinline__ void decayed_state_step(float* X, int ld, const float* sGc, int K, int a0, Terms&& terms) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float c[8][4];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int a = a0 + g + 8 * (q >> 1), y = 8 * nt + 2 * t + (q & 1);
      c[nt][q] = a < K ? (kDecay ? exp2f(sGc[a]) : 1.0f) * X[a * ld + y] : 0.f;
    }
#pragma unroll 1
  for (int ks = 0; ks < kC / 16; ++ks) terms(c, ks);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int a = a0 + g + 8 * (q >> 1), y = 8 * nt + 2 * t + (q & 1);
      if (a < K) X[a * ld + y] = c[nt][q];
    }
}

}  // namespace encore::cuda::kdabwd
