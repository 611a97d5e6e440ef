// KDA backward, kernel 3b (docs/math/kda.md §6 stages 3-5 and the tails), grid (chunk slots, H), 512
// threads, after kernel 3b-1 (kda_bwd_inter.cu) has left the GEMM-shaped products in the record:
// P1 = dO S^T, P2 = Vn dS'^T [64][K], dA' = dVn v^T + dW KE^T [64][64], dKb' = A^T dW [64][K],
// dbv = rowsum(A^T dVn . v) [64], sd = rowsum(S . dS') [K] (dv written there).
// With Q~ = s q, K (L2-normed when asked), E_ij = 2^(G_i - G_j) per channel:
//   inter:  dQ~ = P1 . 2^G    dK = P2 . 2^(gC - G)    dG = Q~ . dQ~ - K . dK
//           last row: dG += 2^gC . sd + sum_rows K . dK (added to every row by the reverse cumsum)
//   WY:     dA = tril(dA') beta_j;  dk += beta 2^G dKb', dbeta += dKb' . K 2^G, dG += beta K 2^G dKb';
//           dbeta += dbv;  dL = -StrictTril(A^T dA A^T)  (fp32 loops over shared [64][64] tiles)
//   intra:  dQ~_i += sum_{j<=i} dAqk_ij K_j E_ij, dKrow_i = sum_{j<i} dL_ij K_j E_ij,
//           dKcol_j = sum_{i>=j} (dAqk_ij Q~_i + dL_ij beta_i K_i) E_ij, by kda_bwd_intra.cuh's factored form
//           (a thread per channel and 16-row sub-block; every exp2 factor <= 1)
//   tails:  dg = the chunk-local reverse cumsum of dG (one thread per channel, shared memory only), the
//           gate backward elementwise by all threads with per-chunk partials of dA_log, ddt_bias summed
//           per channel in row order; dq = s dQ~, dk through the L2-norm backward (with grouped value
//           heads per value head, into fp32 partials that kda_backward.cu sums per q/k head).
// Thread (channel a, sub-block I) owns the 16 elements (16 I + u, a): one fused pass gathers every term
// of each in registers and leaves dQ~, dK, the dbeta and dG parts in the record (over P1, P2, Qg, Kg:
// owner only), reading dAqk and dL by rows and, through transposed copies, by columns 16 at a time.
// Deterministic (fixed orders). K, V <= 128; 210 KB shared.
#include "kda/cuda/kda_bwd_intra.cuh"
#include "kda/cuda/kda_bwd_mma.cuh"

