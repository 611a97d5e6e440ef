// The expert-parallel all-to-all on CUDA: the CPU emulation's protocol (moe/reference/ep_emulation.hpp,
// docs/moe.md "Expert parallel") on peer memory, one rank's side, every kernel on the caller's stream.
// Cells are 64-bit {epoch << 32 | value}, published with st.release.sys / red.release.sys and read with
// ld.acquire.sys; every spin loop polls %globaltimer and the group's abort cell, and on a timeout or a
// bad input records the first failure in the group's EpErrorRecord (one CAS) and returns (no trap: the
// host reads the record, EpDeviceAllToAll::status).
// Dispatch (round n):
//   ep_arm_kernel        ids checked (range, distinct per token); own combine counters armed {n | 0}
//   ep_send_kernel       block e per global expert: the (t, j) pairs with ids == e in token order (a
//                        block scan: the stable slot), each row copied (16-byte stores) into region
//                        `rank` of the owner's memory with its scales and int32 source slot t k + j;
//                        then the count cell {n | count + 1} (fence.sys, st.release.sys)
//   ep_recv_counts_kernel  one block: waits for every (sender, local expert) count, the row table
//   ep_recv_copy_kernel  rows out of the regions, expert-contiguous in (local expert, sender, slot) order
// Combine:
//   ep_combine_send_kernel  each received row's expert output into its origin's combine area at slot
//                           t k + j, then red.release.sys +1 on that token's counter
//   ep_combine_flags_kernel {n | 1} into every peer's combine flag (this rank consumed its region)
//   ep_combine_recv_kernel  per own token: wait for {n | k}, out = sum_j w_j y_j in fp32, one fma per j
//                           in j order from 0 (the single-GPU combine: bit-equal), rounded once
//   ep_combine_wait_kernel  every peer's combine flag (its outputs are out; the regions may be reused)
// Constraints (ep_device.cpp checks them): world <= kEpMaxWorld, row bytes a multiple of 16, rows and
// tensors 16-byte aligned, num_experts < 2^30 (int loops over experts), max_rows < 2^31 (int32 rows).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "common/cuda/vector_io.cuh"
#include "moe/cuda/launch.hpp"

