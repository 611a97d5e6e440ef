// KDA backward, kernel 1 (docs/math/kda.md §6 stage 0): the recompute from the forward's residuals,
// into the record (fp32; rows past the chunk's valid rows zero).
// kda_bwd_prep_tc_kernel, grid (chunk slots, H), 256 threads, chunk-parallel: from q, k (L2-normed
//   when asked), v, beta, the residual G (log2 cumsum) and A = Akk = (I + L)^-1:
//     Qg = s q . 2^G    Kg = k . 2^(gC - G)    Kbeta = beta k . 2^G    W = A Kbeta    U = A (beta v)
//   with gC = G at the last valid row; W [64x64]x[64xK] and U [64x64]x[64xV] on tensor cores (split
//   bf16 operands from zero-padded fp32 tiles; warp w: rows 16 (w % 4) .., columns 64 (w / 4) ..).
//   150 KB shared.
// kda_bwd_states_tc_kernel, grid (slots or sequences, H, ceil(V / 64)), 256 threads: Vnew = U - W S
//   per 64 value columns (W staged from the record into shared memory, S [K][64] fp32 in shared
//   memory). Saved-h mode: S = the residual h of the chunk, one chunk per block. Rematerialize mode:
//   one block walks its sequence's chunks in order from the initial state (or 0), writes each
//   chunk-start state into the record (hs) and advances S <- Diag(2^gC) S + Kg^T Vnew (Kg staged;
//   fp32 state, products on tensor cores, each state element updated by its owner). 87 KB shared.
// K, V <= 128.
#include "kda/cuda/kda_bwd_mma.cuh"

