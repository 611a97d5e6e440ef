// KDA inter-chunk state and output pass (docs/kda.md, "Design"): grid (H · ceil(V / kVs), N), 512 threads
// (four warpgroups) for kVs = 64, 32 or 16 value columns; the serial pass of one sequence and head
// over its chunks on a kVs-column slice of the state, with each chunk's output on the way;
// blockIdx.y ranks the sequences longest first (p.seq_by_length), so when the grid exceeds one wave
// the blocks left for later are the short passes (varlen with 160 blocks on 132 SMs: the critical
// path is the longest sequence, not a short one followed by the longest). Per chunk, on wgmma (bf16
// operands in shared memory in the 128-byte swizzled layout, fp32 accumulators; S [K, kVs] fp32 in
// the registers of warpgroups 2 and 3, state rows 64 (wg − 2)..):
//
//   warpgroup 0:     Vnew = U − W h_t                  [64 x kVs], K = 128 -> Vnewᵀ as bf16 hi + lo
//   warpgroup 1:     O = Qg h_t; after the barrier O += Aqk_hi Vnew_hi + Aqk_lo Vnew_hi + Aqk_hi Vnew_lo
//   warpgroups 2, 3: the h residual from fp32 S, S ⊙= dC; after the barrier S += Kgᵀ Vnew_hi, then
//                    h_{t+1}ᵀ in bf16 for the next chunk's products
//
// h_t is S at the chunk's start; its bf16 transpose and Vnewᵀ (the products' B operands, K-major)
// are written from the accumulators by stmatrix.trans. o in its dtype for the chunk's valid rows and
// the first V columns. S and Vnew enter the products rounded to bf16, like the chunk operands (as fla
// does). A chunk's operands (W, Kg, Qg, Aqk, dC: one bulk copy; the U slices of the block's
// columns: a second) arrive by cp.async.bulk on an mbarrier, issued by one thread, one chunk ahead
// (two stages). wgmma rather than mma.sync: 16 warps of 16 x 16 mma.sync tiles were bound by their
// ldmatrix traffic (~490 KB a step); a wgmma version whose fragments went to shared memory by
// scalar stores lost to that, one warp per scheduler issuing them (stmatrix.trans fixed it).
//
// The prefill on a state pool (p.pool set; include/encore/kda_serving.hpp's KdaPoolForwardArgs): S starts
// from slot idx[n] of the pool (fp32, or bf16 converted) instead of h0 and the final state goes back
// there in the pool's dtype, in place (each element read and written by the same thread; the blocks of
// a slot own disjoint heads and columns). Thread 0 loads idx[n] once into shared memory (one barrier
// before the pass; a sequence without tokens returns before it, reading and writing nothing). The
// device index contract (as the decode kernel's, kda_decode.cu): idx < 0 is padding, the block writes
// zeros into the sequence's o rows of its head and columns; idx >= P writes NaN there (the error shows
// in o); either way the block returns without touching the pool. Duplicate slots are the caller's
// contract. The branch is taken once per block; the path without a pool is the one above.
//
// state_pass is the body of one block of the state kernel (kda_state.cu: block (bx, by) = its blockIdx)
// and of the state phase of the one-launch forward (kda_chunk.cu). chunk_ready(slot, h), called by thread 0
// before the first read of record (slot, h), returns once the record is written (the one-launch kernel's
// acquire on the chunk item's flag; a no-op after a separate chunk kernel).
#pragma once
#include "common/cuda/wgmma.cuh"
#include "kda/cuda/kda_device.cuh"

