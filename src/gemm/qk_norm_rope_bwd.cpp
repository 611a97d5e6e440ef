// The QK-norm + RoPE backward (encore/gemm.hpp QkNormRopeBwdArgs): validation, then the CPU reference
// (reference::qk_norm_rope_bwd) or the CUDA kernel (cuda/qk_norm_rope_bwd.cu).
#include <cmath>
#include <string>
#include <utility>

#include "encore/gemm.hpp"
#include "gemm/checks.hpp"
#include "gemm/cuda/qk_norm_rope_bwd.hpp"  // host-only declarations
#include "gemm/reference/gemm_ref.hpp"

namespace encore {
namespace {

using gemm::contiguous_vector;
using gemm::kIo;
using gemm::matrix;
using gemm::vector;

Status validate(const QkNormRopeBwdArgs& a, const QkNormRopeOptions& o) {
  ENCORE_RETURN_IF_ERROR(gemm::qk_norm_rope_operands("dy", a.dy, a.partials, a.q_weight, a.k_weight, a.pos, a.freq, o));
  const int64_t M = a.dy.shape[0], N = a.dy.shape[1];
  ENCORE_RETURN_IF_ERROR(matrix("x", a.x, M, N, "[M, N] (the forward's input)", a.dy, {a.dy.dtype}));
  ENCORE_RETURN_IF_ERROR(matrix("dx", a.dx, M, N, "[M, N]", a.dy, {a.dy.dtype}));
  ENCORE_RETURN_IF_ERROR(vector("dq_weight", a.dq_weight, o.head_dim, "[head_dim]", a.dy, {DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(vector("dk_weight", a.dk_weight, o.head_dim, "[head_dim]", a.dy, {DType::kFP32}));
  if (a.dx.data != a.dy.data) ENCORE_RETURN_IF_ERROR(checks::no_overlap("dx", a.dx, "dy", a.dy));
  else if (a.dx.strides != a.dy.strides) return Status::invalid("dx: in place on dy needs dy's strides");
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("dx", a.dx, "x", a.x));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("dq_weight", a.dq_weight, "dk_weight", a.dk_weight));
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"partials", &a.partials}, {"dq_weight", &a.dq_weight},
                         {"dk_weight", &a.dk_weight}, {"pos", &a.pos}, {"freq", &a.freq}})
    ENCORE_RETURN_IF_ERROR(checks::no_overlap("dx", a.dx, name, *t));
  if (a.dy.device.is_cuda()) {
    if (o.head_dim > 256) return Status::unsupported("head_dim: at most 256 on CUDA, got " + std::to_string(o.head_dim));
    // The kernel's V pass-through takes the row width N (V columns included) as int.
    if (N >= (int64_t(1) << 31))
      return Status::unsupported("dy: N = (num_q_heads + 2 * num_kv_heads) * head_dim = " + std::to_string(N) +
                                 " columns; the CUDA kernel takes fewer than 2^31");
    for (auto [name, t] : {std::pair<const char*, const TensorView*>{"dq_weight", &a.dq_weight}, {"dk_weight", &a.dk_weight}})
      ENCORE_RETURN_IF_ERROR(contiguous_vector(name, *t));
    for (auto [name, t] : {std::pair<const char*, const TensorView*>{"x", &a.x}, {"dx", &a.dx}})
      ENCORE_RETURN_IF_ERROR(checks::unit_last_stride(name, *t));
  }
  return Status::ok();
}

}  // namespace

size_t workspace_bytes(const QkNormRopeBwdArgs& a, const QkNormRopeOptions& o) {
  if (!a.dy.device.is_cuda() || a.dy.ndim != 2 || o.head_dim < 2) return 0;
  return size_t(cuda::qk_norm_rope_bwd_warps(a.dy.shape[0], o.num_q_heads + o.num_kv_heads)) * 2 * size_t(o.head_dim) * sizeof(float);
}

Status run(const QkNormRopeBwdArgs& a, const QkNormRopeOptions& o, void* workspace, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  if (a.dy.device.is_cuda()) {
    if (!workspace) return Status::invalid("workspace: the CUDA backend needs workspace_bytes(args, opts) bytes of device memory");
    ENCORE_RETURN_IF_ERROR(checks::device_memory({{"dy", &a.dy}, {"x", &a.x}, {"partials", &a.partials}, {"q_weight", &a.q_weight},
                                                  {"k_weight", &a.k_weight}, {"pos", &a.pos}, {"freq", &a.freq}, {"dx", &a.dx},
                                                  {"dq_weight", &a.dq_weight}, {"dk_weight", &a.dk_weight}}));
    ENCORE_RETURN_IF_ERROR(checks::device_pointer("workspace", workspace, a.dy.device));
#ifdef ENCORE_WITH_CUDA
    cuda::DeviceGuard guard;
    ENCORE_RETURN_IF_ERROR(guard.set(a.dy.device.index));
    cuda::QkNormRopeBwdProblem p;
    p.dy = a.dy.data;
    p.x = a.x.data;
    p.dx = a.dx.data;
    p.ld_dy = a.dy.strides[0];
    p.ld_x = a.x.strides[0];
    p.ld_dx = a.dx.strides[0];
    p.dtype = a.dy.dtype;
    p.partials = static_cast<const float*>(a.partials.data);
    p.ld_partials = a.partials.strides[0];
    p.q_weight = a.q_weight.data;
    p.k_weight = a.k_weight.data;
    p.weight_fp32 = a.q_weight.dtype == DType::kFP32;
    p.pos = static_cast<const int32_t*>(a.pos.data);
    p.freq = static_cast<const float*>(a.freq.data);
    p.dq_weight = static_cast<float*>(a.dq_weight.data);
    p.dk_weight = static_cast<float*>(a.dk_weight.data);
    p.M = int(a.dy.shape[0]);
    p.N = int(a.dy.shape[1]);
    p.num_q_heads = o.num_q_heads;
    p.qk_heads = o.num_q_heads + o.num_kv_heads;
    p.head_dim = o.head_dim;
    p.eps = o.eps;
    return cuda::launch_qk_norm_rope_bwd(p, static_cast<float*>(workspace), stream);
#else
    (void)stream;
    return gemm::no_cuda(a.dy, "dy");
#endif
  }
  reference::qk_norm_rope_bwd(a, o);
  return Status::ok();
}

}  // namespace encore
