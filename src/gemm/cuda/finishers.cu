// Finishers of the GEMM-epilogue family: the small per-row kernels after a partials epilogue.
//   rms_final_reduce  r[m] = rsqrt(Σ_t partials[m, t] / hidden + eps)
//   lse_finish        lse[m] = log Σ_t e^{partials[m, t]};  loss[m] = lse[m] − target_logit[m]
//                     (0 when target[m] == ignore_index)
//   partials_sum      out[m] = scale · Σ_t partials[m, t] (per row: zdz) or out[n] = scale · Σ_t partials[t, n]
//                     (per column: dγ; consecutive threads read consecutive columns)
//   cross_entropy_bwd dlogits[m, n] = α·(e^(logits[m, n] − lse[m]) − [n == target[m]]), 0 on ignore_index rows,
//                     NaN on rows whose target is outside [0, N) (one block per row; 16-byte accesses where aligned)
//   ce_mean           loss = Σ_{counted} loss_rows / n, alpha = d_loss / n (n rows with target != ignore_index;
//                     0 when n = 0): one CTA, per-thread strided sums, then a fixed tree over shared memory
// One thread per output, tiles summed in order (deterministic); partials fp32, row stride ld.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "common/cuda/fast_math.cuh"
#include "common/cuda/launch_check.hpp"
#include "gemm/cuda/launch.hpp"

namespace encore::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void rms_final_reduce_kernel(const float* __restrict__ partials, int64_t ld, int M, int tiles, float* __restrict__ r,
                                        float inv_hidden, float eps) {
  const int64_t m = int64_t(blockIdx.x) * kThreads + threadIdx.x;  // 64-bit: M may be close to 2^31
  if (m >= M) return;
  const float* row = partials + int64_t(m) * ld;
  float s = 0.0f;
  for (int t = 0; t < tiles; ++t) s += row[t];
  r[m] = rsqrtf(s * inv_hidden + eps);
}

__global__ void lse_finish_kernel(const float* __restrict__ partials, int64_t ld, int M, int tiles, float* __restrict__ lse,
                                  const int32_t* __restrict__ target, const float* __restrict__ target_logit, float* __restrict__ loss,
                                  int ignore_index) {
  const int64_t m = int64_t(blockIdx.x) * kThreads + threadIdx.x;  // 64-bit: M may be close to 2^31
  if (m >= M) return;
  const float* row = partials + int64_t(m) * ld;
  float mx = -INFINITY;
  bool nan = false;  // a NaN tile (NaN logits) makes the row NaN: fmaxf alone would skip it
  for (int t = 0; t < tiles; ++t) {
    mx = fmaxf(mx, row[t]);
    nan = nan || isnan(row[t]);
  }
  float s = 0.0f;
  if (mx != -INFINITY)
    for (int t = 0; t < tiles; ++t) s += expf(row[t] - mx);
  const float l = nan ? NAN : mx == -INFINITY ? -INFINITY : mx + logf(s);
  lse[m] = l;
  if (target != nullptr) loss[m] = target[m] == ignore_index ? 0.0f : l - target_logit[m];
}

__global__ void partials_sum_kernel(const float* __restrict__ partials, int64_t ld, int rows, int cols, float* __restrict__ out, int n_out,
                                    bool per_column, float scale) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;  // 64-bit: n_out may be close to 2^31
  if (i >= n_out) return;
  float s = 0.0f;
  if (per_column)
    for (int t = 0; t < rows; ++t) s += partials[int64_t(t) * ld + i];
  else
    for (int t = 0; t < cols; ++t) s += partials[i * ld + t];
  out[i] = scale * s;
}

// One block per row (grid-strided over rows). kVec elements per access where the row pointers and
// N allow 16-byte accesses, else one. In place allowed: no __restrict__ on logits / dlogits, and
// each element is read before it is written by the same thread.
template <class T>
__global__ void cross_entropy_bwd_kernel(const T* logits, int64_t ld, T* dlogits, int64_t ld_out, int M, int N, const float* __restrict__ lse,
                                         const int32_t* __restrict__ target, const float* __restrict__ alpha, int ignore_index, bool vec) {
  constexpr int kVec = 16 / int(sizeof(T));
  const float a = alpha != nullptr ? __ldg(alpha) : 1.0f;
  // 64-bit row and column counters: m + gridDim.x and n + blockDim.x * kVec may pass 2^31 for M, N < 2^31.
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const int t = target[m];
    const T* in = logits + m * ld;
    T* out = dlogits + m * ld_out;
    // ignore_index: e^(x − inf) = 0 and no one-hot; a target outside [0, N): NaN for the whole row
    const float l2 = t == ignore_index ? INFINITY : (t < 0 || t >= N) ? NAN : lse[m] * kLog2e;
    // (an ignored row is selected to 0: exact even for a non-finite logit)
    const bool ignored = t == ignore_index;
    auto grad = [&](float x, int64_t n) { return ignored ? 0.0f : a * (fast_exp2(fmaf(x, kLog2e, -l2)) - (n == t ? 1.0f : 0.0f)); };
    if (vec) {
      for (int64_t n = int64_t(threadIdx.x) * kVec; n < N; n += int64_t(blockDim.x) * kVec) {
        uint4 raw = *reinterpret_cast<const uint4*>(in + n);
        T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int i = 0; i < kVec; ++i) v[i] = T(grad(float(v[i]), n + i));
        *reinterpret_cast<uint4*>(out + n) = raw;
      }
    } else {
      for (int64_t n = threadIdx.x; n < N; n += blockDim.x) out[n] = T(grad(float(in[n]), n));
    }
  }
}