namespace encore::cuda {
namespace {

using moe::ep::EpDeviceParams;
using moe::ep::EpErrorRecord;
using u64 = unsigned long long;

constexpr int kThreads = 256;

__device__ __forceinline__ u64 cell(uint32_t epoch, uint32_t value) { return u64(epoch) << 32 | value; }
__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(u64* p, u64 v) { asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ void add_release_sys(u64* p, u64 v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// This rank's current round (ep_round_kernel's count, stream-ordered before every other kernel of it).
__device__ __forceinline__ uint32_t round_of(const EpDeviceParams& p) { return *p.epoch_dev; }

__device__ __forceinline__ bool aborted(const EpDeviceParams& p) { return ld_acquire_sys(&p.err->abort) != 0; }
// The abort cell read once for the whole block (thread 0, then a barrier): a block-uniform answer, so no
// warp leaves while others go on to the block's barriers.
__device__ __forceinline__ bool block_aborted(const EpDeviceParams& p) {
  __shared__ int flag;
  if (threadIdx.x == 0) flag = aborted(p);
  __syncthreads();
  return flag != 0;
}

// Records the group's first failure: this rank's detail slot first (claimed by one thread of the rank),
// then the release of the group's abort cell by CAS (a later failure of another rank finds it set and
// leaves only its own slot), so whoever sees the abort sees the winner's detail.
__device__ void fail(const EpDeviceParams& p, uint32_t phase, uint32_t what, int peer, int64_t index, u64 expected, u64 seen) {
  moe::ep::EpErrorDetail& d = p.err->detail[p.rank];
  if (atomicCAS_system(&d.claimed, 0u, 1u) != 0) return;  // this rank already recorded one
  d.phase = phase;
  d.what = what;
  d.peer = peer;
  d.index = int32_t(index);
  d.expected = expected;
  d.seen = seen;
  __threadfence_system();
  atomicCAS_system(&p.err->abort, 0ull, cell(round_of(p), uint32_t(p.rank + 1)));
}

// Spins until done(value); false on the group's abort or a timeout (recorded).
template <class Done>
__device__ bool spin(const EpDeviceParams& p, const u64* c, Done done, uint32_t phase, uint32_t what, int peer, int64_t index, u64 expected) {
  const u64 start = globaltimer();
  for (uint32_t it = 0;; ++it) {
    const u64 v = ld_acquire_sys(c);
    if (done(v)) return true;
    if ((it & 31) == 31) {
      if (aborted(p)) return false;
      if (globaltimer() - start > p.timeout_ns) {
        fail(p, phase, what, peer, index, expected, v);
        return false;
      }
      __nanosleep(200);
    }
  }
}

__device__ __forceinline__ uint8_t* region(const EpDeviceParams& p, int owner, int sender) { return p.mem[owner] + int64_t(sender) * p.region_bytes; }
__device__ __forceinline__ u64* counter(const EpDeviceParams& p, int owner, int64_t t) {
  return reinterpret_cast<u64*>(p.mem[owner] + int64_t(p.world) * p.region_bytes) + t;
}
__device__ __forceinline__ uint8_t* combine_row(const EpDeviceParams& p, int owner, int64_t slot) {
  return p.mem[owner] + int64_t(p.world) * p.region_bytes + p.combine_header + slot * p.combine_row_bytes;
}

// n bytes (a multiple of 16, both 16-byte aligned) by the block's threads.
__device__ __forceinline__ void copy16(uint8_t* dst, const uint8_t* src, int64_t n) {
  for (int64_t i = int64_t(threadIdx.x) * 16; i < n; i += int64_t(blockDim.x) * 16)
    *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
}

// This round's tokens: m, or the device count m_dev clamped to [0, m] as ep_round_kernel copied it
// (epoch_dev[1]) at the round's start, so every kernel of the round reads the same value even if the
// caller's count changes meanwhile (ep_arm_kernel records a count outside the range).
__device__ __forceinline__ int64_t live_tokens(const EpDeviceParams& p) { return p.m_dev ? int64_t(p.epoch_dev[1]) : p.m; }

// Round n + 1 begins: the first kernel of every dispatch (one thread).
__global__ void ep_round_kernel(const __grid_constant__ EpDeviceParams p) {
  ++p.epoch_dev[0];
  if (p.m_dev) {
    const int64_t n = *p.m_dev;
    p.epoch_dev[1] = uint32_t(n < 0 ? 0 : (n > p.m ? p.m : n));
  }
}

__global__ void __launch_bounds__(kThreads) ep_arm_kernel(const __grid_constant__ EpDeviceParams p) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t == 0 && p.m_dev && (*p.m_dev < 0 || *p.m_dev > p.m))
    fail(p, moe::ep::kEpPhaseDispatch, moe::ep::kEpBadTokenCount, -1, 0, u64(p.m), u64(uint32_t(*p.m_dev)));
  if (t >= live_tokens(p)) return;
  const int k = p.top_k;
  for (int j = 0; j < k; ++j) {
    const int32_t e = p.ids[t * k + j];
    if (e < 0 || e >= p.num_experts) fail(p, moe::ep::kEpPhaseDispatch, moe::ep::kEpBadExpert, -1, t * k + j, 0, u64(uint32_t(e)));
    for (int i = 0; i < j; ++i)
      if (p.ids[t * k + i] == e) fail(p, moe::ep::kEpPhaseDispatch, moe::ep::kEpDuplicateExpert, -1, t * k + j, 0, u64(uint32_t(e)));
  }
  // Program order before this rank's release stores (next kernel, after its fence): a peer's add always
  // lands on the armed value.
  *counter(p, p.rank, t) = cell(round_of(p), 0);
}

__global__ void __launch_bounds__(kThreads) ep_send_kernel(const __grid_constant__ EpDeviceParams p) {
  __shared__ int32_t warp_n[kThreads / 32];
  __shared__ int32_t pairs[kThreads];
  __shared__ int32_t chunk_n;
  if (block_aborted(p)) return;
  const int e = blockIdx.x, dest = e / p.e_local, le = e - dest * p.e_local, k = p.top_k;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t total = live_tokens(p) * k;
  uint8_t* rows = region(p, dest, p.rank) + p.region_header + int64_t(le) * p.max_tokens * p.token_stride;
  int32_t base = 0;
  for (int64_t i0 = 0; i0 < total; i0 += kThreads) {
    const int64_t i = i0 + threadIdx.x;
    const bool hit = i < total && __ldg(p.ids + i) == e;
    const unsigned mask = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) warp_n[warp] = __popc(mask);
    __syncthreads();
    int32_t before = 0, n = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      before += w < warp ? warp_n[w] : 0;
      n += warp_n[w];
    }
    if (hit) pairs[before + __popc(mask & ((1u << lane) - 1))] = int32_t(i);
    if (threadIdx.x == 0) chunk_n = n;
    __syncthreads();
    for (int q = 0; q < chunk_n; ++q) {  // rows in token order: slot base + q
      const int32_t src = pairs[q];
      uint8_t* row = rows + int64_t(base + q) * p.token_stride;
      copy16(row, p.x + int64_t(src / k) * p.row_bytes, p.row_bytes);
      for (int64_t b = threadIdx.x; b < p.scale_bytes + 4; b += blockDim.x)
        row[p.row_bytes + b] = b < p.scale_bytes ? p.scales[int64_t(src / k) * p.scale_bytes + b]
                                                 : uint8_t(uint32_t(src) >> (8 * (b - p.scale_bytes)));
    }
    base += chunk_n;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    __threadfence_system();  // this block's rows (and the armed counters) before the count
    u64* cells = reinterpret_cast<u64*>(region(p, dest, p.rank));
    st_release_sys(cells + 2 + le, cell(round_of(p), uint32_t(base + 1)));
  }
}

