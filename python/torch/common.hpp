// What the C++ kernels of encore._encore_torch share (norm_ops.cpp, gemm_ops.cpp, kda_ops.cpp): the
// ATen tensor -> encore::TensorView conversion, the Status -> exception mapping (an invalid argument
// raises ValueError with encore's message, any other failure RuntimeError), torch's current CUDA
// stream, outputs allocated on an input's device, and the few Python spellings (list and float repr)
// that the Python launchers' error messages use, so that both paths raise the same text.
#pragma once
#include <ATen/ATen.h>
#include <ATen/DLConvertor.h>
#include <torch/library.h>

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#ifdef ENCORE_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <charconv>
#include <climits>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore_torch {

using encore::DType;
using encore::TensorView;
using OptTensor = std::optional<at::Tensor>;

// The binding's dtype rule and message (python/src/convert.hpp, on the DLPack dtype torch exports).
inline DType to_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kFP16;
    case at::kFloat: return DType::kFP32;
    case at::kDouble: return DType::kFP64;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kByte: return DType::kUInt8;
    default: {
      const DLDataType dl = at::getDLDataType(t);
      TORCH_CHECK_VALUE(false, name, ": unsupported array dtype (code ", int(dl.code), ", ", int(dl.bits), " bits)");
    }
  }
}

// The view of `t` (checks and messages in the binding's order: dimensions, device, dtype).
inline TensorView view(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() <= TensorView::kMaxDims, name, ": more than 6 dimensions");
  TensorView v;
  if (t.is_cuda()) v.device = {encore::DeviceType::kCUDA, int(t.get_device())};
  else TORCH_CHECK_VALUE(t.is_cpu(), name, ": arrays must live on the CPU or a CUDA device");
  v.dtype = to_dtype(t, name);
  v.data = t.data_ptr();
  v.ndim = int(t.dim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = t.size(i);
    v.strides[i] = t.stride(i);
  }
  return v;
}

// An optional argument or output: absent (an empty view) where not given.
inline TensorView view(const OptTensor& t, const char* name) { return t && t->defined() ? view(*t, name) : TensorView{}; }

inline encore::Stream stream_of(const at::Tensor& t) {
#ifdef ENCORE_TORCH_CUDA
  if (t.is_cuda()) return reinterpret_cast<encore::Stream>(c10::cuda::getCurrentCUDAStream(t.get_device()).stream());
#endif
  (void)t;
  return nullptr;
}

inline void check(const encore::Status& st) {
  if (st.is_ok()) return;
  TORCH_CHECK_VALUE(st.code() != encore::StatusCode::kInvalidArgument, st.message());
  TORCH_CHECK(false, st.to_string());
}

// An int op argument as the C++ API's int (the Python launchers pass it through nanobind, which refuses
// a value outside int's range with TypeError).
inline int to_int(int64_t v, const char* name) {
  TORCH_CHECK_TYPE(v >= INT_MIN && v <= INT_MAX, name, ": ", v, " does not fit a C++ int");
  return int(v);
}

// An uninitialized tensor of `shape` on like's device: like's dtype (Python's like.new_empty(shape)) or `dtype`.
// For a CPU or CUDA `like` the allocator is called without the dispatcher (where at::empty ends: ~0.2 us a
// call less; torch's deterministic NaN fill of new memory is skipped, and every output here is written
// whole), else through at::empty (meta and other devices). On CUDA: at::detail::empty_cuda's steps on torch's
// caching allocator (empty_cuda itself is in libtorch_cuda, which this library does not link: referenced, the
// library would not load).
inline at::Tensor new_empty(const at::Tensor& like, at::IntArrayRef shape, at::ScalarType dtype) {
#ifdef ENCORE_TORCH_CUDA
  if (like.is_cuda()) {
    const c10::cuda::CUDAGuard device(like.device());
    return at::detail::empty_generic(shape, c10::cuda::CUDACachingAllocator::get(), c10::DispatchKeySet(c10::DispatchKey::CUDA), dtype,
                                     std::nullopt);
  }
#endif
  if (like.is_cpu()) return at::detail::empty_cpu(shape, dtype, /*pin_memory=*/false, std::nullopt);
  return at::empty(shape, like.options().dtype(dtype));
}
inline at::Tensor new_empty(const at::Tensor& like, at::IntArrayRef shape) { return new_empty(like, shape, like.scalar_type()); }

// The first 16-byte aligned address at or after p.
inline void* align16(uintptr_t p) { return reinterpret_cast<void*>(p + (16 - p % 16) % 16); }

