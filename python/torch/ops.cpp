// encore._encore_torch: C++ kernels for the hottest torch.ops.encore ops (the norm family), so a call
// through torch's dispatcher reaches encore's C++ API without a trip back into Python. The schemas
// are the family modules' (python/encore/norm.py declares each op from its Python signature); this
// library registers CompositeExplicitAutograd kernels for some of them, and the Python side skips its
// own kernel for those (encore/_core.py, register_torch_ops). Built where torch's headers are found
// at configure time (python/CMakeLists.txt), against that torch only; loaded with
// torch.ops.load_library.
//
// Each kernel: views of the tensors (no copies but the [rows, hidden] reshape of a non-viewable x, as
// the Python launcher does), outputs allocated by ATen, the current CUDA stream, one encore::run;
// an invalid argument raises ValueError with encore's message, any other failure RuntimeError.
#include <ATen/ATen.h>
#include <torch/library.h>

#ifdef ENCORE_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <string>

#include "encore/norm.hpp"

namespace {

using encore::DType;
using encore::TensorView;

DType to_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kFP16;
    case at::kFloat: return DType::kFP32;
    case at::kDouble: return DType::kFP64;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kByte: return DType::kUInt8;
    default: TORCH_CHECK_VALUE(false, name, ": unsupported dtype ", t.scalar_type());
  }
}

TensorView view(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() <= TensorView::kMaxDims, name, ": more than 6 dimensions");
  TensorView v;
  v.data = t.data_ptr();
  v.dtype = to_dtype(t, name);
  if (t.is_cuda()) v.device = {encore::DeviceType::kCUDA, int(t.get_device())};
  else TORCH_CHECK_VALUE(t.is_cpu(), name, ": tensors must live on the CPU or a CUDA device");
  v.ndim = int(t.dim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = t.size(i);
    v.strides[i] = t.stride(i);
  }
  return v;
}

encore::Stream stream_of(const at::Tensor& t) {
#ifdef ENCORE_TORCH_CUDA
  if (t.is_cuda()) return reinterpret_cast<encore::Stream>(c10::cuda::getCurrentCUDAStream(t.get_device()).stream());
#endif
  (void)t;
  return nullptr;
}

void check(const encore::Status& st) {
  if (st.is_ok()) return;
  TORCH_CHECK_VALUE(st.code() != encore::StatusCode::kInvalidArgument, st.message());
  TORCH_CHECK(false, st.to_string());
}

// x as [rows, hidden]: leading dimensions flattened (a copy only where no view exists).
at::Tensor rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK_VALUE(x.dim() >= 1, name, ": expected at least 1 dimension [..., hidden]");
  return x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
}

// An output written in place, as [rows, hidden]: refused where that needs a copy.
at::Tensor rows_view(const at::Tensor& h, const char* name) {
  TORCH_CHECK_VALUE(h.dim() >= 1, name, ": expected at least 1 dimension [..., hidden]");
  if (h.dim() == 2) return h;
  try {
    return h.view({-1, h.size(-1)});
  } catch (const c10::Error&) {
    TORCH_CHECK_VALUE(false, name, ": must be viewable as [rows, hidden] (it is written in place)");
  }
}

encore::RmsNormOptions norm_options(double eps, double weight_offset) {
  encore::RmsNormOptions o;
  o.eps = float(eps);
  o.weight_offset = float(weight_offset);
  return o;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double weight_offset) {
  const at::Tensor x2 = rows(x, "x");
  at::Tensor y = at::empty_like(x2, at::MemoryFormat::Contiguous);
  check(encore::run(encore::RmsNormArgs{view(x2, "x"), view(weight, "weight"), view(y, "y")}, norm_options(eps, weight_offset), nullptr,
                    stream_of(x)));
  return x2.dim() == x.dim() ? y : y.view(x.sizes());
}

// y = rms_norm(x + residual) with h = x + residual written to h2 ([rows, hidden]).
at::Tensor add_rms_norm_into(const at::Tensor& x2, const at::Tensor& r2, const at::Tensor& weight, double eps, double weight_offset,
                             const at::Tensor& h2, const at::Tensor& like) {
  at::Tensor y = at::empty_like(x2, at::MemoryFormat::Contiguous);
  check(encore::run(encore::AddRmsNormArgs{view(x2, "x"), view(r2, "residual"), view(weight, "weight"), view(y, "y"), view(h2, "h")},
                    norm_options(eps, weight_offset), nullptr, stream_of(like)));
  return x2.dim() == like.dim() ? y : y.view(like.sizes());
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                                                double weight_offset) {
  const at::Tensor x2 = rows(x, "x");
  at::Tensor h = at::empty_like(x2, at::MemoryFormat::Contiguous);
  at::Tensor y = add_rms_norm_into(x2, rows(residual, "residual"), weight, eps, weight_offset, h, x);
  return {y, x2.dim() == x.dim() ? h : h.view(x.sizes())};
}

at::Tensor add_rms_norm_inplace(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                                double weight_offset) {
  const at::Tensor r2 = rows_view(residual, "residual");
  return add_rms_norm_into(rows(x, "x"), r2, weight, eps, weight_offset, r2, x);
}

at::Tensor add_rms_norm_out(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps, double weight_offset,
                            const at::Tensor& h_out) {
  return add_rms_norm_into(rows(x, "x"), rows(residual, "residual"), weight, eps, weight_offset, rows_view(h_out, "h_out"), x);
}

void qk_norm_(const at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight, int64_t num_q_heads, int64_t num_kv_heads,
              int64_t head_dim, double eps, double weight_offset) {
  TORCH_CHECK_VALUE(qkv.dim() == 2, "qkv: expected 2 dimensions [tokens, (num_q_heads + 2*num_kv_heads) * head_dim]");
  encore::QkNormOptions o;
  o.num_q_heads = int(num_q_heads);
  o.num_kv_heads = int(num_kv_heads);
  o.head_dim = int(head_dim);
  o.eps = float(eps);
  o.weight_offset = float(weight_offset);
  check(encore::run(encore::QkNormArgs{view(qkv, "qkv"), view(q_weight, "q_weight"), view(k_weight, "k_weight")}, o, nullptr,
                    stream_of(qkv)));
}

}  // namespace

TORCH_LIBRARY_IMPL(encore, CompositeExplicitAutograd, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_inplace);
  m.impl("add_rms_norm_out", &add_rms_norm_out);
  m.impl("qk_norm_", &qk_norm_);
}
