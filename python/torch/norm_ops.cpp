// encore._encore_torch, the norm family: C++ CompositeExplicitAutograd kernels of torch.ops.encore.rms_norm,
// add_rms_norm, add_rms_norm_, add_rms_norm_out and qk_norm_ (schemas declared by python/encore/norm.py
// from its Python kernels' signatures), so a call through torch's dispatcher reaches encore's C++ API
// without a trip back into Python. Each kernel: views of the tensors (no copies but the [rows, hidden]
// reshape of a non-viewable x, as the Python launcher does), outputs allocated by ATen, the current CUDA
// stream, one encore::run.
#include "common.hpp"
#include "encore/norm.hpp"

namespace {

using namespace encore_torch;

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
  o.num_q_heads = to_int(num_q_heads, "num_q_heads");  // (not truncated: 2**32 + 1 heads is no 1 head)
  o.num_kv_heads = to_int(num_kv_heads, "num_kv_heads");
  o.head_dim = to_int(head_dim, "head_dim");
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