// An uninitialized contiguous tensor of `shape` in like's dtype on like's device whose allocation also holds
// `tail` bytes after it (16-byte aligned, at *tail_at): one caching-allocator call for an output and a
// small workspace that lives as long as the output. On CPU and CUDA the tensor is built on a storage of the
// device's allocator directly (one TensorImpl, no dispatcher); elsewhere on a byte tensor's storage.
inline at::Tensor empty_with_tail(const at::Tensor& like, at::IntArrayRef shape, size_t tail, void** tail_at) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  const size_t head = (size_t(n) * like.element_size() + 255) / 256 * 256, bytes = head + tail + 16;
  auto build = [&](c10::Storage storage, c10::DispatchKeySet keys) {
    *tail_at = align16(reinterpret_cast<uintptr_t>(storage.mutable_data()) + head);
    auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), keys, like.dtype());
    impl->set_sizes_contiguous(shape);
    return at::Tensor(std::move(impl));
  };
#ifdef ENCORE_TORCH_CUDA
  if (like.is_cuda()) {
    const c10::cuda::CUDAGuard device(like.device());
    return build(c10::Storage(c10::Storage::use_byte_size_t(), bytes, c10::cuda::CUDACachingAllocator::get(), /*resizable=*/false),
                 c10::DispatchKeySet(c10::DispatchKey::CUDA));
  }
#endif
  if (like.is_cpu())
    return build(c10::Storage(c10::Storage::use_byte_size_t(), bytes, c10::GetCPUAllocator(), /*resizable=*/false),
                 c10::DispatchKeySet(c10::DispatchKey::CPU));
  const at::Tensor buf = new_empty(like, {int64_t(bytes)}, at::kByte);
  return build(c10::Storage(buf.storage()), buf.key_set());
}

// x, rounded up / divided up (Python's (x + d - 1) // d for x >= 0, d > 0).
inline int64_t ceil_div(int64_t x, int64_t d) { return (x + d - 1) / d; }

// --- Python spellings, for the messages the Python launchers raise -----------------------------------------

// repr(s) of a str: single quotes unless s holds one and no double quote; backslash and control
// characters escaped.
inline std::string py_repr(std::string_view s) {
  const bool dq = s.find('\'') != std::string_view::npos && s.find('"') == std::string_view::npos;
  const char quote = dq ? '"' : '\'';
  std::string out(1, quote);
  for (unsigned char c : s) {
    if (c == quote || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) {
      static const char hex[] = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else out += char(c);
  }
  return out + quote;
}

// repr(x) of a float: the shortest round-trip digits, exponent form below 1e-4 and from 1e16.
inline std::string py_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);  // [-]d[.ddd]e[+-]XX
  const std::string_view s(buf, size_t(r.ptr - buf));
  const size_t e_at = s.find('e');
  const bool neg = s[0] == '-';
  std::string digits;
  for (char c : s.substr(neg, e_at - neg))
    if (c != '.') digits += c;
  const int exp = std::stoi(std::string(s.substr(e_at + 1)));
  std::string out = neg ? "-" : "";
  if (exp < -4 || exp >= 16) {
    out += digits[0];
    if (digits.size() > 1) out += "." + digits.substr(1);
    const std::string e = std::to_string(exp < 0 ? -exp : exp);
    return out + (exp < 0 ? "e-" : "e+") + (e.size() < 2 ? "0" : "") + e;
  }
  const int point = exp + 1, nd = int(digits.size());
  if (point <= 0) return out + "0." + std::string(size_t(-point), '0') + digits;
  if (point >= nd) return out + digits + std::string(size_t(point - nd), '0') + ".0";
  return out + digits.substr(0, size_t(point)) + "." + digits.substr(size_t(point));
}

// repr(list) of strs or of ints (a shape: Python's list(a.shape)).
inline std::string py_list(const std::vector<std::string>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + py_repr(items[i]);
  return out + "]";
}
inline std::string py_list(at::IntArrayRef items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + std::to_string(items[i]);
  return out + "]";
}

// _core.matrix_shape: ValueError unless `t` has `ndim` dimensions (naming the argument and the layout).
inline void check_dims(const at::Tensor& t, const char* name, int64_t ndim, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == ndim, name, ": expected ", ndim, " dimension", ndim != 1 ? "s " : " ", layout, ", got ",
                    py_list(t.sizes()));
}

}  // namespace encore_torch
