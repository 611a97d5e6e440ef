// Testing hook (tests only): arms the launch-path test seam (src/core/fault_injection.hpp) so that a
// chosen step fails, and resets the device-memory check's per-thread cache (src/core/device_memory.hpp).
#pragma once
#include <string>

#include "core/fault_injection.hpp"

namespace encore::testing {

// While alive, the seam fails `step` for calls whose name contains `match` (empty: any call): the
// first `skip` matching consultations pass, the next `times` fail (times < 0: every one). Scopes nest;
// the destructor disarms this one.
class ScopedFault {
 public:
  explicit ScopedFault(fault::Step step, std::string match = "", int skip = 0, int times = 1);
  ~ScopedFault();
  ScopedFault(const ScopedFault&) = delete;
  ScopedFault& operator=(const ScopedFault&) = delete;
  // How many failures this scope has injected so far.
  int hits() const;

 private:
  int id_;
};

// Forgets the calling thread's verified device-memory ranges (the next check queries the driver).
void clear_device_memory_cache();
// How many driver queries the calling thread's device-memory checks made (cache misses), for tests.
long long device_memory_queries();

}  // namespace encore::testing
