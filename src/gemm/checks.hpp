// Argument checks shared by the GEMM-epilogue family's dispatch files (gemm.cpp, finishers.cpp).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/checks.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore::gemm {

inline int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / y; }

inline const std::initializer_list<DType> kIo = {DType::kBF16, DType::kFP16, DType::kFP32};

// A 2-D operand [rows, cols] of one of `dtypes`, on `ref`'s device (ref is named "a").
inline Status matrix(const char* name, const TensorView& t, int64_t rows, int64_t cols, const char* layout, const TensorView& ref,
                     std::initializer_list<DType> dtypes) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  ENCORE_RETURN_IF_ERROR(checks::ndim(name, t, 2, layout));
  if (t.shape[0] != rows || t.shape[1] != cols)
    return Status::invalid(std::string(name) + ": expected " + layout + " = [" + std::to_string(rows) + ", " + std::to_string(cols) +
                           "], got " + t.shape_string());
  ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, t, dtypes));
  ENCORE_RETURN_IF_ERROR(checks::same_device(name, t, "a", ref));
  return Status::ok();
}

// A 1-D operand [len] of one of `dtypes`, on `ref`'s device.
inline Status vector(const char* name, const TensorView& t, int64_t len, const char* layout, const TensorView& ref,
                     std::initializer_list<DType> dtypes) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  ENCORE_RETURN_IF_ERROR(checks::ndim(name, t, 1, layout));
  if (t.shape[0] != len)
    return Status::invalid(std::string(name) + ": expected " + layout + " = [" + std::to_string(len) + "], got " + t.shape_string());
  ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, t, dtypes));
  ENCORE_RETURN_IF_ERROR(checks::same_device(name, t, "a", ref));
  return Status::ok();
}

// 16-byte aligned data and row stride (TMA rows and vector stores).
inline Status tma_rows(const char* name, const TensorView& t) {
  if (!t.defined()) return Status::ok();
  const int64_t esize = int64_t(dtype_size(t.dtype));
  if (!checks::aligned(t.data, 16) || (t.shape[0] > 1 && (t.strides[0] * esize) % 16 != 0))
    return Status::invalid(std::string(name) + ": data pointer and row stride must be 16-byte aligned on CUDA");
  return Status::ok();
}

inline Status contiguous_vector(const char* name, const TensorView& t) {
  if (t.defined() && t.shape[0] > 1 && t.strides[0] != 1)
    return Status::invalid(std::string(name) + ": must be contiguous (stride 1) on CUDA, got stride " + std::to_string(t.strides[0]));
  return Status::ok();
}

inline Status no_cuda(const TensorView& t, const char* name = "a") {
  return Status::unsupported(std::string(name) + ": on " + t.device.to_string() + " but encore was built without CUDA (ENCORE_CUDA=OFF)");
}

}  // namespace encore::gemm
