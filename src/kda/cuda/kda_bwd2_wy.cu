// The second CUDA KDA backward, stage K2b and the closing reductions (kda_bwd2.hpp; math:
// docs/math/kda.md §6; the CPU ground truth: stages 3-5 and the tails of
// src/kda/reference/kda_chunked_bwd.cpp). GEMM-shaped products on mma.sync m16n8k16 (bf16 operands,
// fp32 accumulation); the intra-chunk diagonal 16 x 16 blocks, the decay factors, the reverse cumsum
// and the tails in fp32.
//
// kda2_wy_kernel, grid (chunk slots, HV), 512 threads (16 warps; warp w: rows 16 (w % 4).., channels
// 32 (w / 4)..), 220 KB of shared memory, 128 registers (ptxas, sm_90a; 60 B spilled): one block
// of 16 warps per SM. Per chunk, with q^, k^ the (L2-normed) inputs, q~ = scale q^,
// G the log2 cumsum, A = (I + L)^-1, and K2a's dA, dAqk, dW, dqi, dki, sd, K1's dVnew:
//   dVbeta = A^T dVnew -> dv = beta dVbeta, dbeta += rowsum(dVbeta . v)
//   dKbeta = A^T dW    -> dk += beta 2^G . dKbeta, dbeta += rowsum(dKbeta . k^ 2^G), dG += Kbeta . dKbeta
//   dL = -strict(A^T dA A^T)                                (two 64 x 64 x 64 products, M = A^T dA in bf16)
//   intra (i >= j, E_ij = 2^(G_i - G_j) per channel): dQi_i = sum_j dAqk_ij k^_j E_ij,
//     dKrow_i = sum_{j<i} dL_ij k^_j E_ij, dKcol_j = sum_{i>=j} (dAqk_ij q~_i + [i>j] dL_ij beta_i k^_i) E_ij:
//     off the diagonal blocks as tensor-core products on operands anchored at a block edge (row block
//     b: k^_j 2^(G_16b - G_j), then times 2^(G_i - G_16b); column block b: q~_i 2^(G_i - G_16b+15), then
//     times 2^(G_16b+15 - G_j): every exponent <= 0, so no overflow at any gate); the diagonal blocks
//     the same way, anchored at the block's first (last) row, where the block's G spans <= 60 (log2)
//     in each of a warp's channels (exponents <= 60 then), else per pair in fp32 (steep gates);
//   dq^ = dqi + scale dQi;  dk^ = dki + beta 2^G dKbeta + beta dKrow + dKcol;
//   dG = q^ . dqi - k^ . dki + Kbeta . dKbeta + q~ . dQi + k^ . (beta dKrow - dKcol), the last row also
//     2^gC sd + sum_rows k^ . dki; dg = the reverse cumsum of dG within the chunk;
//   then the gate backward (softplus / lower-bound gate: dg w.r.t. the raw gate, per-chunk partials of
//   dA_log and ddt_bias into gp) and the L2-norm backward (dq, dk). With grouped value heads dq, dk go
//   to fp32 per-value-head partials (in place over dqi, dki), summed per q/k head by
//   kda2_group_reduce_kernel; dA_log, ddt_bias from gp by the first backward's gate reduction
//   (kdabwd::launch_gate_reduce_parts; fixed orders).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "common/cuda/fast_math.cuh"
#include "common/cuda/launch_check.hpp"
#include "kda/cuda/kda_bwd2_device.cuh"