__global__ void __launch_bounds__(kThreads) ep_recv_counts_kernel(const __grid_constant__ EpDeviceParams p) {
  __shared__ int ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  const int W = p.world, El = p.e_local;
  for (int c = threadIdx.x; c < W * El; c += blockDim.x) {
    const int s = c / El, le = c - s * El;
    const u64* cells = reinterpret_cast<const u64*>(region(p, p.rank, s));
    const u64 want = cell(round_of(p), 1);
    u64 v = 0;
    const bool got = spin(
        p, cells + 2 + le, [&](u64 x) { return (x >> 32) == round_of(p) && uint32_t(x) >= 1 && ((v = x), true); }, moe::ep::kEpPhaseReceive,
        moe::ep::kEpTimeoutCount, s, int64_t(p.rank) * El + le, want);
    if (!got) {
      ok = 0;
      continue;
    }
    const int64_t n = int64_t(uint32_t(v)) - 1;
    if (n > p.max_tokens) {
      fail(p, moe::ep::kEpPhaseReceive, moe::ep::kEpBadCount, s, int64_t(p.rank) * El + le, cell(round_of(p), uint32_t(p.max_tokens + 1)), v);
      ok = 0;
      continue;
    }
    p.counts_from[c] = int32_t(n);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  int64_t total = 0;
  for (int c = 0; ok && c < W * El; ++c) total += p.counts_from[c];
  if (ok && total > p.max_rows) {  // counts valid one by one, too many together: refuse before any copy
    fail(p, moe::ep::kEpPhaseReceive, moe::ep::kEpBadCount, -1, -1, u64(p.max_rows), u64(total));
    ok = 0;
  }
  if (!ok) {  // nothing received this round: an empty table, so the copy and combine kernels do nothing
    for (int c = 0; c <= W * El; ++c) p.table[c] = 0;
    for (int le = 0; le <= El; ++le) p.offsets[le] = 0;
    for (int le = 0; le < El; ++le) p.counts[le] = 0;
    return;
  }
  int32_t at = 0;
  for (int le = 0; le < El; ++le) {
    p.offsets[le] = at;
    for (int s = 0; s < W; ++s) {
      p.table[le * W + s] = at;
      at += p.counts_from[s * El + le];
    }
    p.counts[le] = at - p.offsets[le];
  }
  p.offsets[El] = at;
  p.table[W * El] = at;
}

__global__ void __launch_bounds__(kThreads) ep_recv_copy_kernel(const __grid_constant__ EpDeviceParams p) {
  const int W = p.world, cells = W * p.e_local;
  const int32_t total = p.table[cells];
  for (int64_t i = blockIdx.x; i < total; i += gridDim.x) {  // 64-bit: i + gridDim.x may pass 2^31 - 1
    int lo = 0, hi = cells - 1;  // the last table entry <= i (empty (le, s) pairs repeat an entry)
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.table[mid] <= i) lo = mid;
      else hi = mid - 1;
    }
    const int le = lo / W, s = lo - le * W;
    const int64_t q = i - p.table[lo];
    const uint8_t* row = region(p, p.rank, s) + p.region_header + (int64_t(le) * p.max_tokens + q) * p.token_stride;
    copy16(p.rx + int64_t(i) * p.row_bytes, row, p.row_bytes);
    for (int64_t b = threadIdx.x; b < p.scale_bytes; b += blockDim.x) p.rscales[int64_t(i) * p.scale_bytes + b] = row[p.row_bytes + b];
    if (threadIdx.x == 0) {
      uint32_t src = 0;
      for (int b = 0; b < 4; ++b) src |= uint32_t(row[p.row_bytes + p.scale_bytes + b]) << (8 * b);
      if (int64_t(src) >= p.max_tokens * p.top_k) fail(p, moe::ep::kEpPhaseReceive, moe::ep::kEpBadSlot, s, i, 0, src);
      p.src_rank[i] = s;
      p.src_slot[i] = int32_t(src);
    }
  }
}

