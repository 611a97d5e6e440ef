// The second CUDA KDA backward, stage K2a: the per-chunk products with the chunk-start state
// (kda_bwd2.hpp; math: docs/math/kda.md §6, the CPU ground truth: the stage-3 terms of
// src/kda/reference/kda_chunked_bwd.cpp). Every product one mma.sync m16n8k16 on bf16 operands with
// fp32 accumulation.
//
// kda2_state_grads_kernel, grid (chunk slots, HV), 512 threads (16 warps, 128 registers, no spills;
// one block an SM), 196 KB of shared memory (S, dS' [128][128]; A [64][64]; beta v, -W then dW,
// Kbeta, dO, dVnew, Vnew hi and lo [64][128], all bf16; Vnew and dAqk as bf16 hi + lo pairs, two MMAs
// where they are operands: on the CPU model of the kernels' roundings they were the largest dA_log
// errors, up to 4e-2 of 60 draws, 5.6e-3 as pairs). Staging (kda2_state_grads_kernel<RowPath>, the
// path chosen on the host, kda_bwd2_load.cuh): -W, dVnew and dS' by 16-byte cp.async on every path;
// kBf16 / kFp16 (16-bit inputs in 16-byte aligned rows, bf16 residuals) add k, v, dO (raw, into their
// tiles), A's lower triangle and S, all in one commit group with beta and G in flight beside it, then
// Kbeta and beta v computed in place (fp16 dO converted there); kGeneric: S as 4-column quads where
// V % 4 == 0 and the state is 16-byte aligned (all of a thread's issued before the row loop, stored
// after it), else element pairs, and the rows through the per-element dtype loads (one vector load a
// lane where the layout allows). Products: warp w owns rows 16 (w % 4).., columns 32 (w / 4).. (16
// (w / 4).. of the [64 x 64] ones):
//   Vnew = A (beta v) + (-W) S                        (64 x 128 x (64 + 128))
//   dqi  = scale (dO S^T) . 2^G    dki = (Vnew dS'^T) . 2^(gC - G)    dW = -dVnew S^T   (64 x 128 x 128 each)
//   dAqk = tril(dO Vnew^T) (hi, lo) dA = dVnew (beta v)^T + dW Kbeta^T (i >= j)          (64 x 64 x 128)
//   sd   = rowsum_V(S . dS')       (fp32, per state row)
// S is the forward's saved chunk-start state (residuals.h); dS' and dVnew come from K1, -W from K0.
// Rows past a chunk's end are zero in every tile and never written; K, V <= 128, channels padded.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <type_traits>

#include "common/cuda/launch_check.hpp"
#include "kda/cuda/kda_bwd2_device.cuh"
#include "kda/cuda/kda_bwd2_load.cuh"

