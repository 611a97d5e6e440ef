// MoE dispatch on CUDA: counts, padded offsets, slot_rows / row_slots and the gather, in exactly the
// CPU reference's layout (within an expert, slots in row-major (t, j) order). Pair i = t * k + j.
//
// Decode (DispatchPath::kSingleBlock): one 256-thread block: shared-memory histogram (atomics: only
// the counts depend on them), a block scan of the padded counts, row_slots = -1, then warp 0 walks
// the pairs in order, 32 at a time: __match_any_sync groups the lanes of one expert, a lane's rank
// is the popcount of its group's lower lanes, the group's lowest lane advances the expert's cursor;
// then every warp gathers rows.
// Prefill (kCountThenScatter): (1) one block per chunk of kDispatchChunkPairs pairs writes its
// histogram to the workspace hist[e][chunk] (and the blocks fill row_slots with -1); (2) one block
// scans hist over the chunks for each expert (a warp per expert), then the padded counts over the
// experts, and turns hist into each chunk's first row per expert; (3) one warp per chunk ranks its
// pairs in order as in the decode path, from its cursors; (4) one warp per row gathers x (16-byte
// vectors when every row is 16-byte aligned) or zeroes a padding row, up to offsets[E].
// Ids outside [0, E) (the host does not scan device ids) are skipped: slot_rows -1, no row.
#include <cuda_runtime.h>

#include <string>

#include "common/cuda/device_guard.hpp"
#include "moe/cuda/launch.hpp"