__global__ void __launch_bounds__(kThreads) ep_combine_send_kernel(const __grid_constant__ EpDeviceParams p) {
  if (block_aborted(p)) return;
  const int32_t total = p.offsets[p.e_local];
  for (int64_t i = blockIdx.x; i < total; i += gridDim.x) {  // 64-bit: i + gridDim.x may pass 2^31 - 1
    const int origin = p.src_rank[i];
    const int32_t slot = p.src_slot[i];
    copy16(combine_row(p, origin, slot), p.y + int64_t(i) * p.y_row_bytes, p.y_row_bytes);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      add_release_sys(counter(p, origin, slot / p.top_k), 1);
    }
  }
}

__global__ void ep_combine_flags_kernel(const __grid_constant__ EpDeviceParams p) {
  const int s = threadIdx.x;
  if (s >= p.world || aborted(p)) return;
  __threadfence_system();  // the previous kernel's rows and adds before the flag
  st_release_sys(reinterpret_cast<u64*>(region(p, s, p.rank)) + 1, cell(round_of(p), 1));
}

template <typename TI, typename TO>
__global__ void __launch_bounds__(kThreads) ep_combine_recv_kernel(const __grid_constant__ EpDeviceParams p) {
  __shared__ int ready;
  const int k = p.top_k;
  const int64_t H = p.y_row_bytes / int64_t(sizeof(TI));
  const int64_t m = live_tokens(p);
  for (int64_t t = blockIdx.x; t < m; t += gridDim.x) {
    if (threadIdx.x == 0) {
      const u64 want = cell(round_of(p), uint32_t(k));
      ready = spin(p, counter(p, p.rank, t), [&](u64 v) { return v == want; }, moe::ep::kEpPhaseCombine, moe::ep::kEpTimeoutToken, -1, t, want);
    }
    __syncthreads();
    if (!ready) return;
    const TI* rows = reinterpret_cast<const TI*>(combine_row(p, p.rank, t * k));
    const int64_t ld = p.combine_row_bytes / int64_t(sizeof(TI));
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
      float acc = 0.0f;
      for (int j = 0; j < k; ++j) acc = __fmaf_rn(p.weights[t * k + j], to_float<TI>(rows[j * ld + h]), acc);
      static_cast<TO*>(p.out)[t * H + h] = from_float<TO>(acc);
    }
    __syncthreads();
  }
}

