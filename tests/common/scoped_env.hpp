// Test helper: an environment variable for a scope (the library reads its switches, e.g.
// ENCORE_NORM_PACK_BYTES or ENCORE_MOE_DECODE, at every call), its previous value (or absence) restored
// at scope exit. value null: only save and restore (the test sets it as it goes).
#pragma once
#include <cstdlib>
#include <string>

namespace encore::test {

class ScopedEnv {
 public:
  explicit ScopedEnv(const char* name, const char* value = nullptr) : name_(name) {
    if (const char* v = std::getenv(name_)) saved_ = v, had_ = true;
    if (value) setenv(name_, value, 1);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() { had_ ? setenv(name_, saved_.c_str(), 1) : unsetenv(name_); }

 private:
  const char* name_;
  std::string saved_;
  bool had_ = false;
};

}  // namespace encore::test
