// The device-memory check (core/device_memory.hpp). Compiled with the CUDA runtime only when
// ENCORE_WITH_CUDA is defined; without it the check is the test seam alone.
#include "core/device_memory.hpp"

#include <algorithm>
#include <cstdio>

#include "core/fault_injection.hpp"
#include "testing/fault_injection.hpp"

#ifdef ENCORE_WITH_CUDA
#include <cuda.h>
#include <cuda_runtime.h>

#include "common/cuda/driver_entry.hpp"
#endif

namespace encore::checks {
namespace {

thread_local VerifiedRanges t_ranges;
thread_local long long t_queries = 0;

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)));
  return buf;
}

#ifdef ENCORE_WITH_CUDA
using PointerGetAttributes = CUresult (*)(unsigned, CUpointer_attribute*, void**, CUdeviceptr);

// What the driver says about p: its kind, owner device and allocation range.
struct Answer {
  MemoryKind kind = MemoryKind::kUnregisteredHost;
  int owner = -1;
  uintptr_t begin = 0, end = 0;
};

// One cuPointerGetAttributes call (a driver query that neither synchronizes nor touches a stream);
// false when the driver cannot answer (no entry point, not initialized yet).
bool driver_answer(const void* p, Answer* out) {
  static const PointerGetAttributes get = cuda::driver_entry<PointerGetAttributes>("cuPointerGetAttributes");
  if (get == nullptr) return false;
  unsigned type = 0, managed = 0;  // IS_MANAGED is a boolean: the zeroed word reads it whatever its width
  int ordinal = -1;
  CUdeviceptr start = 0;
  size_t size = 0;
  CUpointer_attribute attrs[5] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                  CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void* data[5] = {&type, &managed, &ordinal, &start, &size};
  const auto at = reinterpret_cast<uintptr_t>(p);
  if (get(5, attrs, data, CUdeviceptr(at)) != CUDA_SUCCESS) return false;
  out->kind = managed ? MemoryKind::kManaged
              : type == CU_MEMORYTYPE_DEVICE ? MemoryKind::kDevice
              : type == CU_MEMORYTYPE_HOST   ? MemoryKind::kPinnedHost
                                             : MemoryKind::kUnregisteredHost;
  out->owner = ordinal;
  const bool in_range = size > 0 && at >= uintptr_t(start) && at - uintptr_t(start) < size;
  out->begin = in_range ? uintptr_t(start) : at;
  out->end = in_range ? uintptr_t(start) + size : at + 1;
  return true;
}

// The runtime's answer (cudaPointerGetAttributes, which also initializes the runtime), no range.
Status runtime_answer(const char* name, const void* p, Device device, Answer* out) {
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it for the launch checks that follow
    return Status::cuda_error(fault::failure_message((std::string(name) + ": memory at " + hex(p) + " on " + device.to_string()).c_str(),
                                                     "pointer check (cudaPointerGetAttributes)", cudaGetErrorName(e), int(e),
                                                     cudaGetErrorString(e)));
  }
  out->kind = a.type == cudaMemoryTypeManaged  ? MemoryKind::kManaged
              : a.type == cudaMemoryTypeDevice ? MemoryKind::kDevice
              : a.type == cudaMemoryTypeHost   ? MemoryKind::kPinnedHost
                                               : MemoryKind::kUnregisteredHost;
  out->owner = a.device;
  out->begin = reinterpret_cast<uintptr_t>(p);
  out->end = out->begin + 1;
  return Status::ok();
}

