// Device helpers of the CUDA KDA backward (kda_backward.cu and the kernels of kda_bwd_*.cu): the
// chunk map, the workspace record, guarded input and residual loads, output stores, and the
// launchers the host entry calls in order (math: docs/math/kda.md §6; the CPU ground
// truth stage by stage: src/kda/reference/kda_chunked_bwd.cpp). The kernels run their products on
// tensor cores (kda_bwd_mma.cuh) and pass their intermediates through the workspace record.
#pragma once
#include <cuda_runtime.h>

#include "kda/cuda/kda_bwd_launch.hpp"
#include "kda/cuda/kda_device.cuh"

namespace encore::cuda::kdabwd {

using ::encore::cuda::kda::load;
using ::encore::cuda::kda::store;

constexpr int kC = 64;         // chunk rows
constexpr int kMaxD = 128;     // K, V <= 128
constexpr int kTile = kC * kMaxD;  // floats of a [64][128] shared tile

struct ChunkInfo {
  int n, b, t0, rows;
};

// Sequence of chunk slot `slot`: the last n with chunk_start[n] <= slot (empty sequences own none).
__device__ __forceinline__ ChunkInfo chunk_info(const KdaBwdCudaProblem& p, int slot) {
  int lo = 0, hi = p.N - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.chunk_start[mid] <= slot) lo = mid;
    else hi = mid - 1;
  }
  ChunkInfo c;
  c.n = lo;
  c.b = p.varlen ? 0 : lo;
  c.t0 = p.seq_begin[lo] + (slot - p.chunk_start[lo]) * kC;
  c.rows = min(kC, p.seq_end[lo] - c.t0);
  return c;
}

__device__ __forceinline__ float* ws_rec(float* ws, const KdaBwdCudaProblem& p, int slot, int h) {
  return ws + (int64_t(slot) * p.H + h) * p.ws.rec;
}

// Token index (b * T + t) * H + h of a contiguous [B, T, H, *] residual.
__device__ __forceinline__ int64_t tok(const KdaBwdCudaProblem& p, int b, int t, int h) {
  return (int64_t(b) * p.T + t) * p.H + h;
}

// Guarded loads for the staging loops' sources, without control flow: the load always issues (at the
// base itself when !ok) and its value is dropped, so an unrolled loop keeps all its loads in flight. A
// branch per element (`ok ? load : 0`) made each load wait for the one before (long-scoreboard stalls on
// every staged element: most of a chunk-parallel kernel's time, in both backwards' profiles).
// A plain (coherent) load: some sources are record areas this kernel wrote before a barrier.
__device__ __forceinline__ float ld_or0(const float* x, int64_t off, bool ok) {
  const float v = x[ok ? off : 0];
  return ok ? v : 0.f;
}
// Through the read-only path: sources no thread of this kernel writes (inputs, earlier kernels' records).
__device__ __forceinline__ float ldg_or0(const float* x, int64_t off, bool ok) {
  const float v = __ldg(x + (ok ? off : 0));
  return ok ? v : 0.f;
}
// bf16 or fp32 (the residuals' dtypes) at x[off].
__device__ __forceinline__ float load_any_or0(const void* x, DType dt, int64_t off, bool ok) {
  off = ok ? off : 0;
  const float v = dt == DType::kBF16 ? __bfloat162float(__ldg(static_cast<const __nv_bfloat16*>(x) + off)) : __ldg(static_cast<const float*>(x) + off);
  return ok ? v : 0.f;
}
// Element c of token tok, head h of an input tensor (kda::load's addressing and dtypes).
__device__ __forceinline__ float load_or0(const KdaTensor& t, int b, int tok, int h, int c, bool ok) {
  const int64_t off = ok ? int64_t(b) * t.sb + int64_t(tok) * t.st + int64_t(h) * t.sh + c : 0;
  // One 32- or 16-bit load (two predicated loads, not a branch per dtype), then the conversion by selects.
  const bool wide = t.dtype == DType::kFP32;
  float w = 0.f;
  unsigned short n = 0;
  if (wide) w = __ldg(static_cast<const float*>(t.data) + off);
  else n = __ldg(static_cast<const unsigned short*>(t.data) + off);
  const float v = wide ? w : t.dtype == DType::kBF16 ? __uint_as_float(uint32_t(n) << 16) : __half2float(__ushort_as_half(n));
  return ok ? v : 0.f;
}

__device__ __forceinline__ void store_out(const KdaOutTensor& o, int b, int t, int h, int c, float x) {
  store(o.data, o.dtype, int64_t(b) * o.sb + int64_t(t) * o.st + int64_t(h) * o.sh + c, x);
}

// Launchers (one per kernel), in the order the host entry runs them.
Status launch_prep_tc(const KdaBwdCudaProblem& p, float* ws, int slots, cudaStream_t s);    // kda_bwd_recompute_tc.cu
Status launch_states_tc(const KdaBwdCudaProblem& p, float* ws, int slots, cudaStream_t s);  // kda_bwd_recompute_tc.cu
Status launch_dav(const KdaBwdCudaProblem& p, float* ws, int slots, cudaStream_t s);        // kda_bwd_dav.cu
Status launch_dh(const KdaBwdCudaProblem& p, float* ws, cudaStream_t s);                    // kda_bwd_reverse.cu
Status launch_inter(const KdaBwdCudaProblem& p, float* ws, int slots, cudaStream_t s);      // kda_bwd_inter.cu (kernel 3b-1)
Status launch_grads_tc(const KdaBwdCudaProblem& p, float* ws, int slots, cudaStream_t s);   // kda_bwd_grads_tc.cu (kernel 3b)
// dA_log[h] and ddt_bias[h, :] from per-(chunk slot, head) partials at parts + (c H + h) rec (+ pdt,
// + pda floats): channels' sums over the slots in order, then dA_log over the channels in order.
Status launch_gate_reduce_parts(const KdaBwdCudaProblem& p, const float* parts, int64_t rec, int64_t pdt, int64_t pda, int slots,
                                cudaStream_t s);  // kda_backward.cu
Status launch_group_reduce(const KdaBwdCudaProblem& p, const KdaOutTensor& dq, const KdaOutTensor& dk, cudaStream_t s);  // kda_backward.cu

}  // namespace encore::cuda::kdabwd
