// KDA token-recurrent path for large head dims (128 < K or V <= 256; docs/kda.md, "Large head
// dims"): fp32 on CUDA cores, per token and value column j, with the transformed inputs (q̂, k̂
// L2-normed when asked, q̃ = scale · q̂, g the activated gate):
//   a = exp(g_t) ⊙ S_{t−1}[:, j];  e_j = v_tj − k̂ᵀ a;  S_t[:, j] = a + β_t k̂ e_j;  o_tj = q̃ᵀ S_t[:, j]
// (the updated state: token t sees its own write, kda_ref.cpp's recurrence). Value columns are
// independent, so a block of 256 threads owns (sequence, value head, 32 value columns): lane =
// column, warp w holds the state rows k = w + 8 r (r < ceil(K / 8) <= 32) in registers; sums over
// K go through shared memory across the 8 warps, sums over the columns (backward) by a 32-way
// transposing warp reduction. A token's inputs are loaded one token ahead into registers, then
// q̃, k̂, exp(g), v, β (and d_o) are staged in shared memory, double-buffered by token parity, so a
// token costs three barriers (four with o).
//
// This header: the shared constants, the gate, the token staging and the forward kernel, which
// the backward also launches (on its problem type) to rematerialize the chunk-start states.
#pragma once
#include <cuda_runtime.h>

#include <cmath>

#include "kda/cuda/kda_bwd_launch.hpp"
#include "kda/cuda/kda_device.cuh"

namespace encore::cuda::kda_rec {

using kda::load;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 32;     // value columns per block (lane = column)
constexpr int kRows = 32;     // state rows per thread at K = 256
constexpr int kMaxDim = 256;  // K, V on this path
constexpr int kChunk = 64;    // checkpoint interval (= the chunked path's chunk: residuals.h is shared)

__host__ __device__ constexpr int col_tiles(int V) { return (V + kCols - 1) / kCols; }
__host__ __device__ constexpr int row_count(int K) { return (K + kWarps - 1) / kWarps; }

using kda::gate_act;
using kda::gate_backward;
using kda::gate_input;
using kda::gate_scale;
using kda::sigmoid;
using kda::softplus;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// One step of transpose_sum: lanes with bit O set keep (and receive) the upper O of x's first 2 O
// entries, the others the lower O.
template <int O>
__device__ __forceinline__ void halve(float (&x)[kRows], int lane) {
  const bool up = lane & O;
#pragma unroll
  for (int i = 0; i < O; ++i) {
    const float send = up ? x[i] : x[i + O], keep = up ? x[i + O] : x[i];
    x[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
  }
}
// Σ over the warp's 32 lanes of x[L], returned at lane L (recursive halving: 31 shuffles for 32
// sums; x is clobbered).
__device__ __forceinline__ float transpose_sum(float (&x)[kRows]) {
  const int lane = threadIdx.x & 31;
  halve<16>(x, lane);
  halve<8>(x, lane);
  halve<4>(x, lane);
  halve<2>(x, lane);
  halve<1>(x, lane);
  return x[0];
}

// One token's operands in shared memory, two of them (token parity).
struct Stage {
  float q[2][kMaxDim];    // q̃ = scale · q̂ (0 past K)
  float k[2][kMaxDim];    // k̂
  float dec[2][kMaxDim];  // exp(g)
  float v[2][kCols];      // v of the block's columns (0 past V)
  float dout[2][kCols];   // d_o of the block's columns (backward)
  float beta[2];
  float sq[2][2][kWarps];       // L2-norm partials of q, k per warp
  float red[2][kWarps][kCols];  // per-warp column sums over its rows
  float red2[2][kWarps][kCols];
};

// This thread's share of one token's inputs, loaded (and the gate activated) one token ahead so the
// loads overlap the current token's work: channel tid of q, k, g (tid < K), column col0 + tid of v
// and d_o (tid < 32), β.
struct TokenRegs {
  float q = 0.f, k = 0.f, g = 0.f, v = 0.f, dout = 0.f, beta = 0.f;
};
template <class P>
__device__ __forceinline__ TokenRegs fetch_token(const P& p, int b, int tok, int h, int col0, const KdaTensor* dout) {
  const int tid = threadIdx.x;
  TokenRegs r;
  if (tid < p.K) {
    const int hq = h / p.group;
    r.q = load(p.q, b, tok, hq, tid);
    r.k = load(p.k, b, tok, hq, tid);
    r.g = gate_act(p, load(p.g, b, tok, h, tid), h, tid);
  }
  const int c = col0 + tid;
  if (tid < kCols && c < p.V) {
    r.v = load(p.v, b, tok, h, c);
    if (dout) r.dout = load(*dout, b, tok, h, c);
  }
  if (tid == 0) r.beta = load(p.beta, b, tok, h, 0);
  return r;
}

// Stages a fetched token into buffer `buf` (the L2 norm applied, exp(g) taken). Two barriers; the
// caller alternates buf from token to token, so no barrier is needed before the writes (the
// buffer's last readers passed this token's first barrier).
template <class P>
__device__ __forceinline__ void stage_token(const P& p, Stage& s, int buf, const TokenRegs& r) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid < kCols) {
    s.v[buf][tid] = r.v;
    s.dout[buf][tid] = r.dout;
  }
  if (tid == 0) s.beta[buf] = r.beta;
  if (p.l2norm) {
    const float sq = warp_sum(r.q * r.q), sk = warp_sum(r.k * r.k);
    if (lane == 0) {
      s.sq[buf][0][warp] = sq;
      s.sq[buf][1][warp] = sk;
    }
  }
  __syncthreads();
  float rq = 1.f, rk = 1.f;
  if (p.l2norm) {
    float sq = 0.f, sk = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      sq += s.sq[buf][0][w];
      sk += s.sq[buf][1][w];
    }
    rq = 1.f / sqrtf(sq + 1e-6f);
    rk = 1.f / sqrtf(sk + 1e-6f);
  }
  s.q[buf][tid] = p.scale * r.q * rq;
  s.k[buf][tid] = r.k * rk;
  s.dec[buf][tid] = tid < p.K ? expf(r.g) : 0.f;
  __syncthreads();
}

