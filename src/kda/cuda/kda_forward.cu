// KDA chunked forward on CUDA (docs/kda.md), two kernels on tensor cores (bf16 operands, fp32 accumulation)
// connected by the workspace layout of kda_device.cuh: the intra-chunk kernel (kda_chunk.cu) writes
// each (chunk, head)'s operands; the state kernel (kda_state.cu) runs the serial inter-chunk pass per
// (sequence, head, 64, 32 or 16 value columns), computing each chunk's o on the way, and writes the final
// state (and the h residual when asked). The chunk kernel's grid and the state kernel's width come
// from the launch plan (kda/plan.hpp), chosen by the dispatch; a problem of <= kKdaFewSeqs sequences
// whose chunk items and state blocks each fit one wave runs both in one kernel (plan.launches 1;
// kda_one_launch_kernel, a cooperative launch), outside graph capture and where its grid is resident
// at once (else the two kernels).
#include <cuda.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "common/cuda/device_guard.hpp"
#include "kda/cuda/kda_device.cuh"
#include "kda/cuda/launch.hpp"

namespace encore::cuda {
namespace {

static_assert(sizeof(KdaCudaProblem) <= 32764, "the problem travels as one kernel parameter (32764-byte limit, CUDA 12.1+)");

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                                 const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess || q != cudaDriverEntryPointSuccess)
      return EncodeTiled(nullptr);
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

// The chunk kernel's TMA descriptor of an input [B, T, H, C]: bf16, boxes of 64 channels x 1 head x
// 64 tokens with 128-byte swizzle (kda_device.cuh's raw_at layout), zeros outside the tensor.
// False (the kernel then reads the input from global memory itself) for fp32 inputs, C not a
// multiple of 8, a base or strides not 16-byte aligned, or anything else the encoder refuses.
bool encode_input_map(unsigned char (&out)[128], const KdaTensor& t, int B, int T, int H, int C) {
  static_assert(sizeof(CUtensorMap) == 128 && alignof(CUtensorMap) <= 128, "CUtensorMap layout");
  if (t.dtype != DType::kBF16 || C % 8 != 0 || (reinterpret_cast<uintptr_t>(t.data) & 15) != 0 || t.sb % 8 != 0 || t.st % 8 != 0 ||
      t.sh % 8 != 0 || t.sb <= 0 || t.st <= 0 || t.sh <= 0)
    return false;
  const EncodeTiled fn = encode_tiled();
  if (!fn) return false;
  const cuuint64_t dims[4] = {cuuint64_t(C), cuuint64_t(H), cuuint64_t(T), cuuint64_t(B)};
  const cuuint64_t strides[3] = {cuuint64_t(t.sh) * 2, cuuint64_t(t.st) * 2, cuuint64_t(t.sb) * 2};  // bytes, dims 1..3
  // The descriptor is a function of the address, dims and strides alone (the rest is fixed here): each thread keeps
  // the last few it encoded and copies one back when all three repeat, as they do call after call where the
  // caching allocator hands the same buffers out again (~60 ns an encode saved, four a launch).
  struct Memo {
    const void* data = nullptr;
    cuuint64_t dims[4] = {}, strides[3] = {};
    unsigned char map[128] = {};
  };
  thread_local Memo memo[4];
  thread_local unsigned next = 0;
  for (const Memo& m : memo)
    if (m.data == t.data && std::equal(dims, dims + 4, m.dims) && std::equal(strides, strides + 3, m.strides)) {
      std::memcpy(out, m.map, 128);
      return true;
    }
  const cuuint32_t box[4] = {64, 1, kda::kC, 1}, elem[4] = {1, 1, 1, 1};
  if (fn(reinterpret_cast<CUtensorMap*>(out), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(t.data), dims, strides, box, elem,
         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return false;
  Memo& m = memo[next++ % 4];
  m.data = t.data;
  std::copy(dims, dims + 4, m.dims);
  std::copy(strides, strides + 3, m.strides);
  std::memcpy(m.map, out, 128);
  return true;
}

// The one-launch kernel's flag value for the next launch: distinct per launch of this process, and seeded
// from the clock and the process so stale flags of another process's launch in reused memory differ too.
unsigned long long next_epoch() {
  static std::atomic<unsigned long long> epoch{(static_cast<unsigned long long>(std::chrono::steady_clock::now().time_since_epoch().count()) << 20) ^
                                               (static_cast<unsigned long long>(::getpid()) << 1)};
  return epoch.fetch_add(1, std::memory_order_relaxed) + 1;
}

// A stream being captured into a graph takes the two kernels: a replay would repeat the epoch, and the flags
// of the previous replay would already hold it.
bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &st) != cudaSuccess) {
    (void)cudaGetLastError();  // (not left for the next launch's check)
    return true;
  }
  return st != cudaStreamCaptureStatusNone;
}

// The test hook (launch.hpp, kda_forward_launches): the kernels of the last chunked forward with chunks.
int g_last_launches = 0;

}  // namespace

int kda_forward_launches() { return g_last_launches; }

size_t kda_forward_workspace_bytes(int64_t chunks, int64_t H) {
  return size_t(chunks * H * (kda::WsLayout::kBytes + 8));  // the records, then the one-launch kernel's flags
}

template <class P>
Status launch_kda_forward(P& p, const ::encore::kda::KdaLaunchPlan& plan, void* workspace, Stream stream) {
  if ((plan.state_columns != 16 && plan.state_columns != 32 && plan.state_columns != 64) || plan.chunk_blocks < 1)
    return Status::internal("kda forward: the launch plan must be resolved (state_columns 16, 32 or 64, chunk_blocks >= 1), got " +
                            std::to_string(plan.state_columns) + ", " + std::to_string(plan.chunk_blocks));
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(p.device));
  if (p.chunk_start[p.N] == 0 && !p.final_state) return Status::ok();
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.chunk_start[p.N] > 0) {
    p.raw_fast = 0;
    const KdaTensor* inputs[4] = {&p.q, &p.k, &p.g, &p.v};
    for (int t = 0; t < 4; ++t)
      if (encode_input_map(p.tmap[t], *inputs[t], p.B, p.T, t < 2 ? p.H / p.group : p.H, t == 3 ? p.V : p.K)) p.raw_fast |= 1 << t;
    if constexpr (std::is_same_v<P, KdaCudaProblemFew>)
      if (plan.launches == 1 && !capturing(s)) {
        const Status one = kda::launch_one_kernel(p, workspace, plan.state_columns, next_epoch(), s);
        if (one.code() != StatusCode::kUnsupported) {  // (unsupported: the grid would not be resident at once)
          if (one.is_ok()) g_last_launches = 1;
          return one;
        }
      }
    ENCORE_RETURN_IF_ERROR(kda::launch_chunk_kernel(p, workspace, plan.chunk_blocks, s));
    g_last_launches = 2;
  }
  return kda::launch_state_kernel(p, workspace, plan.state_columns, s);
}
template Status launch_kda_forward(KdaCudaProblem&, const ::encore::kda::KdaLaunchPlan&, void*, Stream);
template Status launch_kda_forward(KdaCudaProblemFew&, const ::encore::kda::KdaLaunchPlan&, void*, Stream);

}  // namespace encore::cuda