namespace encore::cuda {
namespace kda2 {
namespace {


constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kLdF = kD + 4;        // fp32 row stride of [64][128] tiles
constexpr int kAnchorRows = 96;     // rows of the anchored operands: 16 + 32 + 48
constexpr size_t kSmall = size_t(kC) * kLdC * 2;  // one bf16 [64][64] tile
constexpr size_t kTileF = size_t(kC) * kLdF * 4;   // one fp32 [64][128] tile
// The region, in turn: dVnew, dW, v (bf16 [64][kLd] each) | one anchored operand's hi + lo (bf16
// [96][kLd] each) | dG, k^.dki (fp32 tiles); sized by the largest.
constexpr int kOperandRows = 128;   // an operand's hi half, then its lo half kOperandRows rows on
constexpr size_t kRegion = 2 * kTileF > 2 * size_t(kOperandRows) * kLd * 2 ? 2 * kTileF : 2 * size_t(kOperandRows) * kLd * 2;
constexpr float kDiagSpan = 60.f;   // the diagonal blocks on tensor cores where a block's G spans <= this (log2)
constexpr int kQuarters = 4;      // column quarters of the [64 x 128] fragments (warp >> 2)
constexpr int kParts = kThreads / kKda2D, kPartRows = kC / kParts;  // the dg tail: 4 parts of 16 rows per channel
constexpr size_t kSmem = 5 * kSmall + kRegion + 3 * kTileF + size_t(3 * kC + kQuarters * 3 * kC + kD + 2 * kParts * kD) * 4;
static_assert(kAnchorRows <= kOperandRows && 2 * size_t(kOperandRows) * kLd * 2 <= kRegion, "an operand's hi and lo halves fit the region");
static_assert(3 * size_t(kC) * kLd * 2 <= kRegion, "dVnew, dW and v alias the anchored operands");

// First row of row block b's anchored k^ rows (b = 1..3) and of column block b's q~ / beta k^ rows (b = 0..2).
__device__ __forceinline__ int row_base(int b) { return b == 1 ? 0 : b == 2 ? 16 : 48; }
__device__ __forceinline__ int col_base(int b) { return b == 0 ? 0 : b == 1 ? 48 : 80; }

__global__ void __launch_bounds__(kThreads, 1) kda2_wy_kernel(const __grid_constant__ KdaBwdCudaProblem p, Ptrs w) {
  extern __shared__ __align__(16) unsigned char smem[];
  auto* a_s = reinterpret_cast<__nv_bfloat16*>(smem);  // [64][kLdC] A
  __nv_bfloat16* dl_s = a_s + kC * kLdC;                // [64][kLdC] dA, then dL
  __nv_bfloat16* daqk_s = dl_s + kC * kLdC;             // [64][kLdC] dAqk
  __nv_bfloat16* m_s = daqk_s + kC * kLdC;              // [64][kLdC] M = A^T dA
  __nv_bfloat16* daqkl_s = m_s + kC * kLdC;             // [64][kLdC] dAqk's lo half (K2a's bf16 hi + lo pair)
  __nv_bfloat16* reg = daqkl_s + kC * kLdC;             // the region (kRegion)
  __nv_bfloat16 *dvn_s = reg, *dw_s = reg + kC * kLd, *v_s = reg + 2 * kC * kLd;  // v: the dbeta term
  __nv_bfloat16 *an_hi = reg, *an_lo = reg + kOperandRows * kLd;  // one anchored operand at a time, bf16 hi + lo
  auto* dg_f = reinterpret_cast<float*>(reg);
  float* kdk_f = dg_f + kC * kLdF;
  auto* q_f = reinterpret_cast<float*>(smem + 5 * kSmall + kRegion);  // [64][kLdF] q^ (unscaled)
  float* k_f = q_f + kC * kLdF;                                        // [64][kLdF] k^
  float* g_f = k_f + kC * kLdF;                                        // [64][kLdF] G (rows past the end: gC)
  float* beta_s = g_f + kC * kLdF;                                     // [64]
  float* rq_s = beta_s + kC;                                           // [64] 1 / |q| (1 without the norm)
  float* rk_s = rq_s + kC;                                             // [64]
  float* dbp = rk_s + kC;                                              // [4][64] dbeta per channel quarter
  float* dotq = dbp + kQuarters * kC;                                  // [4][64] dq^ . q^
  float* dotk = dotq + kQuarters * kC;                                 // [4][64] dk^ . k^
  float* extra = dotk + kQuarters * kC;                                // [128] 2^gC sd
  float* tail_s = extra + kD;                                          // [2][4][128] the dg tail's part sums

  const int slot = blockIdx.x, hv = blockIdx.y, hq = hv / p.group;
  const ChunkInfo ci = chunk_info(p, slot);
  const int rows = ci.rows, b = ci.b, t0 = ci.t0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c0 = 4 * lane;
  const int64_t state = int64_t(slot) * p.H + hv;
  const int64_t last = tok(p, b, t0 + rows - 1, hv);

  // ---- A: rows (warp per row, lane 4 channels) -------------------------------------------------
  float gc[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) gc[e] = ldg_or0(p.G, last * p.K + c0 + e, c0 + e < p.K);
  const Rows in_q = rows_of(p.q, b, t0, hq), in_k = rows_of(p.k, b, t0, hq), in_v = rows_of(p.v, b, t0, hv), in_beta = rows_of(p.beta, b, t0, hv);
  const int64_t tok0 = tok(p, b, t0, hv);  // the token row of chunk row i: tok0 + i H
  auto tokr = [&](int i) { return tok0 + int64_t(i) * p.H; };
#pragma unroll
  for (int u = 0; u < kC / kWarps; ++u) {  // all of a warp's rows' loads in flight together
    const int i = warp + kWarps * u;
    const bool valid = i < rows;
    const int iv = valid ? i : 0;
    const int64_t row = tokr(iv);
    float q[4], k[4], g[4], v[4];
    load4(in_q, iv, c0, p.K, valid, q), load4(in_k, iv, c0, p.K, valid, k);
    load_g4(p.G, row, p.K, c0, valid, g), load4(in_v, iv, c0, p.V, valid, v);
#pragma unroll
    for (int e = 0; e < 4; ++e) g[e] = valid && c0 + e < p.K ? g[e] : gc[e];  // rows past the end: gC
    const float beta = load1(in_beta, iv, 0, valid);
    const uint2 dvn = load4_or0(w.dvn + row * kD, c0, valid, p.V), dw = load4_or0(w.dw + row * kD, c0, valid);
    const int j = 2 * lane;
    const uint32_t da = load2_or0(w.da, row * kC + j, valid), daqk = load2_or0(w.daqk, row * kC + j, valid),
                   daqkl = load2_or0(w.daqk_lo, row * kC + j, valid);
    float av[2];
    load2_any_or0(p.Akk, p.akk_dtype, row * kC + j, valid && j <= i, valid && j + 1 <= i, av);
    const float rq = row_rnorm(q, p.l2norm), rk = row_rnorm(k, p.l2norm);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      q_f[i * kLdF + c0 + e] = q[e] * rq;
      k_f[i * kLdF + c0 + e] = k[e] * rk;
      g_f[i * kLdF + c0 + e] = g[e];
    }
    if (lane == 0) {
      beta_s[i] = beta;
      rq_s[i] = rq;
      rk_s[i] = rk;
    }
    *reinterpret_cast<uint2*>(dvn_s + i * kLd + c0) = dvn;
    store_pair(v_s + i * kLd + c0, v[0], v[1]), store_pair(v_s + i * kLd + c0 + 2, v[2], v[3]);
    *reinterpret_cast<uint2*>(dw_s + i * kLd + c0) = dw;
    *reinterpret_cast<uint32_t*>(dl_s + i * kLdC + j) = da;
    *reinterpret_cast<uint32_t*>(daqk_s + i * kLdC + j) = daqk;
    *reinterpret_cast<uint32_t*>(daqkl_s + i * kLdC + j) = daqkl;
    store_pair(a_s + i * kLdC + j, av[0], av[1]);
  }
  for (int a = threadIdx.x; a < kD; a += kThreads) {
    const float gl = ldg_or0(p.G, last * p.K + a, a < p.K), sd = ld_or0(w.sd, state * kD + a, a < p.K);
    extra[a] = a < p.K ? exp2f(gl) * sd : 0.f;
  }
  __syncthreads();

