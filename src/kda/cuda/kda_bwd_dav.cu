// KDA backward, kernel 2 (math-kda.md §6 stage 1), dAv, grid (chunk slots, H), 256 threads,
// chunk-parallel: from dO, the record's Vnew and the residual Aqk (scale included):
//   dAqk = tril(dO Vnew^T) (diagonal included)  [64][64]     dVnew(intra) = Aqk^T dO  [64][V]
// into the record (fp32; entries outside the valid rows' triangle zero). K, V <= 128; 80 KB shared.
#include "kda/cuda/kda_bwd_device.cuh"

namespace encore::cuda::kdabwd {
namespace {

constexpr int kThreads = 256;
constexpr size_t kSmem = (2 * kTile + kC * kC) * sizeof(float);

__global__ void __launch_bounds__(kThreads) kda_bwd_dav_kernel(const __grid_constant__ KdaBwdCudaProblem p, float* ws) {
  extern __shared__ float smem[];
  float* sdO = smem;          // [64][V]
  float* sVn = sdO + kTile;   // [64][V]
  float* sAqk = sVn + kTile;  // [64][64]
  const int slot = blockIdx.x, h = blockIdx.y, V = p.V, tid = threadIdx.x;
  const ChunkInfo ci = chunk_info(p, slot);
  const int rows = ci.rows;
  float* rec = ws_rec(ws, p, slot, h);
  for (int e = tid; e < kC * V; e += blockDim.x) {
    const int i = e / V, y = e - i * V;
    sdO[e] = i < rows ? load(p.d_o, ci.b, ci.t0 + i, h, y) : 0.f;
    sVn[e] = rec[p.ws.vn + e];
  }
  for (int e = tid; e < kC * kC; e += blockDim.x) {
    const int i = e / kC, j = e - i * kC;
    sAqk[e] = (i < rows && j <= i) ? load_any(p.Aqk, p.aqk_dtype, tok(p, ci.b, ci.t0 + i, h) * kC + j) : 0.f;
  }
  __syncthreads();
  for (int e = tid; e < kC * kC; e += blockDim.x) {  // dAqk = tril(dO Vnew^T)
    const int i = e / kC, j = e - i * kC;
    float s = 0.f;
    if (i < rows && j <= i)
      for (int y = 0; y < V; ++y) s += sdO[i * V + y] * sVn[j * V + y];
    rec[p.ws.daqk + e] = s;
  }
  for (int e = tid; e < kC * V; e += blockDim.x) {  // dVnew = Aqk^T dO
    const int j = e / V, y = e - j * V;
    float s = 0.f;
    for (int i = j; i < rows; ++i) s += sAqk[i * kC + j] * sdO[i * V + y];
    rec[p.ws.dvn + e] = s;
  }
}

}  // namespace

cudaError_t launch_dav(const KdaBwdCudaProblem& p, float* ws, int slots, cudaStream_t s) {
  cudaError_t e = cudaFuncSetAttribute(kda_bwd_dav_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem));
  if (e != cudaSuccess) return e;
  kda_bwd_dav_kernel<<<dim3(slots, p.H), kThreads, kSmem, s>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace encore::cuda::kdabwd
