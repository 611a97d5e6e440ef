// KDA backward, kernel 3b-1 (docs/math/kda.md §6 stages 3-4, the GEMM-shaped terms of kernel 3b), grid
// (chunk slots, H), 256 threads (8 warps), chunk-parallel after kernel 3a (dh). With S the chunk-start
// state [K][V], dS' the record's dh [K][V], dO, v [64][V] (inputs), Vn, dVn [64][V] (record), A the
// residual Akk (lower triangle incl. the diagonal, valid rows only), KE = k 2^G (k L2-normed when
// asked; Kbeta = beta KE):
//   P1 = dO S^T      -> record Qg-slot "w"  [64][K]   (kernel 3b: dQ~ = P1 . 2^G)
//   P2 = Vn dS'^T    -> record "acc"        [64][K]   (kernel 3b: dK  = P2 . 2^(gC - G))
//   sd[a] = rowsum_y(S . dS')               -> record "sd" [K]
//   dW = -dVn S^T    (registers, then shared)
//   dVbeta = A^T dVn -> dv = beta dVbeta (output);  record "dbv"[j] = rowsum_y(dVbeta . v)
//   dA' = dVn v^T + dW KE^T  -> record "da"  [64][64]  (unmasked; kernel 3b: dA = tril(dA') beta_j)
//   dKb' = A^T dW            -> record "dw"  [64][K]   (kernel 3b: dKbeta = dKb' as its loop's s)
// Every product on bf16 tensor cores (mma.sync m16n8k16) with both operands split into bf16 hi + lo
// (hi·hi + hi·lo + lo·hi, ~2^-16 relative: near fp32), from fp32 shared tiles zero-padded to 128
// (K, V <= 128, any sizes). Warp w owns rows 16 (w % 4) .. + 16 and columns 64 (w / 4) .. + 64 of
// each [64][128] product (32 of a [64][64] one). Row sums: within a warp by shuffles, across the two
// column halves in a fixed order (deterministic). 203 KB shared.
#include "kda/cuda/kda_bwd_mma.cuh"

namespace encore::cuda::kdabwd {
namespace {

using ::encore::cuda::kda::store_pair;

constexpr int kThreads = 256;
constexpr size_t kSmem = (2 * kMaxD * kLd + 2 * kC * kLd + 3 * kC) * sizeof(float);

__global__ void __launch_bounds__(kThreads, 1) kda_bwd_inter_kernel(const __grid_constant__ KdaBwdCudaProblem p, float* ws) {
  extern __shared__ float smem[];
  float* sS = smem;                // [128][kLd] S
  float* sX = sS + kMaxD * kLd;    // [128][kLd] dS'; then A [64][kLdA]
  float* sP = sX + kMaxD * kLd;    // [64][kLd] dO; then dVn
  float* sR = sP + kC * kLd;       // [64][kLd] Vn; then v
  float* sPart = sR + kC * kLd;    // [2][64] row-sum halves
  float* sBeta = sPart + 2 * kC;   // [64]
  const int slot = blockIdx.x, h = blockIdx.y, K = p.K, V = p.V, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int m0 = 16 * (warp & 3), nh = warp >> 2, n0 = 64 * nh;
  const ChunkInfo ci = chunk_info(p, slot);
  const int rows = ci.rows, b = ci.b, t0 = ci.t0;
  float* rec = ws_rec(ws, p, slot, h);

  // Phase 1 operands: S, dS' (rows a < K, columns y < V; zero to 128), dO, Vn (rows < `rows`).
  const float* cre = rec;
  // S: the saved h or the rematerialized copy in the record (chosen once).
  const void* s_base = p.h ? p.h : static_cast<const void*>(cre + p.ws.hs);
  const DType s_dtype = p.h ? p.h_dtype : DType::kFP32;
  const int64_t s_off = p.h ? (int64_t(slot) * p.H + h) * p.K * p.V : 0;
  stage<32, kThreads>(
      kMaxD * kMaxD, [&](int e) { const int a = e >> 7, y = e & 127; return load_any_or0(s_base, s_dtype, s_off + a * V + y, a < K && y < V); },
      [&](int e, float x) { sS[(e >> 7) * kLd + (e & 127)] = x; });
  stage<32, kThreads>(
      kMaxD * kMaxD, [&](int e) { const int a = e >> 7, y = e & 127; return ldg_or0(cre + p.ws.dh, a * V + y, a < K && y < V); },
      [&](int e, float x) { sX[(e >> 7) * kLd + (e & 127)] = x; });
  stage<32, kThreads>(
      kC * kMaxD, [&](int e) { const int i = e >> 7, y = e & 127; return load_or0(p.d_o, b, t0 + i, h, y, i < rows && y < V); },
      [&](int e, float x) { sP[(e >> 7) * kLd + (e & 127)] = x; });
  stage<32, kThreads>(
      kC * kMaxD, [&](int e) { const int i = e >> 7, y = e & 127; return ldg_or0(cre + p.ws.vn, i * V + y, i < rows && y < V); },
      [&](int e, float x) { sR[(e >> 7) * kLd + (e & 127)] = x; });
  __syncthreads();
  {
    float c[8][4];
    zero(c);
    warp_gemm<8, true, true>(c, sP + m0 * kLd, kLd, sS + n0 * kLd, kLd, kMaxD / 16);  // dO S^T
    store_acc(c, rec + p.ws.w, K, m0, n0, K, 1.0f);
    zero(c);
    warp_gemm<8, true, true>(c, sR + m0 * kLd, kLd, sX + n0 * kLd, kLd, kMaxD / 16);  // Vn dS'^T
    store_acc(c, rec + p.ws.acc, K, m0, n0, K, 1.0f);
  }
  for (int a = warp; a < K; a += kThreads / 32) {  // sd[a] = sum_y S . dS' (fixed shuffle order)
    float s = 0.f;
    for (int y = lane; y < kMaxD; y += 32) s += sS[a * kLd + y] * sX[a * kLd + y];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) rec[p.ws.sd + a] = s;
  }
  __syncthreads();