  // Warp w owns rows m0 = 16 (w % 4).. (row block blk) and channels n0 = 32 (w / 4).. (quarter qtr)
  // of the [64 x 128] products; of the [64 x 64] ones, columns n0c = 16 qtr.. .
  const int blk = warp & 3, qtr = warp >> 2, m0 = 16 * blk, n0 = 32 * qtr, n0c = 16 * qtr, g8 = lane >> 2, t4 = lane & 3;
  // f(fragment element n-tile j, e, row i, channel a) over this warp's [16 x 32] fragment.
  auto each = [&](auto&& f) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(j, e, m0 + g8 + 8 * (e >> 1), n0 + 8 * j + 2 * t4 + (e & 1));
  };
  // G at this warp's fragment elements: the exponents' reference.
  float gr[4][4];
  each([&](int j, int e, int i, int a) { gr[j][e] = g_f[i * kLdF + a]; });
  float acc[4][4], dk_t[4][4], dg_t[4][4];
  float db[2] = {0.f, 0.f};  // dbeta parts of rows m0 + g8 (+ 8)

  // ---- B: dVbeta, dKbeta, M ----------------------------------------------------------------------
  zero(acc);
  warp_mma<kC, 4, true, true>(acc, a_s, kLdC, m0, dvn_s, kLd, n0);
  const OutRows out_dv = out_rows(p.dv, b, t0, hv);
  each([&](int j, int e, int i, int y) {
    db[e >> 1] += acc[j][e] * __bfloat162float(v_s[i * kLd + y]);
    if ((e & 1) == 0 && i < rows && y < p.V) store2(out_dv, i, y, beta_s[i] * acc[j][e], beta_s[i] * acc[j][e + 1], y + 1 < p.V);
  });
  zero(acc);
  warp_mma<kC, 4, true, true>(acc, a_s, kLdC, m0, dw_s, kLd, n0);
  each([&](int j, int e, int i, int a) {
    const float eg = fast_exp2(gr[j][e]), ke = k_f[i * kLdF + a] * eg;
    dk_t[j][e] = beta_s[i] * eg * acc[j][e];
    dg_t[j][e] = beta_s[i] * ke * acc[j][e];
    db[e >> 1] += acc[j][e] * ke;
  });
  float acc_m[2][4];
  zero(acc_m);
  warp_mma<kC, 2, true, true>(acc_m, a_s, kLdC, m0, dl_s, kLdC, n0c);
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) store_pair(m_s + (m0 + g8 + 8 * h) * kLdC + n0c + 8 * j + 2 * t4, acc_m[j][2 * h], acc_m[j][2 * h + 1]);
  __syncthreads();  // M complete; dA read
  // dL = -strict(M A^T), into dl_s.
  zero(acc_m);
  warp_mma<kC, 2, false, false>(acc_m, m_s, kLdC, m0, a_s, kLdC, n0c);
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = m0 + g8 + 8 * h, c = n0c + 8 * j + 2 * t4;
      store_pair(dl_s + i * kLdC + c, c < i && i < rows ? -acc_m[j][2 * h] : 0.f, c + 1 < i && i < rows ? -acc_m[j][2 * h + 1] : 0.f);
    }
  __syncthreads();  // dL complete; dVnew, dW read (the region is free)

  // ---- C: the intra-chunk terms -----------------------------------------------------------------
  // The anchored operands off the diagonal blocks go in as bf16 hi + lo pairs (two MMAs each): rounded
  // to bf16 alone, their errors are shared by a block's 16 rows and move the dG plane (dA_log, ddt_bias
  // by up to 2e-2 on the CPU model of the kernel; hi + lo: 2e-3, the other roundings' level). One
  // operand at a time in the region (96 rows x 2), built by all threads: thread x takes the channel pair
  // a = 2 (x % 64) of rows rr = x / 64 + 8 u, u < kRows / 8 unrolled, so the block of row rr, and with it
  // its anchor, is known at compile time from u (the blocks' bounds are multiples of 8 rows); value(u, rr,
  // a) gives the pair's two values. The anchors' G are read from shared memory once, before the loop.
  auto build = [&](auto kRows, auto&& value) {
    const int a = 2 * int(threadIdx.x & 63), r0 = int(threadIdx.x >> 6);
#pragma unroll
    for (int u = 0; u < decltype(kRows)::value / 8; ++u) {
      const int rr = r0 + 8 * u;
      const float2 v = value(u, rr, a);
      const __nv_bfloat162 h = __float22bfloat162_rn(v);  // both halves rounded to nearest in one conversion
      *reinterpret_cast<__nv_bfloat162*>(an_hi + rr * kLd + a) = h;
      store_pair(an_lo + rr * kLd + a, v.x - __low2float(h), v.y - __high2float(h));
    }
  };
  auto pair = [](const float* t, int i, int a) { return *reinterpret_cast<const float2*>(t + i * kLdF + a); };
  const int ba = 2 * int(threadIdx.x & 63);  // the builds' channel pair
  // kr: row block rb's anchor r = 16 rb, rows j < r: k^_j 2^(G_r - G_j) (16, 32, 48 rows for rb = 1, 2, 3).
  {
    const float2 ga[3] = {pair(g_f, 16, ba), pair(g_f, 32, ba), pair(g_f, 48, ba)};
    build(std::integral_constant<int, kAnchorRows>{}, [&](int u, int rr, int a) {
      const int b = 8 * u < 16 ? 0 : 8 * u < 48 ? 1 : 2, j = rr - (b == 0 ? 0 : b == 1 ? 16 : 48);  // rb = b + 1, j = rr - row_base(rb)
      const float2 k = pair(k_f, j, a), g = pair(g_f, j, a);
      return make_float2(k.x * fast_exp2(ga[b].x - g.x), k.y * fast_exp2(ga[b].y - g.y));
    });
  }
  // qr / bkr: column block cb's anchor r = 16 cb + 15, rows i > r: q~_i (or beta_i k^_i) 2^(G_i - G_r)
  // (48, 32, 16 rows for cb = 0, 1, 2).
  auto col_anchored = [&](bool q) {
    const float2 ga[3] = {pair(g_f, 15, ba), pair(g_f, 31, ba), pair(g_f, 47, ba)};
    build(std::integral_constant<int, kAnchorRows>{}, [&](int u, int rr, int a) {
      const int cb = 8 * u < 48 ? 0 : 8 * u < 80 ? 1 : 2, i = rr + (cb == 0 ? 16 : cb == 1 ? -16 : -32);  // 16 (cb + 1) + rr - col_base(cb)
      const float2 x = pair(q ? q_f : k_f, i, a), g = pair(g_f, i, a);
      const float sx = q ? p.scale : beta_s[i];
      return make_float2(sx * x.x * fast_exp2(g.x - ga[cb].x), sx * x.y * fast_exp2(g.y - ga[cb].y));
    });
  };
  __syncthreads();
  auto bf = [](const __nv_bfloat16* t, int i, int j) { return __bfloat162float(t[i * kLdC + j]); };
  // The diagonal blocks per pair in fp32, E = 2^min(0, G_row - G_col) (the clamp harmless: pairs past
  // the triangle have zero coefficients; every exponent finite). A step covers one row or column of the
  // block for all fragment elements at once; fragment rows that the triangle leaves out of a step
  // (kAll false: the upper or lower 8 rows) are skipped at compile time.
  // (1, 2) dQi and dKrow over row block blk: off the diagonal block on tensor cores (anchored at row
  // m0, then times 2^(G_i - G_m0)), then the block per pair, column by column.
  float acc2[4][4];
  zero(acc);
  zero(acc2);
  // dAqk's hi + lo times the operand's hi + lo (lo x lo left out: ~2^-16 of the rest).
  for (int s = 0; s < blk; ++s) {
    for (const __nv_bfloat16* kr : {an_hi, an_lo}) {
      warp_mma<16, 4, false, true>(acc, daqk_s + 16 * s, kLdC, m0, kr + (row_base(blk) + 16 * s) * kLd, kLd, n0);
      warp_mma<16, 4, false, true>(acc2, dl_s + 16 * s, kLdC, m0, kr + (row_base(blk) + 16 * s) * kLd, kLd, n0);
    }
    warp_mma<16, 4, false, true>(acc, daqkl_s + 16 * s, kLdC, m0, an_hi + (row_base(blk) + 16 * s) * kLd, kLd, n0);
  }
  // The diagonal block on tensor cores too where this warp's block of G spans <= kDiagSpan in every
  // channel (then k^_j 2^(G_m0 - G_j) <= 2^60 |k^_j| and no exponent leaves fp32): anchored at its
  // first row like the blocks before it. Elsewhere (steep gates) the per-pair loops below.
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
  {
    const float2 ga[4] = {pair(g_f, 0, ba), pair(g_f, 16, ba), pair(g_f, 32, ba), pair(g_f, 48, ba)};
    build(std::integral_constant<int, kC>{}, [&](int u, int rr, int a) {  // the anchor: row rr & ~15 = 16 (u / 2)
      const float2 k = pair(k_f, rr, a), g = pair(g_f, rr, a);
      return make_float2(k.x * fast_exp2(fminf(ga[u / 2].x - g.x, kDiagSpan)), k.y * fast_exp2(fminf(ga[u / 2].y - g.y, kDiagSpan)));
    });
  }
  __syncthreads();
  if (tc_diag) {
    for (const __nv_bfloat16* kd : {an_hi, an_lo}) {
      warp_mma<16, 4, false, true>(acc, daqk_s + m0, kLdC, m0, kd + m0 * kLd, kLd, n0);
      warp_mma<16, 4, false, true>(acc2, dl_s + m0, kLdC, m0, kd + m0 * kLd, kLd, n0);
    }
    warp_mma<16, 4, false, true>(acc, daqkl_s + m0, kLdC, m0, an_hi + m0 * kLd, kLd, n0);
  }
  each([&](int j, int e, int i, int a) {
    const float f = fast_exp2(gr[j][e] - g_f[m0 * kLdF + a]);
    acc[j][e] *= f;
    acc2[j][e] *= f;
  });
  // Column jj of the block (E_ij = 2^min(0, G_i - G_jj)): the coefficients vanish past the diagonal
  // (dAqk is tril, dL strict), so columns jj >= m0 + 8 touch only the lower 8 fragment rows.
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
      const float2 k2 = *reinterpret_cast<const float2*>(k_f + jj * kLdF + a), g2 = *reinterpret_cast<const float2*>(g_f + jj * kLdF + a);