namespace encore::cuda {
namespace {

constexpr int kThreads = 256;

struct DispatchParams {
  const int32_t* ids;
  int64_t ids_stride;
  int64_t pairs;
  int k, E, align_m;
  int32_t* counts;
  int32_t* offsets;
  int32_t* slot_rows;
  int64_t slot_stride;
  int32_t* row_slots;
  int64_t rows;
  const unsigned char* x;  // nullptr: maps only
  int64_t x_stride_bytes;
  unsigned char* xp;
  int64_t xp_stride_bytes;
  int64_t row_bytes;
  bool vec16;  // rows, strides and pointers 16-byte aligned
  int32_t* hist;  // prefill: [E][chunks]
  long long chunks;
};

__device__ __forceinline__ int expert_of(const DispatchParams& p, int64_t i) {
  const int64_t t = i / p.k;
  const int j = int(i - t * p.k);
  const int e = p.ids[t * p.ids_stride + j];
  return e >= 0 && e < p.E ? e : -1;
}

// Warp-level stable scatter of pairs [begin, end) with per-expert cursors cur[] (shared memory,
// advanced). Called by all 32 lanes of one warp.
__device__ void rank_and_scatter(const DispatchParams& p, int64_t begin, int64_t end, int* cur) {
  const int lane = int(threadIdx.x) & 31;
  const unsigned lower = (1u << lane) - 1u;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    const int e = i < end ? expert_of(p, i) : -2;
    const unsigned group = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(group & lower);
    int row = -1;
    if (e >= 0) row = cur[e] + rank;
    __syncwarp();
    if (e >= 0 && rank == 0) cur[e] += __popc(group);
    if (i < end) {
      const int64_t t = i / p.k;
      p.slot_rows[t * p.slot_stride + (i - t * p.k)] = row;
      if (row >= 0) p.row_slots[row] = int32_t(i);
    }
    __syncwarp();
  }
}

// One warp copies (or zeroes) permuted row r.
__device__ __forceinline__ void gather_row(const DispatchParams& p, int32_t r, int lane) {
  const int32_t slot = p.row_slots[r];
  unsigned char* dst = p.xp + int64_t(r) * p.xp_stride_bytes;
  if (slot >= 0) {
    const unsigned char* src = p.x + (int64_t(slot) / p.k) * p.x_stride_bytes;
    if (p.vec16) {
      for (int64_t b = int64_t(lane) * 16; b < p.row_bytes; b += 32 * 16)
        *reinterpret_cast<uint4*>(dst + b) = *reinterpret_cast<const uint4*>(src + b);
    } else {
      for (int64_t b = int64_t(lane) * 2; b < p.row_bytes; b += 32 * 2)  // element sizes are 2 or 4 bytes
        *reinterpret_cast<uint16_t*>(dst + b) = *reinterpret_cast<const uint16_t*>(src + b);
    }
  } else {
    if (p.vec16) {
      for (int64_t b = int64_t(lane) * 16; b < p.row_bytes; b += 32 * 16) *reinterpret_cast<uint4*>(dst + b) = make_uint4(0, 0, 0, 0);
    } else {
      for (int64_t b = int64_t(lane) * 2; b < p.row_bytes; b += 32 * 2) *reinterpret_cast<uint16_t*>(dst + b) = 0;
    }
  }
}

// Block-wide exclusive scan of the padded counts cnt[0..E) into off[0..E] (shared), any blockDim
// multiple of 32 up to 1024. scratch: 32 ints.
__device__ void block_scan_offsets(const int* cnt, int* off, int E, int align_m, int* scratch) {
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5, nwarps = int(blockDim.x) >> 5;
  int carry = 0;
  for (int base = 0; base < E; base += int(blockDim.x)) {
    const int e = base + tid;
    const int v = e < E ? (cnt[e] + align_m - 1) / align_m * align_m : 0;
    int inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, inc, o);
      if (lane >= o) inc += n;
    }
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < nwarps; ++w) {
      if (w < warp) before += scratch[w];
      total += scratch[w];
    }
    if (e < E) off[e] = carry + before + inc - v;
    carry += total;
    __syncthreads();
  }
  if (tid == 0) off[E] = carry;
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) dispatch_single_block_kernel(DispatchParams p) {
  extern __shared__ int smem[];
  int* cnt = smem;              // [E]
  int* off = smem + p.E;        // [E + 1], then the cursors
  int* scratch = off + p.E + 1;  // [32]
  const int tid = int(threadIdx.x);
  for (int e = tid; e < p.E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int64_t i = tid; i < p.pairs; i += blockDim.x) {
    const int e = expert_of(p, i);
    if (e >= 0) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  block_scan_offsets(cnt, off, p.E, p.align_m, scratch);
  for (int e = tid; e < p.E; e += blockDim.x) p.counts[e] = cnt[e];
  for (int e = tid; e <= p.E; e += blockDim.x) p.offsets[e] = off[e];
  for (int64_t r = tid; r < p.rows; r += blockDim.x) p.row_slots[r] = -1;
  const int total = off[p.E];
  __syncthreads();  // everyone has read off[E] and written row_slots before warp 0 advances the cursors
  if (tid < 32) rank_and_scatter(p, 0, p.pairs, off);
  __syncthreads();  // row_slots complete (global writes of this block are visible after the barrier)
  if (p.x) {
    const int warp = tid >> 5, lane = tid & 31, nwarps = int(blockDim.x) >> 5;
    for (int r = warp; r < total; r += nwarps) gather_row(p, r, lane);
  }
}

__global__ void __launch_bounds__(kThreads) dispatch_histogram_kernel(DispatchParams p) {
  extern __shared__ int h[];  // [E]
  const int tid = int(threadIdx.x);
  for (int e = tid; e < p.E; e += blockDim.x) h[e] = 0;
  __syncthreads();
  const int64_t begin = int64_t(blockIdx.x) * moe::kDispatchChunkPairs;
  const int64_t end = begin + moe::kDispatchChunkPairs < p.pairs ? begin + moe::kDispatchChunkPairs : p.pairs;
  for (int64_t i = begin + tid; i < end; i += blockDim.x) {
    const int e = expert_of(p, i);
    if (e >= 0) atomicAdd(&h[e], 1);
  }
  __syncthreads();
  for (int e = tid; e < p.E; e += blockDim.x) p.hist[int64_t(e) * p.chunks + blockIdx.x] = h[e];
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + tid; r < p.rows; r += int64_t(gridDim.x) * blockDim.x) p.row_slots[r] = -1;
}

// One block of 1024 threads: hist[e][c] -> first row of chunk c's pairs of expert e.
__global__ void __launch_bounds__(1024) dispatch_scan_kernel(DispatchParams p) {
  extern __shared__ int smem[];
  int* cnt = smem;               // [E]
  int* off = smem + p.E;         // [E + 1]
  int* scratch = off + p.E + 1;  // [32]
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5, nwarps = int(blockDim.x) >> 5;
  for (int e = warp; e < p.E; e += nwarps) {
    int32_t* h = p.hist + int64_t(e) * p.chunks;
    int running = 0;
    for (long long base = 0; base < p.chunks; base += 32) {
      const long long c = base + lane;
      const int v = c < p.chunks ? h[c] : 0;
      int inc = v;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
      }
      if (c < p.chunks) h[c] = running + inc - v;
      running += __shfl_sync(0xffffffffu, inc, 31);
    }
    if (lane == 0) cnt[e] = running;
  }
  __syncthreads();
  block_scan_offsets(cnt, off, p.E, p.align_m, scratch);
  for (int e = tid; e < p.E; e += blockDim.x) p.counts[e] = cnt[e];
  for (int e = tid; e <= p.E; e += blockDim.x) p.offsets[e] = off[e];
  for (int e = warp; e < p.E; e += nwarps) {
    int32_t* h = p.hist + int64_t(e) * p.chunks;
    for (long long c = lane; c < p.chunks; c += 32) h[c] += off[e];
  }
}

