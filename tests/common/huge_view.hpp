// Views of tensors too large to allocate, for tests of the CUDA size limits that validation
// refuses before any device access: distinct fake CUDA addresses 2^40 bytes apart (never read).
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore::test {

constexpr int64_t k2p31 = int64_t(1) << 31;

// A refusal whose message contains `what` (the argument and the limit).
inline void expect_refused(const Status& st, const std::string& what) {
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find(what), std::string::npos) << st.message();
}

inline TensorView huge_cuda_view(int slot, DType dtype, std::initializer_list<int64_t> shape) {
  void* fake = reinterpret_cast<void*>(uintptr_t(slot + 1) << 40);
  return TensorView::contiguous(fake, dtype, shape, Device{DeviceType::kCUDA, 0});
}

}  // namespace encore::test
