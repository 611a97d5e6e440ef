// FP8 group quantization dispatch: validate -> problem -> CPU reference or CUDA kernel; and the
// CPU dequantization.
#include <cmath>

#include "core/checks.hpp"
#include "core/device_memory.hpp"
#include "encore/core/device_info.hpp"
#include "encore/quant.hpp"
#include "quant/jit.hpp"
#include "quant/problem.hpp"
#include "quant/reference/quant_ref.hpp"
#ifdef ENCORE_WITH_CUDA
#include "quant/cuda/launch.hpp"
#endif

namespace encore {
namespace {

// scales [M, G] fp32 whose elements do not overlap: row-major-like (stride_g 1, stride_m >= G) or
// column-major-like (stride_m 1, stride_g >= M).
Status validate_scales(const TensorView& s, int64_t rows, int64_t groups, const TensorView& x) {
  ENCORE_RETURN_IF_ERROR(checks::present("scales", s));
  ENCORE_RETURN_IF_ERROR(checks::ndim("scales", s, 2, "[M, K / group_size]"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("scales", s, 0, rows, "x's rows (M)"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("scales", s, 1, groups, "K / group_size"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("scales", s, {DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(checks::same_device("scales", s, "x", x));
  const int64_t sm = s.strides[0], sg = s.strides[1];
  const bool row_major = (groups == 1 || sg == 1) && (rows == 1 || sm >= groups);
  const bool col_major = (rows == 1 || sm == 1) && (groups == 1 || sg >= rows);
  if (!row_major && !col_major)
    return Status::invalid("scales: strides {" + std::to_string(sm) + ", " + std::to_string(sg) +
                           "} must be row-major {>= K/group_size, 1} or column-major {1, >= M}");
  return Status::ok();
}

quant::Fp8QuantProblem make_problem(const Fp8GroupQuantArgs& a, const Fp8GroupQuantOptions& o) {
  quant::Fp8QuantProblem p;
  p.x = a.x.data;
  p.x_stride = a.x.strides[0];
  p.q = static_cast<uint8_t*>(a.q.data);
  p.q_stride = a.q.strides[0];
  p.scales = static_cast<float*>(a.scales.data);
  p.scale_stride_m = a.scales.strides[0];
  p.scale_stride_g = a.scales.strides[1];
  p.rows = a.x.shape[0];
  p.cols = a.x.shape[1];
  p.group_size = o.group_size;
  p.dtype = a.x.dtype;
  p.power_of_two = o.power_of_two_scales;
  p.eps = o.eps;
  p.device_index = a.x.device.index;
  return p;
}

}  // namespace

Status validate(const Fp8GroupQuantArgs& a, const Fp8GroupQuantOptions& o) {
  if (o.group_size != 128) return Status::unsupported("group_size: only 128 is supported, got " + std::to_string(o.group_size));
  if (!(o.eps > 0.0f) || !std::isfinite(o.eps)) return Status::invalid("eps: must be finite and > 0");
  ENCORE_RETURN_IF_ERROR(checks::present("x", a.x));
  ENCORE_RETURN_IF_ERROR(checks::ndim("x", a.x, 2, "[M, K]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("x", a.x, {DType::kBF16, DType::kFP16, DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("x", a.x));
  ENCORE_RETURN_IF_ERROR(checks::rows_disjoint("x", a.x));
  const int64_t rows = a.x.shape[0], cols = a.x.shape[1];
  if (cols % o.group_size != 0)
    return Status::invalid("x: K = " + std::to_string(cols) + " must be a multiple of group_size (" + std::to_string(o.group_size) + ")");
  if (rows * (cols / o.group_size) >= (int64_t(1) << 31)) return Status::unsupported("x: M * K / group_size must be < 2^31");
  // CUDA: a group's column offset within its row is 32-bit (group index * 128).
  if (a.x.device.is_cuda() && cols >= (int64_t(1) << 31))
    return Status::unsupported("x: K = " + std::to_string(cols) + " columns; the CUDA kernels take fewer than 2^31");
  if (!checks::aligned(a.x.data, 16) || (rows > 1 && (a.x.strides[0] * int64_t(a.x.element_size())) % 16 != 0))
    return Status::invalid("x: data pointer and row stride must be 16-byte aligned");
  ENCORE_RETURN_IF_ERROR(checks::present("q", a.q));
  ENCORE_RETURN_IF_ERROR(checks::ndim("q", a.q, 2, "[M, K]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("q", a.q, {DType::kFP8E4M3}));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("q", a.q, 0, rows, "x's rows (M)"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("q", a.q, 1, cols, "x's columns (K)"));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("q", a.q));
  ENCORE_RETURN_IF_ERROR(checks::rows_disjoint("q", a.q));
  ENCORE_RETURN_IF_ERROR(checks::same_device("q", a.q, "x", a.x));
  if (!checks::aligned(a.q.data, 16) || (rows > 1 && a.q.strides[0] % 16 != 0))
    return Status::invalid("q: data pointer and row stride must be 16-byte aligned");
  ENCORE_RETURN_IF_ERROR(validate_scales(a.scales, rows, cols / o.group_size, a.x));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("q", a.q, "x", a.x));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("scales", a.scales, "x", a.x));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("scales", a.scales, "q", a.q));
  return Status::ok();
}

size_t workspace_bytes(const Fp8GroupQuantArgs&, const Fp8GroupQuantOptions&) { return 0; }

Status run(const Fp8GroupQuantArgs& a, const Fp8GroupQuantOptions& o, void*, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  const quant::Fp8QuantProblem p = make_problem(a, o);
  if (!a.x.device.is_cuda()) {
    reference::fp8_group_quant(p);
    return Status::ok();
  }
  ENCORE_RETURN_IF_ERROR(checks::device_memory({{"x", &a.x}, {"q", &a.q}, {"scales", &a.scales}}));
#ifdef ENCORE_WITH_CUDA
  const DeviceInfo* info = nullptr;
  ENCORE_RETURN_IF_ERROR(get_device_info(a.x.device.index, &info));
  const quant::Fp8QuantLaunchPlan plan = quant::plan_fp8_group_quant(p, info->sm_count);
  if (quant::fp8_group_quant_uses_jit(p)) {  // docs/jit.md: K baked in
    Status st = quant::launch_fp8_group_quant_jit(p, plan, stream);
    if (quant::fp8_group_quant_jit_family().handled(st, stream)) return st;  // ran, or refused during a graph capture
  }
  return cuda::launch_fp8_group_quant(p, plan, stream);
#else
  (void)stream;
  return Status::unsupported("x: on " + a.x.device.to_string() + " but encore was built without CUDA (ENCORE_CUDA=OFF)");
#endif
}

Status run(const Fp8GroupDequantArgs& a, const Fp8GroupQuantOptions& o) {
  ENCORE_RETURN_IF_ERROR(checks::present("q", a.q));
  ENCORE_RETURN_IF_ERROR(checks::ndim("q", a.q, 2, "[M, K]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("q", a.q, {DType::kFP8E4M3}));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("q", a.q));
  if (a.q.device.is_cuda()) return Status::unsupported("q: dequantization runs on the CPU backend only");
  const int64_t rows = a.q.shape[0], cols = a.q.shape[1];
  if (o.group_size <= 0 || cols % o.group_size != 0)
    return Status::invalid("q: K = " + std::to_string(cols) + " must be a multiple of group_size");
  ENCORE_RETURN_IF_ERROR(validate_scales(a.scales, rows, cols / o.group_size, a.q));
  ENCORE_RETURN_IF_ERROR(checks::present("x", a.x));
  ENCORE_RETURN_IF_ERROR(checks::ndim("x", a.x, 2, "[M, K]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("x", a.x, {DType::kFP32, DType::kBF16}));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("x", a.x, 0, rows, "q's rows"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("x", a.x, 1, cols, "q's columns"));
  ENCORE_RETURN_IF_ERROR(checks::same_device("x", a.x, "q", a.q));
  const auto* q = static_cast<const uint8_t*>(a.q.data);
  const auto* s = static_cast<const float*>(a.scales.data);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t k = 0; k < cols; ++k) {
      const float scale = s[m * a.scales.strides[0] + (k / o.group_size) * a.scales.strides[1]];
      store_from_double(a.x.data, a.x.dtype, m * a.x.strides[0] + k * a.x.strides[1], double(e4m3_to_float(q[m * a.q.strides[0] + k]) * scale));
    }
  return Status::ok();
}

}  // namespace encore
