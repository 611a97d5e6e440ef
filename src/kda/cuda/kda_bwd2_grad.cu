// The second CUDA KDA backward, stage K2a: the per-chunk products with the chunk-start state
// (kda_bwd2.hpp; math: docs/math/kda.md §6, the CPU ground truth: the stage-3 terms of
// src/kda/reference/kda_chunked_bwd.cpp). Every product one mma.sync m16n8k16 on bf16 operands with
// fp32 accumulation.
//
// kda2_state_grads_kernel, grid (chunk slots, HV), 256 threads (8 warps), ~179 KB of shared memory
// (S, dS' [128][128]; A [64][64]; beta v, -W then dW, Kbeta, dO, dVnew, Vnew [64][128], all bf16):
//   Vnew = A (beta v) + (-W) S                        (64 x 128 x (64 + 128))
//   dqi  = scale (dO S^T) . 2^G    dki = (Vnew dS'^T) . 2^(gC - G)    dW = -dVnew S^T   (64 x 128 x 128 each)
//   dAqk = tril(dO Vnew^T)         dA = dVnew (beta v)^T + dW Kbeta^T (i >= j)          (64 x 64 x 128)
//   sd   = rowsum_V(S . dS')       (fp32, per state row)
// S is the forward's saved chunk-start state (residuals.h); dS' and dVnew come from K1, -W from K0.
// Rows past a chunk's end are zero in every tile and never written; K, V <= 128, channels padded.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/cuda/launch_check.hpp"
#include "kda/cuda/kda_bwd2_device.cuh"

namespace encore::cuda {
namespace kda2 {
namespace {


constexpr int kThreads = 256;
constexpr int kSmemElems = 2 * kD * kLd + kC * kLdC + 6 * kC * kLd;
constexpr size_t kSmem = size_t(kSmemElems) * sizeof(__nv_bfloat16);

__global__ void __launch_bounds__(kThreads) kda2_state_grads_kernel(const __grid_constant__ KdaBwdCudaProblem p, Ptrs w) {
  extern __shared__ __align__(16) unsigned char smem[];
  auto* s_s = reinterpret_cast<__nv_bfloat16*>(smem);  // [128][kLd] S, [k][v]
  __nv_bfloat16* d_s = s_s + kD * kLd;                  // [128][kLd] dS', [k][v]
  __nv_bfloat16* a_s = d_s + kD * kLd;                  // [64][kLdC] A
  __nv_bfloat16* vb_s = a_s + kC * kLdC;                // [64][kLd]  beta v
  __nv_bfloat16* wn_s = vb_s + kC * kLd;                // [64][kLd]  -W, then dW
  __nv_bfloat16* kb_s = wn_s + kC * kLd;                // [64][kLd]  Kbeta
  __nv_bfloat16* do_s = kb_s + kC * kLd;                // [64][kLd]  dO
  __nv_bfloat16* dvn_s = do_s + kC * kLd;               // [64][kLd]  dVnew
  __nv_bfloat16* vn_s = dvn_s + kC * kLd;               // [64][kLd]  Vnew
  const int slot = blockIdx.x, hv = blockIdx.y, hq = hv / p.group;
  const ChunkInfo ci = chunk_info(p, slot);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c0 = 4 * lane;
  const int64_t last = tok(p, ci.b, ci.t0 + ci.rows - 1, hv);

  // Rows: Kbeta = beta k^ . 2^G, beta v, dO, A, -W, dVnew (warp per row, lane 4 channels).
#pragma unroll 2
  for (int i = warp; i < kC; i += kThreads / 32) {
    const bool valid = i < ci.rows;
    const int t = ci.t0 + (valid ? i : 0);
    const int64_t row = tok(p, ci.b, t, hv);
    // Straight-line loads (ld*_or0): a row's loads are in flight together.
    float k[4], g[4], v[4], o[4];
    const float beta = load_or0(p.beta, ci.b, t, hv, 0, valid);
    load4(p.k, ci.b, t, hq, c0, p.K, valid, k), load_g4(p.G, row, p.K, c0, valid, g);
    load4(p.v, ci.b, t, hv, c0, p.V, valid, v), load4(p.d_o, ci.b, t, hv, c0, p.V, valid, o);
    // -W and dVnew rows from K0 / K1 (bf16, zero-padded channels): 8 bytes a lane.
    const uint2 wn = load4_or0(w.wn + row * kD, c0, valid), dvn = load4_or0(w.dvn + row * kD, c0, valid, p.V);
    float av[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) av[e] = load_any_or0(p.Akk, p.akk_dtype, row * kC + 2 * lane + e, valid && 2 * lane + e <= i);
    float sk = k[0] * k[0] + k[1] * k[1] + k[2] * k[2] + k[3] * k[3];
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) sk += __shfl_xor_sync(0xffffffffu, sk, s);
    const float rk = p.l2norm ? rsqrtf(sk + 1e-6f) : 1.f;
    float kb[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) kb[e] = valid ? beta * k[e] * rk * exp2f(g[e]) : 0.f;  // G <= 0: <= beta |k^|
    store_pair(kb_s + i * kLd + c0, kb[0], kb[1]), store_pair(kb_s + i * kLd + c0 + 2, kb[2], kb[3]);
    store_pair(vb_s + i * kLd + c0, beta * v[0], beta * v[1]), store_pair(vb_s + i * kLd + c0 + 2, beta * v[2], beta * v[3]);
    store_pair(do_s + i * kLd + c0, o[0], o[1]), store_pair(do_s + i * kLd + c0 + 2, o[2], o[3]);
    *reinterpret_cast<uint2*>(wn_s + i * kLd + c0) = wn;
    *reinterpret_cast<uint2*>(dvn_s + i * kLd + c0) = dvn;
    store_pair(a_s + i * kLdC + 2 * lane, av[0], av[1]);
  }
  // S (the saved state, any float dtype) and dS' (K1's bf16 tile; columns past V never written there).
  const int64_t state = (int64_t(slot) * p.H + hv);
  const __nv_bfloat16* dsp = w.dsp + state * kD * kD;
#pragma unroll 8
  for (int x = threadIdx.x; x < kD * kD / 2; x += kThreads) {
    const int a = x / (kD / 2), y = 2 * (x % (kD / 2));
    const int64_t at = (state * p.K + a) * p.V + y;
    const bool ok0 = a < p.K && y < p.V, ok1 = a < p.K && y + 1 < p.V;
    const float s0 = load_any_or0(p.h, p.h_dtype, at, ok0), s1 = load_any_or0(p.h, p.h_dtype, at + 1, ok1);
    const float d0 = loadbf_or0(dsp, a * kD + y, ok0), d1 = loadbf_or0(dsp, a * kD + y + 1, ok1);
    store_pair(s_s + a * kLd + y, s0, s1);
    store_pair(d_s + a * kLd + y, d0, d1);
  }
  __syncthreads();

