// The small kernels of KDA context parallelism (kda_cp_fill.hpp): identity and transpose of [HV, K, K]
// fp32 per-head matrices, and the merge of n summaries
//   X = 0;  X = M_i·X + S_i  (i = 0..n-1),  S_i [HV, K, V], M_i [HV, K, K], fp32 contiguous.
// The merge: one block of 256 threads per (head, 32 value columns); X's column block [K, 32] lives in
// shared memory (K <= 128: 16 KB), each step reads M_i's rows from global memory (L2-resident: n is the
// number of ranks). The summaries are small (HV·K·(K + V) floats per rank): this is not a hot path.
#include <cuda_runtime.h>

#include <string>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "kda/cuda/kda_cp_fill.hpp"

namespace encore::cuda {
namespace {

constexpr int kMergeCols = 32, kMergeThreads = 256, kMaxK = 128;

__global__ void identity_kernel(float* X, int64_t total, int K) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t e = i % (int64_t(K) * K);
  X[i] = (e / K == e % K) ? 1.f : 0.f;
}

__global__ void transpose_kernel(const float* __restrict__ src, float* __restrict__ dst, int64_t total, int K) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t KK = int64_t(K) * K, h = i / KK, e = i % KK, a = e / K, b = e % K;
  dst[h * KK + b * K + a] = src[i];
}

__global__ void merge_kernel(const float* __restrict__ S, const float* __restrict__ M, float* __restrict__ out, int n, int HV, int K,
                             int V) {
  __shared__ float X[kMaxK][kMergeCols], Y[kMaxK][kMergeCols];
  const int h = blockIdx.x, c0 = blockIdx.y * kMergeCols, cols = min(kMergeCols, V - c0);
  for (int e = threadIdx.x; e < K * kMergeCols; e += blockDim.x) X[e / kMergeCols][e % kMergeCols] = 0.f;
  __syncthreads();
  for (int j = 0; j < n; ++j) {
    const float* Mj = M + (int64_t(j) * HV + h) * K * K;
    const float* Sj = S + (int64_t(j) * HV + h) * K * V;
    for (int e = threadIdx.x; e < K * kMergeCols; e += blockDim.x) {
      const int a = e / kMergeCols, c = e % kMergeCols;
      if (c >= cols) continue;
      float acc = Sj[int64_t(a) * V + c0 + c];
      for (int b = 0; b < K; ++b) acc = fmaf(Mj[int64_t(a) * K + b], X[b][c], acc);
      Y[a][c] = acc;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < K * kMergeCols; e += blockDim.x) X[e / kMergeCols][e % kMergeCols] = Y[e / kMergeCols][e % kMergeCols];
    __syncthreads();
  }
  for (int e = threadIdx.x; e < K * kMergeCols; e += blockDim.x) {
    const int a = e / kMergeCols, c = e % kMergeCols;
    if (c < cols) out[(int64_t(h) * K + a) * V + c0 + c] = X[a][c];
  }
}

unsigned blocks_for(int64_t total) { return unsigned((total + 255) / 256); }

}  // namespace

Status kda_cp_zero(void* p, size_t bytes, int device, Stream stream) {
  if (bytes == 0) return Status::ok();
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device));
  ENCORE_RETURN_IF_ERROR(launch_gate("kda cp zero fill"));  // the seam, as before a kernel
  return call_result("kda cp zero fill", "cudaMemsetAsync", cudaMemsetAsync(p, 0, bytes, static_cast<cudaStream_t>(stream)));
}

Status kda_cp_identity(float* X, int64_t HV, int64_t K, int device, Stream stream) {
  const int64_t total = HV * K * K;
  if (total == 0) return Status::ok();
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device));
  return launch("kda cp identity fill", [&] { identity_kernel<<<blocks_for(total), 256, 0, static_cast<cudaStream_t>(stream)>>>(X, total, int(K)); });
}

Status kda_cp_transpose(const float* src, float* dst, int64_t HV, int64_t K, int device, Stream stream) {
  const int64_t total = HV * K * K;
  if (total == 0) return Status::ok();
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device));
  return launch("kda cp transpose",
                [&] { transpose_kernel<<<blocks_for(total), 256, 0, static_cast<cudaStream_t>(stream)>>>(src, dst, total, int(K)); });
}

Status kda_cp_merge(const float* S, const float* M, float* out, int64_t n, int64_t HV, int64_t K, int64_t V, int device, Stream stream) {
  if (K > kMaxK) return Status::unsupported("kda cp merge: the CUDA merge takes K <= " + std::to_string(kMaxK) + ", got " + std::to_string(K));
  if (HV * K * V == 0) return Status::ok();
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device));
  const dim3 grid(unsigned(HV), unsigned((V + kMergeCols - 1) / kMergeCols));
  return launch("kda cp merge",
                [&] { merge_kernel<<<grid, kMergeThreads, 0, static_cast<cudaStream_t>(stream)>>>(S, M, out, int(n), int(HV), int(K), int(V)); });
}

}  // namespace encore::cuda