#pragma unroll
      for (int e = decltype(kAll)::value ? 0 : 2; e < 4; ++e) {
        const float kf = (e & 1 ? k2.y : k2.x) * fast_exp2(fminf(gr[j][e] - (e & 1 ? g2.y : g2.x), 0.f));
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
  // This thread's two fragment rows of dqi (later of dki): their addresses once (rows past the chunk: its last).
  auto frag_rows = [&](const float* x, const float* (&at)[2]) {
    at[0] = x + tokr(min(m0 + g8, rows - 1)) * kD, at[1] = x + tokr(min(m0 + g8 + 8, rows - 1)) * kD;
  };
  const float* dqi_rows[2];
  frag_rows(w.dqi, dqi_rows);
  each([&](int j, int e, int i, int a) {
    const float dqi = ld_or0(dqi_rows[e >> 1], a, i < rows && a < p.K);
    const float qf = q_f[i * kLdF + a], kf = k_f[i * kLdF + a], bt = beta_s[i];
    dg_t[j][e] += p.scale * qf * acc[j][e] + qf * dqi + bt * kf * acc2[j][e];
    dk_t[j][e] += bt * acc2[j][e];
    db[e >> 1] += kf * acc2[j][e];
    acc[j][e] = dqi + p.scale * acc[j][e];  // dq^ from here on
  });
  float(&dq_t)[4][4] = acc;
  // (3) dKcol over column block blk (the fragment's rows are the column index c): off the diagonal
  // block anchored at row m0 + 15, then times 2^(G_m0+15 - G_c); the block per pair.
  zero(acc2);
  for (int term = 0; term < 2; ++term) {  // dAqk^T qr, then dL^T bkr: each operand in the region in turn
    __syncthreads();                       // the region's previous operand is read
    col_anchored(term == 0);
    __syncthreads();
    const __nv_bfloat16* coef = term == 0 ? daqk_s : dl_s;
    for (int s = 0; s < 3 - blk; ++s) {
      const int i0 = 16 * (blk + 1) + 16 * s, rb = col_base(blk) + 16 * s;
      warp_mma<16, 4, true, true>(acc2, coef + i0 * kLdC, kLdC, m0, an_hi + rb * kLd, kLd, n0);
      warp_mma<16, 4, true, true>(acc2, coef + i0 * kLdC, kLdC, m0, an_lo + rb * kLd, kLd, n0);
      if (term == 0) warp_mma<16, 4, true, true>(acc2, daqkl_s + i0 * kLdC, kLdC, m0, an_hi + rb * kLd, kLd, n0);
    }
  }
  // The diagonal block, where tc_diag: q~_ii and beta_ii k^_ii times 2^(G_ii - G_16b+15) (rows ii of
  // the q part, 64 + ii of the beta k part), anchored at the block's last row like the blocks after it.
  __syncthreads();  // bkr is read
  {
    const float2 ga[4] = {pair(g_f, 15, ba), pair(g_f, 31, ba), pair(g_f, 47, ba), pair(g_f, 63, ba)};
    build(std::integral_constant<int, 2 * kC>{}, [&](int u, int rr, int a) {  // row ii = rr % 64, its anchor ii | 15: 16 (u % 8 / 2) + 15
      const int ii = rr - (u < kC / 8 ? 0 : kC);  // rr % 64 (rr = r0 + 8 u, r0 < 8)
      const bool q = u < kC / 8;
      const float2 x = pair(q ? q_f : k_f, ii, a), g = pair(g_f, ii, a);
      const float sx = q ? p.scale : beta_s[ii];
      const float2 gr_ = ga[(u % 8) / 2];
      return make_float2(sx * x.x * fast_exp2(fminf(g.x - gr_.x, kDiagSpan)), sx * x.y * fast_exp2(fminf(g.y - gr_.y, kDiagSpan)));
    });
  }
  __syncthreads();
  if (tc_diag) {
    for (const __nv_bfloat16* cd : {an_hi, an_lo}) {
      warp_mma<16, 4, true, true>(acc2, daqk_s + m0 * kLdC, kLdC, m0, cd + m0 * kLd, kLd, n0);
      warp_mma<16, 4, true, true>(acc2, dl_s + m0 * kLdC, kLdC, m0, cd + (kC + m0) * kLd, kLd, n0);
    }
    warp_mma<16, 4, true, true>(acc2, daqkl_s + m0 * kLdC, kLdC, m0, an_hi + m0 * kLd, kLd, n0);
  }
  each([&](int j, int e, int c, int a) { acc2[j][e] *= fast_exp2(g_f[(m0 + 15) * kLdF + a] - gr[j][e]); });
  // Row ii of the block (E = 2^min(0, G_ii - G_c)): nonzero for ii >= c only, so rows ii < m0 + 8
  // touch only the upper 8 fragment rows.
  auto row = [&](int ii, auto kAll) {
    float cq[2], cl[2];
    const float bt = beta_s[ii];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = m0 + g8 + 8 * h;
      cq[h] = (bf(daqk_s, ii, c) + bf(daqkl_s, ii, c)) * p.scale;  // zero unless ii >= c
      cl[h] = bf(dl_s, ii, c) * bt;         // zero unless ii > c
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int a = n0 + 8 * j + 2 * t4;
      const float2 q2 = *reinterpret_cast<const float2*>(q_f + ii * kLdF + a), k2 = *reinterpret_cast<const float2*>(k_f + ii * kLdF + a),
                   g2 = *reinterpret_cast<const float2*>(g_f + ii * kLdF + a);
#pragma unroll
      for (int e = 0; e < (decltype(kAll)::value ? 4 : 2); ++e) {
        const float f = fast_exp2(fminf((e & 1 ? g2.y : g2.x) - gr[j][e], 0.f));
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
    dg_t[j][e] -= k_f[c * kLdF + a] * acc2[j][e];
  });

  // ---- D: the inter-chunk parts of dk and dG, the row dots ----------------------------------------
  float kdk[4][4];
  float dq_dot[2] = {0.f, 0.f}, dk_dot[2] = {0.f, 0.f};
  const float* dki_rows[2];
  frag_rows(w.dki, dki_rows);
  each([&](int j, int e, int i, int a) {
    const float dki = ld_or0(dki_rows[e >> 1], a, i < rows && a < p.K);
    dk_t[j][e] += dki;
    dg_t[j][e] -= k_f[i * kLdF + a] * dki;
    kdk[j][e] = k_f[i * kLdF + a] * dki;
    dq_dot[e >> 1] += dq_t[j][e] * q_f[i * kLdF + a];
    dk_dot[e >> 1] += dk_t[j][e] * k_f[i * kLdF + a];
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
  // ---- E: the tails ------------------------------------------------------------------------------
  // dq, dk (the L2-norm backward), per value head: to the outputs, or with grouped heads to the fp32
  // partials over dqi, dki (the element this thread read above).
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
          dq[x] = rq_s[i] * (dq[x] - q_f[i * kLdF + a + x] * sq);
          dk[x] = rk_s[i] * (dk[x] - k_f[i * kLdF + a + x] * sk);
        }
      }
      store2(out_dq, i, a, dq[0], dq[1], a + 1 < p.K);
      store2(out_dk, i, a, dk[0], dk[1], a + 1 < p.K);
    }
  }
  if (threadIdx.x < rows) store1(out_rows(p.dbeta, b, t0, hv), threadIdx.x, 0, quarters(dbp, threadIdx.x));
  // dg: the reverse cumsum per channel with the last row's terms, then the gate backward. Thread
  // (channel a, part) takes rows 16 part .. 16 part + 15 (rows past the end hold zeros), the parts'
  // sums and gate partials meet in tail_s.
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
    // This thread's channel a of g (row 0 where a row is past the chunk: always in the tensor) and its rows
    // r0.. of dg (stored only where i < rows): the column's address once, a row one step on.
    const Rows g_col{in_g.base + (int64_t(a) << in_g.shift), in_g.step, in_g.shift, in_g.dtype};
    const OutRows dg_col{out_dg.base + int64_t(r0) * out_dg.step, out_dg.step, out_dg.shift, out_dg.dtype};
    float xr[kPartRows];  // the gate's input (raw g + dt_bias) of the part's rows, loaded before the chain
