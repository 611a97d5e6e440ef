// MXFP8 / NVFP4 dispatch: validate -> problem -> CPU reference or CUDA kernels (src/quant/cuda/mx_quant.cu), for the
// quantization and its inverse.
#include <cmath>
#include <string>

#include "core/checks.hpp"
#include "core/device_memory.hpp"
#include "encore/quant.hpp"
#include "quant/jit.hpp"
#include "quant/problem.hpp"
#include "quant/reference/mx_quant_ref.hpp"
#ifdef ENCORE_WITH_CUDA
#include "quant/cuda/launch.hpp"
#endif

namespace encore {
namespace {

using quant::MxKind;

struct Kind {
  MxKind kind;
  int block;
  const char* op;
};
constexpr Kind kMx{MxKind::kMxfp8, quant::kMxfp8Block, "mxfp8"};
constexpr Kind kNv{MxKind::kNvfp4, quant::kNvfp4Block, "nvfp4"};

std::string str(int64_t v) { return std::to_string(v); }

// The high-precision side: [M, K], K a multiple of the block.
Status validate_x(const TensorView& x, const Kind& k, std::initializer_list<DType> dtypes, bool input) {
  ENCORE_RETURN_IF_ERROR(checks::present("x", x));
  ENCORE_RETURN_IF_ERROR(checks::ndim("x", x, 2, "[M, K]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("x", x, dtypes));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("x", x));
  if (!input) ENCORE_RETURN_IF_ERROR(checks::rows_disjoint("x", x));
  if (x.shape[1] % k.block != 0)
    return Status::invalid("x: K = " + str(x.shape[1]) + " must be a multiple of " + str(k.block) + " (the " + k.op + " block)");
  if (x.shape[0] * x.shape[1] >= (int64_t(1) << 40)) return Status::unsupported("x: M * K must be < 2^40");
  return Status::ok();
}

// q: [M, K] e4m3 (MXFP8) or [M, K / 2] uint8 (NVFP4).
Status validate_q(const TensorView& q, const Kind& k, int64_t rows, int64_t cols, const TensorView& x, bool output) {
  ENCORE_RETURN_IF_ERROR(checks::present("q", q));
  ENCORE_RETURN_IF_ERROR(checks::ndim("q", q, 2, k.kind == MxKind::kMxfp8 ? "[M, K]" : "[M, K / 2]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("q", q, {k.kind == MxKind::kMxfp8 ? DType::kFP8E4M3 : DType::kUInt8}));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("q", q, 0, rows, "x's rows (M)"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("q", q, 1, k.kind == MxKind::kMxfp8 ? cols : cols / 2,
                                            k.kind == MxKind::kMxfp8 ? "x's columns (K)" : "K / 2 (two e2m1 codes a byte)"));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("q", q));
  if (output) ENCORE_RETURN_IF_ERROR(checks::rows_disjoint("q", q));
  return checks::same_device("q", q, "x", x);
}

// Row-major [M, K / block] (unit last stride, row stride >= K / block) or the swizzled buffer
// [pad128(M), pad4(K / block)] contiguous.
Status validate_scales(const TensorView& s, const Kind& k, int64_t rows, int64_t cols, bool swizzled, const TensorView& x) {
  ENCORE_RETURN_IF_ERROR(checks::present("scales", s));
  const int64_t sc = cols / k.block;
  ENCORE_RETURN_IF_ERROR(checks::ndim("scales", s, 2, swizzled ? "[ceil(M / 128) * 128, ceil(K / block / 4) * 4] (swizzled)" : "[M, K / block]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("scales", s, {k.kind == MxKind::kMxfp8 ? DType::kUInt8 : DType::kFP8E4M3}));
  ENCORE_RETURN_IF_ERROR(checks::same_device("scales", s, "x", x));
  if (swizzled) {
    ENCORE_RETURN_IF_ERROR(checks::dim_equals("scales", s, 0, quant::mx_padded_rows(rows), "M rounded up to 128 (swizzled layout)"));
    ENCORE_RETURN_IF_ERROR(checks::dim_equals("scales", s, 1, quant::mx_padded_scale_cols(sc), "K / block rounded up to 4 (swizzled layout)"));
    if (!s.is_contiguous()) return Status::invalid("scales: the swizzled layout must be contiguous");
    return Status::ok();
  }
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("scales", s, 0, rows, "x's rows (M)"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("scales", s, 1, sc, "K / block"));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("scales", s));
  return checks::rows_disjoint("scales", s);
}

Status validate_global(const TensorView& g, const TensorView& x) {
  ENCORE_RETURN_IF_ERROR(checks::present("global_scale", g));
  ENCORE_RETURN_IF_ERROR(checks::ndim("global_scale", g, 1, "[1]"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("global_scale", g, 0, 1, "1"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("global_scale", g, {DType::kFP32}));
  return checks::same_device("global_scale", g, "x", x);
}

Status validate_options(const MxQuantOptions& o, const Kind& k) {
  if (o.scale_layout != MxScaleLayout::kRowMajor && o.scale_layout != MxScaleLayout::kSwizzled)
    return Status::invalid("scale_layout: unknown value");
  if (o.rounding != MxScaleRounding::kFloor && o.rounding != MxScaleRounding::kRceil) return Status::invalid("rounding: unknown value");
  if (k.kind == MxKind::kNvfp4 && !(o.global_scale >= 0.0f && std::isfinite(o.global_scale)))
    return Status::invalid("global_scale: must be finite and >= 0 (0: computed from x)");
  return Status::ok();
}

quant::MxProblem make_problem(const Kind& k, const TensorView& x, const TensorView& q, const TensorView& s, float* global,
                              const MxQuantOptions& o) {
  quant::MxProblem p;
  p.kind = k.kind;
  p.x = x.data;
  p.x_stride = x.strides[0];
  p.dtype = x.dtype;
  p.q = static_cast<uint8_t*>(q.data);
  p.q_stride = q.strides[0];
  p.scales = static_cast<uint8_t*>(s.data);
  p.scale_stride = s.strides[0];
  p.swizzled = o.scale_layout == MxScaleLayout::kSwizzled;
  p.rceil = o.rounding == MxScaleRounding::kRceil;
  p.global_scale = global;
  p.given_global = o.global_scale;
  p.rows = x.shape[0];
  p.cols = x.shape[1];
  return p;
}

Status validate_quant(const Kind& k, const TensorView& x, const TensorView& q, const TensorView& s, const TensorView* g,
                      const MxQuantOptions& o) {
  ENCORE_RETURN_IF_ERROR(validate_options(o, k));
  ENCORE_RETURN_IF_ERROR(validate_x(x, k, {DType::kBF16, DType::kFP16, DType::kFP32}, true));
  const int64_t rows = x.shape[0], cols = x.shape[1];
  ENCORE_RETURN_IF_ERROR(validate_q(q, k, rows, cols, x, true));
  ENCORE_RETURN_IF_ERROR(validate_scales(s, k, rows, cols, o.scale_layout == MxScaleLayout::kSwizzled, x));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("q", q, "x", x));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("scales", s, "x", x));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("scales", s, "q", q));
  if (g) {
    ENCORE_RETURN_IF_ERROR(validate_global(*g, x));
    for (auto [name, t] : {std::pair{"x", &x}, {"q", &q}, {"scales", &s}})
      ENCORE_RETURN_IF_ERROR(checks::no_overlap("global_scale", *g, name, *t));
  }
  return Status::ok();
}

// The CUDA kernels' extra constraints: one thread per 8 elements (M * K / 8 < 2^31), 16-byte
// vector access to x (pointer and row stride multiples of 16 bytes), 8-byte (MXFP8) or 4-byte
// (NVFP4) stores of q (its pointer and row stride multiples of that).
Status validate_cuda(const Kind& k, const TensorView& x, const TensorView& q) {
  const int64_t rows = x.shape[0], cols = x.shape[1];
  if (rows * (cols / 8) >= (int64_t(1) << 31))
    return Status::unsupported(std::string(k.op) + " on CUDA: M * K / 8 must be < 2^31, got " + str(rows) + " x " + str(cols));
  if (cols >= (int64_t(1) << 31))  // a unit's column offset within its row is 32-bit
    return Status::unsupported("x: K = " + str(cols) + " columns; the CUDA kernels take fewer than 2^31");
  if (!checks::aligned(x.data, 16) || (rows > 1 && (x.strides[0] * int64_t(x.element_size())) % 16 != 0))
    return Status::invalid(std::string(k.op) + " on CUDA: x's data pointer and row stride must be 16-byte aligned");
  const int64_t qa = k.kind == MxKind::kMxfp8 ? 8 : 4;
  if (!checks::aligned(q.data, size_t(qa)) || (rows > 1 && q.strides[0] % qa != 0))
    return Status::invalid(std::string(k.op) + " on CUDA: q's data pointer and row stride must be multiples of " + str(qa) + " bytes");
  return Status::ok();
}

// CPU reference, or the CUDA kernels (asynchronous on `stream`).
// `scales` and `global` (null: none) for the device-memory check.
Status dispatch(const Kind& k, const TensorView& x, const TensorView& q, const TensorView& scales, const TensorView* global,
                const quant::MxProblem& p, bool quantize, Stream stream) {
  if (!x.device.is_cuda()) {
    if (quantize) reference::mx_quant(p);
    else reference::mx_dequant(p);
    return Status::ok();
  }
  ENCORE_RETURN_IF_ERROR(validate_cuda(k, x, q));
  ENCORE_RETURN_IF_ERROR(checks::device_memory({{"x", &x}, {"q", &q}, {"scales", &scales}, {"global_scale", global}}));
#ifdef ENCORE_WITH_CUDA
  if (quantize && quant::mx_quant_uses_jit(p)) {  // docs/jit.md: K baked in
    Status st = quant::launch_mx_quant_jit(p, x.device.index, stream);
    if (quant::mx_quant_jit_family().handled(st, stream)) return st;  // ran, or refused during a graph capture
  }
  return quantize ? cuda::launch_mx_quant(p, x.device.index, stream) : cuda::launch_mx_dequant(p, x.device.index, stream);
#else
  (void)stream;
  return Status::unsupported(std::string(k.op) + ": x on " + x.device.to_string() + " but encore was built without CUDA (ENCORE_CUDA=OFF)");
#endif
}

Status run_dequant(const Kind& k, const TensorView& q, const TensorView& s, const TensorView* g, const TensorView& x,
                   const MxQuantOptions& o, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate_options(o, k));
  ENCORE_RETURN_IF_ERROR(validate_x(x, k, {DType::kFP32, DType::kBF16}, false));
  const int64_t rows = x.shape[0], cols = x.shape[1];
  ENCORE_RETURN_IF_ERROR(validate_q(q, k, rows, cols, x, false));
  ENCORE_RETURN_IF_ERROR(validate_scales(s, k, rows, cols, o.scale_layout == MxScaleLayout::kSwizzled, x));
  if (g) ENCORE_RETURN_IF_ERROR(validate_global(*g, x));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("x", x, "q", q));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("x", x, "scales", s));
  return dispatch(k, x, q, s, g, make_problem(k, x, q, s, g ? static_cast<float*>(g->data) : nullptr, o), false, stream);
}

}  // namespace