namespace encore::cuda::kda::state {

constexpr int kStages = 2;
constexpr int kThreads = 512;

// Shared memory of a block of kVs value columns, byte offsets from a 1024-byte aligned base (the
// allocation has 1024 bytes of slack for it).
template <int kVs>
struct StateSmem {
  static constexpr int kUBytes = int(kVs / kUSlice * WsLayout::kUSliceBytes);     // the block's U slices
  static constexpr int kStage = int((WsLayout::kU + kUBytes + 1023) / 1024 * 1024);  // W .. dC, then the U slices at kU
  static constexpr int kSt = kStages * kStage;    // bf16 h_tᵀ [2][kVs][64] (K = key channels, two halves of 64)
  static constexpr int kVt = kSt + 2 * kVs * 128;  // bf16 Vnewᵀ [kVs][64] hi (K = chunk tokens)
  static constexpr int kVtLo = kVt + kVs * 128;    // lo
  static constexpr int kBar = kVtLo + kVs * 128;   // uint64 [kStages] stage barriers
  static constexpr int kSlot = kBar + kStages * 8;  // int64: the sequence's pool slot (prefill on a pool)
  static constexpr int kBytes = kSlot + 8;
  static constexpr int kAlloc = kBytes + 1024;
  static_assert(kVs % kUSlice == 0, "a block's columns are whole U slices");
  static_assert(kStage % 1024 == 0 && kVt % 1024 == 0 && kVtLo % 1024 == 0, "swizzled tiles 1024-byte aligned");
  static_assert(kAlloc <= 227 * 1024, "fits the opt-in shared memory of an sm_90 block");
};

// One thread: the two bulk copies of a chunk's operands (W .. dC; the block's U slices) into a stage.
template <int kVs>
__device__ void prefetch(unsigned char* stage, uint64_t* bar, const unsigned char* rec, int v0) {
  constexpr int kUBytes = StateSmem<kVs>::kUBytes;
  mbar_expect(bar, unsigned(WsLayout::kU + kUBytes));
  bulk_copy(stage, rec, unsigned(WsLayout::kU), bar);
  bulk_copy(stage + WsLayout::kU, rec + WsLayout::kU + v0 / kUSlice * WsLayout::kUSliceBytes, unsigned(kUBytes), bar);
}

// This warp's 16 rows (r0..r0+15) of a 64 x kVs accumulator fragment, as bf16 words packed by the
// caller (x[j][0]: row r0 + g, columns 8 j + 2 t..; x[j][1]: row r0 + 8 + g), into the transposed
// tile [K / 64][kVs][64] (sw128_at<kVs>, bf16): row = the fragment's column, K = its row
// (stmatrix.trans, 16 bytes a row).
template <int kVs>
__device__ __forceinline__ void store_transposed(unsigned char* tile, const uint32_t (&x)[kVs / 8][2], int r0, int lane) {
  const int m = lane >> 3, r = lane & 7;  // this lane addresses row r of stored matrix m
#pragma unroll
  for (int j = 0; j < kVs / 8; j += 2)
    stmatrix_x4_trans(tile + sw128_at<kVs, 2>(8 * (j + m / 2) + r, r0 + 8 * (m % 2)), x[j][0], x[j][1], x[j + 1][0], x[j + 1][1]);
}

// A pool state element (fp32 or bf16) as fp32.
__device__ __forceinline__ float load_state(const void* base, DType dt, int64_t off) {
  return dt == DType::kBF16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(base)[off]) : static_cast<const float*>(base)[off];
}

// The prefill on a pool: sequence n's slot, loaded once by thread 0 into shared memory (*slot) for the
// block (one barrier). Rows [t0, t1) of o for this block's head and columns are then written with 0
// (padding, slot < 0) or NaN (slot >= P, an error on the device) and false returned when the slot is not
// in the pool: the block reads and writes nothing else.
template <int kVs, class P>
__device__ bool pool_slot(const P& p, int n, int h, int v0, int b, int64_t* slot) {
  if (threadIdx.x == 0) {
    const int64_t i = int64_t(n) * p.pool_idx_stride;
    *slot = p.pool_idx64 ? static_cast<const int64_t*>(p.pool_idx)[i] : int64_t(static_cast<const int32_t*>(p.pool_idx)[i]);
  }
  __syncthreads();
  const int64_t s = *slot;
  if (s >= 0 && s < p.pool_slots) return true;
  const float x = s < 0 ? 0.f : __int_as_float(0x7fc00000);
  const int t0 = p.seq_begin[n], rows = p.seq_end[n] - t0;
  const int64_t base = int64_t(b) * p.o_sb + int64_t(h) * p.o_sh;
  for (int e = threadIdx.x; e < rows * kVs; e += blockDim.x) {  // rows < 2^25 (the dispatch's limit)
    const int i = e / kVs, v = v0 + e % kVs;
    if (v < p.V) store(p.o, p.o_dtype, base + int64_t(t0 + i) * p.o_st + v, x);
  }
  return false;
}