namespace encore::cuda::kdabwd {
namespace {

constexpr int kThreads = 512;
constexpr int kSmall = 64 * 6 + 128 * 2;
constexpr size_t kSmem = (6 * kTile + kC * kC + kSmall) * sizeof(float);

__global__ void __launch_bounds__(kThreads, 1) kda_bwd_grads_tc_kernel(const __grid_constant__ KdaBwdCudaProblem p, float* ws) {
  extern __shared__ float smem[];
  float* sG = smem;          // [64][K] G; then dk . k
  float* sQ = sG + kTile;    // Q~
  float* sK = sQ + kTile;    // K
  float* sW = sK + kTile;    // dG, then dy (the reverse cumsum)
  float* sT = sW + kTile;    // K . dK(inter); M = A^T dA; dbeta parts; then the ddt_bias parts
  float* sA = sT + kTile;    // [64][64] A
  float* sD = sA + kC * kC;  // [64][64] dAqk  (sA, sD: one [64][128] tile for dq . q, then the dA_log parts)
  float* sM = sD + kC * kC;  // [64][64] dA, then dL
  float* sBeta = sM + kC * kC;
  float* sRq = sBeta + kC;
  float* sRk = sRq + kC;
  float* sDb = sRk + kC;
  float* sDotq = sDb + kC;
  float* sDotk = sDotq + kC;
  float* sGc = sDotk + kC;
  float* sExtra = sGc + kMaxD;
  float* sMt = sW;            // dL^T, dAqk^T [64][64] each during the fused pass (sW is free then)
  float* sDt = sW + kC * kC;
  const int slot = blockIdx.x, h = blockIdx.y, K = p.K, tid = threadIdx.x;
  const ChunkInfo ci = chunk_info(p, slot);
  const int rows = ci.rows, b = ci.b, t0 = ci.t0;
  float* rec = ws_rec(ws, p, slot, h);
  float* dQt = rec + p.ws.w;          // P1, then dQ~ (owner-only overwrite)
  float* dKt = rec + p.ws.acc;        // P2, then dK
  const float* dKb = rec + p.ws.dw;   // A^T dW
  float* dbR = rec + p.ws.qg;         // the fused pass's dbeta and dG parts (the record's Qg, Kg areas are
  float* dGR = rec + p.ws.kg;         // done with: kernel 3a was their last reader)

  const float* cre = rec;
  load_rows_batched<kThreads>(p.q, b, t0, rows, h / p.group, K, p.l2norm, p.scale, sQ, K, false, sRq);  // the group's head
  load_rows_batched<kThreads>(p.k, b, t0, rows, h / p.group, K, p.l2norm, 1.0f, sK, K, false, sRk);
  stage<16, kThreads>(
      kC * K, [&](int e) { const int i = e / K; return ldg_or0(p.G, tok(p, b, t0 + i, h) * K + (e - i * K), i < rows); },
      [&](int e, float x) { sG[e] = x; });
  stage<8, kThreads>(
      kC * kC,
      [&](int e) {
        const int i = e >> 6, j = e & 63;
        return load_any_or0(p.Akk, p.akk_dtype, tok(p, b, t0 + i, h) * kC + j, i < rows && j <= i);
      },
      [&](int e, float x) { sA[e] = x; });
  stage<8, kThreads>(kC * kC, [&](int e) { return ldg_or0(cre + p.ws.daqk, e, true); }, [&](int e, float x) { sD[e] = x; });
  if (tid < kC) {
    sBeta[tid] = tid < rows ? load(p.beta, b, t0 + tid, h, 0) : 0.f;
    sDb[tid] = rec[p.ws.dbv + tid];
  }
  if (tid < K) sGc[tid] = rec[p.ws.gc + tid];
  __syncthreads();

  // K . dK(inter) for the gC term's column sums; dA = tril(dA') beta_j.
  stage<16, kThreads>(
      kC * K, [&](int e) { return ld_or0(dKt, e, e / K < rows); },
      [&](int e, float p2) { sT[e] = e / K < rows ? sK[e] * (p2 * exp2f(sGc[e % K] - sG[e])) : 0.f; });
  stage<8, kThreads>(
      kC * kC, [&](int e) { const int i = e >> 6, j = e & 63; return ldg_or0(cre + p.ws.da, e, i < rows && j <= i); },
      [&](int e, float x) { sM[e] = x * sBeta[e & 63]; });
  __syncthreads();
  if (tid < K) {
    float kdk = 0.f;
    for (int i = 0; i < rows; ++i) kdk += sT[i * K + tid];
    sExtra[tid] = exp2f(sGc[tid]) * rec[p.ws.sd + tid] + kdk;
  }
  __syncthreads();
  for (int e = tid; e < kC * kC; e += kThreads) {  // M = A^T dA
    const int i = e / kC, j = e - i * kC;
    float s = 0.f;
    if (i < rows && j < rows)
      for (int m = max(i, j); m < rows; ++m) s += sA[m * kC + i] * sM[m * kC + j];
    sT[e] = s;
  }
  __syncthreads();
  for (int e = tid; e < kC * kC; e += kThreads) {  // dL = -StrictTril(M A^T)
    const int i = e / kC, j = e - i * kC;
    float s = 0.f;
    if (i < rows && j < i)
      for (int m = 0; m <= j; ++m) s -= sT[i * kC + m] * sA[j * kC + m];
    sM[e] = s;
    sMt[j * kC + i] = s;      // the transposes, for the column walks of the fused pass
    sDt[j * kC + i] = sD[e];
  }
  __syncthreads();

  // The fused pass: inter, WY (dKbeta) and intra terms of each owned (row, channel); `finish` combines
  // an element's record values p1 = P1, p2 = P2, kb = dKb' with its intra sums.
  auto finish = [&](int e, int i, int a, float p1, float p2, float kb, float dqi, float dkr, float dkc) {
    const float gi = sG[e], eg = exp2f(gi), ke = sK[e] * eg, bi = sBeta[i];
    const float dqt = p1 * eg, dki = p2 * exp2f(sGc[a] - gi);
    dQt[e] = dqt + dqi;
    dKt[e] = dki + bi * eg * kb + (bi * dkr + dkc);
    dbR[e] = kb * ke + sK[e] * dkr;  // to the record (owner only; sT, sW are busy)
    dGR[e] = (sQ[e] * dqt - sK[e] * dki) + bi * ke * kb + (sQ[e] * dqi + sK[e] * (bi * dkr - dkc));
  };
  {
    static_assert(kThreads == 4 * kMaxD, "a thread per channel and 16-row sub-block");
    const int a = tid % kMaxD, I = tid / kMaxD;
    const IntraTiles tiles{sG, sK, sQ, sD, sM, sDt, sMt, sBeta, K, rows};
    float dqi[16], dkr[16], dkc[16];
    if (a < K) {
      intra_factored(tiles, I, a, dqi, dkr, dkc);
#pragma unroll
      for (int u = 0; u < 16; ++u) {
        const int i = 16 * I + u, e = i * K + a;
        const float p1 = ld_or0(dQt, e, i < rows), p2 = ld_or0(dKt, e, i < rows), kb = ld_or0(dKb, e, i < rows);
        if (i < rows) finish(e, i, a, p1, p2, kb, dqi[u], dkr[u], dkc[u]);
      }
    }
  }
  __syncthreads();
  stage<16, kThreads>(
      kC * K, [&](int e) { return ld_or0(dbR, e, e / K < rows); }, [&](int e, float x) { sT[e] = x; });
  stage<16, kThreads>(
      kC * K, [&](int e) { return ld_or0(dGR, e, e / K < rows); }, [&](int e, float x) { sW[e] = x; });
  const float inv_scale = 1.0f / p.scale;
  stage<16, kThreads>(  // dqn . qn (sA, sD: one [64][128] tile)
      kC * K, [&](int e) { return ld_or0(dQt, e, e / K < rows); }, [&](int e, float x) { sA[e] = p.scale * x * sQ[e] * inv_scale; });
  stage<16, kThreads>(  // dkn . kn
      kC * K, [&](int e) { return ld_or0(dKt, e, e / K < rows); }, [&](int e, float x) { sG[e] = x * sK[e]; });
  __syncthreads();
  if (tid < kC) {  // row sums: dbeta, the L2-norm dots
    float db = sDb[tid], dq = 0.f, dk = 0.f;
    for (int a = 0; a < K; ++a) {
      db += sT[tid * K + a];
      dq += sA[tid * K + a];
      dk += sG[tid * K + a];
    }
    sDotq[tid] = dq;
    sDotk[tid] = dk;
    if (tid < rows) store_out(p.dbeta, b, t0 + tid, h, 0, db);
  } else if (tid >= kC && tid < kC + K) {  // channel a: dy = the reverse cumsum of dG + the gC terms, in place
    const int a = tid - kC;
    float acc = 0.f;
    for (int i = rows - 1; i >= 0; --i) {
      acc += sW[i * K + a];
      sW[i * K + a] = acc + sExtra[a];
    }
  }
  __syncthreads();
  const float ea = (p.gate_in_kernel && p.A_log) ? expf(p.A_log[h]) : 1.0f;
  constexpr int kU = 8;  // elements per batch of loads
  for (int base = tid; base < kC * K; base += kU * kThreads) {  // the gate backward, dq, dk
    float xg[kU], vq[kU], vk[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int e = base + u * kThreads, i = e / K;
      const bool in = e < kC * K && i < rows;
      xg[u] = (in && p.gate_in_kernel) ? load(p.g, b, t0 + i, h, e - i * K) : 0.f;
      vq[u] = in ? dQt[e] : 0.f;
      vk[u] = in ? dKt[e] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int e = base + u * kThreads, i = e / K, a = e - i * K;
      if (e >= kC * K) continue;
      float pdt = 0.f, pda = 0.f;
      if (i < rows) {
        const float dy = sW[e];
        float dx = dy;
        if (p.gate_in_kernel) {
          const float bias = p.dt_bias ? p.dt_bias[h * K + a] : 0.f;
          const float x = xg[u] + bias;
          if (p.lower_bound_gate) {
            const float sg = 1.0f / (1.0f + expf(-ea * x));
            dx = dy * p.lower_bound * sg * (1.0f - sg) * ea;
            pda = dx * x;
          } else {
            const float sp = x > 20.f ? x : log1pf(expf(x)), sg = x > 20.f ? 1.0f : 1.0f / (1.0f + expf(-x));
            dx = dy * (-ea) * sg;
            pda = dy * (-ea * sp);
          }
          pdt = dx;
        }
        store_out(p.dg, b, t0 + i, h, a, dx);
        const float dqn = p.scale * vq[u], dkn = vk[u];
        float dq = dqn, dk = dkn;
        if (p.l2norm) {
          dq = sRq[i] * (dqn - sQ[e] * inv_scale * sDotq[i]);
          dk = sRk[i] * (dkn - sK[e] * sDotk[i]);
        }
        store_out(p.dq, b, t0 + i, h, a, dq);  // with grouped heads: per-value-head partials (kda_backward.cu)
        store_out(p.dk, b, t0 + i, h, a, dk);
      }
      sT[e] = pdt;
      sA[e] = pda;
    }
  }
  __syncthreads();
  if (tid < K) {  // per-chunk gate partials, rows in order
    float pdt = 0.f, pda = 0.f;
    for (int i = 0; i < rows; ++i) {
      pdt += sT[i * K + tid];
      pda += sA[i * K + tid];
    }
    rec[p.ws.pdt + tid] = pdt;
    rec[p.ws.pda + tid] = pda;
  }
}

}  // namespace

Status launch_grads_tc(const KdaBwdCudaProblem& p, float* ws, int slots, cudaStream_t s) {
  constexpr const char* what = "kda backward: gradient kernel (kda_bwd_grads_tc_kernel)";
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kda_bwd_grads_tc_kernel, kSmem));
  return launch(what, [&] { kda_bwd_grads_tc_kernel<<<dim3(slots, p.H), kThreads, kSmem, s>>>(p, ws); });
}

}  // namespace encore::cuda::kdabwd
