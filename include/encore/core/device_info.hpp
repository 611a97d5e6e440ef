// encore::DeviceInfo — properties of a CUDA device, queried once per device and cached.
#pragma once
#include <string>

#include "encore/core/status.hpp"

namespace encore {

struct DeviceInfo {
  int index = -1;
  std::string name;
  int sm_count = 0;
  int cc_major = 0;
  int cc_minor = 0;
  size_t smem_per_block_optin = 0;  // bytes, the opt-in limit for dynamic shared memory
  size_t smem_per_sm = 0;
  size_t l2_bytes = 0;
  size_t global_mem_bytes = 0;
  int max_threads_per_sm = 0;
};

// Number of visible CUDA devices; 0 when built without CUDA or when no device/driver is present.
int cuda_device_count();
// Cached properties of device `index`. Fails when built without CUDA or the device is absent.
Status get_device_info(int index, const DeviceInfo** out);
// Whether this build contains the CUDA backend.
bool built_with_cuda();

}  // namespace encore
