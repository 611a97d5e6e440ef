// KDA backward, kernel 1 (docs/math/kda.md §6 stage 0): the recompute from the forward's residuals.
//
// kda_bwd_prep_kernel, grid (chunk slots, H), 256 threads, chunk-parallel: from q, k (L2-normed when
//   asked), v, beta, the residual G (log2 cumsum) and A = Akk = (I + L)^-1:
//     Qg = s q . 2^G    Kg = k . 2^(gC - G)    Kbeta = beta k . 2^G    W = A Kbeta    U = A (beta v)
//   into the record (fp32; rows past the chunk's valid rows zero), with gC = G at the last valid row.
// kda_bwd_states_kernel, grid (slots or sequences, H, ceil(V / 32)), 256 threads: Vnew = U - W S per
//   32 value columns. Saved-h mode: S = the residual h of the chunk, one chunk per block. Rematerialize
//   mode: one block walks its sequence's chunks in order from the initial state (or 0), writes each
//   chunk-start state into the record (hs) and advances S <- Diag(2^gC) S + Kg^T Vnew (fp32).
// Shapes: K, V <= 128; shared memory 148 KB (prep), 97 KB (states).
// These are the SIMT fp32 versions (ENCORE_KDA_BWD_SIMT=1); the default: kda_bwd_recompute_tc.cu.
#include "kda/cuda/kda_bwd_device.cuh"

