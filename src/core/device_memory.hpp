// The device-memory check every family's CUDA path runs after its argument checks and before any
// launch: a view declared on cuda:N must start in memory the CUDA driver knows as device memory that
// cuda:N can use (cudaMemoryTypeDevice of N or of a peer N can access, or managed memory). Host memory
// labelled as a CUDA tensor is refused here with a message naming the argument, instead of failing
// later inside a TMA descriptor or a kernel ("x: memory at 0x... is ... not device memory of cuda:0
// (host memory labelled as a CUDA tensor?)").
// Host cost: a per-thread cache of the allocation ranges verified (cuPointerGetAttributes'
// RANGE_START_ADDR / RANGE_SIZE) makes a repeated pointer a binary search; only a miss
// queries the driver (one cuPointerGetAttributes for type, owner and range: no synchronization, no
// stream; the runtime's cudaPointerGetAttributes where the driver cannot answer yet). Only positive
// answers are cached and a refusal always comes from a fresh query, so a stale entry can at worst let through a pointer into a
// freed range (a diagnostic, not a use-after-free detector). A build without CUDA checks nothing (its
// CUDA paths refuse earlier). Compiled with the CUDA runtime only under ENCORE_WITH_CUDA.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore::checks {

using NamedView = std::pair<const char*, const TensorView*>;

// Every CUDA view among `views` (CPU, undefined, null or empty views are skipped: nothing reads them).
Status device_memory(std::initializer_list<NamedView> views);
Status device_memory(const char* name, const TensorView& t);
// A raw pointer used on `device` (a workspace); null or a CPU device: nothing to check.
Status device_pointer(const char* name, const void* p, Device device);

// What the driver says a pointer is.
enum class MemoryKind : uint8_t { kDevice, kManaged, kPinnedHost, kUnregisteredHost };

// The refusal: "x: memory at 0x... is <kind>, not device memory of cuda:N (host memory labelled as a
// CUDA tensor?)"; for device memory of another device (owner), that device and the missing peer access.
std::string not_device_memory_message(const char* name, const void* p, Device device, MemoryKind kind, int owner);

// Ranges [begin, end) verified usable from a device (device -1: any device, managed memory), kept
// sorted and disjoint: a lookup is a binary search (a model's weights alone are hundreds of allocations;
// a cache too small to hold a step's working set would query the driver on every call). A new range
// replaces the ones it overlaps (a freed allocation's address reused); a full cache starts over. The
// per-thread cache of device_pointer; CPU-testable.
class VerifiedRanges {
 public:
  static constexpr size_t kCapacity = 1024;
  bool contains(uintptr_t p, int device) const;
  void add(uintptr_t begin, uintptr_t end, int device);
  void clear() { r_.clear(); }
  size_t size() const { return r_.size(); }

 private:
  struct Range {
    uintptr_t begin = 0, end = 0;
    int device = 0;
  };
  std::vector<Range> r_;  // sorted by begin, disjoint
};

}  // namespace encore::checks
