// encore._encore: one converter (DLPack ndarray -> TensorView) and one line per op. Outputs are
// allocated by the Python caller; streams arrive as integers. Status errors become ValueError
// (invalid argument) or RuntimeError (anything else) carrying the C++ message.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>

#include "encore/core/device_info.hpp"
#include "encore/norm.hpp"
#include "encore/quant.hpp"

namespace nb = nanobind;
using namespace encore;

namespace {

using Array = nb::ndarray<>;  // any dtype, device and strides

DType to_dtype(const nb::dlpack::dtype& t, const char* name) {
  using C = nb::dlpack::dtype_code;
  const auto code = C(t.code);
  if (t.lanes == 1) {
    if (code == C::Bfloat && t.bits == 16) return DType::kBF16;
    if (code == C::Float && t.bits == 16) return DType::kFP16;
    if (code == C::Float && t.bits == 32) return DType::kFP32;
    if (code == C::Float && t.bits == 64) return DType::kFP64;
    if (code == C::Int && t.bits == 32) return DType::kInt32;
    if (code == C::Int && t.bits == 64) return DType::kInt64;
  }
  throw nb::value_error((std::string(name) + ": unsupported array dtype (code " + std::to_string(t.code) + ", " +
                         std::to_string(t.bits) + " bits)").c_str());
}

// Data, device, shape and strides; the dtype is left to the caller.
TensorView to_view_raw(const Array& a, const char* name) {
  if (a.ndim() > size_t(TensorView::kMaxDims))
    throw nb::value_error((std::string(name) + ": more than 6 dimensions").c_str());
  TensorView v;
  v.data = a.data();
  const int dev = a.device_type();
  if (dev == nb::device::cpu::value) v.device = {DeviceType::kCPU, 0};
  else if (dev == nb::device::cuda::value) v.device = {DeviceType::kCUDA, int(a.device_id())};
  else throw nb::value_error((std::string(name) + ": arrays must live on the CPU or a CUDA device").c_str());
  v.ndim = int(a.ndim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = int64_t(a.shape(i));
    v.strides[i] = int64_t(a.stride(i));
  }
  return v;
}

TensorView to_view(const Array& a, const char* name) {
  TensorView v = to_view_raw(a, name);
  v.dtype = to_dtype(a.dtype(), name);
  return v;
}

// An fp8 e4m3 tensor arrives as raw bytes (uint8 / int8 arrays: numpy has no fp8 dtype, and the
// Python side passes torch float8 tensors as uint8 views).
TensorView to_fp8_view(const Array& a, const char* name) {
  const auto t = a.dtype();
  using C = nb::dlpack::dtype_code;
  if (!((C(t.code) == C::UInt || C(t.code) == C::Int) && t.bits == 8 && t.lanes == 1))
    throw nb::value_error((std::string(name) + ": expected the fp8 e4m3 bytes as a uint8 array").c_str());
  TensorView v = to_view_raw(a, name);
  v.dtype = DType::kFP8E4M3;
  return v;
}

void raise_if_error(const Status& st) {
  if (st.is_ok()) return;
  if (st.code() == StatusCode::kInvalidArgument) throw nb::value_error(st.message().c_str());
  throw std::runtime_error(st.to_string());
}

Stream as_stream(uintptr_t s) { return reinterpret_cast<Stream>(s); }

}  // namespace

NB_MODULE(_encore, m) {
  m.doc() = "encore: fused transformer kernels (CPU reference backend + CUDA sm_90a)";
  m.def("built_with_cuda", &built_with_cuda);
  m.def("cuda_device_count", &cuda_device_count);

  m.def("rms_norm_out",
        [](Array x, Array weight, Array y, float eps, float weight_offset, uintptr_t stream) {
          RmsNormArgs a{to_view(x, "x"), to_view(weight, "weight"), to_view(y, "y")};
          raise_if_error(run(a, RmsNormOptions{eps, weight_offset}, nullptr, as_stream(stream)));
        },
        nb::arg("x"), nb::arg("weight"), nb::arg("y"), nb::arg("eps"), nb::arg("weight_offset"), nb::arg("stream"));

  m.def("add_rms_norm_out",
        [](Array x, Array residual, Array weight, Array y, Array h, float eps, float weight_offset, uintptr_t stream) {
          AddRmsNormArgs a{to_view(x, "x"), to_view(residual, "residual"), to_view(weight, "weight"), to_view(y, "y"),
                           to_view(h, "h")};
          raise_if_error(run(a, RmsNormOptions{eps, weight_offset}, nullptr, as_stream(stream)));
        },
        nb::arg("x"), nb::arg("residual"), nb::arg("weight"), nb::arg("y"), nb::arg("h"), nb::arg("eps"),
        nb::arg("weight_offset"), nb::arg("stream"));

  m.def("qk_norm_",
        [](Array qkv, Array q_weight, Array k_weight, int num_q_heads, int num_kv_heads, int head_dim, float eps,
           float weight_offset, uintptr_t stream) {
          QkNormArgs a{to_view(qkv, "qkv"), to_view(q_weight, "q_weight"), to_view(k_weight, "k_weight")};
          raise_if_error(run(a, QkNormOptions{num_q_heads, num_kv_heads, head_dim, eps, weight_offset}, nullptr, as_stream(stream)));
        },
        nb::arg("qkv"), nb::arg("q_weight"), nb::arg("k_weight"), nb::arg("num_q_heads"), nb::arg("num_kv_heads"),
        nb::arg("head_dim"), nb::arg("eps"), nb::arg("weight_offset"), nb::arg("stream"));

  m.def("fp8_group_quant_out",
        [](Array x, Array q, Array scales, bool power_of_two, float eps, uintptr_t stream) {
          Fp8GroupQuantOptions o;
          o.power_of_two_scales = power_of_two;
          o.eps = eps;
          raise_if_error(run(Fp8GroupQuantArgs{to_view(x, "x"), to_fp8_view(q, "q"), to_view(scales, "scales")}, o, nullptr,
                             as_stream(stream)));
        },
        nb::arg("x"), nb::arg("q"), nb::arg("scales"), nb::arg("power_of_two"), nb::arg("eps"), nb::arg("stream"));

  m.def("fp8_group_dequant_out",
        [](Array q, Array scales, Array x) {
          raise_if_error(run(Fp8GroupDequantArgs{to_fp8_view(q, "q"), to_view(scales, "scales"), to_view(x, "x")}, Fp8GroupQuantOptions{}));
        },
        nb::arg("q"), nb::arg("scales"), nb::arg("x"));
}