namespace encore::cuda {
namespace kda2 {
namespace {

constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kQuads = kD * kD / 4 / kThreads;  // (state row, 4 columns) quads of S and dS' a thread stages
constexpr int kSmemElems = 2 * kD * kLd + kC * kLdC + 7 * kC * kLd;
constexpr size_t kSmem = size_t(kSmemElems) * sizeof(__nv_bfloat16);

template <RowPath kPath>
__global__ void __launch_bounds__(kThreads, 1) kda2_state_grads_kernel(const __grid_constant__ KdaBwdCudaProblem p, Ptrs w) {
  constexpr bool kFast = kPath != RowPath::kGeneric;
  extern __shared__ __align__(16) unsigned char smem[];
  auto* s_s = reinterpret_cast<__nv_bfloat16*>(smem);  // [128][kLd] S, [k][v]
  __nv_bfloat16* d_s = s_s + kD * kLd;                  // [128][kLd] dS', [k][v]
  __nv_bfloat16* a_s = d_s + kD * kLd;                  // [64][kLdC] A
  __nv_bfloat16* vb_s = a_s + kC * kLdC;                // [64][kLd]  beta v
  __nv_bfloat16* wn_s = vb_s + kC * kLd;                // [64][kLd]  -W, then dW
  __nv_bfloat16* kb_s = wn_s + kC * kLd;                // [64][kLd]  Kbeta
  __nv_bfloat16* do_s = kb_s + kC * kLd;                // [64][kLd]  dO
  __nv_bfloat16* dvn_s = do_s + kC * kLd;               // [64][kLd]  dVnew
  __nv_bfloat16* vn_s = dvn_s + kC * kLd;               // [64][kLd]  Vnew, bf16 hi
  __nv_bfloat16* vnl_s = vn_s + kC * kLd;               // [64][kLd]  Vnew - hi, bf16 (the lo half)
  const int slot = blockIdx.x, hv = blockIdx.y, hq = hv / p.group;
  const ChunkInfo ci = chunk_info(p, slot);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c0 = 4 * lane;
  const int64_t last = tok(p, ci.b, ci.t0 + ci.rows - 1, hv);

  // Rows: Kbeta = beta k^ . 2^G, beta v, dO, A, -W, dVnew (warp per row, lane 4 channels), and the
  // tiles S (the saved state, fp32 or bf16) and dS' (K1's bf16 tile; columns past V never written there).
  const int64_t tok0 = tok(p, ci.b, ci.t0, hv);  // the token row of chunk row i: tok0 + i H
  const int64_t state = (int64_t(slot) * p.H + hv);
  const __nv_bfloat16* dsp = w.dsp + state * kD * kD;
  // Group 1, both paths: the workspace tiles -W, dVnew (K0's and K1's rows, channels zero-padded; dVnew's
  // past V never written) and dS' by cp.async; the fast path adds k, v, dO raw (into Kbeta's, beta v's and
  // dO's tiles), A (the lower triangle) and S (bf16, rows of V).
  {
    const int64_t wstep = int64_t(p.H) * kD * 2;
    copy_rows<kThreads>(wn_s, kLd, reinterpret_cast<const unsigned char*>(w.wn + tok0 * kD), wstep, ci.rows, kD);
    copy_rows<kThreads>(dvn_s, kLd, reinterpret_cast<const unsigned char*>(w.dvn + tok0 * kD), wstep, ci.rows, p.V);
    copy_rows<kThreads, kD>(d_s, kLd, reinterpret_cast<const unsigned char*>(dsp), kD * 2, p.K, p.V);
    if constexpr (kFast) {
      const Rows rk = rows_of(p.k, ci.b, ci.t0, hq), rv = rows_of(p.v, ci.b, ci.t0, hv), ro = rows_of(p.d_o, ci.b, ci.t0, hv);
      copy_rows<kThreads>(kb_s, kLd, rk.base, rk.step, ci.rows, p.K);
      copy_rows<kThreads>(vb_s, kLd, rv.base, rv.step, ci.rows, p.V);
      copy_rows<kThreads>(do_s, kLd, ro.base, ro.step, ci.rows, p.V);
      copy_tri<kThreads>(a_s, kLdC, static_cast<const __nv_bfloat16*>(p.Akk) + tok0 * kC, int64_t(p.H) * kC, ci.rows);
      copy_rows<kThreads, kD>(s_s, kLd, static_cast<const unsigned char*>(p.h) + state * p.K * p.V * 2, int64_t(p.V) * 2, p.K, p.V);
    }
    cp_async_commit();
  }
  // kb = beta k^ . 2^G (k^: k times its row's L2-norm factor) and beta v of row i into their tiles, both
  // paths' one expression.
  auto row_math = [&](int i, bool valid, float beta, const float (&k)[4], const float (&g)[4], const float (&v)[4]) {
    const float rk = row_rnorm(k, p.l2norm);
    float kb[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) kb[e] = valid ? beta * k[e] * rk * exp2f(g[e]) : 0.f;  // G <= 0: <= beta |k^|
    store_pair(kb_s + i * kLd + c0, kb[0], kb[1]), store_pair(kb_s + i * kLd + c0 + 2, kb[2], kb[3]);
    store_pair(vb_s + i * kLd + c0, beta * v[0], beta * v[1]), store_pair(vb_s + i * kLd + c0 + 2, beta * v[2], beta * v[3]);
  };
  if constexpr (kFast) {
    // beta and G of this warp's rows in flight with the copies; then the row math in place.
    constexpr int kRpw = kC / kWarps;
    float beta[kRpw], g[kRpw][4];
#pragma unroll
    for (int r = 0; r < kRpw; ++r) {
      const int i = warp + kWarps * r;
      const bool valid = i < ci.rows;
      beta[r] = scalar16<kPath>(p.beta, ci.b, ci.t0 + (valid ? i : 0), hv, valid);
      g4(p.G, tok0 + int64_t(valid ? i : 0) * p.H, p.K, c0, valid && c0 < p.K, g[r]);
    }
    cp_async_wait<0>();
    __syncthreads();  // every thread's copies visible
#pragma unroll
    for (int r = 0; r < kRpw; ++r) {
      const int i = warp + kWarps * r;
      float k[4], v[4];
      raw4<kPath>(kb_s + i * kLd + c0, k), raw4<kPath>(vb_s + i * kLd + c0, v);
      if constexpr (kPath == RowPath::kFp16) fp16_to_bf16(do_s + i * kLd + c0);
      row_math(i, i < ci.rows, beta[r], k, g[r], v);  // over k, v: this lane read these channels above
    }
  } else {
    const Rows in_k = rows_of(p.k, ci.b, ci.t0, hq), in_v = rows_of(p.v, ci.b, ci.t0, hv), in_o = rows_of(p.d_o, ci.b, ci.t0, hv),
               in_beta = rows_of(p.beta, ci.b, ci.t0, hv);
    auto stage_rows = [&] {
#pragma unroll 1
      for (int i = warp; i < kC; i += kWarps) {
        const bool valid = i < ci.rows;
        const int iv = valid ? i : 0;
        const int64_t row = tok0 + int64_t(iv) * p.H;
        // Straight-line loads (ld*_or0): a row's loads are in flight together.
        float k[4], g[4], v[4], o[4];
        const float beta = load1(in_beta, iv, 0, valid);
        load4(in_k, iv, c0, p.K, valid, k), load4(in_v, iv, c0, p.V, valid, v);
        load4(in_o, iv, c0, p.V, valid, o), load_g4(p.G, row, p.K, c0, valid, g);
        // A row (columns 2 lane, 2 lane + 1; j <= i only): one 4- or 8-byte load.
        float av[2];
        load2_any_or0(p.Akk, p.akk_dtype, row * kC + 2 * lane, valid && 2 * lane <= i, valid && 2 * lane + 1 <= i, av);
        row_math(i, valid, beta, k, g, v);
        store_pair(do_s + i * kLd + c0, o[0], o[1]), store_pair(do_s + i * kLd + c0 + 2, o[2], o[3]);
        store_pair(a_s + i * kLdC + 2 * lane, av[0], av[1]);
      }
    };
    // S: V % 4 == 0 and a 16-byte aligned state: quad u of a thread is state row a = warp + 16 u,
    // columns 4 lane.. (one 16- or 8-byte load); all of them issue before the row loop runs and land
    // in shared memory after it. Else element pairs, any float dtype.
    auto stage_quads = [&](auto wide) {
      constexpr bool kWide = decltype(wide)::value;
      using Quad = std::conditional_t<kWide, float4, uint2>;
      Quad sq[kQuads];
#pragma unroll
      for (int u = 0; u < kQuads; ++u) {
        const int a = warp + kWarps * u;
        const bool ok = a < p.K && c0 < p.V;  // V % 4 == 0: the quad is in or out as a whole
        const int64_t at = ok ? (state * p.K + a) * p.V + c0 : 0;
        if constexpr (kWide) sq[u] = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(p.h) + at));
        else sq[u] = __ldg(reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.h) + at));
      }
      stage_rows();
#pragma unroll
      for (int u = 0; u < kQuads; ++u) {
        const int a = warp + kWarps * u;
        const bool ok = a < p.K && c0 < p.V;
        uint2 s;
        if constexpr (kWide) s = make_uint2(kda::pack_bf16(sq[u].x, sq[u].y), kda::pack_bf16(sq[u].z, sq[u].w));
        else s = sq[u];  // bf16 as stored (bf16 -> fp32 -> bf16 is exact)
        if (!ok) s = make_uint2(0u, 0u);
        *reinterpret_cast<uint2*>(s_s + a * kLd + c0) = s;
      }
    };
    const bool quads = p.V % 4 == 0 && (reinterpret_cast<uintptr_t>(p.h) & 15) == 0;
    if (quads && p.h_dtype == DType::kFP32) stage_quads(std::true_type{});
    else if (quads && p.h_dtype == DType::kBF16) stage_quads(std::false_type{});
    else {
      stage_rows();
#pragma unroll 4
      for (int x = threadIdx.x; x < kD * kD / 2; x += kThreads) {
        const int a = x / (kD / 2), y = 2 * (x % (kD / 2));
        const int64_t at = (state * p.K + a) * p.V + y;
        const bool ok0 = a < p.K && y < p.V, ok1 = a < p.K && y + 1 < p.V;
        store_pair(s_s + a * kLd + y, load_any_or0(p.h, p.h_dtype, at, ok0), load_any_or0(p.h, p.h_dtype, at + 1, ok1));
      }
    }
    cp_async_wait<0>();
  }
  __syncthreads();

  // Warp w: fragment rows m0.. (16), columns n0.. (32, 4 n-tiles) of the [64 x 128] products and
  // n0c.. (16, 2 n-tiles) of the [64 x 64] ones.
  const int m0 = 16 * (warp & 3), n0 = 32 * (warp >> 2), n0c = 16 * (warp >> 2), g8 = lane >> 2, t4 = lane & 3;
  // Token rows of the fragment's rows m0 + g8 + 8 h (clamped to the chunk; stores skip rows past it).
  int64_t trow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) trow[h] = tok(p, ci.b, ci.t0 + min(m0 + g8 + 8 * h, ci.rows - 1), hv);
  // The fragment's decay factors, loaded straight-line before the products that use them:
  // eg = 2^G(i, a) and egc = 2^(gC(a) - G(i, a)) (0 at a >= K). Even K, 8-byte aligned G: pairs.
  float eg[4][4], egc[4][4];
  if (p.K % 2 == 0 && (reinterpret_cast<uintptr_t>(p.G) & 7) == 0) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int a = n0 + 8 * j + 2 * t4;
      const bool in = a < p.K;  // a even, K even: a + 1 < K too
      const float2 gc = __ldg(reinterpret_cast<const float2*>(p.G + (in ? last * p.K + a : 0)));
      egc[j][0] = egc[j][2] = in ? gc.x : 0.f;
      egc[j][1] = egc[j][3] = in ? gc.y : 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float2 g = __ldg(reinterpret_cast<const float2*>(p.G + (in ? trow[h] * p.K + a : 0)));
        eg[j][2 * h] = in ? g.x : 0.f;
        eg[j][2 * h + 1] = in ? g.y : 0.f;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int a = n0 + 8 * j + 2 * t4 + (e & 1);
        eg[j][e] = ldg_or0(p.G, trow[e >> 1] * p.K + a, a < p.K);
        egc[j][e] = ldg_or0(p.G, last * p.K + a, a < p.K);
      }
  }
  float acc[4][4];
  // Vnew = A (beta v) + (-W) S.
  zero(acc);
  warp_mma<kC, 4, false, true>(acc, a_s, kLdC, m0, vb_s, kLd, n0);
  warp_mma<kD, 4, false, true>(acc, wn_s, kLd, m0, s_s, kLd, n0);
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Vnew as a bf16 hi + lo pair: its products (dki, dAqk) feed dA_log, a sum over a head's every
      // token and channel with cancellation, where Vnew rounded to bf16 alone was the largest error.
      const int at = (m0 + g8 + 8 * h) * kLd + n0 + 8 * j + 2 * t4;
      const float x = acc[j][2 * h], y = acc[j][2 * h + 1];
      store_pair(vn_s + at, x, y);
      store_pair(vnl_s + at, x - __bfloat162float(__float2bfloat16(x)), y - __bfloat162float(__float2bfloat16(y)));
    }
  __syncthreads();

  // f(token row, column a, value pair x, y) over this warp's [16 x 32] fragment, valid rows only.
  auto each = [&](auto&& f) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (m0 + g8 + 8 * h < ci.rows) f(trow[h], n0 + 8 * j + 2 * t4, acc[j][2 * h], acc[j][2 * h + 1]);
  };
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool in = n0 + 8 * j + 2 * t4 + (e & 1) < p.K;
      egc[j][e] = in ? exp2f(egc[j][e] - eg[j][e]) : 0.f;  // gC <= G: <= 1
      eg[j][e] = in ? exp2f(eg[j][e]) : 0.f;
    }
  // dqi = scale (dO S^T) . 2^G.
  zero(acc);
  warp_mma<kD, 4, false, false>(acc, do_s, kLd, m0, s_s, kLd, n0);
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] *= p.scale * eg[j][e];
  each([&](int64_t r, int a, float x, float y) { *reinterpret_cast<float2*>(w.dqi + r * kD + a) = make_float2(x, y); });
  // dki = (Vnew dS'^T) . 2^(gC - G).
  zero(acc);
  warp_mma<kD, 4, false, false>(acc, vn_s, kLd, m0, d_s, kLd, n0);
  warp_mma<kD, 4, false, false>(acc, vnl_s, kLd, m0, d_s, kLd, n0);
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] *= egc[j][e];
  each([&](int64_t r, int a, float x, float y) { *reinterpret_cast<float2*>(w.dki + r * kD + a) = make_float2(x, y); });
  // dW = -dVnew S^T, into wn_s (-W was last read before the barrier above) and the workspace.
  zero(acc);
  warp_mma<kD, 4, false, false>(acc, dvn_s, kLd, m0, s_s, kLd, n0);
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = m0 + g8 + 8 * h, a = n0 + 8 * j + 2 * t4;
      store_pair(wn_s + i * kLd + a, -acc[j][2 * h], -acc[j][2 * h + 1]);
      if (i < ci.rows) store_pair(w.dw + trow[h] * kD + a, -acc[j][2 * h], -acc[j][2 * h + 1]);
    }
  // dAqk = tril(dO Vnew^T), the diagonal included: warp w rows m0.., columns n0c.. (2 n-tiles).
  float acc4[2][4];
  // The [64 x 64] results (i >= j kept) to dst, and with lo the bf16 remainders x - bf16(x) to lo.
  auto write64 = [&](__nv_bfloat16* dst, __nv_bfloat16* lo) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = m0 + g8 + 8 * h, c = n0c + 8 * j + 2 * t4;
        if (i >= ci.rows) continue;
        const float x = c <= i ? acc4[j][2 * h] : 0.f, y = c + 1 <= i ? acc4[j][2 * h + 1] : 0.f;
        store_pair(dst + trow[h] * kC + c, x, y);
        if (lo) store_pair(lo + trow[h] * kC + c, x - __bfloat162float(__float2bfloat16(x)), y - __bfloat162float(__float2bfloat16(y)));
      }
  };
  zero(acc4);
  warp_mma<kD, 2, false, false>(acc4, do_s, kLd, m0, vn_s, kLd, n0c);
  warp_mma<kD, 2, false, false>(acc4, do_s, kLd, m0, vnl_s, kLd, n0c);
  write64(w.daqk, w.daqk_lo);  // dAqk as a hi + lo pair too (K2b's products take both)
  // sd = rowsum_V(S . dS'): warp w state rows 8 w.., lane 4 columns (one 8-byte read of each tile).
  for (int a = 8 * warp; a < 8 * warp + 8; ++a) {
    const uint2 su = *reinterpret_cast<const uint2*>(s_s + a * kLd + c0), du = *reinterpret_cast<const uint2*>(d_s + a * kLd + c0);
    const __nv_bfloat16* sv = reinterpret_cast<const __nv_bfloat16*>(&su);
    const __nv_bfloat16* dv = reinterpret_cast<const __nv_bfloat16*>(&du);
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) s += __bfloat162float(sv[e]) * __bfloat162float(dv[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) w.sd[state * kD + a] = s;
  }
  __syncthreads();  // dW complete in wn_s
  // dA = dVnew (beta v)^T + dW Kbeta^T, i >= j.
  zero(acc4);
  warp_mma<kD, 2, false, false>(acc4, dvn_s, kLd, m0, vb_s, kLd, n0c);
  warp_mma<kD, 2, false, false>(acc4, wn_s, kLd, m0, kb_s, kLd, n0c);
  write64(w.da, nullptr);
}

}  // namespace
}  // namespace kda2