#pragma unroll
    for (int u = 0; u < kPartRows; ++u) xr[u] = p.gate_in_kernel ? load1(g_col, r0 + u, 0, r0 + u < rows) + dtb : 0.f;
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
        store1(dg_col, u, a, dx);
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
    w.gp[state * 2 * kD + a] = sdt;
    w.gp[state * 2 * kD + kD + a] = sda;
  }
}

// Grouped value heads: dq[b, t, hq, a] = sum over j < group (in order) of the partial of value head
// hq * group + j (dqi / dki rows); one thread per (b, t, hq, a).
__global__ void kda2_group_reduce_kernel(const __grid_constant__ KdaBwdCudaProblem p, const float* pq, const float* pk) {
  const int Hq = p.H / p.group;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(p.B) * p.T * Hq * p.K) return;
  const int a = int(idx % p.K);
  int64_t r = idx / p.K;
  const int hq = int(r % Hq);
  r /= Hq;
  const int t = int(r % p.T), b = int(r / p.T);
  float sq = 0.f, sk = 0.f;
  for (int j = 0; j < p.group; ++j) {
    const int64_t off = ((int64_t(b) * p.T + t) * p.H + hq * p.group + j) * kD + a;
    sq += pq[off];
    sk += pk[off];
  }
  store_out(p.dq, b, t, hq, a, sq);
  store_out(p.dk, b, t, hq, a, sk);
}

}  // namespace
}  // namespace kda2

Status launch_kda2_wy(const KdaBwdCudaProblem& p, const Kda2Layout& l, void* workspace, int chunks, Stream stream) {
  using namespace kda2;
  const Ptrs w = ptrs_of(l, workspace);
  auto s = static_cast<cudaStream_t>(stream);
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem("kda2_wy_kernel", kda2_wy_kernel, kSmem));
  if (chunks > 0 && p.H > 0) ENCORE_RETURN_IF_ERROR(launch("kda2_wy_kernel", [&] { kda2_wy_kernel<<<dim3(chunks, p.H), kThreads, kSmem, s>>>(p, w); }));
  if (p.dA_log || p.ddt_bias) ENCORE_RETURN_IF_ERROR(kdabwd::launch_gate_reduce_parts(p, w.gp, 2 * kD, 0, kD, chunks, s));
  const int64_t n = int64_t(p.B) * p.T * (p.H / p.group) * p.K;
  if (p.group > 1 && n > 0)
    ENCORE_RETURN_IF_ERROR(launch("kda2_group_reduce_kernel",
                                  [&] { kda2_group_reduce_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(p, w.dqi, w.dki); }));
  return Status::ok();
}

}  // namespace encore::cuda