  // Phase 2 operands: dVn, v, A (S stays).
  stage<32, kThreads>(
      kC * kMaxD, [&](int e) { const int i = e >> 7, y = e & 127; return ldg_or0(cre + p.ws.dvn, i * V + y, i < rows && y < V); },
      [&](int e, float x) { sP[(e >> 7) * kLd + (e & 127)] = x; });
  stage<32, kThreads>(
      kC * kMaxD, [&](int e) { const int i = e >> 7, y = e & 127; return load_or0(p.v, b, t0 + i, h, y, i < rows && y < V); },
      [&](int e, float x) { sR[(e >> 7) * kLd + (e & 127)] = x; });
  stage<16, kThreads>(
      kC * kC,
      [&](int e) {
        const int i = e >> 6, j = e & 63;
        return load_any_or0(p.Akk, p.akk_dtype, tok(p, b, t0 + i, h) * kC + j, i < rows && j <= i);
      },
      [&](int e, float x) { sX[(e >> 6) * kLdA + (e & 63)] = x; });
  if (tid < kC) sBeta[tid] = tid < rows ? load(p.beta, b, t0 + tid, h, 0) : 0.f;
  __syncthreads();
  float cw[8][4];  // dVn S^T = -dW, kept to phase 3 (columns >= K are 0: S rows there are 0)
  zero(cw);
  warp_gemm<8, true, true>(cw, sP + m0 * kLd, kLd, sS + n0 * kLd, kLd, kMaxD / 16);
  {
    float c[8][4];
    zero(c);
    warp_gemm<8, false, false>(c, sX + m0, kLdA, sP + n0, kLd, kC / 16);  // dVbeta = A^T dVn (rows j)
    float part[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int j = m0 + g + 8 * r, y = n0 + 8 * n + 2 * t;
        const float x0 = c[n][2 * r], x1 = c[n][2 * r + 1];
        part[r] += x0 * sR[j * kLd + y] + x1 * sR[j * kLd + y + 1];
        if (j < rows && y < V) {
          const float bj = sBeta[j];
          store_pair(p.dv.data, p.dv.dtype, int64_t(b) * p.dv.sb + int64_t(t0 + j) * p.dv.st + int64_t(h) * p.dv.sh + y, bj * x0,
                     bj * x1, V - y);
        }
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      part[r] += __shfl_xor_sync(0xffffffffu, part[r], 1);
      part[r] += __shfl_xor_sync(0xffffffffu, part[r], 2);
      if (t == 0) sPart[nh * kC + m0 + g + 8 * r] = part[r];
    }
  }
  __syncthreads();
  if (tid < kC) rec[p.ws.dbv + tid] = sPart[tid] + sPart[kC + tid];

  // Phase 3 (S is done): KE into sS rows 0..63, dW into rows 64..127; dVn, v, A stay.
  float* sKE = sS;
  float* sDW = sS + kC * kLd;
  store_acc(cw, sDW, kLd, m0, n0, kMaxD, -1.0f);
  load_rows_batched<kThreads>(p.k, b, t0, rows, h / p.group, K, p.l2norm, 1.0f, sKE, kLd, true, nullptr);
  __syncthreads();
  stage<32, kThreads>(  // KE = k 2^G (zero rows and pad columns stay zero)
      kC * kMaxD,
      [&](int e) { const int i = e >> 7, c = e & 127; return ldg_or0(p.G, tok(p, b, t0 + i, h) * K + c, i < rows && c < K); },
      [&](int e, float g) { sKE[(e >> 7) * kLd + (e & 127)] *= exp2f(g); });
  __syncthreads();
  {
    float c[4][4];  // dA' = dVn v^T + dW KE^T
    zero(c);
    warp_gemm<4, true, true>(c, sP + m0 * kLd, kLd, sR + 32 * nh * kLd, kLd, kMaxD / 16);
    warp_gemm<4, true, true>(c, sDW + m0 * kLd, kLd, sKE + 32 * nh * kLd, kLd, kMaxD / 16);
    store_acc(c, rec + p.ws.da, kC, m0, 32 * nh, kC, 1.0f);
  }
  {
    float c[8][4];  // dKb' = A^T dW (rows j)
    zero(c);
    warp_gemm<8, false, false>(c, sX + m0, kLdA, sDW + n0, kLd, kC / 16);
    store_acc(c, rec + p.ws.dw, K, m0, n0, K, 1.0f);
  }
}

}  // namespace

Status launch_inter(const KdaBwdCudaProblem& p, float* ws, int slots, cudaStream_t s) {
  constexpr const char* what = "kda backward: gradient kernel (kda_bwd_inter_kernel)";
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kda_bwd_inter_kernel, kSmem));
  return launch(what, [&] { kda_bwd_inter_kernel<<<dim3(slots, p.H), kThreads, kSmem, s>>>(p, ws); });
}

}  // namespace encore::cuda::kdabwd
