// What the per-family binding files share: the converter (DLPack ndarray -> TensorView), the
// Status -> exception mapping and ENCORE_BIND_OP, which binds an op's two calls over its C++ Args and
// Options structs (each family binds those structs with named fields: `__init__` keywords that are
// the C++ field names).
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <stdexcept>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore::python {

namespace nb = nanobind;

using Array = nb::ndarray<>;  // any dtype, device and strides

inline DType to_dtype(const nb::dlpack::dtype& t, const char* name) {
  using C = nb::dlpack::dtype_code;
  const auto code = C(t.code);
  if (t.lanes == 1) {
    if (code == C::Bfloat && t.bits == 16) return DType::kBF16;
    if (code == C::Float && t.bits == 16) return DType::kFP16;
    if (code == C::Float && t.bits == 32) return DType::kFP32;
    if (code == C::Float && t.bits == 64) return DType::kFP64;
    if (code == C::Int && t.bits == 32) return DType::kInt32;
    if (code == C::Int && t.bits == 64) return DType::kInt64;
    if (code == C::UInt && t.bits == 8) return DType::kUInt8;
  }
  throw nb::value_error((std::string(name) + ": unsupported array dtype (code " + std::to_string(t.code) + ", " +
                         std::to_string(t.bits) + " bits)").c_str());
}

// Data, device, shape and strides; the dtype is left to the caller.
inline TensorView to_view_raw(const Array& a, const char* name) {
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

inline TensorView to_view(const Array& a, const char* name) {
  TensorView v = to_view_raw(a, name);
  v.dtype = to_dtype(a.dtype(), name);
  return v;
}

// An fp8 e4m3 tensor arrives as raw bytes (uint8 / int8 arrays: numpy has no fp8 dtype, and the
// Python side passes torch float8 tensors as uint8 views).
inline TensorView to_fp8_view(const Array& a, const char* name) {
  const auto t = a.dtype();
  using C = nb::dlpack::dtype_code;
  if (!((C(t.code) == C::UInt || C(t.code) == C::Int) && t.bits == 8 && t.lanes == 1))
    throw nb::value_error((std::string(name) + ": expected the fp8 e4m3 bytes as a uint8 array").c_str());
  TensorView v = to_view_raw(a, name);
  v.dtype = DType::kFP8E4M3;
  return v;
}

inline void raise_if_error(const Status& st) {
  if (st.is_ok()) return;
  if (st.code() == StatusCode::kInvalidArgument) throw nb::value_error(st.message().c_str());
  throw std::runtime_error(st.to_string());
}

inline Stream as_stream(uintptr_t s) { return reinterpret_cast<Stream>(s); }

// An optional array argument: None, an array, or any other object, which the caster below accepts so
// that the op refuses it naming the argument (opt_view: TypeError "<name>: expected ...") rather than
// nanobind's overload error, which names no argument.
struct Opt {
  std::optional<Array> array;
  nb::object refused;  // set when the object is not an array (or a read-only numpy array)
  explicit operator bool() const { return array.has_value(); }
  const Array& operator*() const { return *array; }
  const Array* operator->() const { return &*array; }
};

// Raises TypeError naming `name` when `a` holds an object that is not an array.
inline void check_array(const Opt& a, const char* name) {
  if (!a.refused.is_valid()) return;
  const std::string type = nb::cast<std::string>(nb::str(nb::handle(a.refused.type()).attr("__name__")));
  const nb::object flags = nb::getattr(a.refused, "flags", nb::none());
  if (!flags.is_none() && nb::hasattr(a.refused, "__array_interface__") && !nb::cast<bool>(flags.attr("writeable")))
    throw nb::type_error((std::string(name) + ": a read-only " + type +
                          " (encore's binding takes writable arrays: pass a copy, e.g. numpy.array(" + name + "))").c_str());
  throw nb::type_error((std::string(name) + ": expected an array (a numpy array or a torch tensor), got " + type).c_str());
}

inline TensorView opt_view(const Opt& a, const char* name) {
  check_array(a, name);
  return a ? to_view(*a, name) : TensorView{};
}
inline TensorView opt_fp8_view(const Opt& a, const char* name) {
  check_array(a, name);
  return a ? to_fp8_view(*a, name) : TensorView{};
}
inline void* opt_ptr(const Opt& a, const char* name = "workspace") {
  check_array(a, name);
  return a ? a->data() : nullptr;
}

// An op's run: an absent workspace where the call needs one is refused here (naming the size)
// rather than left to the backend.
template <class A, class O>
void run_checked(const A& a, const O& o, const Opt& workspace, uintptr_t stream) {
  if (!workspace) {
    const size_t need = workspace_bytes(a, o);
    if (need) throw nb::value_error(("workspace: this call needs " + std::to_string(need) + " bytes (query <op>_workspace)").c_str());
  }
  raise_if_error(run(a, o, opt_ptr(workspace), as_stream(stream)));
}

// The two calls of an op over its structs: <name>_workspace(args, opts) -> bytes (validates first)
// and <name>_run(args, opts, workspace, stream).
#define ENCORE_BIND_OP(m, name, A, O)                                                                                    \
  (m).def(name "_workspace",                                                                                             \
          [](const A& a, const O& o) {                                                                                   \
            ::encore::python::raise_if_error(validate(a, o));                                                            \
            return workspace_bytes(a, o);                                                                                \
          },                                                                                                             \
          nb::arg("args"), nb::arg("opts"));                                                                             \
  (m).def(name "_run", &::encore::python::run_checked<A, O>, nb::arg("args"), nb::arg("opts"), nb::arg("workspace").none(), \
          nb::arg("stream") = 0)

}  // namespace encore::python

namespace nanobind::detail {

// Opt from Python: None, an array (nb::ndarray<>), or, in the converting pass, any other object (kept
// to be refused by opt_view with the argument's name).
template <>
struct type_caster<encore::python::Opt> {
  using ArrayCaster = make_caster<encore::python::Array>;
  NB_TYPE_CASTER(encore::python::Opt, optional_name(ArrayCaster::Name))

  bool from_python(handle src, uint32_t flags, cleanup_list* cleanup) noexcept {
    value = encore::python::Opt{};
    if (src.is_none()) return true;
    ArrayCaster caster;
    if (caster.from_python(src, flags, cleanup)) {
      value.array.emplace(caster.value);
      return true;
    }
    if (!(flags & uint32_t(cast_flags::convert))) return false;  // nanobind retries with conversions
    value.refused = borrow(src);
    return true;
  }

  static handle from_cpp(const encore::python::Opt& v, rv_policy policy, cleanup_list* cleanup) noexcept {
    if (!v) return none().release();
    return ArrayCaster::from_cpp(*v, policy, cleanup);
  }
};

}  // namespace nanobind::detail
