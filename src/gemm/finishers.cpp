// GEMM-epilogue family finishers and host helpers: rms_final_reduce, lse_finish, ce_mean and the partials
// sums (the row / column statistics from the epilogues' partials), the QK-norm + RoPE finish after qkv_head_sqsum, and the
// weight / frequency layouts the epilogues read (interleave_gate_up, rope_freq_turns).
#include <cmath>
#include <utility>

#include "encore/gemm.hpp"
#include "gemm/checks.hpp"
#include "gemm/cuda/launch.hpp"  // host-only declarations
#include "gemm/reference/gemm_ref.hpp"

namespace encore {

using gemm::contiguous_vector;
using gemm::kIo;
using gemm::matrix;
using gemm::vector;

namespace gemm {

Status check_run(const RmsFinalReduceArgs& a, int64_t hidden, float eps) {
  ENCORE_RETURN_IF_ERROR(checks::present("partials", a.partials));
  ENCORE_RETURN_IF_ERROR(checks::ndim("partials", a.partials, 2, "[M, tiles]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("partials", a.partials, {DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(vector("r", a.r, a.partials.shape[0], "[M]", a.partials, {DType::kFP32}));
  if (hidden <= 0) return Status::invalid("hidden: must be positive, got " + std::to_string(hidden));
  if (!(eps >= 0.0f) || !std::isfinite(eps)) return Status::invalid("eps: must be finite and >= 0");
  if (a.partials.device.is_cuda()) {
    ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("partials", a.partials));
    ENCORE_RETURN_IF_ERROR(contiguous_vector("r", a.r));
    ENCORE_RETURN_IF_ERROR(gemm::cuda_int_dims("partials", a.partials));
    ENCORE_RETURN_IF_ERROR(checks::device_memory({{"partials", &a.partials}, {"r", &a.r}}));
  }
  return Status::ok();
}

}  // namespace gemm

Status run(const RmsFinalReduceArgs& a, int64_t hidden, float eps, Stream stream) {
  ENCORE_RETURN_IF_ERROR(gemm::check_run(a, hidden, eps));
  if (a.partials.device.is_cuda()) {
#ifdef ENCORE_WITH_CUDA
    cuda::DeviceGuard guard;
    ENCORE_RETURN_IF_ERROR(guard.set(a.partials.device.index));
    return cuda::launch_rms_final_reduce(static_cast<const float*>(a.partials.data), a.partials.strides[0], int(a.partials.shape[0]),
                                         int(a.partials.shape[1]), static_cast<float*>(a.r.data), hidden, eps, stream);
#else
    (void)stream;
    return gemm::no_cuda(a.partials, "partials");
#endif
  }
  reference::rms_final_reduce(a, hidden, eps);
  return Status::ok();
}

namespace gemm {

Status check_run(const LseFinishArgs& a) {
  ENCORE_RETURN_IF_ERROR(checks::present("partials", a.partials));
  ENCORE_RETURN_IF_ERROR(checks::ndim("partials", a.partials, 2, "[M, tiles]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("partials", a.partials, {DType::kFP32}));
  const int64_t M = a.partials.shape[0];
  ENCORE_RETURN_IF_ERROR(vector("lse", a.lse, M, "[M]", a.partials, {DType::kFP32}));
  if (a.target.defined()) {
    ENCORE_RETURN_IF_ERROR(vector("target", a.target, M, "[M]", a.partials, {DType::kInt32}));
    ENCORE_RETURN_IF_ERROR(vector("target_logit", a.target_logit, M, "[M]", a.partials, {DType::kFP32}));
    ENCORE_RETURN_IF_ERROR(vector("loss", a.loss, M, "[M]", a.partials, {DType::kFP32}));
  } else if (a.loss.defined() || a.target_logit.defined()) {
    return Status::invalid("loss: needs target and target_logit");
  }
  if (a.partials.device.is_cuda()) {
    ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("partials", a.partials));
    for (auto [name, t] : {std::pair<const char*, const TensorView*>{"lse", &a.lse}, {"target", &a.target}, {"target_logit", &a.target_logit},
                           {"loss", &a.loss}})
      ENCORE_RETURN_IF_ERROR(contiguous_vector(name, *t));
    ENCORE_RETURN_IF_ERROR(gemm::cuda_int_dims("partials", a.partials));
    ENCORE_RETURN_IF_ERROR(checks::device_memory({{"partials", &a.partials}, {"lse", &a.lse}, {"target", &a.target},
                                                  {"target_logit", &a.target_logit}, {"loss", &a.loss}}));
  }
  return Status::ok();
}

}  // namespace gemm

Status run(const LseFinishArgs& a, int ignore_index, Stream stream) {
  ENCORE_RETURN_IF_ERROR(gemm::check_run(a));
  if (a.partials.device.is_cuda()) {
#ifdef ENCORE_WITH_CUDA
    cuda::DeviceGuard guard;
    ENCORE_RETURN_IF_ERROR(guard.set(a.partials.device.index));
    return cuda::launch_lse_finish(static_cast<const float*>(a.partials.data), a.partials.strides[0], int(a.partials.shape[0]),
                                   int(a.partials.shape[1]), static_cast<float*>(a.lse.data), static_cast<const int32_t*>(a.target.data),
                                   static_cast<const float*>(a.target_logit.data), static_cast<float*>(a.loss.data), ignore_index, stream);
#else
    (void)stream;
    return gemm::no_cuda(a.partials, "partials");
#endif
  }
  reference::lse_finish(a, ignore_index);
  return Status::ok();
}

Status run(const CrossEntropyBwdArgs& a, int ignore_index, Stream stream) {
  ENCORE_RETURN_IF_ERROR(checks::present("logits", a.logits));
  ENCORE_RETURN_IF_ERROR(checks::ndim("logits", a.logits, 2, "[M, N]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("logits", a.logits, kIo));
  const int64_t M = a.logits.shape[0], N = a.logits.shape[1];
  ENCORE_RETURN_IF_ERROR(matrix("dlogits", a.dlogits, M, N, "[M, N] (logits' shape)", a.logits, {a.logits.dtype}));
  ENCORE_RETURN_IF_ERROR(vector("lse", a.lse, M, "[M]", a.logits, {DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(vector("target", a.target, M, "[M]", a.logits, {DType::kInt32}));
  if (a.alpha.defined()) ENCORE_RETURN_IF_ERROR(vector("alpha", a.alpha, 1, "[1]", a.logits, {DType::kFP32}));
  const bool in_place = a.dlogits.data == a.logits.data && a.dlogits.strides[0] == a.logits.strides[0] && a.dlogits.strides[1] == a.logits.strides[1];
  if (!in_place) ENCORE_RETURN_IF_ERROR(checks::no_overlap("dlogits", a.dlogits, "logits", a.logits));
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"lse", &a.lse}, {"target", &a.target}, {"alpha", &a.alpha}})
    if (t->defined()) ENCORE_RETURN_IF_ERROR(checks::no_overlap("dlogits", a.dlogits, name, *t));
  if (a.logits.device.is_cuda()) {
    ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("logits", a.logits));
    ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("dlogits", a.dlogits));
    for (auto [name, t] : {std::pair<const char*, const TensorView*>{"lse", &a.lse}, {"target", &a.target}})
      ENCORE_RETURN_IF_ERROR(contiguous_vector(name, *t));
    if (M >= (int64_t(1) << 31) || N >= (int64_t(1) << 31)) return Status::unsupported("logits: M and N must be < 2^31");
    ENCORE_RETURN_IF_ERROR(checks::device_memory({{"logits", &a.logits}, {"dlogits", &a.dlogits}, {"lse", &a.lse}, {"target", &a.target},
                                                  {"alpha", &a.alpha}}));
#ifdef ENCORE_WITH_CUDA
    cuda::DeviceGuard guard;
    ENCORE_RETURN_IF_ERROR(guard.set(a.logits.device.index));
    return cuda::launch_cross_entropy_bwd(a.logits.data, a.logits.strides[0], a.dlogits.data, a.dlogits.strides[0], a.logits.dtype, int(M), int(N),
                                          static_cast<const float*>(a.lse.data), static_cast<const int32_t*>(a.target.data),
                                          static_cast<const float*>(a.alpha.data), ignore_index, stream);
#else
    (void)stream;
    return gemm::no_cuda(a.logits, "logits");
#endif
  }
  for (int64_t m = 0; m < M; ++m) {  // host data: check the targets
    const int32_t t = static_cast<const int32_t*>(a.target.data)[m * a.target.strides[0]];
    if (t != ignore_index && (t < 0 || t >= N))
      return Status::invalid("target: row " + std::to_string(m) + " has target " + std::to_string(t) + ", outside [0, " + std::to_string(N) +
                             ") and not ignore_index (" + std::to_string(ignore_index) + ")");
  }
  reference::cross_entropy_bwd(a, ignore_index);
  return Status::ok();
}

namespace gemm {

Status check_run(const CeMeanArgs& a) {
  ENCORE_RETURN_IF_ERROR(checks::present("target", a.target));
  ENCORE_RETURN_IF_ERROR(checks::ndim("target", a.target, 1, "[M]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("target", a.target, {DType::kInt32}));
  const int64_t M = a.target.shape[0];
  if (a.loss.defined() || a.loss_rows.defined()) {
    ENCORE_RETURN_IF_ERROR(vector("loss_rows", a.loss_rows, M, "[M] (target's length)", a.target, {DType::kFP32}));
    ENCORE_RETURN_IF_ERROR(vector("loss", a.loss, 1, "[1]", a.target, {DType::kFP32}));
  }
  if (a.alpha.defined() || a.d_loss.defined()) {
    ENCORE_RETURN_IF_ERROR(vector("d_loss", a.d_loss, 1, "[1]", a.target, {DType::kFP32}));
    ENCORE_RETURN_IF_ERROR(vector("alpha", a.alpha, 1, "[1]", a.target, {DType::kFP32}));
  }
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"loss", &a.loss}, {"alpha", &a.alpha}}) {
    if (!t->defined()) continue;
    for (auto [iname, in] : {std::pair<const char*, const TensorView*>{"target", &a.target}, {"loss_rows", &a.loss_rows}, {"d_loss", &a.d_loss}})
      if (in->defined()) ENCORE_RETURN_IF_ERROR(checks::no_overlap(name, *t, iname, *in));
  }
  if (a.loss.defined() && a.alpha.defined()) ENCORE_RETURN_IF_ERROR(checks::no_overlap("alpha", a.alpha, "loss", a.loss));
  if (a.target.device.is_cuda()) {
    for (auto [name, t] : {std::pair<const char*, const TensorView*>{"target", &a.target}, {"loss_rows", &a.loss_rows}})
      ENCORE_RETURN_IF_ERROR(contiguous_vector(name, *t));
    if (M >= (int64_t(1) << 31)) return Status::unsupported("target: M must be < 2^31");
    ENCORE_RETURN_IF_ERROR(checks::device_memory({{"target", &a.target}, {"loss_rows", &a.loss_rows}, {"loss", &a.loss}, {"d_loss", &a.d_loss},
                                                  {"alpha", &a.alpha}}));
  }
  return Status::ok();
}

}  // namespace gemm

Status run(const CeMeanArgs& a, int ignore_index, Stream stream) {
  ENCORE_RETURN_IF_ERROR(gemm::check_run(a));
  if (a.target.device.is_cuda()) {
#ifdef ENCORE_WITH_CUDA
    cuda::DeviceGuard guard;
    ENCORE_RETURN_IF_ERROR(guard.set(a.target.device.index));
    return cuda::launch_ce_mean(static_cast<const int32_t*>(a.target.data), int(a.target.shape[0]), static_cast<const float*>(a.loss_rows.data),
                                static_cast<float*>(a.loss.data), static_cast<const float*>(a.d_loss.data), static_cast<float*>(a.alpha.data),
                                ignore_index, stream);
#else
    (void)stream;
    return gemm::no_cuda(a.target, "target");
#endif
  }
  reference::ce_mean(a, ignore_index);
  return Status::ok();
}

namespace gemm {

Status check_run(const PartialsSumArgs& a, PartialsSum axis, float scale) {
  ENCORE_RETURN_IF_ERROR(checks::present("partials", a.partials));
  ENCORE_RETURN_IF_ERROR(checks::ndim("partials", a.partials, 2, "[rows, cols]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("partials", a.partials, {DType::kFP32}));
  if (axis != PartialsSum::kPerRow && axis != PartialsSum::kPerColumn)
    return Status::invalid("axis: must be PartialsSum::kPerRow or kPerColumn, got " + std::to_string(int(axis)));
  if (!std::isfinite(scale)) return Status::invalid("scale: must be finite");
  const int64_t rows = a.partials.shape[0], cols = a.partials.shape[1];
  if (axis == PartialsSum::kPerRow) {
    ENCORE_RETURN_IF_ERROR(vector("out", a.out, rows, "[rows]", a.partials, {DType::kFP32}));
  } else {
    ENCORE_RETURN_IF_ERROR(checks::present("out", a.out));
    ENCORE_RETURN_IF_ERROR(checks::ndim("out", a.out, 1, "[n]"));
    if (a.out.shape[0] > cols)
      return Status::invalid("out: expected [n] with n <= " + std::to_string(cols) + " (the partials' columns), got " + a.out.shape_string());
    ENCORE_RETURN_IF_ERROR(vector("out", a.out, a.out.shape[0], "[n]", a.partials, {DType::kFP32}));
  }
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("out", a.out, "partials", a.partials));
  if (a.partials.device.is_cuda()) {
    ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("partials", a.partials));
    ENCORE_RETURN_IF_ERROR(contiguous_vector("out", a.out));
    if (rows >= (int64_t(1) << 31) || cols >= (int64_t(1) << 31)) return Status::unsupported("partials: dimensions must be < 2^31");
    ENCORE_RETURN_IF_ERROR(checks::device_memory({{"partials", &a.partials}, {"out", &a.out}}));
  }
  return Status::ok();
}

}  // namespace gemm

Status run(const PartialsSumArgs& a, PartialsSum axis, float scale, Stream stream) {
  ENCORE_RETURN_IF_ERROR(gemm::check_run(a, axis, scale));
  if (a.partials.device.is_cuda()) {
#ifdef ENCORE_WITH_CUDA
    cuda::DeviceGuard guard;
    ENCORE_RETURN_IF_ERROR(guard.set(a.partials.device.index));
    return cuda::launch_partials_sum(static_cast<const float*>(a.partials.data), a.partials.strides[0], int(a.partials.shape[0]), int(a.partials.shape[1]),
                                     static_cast<float*>(a.out.data), int(a.out.shape[0]), axis == PartialsSum::kPerColumn, scale, stream);
#else
    (void)stream;
    return gemm::no_cuda(a.partials, "partials");
#endif
  }
  reference::partials_sum(a, axis, scale);
  return Status::ok();
}

Status run(const QkNormRopeArgs& a, const QkNormRopeOptions& o, Stream stream) {
  ENCORE_RETURN_IF_ERROR(gemm::qk_norm_rope_operands("qkv", a.qkv, a.partials, a.q_weight, a.k_weight, a.pos, a.freq, o));
  const int64_t M = a.qkv.shape[0];
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("qkv", a.qkv, "partials", a.partials));
  if (a.qkv.device.is_cuda()) {
    ENCORE_RETURN_IF_ERROR(checks::device_memory({{"qkv", &a.qkv}, {"partials", &a.partials}, {"q_weight", &a.q_weight}, {"k_weight", &a.k_weight},
                                                  {"pos", &a.pos}, {"freq", &a.freq}}));
#ifdef ENCORE_WITH_CUDA
    cuda::DeviceGuard guard;
    ENCORE_RETURN_IF_ERROR(guard.set(a.qkv.device.index));
    cuda::QkNormRopeProblem p;
    p.qkv = a.qkv.data;
    p.ld_qkv = a.qkv.strides[0];
    p.dtype = a.qkv.dtype;
    p.partials = static_cast<const float*>(a.partials.data);
    p.ld_partials = a.partials.strides[0];
    p.q_weight = a.q_weight.data;
    p.k_weight = a.k_weight.data;
    p.weight_fp32 = a.q_weight.dtype == DType::kFP32;
    p.pos = static_cast<const int32_t*>(a.pos.data);
    p.freq = static_cast<const float*>(a.freq.data);
    p.M = int(M);
    p.num_q_heads = o.num_q_heads;
    p.qk_heads = o.num_q_heads + o.num_kv_heads;
    p.head_dim = o.head_dim;
    p.eps = o.eps;
    return cuda::launch_qk_norm_rope(p, stream);
#else
    (void)stream;
    return gemm::no_cuda(a.qkv, "qkv");
#endif
  }
  reference::qk_norm_rope(a, o);
  return Status::ok();
}

namespace gemm {

Status check_run(const RopeBwdZdzArgs& a, float scale) {
  ENCORE_RETURN_IF_ERROR(checks::present("y", a.y));
  ENCORE_RETURN_IF_ERROR(checks::ndim("y", a.y, 2, "[M, N]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("y", a.y, kIo));
  const int64_t M = a.y.shape[0], N = a.y.shape[1];
  if (N % 2 != 0) return Status::invalid("y: N = " + std::to_string(N) + " must be even (RoPE column pairs)");
  ENCORE_RETURN_IF_ERROR(matrix("dy", a.dy, M, N, "[M, N] (y's shape)", a.y, {a.y.dtype}));
  ENCORE_RETURN_IF_ERROR(matrix("dz", a.dz, M, N, "[M, N] (y's shape)", a.y, {a.y.dtype}));
  ENCORE_RETURN_IF_ERROR(vector("pos", a.pos, M, "[M]", a.y, {DType::kInt32}));
  ENCORE_RETURN_IF_ERROR(vector("freq", a.freq, N, "[N] (hi, lo) pairs", a.y, {DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(vector("zdz", a.zdz, M, "[M]", a.y, {DType::kFP32}));
  if (!std::isfinite(scale)) return Status::invalid("scale: must be finite");
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("dz", a.dz, "y", a.y));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("dz", a.dz, "dy", a.dy));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("zdz", a.zdz, "dz", a.dz));
  if (a.y.device.is_cuda()) {
    for (auto [name, t] : {std::pair<const char*, const TensorView*>{"pos", &a.pos}, {"freq", &a.freq}, {"zdz", &a.zdz}})
      ENCORE_RETURN_IF_ERROR(contiguous_vector(name, *t));
    if (!checks::aligned(a.freq.data, 8)) return Status::invalid("freq: must be 8-byte aligned on CUDA ((hi, lo) pairs)");
    for (auto [name, t] : {std::pair<const char*, const TensorView*>{"y", &a.y}, {"dy", &a.dy}, {"dz", &a.dz}})
      ENCORE_RETURN_IF_ERROR(checks::unit_last_stride(name, *t));
    if (M >= (int64_t(1) << 31) || N >= (int64_t(1) << 31)) return Status::unsupported("y: M and N must be < 2^31");
    ENCORE_RETURN_IF_ERROR(checks::device_memory({{"y", &a.y}, {"dy", &a.dy}, {"pos", &a.pos}, {"freq", &a.freq}, {"dz", &a.dz}, {"zdz", &a.zdz}}));
  }
  return Status::ok();
}

}  // namespace gemm

Status run(const RopeBwdZdzArgs& a, float scale, Stream stream) {
  ENCORE_RETURN_IF_ERROR(gemm::check_run(a, scale));
  if (a.y.device.is_cuda()) {
#ifdef ENCORE_WITH_CUDA
    cuda::DeviceGuard guard;
    ENCORE_RETURN_IF_ERROR(guard.set(a.y.device.index));
    gemm::RopeBwdZdzProblem p;
    p.y = a.y.data;
    p.dy = a.dy.data;
    p.dz = a.dz.data;
    p.ld_y = a.y.strides[0];
    p.ld_dy = a.dy.strides[0];
    p.ld_dz = a.dz.strides[0];
    p.dtype = a.y.dtype;
    p.pos = static_cast<const int32_t*>(a.pos.data);
    p.freq = static_cast<const float*>(a.freq.data);
    p.zdz = static_cast<float*>(a.zdz.data);
    p.M = int(a.y.shape[0]);
    p.N = int(a.y.shape[1]);
    p.scale = scale;
    return cuda::launch_rope_bwd_zdz(p, stream);
#else
    (void)stream;
    return gemm::no_cuda(a.y, "y");
#endif
  }
  reference::rope_bwd_zdz(a, scale);
  return Status::ok();
}

Status interleave_gate_up(const TensorView& gate, const TensorView& up, const TensorView& out) {
  ENCORE_RETURN_IF_ERROR(checks::present("gate", gate));
  ENCORE_RETURN_IF_ERROR(checks::ndim("gate", gate, 2, "[F, K]"));
  const int64_t F = gate.shape[0], K = gate.shape[1];
  ENCORE_RETURN_IF_ERROR(matrix("up", up, F, K, "[F, K]", gate, {gate.dtype}));
  ENCORE_RETURN_IF_ERROR(matrix("out", out, 2 * F, K, "[2F, K]", gate, {gate.dtype}));
  if (gate.device.is_cuda()) return Status::unsupported("gate: interleave_gate_up takes CPU tensors");
  for (int64_t f = 0; f < F; ++f)
    for (int64_t k = 0; k < K; ++k) {
      store_from_double(out.data, out.dtype, (2 * f) * out.strides[0] + k * out.strides[1],
                        load_as_double(gate.data, gate.dtype, f * gate.strides[0] + k * gate.strides[1]));
      store_from_double(out.data, out.dtype, (2 * f + 1) * out.strides[0] + k * out.strides[1],
                        load_as_double(up.data, up.dtype, f * up.strides[0] + k * up.strides[1]));
    }
  return Status::ok();
}

Status rope_freq_turns(int num_heads, int rotary_heads, int head_dim, double base, const TensorView& freq) {
  if (num_heads < 1 || rotary_heads < 0 || rotary_heads > num_heads)
    return Status::invalid("rotary_heads: must lie in [0, num_heads], with num_heads >= 1");
  if (head_dim < 2 || head_dim % 2 != 0) return Status::invalid("head_dim: must be even and >= 2, got " + std::to_string(head_dim));
  if (!(base > 1.0)) return Status::invalid("base: must be > 1");
  ENCORE_RETURN_IF_ERROR(checks::present("freq", freq));
  ENCORE_RETURN_IF_ERROR(checks::ndim("freq", freq, 1, "[num_heads * head_dim]"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("freq", freq, 0, int64_t(num_heads) * head_dim, "num_heads * head_dim"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("freq", freq, {DType::kFP32}));
  if (freq.device.is_cuda()) return Status::unsupported("freq: rope_freq_turns fills a CPU tensor");
  auto* f = static_cast<float*>(freq.data);
  const int pairs_per_head = head_dim / 2;
  for (int h = 0; h < num_heads; ++h)
    for (int i = 0; i < pairs_per_head; ++i) {
      const double turns = h < rotary_heads ? std::pow(base, -2.0 * i / head_dim) / 6.283185307179586 : 0.0;
      const float hi = float(turns), lo = float(turns - double(hi));
      const int64_t j = int64_t(h) * pairs_per_head + i;
      f[(2 * j) * freq.strides[0]] = hi;
      f[(2 * j + 1) * freq.strides[0]] = lo;
    }
  return Status::ok();
}

}  // namespace encore