// The forward kernel's outputs (each optional).
struct RecurrentOut {
  void* o = nullptr;  // [B, T, H, V]
  DType o_dtype = DType::kFP32;
  int64_t o_sb = 0, o_st = 0, o_sh = 0;
  float* final_state = nullptr;  // [N, H, K, V]
  void* h = nullptr;             // chunk-start states [NT, H, K, V] (residuals.h, or the backward's checkpoints)
  DType h_dtype = DType::kFP32;
};

// The state of (sequence, head, columns) at offset ((n_or_slot · H + h) · K + k) · V + col.
__device__ __forceinline__ int64_t state_off(int64_t nslot, int h, int k, int col, int H, int K, int V) {
  return ((nslot * H + h) * K + k) * int64_t(V) + col;
}
// The same element of a caller's state in either layout: v_first (fla's state_v_first) at
// ((n · H + h) · V + col) · K + k.
__device__ __forceinline__ int64_t state_off(int64_t nslot, int h, int k, int col, int H, int K, int V, bool v_first) {
  return v_first ? ((nslot * H + h) * V + col) * int64_t(K) + k : state_off(nslot, h, k, col, H, K, V);
}

// One token's delta-rule step on this thread's state rows (k = warp + kWarps·r, its column = lane):
// a = exp(g)·S, e = v − kᵀa (summed over the block's warps through s.red[buf], one barrier),
// S = a + β·e·k. Returns e (the forward and the backward's recompute run the same arithmetic).
__device__ __forceinline__ float delta_step(Stage& s, int buf, float (&S)[kRows], int nr, int warp, int lane) {
  float a[kRows], part = 0.f;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int k = warp + kWarps * r;
    a[r] = r < nr ? s.dec[buf][k] * S[r] : 0.f;
    part += r < nr ? s.k[buf][k] * a[r] : 0.f;
  }
  s.red[buf][warp][lane] = part;
  __syncthreads();
  float ka = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) ka += s.red[buf][w][lane];
  const float e = s.v[buf][lane] - ka, be = s.beta[buf] * e;
#pragma unroll
  for (int r = 0; r < kRows; ++r)
    if (r < nr) S[r] = fmaf(be, s.k[buf][warp + kWarps * r], a[r]);
  return e;
}

// Forward: block = (sequence n, value head h, column tile), blockIdx.x = (n · H + h) · tiles + tile.
// P is KdaCudaProblem or KdaBwdCudaProblem (the same input fields).
template <class P>
__global__ void __launch_bounds__(kThreads) kda_recurrent_fwd_kernel(const __grid_constant__ P p, const RecurrentOut out) {
  __shared__ Stage s;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int tiles = col_tiles(p.V), nr = row_count(p.K);
  const int tile = int(blockIdx.x) % tiles, h = (int(blockIdx.x) / tiles) % p.H, n = int(blockIdx.x) / (tiles * p.H);
  const int col = tile * kCols + lane;
  const bool cv = col < p.V;
  const int b = p.varlen ? 0 : n, begin = p.seq_begin[n], end = p.seq_end[n];
  float S[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int k = warp + kWarps * r;
    S[r] = p.h0 && r < nr && k < p.K && cv ? p.h0[state_off(n, h, k, col, p.H, p.K, p.V, p.state_v_first)] : 0.f;
  }
  TokenRegs next = begin < end ? fetch_token(p, b, begin, h, tile * kCols, nullptr) : TokenRegs{};
  for (int t = begin; t < end; ++t) {
    const int i = t - begin, buf = i & 1;
    if (out.h && i % kChunk == 0 && cv) {
      const int64_t slot = p.chunk_start[n] + i / kChunk;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int k = warp + kWarps * r;
        if (r < nr && k < p.K) kda::store(out.h, out.h_dtype, state_off(slot, h, k, col, p.H, p.K, p.V), S[r]);
      }
    }
    stage_token(p, s, buf, next);
    if (t + 1 < end) next = fetch_token(p, b, t + 1, h, tile * kCols, nullptr);
    delta_step(s, buf, S, nr, warp, lane);
    float part = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      if (r < nr) part += s.q[buf][warp + kWarps * r] * S[r];
    if (out.o) {
      s.red2[buf][warp][lane] = part;
      __syncthreads();
      if (warp == 0 && cv) {
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) o += s.red2[buf][w][lane];
        kda::store(out.o, out.o_dtype, int64_t(b) * out.o_sb + int64_t(t) * out.o_st + int64_t(h) * out.o_sh + col, o);
      }
    }
  }
  if (out.final_state && cv) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int k = warp + kWarps * r;
      if (r < nr && k < p.K) out.final_state[state_off(n, h, k, col, p.H, p.K, p.V, p.state_v_first)] = S[r];
    }
  }
}

}  // namespace encore::cuda::kda_rec