__global__ void ep_combine_wait_kernel(const __grid_constant__ EpDeviceParams p) {
  const int s = threadIdx.x;
  if (s >= p.world) return;
  const u64 want = cell(round_of(p), 1);
  spin(p, reinterpret_cast<const u64*>(region(p, p.rank, s)) + 1, [&](u64 v) { return v == want; }, moe::ep::kEpPhaseSync,
       moe::ep::kEpTimeoutFlag, s, -1, want);
}

template <typename TI>
void* combine_recv_kernel_from(DType out) {
  switch (out) {
    case DType::kFP32: return reinterpret_cast<void*>(ep_combine_recv_kernel<TI, float>);
    case DType::kBF16: return reinterpret_cast<void*>(ep_combine_recv_kernel<TI, __nv_bfloat16>);
    case DType::kFP16: return reinterpret_cast<void*>(ep_combine_recv_kernel<TI, __half>);
    default: return nullptr;
  }
}
// The combine's receive kernel for expert outputs of `in` summed into `out` (null: none).
void* combine_recv_kernel(DType in, DType out) {
  switch (in) {
    case DType::kFP32: return combine_recv_kernel_from<float>(out);
    case DType::kBF16: return combine_recv_kernel_from<__nv_bfloat16>(out);
    case DType::kFP16: return combine_recv_kernel_from<__half>(out);
    default: return nullptr;
  }
}

// enqueue(stream) with `device_index` current.
template <class Enqueue>
Status on_device(int device_index, Stream stream, Enqueue&& enqueue) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  return enqueue(static_cast<cudaStream_t>(stream));
}

}  // namespace

Status launch_ep_dispatch_send(const moe::ep::EpDeviceParams& p, int device_index, Stream stream) {
  return on_device(device_index, stream, [&](cudaStream_t s) {
    ENCORE_RETURN_IF_ERROR(launch("ep round", [&] { ep_round_kernel<<<1, 1, 0, s>>>(p); }));
    if (p.m > 0 || p.m_dev) {  // with a device count: also its range check
      ENCORE_RETURN_IF_ERROR(
          launch("ep arm", [&] { ep_arm_kernel<<<unsigned(p.m > 0 ? (p.m + kThreads - 1) / kThreads : 1), kThreads, 0, s>>>(p); }));
    }
    return launch("ep send", [&] { ep_send_kernel<<<unsigned(p.num_experts), kThreads, 0, s>>>(p); });
  });
}

Status launch_ep_dispatch_recv(const moe::ep::EpDeviceParams& p, int device_index, Stream stream) {
  return on_device(device_index, stream, [&](cudaStream_t s) {
    ENCORE_RETURN_IF_ERROR(launch("ep receive counts", [&] { ep_recv_counts_kernel<<<1, kThreads, 0, s>>>(p); }));
    return launch("ep receive copy", [&] { ep_recv_copy_kernel<<<unsigned(p.grid), kThreads, 0, s>>>(p); });
  });
}

Status launch_ep_combine_send(const moe::ep::EpDeviceParams& p, int device_index, Stream stream) {
  return on_device(device_index, stream, [&](cudaStream_t s) {
    ENCORE_RETURN_IF_ERROR(launch("ep combine send", [&] { ep_combine_send_kernel<<<unsigned(p.grid), kThreads, 0, s>>>(p); }));
    return launch("ep combine flags", [&] { ep_combine_flags_kernel<<<1, 32, 0, s>>>(p); });
  });
}

