// KDA backward, kernel 3a (math-kda.md §6 stage 2, the serial part): the dh recurrence per
// (sequence, head, 32 value columns), grid (N, H, ceil(V / 32)), 256 threads, chunks last to first:
//   dS' = dht[n] (0 without it) at the sequence's last chunk;  per chunk: dh[chunk] = dS' (record)
//   dVnew = Aqk^T dO + Kg dS'  (completes the record's dVn in place)
//   dS = Diag(2^gC) dS' + Qg^T dO - W^T dVnew  -> dS' of the previous chunk; dh0[n] after the first.
// fp32 state in shared memory; sequences without chunks write dh0 = dht (or 0). The chunk-parallel
// rest of the reverse pass (WY, intra-chunk, reverse cumsum, gate and L2-norm tails) reads dh from
// the record: kda_bwd_grads.cu. K, V <= 128; 129 KB shared.
#include "kda/cuda/kda_bwd_device.cuh"

namespace encore::cuda::kdabwd {
namespace {

constexpr int kThreads = 256;
constexpr int kPer = kMaxD * kVs / kThreads;  // state elements per thread
constexpr size_t kSmem = (kMaxD * kVs + 3 * kTile + 2 * kC * kVs + kMaxD) * sizeof(float);

__global__ void __launch_bounds__(kThreads) kda_bwd_dh_kernel(const __grid_constant__ KdaBwdCudaProblem p, float* ws) {
  extern __shared__ float smem[];
  float* sdS = smem;              // [K][32]
  float* sQg = sdS + kMaxD * kVs; // [64][K]
  float* sKg = sQg + kTile;
  float* sW = sKg + kTile;
  float* sdO = sW + kTile;        // [64][32]
  float* sdV = sdO + kC * kVs;    // [64][32]
  float* sGc = sdV + kC * kVs;
  const int n = blockIdx.x, h = blockIdx.y, K = p.K, V = p.V, tid = threadIdx.x;
  const int y0 = blockIdx.z * kVs, nc = min(kVs, V - y0);
  const int b = p.varlen ? 0 : n;
  const int64_t s0 = (int64_t(n) * p.H + h) * K * V;
  for (int e = tid; e < K * kVs; e += blockDim.x) {
    const int a = e / kVs, y = e - a * kVs;
    sdS[e] = (y < nc && p.dht) ? p.dht[s0 + a * V + y0 + y] : 0.f;
  }
  __syncthreads();
  const int first = p.chunk_start[n], last = p.chunk_start[n + 1];
  for (int slot = last - 1; slot >= first; --slot) {
    float* rec = ws_rec(ws, p, slot, h);
    const int t0 = p.seq_begin[n] + (slot - first) * kC, rows = min(kC, p.seq_end[n] - t0);
    for (int e = tid; e < K * nc; e += blockDim.x) {
      const int a = e / nc, y = e - a * nc;
      rec[p.ws.dh + a * V + y0 + y] = sdS[a * kVs + y];
    }
    for (int e = tid; e < kC * K; e += blockDim.x) {
      sQg[e] = rec[p.ws.qg + e];
      sKg[e] = rec[p.ws.kg + e];
      sW[e] = rec[p.ws.w + e];
    }
    for (int e = tid; e < kC * kVs; e += blockDim.x) {
      const int i = e / kVs, y = e - i * kVs;
      sdO[e] = (i < rows && y < nc) ? load(p.d_o, b, t0 + i, h, y0 + y) : 0.f;
    }
    if (tid < K) sGc[tid] = rec[p.ws.gc + tid];
    __syncthreads();
    for (int e = tid; e < kC * kVs; e += blockDim.x) {  // dVnew += Kg dS'
      const int i = e / kVs, y = e - i * kVs;
      float s = 0.f;
      if (y < nc) {
        s = rec[p.ws.dvn + i * V + y0 + y];
        for (int a = 0; a < K; ++a) s += sKg[i * K + a] * sdS[a * kVs + y];
        rec[p.ws.dvn + i * V + y0 + y] = s;
      }
      sdV[e] = s;
    }
    __syncthreads();
    float next[kPer];
#pragma unroll
    for (int r = 0; r < kPer; ++r) {  // dS = Diag(2^gC) dS' + Qg^T dO - W^T dVnew
      const int e = tid + r * kThreads, a = e / kVs, y = e - a * kVs;
      float s = 0.f;
      if (a < K) {
        s = exp2f(sGc[a]) * sdS[e];
        for (int i = 0; i < rows; ++i) s += sQg[i * K + a] * sdO[i * kVs + y] - sW[i * K + a] * sdV[i * kVs + y];
      }
      next[r] = s;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kPer; ++r) {
      const int e = tid + r * kThreads;
      if (e < K * kVs) sdS[e] = next[r];
    }
    __syncthreads();
  }
  if (p.dh0)
    for (int e = tid; e < K * nc; e += blockDim.x) {
      const int a = e / nc, y = e - a * nc;
      p.dh0[s0 + a * V + y0 + y] = sdS[a * kVs + y];
    }
}

}  // namespace

cudaError_t launch_dh(const KdaBwdCudaProblem& p, float* ws, cudaStream_t s) {
  cudaError_t e = cudaFuncSetAttribute(kda_bwd_dh_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem));
  if (e != cudaSuccess) return e;
  kda_bwd_dh_kernel<<<dim3(p.N, p.H, (p.V + kVs - 1) / kVs), kThreads, kSmem, s>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace encore::cuda::kdabwd