Status validate(const Mxfp8QuantArgs& a, const MxQuantOptions& o) { return validate_quant(kMx, a.x, a.q, a.scales, nullptr, o); }
Status validate(const Nvfp4QuantArgs& a, const MxQuantOptions& o) {
  return validate_quant(kNv, a.x, a.q, a.scales, &a.global_scale, o);
}
size_t workspace_bytes(const Mxfp8QuantArgs&, const MxQuantOptions&) { return 0; }
size_t workspace_bytes(const Nvfp4QuantArgs&, const MxQuantOptions&) { return 0; }

Status run(const Mxfp8QuantArgs& a, const MxQuantOptions& o, void*, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  return dispatch(kMx, a.x, a.q, a.scales, nullptr, make_problem(kMx, a.x, a.q, a.scales, nullptr, o), true, stream);
}

Status run(const Nvfp4QuantArgs& a, const MxQuantOptions& o, void*, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  return dispatch(kNv, a.x, a.q, a.scales, &a.global_scale, make_problem(kNv, a.x, a.q, a.scales, static_cast<float*>(a.global_scale.data), o),
                  true, stream);
}

Status run(const Mxfp8DequantArgs& a, const MxQuantOptions& o, Stream stream) {
  return run_dequant(kMx, a.q, a.scales, nullptr, a.x, o, stream);
}
Status run(const Nvfp4DequantArgs& a, const MxQuantOptions& o, Stream stream) {
  return run_dequant(kNv, a.q, a.scales, &a.global_scale, a.x, o, stream);
}

}  // namespace encore
