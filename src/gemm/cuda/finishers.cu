// Finishers of the GEMM-epilogue family: the small per-row kernels after a partials epilogue.
//   rms_final_reduce  r[m] = rsqrt(Σ_t partials[m, t] / hidden + eps)
//   lse_finish        lse[m] = log Σ_t e^{partials[m, t]};  loss[m] = lse[m] − target_logit[m]
//                     (0 when target[m] == ignore_index)
//   partials_sum      out[m] = scale · Σ_t partials[m, t] (per row: zdz) or out[n] = scale · Σ_t partials[t, n]
//                     (per column: dγ; consecutive threads read consecutive columns)
// One thread per output, tiles summed in order (deterministic); partials fp32, row stride ld.
#include <cuda_runtime.h>

#include <cmath>

#include "gemm/cuda/launch.hpp"

namespace encore::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void rms_final_reduce_kernel(const float* __restrict__ partials, int64_t ld, int M, int tiles, float* __restrict__ r,
                                        float inv_hidden, float eps) {
  const int m = blockIdx.x * kThreads + threadIdx.x;
  if (m >= M) return;
  const float* row = partials + int64_t(m) * ld;
  float s = 0.0f;
  for (int t = 0; t < tiles; ++t) s += row[t];
  r[m] = rsqrtf(s * inv_hidden + eps);
}

__global__ void lse_finish_kernel(const float* __restrict__ partials, int64_t ld, int M, int tiles, float* __restrict__ lse,
                                  const int32_t* __restrict__ target, const float* __restrict__ target_logit, float* __restrict__ loss,
                                  int ignore_index) {
  const int m = blockIdx.x * kThreads + threadIdx.x;
  if (m >= M) return;
  const float* row = partials + int64_t(m) * ld;
  float mx = -INFINITY;
  for (int t = 0; t < tiles; ++t) mx = fmaxf(mx, row[t]);
  float s = 0.0f;
  if (mx != -INFINITY)
    for (int t = 0; t < tiles; ++t) s += expf(row[t] - mx);
  const float l = mx == -INFINITY ? -INFINITY : mx + logf(s);
  lse[m] = l;
  if (target != nullptr) loss[m] = target[m] == ignore_index ? 0.0f : l - target_logit[m];
}

__global__ void partials_sum_kernel(const float* __restrict__ partials, int64_t ld, int rows, int cols, float* __restrict__ out, int n_out,
                                    bool per_column, float scale) {
  const int i = blockIdx.x * kThreads + threadIdx.x;
  if (i >= n_out) return;
  float s = 0.0f;
  if (per_column)
    for (int t = 0; t < rows; ++t) s += partials[int64_t(t) * ld + i];
  else
    for (int t = 0; t < cols; ++t) s += partials[int64_t(i) * ld + t];
  out[i] = scale * s;
}

Status launched(const char* name) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status::cuda_error(std::string(name) + ": launch failed: " + cudaGetErrorString(e));
  return Status::ok();
}

}  // namespace

Status launch_rms_final_reduce(const float* partials, int64_t ld, int M, int tiles, float* r, int64_t hidden, float eps, Stream stream) {
  if (M == 0) return Status::ok();
  rms_final_reduce_kernel<<<(M + kThreads - 1) / kThreads, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      partials, ld, M, tiles, r, float(1.0 / double(hidden)), eps);
  return launched("rms_final_reduce");
}

Status launch_partials_sum(const float* partials, int64_t ld, int rows, int cols, float* out, int n_out, bool per_column, float scale,
                           Stream stream) {
  const int n = per_column ? n_out : rows;
  if (n == 0) return Status::ok();
  partials_sum_kernel<<<(n + kThreads - 1) / kThreads, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(partials, ld, rows, cols, out, n,
                                                                                                          per_column, scale);
  return launched("partials_sum");
}

Status launch_lse_finish(const float* partials, int64_t ld, int M, int tiles, float* lse, const int32_t* target, const float* target_logit,
                         float* loss, int ignore_index, Stream stream) {
  if (M == 0) return Status::ok();
  lse_finish_kernel<<<(M + kThreads - 1) / kThreads, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      partials, ld, M, tiles, lse, target, target_logit, loss, ignore_index);
  return launched("lse_finish");
}

}  // namespace encore::cuda
