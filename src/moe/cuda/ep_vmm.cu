// Peer memory for the expert-parallel all-to-all across processes (ep_device.cpp's create_ipc): device
// allocations made with the CUDA virtual memory API (cuMemCreate with a POSIX file descriptor as the
// shareable handle), exported as a file descriptor, and imported and mapped by every peer process
// (cuMemImportFromShareableHandle, cuMemAddressReserve, cuMemMap, cuMemSetAccess for this process's
// device; peers on other GPUs reach it over NVLink / PCIe peer access). Not cudaIpcGetMemHandle
// (inference.md §3.3). Driver entry points through cudaGetDriverEntryPointByVersion, as the JIT does:
// no link against libcuda. Host code only.
#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <string>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/driver_entry.hpp"
#include "moe/cuda/launch.hpp"

namespace encore::cuda {
namespace {

struct Vmm {
  decltype(&cuMemGetAllocationGranularity) granularity = driver_entry<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity");
  decltype(&cuMemCreate) create = driver_entry<decltype(&cuMemCreate)>("cuMemCreate");
  decltype(&cuMemRelease) release = driver_entry<decltype(&cuMemRelease)>("cuMemRelease");
  decltype(&cuMemExportToShareableHandle) export_fd = driver_entry<decltype(&cuMemExportToShareableHandle)>("cuMemExportToShareableHandle");
  decltype(&cuMemImportFromShareableHandle) import_fd = driver_entry<decltype(&cuMemImportFromShareableHandle)>("cuMemImportFromShareableHandle");
  decltype(&cuMemAddressReserve) reserve = driver_entry<decltype(&cuMemAddressReserve)>("cuMemAddressReserve");
  decltype(&cuMemAddressFree) address_free = driver_entry<decltype(&cuMemAddressFree)>("cuMemAddressFree");
  decltype(&cuMemMap) map = driver_entry<decltype(&cuMemMap)>("cuMemMap");
  decltype(&cuMemUnmap) unmap = driver_entry<decltype(&cuMemUnmap)>("cuMemUnmap");
  decltype(&cuMemSetAccess) access = driver_entry<decltype(&cuMemSetAccess)>("cuMemSetAccess");
  bool ok() const { return granularity && create && release && export_fd && import_fd && reserve && address_free && map && unmap && access; }
};
const Vmm& vmm() {
  static const Vmm v;
  return v;
}

Status check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return Status::ok();
  return Status::cuda_error(driver_failure_message("ep peer memory", what, r));
}

CUmemAllocationProp prop_for(int device) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = device;
  return p;
}

// The driver's entry points present, the primary context current, and *bytes rounded up to the
// recommended allocation granularity (the exporter and every importer compute the same size).
Status round_to_granularity(int device, size_t* bytes) {
  const Vmm& v = vmm();
  if (!v.ok()) return Status::unsupported("ep peer memory: the driver lacks the virtual memory entry points (cuMemCreate ...)");
  if (const cudaError_t e = cudaFree(nullptr); e != cudaSuccess) {  // the primary context exists before the driver calls
    (void)cudaGetLastError();
    return Status::cuda_error(fault::failure_message("ep peer memory", "cudaFree(nullptr) (context creation)", cudaGetErrorName(e), int(e),
                                                     cudaGetErrorString(e)));
  }
  const CUmemAllocationProp prop = prop_for(device);
  size_t gran = 0;
  ENCORE_RETURN_IF_ERROR(check(v.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity"));
  *bytes = (*bytes + gran - 1) / gran * gran;
  return Status::ok();
}

// Reserves an address range for `handle`, maps it and grants this process's device read / write.
Status map_here(unsigned long long handle, size_t bytes, int device, EpPeerMemory* out) {
  const Vmm& v = vmm();
  CUdeviceptr ptr = 0;
  ENCORE_RETURN_IF_ERROR(check(v.reserve(&ptr, bytes, 0, 0, 0), "cuMemAddressReserve"));
  if (Status s = check(v.map(ptr, bytes, 0, CUmemGenericAllocationHandle(handle), 0), "cuMemMap"); !s) {
    v.address_free(ptr, bytes);
    return s;
  }
  CUmemAccessDesc a{};
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = device;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (Status s = check(v.access(ptr, bytes, &a, 1), "cuMemSetAccess (peer access between the GPUs?)"); !s) {
    v.unmap(ptr, bytes);
    v.address_free(ptr, bytes);
    return s;
  }
  out->ptr = reinterpret_cast<void*>(ptr);
  out->bytes = bytes;
  out->handle = handle;
  return Status::ok();
}

}  // namespace

Status ep_peer_memory_create(size_t bytes, int device_index, EpPeerMemory* out) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  ENCORE_RETURN_IF_ERROR(round_to_granularity(device_index, &bytes));
  const Vmm& v = vmm();
  const CUmemAllocationProp prop = prop_for(device_index);
  CUmemGenericAllocationHandle h = 0;
  ENCORE_RETURN_IF_ERROR(check(v.create(&h, bytes, &prop, 0), "cuMemCreate (POSIX file descriptor handle)"));
  int fd = -1;
  if (Status s = check(v.export_fd(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), "cuMemExportToShareableHandle"); !s) {
    v.release(h);
    return s;
  }
  if (Status s = map_here(h, bytes, device_index, out); !s) {
    close(fd);
    v.release(h);
    return s;
  }
  out->fd = fd;
  cudaError_t e = cudaMemset(out->ptr, 0, bytes);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();  // zeroed before the descriptor leaves this process
  if (e != cudaSuccess) {
    ep_peer_memory_release(out);
    return Status::cuda_error(fault::failure_message("ep peer memory", "cudaMemset", cudaGetErrorName(e), int(e), cudaGetErrorString(e)));
  }
  return Status::ok();
}

Status ep_peer_memory_import(int fd, size_t bytes, int device_index, EpPeerMemory* out) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  ENCORE_RETURN_IF_ERROR(round_to_granularity(device_index, &bytes));
  const Vmm& v = vmm();
  CUmemGenericAllocationHandle h = 0;
  ENCORE_RETURN_IF_ERROR(check(v.import_fd(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                               "cuMemImportFromShareableHandle"));
  if (Status s = map_here(h, bytes, device_index, out); !s) {
    v.release(h);
    return s;
  }
  out->fd = -1;
  return Status::ok();
}

void ep_peer_memory_release(EpPeerMemory* m) {
  if (!m || !m->ptr) return;
  const Vmm& v = vmm();
  const auto ptr = reinterpret_cast<CUdeviceptr>(m->ptr);
  v.unmap(ptr, m->bytes);
  v.address_free(ptr, m->bytes);
  v.release(CUmemGenericAllocationHandle(m->handle));
  if (m->fd >= 0) close(m->fd);
  *m = EpPeerMemory{};
}

}  // namespace encore::cuda