__global__ void ce_mean_kernel(const int32_t* __restrict__ target, int M, const float* __restrict__ loss_rows, float* __restrict__ loss,
                               const float* __restrict__ d_loss, float* __restrict__ alpha, int ignore_index) {
  __shared__ float s_sum[kThreads];
  __shared__ int s_cnt[kThreads];
  float sum = 0.0f;
  int cnt = 0;
  for (int64_t m = threadIdx.x; m < M; m += kThreads)  // 64-bit: m + kThreads passes 2^31 - 1 for M close to 2^31
    if (target[m] != ignore_index) {
      ++cnt;
      if (loss_rows != nullptr) sum += loss_rows[m];
    }
  s_sum[threadIdx.x] = sum;
  s_cnt[threadIdx.x] = cnt;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (int(threadIdx.x) < w) {
      s_sum[threadIdx.x] += s_sum[threadIdx.x + w];
      s_cnt[threadIdx.x] += s_cnt[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  const int n = s_cnt[0];
  if (loss != nullptr) *loss = n > 0 ? s_sum[0] / float(n) : 0.0f;
  if (alpha != nullptr) *alpha = n > 0 ? *d_loss / float(n) : 0.0f;
}

}  // namespace

Status launch_rms_final_reduce(const float* partials, int64_t ld, int M, int tiles, float* r, int64_t hidden, float eps, Stream stream) {
  if (M == 0) return Status::ok();
  return launch("rms_final_reduce", [&] {
    rms_final_reduce_kernel<<<unsigned((int64_t(M) + kThreads - 1) / kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        partials, ld, M, tiles, r, float(1.0 / double(hidden)), eps);
  });
}

Status launch_partials_sum(const float* partials, int64_t ld, int rows, int cols, float* out, int n_out, bool per_column, float scale,
                           Stream stream) {
  const int n = per_column ? n_out : rows;
  if (n == 0) return Status::ok();
  return launch("partials_sum", [&] {
    partials_sum_kernel<<<unsigned((int64_t(n) + kThreads - 1) / kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(partials, ld, rows, cols, out, n,
                                                                                                            per_column, scale);
  });
}

Status launch_lse_finish(const float* partials, int64_t ld, int M, int tiles, float* lse, const int32_t* target, const float* target_logit,
                         float* loss, int ignore_index, Stream stream) {
  if (M == 0) return Status::ok();
  return launch("lse_finish", [&] {
    lse_finish_kernel<<<unsigned((int64_t(M) + kThreads - 1) / kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        partials, ld, M, tiles, lse, target, target_logit, loss, ignore_index);
  });
}

Status launch_ce_mean(const int32_t* target, int M, const float* loss_rows, float* loss, const float* d_loss, float* alpha, int ignore_index,
                      Stream stream) {
  if (loss == nullptr && alpha == nullptr) return Status::ok();
  return launch("ce_mean", [&] {
    ce_mean_kernel<<<1, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(target, M, loss != nullptr ? loss_rows : nullptr, loss, d_loss,
                                                                         alpha, ignore_index);
  });
}

Status launch_cross_entropy_bwd(const void* logits, int64_t ld, void* dlogits, int64_t ld_out, DType dtype, int M, int N, const float* lse,
                                const int32_t* target, const float* alpha, int ignore_index, Stream stream) {
  if (M == 0 || N == 0) return Status::ok();
  const size_t es = dtype_size(dtype);
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const int64_t vec_elems = int64_t(16 / es);
  const bool vec = aligned(logits) && aligned(dlogits) && N % vec_elems == 0 && (M == 1 || (ld % vec_elems == 0 && ld_out % vec_elems == 0));
  const int blocks = M < 65535 * 8 ? M : 65535 * 8;
  auto s = static_cast<cudaStream_t>(stream);
  ENCORE_RETURN_IF_ERROR(launch_gate("cross_entropy_bwd"));
  switch (dtype) {
    case DType::kBF16:
      cross_entropy_bwd_kernel<__nv_bfloat16><<<blocks, kThreads, 0, s>>>(static_cast<const __nv_bfloat16*>(logits), ld,
                                                                          static_cast<__nv_bfloat16*>(dlogits), ld_out, M, N, lse, target,
                                                                          alpha, ignore_index, vec);
      break;
    case DType::kFP16:
      cross_entropy_bwd_kernel<__half><<<blocks, kThreads, 0, s>>>(static_cast<const __half*>(logits), ld, static_cast<__half*>(dlogits), ld_out,
                                                                   M, N, lse, target, alpha, ignore_index, vec);
      break;
    case DType::kFP32:
      cross_entropy_bwd_kernel<float><<<blocks, kThreads, 0, s>>>(static_cast<const float*>(logits), ld, static_cast<float*>(dlogits), ld_out, M,
                                                                  N, lse, target, alpha, ignore_index, vec);
      break;
    default: return Status::unsupported(std::string("logits: cross_entropy_bwd on CUDA takes bf16, fp16 or fp32, got ") + dtype_name(dtype));
  }
  return launch_status("cross_entropy_bwd");
}

}  // namespace encore::cuda
