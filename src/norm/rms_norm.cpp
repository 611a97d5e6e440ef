// Norm family dispatch: validate -> problem + plan -> CPU reference or CUDA kernel.
#include <algorithm>
#include <atomic>
#include <cmath>

#include "core/checks.hpp"
#include "core/device_memory.hpp"
#include "encore/core/device_info.hpp"
#include "encore/norm.hpp"
#include "norm/jit.hpp"
#include "norm/problem.hpp"
#include "norm/reference/norm_ref.hpp"
#ifdef ENCORE_WITH_CUDA
#include "norm/cuda/launch.hpp"
#endif

namespace encore {
namespace {

// Two views are either the same view (exact alias: same pointer, shape and strides, a dimension of
// size 1 having no stride that matters) or disjoint in memory.
bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.ndim != b.ndim || a.shape != b.shape) return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] > 1 && a.strides[i] != b.strides[i]) return false;
  return true;
}

Status same_or_disjoint(const char* a_name, const TensorView& a, const char* b_name, const TensorView& b) {
  if (same_view(a, b)) return Status::ok();
  Status st = checks::no_overlap(a_name, a, b_name, b);
  if (!st) return Status::invalid(st.message() + " (outputs may alias an input only exactly: same pointer and strides)");
  return st;
}

Status validate_common(const TensorView& x, const TensorView& weight, const RmsNormOptions& opts) {
  ENCORE_RETURN_IF_ERROR(checks::present("x", x));
  ENCORE_RETURN_IF_ERROR(checks::ndim("x", x, 2, "[rows, hidden]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("x", x, {DType::kBF16, DType::kFP16, DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("x", x));
  ENCORE_RETURN_IF_ERROR(checks::rows_disjoint("x", x));
  if (x.shape[1] > (int64_t(1) << 30)) return Status::unsupported("x: hidden size " + std::to_string(x.shape[1]) + " exceeds 2^30");
  // CUDA: one block (or a team) per row, the grid a 32-bit count of blocks (the row offsets are 64-bit).
  if (x.device.is_cuda() && x.shape[0] >= (int64_t(1) << 31))
    return Status::unsupported("x: " + std::to_string(x.shape[0]) + " rows; the CUDA kernels take fewer than 2^31");
  ENCORE_RETURN_IF_ERROR(checks::present("weight", weight));
  ENCORE_RETURN_IF_ERROR(checks::ndim("weight", weight, 1, "[hidden]"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("weight", weight, 0, x.shape[1], "x's hidden size"));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("weight", weight));
  ENCORE_RETURN_IF_ERROR(checks::same_dtype("weight", weight, "x", x));
  ENCORE_RETURN_IF_ERROR(checks::same_device("weight", weight, "x", x));
  if (!(opts.eps >= 0.0f) || !std::isfinite(opts.eps)) return Status::invalid("eps: must be finite and >= 0, got " + std::to_string(opts.eps));
  if (!std::isfinite(opts.weight_offset)) return Status::invalid("weight_offset: must be finite");
  return Status::ok();
}

// A [rows, hidden] tensor matching x in shape, dtype and device.
Status validate_like_x(const char* name, const TensorView& t, const TensorView& x) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  ENCORE_RETURN_IF_ERROR(checks::ndim(name, t, 2, "[rows, hidden]"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals(name, t, 0, x.shape[0], "x's rows"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals(name, t, 1, x.shape[1], "x's hidden size"));
  ENCORE_RETURN_IF_ERROR(checks::same_dtype(name, t, "x", x));
  ENCORE_RETURN_IF_ERROR(checks::same_device(name, t, "x", x));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride(name, t));
  ENCORE_RETURN_IF_ERROR(checks::rows_disjoint(name, t));
  return Status::ok();
}

norm::RmsNormProblem make_problem(const TensorView& x, const TensorView* residual, const TensorView& weight,
                                  const TensorView& y, const TensorView* h, const RmsNormOptions& opts) {
  norm::RmsNormProblem p;
  p.x = x.data;
  p.x_stride = x.strides[0];
  if (residual) {
    p.residual = residual->data;
    p.residual_stride = residual->strides[0];
    p.h = h->data;
    p.h_stride = h->strides[0];
  }
  p.weight = weight.data;
  p.y = y.data;
  p.y_stride = y.strides[0];
  p.rows = x.shape[0];
  p.hidden = x.shape[1];
  p.dtype = x.dtype;
  p.eps = opts.eps;
  p.weight_offset = opts.weight_offset;
  p.device_index = x.device.index;
  return p;
}

// Packs of `bytes` (16 or 32) are possible when every pointer is that aligned and hidden and every
// row stride are whole packs.
bool can_vectorize(const norm::RmsNormProblem& p, int64_t bytes = 16) {
  const int64_t pack = bytes / int64_t(dtype_size(p.dtype));
  auto ok_ptr = [&](const void* ptr) { return ptr == nullptr || checks::aligned(ptr, size_t(bytes)); };
  auto ok_stride = [&](int64_t s) { return p.rows == 1 || s % pack == 0; };
  return p.hidden % pack == 0 && ok_ptr(p.x) && ok_ptr(p.residual) && ok_ptr(p.weight) && ok_ptr(p.y) && ok_ptr(p.h) &&
         ok_stride(p.x_stride) && ok_stride(p.y_stride) && (!p.residual || (ok_stride(p.residual_stride) && ok_stride(p.h_stride)));
}

std::atomic<int64_t> g_wide_plans{0};

bool is_split(RmsNormPath path) {
  return path == RmsNormPath::kSplitRowTwoLaunch || path == RmsNormPath::kSplitRowBarrier;
}

// The split-row paths' extra constraints (CUDA tensors only; the CPU backend ignores the path).
Status validate_path(const norm::RmsNormProblem& p, Device device, const RmsNormOptions& opts) {
  if (!is_split(opts.path) || !device.is_cuda()) return Status::ok();
  if (p.rows > norm::kSplitRowMaxRows)
    return Status::invalid("x: the split-row paths take at most " + std::to_string(norm::kSplitRowMaxRows) + " rows, got " +
                           std::to_string(p.rows));
  if (!can_vectorize(p))
    return Status::invalid("x: the split-row paths need 16-byte aligned pointers and rows (hidden and row strides multiples of 16 bytes)");
  return Status::ok();
}

Status execute(const norm::RmsNormProblem& p, Device device, const RmsNormOptions& opts, void* workspace, Stream stream) {
  if (!device.is_cuda()) {
    reference::rms_norm(p);
    return Status::ok();
  }
#ifdef ENCORE_WITH_CUDA
  if (is_split(opts.path)) {
    if (workspace == nullptr || !checks::aligned(workspace, 16))
      return Status::invalid("workspace: the split-row paths need a 16-byte aligned workspace of workspace_bytes() bytes");
    return cuda::launch_rms_norm_split(p, opts.path == RmsNormPath::kSplitRowBarrier, workspace, stream);
  }
  const DeviceInfo* info = nullptr;
  ENCORE_RETURN_IF_ERROR(get_device_info(device.index, &info));
  norm::RmsNormLaunchPlan plan = norm::plan_rms_norm(p.rows, p.hidden, p.dtype, can_vectorize(p), p.residual != nullptr, info->sm_count);
  if (norm::norm_wide_packs(info->cc_major) && can_vectorize(p, 32)) {
    const norm::RmsNormLaunchPlan wide = norm::widen_rms_norm_plan(plan, p.dtype);
    if (wide.vec_elems != plan.vec_elems) g_wide_plans.fetch_add(1, std::memory_order_relaxed);
    plan = wide;
  }
  if (norm::rms_norm_uses_jit(p.hidden)) {  // docs/jit.md: the hidden size baked in
    Status st = norm::launch_rms_norm_jit(p, plan, stream);
    if (norm::rms_norm_jit_family().handled(st, stream)) return st;  // ran, or refused during a graph capture
  }
  return cuda::launch_rms_norm(p, plan, stream);
#else
  (void)stream;
  (void)workspace;
  (void)opts;
  return Status::unsupported("x: tensors are on " + device.to_string() + " but encore was built without CUDA (ENCORE_CUDA=OFF)");
#endif
}

Status init_workspace(Device device, const RmsNormOptions& opts, void* workspace, Stream stream) {
  if (opts.path != RmsNormPath::kSplitRowBarrier || !device.is_cuda()) return Status::ok();
  if (workspace == nullptr) return Status::invalid("workspace: null; kSplitRowBarrier needs workspace_bytes() bytes");
  ENCORE_RETURN_IF_ERROR(checks::device_pointer("workspace", workspace, device));
#ifdef ENCORE_WITH_CUDA
  return cuda::zero_split_barrier(workspace, device.index, stream);
#else
  (void)stream;
  return Status::unsupported("workspace: encore was built without CUDA");
#endif
}

}  // namespace

Status validate(const RmsNormArgs& a, const RmsNormOptions& opts) {
  ENCORE_RETURN_IF_ERROR(validate_common(a.x, a.weight, opts));
  ENCORE_RETURN_IF_ERROR(validate_like_x("y", a.y, a.x));
  ENCORE_RETURN_IF_ERROR(same_or_disjoint("y", a.y, "x", a.x));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("y", a.y, "weight", a.weight));
  return validate_path(make_problem(a.x, nullptr, a.weight, a.y, nullptr, opts), a.x.device, opts);
}