  const int m0 = 16 * (warp & 3), n0 = 64 * (warp >> 2), n0c = 32 * (warp >> 2), g8 = lane >> 2, t4 = lane & 3;
  float acc[8][4];
  // Vnew = A (beta v) + (-W) S.
  zero(acc);
  warp_mma<kC, 8, false, true>(acc, a_s, kLdC, m0, vb_s, kLd, n0);
  warp_mma<kD, 8, false, true>(acc, wn_s, kLd, m0, s_s, kLd, n0);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) store_pair(vn_s + (m0 + g8 + 8 * h) * kLd + n0 + 8 * j + 2 * t4, acc[j][2 * h], acc[j][2 * h + 1]);
  __syncthreads();

  // f(row i, column a, value pair x, y) over this warp's [16 x 64] fragment, valid rows and a < K only.
  auto each = [&](auto&& f) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = m0 + g8 + 8 * h, a = n0 + 8 * j + 2 * t4;
        if (i < ci.rows) f(i, a, acc[j][2 * h], acc[j][2 * h + 1]);
      }
  };
  // The fragment's decay factors, loaded straight-line before the products that use them:
  // eg = 2^G(i, a) and egc = 2^(gC(a) - G(i, a)) (0 at a >= K).
  float eg[8][4], egc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = min(m0 + g8 + 8 * (e >> 1), ci.rows - 1), a = n0 + 8 * j + 2 * t4 + (e & 1);
      eg[j][e] = ldg_or0(p.G, tok(p, ci.b, ci.t0 + i, hv) * p.K + a, a < p.K);
      egc[j][e] = ldg_or0(p.G, last * p.K + a, a < p.K);
    }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool in = n0 + 8 * j + 2 * t4 + (e & 1) < p.K;
      egc[j][e] = in ? exp2f(egc[j][e] - eg[j][e]) : 0.f;  // gC <= G: <= 1
      eg[j][e] = in ? exp2f(eg[j][e]) : 0.f;
    }
  // dqi = scale (dO S^T) . 2^G.
  zero(acc);
  warp_mma<kD, 8, false, false>(acc, do_s, kLd, m0, s_s, kLd, n0);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] *= p.scale * eg[j][e];
  each([&](int i, int a, float x, float y) { *reinterpret_cast<float2*>(w.dqi + tok(p, ci.b, ci.t0 + i, hv) * kD + a) = make_float2(x, y); });
  // dki = (Vnew dS'^T) . 2^(gC - G).
  zero(acc);
  warp_mma<kD, 8, false, false>(acc, vn_s, kLd, m0, d_s, kLd, n0);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] *= egc[j][e];
  each([&](int i, int a, float x, float y) { *reinterpret_cast<float2*>(w.dki + tok(p, ci.b, ci.t0 + i, hv) * kD + a) = make_float2(x, y); });
  // dW = -dVnew S^T, into wn_s (-W was last read before the barrier above) and the workspace.
  zero(acc);
  warp_mma<kD, 8, false, false>(acc, dvn_s, kLd, m0, s_s, kLd, n0);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = m0 + g8 + 8 * h, a = n0 + 8 * j + 2 * t4;
      store_pair(wn_s + i * kLd + a, -acc[j][2 * h], -acc[j][2 * h + 1]);
      if (i < ci.rows) store_pair(w.dw + tok(p, ci.b, ci.t0 + i, hv) * kD + a, -acc[j][2 * h], -acc[j][2 * h + 1]);
    }
  // dAqk = tril(dO Vnew^T), the diagonal included: warp w rows m0.., columns n0c.. (4 n-tiles).
  float acc4[4][4];
  auto write64 = [&](__nv_bfloat16* dst) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = m0 + g8 + 8 * h, c = n0c + 8 * j + 2 * t4;
        if (i < ci.rows)
          store_pair(dst + tok(p, ci.b, ci.t0 + i, hv) * kC + c, c <= i ? acc4[j][2 * h] : 0.f, c + 1 <= i ? acc4[j][2 * h + 1] : 0.f);
      }
  };
  zero(acc4);
  warp_mma<kD, 4, false, false>(acc4, do_s, kLd, m0, vn_s, kLd, n0c);
  write64(w.daqk);
  // sd = rowsum_V(S . dS'): warp w state rows 16 w.., lane 4 columns.
  for (int a = 16 * warp; a < 16 * warp + 16; ++a) {
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) s += __bfloat162float(s_s[a * kLd + c0 + e]) * __bfloat162float(d_s[a * kLd + c0 + e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) w.sd[state * kD + a] = s;
  }
  __syncthreads();  // dW complete in wn_s
  // dA = dVnew (beta v)^T + dW Kbeta^T, i >= j.
  zero(acc4);
  warp_mma<kD, 4, false, false>(acc4, dvn_s, kLd, m0, vb_s, kLd, n0c);
  warp_mma<kD, 4, false, false>(acc4, wn_s, kLd, m0, kb_s, kLd, n0c);
  write64(w.da);
}

}  // namespace
}  // namespace kda2

Status launch_kda2_state_grads(const KdaBwdCudaProblem& p, const Kda2Layout& l, void* workspace, int chunks, Stream stream) {
  using namespace kda2;
  if (p.K > kKda2D || p.V > kKda2D) return Status::unsupported("kda backward (second design): K and V up to 128");
  if (!p.h) return Status::invalid("residuals.h: the second backward's state products read the forward's saved states");
  const Ptrs w = ptrs_of(l, workspace);
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem("kda2_state_grads_kernel", kda2_state_grads_kernel, kSmem));
  if (chunks > 0)
    ENCORE_RETURN_IF_ERROR(launch("kda2_state_grads_kernel",
                                  [&] { kda2_state_grads_kernel<<<dim3(chunks, p.H), kThreads, kSmem, static_cast<cudaStream_t>(stream)>>>(p, w); }));
  return Status::ok();
}

}  // namespace encore::cuda