Status launch_ep_combine_recv(const moe::ep::EpDeviceParams& p, int device_index, Stream stream) {
  void* recv = combine_recv_kernel(p.dtype, p.out_dtype);
  if (!recv) return Status::internal(std::string("ep combine: no CUDA kernel for ") + dtype_name(p.dtype) + " -> " + dtype_name(p.out_dtype));
  return on_device(device_index, stream, [&](cudaStream_t s) {
    if (p.m > 0) {
      const unsigned grid = unsigned(p.m < 8 ? p.m : 8);  // spinning blocks: few, so the peers' senders find SMs
      void* args[] = {const_cast<moe::ep::EpDeviceParams*>(&p)};
      ENCORE_RETURN_IF_ERROR(launch_api("ep combine receive", [&] { return cudaLaunchKernel(recv, dim3(grid), dim3(kThreads), args, 0, s); }));
    }
    return launch("ep combine wait", [&] { ep_combine_wait_kernel<<<1, 32, 0, s>>>(p); });
  });
}

// Every kernel of the protocol, loaded now: with lazy module loading (CUDA's default) a kernel's first
// launch may wait for the context's running kernels, and a peer's spinning receive kernel waits in turn
// for this rank's sender: loading it then would stall every rank until the timeout.
Status ep_load_kernels(int device_index) {
  std::vector<const void*> all = {reinterpret_cast<const void*>(ep_round_kernel),        reinterpret_cast<const void*>(ep_arm_kernel),
                                  reinterpret_cast<const void*>(ep_send_kernel),         reinterpret_cast<const void*>(ep_recv_counts_kernel),
                                  reinterpret_cast<const void*>(ep_recv_copy_kernel),    reinterpret_cast<const void*>(ep_combine_send_kernel),
                                  reinterpret_cast<const void*>(ep_combine_flags_kernel), reinterpret_cast<const void*>(ep_combine_wait_kernel)};
  for (DType in : {DType::kFP32, DType::kBF16, DType::kFP16})
    for (DType out : {DType::kFP32, DType::kBF16, DType::kFP16}) all.push_back(combine_recv_kernel(in, out));
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  for (const void* k : all) {
    cudaFuncAttributes attr;
    const cudaError_t e = cudaFuncGetAttributes(&attr, k);
    if (e != cudaSuccess) return Status::cuda_error(std::string("ep: loading the all-to-all's kernels: ") + cudaGetErrorString(e));
  }
  return Status::ok();
}

Status ep_check_device_int(const int32_t* p, int device_index, Stream stream, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 4 != 0) return Status::invalid(std::string(what) + ": must be 4-byte aligned");
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone)
    return Status::ok();  // no pointer query inside a capture (some capture modes refuse other API calls)
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess || (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) || a.device != device_index) {
    cudaGetLastError();  // clear a failed query
    return Status::invalid(std::string(what) + ": must point to device memory of CUDA device " + std::to_string(device_index));
  }
  return Status::ok();
}

Status ep_device_alloc(size_t bytes, int device_index, void** out) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  cudaError_t e = cudaMalloc(out, bytes);
  if (e == cudaSuccess) e = cudaMemset(*out, 0, bytes);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();  // zeroed before any rank's kernel (other streams, other processes)
  if (e != cudaSuccess) return Status::cuda_error(std::string("ep: cudaMalloc / cudaMemset of ") + std::to_string(bytes) + " bytes: " + cudaGetErrorString(e));
  return Status::ok();
}

void ep_device_free(void* p) {
  if (p) cudaFree(p);
}

Status ep_device_read(void* host, const void* device, size_t bytes) {
  const cudaError_t e = cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) return Status::cuda_error(std::string("ep: reading device memory: ") + cudaGetErrorString(e));
  return Status::ok();
}

}  // namespace encore::cuda