Status launch_kda2_state_grads(const KdaBwdCudaProblem& p, const Kda2Layout& l, void* workspace, int chunks, Stream stream) {
  using namespace kda2;
  if (p.K > kKda2D || p.V > kKda2D) return Status::unsupported("kda backward (second design): K and V up to 128");
  if (!p.h) return Status::invalid("residuals.h: the second backward's state products read the forward's saved states");
  const Ptrs w = ptrs_of(l, workspace);
  // The row loader (kda_bwd2_load.cuh): 16-bit inputs in aligned rows with bf16 residuals take cp.async.
  const RowPath path = row_path(p, /*with_h=*/true);
  auto* kernel = path == RowPath::kBf16   ? kda2_state_grads_kernel<RowPath::kBf16>
                 : path == RowPath::kFp16 ? kda2_state_grads_kernel<RowPath::kFp16>
                                          : kda2_state_grads_kernel<RowPath::kGeneric>;
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem("kda2_state_grads_kernel", kernel, kSmem));
  if (chunks > 0 && p.H > 0)
    ENCORE_RETURN_IF_ERROR(
        launch("kda2_state_grads_kernel", [&] { kernel<<<dim3(chunks, p.H), kThreads, kSmem, static_cast<cudaStream_t>(stream)>>>(p, w); }));
  return Status::ok();
}

}  // namespace encore::cuda
