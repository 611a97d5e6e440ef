// The one-hot router logits of moe_forward_ep's received rows (src/moe/ep_comm.cpp): logits [rows, E_l]
// fp32, 1 at the row's local expert and 0 elsewhere, the rows grouped in (source rank, local expert)
// blocks b = s * E_l + e holding rows [starts[b], starts[b + 1]). One thread per element; the block of a
// row by binary search over the starts (device memory, at most 8 x 512 + 1, staged in shared memory).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "moe/cuda/launch.hpp"

namespace encore::cuda {
namespace {

constexpr int kMaxBlocks = 8 * 512 + 1;

__global__ void ep_one_hot_kernel(float* __restrict__ logits, const long long* __restrict__ starts, int nstarts, int El, long long rows) {
  __shared__ long long s[kMaxBlocks];
  for (int i = threadIdx.x; i < nstarts; i += blockDim.x) s[i] = starts[i];
  __syncthreads();
  const long long total = rows * El;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / El;
    int lo = 0, hi = nstarts - 1;  // the last b with s[b] <= r: s[lo] <= r < s[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (s[mid] <= r) lo = mid;
      else hi = mid;
    }
    logits[i] = (int(i % El) == lo % El) ? 1.0f : 0.0f;
  }
}

}  // namespace

Status launch_ep_one_hot_logits(float* logits, const int64_t* starts, int nstarts, int El, int64_t rows, int device_index, Stream stream) {
  if (nstarts < 2 || nstarts > kMaxBlocks || El < 1)
    return Status::internal("ep one-hot logits: " + std::to_string(nstarts) + " block starts (2 to 4097 expected)");
  DeviceGuard guard;  // was a bare cudaSetDevice that left the caller's device changed
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  if (rows <= 0) return Status::ok();
  const long long total = rows * El;
  const int blocks = int(std::min<long long>((total + 255) / 256, 1024));
  return launch("ep one-hot logits", [&] {
    ep_one_hot_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(logits, reinterpret_cast<const long long*>(starts), nstarts, El, rows);
  });
}

}  // namespace encore::cuda