template <int kVs, class P, class ChunkReady>  // P: KdaCudaProblem or KdaCudaProblemFew
__device__ __forceinline__ void state_pass(const P& p, const void* ws, unsigned bx, unsigned by, unsigned char* smem_raw, ChunkReady&& chunk_ready) {
  using Sm = StateSmem<kVs>;
  constexpr int kNt = kVs / 8;  // 8-column tiles of a fragment
  const int nz = state_column_blocks(p.V, kVs);
  const int n = p.seq_by_length[by], h = bx / nz, v0 = (bx % nz) * kVs, tid = threadIdx.x, lane = tid % 32;
  const int wg = tid / 128, w = (tid / 32) % 4;       // warpgroup, warp in it
  const int g8 = lane >> 2, t4 = lane & 3;
  const int K = p.K, V = p.V;
  const int b = p.varlen ? 0 : n;
  unsigned char* const smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* const St = smem + Sm::kSt;
  unsigned char* const Vt = smem + Sm::kVt;
  unsigned char* const VtLo = smem + Sm::kVtLo;

  // This thread's fragment of its warpgroup's 64 x kVs tile: d[j][q] at row r0 + g8 + 8 (q / 2),
  // column 8 j + 2 t4 + q % 2 (warpgroup 3: state rows 64..). Warpgroups 2 and 3: S (fp32, the whole
  // pass); 0: W h_t, then Vnew; 1: O.
  float d[kNt][4];
  const int r0 = 16 * w + (wg == 3 ? 64 : 0);
  auto for_frag = [&](auto&& f) {  // f(element, row, column)
#pragma unroll
    for (int j = 0; j < kNt; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) f(d[j][q], r0 + g8 + 8 * (q / 2), 8 * j + 2 * t4 + q % 2);
  };
  // The prefill on a pool (once per block): no tokens, padding or an index out of the pool: done here.
  if (p.pool && (p.seq_begin[n] == p.seq_end[n] || !pool_slot<kVs>(p, n, h, v0, b, reinterpret_cast<int64_t*>(smem + Sm::kSlot)))) return;
  const bool state_wg = wg >= 2;
  const int64_t srow0 = (int64_t(n) * p.H + h) * K;  // [N, H, K, V] row of (n, h, c = 0)
  // State element (c, v) of the head's K V block at c cs + v vs: [K, V], or [V, K] with state_v_first.
  const int cs = p.state_v_first ? 1 : V, vs = p.state_v_first ? K : 1;
  auto write_st = [&] {  // h_tᵀ in bf16 for the next chunk's products, then visible to them (async proxy)
    uint32_t x[kNt][2];
#pragma unroll
    for (int j = 0; j < kNt; ++j) x[j][0] = pack_bf16(d[j][0], d[j][1]), x[j][1] = pack_bf16(d[j][2], d[j][3]);
    store_transposed<kVs>(St, x, r0, lane);
    fence_proxy_async_shared();
  };
  // The pool's [H, K, V] block of (slot, h) at slot * pool_stride + h K V (the slot from shared memory:
  // no register held across the pass).
  auto pool_state = [&] { return *reinterpret_cast<const int64_t*>(smem + Sm::kSlot) * p.pool_stride + int64_t(h) * K * V; };
  if (state_wg) {
    if (p.pool) {
      const int64_t base = pool_state();
      for_frag([&](float& s, int c, int vl) {
        const int v = v0 + vl;
        s = (c < K && v < V) ? load_state(p.pool, p.pool_dtype, base + (c * cs + v * vs)) : 0.f;
      });
    } else {
      for_frag([&](float& s, int c, int vl) {
        const int v = v0 + vl;
        s = (p.h0 && c < K && v < V) ? p.h0[srow0 * V + (c * cs + v * vs)] : 0.f;
      });
    }
    write_st();
  }

  // o of this thread's columns v0 + 2 t4 + 8 j: element offset at token 0, and (the common case, every
  // (row, column pair) a 4-byte aligned bf16 word inside V) a pointer that steps a chunk at a time.
  const int64_t o_off = int64_t(b) * p.o_sb + int64_t(h) * p.o_sh + v0 + 2 * t4;
  const bool o_pairs = p.o_dtype == DType::kBF16 && (reinterpret_cast<uintptr_t>(p.o) & 3) == 0 && p.o_sb % 2 == 0 &&
                       p.o_st % 2 == 0 && p.o_sh % 2 == 0 && v0 + kVs <= V;
  const int seq_begin = p.seq_begin[n], seq_end = p.seq_end[n];
  __nv_bfloat16* o_chunk = static_cast<__nv_bfloat16*>(p.o) + o_off + int64_t(seq_begin) * p.o_st;  // row 0 of the current chunk
  const int first = p.chunk_start[n], last = p.chunk_start[n + 1];
  auto* bar = reinterpret_cast<uint64_t*>(smem + Sm::kBar);
  if (tid == 0) {
    for (int k = 0; k < kStages; ++k) mbar_init(bar + k);
    if (first < last) {
      chunk_ready(first, h);
      prefetch<kVs>(smem, bar, ws_record(ws, first, p.H, h), v0);
    }
  }
  __syncthreads();  // barriers initialized, h_0ᵀ written
  for (int slot = first; slot < last; ++slot) {
    const int it = slot - first;
    mbar_wait(bar + it % kStages, unsigned(it / kStages) & 1u);  // this chunk's operands have landed
    __syncthreads();  // h_tᵀ written; every product of the previous chunk done (its stage and Vnewᵀ free)
    if (tid == 0 && slot + 1 < last) {
      const int st = (it + 1) % kStages;
      chunk_ready(slot + 1, h);
      prefetch<kVs>(smem + st * Sm::kStage, bar + st, ws_record(ws, slot + 1, p.H, h), v0);
    }
    const unsigned char* cur = smem + (it % kStages) * Sm::kStage;
    if (wg < 2) {  // W h_t (warpgroup 0), O = Qg h_t (warpgroup 1); K = 128 in two swizzled halves
      const uint64_t da = wgmma_desc_sw128(cur + (wg == 0 ? WsLayout::kW : WsLayout::kQg)), db = wgmma_desc_sw128(St);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kD / 16; ++ks)
        wgmma_bf16<kVs, 0>(d, wgmma_desc_advance(da, (ks / 4) * (kC * 128) + (ks % 4) * 32),
                           wgmma_desc_advance(db, (ks / 4) * (kVs * 128) + (ks % 4) * 32), ks > 0);
      wgmma_commit();
      wgmma_wait<0>();
      if (wg == 0) {  // Vnew = U − W h_t as bf16 hi + lo, transposed
        const auto* U = reinterpret_cast<const float*>(cur + WsLayout::kU);  // the block's slices
        uint32_t hi[kNt][2], lo[kNt][2];
#pragma unroll
        for (int j = 0; j < kNt; ++j)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const float2 u = *reinterpret_cast<const float2*>(U + u_at(r0 + g8 + 8 * hh, 8 * j + 2 * t4));
            split_pair(u.x - d[j][2 * hh], u.y - d[j][2 * hh + 1], hi[j][hh], lo[j][hh]);
          }
        store_transposed<kVs>(Vt, hi, r0, lane);
        store_transposed<kVs>(VtLo, lo, r0, lane);
        fence_proxy_async_shared();
      }
    } else {  // the h residual (the chunk-start state, fp32), then S ⊙ dC
      if (p.res_h)
        for_frag([&](float& s, int c, int vl) {
          const int v = v0 + vl;
          if (c < K && v < V) store(p.res_h, p.res_dtype, ((int64_t(slot) * p.H + h) * K + c) * V + v, s);
        });
      const auto* dC = reinterpret_cast<const float*>(cur + WsLayout::kDC);
      for_frag([&](float& s, int c, int) { s *= dC[c]; });
    }
    __syncthreads();  // Vnewᵀ written; every read of h_tᵀ done
    if (state_wg) {  // S += Kgᵀ Vnew_hi on state rows 64 (wg − 2).. (Kg's channel half, MN-major), then h_{t+1}ᵀ
      const uint64_t da = wgmma_desc_sw128(cur + WsLayout::kKg + (wg - 2) * (kC * 128), true), db = wgmma_desc_sw128(Vt);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kC / 16; ++ks) wgmma_bf16<kVs, 1>(d, wgmma_desc_advance(da, ks * 2048), wgmma_desc_advance(db, ks * 32), 1);
      wgmma_commit();
      wgmma_wait<0>();
      write_st();
    } else if (wg == 1) {  // O += Aqk_hi Vnew_hi + Aqk_lo Vnew_hi + Aqk_hi Vnew_lo, then o
      const uint64_t ahi = wgmma_desc_sw128(cur + WsLayout::kAqk), alo = wgmma_desc_advance(ahi, int(WsLayout::kAqkPlane * 2));
      const uint64_t bhi = wgmma_desc_sw128(Vt), blo = wgmma_desc_sw128(VtLo);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kC / 16; ++ks) {
        wgmma_bf16<kVs, 0>(d, wgmma_desc_advance(ahi, ks * 32), wgmma_desc_advance(bhi, ks * 32), 1);
        wgmma_bf16<kVs, 0>(d, wgmma_desc_advance(alo, ks * 32), wgmma_desc_advance(bhi, ks * 32), 1);
        wgmma_bf16<kVs, 0>(d, wgmma_desc_advance(ahi, ks * 32), wgmma_desc_advance(blo, ks * 32), 1);
      }
      wgmma_commit();
      wgmma_wait<0>();
      // o rows t0 + i (i < rows), columns v < V
      const int t0 = seq_begin + it * kC, rows = min(kC, seq_end - t0);
      if (o_pairs) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int i = r0 + g8 + 8 * hh;
          if (i < rows) {
            __nv_bfloat16* const row = o_chunk + int64_t(i) * p.o_st;
            // Streaming stores (evict first): o is not read again here, the next chunks' records are
            // (ncu: -1.2% varlen, -1.8% B4; without any o stores the kernel ran 15% faster).
#pragma unroll
            for (int j = 0; j < kNt; ++j) __stcs(reinterpret_cast<unsigned int*>(row + 8 * j), pack_bf16(d[j][2 * hh], d[j][2 * hh + 1]));
          }
        }
      } else {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int i = r0 + g8 + 8 * hh;
          if (i < rows)
#pragma unroll
            for (int j = 0; j < kNt; ++j)
              store_pair(p.o, p.o_dtype, o_off + int64_t(t0 + i) * p.o_st + 8 * j, d[j][2 * hh], d[j][2 * hh + 1], V - (v0 + 2 * t4 + 8 * j));
        }
      }
      o_chunk += int64_t(kC) * p.o_st;  // only warpgroup 1 stores o
    }
  }
  if (p.pool && state_wg) {  // the final state back into the slot, in the pool's dtype
    const int64_t base = pool_state();
    for_frag([&](float& s, int c, int vl) {
      const int v = v0 + vl;
      if (c < K && v < V) store(p.pool, p.pool_dtype, base + (c * cs + v * vs), s);
    });
  } else if (p.final_state && state_wg) {
    for_frag([&](float& s, int c, int vl) {
      const int v = v0 + vl;
      if (c < K && v < V) p.final_state[srow0 * V + (c * cs + v * vs)] = s;
    });
  }
}

}  // namespace encore::cuda::kda::state
