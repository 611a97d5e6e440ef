// The second CUDA KDA backward, stage K2 fused (kda_bwd2.hpp; math: docs/math/kda.md §6; the CPU ground
// truth: stages 3-5 and the tails of src/kda/reference/kda_chunked_bwd.cpp): K2a's state products
// (kda_bwd2_grad.cu) and K2b's WY, intra-chunk gradients and tails (kda_bwd2_wy.cu) in one block, the
// intermediates K2a handed to K2b through the workspace (dqi, dki, dW, dAqk hi + lo, dA, sd) kept on chip.
// Bit-identical to K2a then K2b on an H100 (KdaBwd2Gpu.FusedK2IsBitIdenticalToSplit); run still takes
// the pair (kda/plan.hpp's kda2_k2) until `encore bench kda_bwd`, which times both in one run, shows
// this kernel ahead; then the pair leaves the tree.
//
// kda2_k2_kernel<RowPath, kHalf>, grid (chunk slots, HV), 512 threads (16 warps; warp w: rows 16 (w % 4)..,
// channels 32 (w / 4)..), one block an SM. Per chunk and value head, K, V <= 128, 16-bit q and k (kHalf:
// fp16, else bf16; fp32 inputs take K2a + K2b):
//   phase A (K2a's products, its staging and expressions unchanged):
//     Vnew = A (beta v) + (-W) S (bf16 hi + lo), sd = rowsum_V(S . dS'),
//     dki = (Vnew dS'^T) . 2^(gC - G) (fp32, shared), dqi = scale (dO S^T) . 2^G (fp32, parked in shared),
//     dW = -dVnew S^T, dAqk = tril(dO Vnew^T) (bf16 hi + lo), dA = dVnew (beta v)^T + dW Kbeta^T;
//   phase B (K2b's kernel from its row staging on): dVbeta, dKbeta, dL, the intra-chunk sweeps, dq, dk,
//     dv, dbeta, the dg reverse cumsum and the gate / L2-norm tails (kda_bwd2_wy.cu's header).
// Every intermediate holds the value K2b read back (rows past the chunk's end and channels past K zero
// where K2b's loads zeroed them), every reduction runs in K2a's / K2b's order, and dqi's product is
// __fmul_rn (in K2b it came from memory: nothing may contract it into dq's add), so the gradients are
// the split path's bits. q^, k^ of phase B are the raw 16-bit inputs times the row's L2-norm factor,
// recomputed at each use (the same fp32 product K2b stored in its fp32 tiles).
// Shared memory: 227,584 bytes (+16 B static), its map and dqi's parking slots in kda_bwd2_k2_layout.cuh.
// Loads in the order of use, each issued as soon as its tile is free: phase A's staging in three
// cp.async commit groups (row paths: k, v, dO for the row math; A, -W, S for Vnew; dS', dVnew for sd,
// dki and dW); phase B's G and v issued at S's (and dO's, Vnew's) last read, mid phase A, k and q at
// phase A's end, so phase B's first product (A^T dVnew, both on chip) runs while they land; beta and
// 1/|k| come from phase A's row math, 1/|q| from the landed q rows before dL. The generic path keeps its
// per-row loads for the rows (one code path per load). dqi lives in shared memory from its product to
// phase B's merge (park), so no register carries it across phase A's end.
// Registers (ptxas, sm_90a, CUDA 13.0): 128 (the __launch_bounds__(512, 1) cap), spills 0 B (bf16, fp16
// rows, generic bf16) and 12 B (generic fp16), from 100-124 B: the products' k-loops rolled two k-steps an
// iteration (mma_k: ptxas had loaded a whole product's fragments ahead, ~96 registers), dqi parked,
// phase A's decay factors taken at their products from raw G, phase B's G re-read from shared memory in
// the sweeps, and the chunk's indices re-read from shared memory where a later step issues loads
// (renew): the compiler no longer shares row addresses across the phases or hoists read-only loads.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/cuda/fast_math.cuh"
#include "common/cuda/launch_check.hpp"
#include "kda/cuda/kda_bwd2_device.cuh"
#include "kda/cuda/kda_bwd2_k2_layout.cuh"
#include "kda/cuda/kda_bwd2_load.cuh"