// The driver's answer for p on `device` (a cache miss); a usable range is remembered.
Status query(const char* name, const void* p, Device device) {
  ++t_queries;
  Answer a;
  if (!driver_answer(p, &a)) ENCORE_RETURN_IF_ERROR(runtime_answer(name, p, device, &a));
  switch (a.kind) {
    case MemoryKind::kManaged: t_ranges.add(a.begin, a.end, -1); return Status::ok();
    case MemoryKind::kDevice: {
      bool usable = a.owner == device.index;
      if (!usable) {  // another device's memory: usable where `device` can access its peer's
        int can = 0;
        usable = cudaDeviceCanAccessPeer(&can, device.index, a.owner) == cudaSuccess && can != 0;
        (void)cudaGetLastError();
      }
      if (!usable) return Status::invalid(not_device_memory_message(name, p, device, MemoryKind::kDevice, a.owner));
      t_ranges.add(a.begin, a.end, device.index);
      return Status::ok();
    }
    default: return Status::invalid(not_device_memory_message(name, p, device, a.kind, a.owner));
  }
}
#endif

}  // namespace

bool VerifiedRanges::contains(uintptr_t p, int device) const {
  auto it = std::upper_bound(r_.begin(), r_.end(), p, [](uintptr_t x, const Range& r) { return x < r.begin; });
  if (it == r_.begin()) return false;
  --it;
  return p < it->end && (it->device == device || it->device < 0);
}

void VerifiedRanges::add(uintptr_t begin, uintptr_t end, int device) {
  if (end <= begin) end = begin + 1;
  // The first range ending after begin, through the last starting before end: the overlapped ones.
  auto first = std::upper_bound(r_.begin(), r_.end(), begin, [](uintptr_t x, const Range& r) { return x < r.end; });
  auto last = std::lower_bound(first, r_.end(), end, [](const Range& r, uintptr_t x) { return r.begin < x; });
  first = r_.erase(first, last);
  if (r_.size() >= kCapacity) {  // full: start over
    r_.clear();
    first = r_.begin();
  }
  r_.insert(first, Range{begin, end, device});
}

std::string not_device_memory_message(const char* name, const void* p, Device device, MemoryKind kind, int owner) {
  const std::string head = std::string(name) + ": memory at " + hex(p) + " is ";
  switch (kind) {
    case MemoryKind::kDevice:
      return head + "device memory of cuda:" + std::to_string(owner) + ", not of " + device.to_string() + ", and " + device.to_string() +
             " has no peer access to cuda:" + std::to_string(owner) + " (a view labelled with the wrong device?)";
    case MemoryKind::kManaged: return head + "managed memory (usable on every device)";
    case MemoryKind::kPinnedHost:
      return head + "pinned host memory (cudaMallocHost / cudaHostRegister), not device memory of " + device.to_string() +
             " (host memory labelled as a CUDA tensor?)";
    case MemoryKind::kUnregisteredHost: break;
  }
  return head + "not device memory of " + device.to_string() + ": the CUDA driver does not know it (host memory labelled as a CUDA tensor?)";
}

Status device_pointer(const char* name, const void* p, Device device) {
  if (!device.is_cuda() || p == nullptr) return Status::ok();
  if (fault::inject(fault::Step::kPointerCheck, name)) return fault::injected(fault::Step::kPointerCheck, name);
#ifdef ENCORE_WITH_CUDA
  if (t_ranges.contains(reinterpret_cast<uintptr_t>(p), device.index)) return Status::ok();
  return query(name, p, device);
#else
  return Status::ok();
#endif
}

Status device_memory(const char* name, const TensorView& t) {
  if (!t.device.is_cuda() || t.data == nullptr || t.ndim <= 0) return Status::ok();
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] <= 0) return Status::ok();
  return device_pointer(name, t.data, t.device);
}

Status device_memory(std::initializer_list<NamedView> views) {
  for (const NamedView& v : views)
    if (v.second != nullptr) ENCORE_RETURN_IF_ERROR(device_memory(v.first, *v.second));
  return Status::ok();
}

}  // namespace encore::checks

namespace encore::testing {

void clear_device_memory_cache() { checks::t_ranges.clear(); }
long long device_memory_queries() { return checks::t_queries; }

}  // namespace encore::testing
