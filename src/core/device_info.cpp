// Device queries. Compiled with the CUDA runtime only when ENCORE_WITH_CUDA is defined.
#include "encore/core/device_info.hpp"

#include <memory>
#include <mutex>
#include <vector>

#ifdef ENCORE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace encore {

bool built_with_cuda() {
#ifdef ENCORE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef ENCORE_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver/device" error
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

Status get_device_info(int index, const DeviceInfo** out) {
#ifdef ENCORE_WITH_CUDA
  static std::mutex mu;
  static std::vector<std::unique_ptr<DeviceInfo>> cache;
  std::lock_guard<std::mutex> lock(mu);
  int n = cuda_device_count();
  if (index < 0 || index >= n)
    return Status::invalid("device index " + std::to_string(index) + " out of range: " +
                           std::to_string(n) + " CUDA device(s) visible");
  if (cache.size() < size_t(n)) cache.resize(n);
  if (!cache[index]) {
    cudaDeviceProp p{};
    cudaError_t e = cudaGetDeviceProperties(&p, index);
    if (e != cudaSuccess) return Status::cuda_error(std::string("cudaGetDeviceProperties: ") + cudaGetErrorString(e));
    auto info = std::make_unique<DeviceInfo>();
    info->index = index;
    info->name = p.name;
    info->sm_count = p.multiProcessorCount;
    info->cc_major = p.major;
    info->cc_minor = p.minor;
    info->smem_per_block_optin = p.sharedMemPerBlockOptin;
    info->smem_per_sm = p.sharedMemPerMultiprocessor;
    info->l2_bytes = p.l2CacheSize;
    info->global_mem_bytes = p.totalGlobalMem;
    info->max_threads_per_sm = p.maxThreadsPerMultiProcessor;
    cache[index] = std::move(info);
  }
  *out = cache[index].get();
  return Status::ok();
#else
  (void)index;
  *out = nullptr;
  return Status::unsupported("encore was built without CUDA (ENCORE_CUDA=OFF)");
#endif
}

}  // namespace encore
