// Argument checks shared by the GEMM-epilogue family's dispatch files (gemm.cpp, finishers.cpp).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include <cmath>

#include "core/checks.hpp"
#include "core/device_memory.hpp"
#include "encore/core/tensor_view.hpp"
#include "encore/gemm.hpp"
#ifdef ENCORE_WITH_CUDA
#include "common/cuda/device_guard.hpp"  // the CUDA paths launch with the tensors' device current
#endif

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

// The finishers' CUDA kernels take a 2-D tensor's dimensions as int: both must be < 2^31.
inline Status cuda_int_dims(const char* name, const TensorView& t) {
  for (int d = 0; d < 2; ++d)
    if (t.shape[d] >= (int64_t(1) << 31))
      return Status::unsupported(std::string(name) + ": " + t.shape_string() + "; the CUDA kernels take dimensions of fewer than 2^31");
  return Status::ok();
}

inline Status no_cuda(const TensorView& t, const char* name = "a") {
  return Status::unsupported(std::string(name) + ": on " + t.device.to_string() + " but encore was built without CUDA (ENCORE_CUDA=OFF)");
}

// The QK-norm + RoPE finish's and its backward's shared operands: t (named `name`, the [M, N] qkv-shaped
// tensor the call is about) with N = (num_q_heads + 2 num_kv_heads)·head_dim, the options, partials
// [M, heads] fp32, q_weight / k_weight [head_dim], pos [M] int32, freq [N] fp32.
inline Status qk_norm_rope_operands(const char* name, const TensorView& t, const TensorView& partials, const TensorView& q_weight,
                                    const TensorView& k_weight, const TensorView& pos, const TensorView& freq, const QkNormRopeOptions& o) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  ENCORE_RETURN_IF_ERROR(checks::ndim(name, t, 2, "[M, N]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, t, kIo));
  if (o.num_q_heads < 1 || o.num_kv_heads < 1 || o.head_dim < 2 || o.head_dim % 2 != 0)
    return Status::invalid("num_q_heads, num_kv_heads: must be >= 1 and head_dim even (got " + std::to_string(o.num_q_heads) + ", " +
                           std::to_string(o.num_kv_heads) + ", " + std::to_string(o.head_dim) + ")");
  const int64_t M = t.shape[0], heads = int64_t(o.num_q_heads) + 2 * int64_t(o.num_kv_heads), N = heads * o.head_dim;
  if (t.shape[1] != N)
    return Status::invalid(std::string(name) + ": expected [M, (num_q_heads + 2 * num_kv_heads) * head_dim] = [" + std::to_string(M) + ", " +
                           std::to_string(N) + "], got " + t.shape_string());
  ENCORE_RETURN_IF_ERROR(matrix("partials", partials, M, heads, "[M, heads]", t, {DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(vector("q_weight", q_weight, o.head_dim, "[head_dim]", t, {t.dtype, DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(vector("k_weight", k_weight, o.head_dim, "[head_dim]", t, {t.dtype, DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(vector("pos", pos, M, "[M]", t, {DType::kInt32}));
  ENCORE_RETURN_IF_ERROR(vector("freq", freq, N, "[N] (hi, lo) pairs", t, {DType::kFP32}));
  if (!(o.eps >= 0.0f) || !std::isfinite(o.eps)) return Status::invalid("eps: must be finite and >= 0");
  if (t.device.is_cuda()) {  // what both CUDA kernels read: one weight dtype, contiguous vectors, float2 freq pairs
    if (q_weight.dtype != k_weight.dtype) return Status::invalid("k_weight: dtype must match q_weight's on CUDA");
    for (auto [vname, v] : {std::pair<const char*, const TensorView*>{"q_weight", &q_weight}, {"k_weight", &k_weight}, {"pos", &pos},
                            {"freq", &freq}})
      ENCORE_RETURN_IF_ERROR(contiguous_vector(vname, *v));
    if (!checks::aligned(freq.data, 8)) return Status::invalid("freq: must be 8-byte aligned on CUDA ((hi, lo) pairs)");
    ENCORE_RETURN_IF_ERROR(checks::unit_last_stride(name, t));
    ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("partials", partials));
    if (M >= (int64_t(1) << 31)) return Status::unsupported(std::string(name) + ": M must be < 2^31");
    // The kernel's Q/K columns per row, (num_q_heads + num_kv_heads) * head_dim, are int.
    const int64_t qk_cols = (int64_t(o.num_q_heads) + o.num_kv_heads) * o.head_dim;
    if (qk_cols >= (int64_t(1) << 31))
      return Status::unsupported(std::string(name) + ": (num_q_heads + num_kv_heads) * head_dim = " + std::to_string(qk_cols) +
                                 " columns; the CUDA kernels take fewer than 2^31");
  }
  return Status::ok();
}

// Everything a run of these ops checks before it launches or computes (the arguments, and on CUDA the
// kernels' own limits and the device memory), without running: a composition (the blocks) checks every
// step with these before its first step writes anything. check_run(GemmEpilogueArgs) also hands back the
// options with partial_tile_n resolved and the CUDA tile (either pointer may be null).
Status check_run(const GemmEpilogueArgs& a, const GemmEpilogueOptions& opts, GemmEpilogueOptions* resolved = nullptr,
                 GemmTile* tile = nullptr);
Status check_run(const RmsFinalReduceArgs& a, int64_t hidden, float eps);
Status check_run(const LseFinishArgs& a);
Status check_run(const CeMeanArgs& a);
Status check_run(const PartialsSumArgs& a, PartialsSum axis, float scale);
Status check_run(const RopeBwdZdzArgs& a, float scale);

}  // namespace encore::gemm
