// MoE dispatch kernels: counts, padded offsets, slot_rows / row_slots and the gather, in exactly the
// CPU reference's layout (within an expert, slots in row-major (t, j) order). Pair i = t * k + j.
//
// Maps, decode (DispatchPath::kSingleBlock): one 256-thread block stages the first 1024 ids in shared
// memory; up to 1024 pairs and 256 experts, each warp ranks its eighth of the pairs with its own
// counters (__match_any_sync groups the lanes of one expert, a lane's rank is the popcount of its
// group's lower lanes, the group's lowest lane advances the counter), counts = the sums of the warps'
// counters; beyond, a shared-memory histogram (atomics: only the counts depend on them). Then a block
// scan of the padded counts, -1 into each expert's padding rows, and the rows: warp w's rows of expert
// e start after the lower warps' (parallel), or warp 0 walks all pairs from the cursors (beyond).
// Maps, prefill (kCountThenScatter): (1) one block per chunk of kDispatchChunkPairs pairs writes its
// histogram to the workspace hist[e][chunk] (and the blocks fill row_slots with -1); (2) one block
// scans hist over the chunks for each expert (a warp per expert), then the padded counts over the
// experts, and turns hist into each chunk's first row per expert (a lane per run of chunks, so the
// loads of a lane are independent); (3) one warp per chunk stages its
// ids in shared memory and ranks its pairs in order as in the decode path, from its cursors.
// Gather (both paths, its own grid of up to plan.grid 256-thread blocks, launched as a programmatic
// dependent of the map kernel: griddepcontrol.wait before it reads the maps): work item = (row r <
// offsets[E], chunk of 32 lanes x kUnroll vectors); 16-byte vectors when rows, strides and pointers are
// 16-byte aligned, else 2-byte; every load of an item is issued before its stores. A padding row is
// zeroed. In the decode path it also writes row_slots[offsets[E], R) = -1.
// Ids outside [0, E) (the host does not scan device ids) are skipped: slot_rows -1, no row.
// NOTES: the gather used to run inside the decode block (8 warps, one load in flight per lane: 1.75 ms
// for 512 rows of 14 KB on the H200); a 2 KB item per warp and the whole GPU make it bandwidth-bound.
// Specializations: the map kernels (single block, histogram, scan, scatter) take <kTopK, kExperts>:
//   0 in the ahead-of-time kernels (k and E read from the params), the problem's k and E in a JIT
//   specialization (docs/jit.md): the pair -> (token, slot) split is a division by a constant and the
//   per-expert loops have constant bounds. Same layout either way. The gather is ahead-of-time only.
// sm_100+ (ENCORE_GLOBAL_256, common/cuda/vector_io.cuh): the 16-byte gather moves 32 bytes per access
//   where both rows are 32-byte aligned; the sm_90 code is unchanged.
// One source, two ways in: dispatch.cu #includes this file; the build embeds it for NVRTC.
#pragma once
#include <cstdint>

#include "common/cuda/pdl.cuh"
#include "common/cuda/reduce.cuh"
#include "common/cuda/vector_io.cuh"
#include "moe/problem.hpp"

namespace encore::cuda {

constexpr int kDispatchThreads = 256;
constexpr int kStagedIds = 1024;  // decode: ids staged in shared memory (the rest read from global)

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
  bool vec16;      // rows, strides and pointers 16-byte aligned
  bool fill_tail;  // gather: row_slots[offsets[E], rows) = -1 (decode: the map block leaves them)
  int32_t* hist;   // prefill: [E][chunks]
  long long chunks;
};

// Programmatic dependent launch (common/cuda/pdl.cuh): the map kernels let the gather's blocks be
// scheduled early; the gather waits for the map grid's completion (and memory flush) before it reads anything.

// The map kernels' k and E: the template arguments of a JIT specialization (both nonzero), else the
// params' (the ahead-of-time kernels, <0, 0>).
template <int kTopK, int kExperts>
__device__ __forceinline__ int top_k_of(const DispatchParams& p) { return kTopK ? kTopK : p.k; }
template <int kTopK, int kExperts>
__device__ __forceinline__ int experts_of(const DispatchParams& p) { return kExperts ? kExperts : p.E; }

