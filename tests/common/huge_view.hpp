// Views of tensors too large to allocate, for tests of the CUDA size limits that validation
// refuses before any device access: distinct fake CUDA addresses 2^40 bytes apart (never read).
#pragma once
#include <cstdint>
#include <initializer_list>

#include "encore/core/tensor_view.hpp"

namespace encore::test {

inline TensorView huge_cuda_view(int slot, DType dtype, std::initializer_list<int64_t> shape) {
  void* fake = reinterpret_cast<void*>(uintptr_t(slot + 1) << 40);
  return TensorView::contiguous(fake, dtype, shape, Device{DeviceType::kCUDA, 0});
}

}  // namespace encore::test
