// Bindings of the CUDA expert-parallel all-to-all on peer memory (src/moe/ep_device.hpp): one rank's end
// of an IPC group (EpDeviceGroup::create_ipc + EpDeviceAllToAll), used by encore/_moe_ep.py's
// transport="peer". Its received buffers come back as torch tensors viewing the object's device memory
// (valid until its next dispatch).
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <chrono>
#include <memory>

#include "convert.hpp"
#include "moe/ep_device.hpp"

namespace encore::python {
namespace {

using namespace encore::moe::ep;

struct EpPeerRank {
  std::unique_ptr<EpDeviceGroup> group;
  std::unique_ptr<EpDeviceAllToAll> end;
  int device = 0;
};

nb::dlpack::dtype dl(DType t) {
  using C = nb::dlpack::dtype_code;
  switch (t) {
    case DType::kBF16: return {uint8_t(C::Bfloat), 16, 1};
    case DType::kFP16: return {uint8_t(C::Float), 16, 1};
    case DType::kFP32: return {uint8_t(C::Float), 32, 1};
    case DType::kFP8E4M3:
    case DType::kUInt8: return {uint8_t(C::UInt), 8, 1};  // e4m3 rows and scale bytes as raw bytes
    default: return {uint8_t(C::Int), 32, 1};
  }
}

nb::ndarray<nb::pytorch> view(const void* p, std::initializer_list<size_t> shape, nb::dlpack::dtype t, int device, nb::handle owner) {
  return nb::ndarray<nb::pytorch>(const_cast<void*>(p), shape, owner, {}, t, nb::device::cuda::value, device);
}

}  // namespace

void bind_moe_ep(nb::module_& m) {
  nb::class_<EpPeerRank>(m, "EpPeerRank")
      .def("__init__",
           [](EpPeerRank* self, int world, int rank, int num_experts, int top_k, int64_t hidden, int64_t max_tokens, Array like, int64_t scale_bytes,
              int timeout_ms, int device, const std::string& name, bool fp8_rows) {
             new (self) EpPeerRank();
             EpConfig c;
             c.world = world, c.num_experts = num_experts, c.top_k = top_k, c.hidden = hidden, c.max_tokens = max_tokens;
             c.dtype = to_view(like, "like").dtype, c.scale_bytes = scale_bytes, c.timeout = std::chrono::milliseconds(timeout_ms);
             if (fp8_rows) c.combine_dtype = c.dtype, c.dtype = DType::kFP8E4M3;  // e4m3 rows, expert outputs in like's dtype
             self->device = device;
             raise_if_error(EpDeviceGroup::create_ipc(c, rank, device, name, &self->group));
             raise_if_error(EpDeviceAllToAll::create(self->group.get(), rank, &self->end));
           },
           nb::arg("world"), nb::arg("rank"), nb::arg("num_experts"), nb::arg("top_k"), nb::arg("hidden"), nb::arg("max_tokens"), nb::arg("like"),
           nb::arg("scale_bytes"), nb::arg("timeout_ms"), nb::arg("device"), nb::arg("name"), nb::arg("fp8_rows") = false,
           nb::call_guard<nb::gil_scoped_release>())  // the descriptor exchange waits for the peers
      .def("dispatch",
           [](EpPeerRank& r, Array x, Array topk_ids, Opt scales, uintptr_t stream) {
             TensorView xv = to_view(x, "x");
             // fp8 rows come as their bytes (torch's float8 has no DLPack code): uint8 is e4m3 here
             if (r.group->config().dtype == DType::kFP8E4M3 && xv.dtype == DType::kUInt8) xv.dtype = DType::kFP8E4M3;
             raise_if_error(r.end->dispatch(xv, to_view(topk_ids, "topk_ids"), opt_view(scales, "scales"), as_stream(stream)));
           },
           nb::arg("x"), nb::arg("topk_ids"), nb::arg("scales").none(), nb::arg("stream"))
      .def("received",  // (counts [E_l], offsets [E_l + 1], rows [max_rows, H], scales [max_rows, scale_bytes]) on the device
           [](nb::handle self) {
             EpPeerRank& r = nb::cast<EpPeerRank&>(self);
             const EpConfig& c = r.group->config();
             const EpDeviceReceived& rv = r.end->received();
             const size_t el = size_t(c.num_experts / c.world);
             return nb::make_tuple(view(rv.counts, {el}, dl(DType::kInt32), r.device, self), view(rv.offsets, {el + 1}, dl(DType::kInt32), r.device, self),
                                   view(rv.x, {size_t(rv.max_rows), size_t(c.hidden)}, dl(c.dtype), r.device, self),
                                   view(rv.scales, {size_t(rv.max_rows), size_t(c.scale_bytes)}, dl(DType::kUInt8), r.device, self));
           })
      .def_prop_ro("max_rows", [](EpPeerRank& r) { return r.end->received().max_rows; })
      .def("combine",
           [](EpPeerRank& r, Array expert_out, Array topk_weights, Array out, uintptr_t stream) {
             raise_if_error(r.end->combine(to_view(expert_out, "expert_out"), to_view(topk_weights, "topk_weights"), to_view(out, "out"), as_stream(stream)));
           },
           nb::arg("expert_out"), nb::arg("topk_weights"), nb::arg("out"), nb::arg("stream"))
      .def("check", [](EpPeerRank& r) { raise_if_error(r.end->status()); });  // after synchronizing the stream
}

}  // namespace encore::python