// Pair indices are < 2^31 (validate: R < 2^31 and pairs <= R), so 32-bit division splits them.
template <int kTopK, int kExperts>
__device__ __forceinline__ int expert_of(const DispatchParams& p, int64_t i) {
  const int K = top_k_of<kTopK, kExperts>(p);
  const int64_t t = unsigned(i) / unsigned(K);
  const int j = int(i - t * K);
  const int e = p.ids[t * p.ids_stride + j];
  return e >= 0 && e < experts_of<kTopK, kExperts>(p) ? e : -1;
}

// Warp-level stable scatter of pairs [begin, end) with per-expert cursors cur[] (shared memory,
// advanced). The experts of pairs [sid_begin, sid_end) are read from sid[] (shared memory, already
// validated), the others from global memory. Called by all 32 lanes of one warp.
template <int kTopK, int kExperts>
__device__ void rank_and_scatter(const DispatchParams& p, int64_t begin, int64_t end, int* cur, const int* sid, int64_t sid_begin,
                                 int64_t sid_end) {
  const int lane = int(threadIdx.x) & 31;
  const unsigned lower = (1u << lane) - 1u;
  const int K = top_k_of<kTopK, kExperts>(p);
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    const int e = i >= end ? -2 : i >= sid_begin && i < sid_end ? sid[i - sid_begin] : expert_of<kTopK, kExperts>(p, i);
    const unsigned group = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(group & lower);
    int row = -1;
    if (e >= 0) row = cur[e] + rank;
    __syncwarp();
    if (e >= 0 && rank == 0) cur[e] += __popc(group);
    if (i < end) {
      const int64_t t = unsigned(i) / unsigned(K);
      p.slot_rows[t * p.slot_stride + (i - t * K)] = row;
      if (row >= 0) p.row_slots[row] = int32_t(i);
    }
    __syncwarp();
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
    const int inc = warp_inclusive_sum(v);
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

// Decode maps: counts, offsets, slot_rows, row_slots[0, offsets[E]) (data rows and padding rows);
// row_slots[offsets[E], R) and the gather are the gather kernel's. Two ways to rank, same layout:
// - parallel (pairs <= kStagedIds and E <= kParallelRankMaxExperts, every plan-chosen decode): warp w
//   ranks its contiguous segment of the staged pairs with its own counters whist[w][e]; counts are
//   the sums over the warps; after the scan, whist[w][e] becomes warp w's first row of expert e
//   (offsets[e] + the counts of the lower warps), so row = whist[w][e] + local rank: experts' slots
//   in (warp, pair) order = pair order, as the serial walk gives.
// - serial (any size: the forced-path tests): shared-memory histogram (atomics), the scan, then warp 0
//   walks all pairs 32 at a time from the cursors.
constexpr int kParallelRankMaxExperts = 256;
constexpr int kDispatchWarps = kDispatchThreads / 32;

__host__ __device__ constexpr bool parallel_rank(int64_t pairs, int E) { return pairs <= kStagedIds && E <= kParallelRankMaxExperts; }

template <int kTopK = 0, int kExperts = 0>
__global__ void __launch_bounds__(kDispatchThreads) dispatch_single_block_kernel(DispatchParams p) {
  launch_dependents();
  const int K = top_k_of<kTopK, kExperts>(p), E = experts_of<kTopK, kExperts>(p);
  extern __shared__ int smem[];
  int* cnt = smem;               // [E]
  int* off = smem + E;         // [E + 1], then the cursors
  int* scratch = off + E + 1;  // [32]
  int* sid = scratch + 32;       // [kStagedIds]
  int* lrank = sid + kStagedIds;  // parallel: [kStagedIds] rank within the warp's segment
  int* whist = lrank + kStagedIds;  // parallel: [kDispatchWarps][E]
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int64_t staged = p.pairs < kStagedIds ? p.pairs : kStagedIds;
  const bool parallel = parallel_rank(p.pairs, E);
  for (int64_t i = tid; i < staged; i += blockDim.x) sid[i] = expert_of<kTopK, kExperts>(p, i);
  const int seg = int((staged + kDispatchWarps - 1) / kDispatchWarps);  // parallel: pairs per warp
  if (parallel) {
    int* h = whist + warp * E;
    for (int e = lane; e < E; e += 32) h[e] = 0;
    __syncthreads();  // sid complete
    const unsigned lower = (1u << lane) - 1u;
    const int begin = warp * seg, end = begin + seg < int(staged) ? begin + seg : int(staged);
    for (int base = begin; base < end; base += 32) {
      const int i = base + lane;
      const int e = i < end ? sid[i] : -2;
      const unsigned group = __match_any_sync(0xffffffffu, e);
      const int rank = __popc(group & lower);
      if (e >= 0) lrank[i] = h[e] + rank;
      __syncwarp();
      if (e >= 0 && rank == 0) h[e] += __popc(group);
      __syncwarp();
    }
    __syncthreads();  // every warp's counters complete
    for (int e = tid; e < E; e += blockDim.x) {
      int c = 0;
      for (int w = 0; w < kDispatchWarps; ++w) c += whist[w * E + e];
      cnt[e] = c;
    }
  } else {
    for (int e = tid; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int64_t i = tid; i < p.pairs; i += blockDim.x) {
      const int e = i < staged ? sid[i] : expert_of<kTopK, kExperts>(p, i);
      if (e >= 0) atomicAdd(&cnt[e], 1);
    }
  }
  __syncthreads();
  block_scan_offsets(cnt, off, E, p.align_m, scratch);
  const int nwarps = int(blockDim.x) >> 5;
  for (int e = tid; e < E; e += blockDim.x) p.counts[e] = cnt[e];
  for (int e = tid; e <= E; e += blockDim.x) p.offsets[e] = off[e];
  for (int e = warp; e < E; e += nwarps)  // padding rows (disjoint from the data rows ranked below)
    for (int r = off[e] + cnt[e] + lane; r < off[e + 1]; r += 32) p.row_slots[r] = -1;
  if (parallel) {
    for (int e = tid; e < E; e += blockDim.x) {  // whist[w][e] -> warp w's first row of expert e
      int run = off[e];
      for (int w = 0; w < kDispatchWarps; ++w) {
        const int c = whist[w * E + e];
        whist[w * E + e] = run;
        run += c;
      }
    }
    __syncthreads();
    for (int i = tid; i < int(staged); i += blockDim.x) {
      const int e = sid[i];
      const int row = e >= 0 ? whist[(i / seg) * E + e] + lrank[i] : -1;
      const int t = i / K;
      p.slot_rows[int64_t(t) * p.slot_stride + (i - t * K)] = row;
      if (row >= 0) p.row_slots[row] = i;
    }
    return;
  }
  __syncthreads();  // everyone has read off[] before warp 0 advances the cursors
  if (tid < 32) rank_and_scatter<kTopK, kExperts>(p, 0, p.pairs, off, sid, 0, staged);
}

template <int kTopK = 0, int kExperts = 0>
__global__ void __launch_bounds__(kDispatchThreads) dispatch_histogram_kernel(DispatchParams p) {
  const int E = experts_of<kTopK, kExperts>(p);
  extern __shared__ int h[];  // [E]
  const int tid = int(threadIdx.x);
  for (int e = tid; e < E; e += blockDim.x) h[e] = 0;
  __syncthreads();
  const int64_t begin = int64_t(blockIdx.x) * moe::kDispatchChunkPairs;
  const int64_t end = begin + moe::kDispatchChunkPairs < p.pairs ? begin + moe::kDispatchChunkPairs : p.pairs;
  for (int64_t i = begin + tid; i < end; i += blockDim.x) {
    const int e = expert_of<kTopK, kExperts>(p, i);
    if (e >= 0) atomicAdd(&h[e], 1);
  }
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) p.hist[int64_t(e) * p.chunks + blockIdx.x] = h[e];
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + tid; r < p.rows; r += int64_t(gridDim.x) * blockDim.x) p.row_slots[r] = -1;
}

