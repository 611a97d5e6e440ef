#include "encore/core/tensor_view.hpp"

#include <cassert>

namespace encore {

std::string Device::to_string() const {
  return is_cuda() ? "cuda:" + std::to_string(index) : std::string("cpu");
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = int(shape.size());
  assert(t.ndim <= kMaxDims);
  int d = 0;
  for (int64_t s : shape) t.shape[d++] = s;
  int64_t st = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.strides[i] = st;
    st *= t.shape[i];
  }
  return t;
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> strides, Device device) {
  TensorView t = contiguous(data, dtype, shape, device);
  int d = 0;
  for (int64_t s : strides) {
    if (d < t.ndim) t.strides[d] = s;
    ++d;
  }
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t st = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != st) return false;
    st *= shape[i];
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace encore