namespace encore::cuda {
namespace kda2 {
namespace {

template <RowPath kPath, bool kHalf>
__global__ void __launch_bounds__(kThreads, 1) kda2_k2_kernel(const __grid_constant__ KdaBwdCudaProblem p, Ptrs w) {
  constexpr bool kFast = kPath != RowPath::kGeneric;
  extern __shared__ __align__(16) unsigned char smem[];
  auto* a_s = reinterpret_cast<__nv_bfloat16*>(smem);           // [64][kLdC] A
  auto* s_s = reinterpret_cast<__nv_bfloat16*>(smem + kOffS);   // A: [128][kLd] S, [k][v]
  auto* d_s = reinterpret_cast<__nv_bfloat16*>(smem + kOffD);   // A: [128][kLd] dS', [k][v]
  auto* reg = reinterpret_cast<__nv_bfloat16*>(smem + kOffR);   // the region
  auto* qz = reinterpret_cast<__nv_bfloat16*>(smem + kOffQ);
  __nv_bfloat16 *dvn_s = reg, *dw_s = reg + kC * kLd, *vn_s = reg + 2 * kC * kLd, *vnl_s = reg + 3 * kC * kLd;
  __nv_bfloat16 *vb_s = qz, *kb_s = qz + kC * kLd, *do_s = qz + 2 * kC * kLd;  // A: beta v, Kbeta, dO
  // Phase B's names.
  __nv_bfloat16 *dl_s = s_s, *daqk_s = s_s + kC * kLdC, *daqkl_s = s_s + 2 * kC * kLdC;  // dA then dL; dAqk hi, lo
  auto* dki_f = reinterpret_cast<float*>(smem + kOffD);  // [64][kLdF] dki
  __nv_bfloat16 *v_s = vn_s, *m_s = vnl_s;                // v [64][kLd]; M = A^T dA [64][kLdC]
  __nv_bfloat16 *an_hi = reg, *an_lo = reg + kOperandRows * kLd;  // one anchored operand at a time, bf16 hi + lo
  auto* dg_f = reinterpret_cast<float*>(reg);
  float* kdk_f = dg_f + kC * kLdF;
  auto* q16 = reinterpret_cast<unsigned short*>(qz);                   // [64][kLd] q, raw 16-bit
  unsigned short* k16 = q16 + kC * kLd;                                // [64][kLd] k, raw 16-bit
  auto* g_f = reinterpret_cast<float*>(smem + kOffQ + 2 * kTile);      // [64][kLdF] G (rows past the end: gC)
  auto* beta_s = reinterpret_cast<float*>(smem + kOffF);               // [64]
  float* rq_s = beta_s + kC;                                           // [64] 1 / |q| (1 without the norm)
  float* rk_s = rq_s + kC;                                             // [64]
  float* dbp = rk_s + kC;                                              // [4][64] dbeta per channel quarter
  float* dotq = dbp + kQuarters * kC;                                  // [4][64] dq^ . q^
  float* dotk = dotq + kQuarters * kC;                                 // [4][64] dk^ . k^
  float* extra = dotk + kQuarters * kC;                                // [128] sd, then 2^gC sd
  float* tail_s = extra + kD;                                          // [2][4][128] the dg tail's part sums
  // dqi's parking slots (kda_bwd2_k2_layout.cuh); t: threadIdx.x as read at the site (tid_here).
  auto park = [&](int t, int j, int e) -> float& {
    const bool h = t >= kThreads / 2;
    auto pad = [&](size_t off, int ld, int t) -> float& { return reinterpret_cast<float*>(smem + off)[(t >> 2) * ld + ld - 4 + (t & 3)]; };
    float* const past_daqk = reinterpret_cast<float*>(smem + kOffS + 3 * kSmall);
    if (j == 3) return (e == 0 ? dbp : tail_s + (e - 1) * kThreads)[t];
    if (j == 2) return reinterpret_cast<float*>(smem + kOffR + 3 * kTile + kSmall)[e * kThreads + t];
    if (j == 1) return e < 3 ? past_daqk[e * kThreads + t] : h ? past_daqk[3 * kThreads - kThreads / 2 + t] : dki_f[kC * kLdF + t];
    if (e == 0) return pad(kOffQ, kLd / 2, t);
    if (e == 1) return h ? dotk[t - kThreads / 2] : pad(0, kLdC / 2, t);
    if (e == 2) return h ? pad(kOffQ + 2 * kTile, kLdF, t - kThreads / 2) : pad(kOffD, kLdF, t);
    return pad(kOffS, kLdC / 2, t);
  };
  const int slot = blockIdx.x;
  auto tid_here = [] {
    int t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
  };
  const ChunkInfo ci = chunk_info(p, slot);
  const int rows = ci.rows;
  // The chunk's indices, read back from shared memory after a barrier (renew) where a later step
  // issues its loads, so that its row addresses (64-bit) are derived there and not held in registers
  // (or spilled) from an earlier step (the compiler otherwise shares and hoists them).
  __shared__ int ids[4];
  int b = ci.b, t0 = ci.t0, hv = blockIdx.y, hq = hv / p.group;
  if (threadIdx.x == 0) ids[0] = b, ids[1] = t0, ids[2] = hv, ids[3] = hq;
  auto renew = [&] { b = ids[0], t0 = ids[1], hv = ids[2], hq = ids[3]; };
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c0 = 4 * lane;
  auto last = [&] { return tok(p, b, t0 + rows - 1, hv); };  // the chunk's last token row
  auto tokr = [&](int i) { return tok(p, b, t0, hv) + int64_t(i) * p.H; };  // the token row of chunk row i
  auto state = [&] { return int64_t(slot) * p.H + hv; };

  // ==== Phase A: K2a's staging and products ========================================================
  // Commit groups in the order of use: (row paths) k, v, dO for the row math; A, -W, S for Vnew; dS',
  // dVnew for sd, dki and dW. The generic path loads A, S and the rows itself: -W; dS', dVnew.
  {
    const int64_t wstep = int64_t(p.H) * kD * 2;
    if constexpr (kFast) {
      const Rows rk = rows_of(p.k, b, t0, hq), rv = rows_of(p.v, b, t0, hv), ro = rows_of(p.d_o, b, t0, hv);
      copy_rows<kThreads>(kb_s, kLd, rk.base, rk.step, rows, p.K);
      copy_rows<kThreads>(vb_s, kLd, rv.base, rv.step, rows, p.V);
      copy_rows<kThreads>(do_s, kLd, ro.base, ro.step, rows, p.V);
      cp_async_commit();
      copy_tri<kThreads>(a_s, kLdC, static_cast<const __nv_bfloat16*>(p.Akk) + tokr(0) * kC, int64_t(p.H) * kC, rows);
      copy_rows<kThreads, kD>(s_s, kLd, static_cast<const unsigned char*>(p.h) + state() * p.K * p.V * 2, int64_t(p.V) * 2, p.K, p.V);
    }
    copy_rows<kThreads>(dw_s, kLd, reinterpret_cast<const unsigned char*>(w.wn + tokr(0) * kD), wstep, rows, kD);  // -W
    cp_async_commit();
    copy_rows<kThreads, kD>(d_s, kLd, reinterpret_cast<const unsigned char*>(w.dsp + state() * kD * kD), kD * 2, p.K, p.V);
    copy_rows<kThreads>(dvn_s, kLd, reinterpret_cast<const unsigned char*>(w.dvn + tokr(0) * kD), wstep, rows, p.V);
    cp_async_commit();
  }
  // The row math; beta and 1 / |k| also into phase B's row arrays (its staging computed the same values).
  auto row_math = [&](int i, bool valid, float beta, const float (&k)[4], const float (&g)[4], const float (&v)[4]) {
    const float rk = row_rnorm(k, p.l2norm);
    if (lane == 0) beta_s[i] = beta, rk_s[i] = rk;
    float kb[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) kb[e] = valid ? beta * k[e] * rk * exp2f(g[e]) : 0.f;
    store_pair(kb_s + i * kLd + c0, kb[0], kb[1]), store_pair(kb_s + i * kLd + c0 + 2, kb[2], kb[3]);
    store_pair(vb_s + i * kLd + c0, beta * v[0], beta * v[1]), store_pair(vb_s + i * kLd + c0 + 2, beta * v[2], beta * v[3]);
  };
  if constexpr (kFast) {
    constexpr int kRpw = kC / kWarps;
    float beta[kRpw], g[kRpw][4];
#pragma unroll
    for (int r = 0; r < kRpw; ++r) {
      const int i = warp + kWarps * r;
      const bool valid = i < rows;
      beta[r] = scalar16<kPath>(p.beta, b, t0 + (valid ? i : 0), hv, valid);
      g4(p.G, tokr(valid ? i : 0), p.K, c0, valid && c0 < p.K, g[r]);
    }
    cp_async_wait<2>();  // k, v, dO
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRpw; ++r) {
      const int i = warp + kWarps * r;
      float k[4], v[4];
      raw4<kPath>(kb_s + i * kLd + c0, k), raw4<kPath>(vb_s + i * kLd + c0, v);
      if constexpr (kPath == RowPath::kFp16) fp16_to_bf16(do_s + i * kLd + c0);
      row_math(i, i < rows, beta[r], k, g[r], v);
    }
  } else {
    const Rows in_k = rows_of(p.k, b, t0, hq), in_v = rows_of(p.v, b, t0, hv), in_o = rows_of(p.d_o, b, t0, hv),
               in_beta = rows_of(p.beta, b, t0, hv);
    auto stage_rows = [&] {
#pragma unroll 1
      for (int i = warp; i < kC; i += kWarps) {
        const bool valid = i < rows;
        const int iv = valid ? i : 0;
        const int64_t row = tokr(iv);
        float k[4], g[4], v[4], o[4];
        const float beta = load1(in_beta, iv, 0, valid);
        load4(in_k, iv, c0, p.K, valid, k), load4(in_v, iv, c0, p.V, valid, v);
        load4(in_o, iv, c0, p.V, valid, o), load_g4(p.G, row, p.K, c0, valid, g);
        float av[2];
        load2_any_or0(p.Akk, p.akk_dtype, row * kC + 2 * lane, valid && 2 * lane <= i, valid && 2 * lane + 1 <= i, av);
        row_math(i, valid, beta, k, g, v);
        store_pair(do_s + i * kLd + c0, o[0], o[1]), store_pair(do_s + i * kLd + c0 + 2, o[2], o[3]);
        store_pair(a_s + i * kLdC + 2 * lane, av[0], av[1]);
      }
    };
    auto stage_quads = [&](auto wide) {
      constexpr bool kWide = decltype(wide)::value;
      using Quad = std::conditional_t<kWide, float4, uint2>;
      Quad sq[kQuads];
#pragma unroll
      for (int u = 0; u < kQuads; ++u) {
        const int a = warp + kWarps * u;
        const bool ok = a < p.K && c0 < p.V;
        const int64_t at = ok ? (state() * p.K + a) * p.V + c0 : 0;
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
        else s = sq[u];
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
        const int64_t at = (state() * p.K + a) * p.V + y;
        const bool ok0 = a < p.K && y < p.V, ok1 = a < p.K && y + 1 < p.V;
        store_pair(s_s + a * kLd + y, load_any_or0(p.h, p.h_dtype, at, ok0), load_any_or0(p.h, p.h_dtype, at + 1, ok1));
      }
    }
  }
  cp_async_wait<1>();  // A, -W, S (row paths); -W (generic)
  __syncthreads();