// Sum over the lanes of a warp of the lane's chunks [lo, hi) of one expert's histogram h (read-only
// loop: the loads of a lane are independent and pipelined).
__device__ __forceinline__ int lane_chunk_sum(const int32_t* h, long long lo, long long hi) {
  int s = 0;
#pragma unroll 4
  for (long long c = lo; c < hi; ++c) s += h[c];
  return s;
}

// One block of 1024 threads: hist[e][c] -> first row of chunk c's pairs of expert e. A warp per
// expert, lane l owns the contiguous chunks [l * per, (l + 1) * per): (1) counts = the warp's sum;
// (2) the block scan of the padded counts; (3) each lane re-reads its chunks, the warp scans the lane
// sums, and the lane writes its chunks' first rows in order.
template <int kTopK = 0, int kExperts = 0>
__global__ void __launch_bounds__(1024) dispatch_scan_kernel(DispatchParams p) {
  const int E = experts_of<kTopK, kExperts>(p);
  extern __shared__ int smem[];
  int* cnt = smem;               // [E]
  int* off = smem + E;         // [E + 1]
  int* scratch = off + E + 1;  // [32]
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5, nwarps = int(blockDim.x) >> 5;
  const long long per = (p.chunks + 31) / 32;
  const long long lo = lane * per < p.chunks ? lane * per : p.chunks;
  const long long hi = lo + per < p.chunks ? lo + per : p.chunks;
  for (int e = warp; e < E; e += nwarps) {
    const int s = __reduce_add_sync(0xffffffffu, lane_chunk_sum(p.hist + int64_t(e) * p.chunks, lo, hi));
    if (lane == 0) cnt[e] = s;
  }
  __syncthreads();
  block_scan_offsets(cnt, off, E, p.align_m, scratch);
  for (int e = tid; e < E; e += blockDim.x) p.counts[e] = cnt[e];
  for (int e = tid; e <= E; e += blockDim.x) p.offsets[e] = off[e];
  for (int e = warp; e < E; e += nwarps) {
    int32_t* h = p.hist + int64_t(e) * p.chunks;
    const int s = lane_chunk_sum(h, lo, hi);
    const int inc = warp_inclusive_sum(s);
    int run = off[e] + inc - s;
    for (long long c = lo; c < hi; ++c) {
      const int v = h[c];
      h[c] = run;
      run += v;
    }
  }
}

