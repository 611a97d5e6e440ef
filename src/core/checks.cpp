#include "core/checks.hpp"

#include <cstdint>

namespace encore::checks {

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

Status present(const char* name, const TensorView& t) {
  if (t.ndim <= 0) return Status::invalid(std::string(name) + ": tensor is missing (ndim 0)");
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] <= 0)
      return Status::invalid(std::string(name) + ": empty tensor " + t.shape_string() +
                             "; every dimension must be >= 1");
    if (t.strides[i] < 0)
      return Status::invalid(std::string(name) + ": negative stride in dimension " + std::to_string(i));
  }
  if (t.data == nullptr) return Status::invalid(std::string(name) + ": data pointer is null");
  if (!aligned(t.data, t.element_size()))
    return Status::invalid(std::string(name) + ": data pointer is not aligned to its element size (" +
                           std::to_string(t.element_size()) + " bytes for " + dtype_name(t.dtype) + ")");
  return Status::ok();
}

Status ndim(const char* name, const TensorView& t, int expected, const char* layout) {
  if (t.ndim != expected)
    return Status::invalid(std::string(name) + ": expected " + std::to_string(expected) +
                           " dimensions " + layout + ", got " + t.shape_string());
  return Status::ok();
}

Status dtype_in(const char* name, const TensorView& t, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (d == t.dtype) return Status::ok();
  std::string list;  // the message only on failure: a passing check allocates nothing
  for (DType d : allowed) list += (list.empty() ? "" : ", ") + std::string(dtype_name(d));
  return Status::invalid(std::string(name) + ": dtype must be one of {" + list + "}, got " +
                         dtype_name(t.dtype));
}

Status same_dtype(const char* name, const TensorView& t, const char* ref_name, const TensorView& ref) {
  if (t.dtype != ref.dtype)
    return Status::invalid(std::string(name) + ": dtype " + dtype_name(t.dtype) + " must match " +
                           ref_name + "'s dtype " + dtype_name(ref.dtype));
  return Status::ok();
}

Status same_device(const char* name, const TensorView& t, const char* ref_name, const TensorView& ref) {
  if (!(t.device == ref.device))
    return Status::invalid(std::string(name) + ": on " + t.device.to_string() + " but " + ref_name +
                           " is on " + ref.device.to_string() + "; all tensors must be on one device");
  return Status::ok();
}

Status unit_last_stride(const char* name, const TensorView& t) {
  if (t.strides[t.ndim - 1] != 1 && t.shape[t.ndim - 1] != 1)
    return Status::invalid(std::string(name) + ": last dimension must be contiguous (stride 1), got stride " +
                           std::to_string(t.strides[t.ndim - 1]));
  return Status::ok();
}

Status dim_equals(const char* name, const TensorView& t, int dim, int64_t expected, const char* what) {
  if (t.shape[dim] != expected)
    return Status::invalid(std::string(name) + ": dimension " + std::to_string(dim) + " is " +
                           std::to_string(t.shape[dim]) + " but must equal " + what + " (" +
                           std::to_string(expected) + ")");
  return Status::ok();
}

Status rows_disjoint(const char* name, const TensorView& t) {
  if (t.shape[0] > 1 && t.strides[0] < t.shape[1])
    return Status::invalid(std::string(name) + ": row stride " + std::to_string(t.strides[0]) +
                           " is smaller than the row length " + std::to_string(t.shape[1]) +
                           " (rows would overlap)");
  return Status::ok();
}

size_t extent_bytes(const TensorView& t) {
  int64_t last = 0;
  for (int i = 0; i < t.ndim; ++i) last += (t.shape[i] - 1) * t.strides[i];
  return size_t(last + 1) * t.element_size();
}

Status no_overlap(const char* a_name, const TensorView& a, const char* b_name, const TensorView& b) {
  auto a0 = reinterpret_cast<uintptr_t>(a.data), b0 = reinterpret_cast<uintptr_t>(b.data);
  uintptr_t a1 = a0 + extent_bytes(a), b1 = b0 + extent_bytes(b);
  if (a0 < b1 && b0 < a1)
    return Status::invalid(std::string(a_name) + ": memory overlaps " + b_name +
                           "; the output must not alias that input");
  return Status::ok();
}

}  // namespace encore::checks