  // Warp w: fragment rows m0.. (16), columns n0.. (32) of the [64 x 128] products, n0c.. (16) of the
  // [64 x 64] ones; the same fragments in both phases.
  const int blk = warp & 3, qtr = warp >> 2, m0 = 16 * blk, n0 = 32 * qtr, n0c = 16 * qtr, g8 = lane >> 2, t4 = lane & 3;
  // dqi at this warp's fragment (0 past the chunk's end and at channels >= K), for phase B's merge: in
  // shared memory (park), held in dqh only until its slot is free.
  float dqh[4][4];
  {
    renew();  // G's loads below stay after the barrier (not hoisted to the staging, 24 registers held through it)
    int64_t trow[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) trow[h] = tok(p, b, t0 + min(m0 + g8 + 8 * h, rows - 1), hv);
    // G at the fragment's elements and gC at its columns (0 at channels >= K), raw: the factors
    // 2^(gC - G) and 2^G are taken at their products (24 registers across Vnew and dki, not 32).
    float gq[4][4], gcq[4][2];
    if constexpr (kFast) {  // K % 4 == 0, G 16-byte aligned: float2 loads (the generic path: one load each, one code path)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int a = n0 + 8 * j + 2 * t4;
        const bool in = a < p.K;
        const float2 gc = __ldg(reinterpret_cast<const float2*>(p.G + (in ? last() * p.K + a : 0)));
        gcq[j][0] = in ? gc.x : 0.f;
        gcq[j][1] = in ? gc.y : 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float2 g = __ldg(reinterpret_cast<const float2*>(p.G + (in ? trow[h] * p.K + a : 0)));
          gq[j][2 * h] = in ? g.x : 0.f;
          gq[j][2 * h + 1] = in ? g.y : 0.f;
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int a = n0 + 8 * j + 2 * t4 + (e & 1);
          gq[j][e] = ldg_or0(p.G, trow[e >> 1] * p.K + a, a < p.K);
          if (e < 2) gcq[j][e] = ldg_or0(p.G, last() * p.K + a, a < p.K);
        }
    }
    float acc[4][4];
    // Vnew = A (beta v) + (-W) S, as a bf16 hi + lo pair.
    zero(acc);
    mma_k<kC, 4, false, true>(acc, a_s, kLdC, m0, vb_s, kLd, n0);
    mma_k<kD, 4, false, true>(acc, dw_s, kLd, m0, s_s, kLd, n0);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int at = (m0 + g8 + 8 * h) * kLd + n0 + 8 * j + 2 * t4;
        const float x = acc[j][2 * h], y = acc[j][2 * h + 1];
        store_pair(vn_s + at, x, y);
        store_pair(vnl_s + at, x - __bfloat162float(__float2bfloat16(x)), y - __bfloat162float(__float2bfloat16(y)));
      }
    cp_async_wait<0>();  // dS', dVnew
    __syncthreads();     // Vnew complete; -W read
    // sd = rowsum_V(S . dS') into extra: warp w state rows 8 w.., lane 4 columns.
    for (int a = 8 * warp; a < 8 * warp + 8; ++a) {
      const uint2 su = *reinterpret_cast<const uint2*>(s_s + a * kLd + c0), du = *reinterpret_cast<const uint2*>(d_s + a * kLd + c0);
      const __nv_bfloat16* sv = reinterpret_cast<const __nv_bfloat16*>(&su);
      const __nv_bfloat16* dv = reinterpret_cast<const __nv_bfloat16*>(&du);
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) s += __bfloat162float(sv[e]) * __bfloat162float(dv[e]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) extra[a] = s;
    }
    // dki = (Vnew dS'^T) . 2^(gC - G), into dS''s zone once every warp has read dS'.
    zero(acc);
    mma_k<kD, 4, false, false>(acc, vn_s, kLd, m0, d_s, kLd, n0);
    mma_k<kD, 4, false, false>(acc, vnl_s, kLd, m0, d_s, kLd, n0);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] *= n0 + 8 * j + 2 * t4 + (e & 1) < p.K ? exp2f(gcq[j][e & 1] - gq[j][e]) : 0.f;
    __syncthreads();  // dS' read (sd, dki)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = m0 + g8 + 8 * (e >> 1), a = n0 + 8 * j + 2 * t4 + (e & 1);
        dki_f[i * kLdF + a] = i < rows && a < p.K ? acc[j][e] : 0.f;
      }
    // dqi = scale (dO S^T) . 2^G (an unfused product: see the header).
    const int t1 = tid_here();
    zero(acc);
    mma_k<kD, 4, false, false>(acc, do_s, kLd, m0, s_s, kLd, n0);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = m0 + g8 + 8 * (e >> 1), a = n0 + 8 * j + 2 * t4 + (e & 1);
        const float x = __fmul_rn(acc[j][e], p.scale * (a < p.K ? exp2f(gq[j][e]) : 0.f));
        const float y = i < rows && a < p.K ? x : 0.f;
        if (dqi_parked_early(j, e)) park(t1, j, e) = y;
        else dqh[j][e] = y;
      }
    // dW = -dVnew S^T into -W's tile (rows past the end: +0, as K2b's masked load).
    zero(acc);
    mma_k<kD, 4, false, false>(acc, dvn_s, kLd, m0, s_s, kLd, n0);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = m0 + g8 + 8 * h, a = n0 + 8 * j + 2 * t4;
        store_pair(dw_s + i * kLd + a, i < rows ? -acc[j][2 * h] : 0.f, i < rows ? -acc[j][2 * h + 1] : 0.f);
      }
  }
  {
    // The [64 x 64] results (i >= j, i < rows kept, else 0) into dst, with lo the bf16 remainders.
    float acc4[2][4];
    auto write64 = [&](__nv_bfloat16* dst, __nv_bfloat16* lo) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = m0 + g8 + 8 * h, c = n0c + 8 * j + 2 * t4;
          const float x = i < rows && c <= i ? acc4[j][2 * h] : 0.f, y = i < rows && c + 1 <= i ? acc4[j][2 * h + 1] : 0.f;
          store_pair(dst + i * kLdC + c, x, y);
          if (lo) store_pair(lo + i * kLdC + c, x - __bfloat162float(__float2bfloat16(x)), y - __bfloat162float(__float2bfloat16(y)));
        }
    };
    // dAqk = tril(dO Vnew^T), hi + lo.
    zero(acc4);
    mma_k<kD, 2, false, false>(acc4, do_s, kLd, m0, vn_s, kLd, n0c);
    mma_k<kD, 2, false, false>(acc4, do_s, kLd, m0, vnl_s, kLd, n0c);
    __syncthreads();  // S read (dqi, dW): its zone takes dAqk and dA; dW complete; dO, Vnew read
    const int t15 = tid_here();
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (!dqi_parked_early(j, e)) park(t15, j, e) = dqh[j][e];
    renew();
    if constexpr (kFast) {  // phase B's G and v rows (one commit group), into dO's tile and past it, and Vnew hi's
#pragma unroll
      for (int u = 0; u < kC * (kD / 4) / kThreads; ++u) {  // 16-byte units of G (K % 4 == 0); rows past the end: gC
        const int x = threadIdx.x + u * kThreads, i = x >> 5, c = 4 * (x & 31);
        const bool ok = c < p.K;
        cp_async16(g_f + i * kLdF + c, p.G + (ok ? (i < rows ? tokr(i) : last()) * p.K + c : 0), ok);
      }
      const Rows rv = rows_of(p.v, b, t0, hv);
      copy_rows<kThreads>(v_s, kLd, rv.base, rv.step, rows, p.V);
      cp_async_commit();
    }
    write64(daqk_s, daqkl_s);
    // dA = dVnew (beta v)^T + dW Kbeta^T, i >= j.
    zero(acc4);
    mma_k<kD, 2, false, false>(acc4, dvn_s, kLd, m0, vb_s, kLd, n0c);
    mma_k<kD, 2, false, false>(acc4, dw_s, kLd, m0, kb_s, kLd, n0c);
    write64(dl_s, nullptr);
  }
  __syncthreads();  // phase A done: beta v, Kbeta free
  renew();

  // ==== Phase B: K2b from its row staging on ========================================================
  // Rows: q, k raw 16-bit, G (rows past the end: gC), bf16 v and the rows' 1 / |q| (beta and 1 / |k|
  // came with phase A's row math); then 2^gC sd. The row paths: G and v in flight since S's last read,
  // k and q as two commit groups here (their tiles were beta v's and Kbeta's), in the order of use;
  // v stays raw (fp16 rounds to bf16 at its one read); 1 / |q| from the landed rows before dL.
  if constexpr (kFast) {
    const Rows rk = rows_of(p.k, b, t0, hq), rq = rows_of(p.q, b, t0, hq);
    copy_rows<kThreads>(reinterpret_cast<__nv_bfloat16*>(k16), kLd, rk.base, rk.step, rows, p.K);
    cp_async_commit();
    copy_rows<kThreads>(reinterpret_cast<__nv_bfloat16*>(q16), kLd, rq.base, rq.step, rows, p.K);
    cp_async_commit();
  } else {  // warp per row, lane 4 channels
    float gc[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) gc[e] = ldg_or0(p.G, last() * p.K + c0 + e, c0 + e < p.K);
    const Rows in_q = rows_of(p.q, b, t0, hq), in_k = rows_of(p.k, b, t0, hq), in_v = rows_of(p.v, b, t0, hv);
#pragma unroll
    for (int u = 0; u < kC / kWarps; ++u) {  // all of a warp's rows' loads in flight together
      const int i = warp + kWarps * u;
      const bool valid = i < rows;
      const int iv = valid ? i : 0;
      float q[4], k[4], g[4], v[4];
      load4(in_q, iv, c0, p.K, valid, q), load4(in_k, iv, c0, p.K, valid, k);
      load_g4(p.G, tokr(iv), p.K, c0, valid, g), load4(in_v, iv, c0, p.V, valid, v);
#pragma unroll
      for (int e = 0; e < 4; ++e) g[e] = valid && c0 + e < p.K ? g[e] : gc[e];
      const float rq = row_rnorm(q, p.l2norm);
      auto pack_raw = [](const float (&x)[4]) {
        return make_uint2(float_to_raw<kHalf>(x[0]) | float_to_raw<kHalf>(x[1]) << 16, float_to_raw<kHalf>(x[2]) | float_to_raw<kHalf>(x[3]) << 16);
      };
      *reinterpret_cast<uint2*>(q16 + i * kLd + c0) = pack_raw(q), *reinterpret_cast<uint2*>(k16 + i * kLd + c0) = pack_raw(k);
      *reinterpret_cast<float4*>(g_f + i * kLdF + c0) = make_float4(g[0], g[1], g[2], g[3]);
      if (lane == 0) rq_s[i] = rq;
      store_pair(v_s + i * kLd + c0, v[0], v[1]), store_pair(v_s + i * kLd + c0 + 2, v[2], v[3]);
    }
  }
  for (int a = threadIdx.x; a < kD; a += kThreads) {
    const float gl = ldg_or0(p.G, last() * p.K + a, a < p.K);
    extra[a] = a < p.K ? exp2f(gl) * extra[a] : 0.f;
  }
  // q^ = q |q|^-1 and k^ (row i, channel a), as K2b's fp32 tiles held them; pairs at even a.
  auto qh = [&](int i, int a) { return raw_to_float<kHalf>(q16[i * kLd + a]) * rq_s[i]; };
  auto kh = [&](int i, int a) { return raw_to_float<kHalf>(k16[i * kLd + a]) * rk_s[i]; };
  auto hat2 = [&](const unsigned short* x16, const float* r_s, int i, int a) {
    const uint32_t u = *reinterpret_cast<const uint32_t*>(x16 + i * kLd + a);
    return make_float2(raw_to_float<kHalf>(u & 0xffffu) * r_s[i], raw_to_float<kHalf>(u >> 16) * r_s[i]);
  };
  auto qh2 = [&](int i, int a) { return hat2(q16, rq_s, i, a); };
  auto kh2 = [&](int i, int a) { return hat2(k16, rk_s, i, a); };

  // f(fragment element n-tile j, e, row i, channel a) over this warp's [16 x 32] fragment.
  auto each = [&](auto&& f) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(j, e, m0 + g8 + 8 * (e >> 1), n0 + 8 * j + 2 * t4 + (e & 1));
  };
  float acc[4][4], dk_t[4][4], dg_t[4][4];
  float db[2] = {0.f, 0.f};  // dbeta parts of rows m0 + g8 (+ 8)

  // ---- dVbeta, dKbeta, M -------------------------------------------------------------------------
  zero(acc);
  mma_k<kC, 4, true, true>(acc, a_s, kLdC, m0, dvn_s, kLd, n0);  // A and dVnew: on chip since phase A
  if constexpr (kFast) cp_async_wait<1>();                           // G, v, k
  __syncthreads();                                                   // the rows (and 2^gC sd) complete
  auto v_at = [&](int i, int y) {  // v as bf16 (the row paths' fp16 rounded as the generic path's staging)
    if constexpr (kPath == RowPath::kFp16) return __bfloat162float(__float2bfloat16_rn(cvt16<kPath>(reinterpret_cast<const unsigned short*>(v_s)[i * kLd + y])));
    else return __bfloat162float(v_s[i * kLd + y]);
  };
  const OutRows out_dv = out_rows(p.dv, b, t0, hv);
  each([&](int j, int e, int i, int y) {
    db[e >> 1] += acc[j][e] * v_at(i, y);
    if ((e & 1) == 0 && i < rows && y < p.V) store2(out_dv, i, y, beta_s[i] * acc[j][e], beta_s[i] * acc[j][e + 1], y + 1 < p.V);
  });
  zero(acc);
  mma_k<kC, 4, true, true>(acc, a_s, kLdC, m0, dw_s, kLd, n0);
  each([&](int j, int e, int i, int a) {
    const float eg = fast_exp2(g_f[i * kLdF + a]), ke = kh(i, a) * eg;
    dk_t[j][e] = beta_s[i] * eg * acc[j][e];
    dg_t[j][e] = beta_s[i] * ke * acc[j][e];
    db[e >> 1] += acc[j][e] * ke;
  });
  float acc_m[2][4];
  zero(acc_m);
  mma_k<kC, 2, true, true>(acc_m, a_s, kLdC, m0, dl_s, kLdC, n0c);
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) store_pair(m_s + (m0 + g8 + 8 * h) * kLdC + n0c + 8 * j + 2 * t4, acc_m[j][2 * h], acc_m[j][2 * h + 1]);
  if constexpr (kFast) cp_async_wait<0>();  // q
  __syncthreads();                          // M complete; dA read; q landed
  if constexpr (kFast) {                    // 1 / |q| (read from the intra sweeps on)
#pragma unroll
    for (int u = 0; u < kC / kWarps; ++u) {
      const int i = warp + kWarps * u;
      float q[4];
      raw4<kPath>(reinterpret_cast<const __nv_bfloat16*>(q16) + i * kLd + c0, q);
      const float rq = row_rnorm(q, p.l2norm);
      if (lane == 0) rq_s[i] = rq;
    }
  }
  // dL = -strict(M A^T), into dl_s.
  zero(acc_m);
  mma_k<kC, 2, false, false>(acc_m, m_s, kLdC, m0, a_s, kLdC, n0c);
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = m0 + g8 + 8 * h, c = n0c + 8 * j + 2 * t4;
      store_pair(dl_s + i * kLdC + c, c < i && i < rows ? -acc_m[j][2 * h] : 0.f, c + 1 < i && i < rows ? -acc_m[j][2 * h + 1] : 0.f);
    }
  __syncthreads();  // dL complete; dVnew, dW, v, M read (the region is free); 1 / |q| complete

  // ---- the intra-chunk terms (K2b's comments on the anchoring and the hi + lo operands) ----------
  auto build = [&](int nrows, auto&& value) {
    for (int x = threadIdx.x; x < nrows * (kD / 2); x += kThreads) {
      const int rr = x / (kD / 2), a = 2 * (x % (kD / 2));
      const float v0 = value(rr, a), v1 = value(rr, a + 1);
      const __nv_bfloat16 h0 = __float2bfloat16(v0), h1 = __float2bfloat16(v1);
      *reinterpret_cast<__nv_bfloat162*>(an_hi + rr * kLd + a) = __halves2bfloat162(h0, h1);
      store_pair(an_lo + rr * kLd + a, v0 - __bfloat162float(h0), v1 - __bfloat162float(h1));
    }
  };
  // kr: row block rb's anchor r = 16 rb, rows j < r: k^_j 2^(G_r - G_j).
  build(kAnchorRows, [&](int rr, int a) {
    const int rb = rr < 16 ? 1 : rr < 48 ? 2 : 3, j = rr - row_base(rb), r = 16 * rb;
    return kh(j, a) * fast_exp2(g_f[r * kLdF + a] - g_f[j * kLdF + a]);
  });
  // qr / bkr: column block cb's anchor r = 16 cb + 15, rows i > r: q~_i (or beta_i k^_i) 2^(G_i - G_r).
  auto col_anchored = [&](int rr, int a, bool q) {
    const int cb = rr < 48 ? 0 : rr < 80 ? 1 : 2, i = 16 * (cb + 1) + rr - col_base(cb), r = 16 * cb + 15;
    return (q ? p.scale * qh(i, a) : beta_s[i] * kh(i, a)) * fast_exp2(g_f[i * kLdF + a] - g_f[r * kLdF + a]);
  };
  __syncthreads();
  auto bf = [](const __nv_bfloat16* t, int i, int j) { return __bfloat162float(t[i * kLdC + j]); };
  // (1, 2) dQi and dKrow over row block blk: off the diagonal block on tensor cores, then the block.
  float acc2[4][4];
  zero(acc);
  zero(acc2);
  for (int s = 0; s < blk; ++s) {
    for (const __nv_bfloat16* kr : {an_hi, an_lo}) {
      mma_k<16, 4, false, true>(acc, daqk_s + 16 * s, kLdC, m0, kr + (row_base(blk) + 16 * s) * kLd, kLd, n0);
      mma_k<16, 4, false, true>(acc2, dl_s + 16 * s, kLdC, m0, kr + (row_base(blk) + 16 * s) * kLd, kLd, n0);
    }
    mma_k<16, 4, false, true>(acc, daqkl_s + 16 * s, kLdC, m0, an_hi + (row_base(blk) + 16 * s) * kLd, kLd, n0);
  }
  bool tc_diag;
  {
    float lo = g_f[m0 * kLdF + n0 + lane], hi = lo;
#pragma unroll
    for (int r = 1; r < 16; ++r) {
      const float x = g_f[(m0 + r) * kLdF + n0 + lane];
      lo = fminf(lo, x), hi = fmaxf(hi, x);
    }
    tc_diag = __all_sync(0xffffffffu, hi - lo <= kDiagSpan);
  }
  __syncthreads();  // kr is read: the region takes the diagonal blocks' k^_j 2^(G_16b - G_j)
  build(kC, [&](int rr, int a) {
    const int r = rr & ~15;
    return kh(rr, a) * fast_exp2(fminf(g_f[r * kLdF + a] - g_f[rr * kLdF + a], kDiagSpan));
  });
  __syncthreads();
  if (tc_diag) {
    for (const __nv_bfloat16* kd : {an_hi, an_lo}) {
      mma_k<16, 4, false, true>(acc, daqk_s + m0, kLdC, m0, kd + m0 * kLd, kLd, n0);
      mma_k<16, 4, false, true>(acc2, dl_s + m0, kLdC, m0, kd + m0 * kLd, kLd, n0);
    }
    mma_k<16, 4, false, true>(acc, daqkl_s + m0, kLdC, m0, an_hi + m0 * kLd, kLd, n0);
  }
  each([&](int j, int e, int i, int a) {
    const float f = fast_exp2(g_f[i * kLdF + a] - g_f[m0 * kLdF + a]);
    acc[j][e] *= f;
    acc2[j][e] *= f;
  });
  // Column jj of the block (E_ij = 2^min(0, G_i - G_jj)); G of the fragment's rows from shared memory
  // (dqi holds the registers K2b gave them).
  auto column = [&](int jj, auto kAll) {
    float cq[2], cl[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = m0 + g8 + 8 * h;
      cq[h] = bf(daqk_s, i, jj) + bf(daqkl_s, i, jj);
      cl[h] = bf(dl_s, i, jj);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int a = n0 + 8 * j + 2 * t4;
      const float2 k2 = kh2(jj, a), g2 = *reinterpret_cast<const float2*>(g_f + jj * kLdF + a);
#pragma unroll
      for (int e = decltype(kAll)::value ? 0 : 2; e < 4; ++e) {
        const float gi = g_f[(m0 + g8 + 8 * (e >> 1)) * kLdF + a + (e & 1)];
        const float kf = (e & 1 ? k2.y : k2.x) * fast_exp2(fminf(gi - (e & 1 ? g2.y : g2.x), 0.f));
        acc[j][e] += cq[e >> 1] * kf;
        acc2[j][e] += cl[e >> 1] * kf;
      }
    }
  };
  if (!tc_diag) {
#pragma unroll 1
    for (int jj = m0; jj < m0 + 8; ++jj) column(jj, std::true_type{});
#pragma unroll 1
    for (int jj = m0 + 8; jj < m0 + 16; ++jj) column(jj, std::false_type{});
  }
  const int t7 = tid_here();
  each([&](int j, int e, int i, int a) {
    const float qf = qh(i, a), kf = kh(i, a), bt = beta_s[i];
    const float dq_in = park(t7, j, e);
    dg_t[j][e] += p.scale * qf * acc[j][e] + qf * dq_in + bt * kf * acc2[j][e];
    dk_t[j][e] += bt * acc2[j][e];
    db[e >> 1] += kf * acc2[j][e];
    acc[j][e] = dq_in + p.scale * acc[j][e];  // dq^ from here on
  });
  float(&dq_t)[4][4] = acc;
  // G at this warp's fragment element (n-tile j, e), from shared memory at each use (16 registers fewer across (3)).
  auto gr = [&](int j, int e) { return g_f[(m0 + g8 + 8 * (e >> 1)) * kLdF + n0 + 8 * j + 2 * t4 + (e & 1)]; };
  // (3) dKcol over column block blk: off the diagonal block anchored at row m0 + 15; the block.
  zero(acc2);
  for (int term = 0; term < 2; ++term) {  // dAqk^T qr, then dL^T bkr: each operand in the region in turn
    __syncthreads();                       // the region's previous operand is read
    build(kAnchorRows, [&](int rr, int a) { return col_anchored(rr, a, term == 0); });
    __syncthreads();
    const __nv_bfloat16* coef = term == 0 ? daqk_s : dl_s;
    for (int s = 0; s < 3 - blk; ++s) {
      const int i0 = 16 * (blk + 1) + 16 * s, rb = col_base(blk) + 16 * s;
      mma_k<16, 4, true, true>(acc2, coef + i0 * kLdC, kLdC, m0, an_hi + rb * kLd, kLd, n0);
      mma_k<16, 4, true, true>(acc2, coef + i0 * kLdC, kLdC, m0, an_lo + rb * kLd, kLd, n0);
      if (term == 0) mma_k<16, 4, true, true>(acc2, daqkl_s + i0 * kLdC, kLdC, m0, an_hi + rb * kLd, kLd, n0);
    }
  }
  __syncthreads();  // bkr is read
  build(2 * kC, [&](int rr, int a) {
    const int ii = rr & (kC - 1), r = ii | 15;
    const float x = rr < kC ? p.scale * qh(ii, a) : beta_s[ii] * kh(ii, a);
    return x * fast_exp2(fminf(g_f[ii * kLdF + a] - g_f[r * kLdF + a], kDiagSpan));
  });
  __syncthreads();
  if (tc_diag) {
    for (const __nv_bfloat16* cd : {an_hi, an_lo}) {
      mma_k<16, 4, true, true>(acc2, daqk_s + m0 * kLdC, kLdC, m0, cd + m0 * kLd, kLd, n0);
      mma_k<16, 4, true, true>(acc2, dl_s + m0 * kLdC, kLdC, m0, cd + (kC + m0) * kLd, kLd, n0);
    }
    mma_k<16, 4, true, true>(acc2, daqkl_s + m0 * kLdC, kLdC, m0, an_hi + m0 * kLd, kLd, n0);
  }
  each([&](int j, int e, int c, int a) { acc2[j][e] *= fast_exp2(g_f[(m0 + 15) * kLdF + a] - gr(j, e)); });
  auto row = [&](int ii, auto kAll) {
    float cq[2], cl[2];
    const float bt = beta_s[ii];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = m0 + g8 + 8 * h;
      cq[h] = (bf(daqk_s, ii, c) + bf(daqkl_s, ii, c)) * p.scale;  // zero unless ii >= c
      cl[h] = bf(dl_s, ii, c) * bt;                                 // zero unless ii > c
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int a = n0 + 8 * j + 2 * t4;
      const float2 q2 = qh2(ii, a), k2 = kh2(ii, a), g2 = *reinterpret_cast<const float2*>(g_f + ii * kLdF + a);
#pragma unroll
      for (int e = 0; e < (decltype(kAll)::value ? 4 : 2); ++e) {
        const float f = fast_exp2(fminf((e & 1 ? g2.y : g2.x) - gr(j, e), 0.f));
        acc2[j][e] += (cq[e >> 1] * (e & 1 ? q2.y : q2.x) + cl[e >> 1] * (e & 1 ? k2.y : k2.x)) * f;
      }
    }
  };
  if (!tc_diag) {
#pragma unroll 1
    for (int ii = m0; ii < m0 + 8; ++ii) row(ii, std::false_type{});
#pragma unroll 1
    for (int ii = m0 + 8; ii < m0 + 16; ++ii) row(ii, std::true_type{});
  }
  each([&](int j, int e, int c, int a) {
    dk_t[j][e] += acc2[j][e];
    dg_t[j][e] -= kh(c, a) * acc2[j][e];
  });

  // ---- the inter-chunk parts of dk and dG, the row dots --------------------------------------------
  float kdk[4][4];
  float dq_dot[2] = {0.f, 0.f}, dk_dot[2] = {0.f, 0.f};
  each([&](int j, int e, int i, int a) {
    const float dki = dki_f[i * kLdF + a], kf = kh(i, a);
    dk_t[j][e] += dki;
    dg_t[j][e] -= kf * dki;
    kdk[j][e] = kf * dki;
    dq_dot[e >> 1] += dq_t[j][e] * qh(i, a);
    dk_dot[e >> 1] += dk_t[j][e] * kf;
  });
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int s = 1; s < 4; s <<= 1) {
      db[h] += __shfl_xor_sync(0xffffffffu, db[h], s);
      dq_dot[h] += __shfl_xor_sync(0xffffffffu, dq_dot[h], s);
      dk_dot[h] += __shfl_xor_sync(0xffffffffu, dk_dot[h], s);
    }
  __syncthreads();  // the anchored operands are read: the region takes dG and k^.dki
  each([&](int j, int e, int i, int a) {
    dg_f[i * kLdF + a] = i < rows ? dg_t[j][e] : 0.f;
    kdk_f[i * kLdF + a] = i < rows ? kdk[j][e] : 0.f;
  });
  if (t4 == 0)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = m0 + g8 + 8 * h;
      dbp[qtr * kC + i] = db[h];
      dotq[qtr * kC + i] = dq_dot[h];
      dotk[qtr * kC + i] = dk_dot[h];
    }
  __syncthreads();
  // ---- the tails ----------------------------------------------------------------------------------
  renew();
  const int64_t sb = int64_t(p.T) * p.H * kD, st = int64_t(p.H) * kD;
  const KdaOutTensor pdq = p.group > 1 ? KdaOutTensor{w.dqi, DType::kFP32, sb, st, kD} : p.dq;
  const KdaOutTensor pdk = p.group > 1 ? KdaOutTensor{w.dki, DType::kFP32, sb, st, kD} : p.dk;
  const int hout = p.group > 1 ? hv : hq;
  auto quarters = [](const float* part, int i) { return (part[i] + part[kC + i]) + (part[2 * kC + i] + part[3 * kC + i]); };
  const OutRows out_dq = out_rows(pdq, b, t0, hout), out_dk = out_rows(pdk, b, t0, hout);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = m0 + g8 + 8 * h;
    if (i >= rows) continue;
    const float sq = p.l2norm ? quarters(dotq, i) : 0.f, sk = p.l2norm ? quarters(dotk, i) : 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int a = n0 + 8 * j + 2 * t4;
      if (a >= p.K) continue;
      float dq[2], dk[2];
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        dq[x] = dq_t[j][2 * h + x], dk[x] = dk_t[j][2 * h + x];
        if (p.l2norm) {
          dq[x] = rq_s[i] * (dq[x] - qh(i, a + x) * sq);
          dk[x] = rk_s[i] * (dk[x] - kh(i, a + x) * sk);
        }
      }
      store2(out_dq, i, a, dq[0], dq[1], a + 1 < p.K);
      store2(out_dk, i, a, dk[0], dk[1], a + 1 < p.K);
    }
  }
  if (threadIdx.x < rows) store1(out_rows(p.dbeta, b, t0, hv), threadIdx.x, 0, quarters(dbp, threadIdx.x));
  // dg: the reverse cumsum per channel with the last row's terms, then the gate backward (K2b's parts).
  const int a = int(threadIdx.x) % kD, part = int(threadIdx.x) / kD, r0 = kPartRows * part;
  float sdg = 0.f, skdk = 0.f;