// One warp per chunk: its ids staged in shared memory (one round of independent loads), then ranked.
template <int kTopK = 0, int kExperts = 0>
__global__ void __launch_bounds__(32) dispatch_scatter_kernel(DispatchParams p) {
  launch_dependents();
  const int E = experts_of<kTopK, kExperts>(p);
  extern __shared__ int cur[];  // [E], then the chunk's experts [kDispatchChunkPairs]
  int* sid = cur + E;
  const int lane = int(threadIdx.x);
  const int64_t begin = int64_t(blockIdx.x) * moe::kDispatchChunkPairs;
  const int64_t end = begin + moe::kDispatchChunkPairs < p.pairs ? begin + moe::kDispatchChunkPairs : p.pairs;
  for (int e = lane; e < E; e += 32) cur[e] = p.hist[int64_t(e) * p.chunks + blockIdx.x];
  for (int64_t i = begin + lane; i < end; i += 32) sid[i - begin] = expert_of<kTopK, kExperts>(p, i);
  __syncwarp();
  rank_and_scatter<kTopK, kExperts>(p, begin, end, cur, sid, begin, end);
}

template <int kBytes> struct VecOf;
template <> struct VecOf<16> { using type = uint4; };
template <> struct VecOf<2> { using type = unsigned short; };