namespace encore::cuda::kdabwd {
namespace {

constexpr int kThreads = 256;
constexpr size_t kPrepSmem = (2 * kTile + 2 * kC * kLd + kC * kLdA + kC + kMaxD + kC) * sizeof(float);

__global__ void __launch_bounds__(kThreads) kda_bwd_prep_tc_kernel(const __grid_constant__ KdaBwdCudaProblem p, float* ws) {
  extern __shared__ float smem[];
  float* sX = smem;              // [64][K] q~, then k (normalized)
  float* sG = sX + kTile;        // [64][K] G
  float* sKb = sG + kTile;       // [64][kLd] beta k 2^G (zero-padded)
  float* sV = sKb + kC * kLd;    // [64][kLd] beta v
  float* sA = sV + kC * kLd;     // [64][kLdA] A (lower, diagonal included)
  float* sBeta = sA + kC * kLdA;
  float* sGc = sBeta + kC;
  float* sR = sGc + kMaxD;
  const int slot = blockIdx.x, h = blockIdx.y, K = p.K, V = p.V, tid = threadIdx.x;
  const int warp = tid >> 5, m0 = 16 * (warp & 3), n0 = 64 * (warp >> 2);
  const ChunkInfo ci = chunk_info(p, slot);
  const int rows = ci.rows;
  float* rec = ws_rec(ws, p, slot, h);
  if (tid < kC) sBeta[tid] = tid < rows ? load(p.beta, ci.b, ci.t0 + tid, h, 0) : 0.f;
  stage<32, kThreads>(
      kC * K, [&](int e) { const int i = e / K; return ldg_or0(p.G, tok(p, ci.b, ci.t0 + i, h) * K + (e - i * K), i < rows); },
      [&](int e, float x) { sG[e] = x; });
  stage<16, kThreads>(
      kC * kC,
      [&](int e) {
        const int i = e >> 6, j = e & 63;
        return load_any_or0(p.Akk, p.akk_dtype, tok(p, ci.b, ci.t0 + i, h) * kC + j, i < rows && j <= i);
      },
      [&](int e, float x) { sA[(e >> 6) * kLdA + (e & 63)] = x; });
  load_rows_batched<kThreads>(p.q, ci.b, ci.t0, rows, h / p.group, K, p.l2norm, p.scale, sX, K, false, sR);  // the group's head
  __syncthreads();
  stage<32, kThreads>(  // beta v (needs sBeta)
      kC * kMaxD, [&](int e) { const int i = e >> 7, y = e & 127; return load_or0(p.v, ci.b, ci.t0 + i, h, y, i < rows && y < V); },
      [&](int e, float x) { sV[(e >> 7) * kLd + (e & 127)] = sBeta[e >> 7] * x; });
  if (tid < K) {
    sGc[tid] = sG[(rows - 1) * K + tid];
    rec[p.ws.gc + tid] = sGc[tid];
  }
  for (int e = tid; e < kC * K; e += kThreads) rec[p.ws.qg + e] = sX[e] * exp2f(sG[e]);  // zero rows stay zero
  __syncthreads();
  load_rows_batched<kThreads>(p.k, ci.b, ci.t0, rows, h / p.group, K, p.l2norm, 1.0f, sX, K, false, sR);
  __syncthreads();
  for (int e = tid; e < kC * kMaxD; e += kThreads) {
    const int i = e / kMaxD, a = e - i * kMaxD;
    const bool ok = i < rows && a < K;
    const float x = ok ? sX[i * K + a] : 0.f, g = ok ? sG[i * K + a] : 0.f;
    if (a < K) rec[p.ws.kg + i * K + a] = ok ? x * exp2f(sGc[a] - g) : 0.f;
    sKb[i * kLd + a] = ok ? sBeta[i] * x * exp2f(g) : 0.f;
  }
  __syncthreads();
  {
    float c[8][4];  // W = A Kbeta
    zero(c);
    warp_gemm<8, true, false>(c, sA + m0 * kLdA, kLdA, sKb + n0, kLd, kC / 16);
    store_acc(c, rec + p.ws.w, K, m0, n0, K, 1.0f);
    zero(c);  // U = A (beta v)
    warp_gemm<8, true, false>(c, sA + m0 * kLdA, kLdA, sV + n0, kLd, kC / 16);
    store_acc(c, rec + p.ws.vn, V, m0, n0, V, 1.0f);
  }
}

constexpr int kCols = 64;        // value columns per state block
static_assert(kCols == 64 && kMaxD == 128, "the staged loads index by shifts");
constexpr int kLdS = kCols + 4;  // fp32 row stride of its [*][64] tiles
constexpr size_t kStateSmem = (kMaxD * kLdS + kC * kLdS + kMaxD + size_t(kC) * kLd) * sizeof(float);

// W and Kg staged in one shared [64][kLd] tile with every load in flight (stage_record_tile) before the
// products that read them.
__global__ void __launch_bounds__(kThreads) kda_bwd_states_tc_kernel(const __grid_constant__ KdaBwdCudaProblem p, float* ws) {
  extern __shared__ float smem[];
  float* sS = smem;                 // [128][kLdS] state columns (rows >= K, columns >= nc zero)
  float* sVn = sS + kMaxD * kLdS;   // [64][kLdS] Vnew columns
  float* sGc = sVn + kC * kLdS;     // [128]
  float* sX = sGc + kMaxD;          // [64][kLd] W, then Kg
  const int h = blockIdx.y, K = p.K, V = p.V, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int y0 = blockIdx.z * kCols, nc = min(kCols, V - y0);
  const bool remat = p.h == nullptr;
  const int ksteps = (K + 15) / 16;
  int first, last;
  if (remat) {
    const int n = blockIdx.x;
    first = p.chunk_start[n];
    last = p.chunk_start[n + 1];
    const float* h0 = p.h0 ? p.h0 : ws;  // a valid address for ldg_or0's dropped loads
    stage<32, kThreads>(
        kMaxD * kCols,
        [&](int e) { const int a = e >> 6, y = e & 63; return ldg_or0(h0, p.state_v_first ? ((int64_t(n) * p.H + h) * V + y0 + y) * K + a : ((int64_t(n) * p.H + h) * K + a) * V + y0 + y,
                        a < K && y < nc && p.h0); },
        [&](int e, float x) { sS[(e >> 6) * kLdS + (e & 63)] = x; });
  } else {
    first = blockIdx.x;
    last = first + 1;
    stage<32, kThreads>(
        kMaxD * kCols,
        [&](int e) {
          const int a = e >> 6, y = e & 63;
          return load_any_or0(p.h, p.h_dtype, ((int64_t(first) * p.H + h) * K + a) * V + y0 + y, a < K && y < nc);
        },
        [&](int e, float x) { sS[(e >> 6) * kLdS + (e & 63)] = x; });
  }
  __syncthreads();
  for (int slot = first; slot < last; ++slot) {
    float* rec = ws_rec(ws, p, slot, h);
    if (tid < K) sGc[tid] = rec[p.ws.gc + tid];
    if (remat)
      for (int e = tid; e < K * kCols; e += kThreads) {
        const int a = e / kCols, y = e - a * kCols;
        if (y < nc) rec[p.ws.hs + a * V + y0 + y] = sS[a * kLdS + y];
      }
    stage_record_tile<kThreads>(sX, rec + p.ws.w, K);
    __syncthreads();
    {  // Vnew = U - W S: warp rows 16 (w % 4) .., columns 32 (w / 4) ..; c = W S - U, Vnew = -c
      const int m0 = 16 * (warp & 3), c0 = 32 * (warp >> 2);
      float c[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int i = m0 + g + 8 * (q >> 1), y = c0 + 8 * nt + 2 * t + (q & 1);
          c[nt][q] = y < nc ? -rec[p.ws.vn + i * V + y0 + y] : 0.f;
        }
#pragma unroll 2
      for (int ks = 0; ks < ksteps; ++ks) {
        uint32_t ahi[4], alo[4], bhi[4][2], blo[4][2];
        frag_a<true>(sX + m0 * kLd + 16 * ks, kLd, ahi, alo);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) frag_b<false>(sS + 16 * ks * kLdS + c0 + 8 * nt, kLdS, bhi[nt], blo[nt]);
        mma_split<4>(c, ahi, alo, bhi, blo);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int i = m0 + g + 8 * (q >> 1), y = c0 + 8 * nt + 2 * t + (q & 1);
          if (y < nc) rec[p.ws.vn + i * V + y0 + y] = -c[nt][q];
          sVn[i * kLdS + y] = -c[nt][q];
        }
    }
    __syncthreads();
    const int a0 = 16 * warp;
    // S <- Diag(2^gC) S + Kg^T Vnew: warp rows (channels) a0 .., 64 columns.
    if (remat && slot + 1 < last) {  // uniform over the block
      stage_record_tile<kThreads>(sX, rec + p.ws.kg, K);
      __syncthreads();
      if (a0 < K)
        decayed_state_step(sS, kLdS, sGc, K, a0, [&](float (&c)[8][4], int ks) { state_term(c, sX, a0, ks, sVn, kLdS); });
    }
    __syncthreads();
  }
}

}  // namespace

Status launch_prep_tc(const KdaBwdCudaProblem& p, float* ws, int slots, cudaStream_t s) {
  constexpr const char* what = "kda backward: recompute kernel (kda_bwd_prep_tc_kernel)";
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kda_bwd_prep_tc_kernel, kPrepSmem));
  return launch(what, [&] { kda_bwd_prep_tc_kernel<<<dim3(slots, p.H), kThreads, kPrepSmem, s>>>(p, ws); });
}

Status launch_states_tc(const KdaBwdCudaProblem& p, float* ws, int slots, cudaStream_t s) {
  constexpr const char* what = "kda backward: state kernel (kda_bwd_states_tc_kernel)";
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kda_bwd_states_tc_kernel, kStateSmem));
  const int x = p.h ? slots : p.N;
  return launch(what, [&] { kda_bwd_states_tc_kernel<<<dim3(x, p.H, (p.V + kCols - 1) / kCols), kThreads, kStateSmem, s>>>(p, ws); });
}

}  // namespace encore::cuda::kdabwd
