// KDA backward, kernel 3b (docs/math/kda.md §6 stages 3-5 and the tails), grid (chunk slots, H), 512
// threads, chunk-parallel once kernel 3a has left each chunk's dh = dS' in the record. With S the
// chunk-start state, Q~ = s q, q and k L2-normed when asked, E_ij = 2^(G_i - G_j) per channel:
//   inter:  dQ~ = (dO S^T) . 2^G    dK = (Vnew dS'^T) . 2^(gC - G)    dW = -dVnew S^T
//           dG += Q~ . dQ~ - K . dK;  last row: dG += 2^gC . rowsum_V(S . dS') + sum_rows K . dK
//   WY:     dA = dVnew (beta v)^T + dW Kbeta^T (i >= j);  dVbeta = A^T dVnew -> dv = beta dVbeta,
//           dbeta += rowsum(dVbeta . v);  dKbeta = A^T dW -> dk += beta 2^G dKbeta,
//           dbeta += rowsum(dKbeta . k 2^G), dG += Kbeta . dKbeta;  dL = -StrictTril(A^T dA A^T)
//   intra:  dQ~_i += sum_{j<=i} dAqk_ij K_j E_ij;  dKrow_i = sum_{j<i} dL_ij K_j E_ij;
//           dKcol_j = sum_{i>=j} (dAqk_ij Q~_i + dL_ij beta_i K_i) E_ij;  dk += beta dKrow + dKcol,
//           dbeta += K . dKrow, dG += Q~ . dQ~(intra) + K . (beta dKrow - dKcol)
//   tails:  dg = the chunk-local reverse cumsum of dG (fp32, one thread per channel), then the
//           in-kernel gate backward (per-chunk partials of dA_log, ddt_bias into the record, summed
//           by kda_backward.cu's reduction: deterministic); dq = s dQ~ and dk through the L2-norm
//           backward dx = rstd (dy - y (dy . y)). With grouped value heads (group > 1) dq, dk
//           here are per value head, into fp32 partials that kda_backward.cu sums per q/k head.
// Each thread owns (row, channel) elements e = tid + 512 r of the [64][K] tiles; their dq, dk, dG and
// dbeta accumulators live in the record (the Qg, Kg, W areas, consumed by kernel 3a, and acc),
// read and written by their owner only;
// row and column sums go through shared tiles in a fixed order. K, V <= 128; 210 KB shared.
// This is the SIMT fp32 version (ENCORE_KDA_BWD_SIMT=1); the default is kernels 3b-1 + 3b in
// kda_bwd_inter.cu and kda_bwd_grads_tc.cu (tensor cores; the same math and outputs).
#include "kda/cuda/kda_bwd_device.cuh"