#pragma unroll
  for (int u = 0; u < kPartRows; ++u) {
    sdg += dg_f[(r0 + u) * kLdF + a];
    skdk += kdk_f[(r0 + u) * kLdF + a];
  }
  tail_s[part * kD + a] = sdg;
  tail_s[(kParts + part) * kD + a] = skdk;
  __syncthreads();
  float tot = extra[a], acc_g = 0.f, pdt = 0.f, pda = 0.f;
#pragma unroll
  for (int x = 0; x < kParts; ++x) tot += tail_s[(kParts + x) * kD + a];
#pragma unroll
  for (int x = kParts - 1; x > 0; --x) acc_g += x > part ? tail_s[x * kD + a] : 0.f;
  if (a < p.K) {
    const float ea = kda::gate_scale(p, hv), dtb = p.dt_bias ? p.dt_bias[hv * p.K + a] : 0.f;
    const Rows in_g = rows_of(p.g, b, t0, hv);
    const OutRows out_dg = out_rows(p.dg, b, t0, hv);
    float xr[kPartRows];
#pragma unroll
    for (int u = 0; u < kPartRows; ++u) xr[u] = p.gate_in_kernel ? load1(in_g, r0 + u < rows ? r0 + u : 0, a, r0 + u < rows) + dtb : 0.f;
#pragma unroll
    for (int u = kPartRows - 1; u >= 0; --u) {
      const int i = r0 + u;
      acc_g += dg_f[i * kLdF + a];
      const float dy = acc_g + tot;
      float dx = dy;
      if (i < rows) {
        if (p.gate_in_kernel) {
          float da;
          kda::gate_backward(p, dy, xr[u], ea, &dx, &da);
          pda += da;
          pdt += dx;
        }
        store1(out_dg, i, a, dx);
      }
    }
  }
  __syncthreads();  // the sums are read: tail_s takes the gate partials
  tail_s[part * kD + a] = pdt;
  tail_s[(kParts + part) * kD + a] = pda;
  __syncthreads();
  if (part == 0 && a < p.K) {
    float sdt = 0.f, sda = 0.f;
#pragma unroll
    for (int x = 0; x < kParts; ++x) {
      sdt += tail_s[x * kD + a];
      sda += tail_s[(kParts + x) * kD + a];
    }
    w.gp[state() * 2 * kD + a] = sdt;
    w.gp[state() * 2 * kD + kD + a] = sda;
  }
}

}  // namespace
}  // namespace kda2