namespace encore::cuda::kdabwd {
namespace {

constexpr int kPrepThreads = 256;
constexpr size_t kPrepSmem = (4 * kTile + kC * kC + kC + kMaxD + kC) * sizeof(float);

__global__ void __launch_bounds__(kPrepThreads) kda_bwd_prep_kernel(const __grid_constant__ KdaBwdCudaProblem p, float* ws) {
  extern __shared__ float smem[];
  float* sX = smem;          // q~, then k (normalized)
  float* sG = sX + kTile;    // G
  float* sKb = sG + kTile;   // beta k 2^G
  float* sV = sKb + kTile;   // v
  float* sA = sV + kTile;    // A (lower, diagonal included)
  float* sBeta = sA + kC * kC;
  float* sGc = sBeta + kC;
  float* sR = sGc + kMaxD;
  const int slot = blockIdx.x, h = blockIdx.y, K = p.K, V = p.V, tid = threadIdx.x;
  const ChunkInfo ci = chunk_info(p, slot);
  const int rows = ci.rows;
  float* rec = ws_rec(ws, p, slot, h);
  for (int e = tid; e < kC * K; e += blockDim.x) {
    const int i = e / K, a = e - i * K;
    sG[e] = i < rows ? p.G[tok(p, ci.b, ci.t0 + i, h) * K + a] : 0.f;
  }
  for (int e = tid; e < kC * kC; e += blockDim.x) {
    const int i = e / kC, j = e - i * kC;
    sA[e] = (i < rows && j <= i) ? load_any(p.Akk, p.akk_dtype, tok(p, ci.b, ci.t0 + i, h) * kC + j) : 0.f;
  }
  for (int e = tid; e < kC * V; e += blockDim.x) {
    const int i = e / V, y = e - i * V;
    sV[e] = i < rows ? load(p.v, ci.b, ci.t0 + i, h, y) : 0.f;
  }
  if (tid < kC) sBeta[tid] = tid < rows ? load(p.beta, ci.b, ci.t0 + tid, h, 0) : 0.f;
  load_rows(p.q, ci.b, ci.t0, rows, h / p.group, K, p.l2norm, p.scale, sX, sR);  // q, k: the group's head
  __syncthreads();
  if (tid < K) {
    sGc[tid] = sG[(rows - 1) * K + tid];
    rec[p.ws.gc + tid] = sGc[tid];
  }
  for (int e = tid; e < kC * K; e += blockDim.x) rec[p.ws.qg + e] = sX[e] * exp2f(sG[e]);  // zero rows stay zero
  __syncthreads();
  load_rows(p.k, ci.b, ci.t0, rows, h / p.group, K, p.l2norm, 1.0f, sX, sR);
  __syncthreads();
  for (int e = tid; e < kC * K; e += blockDim.x) {
    const int i = e / K, a = e - i * K;
    const bool ok = i < rows;
    rec[p.ws.kg + e] = ok ? sX[e] * exp2f(sGc[a] - sG[e]) : 0.f;
    sKb[e] = ok ? sBeta[i] * sX[e] * exp2f(sG[e]) : 0.f;
  }
  __syncthreads();
  for (int e = tid; e < kC * K; e += blockDim.x) {  // W = A Kbeta
    const int i = e / K, a = e - i * K;
    float s = 0.f;
    for (int j = 0; j <= i; ++j) s += sA[i * kC + j] * sKb[j * K + a];
    rec[p.ws.w + e] = s;
  }
  for (int e = tid; e < kC * V; e += blockDim.x) {  // U = A (beta v)
    const int i = e / V, y = e - i * V;
    float s = 0.f;
    for (int j = 0; j <= i; ++j) s += sA[i * kC + j] * sBeta[j] * sV[j * V + y];
    rec[p.ws.vn + e] = s;
  }
}

constexpr int kStateThreads = 256;
constexpr size_t kStateSmem = (kMaxD * kVs + 2 * kTile + kC * kVs + kMaxD) * sizeof(float);

__global__ void __launch_bounds__(kStateThreads) kda_bwd_states_kernel(const __grid_constant__ KdaBwdCudaProblem p, float* ws) {
  extern __shared__ float smem[];
  float* sS = smem;               // [K][32] state columns
  float* sW = sS + kMaxD * kVs;   // [64][K]
  float* sKg = sW + kTile;        // [64][K]
  float* sVn = sKg + kTile;       // [64][32]
  float* sGc = sVn + kC * kVs;
  const int h = blockIdx.y, K = p.K, V = p.V, tid = threadIdx.x;
  const int y0 = blockIdx.z * kVs, nc = min(kVs, V - y0);
  const bool remat = p.h == nullptr;
  int first, last;
  if (remat) {
    const int n = blockIdx.x;
    first = p.chunk_start[n];
    last = p.chunk_start[n + 1];
    for (int e = tid; e < K * kVs; e += blockDim.x) {
      const int a = e / kVs, y = e - a * kVs;
      sS[e] = (y < nc && p.h0) ? p.h0[((int64_t(n) * p.H + h) * K + a) * V + y0 + y] : 0.f;
    }
  } else {
    first = blockIdx.x;
    last = first + 1;
    for (int e = tid; e < K * kVs; e += blockDim.x) {
      const int a = e / kVs, y = e - a * kVs;
      sS[e] = y < nc ? load_any(p.h, p.h_dtype, ((int64_t(first) * p.H + h) * K + a) * V + y0 + y) : 0.f;
    }
  }
  __syncthreads();
  for (int slot = first; slot < last; ++slot) {
    float* rec = ws_rec(ws, p, slot, h);
    const int rows = chunk_info(p, slot).rows;
    for (int e = tid; e < kC * K; e += blockDim.x) {
      sW[e] = rec[p.ws.w + e];
      sKg[e] = rec[p.ws.kg + e];
    }
    if (tid < K) sGc[tid] = rec[p.ws.gc + tid];
    if (remat)
      for (int e = tid; e < K * nc; e += blockDim.x) {
        const int a = e / nc, y = e - a * nc;
        rec[p.ws.hs + a * V + y0 + y] = sS[a * kVs + y];
      }
    __syncthreads();
    for (int e = tid; e < kC * nc; e += blockDim.x) {  // Vnew = U - W S
      const int i = e / nc, y = e - i * nc;
      float s = rec[p.ws.vn + i * V + y0 + y];
      for (int a = 0; a < K; ++a) s -= sW[i * K + a] * sS[a * kVs + y];
      rec[p.ws.vn + i * V + y0 + y] = s;
      sVn[i * kVs + y] = s;
    }
    __syncthreads();
    if (remat && slot + 1 < last) {
      for (int e = tid; e < K * nc; e += blockDim.x) {  // S <- Diag(2^gC) S + Kg^T Vnew
        const int a = e / nc, y = e - a * nc;
        float s = exp2f(sGc[a]) * sS[a * kVs + y];
        for (int i = 0; i < rows; ++i) s += sKg[i * K + a] * sVn[i * kVs + y];
        sS[a * kVs + y] = s;
      }
      __syncthreads();
    }
  }
}

}  // namespace

Status launch_prep(const KdaBwdCudaProblem& p, float* ws, int slots, bool simt, cudaStream_t s) {
  if (!simt) return launch_prep_tc(p, ws, slots, s);
  constexpr const char* what = "kda backward: recompute kernel (kda_bwd_prep_kernel)";
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kda_bwd_prep_kernel, kPrepSmem));
  return launch(what, [&] { kda_bwd_prep_kernel<<<dim3(slots, p.H), kPrepThreads, kPrepSmem, s>>>(p, ws); });
}

Status launch_states(const KdaBwdCudaProblem& p, float* ws, int slots, bool simt, cudaStream_t s) {
  if (!simt) return launch_states_tc(p, ws, slots, s);
  constexpr const char* what = "kda backward: state kernel (kda_bwd_states_kernel)";
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kda_bwd_states_kernel, kStateSmem));
  const int x = p.h ? slots : p.N;
  return launch(what, [&] { kda_bwd_states_kernel<<<dim3(x, p.H, (p.V + kVs - 1) / kVs), kStateThreads, kStateSmem, s>>>(p, ws); });
}

}  // namespace encore::cuda::kdabwd