namespace encore::cuda::kdabwd {
namespace {

constexpr int kThreads = 512;
constexpr int kSmall = 64 * 6 + 128 * 2;
constexpr size_t kSmem = (6 * kTile + kC * kC + kSmall) * sizeof(float);

__global__ void __launch_bounds__(kThreads, 1) kda_bwd_grads_kernel(const __grid_constant__ KdaBwdCudaProblem p, float* ws) {
  extern __shared__ float smem[];
  float* sG = smem;          // [64][K] G; then k-side L2-norm products
  float* sQ = sG + kTile;    // Q~
  float* sK = sQ + kTile;    // K
  float* sW = sK + kTile;    // dW; then dG
  float* sT = sW + kTile;    // scratch: K.dK(inter), dVbeta.v, M = A^T dA, dbeta parts
  float* sA = sT + kTile;    // [64][64] A
  float* sD = sA + kC * kC;  // [64][64] dAqk  (sA, sD: one [64][128] tile for the q-side products)
  float* sM = sD + kC * kC;  // [64][64] dA, then dL
  float* sBeta = sM + kC * kC;
  float* sRq = sBeta + kC;
  float* sRk = sRq + kC;
  float* sDb = sRk + kC;
  float* sDotq = sDb + kC;
  float* sDotk = sDotq + kC;
  float* sGc = sDotk + kC;
  float* sExtra = sGc + kMaxD;
  const int slot = blockIdx.x, h = blockIdx.y, K = p.K, V = p.V, tid = threadIdx.x;
  const ChunkInfo ci = chunk_info(p, slot);
  const int rows = ci.rows, b = ci.b, t0 = ci.t0;
  const float* rec = ws_rec(ws, p, slot, h);
  float* prec = ws_rec(ws, p, slot, h);
  const float* Vn = rec + p.ws.vn;
  const float* dVn = rec + p.ws.dvn;
  const float* dSp = rec + p.ws.dh;

  // Loads.
  load_rows(p.q, b, t0, rows, h / p.group, K, p.l2norm, p.scale, sQ, sRq);  // q, k: the group's head
  load_rows(p.k, b, t0, rows, h / p.group, K, p.l2norm, 1.0f, sK, sRk);
  for (int e = tid; e < kC * K; e += blockDim.x) {
    const int i = e / K, a = e - i * K;
    sG[e] = i < rows ? p.G[tok(p, b, t0 + i, h) * K + a] : 0.f;
  }
  for (int e = tid; e < kC * kC; e += blockDim.x) {
    const int i = e / kC, j = e - i * kC;
    sA[e] = (i < rows && j <= i) ? load_any(p.Akk, p.akk_dtype, tok(p, b, t0 + i, h) * kC + j) : 0.f;
    sD[e] = rec[p.ws.daqk + e];
  }
  if (tid < kC) sBeta[tid] = tid < rows ? load(p.beta, b, t0 + tid, h, 0) : 0.f;
  if (tid < K) sGc[tid] = rec[p.ws.gc + tid];
  __syncthreads();

  // Inter-chunk terms.
  float* acc_dq = prec + p.ws.w;
  float* acc_dk = prec + p.ws.acc;
  float* acc_dG = prec + p.ws.qg;  // [64][K], owner-only read-modify-write
  float* acc_db = prec + p.ws.kg;
  for (int e = tid; e < kC * K; e += kThreads) {
    const int i = e / K, a = e - i * K;
    if (e >= kC * K) continue;
    acc_dq[e] = acc_dk[e] = acc_dG[e] = acc_db[e] = 0.f;
    float kdk = 0.f, dw = 0.f;
    if (i < rows) {
      float so = 0.f, sv = 0.f, sw = 0.f;
      for (int y = 0; y < V; ++y) {
        const float s = state_at(p, rec, slot, h, a, y), ds = dSp[a * V + y];
        so += load(p.d_o, b, t0 + i, h, y) * s;
        sv += Vn[i * V + y] * ds;
        sw += dVn[i * V + y] * s;
      }
      const float dqt = so * exp2f(sG[e]), dki = sv * exp2f(sGc[a] - sG[e]);
      acc_dq[e] = dqt;
      acc_dk[e] = dki;
      acc_dG[e] = sQ[e] * dqt - sK[e] * dki;
      kdk = sK[e] * dki;
      dw = -sw;
    }
    sT[e] = kdk;
    sW[e] = dw;
  }
  __syncthreads();
  if (tid < K) {  // the gC terms, added to every row by the reverse cumsum
    float sd = 0.f, kdk = 0.f;
    for (int y = 0; y < V; ++y) sd += state_at(p, rec, slot, h, tid, y) * dSp[tid * V + y];
    for (int i = 0; i < rows; ++i) kdk += sT[i * K + tid];
    sExtra[tid] = exp2f(sGc[tid]) * sd + kdk;
  }
  __syncthreads();

  // WY: dA (into sM), dVbeta (dv out; dbeta parts into sT), dKbeta (into the accumulators).
  for (int e = tid; e < kC * kC; e += blockDim.x) {
    const int i = e / kC, j = e - i * kC;
    float s = 0.f;
    if (i < rows && j <= i) {
      for (int y = 0; y < V; ++y) s += dVn[i * V + y] * load(p.v, b, t0 + j, h, y);
      for (int a = 0; a < K; ++a) s += sW[i * K + a] * sK[j * K + a] * exp2f(sG[j * K + a]);
      s *= sBeta[j];
    }
    sM[e] = s;
  }
  for (int e = tid; e < kC * V; e += blockDim.x) {
    const int j = e / V, y = e - j * V;
    float part = 0.f;
    if (j < rows) {
      float s = 0.f;
      for (int i = j; i < rows; ++i) s += sA[i * kC + j] * dVn[i * V + y];
      store_out(p.dv, b, t0 + j, h, y, sBeta[j] * s);
      part = s * load(p.v, b, t0 + j, h, y);
    }
    sT[e] = part;
  }
  for (int e = tid; e < kC * K; e += kThreads) {
    const int j = e / K, a = e - j * K;
    if (e >= kC * K || j >= rows) continue;
    float s = 0.f;
    for (int i = j; i < rows; ++i) s += sA[i * kC + j] * sW[i * K + a];
    const float eg = exp2f(sG[e]);
    acc_dk[e] += sBeta[j] * eg * s;
    acc_db[e] += s * sK[e] * eg;
    acc_dG[e] += sBeta[j] * sK[e] * eg * s;
  }
  __syncthreads();
  if (tid < kC) {
    float s = 0.f;
    for (int y = 0; y < V; ++y) s += sT[tid * V + y];
    sDb[tid] = s;
  }
  __syncthreads();
  for (int e = tid; e < kC * kC; e += blockDim.x) {  // M = A^T dA
    const int i = e / kC, j = e - i * kC;
    float s = 0.f;
    if (i < rows && j < rows)
      for (int m = max(i, j); m < rows; ++m) s += sA[m * kC + i] * sM[m * kC + j];
    sT[e] = s;
  }
  __syncthreads();
  for (int e = tid; e < kC * kC; e += blockDim.x) {  // dL = -StrictTril(M A^T)
    const int i = e / kC, j = e - i * kC;
    float s = 0.f;
    if (i < rows && j < i)
      for (int m = 0; m <= j; ++m) s -= sT[i * kC + m] * sA[j * kC + m];
    sM[e] = s;
  }
  __syncthreads();

  // Intra-chunk terms through Aqk and L.
  for (int e = tid; e < kC * K; e += kThreads) {
    const int i = e / K, a = e - i * K;
    if (e >= kC * K || i >= rows) continue;
    const float gi = sG[e];
    float dqi = 0.f, dkr = 0.f, dkc = 0.f;
    for (int j = 0; j <= i; ++j) {
      const float kx = sK[j * K + a] * exp2f(gi - sG[j * K + a]);
      dqi += sD[i * kC + j] * kx;
      dkr += sM[i * kC + j] * kx;  // dL_ii = 0
    }
    for (int m = i; m < rows; ++m)
      dkc += (sD[m * kC + i] * sQ[m * K + a] + sM[m * kC + i] * sBeta[m] * sK[m * K + a]) * exp2f(sG[m * K + a] - gi);
    acc_dq[e] += dqi;
    acc_dk[e] += sBeta[i] * dkr + dkc;
    acc_db[e] += sK[e] * dkr;
    acc_dG[e] += sQ[e] * dqi + sK[e] * (sBeta[i] * dkr - dkc);
  }
  __syncthreads();
  // Row sums (dbeta, the L2-norm dots) and the column cumsum (dg) through shared tiles.
  const float inv_scale = 1.0f / p.scale;
  for (int e = tid; e < kC * K; e += kThreads) {
    if (e >= kC * K) continue;
    sT[e] = acc_db[e];
    sW[e] = acc_dG[e];
    sA[e] = p.scale * acc_dq[e] * sQ[e] * inv_scale;  // dqn . qn (sA, sD: one [64][128] tile)
    sG[e] = acc_dk[e] * sK[e];                         // dkn . kn
  }
  __syncthreads();
  if (tid < kC) {
    float db = sDb[tid], dq = 0.f, dk = 0.f;
    for (int a = 0; a < K; ++a) {
      db += sT[tid * K + a];
      dq += sA[tid * K + a];
      dk += sG[tid * K + a];
    }
    sDotq[tid] = dq;
    sDotk[tid] = dk;
    if (tid < rows) store_out(p.dbeta, b, t0 + tid, h, 0, db);
  } else if (tid >= kC && tid < kC + K) {  // channel a: reverse cumsum of dG, then the gate backward
    const int a = tid - kC;
    const float ea = (p.gate_in_kernel && p.A_log) ? expf(p.A_log[h]) : 1.0f;
    const float bias = (p.gate_in_kernel && p.dt_bias) ? p.dt_bias[h * K + a] : 0.f;
    float acc = 0.f, pdt = 0.f, pda = 0.f;
    for (int i = rows - 1; i >= 0; --i) {
      acc += sW[i * K + a];
      const float dy = acc + sExtra[a];
      float dx = dy;
      if (p.gate_in_kernel) {
        const float x = load(p.g, b, t0 + i, h, a) + bias;
        if (p.lower_bound_gate) {
          const float sg = 1.0f / (1.0f + expf(-ea * x));
          dx = dy * p.lower_bound * sg * (1.0f - sg) * ea;
          pda += dx * x;
        } else {
          const float sp = x > 20.f ? x : log1pf(expf(x)), sg = x > 20.f ? 1.0f : 1.0f / (1.0f + expf(-x));
          dx = dy * (-ea) * sg;
          pda += dy * (-ea * sp);
        }
        pdt += dx;
      }
      store_out(p.dg, b, t0 + i, h, a, dx);
    }
    prec[p.ws.pdt + a] = pdt;
    prec[p.ws.pda + a] = pda;
  }
  __syncthreads();
  for (int e = tid; e < kC * K; e += kThreads) {
    const int i = e / K, a = e - i * K;
    if (e >= kC * K || i >= rows) continue;
    const float dqn = p.scale * acc_dq[e], dkn = acc_dk[e];
    float dq = dqn, dk = dkn;
    if (p.l2norm) {
      dq = sRq[i] * (dqn - sQ[e] * inv_scale * sDotq[i]);
      dk = sRk[i] * (dkn - sK[e] * sDotk[i]);
    }
    store_out(p.dq, b, t0 + i, h, a, dq);  // with grouped heads: per-value-head partials (kda_backward.cu)
    store_out(p.dk, b, t0 + i, h, a, dk);
  }
}

}  // namespace

Status launch_grads(const KdaBwdCudaProblem& p, float* ws, int slots, bool simt, cudaStream_t s) {
  if (!simt) {
    ENCORE_RETURN_IF_ERROR(launch_inter(p, ws, slots, s));
    return launch_grads_tc(p, ws, slots, s);
  }
  constexpr const char* what = "kda backward: gradient kernel (kda_bwd_grads_kernel)";
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kda_bwd_grads_kernel, kSmem));
  return launch(what, [&] { kda_bwd_grads_kernel<<<dim3(slots, p.H), kThreads, kSmem, s>>>(p, ws); });
}

}  // namespace encore::cuda::kdabwd