__device__ __forceinline__ uint4 load_ro(const uint4* p) { return __ldg(p); }
__device__ __forceinline__ unsigned short load_ro(const unsigned short* p) { return __ldg(p); }
__device__ __forceinline__ void set_zero(uint4& v) { v = make_uint4(0u, 0u, 0u, 0u); }
__device__ __forceinline__ void set_zero(unsigned short& v) { v = 0; }

// One warp per (row, chunk) item: the chunk is 32 lanes x kUnroll vectors of kBytes (2 KB for 16-byte
// vectors); rows [0, offsets[E]) only. Launched with programmatic stream serialization.
template <int kBytes, int kUnroll>
__global__ void __launch_bounds__(kDispatchThreads, moe::kDispatchGatherBlocksPerSm) dispatch_gather_kernel(DispatchParams p) {
  using V = typename VecOf<kBytes>::type;
  constexpr int64_t kChunk = int64_t(32) * kBytes * kUnroll;
  wait_for_primary();
  const int total = p.offsets[p.E];
  if (p.fill_tail) {
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    for (int64_t r = int64_t(total) + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < p.rows; r += stride) p.row_slots[r] = -1;
  }
  if (p.x == nullptr) return;
  const int lane = int(threadIdx.x) & 31;
  // 32-bit item indices: items < 2^31, since the rows of more than one chunk fit in device memory.
  const unsigned per_row = unsigned((p.row_bytes + kChunk - 1) / kChunk);
  const unsigned items = unsigned(total) * per_row;
  const unsigned warps = gridDim.x * (blockDim.x >> 5);
  for (unsigned it = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
    const unsigned r = it / per_row;
    const int start = int(it - r * per_row) * int(kChunk);
    const int left = int(p.row_bytes) - start;  // bytes of the row from this chunk on
    const int32_t slot = p.row_slots[r];
#if ENCORE_GLOBAL_256
    if constexpr (kBytes == 16 && kUnroll % 2 == 0) {
      // sm_100+: the same chunk with lane l taking the 32-byte pairs (u * 32 + l): one 256-bit load and
      // store each when both rows are 32-byte aligned (a 16-byte tail at the row's end: 128-bit).
      unsigned char* dst8 = p.xp + int64_t(r) * p.xp_stride_bytes + start;
      const unsigned char* src8 = slot >= 0 ? p.x + int64_t(unsigned(slot) / unsigned(p.k)) * p.x_stride_bytes + start : nullptr;
      if (aligned32(dst8) && (src8 == nullptr || aligned32(src8))) {
        Bits256 w[kUnroll / 2];
#pragma unroll
        for (int u = 0; u < kUnroll / 2; ++u) {
          const int at = (u * 32 + lane) * 32;
          w[u] = Bits256{make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
          if (src8 && at + 32 <= left) w[u] = ld_global_v8<kCacheReadOnly>(src8 + at);
          else if (src8 && at < left) w[u].lo = __ldg(reinterpret_cast<const uint4*>(src8 + at));
        }
#pragma unroll
        for (int u = 0; u < kUnroll / 2; ++u) {
          const int at = (u * 32 + lane) * 32;
          if (at + 32 <= left) st_global_v8<false>(dst8 + at, w[u]);
          else if (at < left) *reinterpret_cast<uint4*>(dst8 + at) = w[u].lo;
        }
        continue;
      }
    }
#endif
    V* dst = reinterpret_cast<V*>(p.xp + int64_t(r) * p.xp_stride_bytes + start);
    V v[kUnroll];
    if (slot >= 0) {
      const V* src = reinterpret_cast<const V*>(p.x + int64_t(unsigned(slot) / unsigned(p.k)) * p.x_stride_bytes + start);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int idx = u * 32 + lane;
        if (idx * kBytes < left) v[u] = load_ro(src + idx);
      }
    } else {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) set_zero(v[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int idx = u * 32 + lane;
      if (idx * kBytes < left) dst[idx] = v[u];
    }
  }
}

}  // namespace encore::cuda