// One warp per chunk.
__global__ void __launch_bounds__(32) dispatch_scatter_kernel(DispatchParams p) {
  extern __shared__ int cur[];  // [E]
  const int lane = int(threadIdx.x);
  for (int e = lane; e < p.E; e += 32) cur[e] = p.hist[int64_t(e) * p.chunks + blockIdx.x];
  __syncwarp();
  const int64_t begin = int64_t(blockIdx.x) * moe::kDispatchChunkPairs;
  const int64_t end = begin + moe::kDispatchChunkPairs < p.pairs ? begin + moe::kDispatchChunkPairs : p.pairs;
  rank_and_scatter(p, begin, end, cur);
}

__global__ void __launch_bounds__(kThreads) dispatch_gather_kernel(DispatchParams p) {
  const int lane = int(threadIdx.x) & 31;
  const int total = p.offsets[p.E];
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); r < total; r += warps) gather_row(p, int32_t(r), lane);
}

Status check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status::cuda_error(std::string("moe dispatch ") + what + " launch: " + cudaGetErrorString(e));
  return Status::ok();
}

}  // namespace

Status launch_moe_dispatch(const moe::DispatchProblem& p, const moe::DispatchPlan& plan, int device_index, Stream stream) {
  if (p.num_experts < 1 || p.num_experts > moe::kCudaDispatchMaxExperts)
    return Status::unsupported("moe dispatch: E = " + std::to_string(p.num_experts) + " experts; the CUDA kernels take at most " +
                               std::to_string(moe::kCudaDispatchMaxExperts));
  const int64_t pairs = p.tokens * p.top_k;
  const long long chunks = (pairs + moe::kDispatchChunkPairs - 1) / moe::kDispatchChunkPairs;
  if (plan.path == moe::DispatchPath::kCountThenScatter &&
      plan.workspace_bytes < size_t(p.num_experts) * size_t(chunks < 1 ? 1 : chunks) * sizeof(int32_t))
    return Status::internal("moe dispatch: the plan's workspace does not hold the histograms");
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  DispatchParams k{};
  k.ids = p.topk_ids;
  k.ids_stride = p.ids_stride;
  k.pairs = pairs;
  k.k = p.top_k;
  k.E = p.num_experts;
  k.align_m = p.align_m;
  k.counts = p.counts;
  k.offsets = p.offsets;
  k.slot_rows = p.slot_rows;
  k.slot_stride = p.slot_stride;
  k.row_slots = p.row_slots;
  k.rows = p.rows;
  if (p.x) {
    const int64_t esz = int64_t(dtype_size(p.dtype));
    k.x = static_cast<const unsigned char*>(p.x);
    k.x_stride_bytes = p.x_stride * esz;
    k.xp = static_cast<unsigned char*>(p.x_permuted);
    k.xp_stride_bytes = p.xp_stride * esz;
    k.row_bytes = p.hidden * esz;
    k.vec16 = k.row_bytes % 16 == 0 && k.x_stride_bytes % 16 == 0 && k.xp_stride_bytes % 16 == 0 &&
              reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && reinterpret_cast<uintptr_t>(p.x_permuted) % 16 == 0;
  }
  k.hist = p.cursors;
  k.chunks = chunks < 1 ? 1 : chunks;
  const size_t smem_scan = (size_t(2) * size_t(p.num_experts) + 1 + 32) * sizeof(int);
  if (plan.path == moe::DispatchPath::kSingleBlock || pairs == 0) {
    dispatch_single_block_kernel<<<1, kThreads, smem_scan, s>>>(k);
    return check_launch("single-block");
  }
  const unsigned nchunks = unsigned(chunks);
  const size_t smem_e = size_t(p.num_experts) * sizeof(int);
  dispatch_histogram_kernel<<<nchunks, kThreads, smem_e, s>>>(k);
  ENCORE_RETURN_IF_ERROR(check_launch("histogram"));
  dispatch_scan_kernel<<<1, 1024, smem_scan, s>>>(k);
  ENCORE_RETURN_IF_ERROR(check_launch("scan"));
  dispatch_scatter_kernel<<<nchunks, 32, smem_e, s>>>(k);
  ENCORE_RETURN_IF_ERROR(check_launch("scatter"));
  if (p.x) {
    dispatch_gather_kernel<<<unsigned(plan.grid < 1 ? 1 : plan.grid), kThreads, 0, s>>>(k);
    ENCORE_RETURN_IF_ERROR(check_launch("gather"));
  }
  return Status::ok();
}

}  // namespace encore::cuda