size_t workspace_bytes(const RmsNormArgs& a, const RmsNormOptions& opts) {
  return is_split(opts.path) ? norm::split_row_workspace_bytes(a.x.shape[0], a.x.shape[1], a.x.dtype) : 0;
}

Status run(const RmsNormArgs& a, const RmsNormOptions& opts, void* workspace, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, opts));
  ENCORE_RETURN_IF_ERROR(checks::device_memory({{"x", &a.x}, {"weight", &a.weight}, {"y", &a.y}}));  // CUDA views only
  if (is_split(opts.path)) ENCORE_RETURN_IF_ERROR(checks::device_pointer("workspace", workspace, a.x.device));
  return execute(make_problem(a.x, nullptr, a.weight, a.y, nullptr, opts), a.x.device, opts, workspace, stream);
}

Status initialize_workspace(const RmsNormArgs& a, const RmsNormOptions& opts, void* workspace, Stream stream) {
  return init_workspace(a.x.device, opts, workspace, stream);
}

Status validate(const AddRmsNormArgs& a, const RmsNormOptions& opts) {
  ENCORE_RETURN_IF_ERROR(validate_common(a.x, a.weight, opts));
  ENCORE_RETURN_IF_ERROR(validate_like_x("residual", a.residual, a.x));
  ENCORE_RETURN_IF_ERROR(validate_like_x("y", a.y, a.x));
  ENCORE_RETURN_IF_ERROR(validate_like_x("h", a.h, a.x));
  ENCORE_RETURN_IF_ERROR(same_or_disjoint("h", a.h, "x", a.x));
  ENCORE_RETURN_IF_ERROR(same_or_disjoint("h", a.h, "residual", a.residual));
  ENCORE_RETURN_IF_ERROR(same_or_disjoint("y", a.y, "x", a.x));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("y", a.y, "residual", a.residual));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("y", a.y, "h", a.h));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("y", a.y, "weight", a.weight));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("h", a.h, "weight", a.weight));
  return validate_path(make_problem(a.x, &a.residual, a.weight, a.y, &a.h, opts), a.x.device, opts);
}

size_t workspace_bytes(const AddRmsNormArgs& a, const RmsNormOptions& opts) {
  return is_split(opts.path) ? norm::split_row_workspace_bytes(a.x.shape[0], a.x.shape[1], a.x.dtype) : 0;
}

Status run(const AddRmsNormArgs& a, const RmsNormOptions& opts, void* workspace, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, opts));
  ENCORE_RETURN_IF_ERROR(checks::device_memory({{"x", &a.x}, {"residual", &a.residual}, {"weight", &a.weight}, {"y", &a.y}, {"h", &a.h}}));
  if (is_split(opts.path)) ENCORE_RETURN_IF_ERROR(checks::device_pointer("workspace", workspace, a.x.device));
  return execute(make_problem(a.x, &a.residual, a.weight, a.y, &a.h, opts), a.x.device, opts, workspace, stream);
}

Status initialize_workspace(const AddRmsNormArgs& a, const RmsNormOptions& opts, void* workspace, Stream stream) {
  return init_workspace(a.x.device, opts, workspace, stream);
}

int64_t norm::rms_norm_wide_plan_count() { return g_wide_plans.load(); }

}  // namespace encore