Status launch_kda2_k2(const KdaBwdCudaProblem& p, const Kda2Layout& l, void* workspace, int chunks, Stream stream) {
  using namespace kda2;
  if (p.K > kKda2D || p.V > kKda2D) return Status::unsupported("kda backward (second design): K and V up to 128");
  if (!p.h) return Status::invalid("residuals.h: the second backward's state products read the forward's saved states");
  const DType dt = p.q.dtype;
  if ((dt != DType::kBF16 && dt != DType::kFP16) || p.k.dtype != dt)
    return Status::unsupported("kda backward (fused K2): 16-bit q and k (kept raw in shared memory); other inputs take K2a + K2b");
  const Ptrs w = ptrs_of(l, workspace);
  const RowPath path = row_path(p, /*with_h=*/true);
  auto* kernel = path == RowPath::kBf16 ? kda2_k2_kernel<RowPath::kBf16, false> : path == RowPath::kFp16 ? kda2_k2_kernel<RowPath::kFp16, true>
                 : dt == DType::kFP16 ? kda2_k2_kernel<RowPath::kGeneric, true> : kda2_k2_kernel<RowPath::kGeneric, false>;
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem("kda2_k2_kernel", kernel, kSmem));
  if (chunks > 0 && p.H > 0)
    ENCORE_RETURN_IF_ERROR(
        launch("kda2_k2_kernel", [&] { kernel<<<dim3(chunks, p.H), kThreads, kSmem, static_cast<cudaStream_t>(stream)>>>(p, w); }));
  return launch_kda2_reductions(p, l, workspace, chunks, stream);
}

}  // namespace encore::cuda
