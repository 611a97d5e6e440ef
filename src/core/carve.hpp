// Bump allocation of views out of one caller-given workspace (each piece 256-byte aligned). The base may
// be null or a placeholder to size a plan: addresses are formed as integers and never dereferenced here.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "encore/core/tensor_view.hpp"

namespace encore {

struct Carve {
  char* base;
  size_t off = 0;
  Device dev;

  static size_t align256(size_t x) { return (x + 255) / 256 * 256; }
  // n raw bytes
  void* bytes(size_t n) {
    void* p = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(base) + off);
    off = align256(off + n);
    return p;
  }
  // a contiguous tensor of this shape
  TensorView take(DType t, std::initializer_list<int64_t> shape) {
    TensorView v = TensorView::contiguous(nullptr, t, shape, dev);
    v.data = bytes(size_t(v.numel()) * dtype_size(t));
    return v;
  }
  // [rows, cols] with row stride ld >= cols (0: cols)
  TensorView take(DType t, int64_t rows, int64_t cols, int64_t ld = 0) {
    if (ld == 0) ld = cols;
    return TensorView::strided(bytes(size_t(rows * ld) * dtype_size(t)), t, {rows, cols}, {ld, 1}, dev);
  }
  TensorView take(DType t, int64_t len) { return take(t, {len}); }
};

}  // namespace encore
