// Host entry of the moe family's CUDA kernels (no CUDA types: callable from plain C++ dispatch code).
// The dispatch files have validated the problem (routing.cpp, dispatch.cpp, combine.cpp); the launches
// never allocate or synchronize. Ids / slot rows are not scanned on the host for CUDA tensors: the
// kernels skip out-of-range entries instead of reading or writing out of bounds (docs/moe.md).
#pragma once
#include <cstddef>
#include <cstdint>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"
#include "moe/problem.hpp"

namespace encore::cuda {

// One warp per token, E <= moe::kCudaRoutingMaxExperts.
Status launch_moe_routing(const moe::RoutingProblem& p, int device_index, Stream stream);

// p.cursors: a workspace of plan.workspace_bytes (16-byte aligned). plan from moe::plan_moe_dispatch.
Status launch_moe_dispatch(const moe::DispatchProblem& p, const moe::DispatchPlan& plan, int device_index, Stream stream);

// One block per token; eo_rows = expert_out's rows (slot rows outside [0, eo_rows) are skipped).
Status launch_moe_combine(const moe::CombineProblem& p, int64_t eo_rows, int device_index, Stream stream);

// moe_forward's expert compute: the grouped gate/up GEMM, the SwiGLU and the grouped down GEMM
// (grouped_gemm.cu). bf16 only; D and F multiples of 8; rows, strides and pointers 16-byte aligned.
Status launch_moe_expert_gemms(const moe::ExpertGemmProblem& p, int device_index, Stream stream);
// The decode GEMV (decode_mlp.cu): act and y of every expert with at most rows_max rows (<= kDecodeMaxRows),
// over a grid of active_max expert slots (>= the experts with rows: min(E, T k)).
Status launch_moe_decode_mlp(const moe::ExpertMlpProblem& m, int64_t rows_max, int64_t active_max, int device_index, Stream stream);

// The expert-parallel all-to-all's kernels (ep_kernels.cu) of one rank, enqueued on `stream`: dispatch's
// send half (arm, send) and receive half (receive counts, receive copy), combine's send half (send,
// flags) and receive half (receive, wait).
Status launch_ep_dispatch_send(const moe::ep::EpDeviceParams& p, int device_index, Stream stream);
Status launch_ep_dispatch_recv(const moe::ep::EpDeviceParams& p, int device_index, Stream stream);
Status launch_ep_combine_send(const moe::ep::EpDeviceParams& p, int device_index, Stream stream);
Status launch_ep_combine_recv(const moe::ep::EpDeviceParams& p, int device_index, Stream stream);
// The EP objects' device memory (allocated once at creation, zeroed) and their host reads.
// moe_forward_ep's one-hot logits [rows, El] fp32 of the received rows (ep_onehot.cu): the (source,
// expert) blocks b hold rows [starts[b], starts[b + 1]) (device memory, nstarts <= 8 * 512 + 1).
Status launch_ep_one_hot_logits(float* logits, const int64_t* starts, int nstarts, int El, int64_t rows, int device_index, Stream stream);
// Loads every all-to-all kernel on the device (no lazy load may wait on a spinning peer later).
Status ep_load_kernels(int device_index);
Status ep_device_alloc(size_t bytes, int device_index, void** out);
// p: a 4-byte-aligned int32 in device memory of device_index (else an invalid-argument error naming `what`;
// the memory type is not queried while `stream` is being captured).
Status ep_check_device_int(const int32_t* p, int device_index, Stream stream, const char* what);
void ep_device_free(void* p);
Status ep_device_read(void* host, const void* device, size_t bytes);  // synchronous
// Peer memory across processes (ep_vmm.cu): a zeroed VMM allocation on `device_index` exported as a
// POSIX file descriptor (fd, owned), or another process's allocation imported from its fd and mapped
// for this process's device (fd -1: the caller keeps or closes the one it received).
using moe::ep::EpPeerMemory;
Status ep_peer_memory_create(size_t bytes, int device_index, EpPeerMemory* out);
Status ep_peer_memory_import(int fd, size_t bytes, int device_index, EpPeerMemory* out);
void ep_peer_memory_release(EpPeerMemory* m);

// ---- What the JIT launches (moe/moe_jit.cpp, docs/jit.md) share with the ahead-of-time ones: the
// kernel argument (one layout for every dtype), the grid, block and shared memory. ----
constexpr int kMoeRoutingBlock = 128;  // routing_kernel.cuh: kRoutingWarps tokens per block
constexpr size_t kMoeRoutingParamsMaxBytes = 128;
size_t moe_routing_smem_bytes(int num_experts);
long long moe_routing_grid(int64_t tokens);
size_t moe_routing_kernel_params(const moe::RoutingProblem& p, void* out);  // RoutingParams; returns its size

constexpr int kMoeCombineBlock = 128;  // combine_kernel.cuh: kCombineThreads
constexpr size_t kMoeCombineParamsMaxBytes = 128;
bool moe_combine_vectorized(const moe::CombineProblem& p);  // kVec = 8 (rows aligned to 8 elements), else 1
long long moe_combine_grid(const moe::CombineProblem& p, bool vec);
size_t moe_combine_kernel_params(const moe::CombineProblem& p, int64_t eo_rows, void* out);

// The dispatch's map kernels (dispatch_kernel.cuh) in launch order: one (decode) or three (prefill).
using moe::DispatchMapKernel;
struct DispatchMapLaunch {
  DispatchMapKernel kernel;
  unsigned grid, block;
  size_t smem;
};
constexpr size_t kMoeDispatchParamsMaxBytes = 256;
// The launch's limits (E range, the prefill workspace): checked before any kernel is launched.
Status moe_dispatch_check(const moe::DispatchProblem& p, const moe::DispatchPlan& plan);
// Fills out[0, n) and the kernel argument they share (`params`, kMoeDispatchParamsMaxBytes); returns n.
int moe_dispatch_map_launches(const moe::DispatchProblem& p, const moe::DispatchPlan& plan, DispatchMapLaunch out[3], void* params);
// The gather after the map kernels: a programmatic dependent of the last kernel launched on `stream`.
Status launch_moe_dispatch_gather(const moe::DispatchProblem& p, const moe::DispatchPlan& plan, const void* params, int device_index,
                                  Stream stream);

}  // namespace encore::cuda
