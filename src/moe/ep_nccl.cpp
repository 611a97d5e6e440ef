// MoeEpComm over NCCL (encore/moe_ep.hpp): all_to_all_v as grouped ncclSend / ncclRecv of bytes on the
// caller's stream; synchronize polls the stream and ncclCommGetAsyncError until done or the deadline,
// then aborts the communicator (a peer that never joins cannot hang the caller). libnccl.so.2 is
// loaded at run time (dlopen) with the few entry points declared here by their ABI, so a build needs no
// NCCL headers and a process without NCCL gets a clear error (moe_ep_have_nccl). Not yet run across GPUs.
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>

#include "core/fault_injection.hpp"
#include "encore/moe_ep.hpp"
#ifdef ENCORE_WITH_CUDA
#include <cuda_runtime.h>
#include <dlfcn.h>
#endif

namespace encore {

#ifdef ENCORE_WITH_CUDA
namespace {

// nccl.h's ABI (stable since NCCL 2): results and data types are C enums (int), the unique id 128 bytes.
using NcclResult = int;
constexpr NcclResult kNcclSuccess = 0, kNcclInProgress = 7;
constexpr int kNcclUint8 = 1;
struct NcclUniqueId {
  char internal[128];
};

struct Nccl {
  NcclResult (*group_start)() = nullptr;
  NcclResult (*group_end)() = nullptr;
  NcclResult (*send)(const void*, size_t, int, int, ncclComm_t, cudaStream_t) = nullptr;
  NcclResult (*recv)(void*, size_t, int, int, ncclComm_t, cudaStream_t) = nullptr;
  NcclResult (*user_rank)(ncclComm_t, int*) = nullptr;
  NcclResult (*count)(ncclComm_t, int*) = nullptr;
  NcclResult (*cu_device)(ncclComm_t, int*) = nullptr;
  NcclResult (*async_error)(ncclComm_t, NcclResult*) = nullptr;
  NcclResult (*abort)(ncclComm_t) = nullptr;
  NcclResult (*destroy)(ncclComm_t) = nullptr;
  NcclResult (*init_rank)(ncclComm_t*, int, NcclUniqueId, int) = nullptr;
  NcclResult (*unique_id)(NcclUniqueId*) = nullptr;
  const char* (*error_string)(NcclResult) = nullptr;
  std::string why;  // empty when loaded
};

const Nccl& nccl() {
  static Nccl n;
  static std::once_flag once;
  std::call_once(once, [] {
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
    if (h == nullptr) h = dlopen("libnccl.so", RTLD_NOW | RTLD_GLOBAL);
    if (h == nullptr) {
      n.why = std::string("NCCL is not available: ") + dlerror();
      return;
    }
    auto sym = [&](auto* fn, const char* name) {
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(h, name));
      if (*fn == nullptr && n.why.empty()) n.why = std::string("NCCL is not available: libnccl lacks ") + name;
    };
    sym(&n.group_start, "ncclGroupStart");
    sym(&n.group_end, "ncclGroupEnd");
    sym(&n.send, "ncclSend");
    sym(&n.recv, "ncclRecv");
    sym(&n.user_rank, "ncclCommUserRank");
    sym(&n.count, "ncclCommCount");
    sym(&n.cu_device, "ncclCommCuDevice");
    sym(&n.async_error, "ncclCommGetAsyncError");
    sym(&n.abort, "ncclCommAbort");
    sym(&n.destroy, "ncclCommDestroy");
    sym(&n.init_rank, "ncclCommInitRank");
    sym(&n.unique_id, "ncclGetUniqueId");
    sym(&n.error_string, "ncclGetErrorString");
  });
  return n;
}

// "moe_forward_ep: <what> failed: ncclResult <r>: <ncclGetErrorString>".
Status nccl_status(NcclResult r, const char* what) {
  if (r == kNcclSuccess) return Status::ok();
  return Status::internal(fault::failure_message("moe_forward_ep", what, "ncclResult", r, nccl().error_string(r)));
}

// The test seam, then the NCCL call `call()` (an injected failure skips it).
template <class F>
Status nccl_call(const char* what, F&& call) {
  if (fault::inject(fault::Step::kNccl, what)) return fault::injected(fault::Step::kNccl, (std::string("moe_forward_ep: ") + what).c_str());
  return nccl_status(call(), what);
}

class NcclComm final : public MoeEpComm {
 public:
  NcclComm(ncclComm_t c, bool owned, int rank, int world, int device) : comm_(c), owned_(owned), rank_(rank), world_(world), device_(device) {}
  ~NcclComm() override {
    if (owned_ && !aborted_) nccl().destroy(comm_);
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  Device device() const override { return Device{DeviceType::kCUDA, device_}; }

  Status all_to_all_v(const void* send, const int64_t* send_offsets, const int64_t* send_bytes, void* recv, const int64_t* recv_offsets,
                      const int64_t* recv_bytes, Stream stream) override {
    if (aborted_) return Status::internal("moe_forward_ep: the communicator was aborted after an earlier timeout");
    const Nccl& n = nccl();
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    ENCORE_RETURN_IF_ERROR(nccl_call("ncclGroupStart", [&] { return n.group_start(); }));
    Status st = Status::ok();
    for (int r = 0; r < world_ && st; ++r) {
      if (send_bytes[r] > 0)
        st = nccl_call("ncclSend", [&] { return n.send(static_cast<const char*>(send) + send_offsets[r], size_t(send_bytes[r]), kNcclUint8, r, comm_, s); });
      if (st && recv_bytes[r] > 0)
        st = nccl_call("ncclRecv", [&] { return n.recv(static_cast<char*>(recv) + recv_offsets[r], size_t(recv_bytes[r]), kNcclUint8, r, comm_, s); });
    }
    // The group is closed even after a failed enqueue. A non-blocking communicator answers ncclInProgress
    // here: the transfer is then checked by synchronize (ncclCommGetAsyncError).
    const NcclResult e = n.group_end();
    const Status end = e == kNcclInProgress ? Status::ok() : nccl_status(e, "ncclGroupEnd");
    return st ? end : st;
  }

  Status synchronize(Stream stream, std::chrono::milliseconds timeout) override {
    if (aborted_) return Status::internal("moe_forward_ep: the communicator was aborted after an earlier timeout");
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const cudaError_t q = cudaStreamQuery(static_cast<cudaStream_t>(stream));
      if (q == cudaSuccess) return Status::ok();
      if (q != cudaErrorNotReady) {
        (void)cudaGetLastError();
        return Status::cuda_error(fault::failure_message("moe_forward_ep", "synchronize (cudaStreamQuery)", cudaGetErrorName(q), int(q),
                                                         cudaGetErrorString(q)));
      }
      NcclResult r = kNcclSuccess;
      if (const NcclResult q2 = nccl().async_error(comm_, &r); q2 != kNcclSuccess) r = q2;  // the query itself failed: report that
      if (r != kNcclSuccess && r != kNcclInProgress) {
        abort_now();
        return Status::internal(fault::failure_message(("moe_forward_ep: rank " + std::to_string(rank_)).c_str(),
                                                       "the all-to-all (ncclCommGetAsyncError)", "ncclResult", r, nccl().error_string(r)) +
                                "; the communicator is aborted");
      }
      if (std::chrono::steady_clock::now() > deadline) {
        abort_now();
        return Status::internal("moe_forward_ep: rank " + std::to_string(rank_) + " of " + std::to_string(world_) + " timed out after " +
                                std::to_string(timeout.count()) + " ms in the all-to-all (a peer did not join); the communicator is aborted");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  void abort_now() {
    nccl().abort(comm_);
    aborted_ = true;
  }
  ncclComm_t comm_;
  bool owned_, aborted_ = false;
  int rank_, world_, device_;
};

}  // namespace

bool moe_ep_have_nccl() { return nccl().why.empty(); }

Status moe_ep_nccl_comm(ncclComm_t comm, std::unique_ptr<MoeEpComm>* out) {
  if (out == nullptr) return Status::invalid("out: null pointer");
  if (comm == nullptr) return Status::invalid("comm: null ncclComm_t");
  const Nccl& n = nccl();
  if (!n.why.empty()) return Status::unsupported(n.why);
  int rank = 0, world = 0, device = 0;
  ENCORE_RETURN_IF_ERROR(nccl_call("ncclCommUserRank", [&] { return n.user_rank(comm, &rank); }));
  ENCORE_RETURN_IF_ERROR(nccl_call("ncclCommCount", [&] { return n.count(comm, &world); }));
  ENCORE_RETURN_IF_ERROR(nccl_call("ncclCommCuDevice", [&] { return n.cu_device(comm, &device); }));
  *out = std::make_unique<NcclComm>(comm, false, rank, world, device);
  return Status::ok();
}

Status moe_ep_nccl_unique_id(void* unique_id) {
  if (unique_id == nullptr) return Status::invalid("unique_id: null pointer (128 bytes)");
  const Nccl& n = nccl();
  if (!n.why.empty()) return Status::unsupported(n.why);
  NcclUniqueId id;
  ENCORE_RETURN_IF_ERROR(nccl_call("ncclGetUniqueId", [&] { return n.unique_id(&id); }));
  std::memcpy(unique_id, id.internal, sizeof(id.internal));
  return Status::ok();
}

Status moe_ep_nccl_comm_from_unique_id(const void* unique_id, int world, int rank, int device, std::unique_ptr<MoeEpComm>* out) {
  if (out == nullptr) return Status::invalid("out: null pointer");
  if (unique_id == nullptr) return Status::invalid("unique_id: null pointer (128 bytes of ncclGetUniqueId expected)");
  if (world < 1 || rank < 0 || rank >= world)
    return Status::invalid("rank: " + std::to_string(rank) + " must be in [0, world = " + std::to_string(world) + ")");
  const Nccl& n = nccl();
  if (!n.why.empty()) return Status::unsupported(n.why);
  const cudaError_t e = cudaSetDevice(device);  // the communicator's device stays current (NCCL's convention)
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::cuda_error(fault::failure_message(("device: cuda:" + std::to_string(device)).c_str(), "cudaSetDevice", cudaGetErrorName(e),
                                                     int(e), cudaGetErrorString(e)));
  }
  NcclUniqueId id;
  std::memcpy(id.internal, unique_id, sizeof(id.internal));
  ncclComm_t comm = nullptr;
  ENCORE_RETURN_IF_ERROR(nccl_call("ncclCommInitRank", [&] { return n.init_rank(&comm, world, id, rank); }));
  *out = std::make_unique<NcclComm>(comm, true, rank, world, device);
  return Status::ok();
}

#else  // a build without CUDA

bool moe_ep_have_nccl() { return false; }
Status moe_ep_nccl_unique_id(void*) { return Status::unsupported("moe_ep_nccl_unique_id: a build without CUDA"); }
Status moe_ep_nccl_comm(ncclComm_t, std::unique_ptr<MoeEpComm>*) { return Status::unsupported("moe_ep_nccl_comm: a build without CUDA"); }
Status moe_ep_nccl_comm_from_unique_id(const void*, int, int, int, std::unique_ptr<MoeEpComm>*) {
  return Status::unsupported("moe_ep_nccl_comm_from_unique_id: a build without CUDA");
}

#endif

}  // namespace encore
