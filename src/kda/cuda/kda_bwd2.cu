// The second CUDA KDA backward, stages K0 and K1 (kda_bwd2.hpp; math: docs/math/kda.md §6; the CPU
// ground truth stage by stage: src/kda/reference/kda_chunked_bwd.cpp). Every product one
// mma.sync m16n8k16 on bf16 operands with fp32 accumulation; fp32 for G, the exp2 factors and the
// state cotangent.
//
// K0 kda2_prep_kernel, grid (chunk slots, HV), 256 threads: per chunk and value head, from q, k, beta,
//   dO and the residuals G, Akk (A), Aqk: Qg, Kg, Kbeta = beta k^ . 2^G (shared), -W = -A Kbeta
//   (64 x 128 x 64), dvl = Aqk^T dO (64 x 128 x 64), 2^gC. Writes qg, kg, wn, dvl, egc.
//   Rows: kda2_prep_kernel<RowPath> (kda_bwd2_load.cuh, chosen on the host). kBf16 / kFp16: q, k
//   (into dO's and Kbeta's tiles, raw), A and Aqk (the lower triangle) by 16-byte cp.async, one group;
//   the row pass reads q, k from there and writes Kbeta over k; then dO by cp.async into its tile,
//   in flight during -A Kbeta (fp16: converted to bf16 in place). kGeneric: per-element dtype loads.
//   53,248 bytes of shared memory either way: 4 blocks an SM.
// K1 kda2_scan_kernel, one block of 128 threads per (sequence, value head, 32 value columns): the
//   reverse pass over the sequence's chunks, dS' [K x 32] fp32 in registers (warp w: state rows
//   32w..32w+31):
//     dsp[c] = bf16(dS');  dVnew = dvl + Kg dS' (64 x 32 x 128) -> bf16 -> dvn;
//     dS = 2^gC . dS' + Qg^T dO + (-W)^T dVnew (128 x 32 x 64, twice)  -> dS' of the chunk before;
//   dS after a sequence's first chunk is dh0. Starts from dht (or 0).
//   Occupancy: the blocks are serial chains (one chunk after another), so the lever is how many run
//   at once. 168 registers (the cap of __launch_bounds__(128, 3)) and 75,264 bytes of shared memory
//   (+ 1 KB the driver reserves a block; 3 x 74.5 KB <= 228 KB, carveout asked at its maximum) give
//   3 blocks an SM: 396 slots on an H100's 132 SMs, so the varlen benchmark's 320 blocks (5
//   sequences x 16 heads x 4 slices) run in one wave (two stages of 57 KB gave 1 block an SM, 2.4 waves).
//   256 threads would not fit: 3 such blocks need <= 85 registers, and 2 an SM are 264 slots < 320.
//   Shared memory: one buffer of each tile, Kg, Qg, -W [64][128] bf16 without row padding, their
//   16-byte chunks XOR-swizzled by row (swz) so ldmatrix stays conflict-free (48 KB for the three).
//   Each is reloaded (cp.async) as soon as its last reader is past a barrier, so it is in flight for
//   about two thirds of a step. A chunk runs three products, each after a barrier: (1) Qg^T dO,
//   (2) Kg dS', (3) (-W)^T dVnew. Past barrier (1) the chunk after's -W is free and this chunk's
//   -W loads; past (2) the chunk before's Qg and 2^gC load; past (3) its Kg and dvl. Qg^T dO before
//   Kg dS' changes no rounding: Kg dS' reads the bf16 copy of dS', and dS accumulates 2^gC . dS',
//   Qg^T dO, (-W)^T dVnew in the order it always did.
//   dO (any float dtype) is loaded a chunk ahead into registers, all its loads in flight together.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "kda/cuda/kda_bwd2.hpp"
#include "kda/cuda/kda_bwd2_device.cuh"
#include "kda/cuda/kda_bwd2_load.cuh"

namespace encore::cuda {
namespace kda2 {
namespace {

using kda::ldmatrix_x4;
using kda::ldmatrix_x4_trans;
using kda::mma_bf16;

constexpr int kVs = 32;        // value columns per scan block
constexpr int kLdS = kVs + 8;  // of [*][32] tiles

// ---- K0: prep ------------------------------------------------------------------------------------

constexpr int kPrepThreads = 256;
constexpr int kPrepBlocksPerSm = 4;  // 64 registers, 53,248 + 1,024 bytes of shared memory a block
constexpr size_t kPrepSmem = size_t(2 * kC * kLdC + 2 * kC * kLd) * sizeof(__nv_bfloat16);  // A, Aqk, Kbeta, dO
static_assert(kPrepBlocksPerSm * (kPrepSmem + 1024) <= 228 * 1024, "K0: four blocks an SM");

template <RowPath kPath>
__global__ void __launch_bounds__(kPrepThreads, kPrepBlocksPerSm) kda2_prep_kernel(const __grid_constant__ KdaBwdCudaProblem p, Ptrs w) {
  constexpr bool kFast = kPath != RowPath::kGeneric;
  extern __shared__ __align__(16) unsigned char smem[];
  auto* a_s = reinterpret_cast<__nv_bfloat16*>(smem);  // [64][kLdC]  A (Akk)
  __nv_bfloat16* aqk_s = a_s + kC * kLdC;               // [64][kLdC]  Aqk
  __nv_bfloat16* kb_s = aqk_s + kC * kLdC;              // [64][kLd]   Kbeta (fast path: k raw first)
  __nv_bfloat16* do_s = kb_s + kC * kLd;                // [64][kLd]   dO (fast path: q raw first)
  const int slot = blockIdx.x, hv = blockIdx.y, hq = hv / p.group;
  const ChunkInfo ci = chunk_info(p, slot);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c0 = 4 * lane;
  const int64_t last = tok(p, ci.b, ci.t0 + ci.rows - 1, hv);
  const int64_t tok0 = tok(p, ci.b, ci.t0, hv);  // the token row of chunk row i: tok0 + i H
  if constexpr (kFast) {  // group 1: q (into dO's tile), k (into Kbeta's), A, Aqk
    const Rows rq = rows_of(p.q, ci.b, ci.t0, hq), rk = rows_of(p.k, ci.b, ci.t0, hq);
    copy_rows<kPrepThreads>(do_s, kLd, rq.base, rq.step, ci.rows, p.K);
    copy_rows<kPrepThreads>(kb_s, kLd, rk.base, rk.step, ci.rows, p.K);
    copy_tri<kPrepThreads>(a_s, kLdC, static_cast<const __nv_bfloat16*>(p.Akk) + tok0 * kC, int64_t(p.H) * kC, ci.rows);
    copy_tri<kPrepThreads>(aqk_s, kLdC, static_cast<const __nv_bfloat16*>(p.Aqk) + tok0 * kC, int64_t(p.H) * kC, ci.rows);
    cp_async_commit();
  }
  float gc[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) gc[e] = ldg_or0(p.G, last * p.K + c0 + e, c0 + e < p.K);
  if (warp == 0) {
#pragma unroll
    for (int e = 0; e < 4; ++e) w.egc[(int64_t(slot) * p.H + hv) * kD + c0 + e] = c0 + e < p.K ? exp2f(gc[e]) : 0.f;
  }
  if constexpr (kFast) {
    cp_async_wait<0>();
    __syncthreads();  // q, k, A, Aqk of every thread's copies visible
  }
  for (int i = warp; i < kC; i += kPrepThreads / 32) {
    const bool valid = i < ci.rows;
    const int t = ci.t0 + (valid ? i : 0);
    const int64_t row = tok(p, ci.b, t, hv);
    // Straight-line loads (kda_bwd_device.cuh, ld*_or0): a row's loads are in flight together.
    float q[4], k[4], g[4], beta;
    if constexpr (kFast) {
      beta = scalar16<kPath>(p.beta, ci.b, t, hv, valid);
      g4(p.G, row, p.K, c0, valid && c0 < p.K, g);
      raw4<kPath>(do_s + i * kLd + c0, q), raw4<kPath>(kb_s + i * kLd + c0, k);
    } else {
      float o[4];
      beta = load_or0(p.beta, ci.b, t, hv, 0, valid);
      load4(p.q, ci.b, t, hq, c0, p.K, valid, q), load4(p.k, ci.b, t, hq, c0, p.K, valid, k);
      load_g4(p.G, row, p.K, c0, valid, g), load4(p.d_o, ci.b, t, hv, c0, p.V, valid, o);
      store_pair(do_s + i * kLd + c0, o[0], o[1]), store_pair(do_s + i * kLd + c0 + 2, o[2], o[3]);
      // A and Aqk rows: lower triangular with the diagonal (A's is 1), columns j <= i.
      const int j = 2 * lane;
      float av[2], qv[2];
      load2_any_or0(p.Akk, p.akk_dtype, row * kC + j, valid && j <= i, valid && j + 1 <= i, av);
      load2_any_or0(p.Aqk, p.aqk_dtype, row * kC + j, valid && j <= i, valid && j + 1 <= i, qv);
      store_pair(a_s + i * kLdC + j, av[0], av[1]);
      store_pair(aqk_s + i * kLdC + j, qv[0], qv[1]);
    }
    const float rq = row_rnorm(q, p.l2norm), rk = row_rnorm(k, p.l2norm);
    float qg[4], kg[4], kb[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float eg = exp2f(g[e]);  // g <= 0 past the chunk start: <= 1
      qg[e] = valid ? p.scale * q[e] * rq * eg : 0.f;
      kg[e] = valid ? k[e] * rk * exp2f(gc[e] - g[e]) : 0.f;  // gC <= G: <= 1
      kb[e] = valid ? beta * k[e] * rk * eg : 0.f;
    }
    if (valid) {
      const int64_t at = (row) * kD + c0;
      store_pair(w.qg + at, qg[0], qg[1]), store_pair(w.qg + at + 2, qg[2], qg[3]);
      store_pair(w.kg + at, kg[0], kg[1]), store_pair(w.kg + at + 2, kg[2], kg[3]);
    }
    // In place on the fast path: this lane read these four channels of k above.
    store_pair(kb_s + i * kLd + c0, kb[0], kb[1]), store_pair(kb_s + i * kLd + c0 + 2, kb[2], kb[3]);
  }
  __syncthreads();
  if constexpr (kFast) {  // group 2: dO over q (read by every warp before the barrier), in flight during -W = -(A Kbeta)
    const Rows ro = rows_of(p.d_o, ci.b, ci.t0, hv);
    copy_rows<kPrepThreads>(do_s, kLd, ro.base, ro.step, ci.rows, p.V);
    cp_async_commit();
  }
  // -W = -(A Kbeta) and dvl = Aqk^T dO: warp w owns rows 16 (w % 4).. and columns 64 (w / 4)..
  const int m0 = 16 * (warp & 3), n0 = 64 * (warp >> 2), g8 = lane >> 2, t4 = lane & 3;
  float acc[8][4];
  auto write = [&](__nv_bfloat16* dst, float mult) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = m0 + g8 + 8 * h;
        if (i < ci.rows)
          store_pair(dst + tok(p, ci.b, ci.t0 + i, hv) * kD + n0 + 8 * j + 2 * t4, mult * acc[j][2 * h], mult * acc[j][2 * h + 1]);
      }
  };
  zero(acc);
  warp_mma<kC, 8, false, true>(acc, a_s, kLdC, m0, kb_s, kLd, n0);
  write(w.wn, -1.f);
  if constexpr (kFast) {
    cp_async_wait<0>();
    if constexpr (kPath == RowPath::kFp16) {  // this thread's own units (visible to it after the wait): fp16 -> bf16
#pragma unroll
      for (int u = 0; u < kC * 16 / kPrepThreads; ++u) {
        const int x = threadIdx.x + u * kPrepThreads, i = x >> 4, c = 8 * (x & 15);
        fp16_to_bf16(do_s + i * kLd + c), fp16_to_bf16(do_s + i * kLd + c + 4);
      }
    }
    __syncthreads();
  }
  zero(acc);
  warp_mma<kC, 8, true, true>(acc, aqk_s, kLdC, m0, do_s, kLd, n0);
  write(w.dvl, 1.f);
}

// ---- K1: the reverse scan --------------------------------------------------------------------------

constexpr int kScanThreads = 128;
constexpr int kScanBlocksPerSm = 3;  // 320 blocks of the varlen benchmark in one wave on 132 SMs
constexpr int kBig = kC * kD;        // elements of a [64][128] tile
// One buffer of each tile (no second stage: the header comment): Kg, Qg, -W [64][128] bf16 unpadded and
// swizzled (swz); dvl, dS', dVnew, dO [*][kLdS] bf16; 2^gC [128] fp32. 75,264 bytes.
constexpr size_t kScanSmem = size_t(3 * kBig + kC * kLdS + kD * kLdS + 2 * kC * kLdS) * sizeof(__nv_bfloat16) + kD * sizeof(float);
// H100: 228 KB of shared memory an SM, each block 1 KB more (the driver's reserve).
static_assert(kScanBlocksPerSm * (kScanSmem + 1024) <= 228 * 1024, "K1: three blocks an SM");
static_assert(kScanBlocksPerSm * kScanThreads * 168 <= 65536, "K1: three blocks an SM at 168 registers");

// Element (i, c) of a swizzled [64][128] tile: row i's 16-byte chunk c / 8 is stored at chunk (c / 8) ^ (i % 8).
// An ldmatrix 8x8 matrix (one chunk of 8 consecutive rows; the rows' 256-byte stride maps them all to
// the same banks unswizzled) then reads 8 distinct bank groups: conflict-free without row padding.
__device__ __forceinline__ int swz(int i, int c) { return i * kD + (((c >> 3) ^ (i & 7)) << 3) + (c & 7); }

// Rows t0 .. t0 + rows (batch b, head hv) of a [tokens][HV][128] bf16 workspace tensor into the swizzled
// tile dst by cp.async, rows past `rows` zero (source size 0). No commit.
__device__ __forceinline__ void load_big(const KdaBwdCudaProblem& p, const __nv_bfloat16* src, __nv_bfloat16* dst, int b, int t0, int rows,
                                         int hv) {
  const int64_t row0 = tok(p, b, t0, hv);
#pragma unroll
  for (int u = 0; u < kC * (kD / 8) / kScanThreads; ++u) {
    const int x = threadIdx.x + u * kScanThreads, i = x / (kD / 8), seg = x % (kD / 8);
    const bool valid = i < rows;
    cp_async16(dst + swz(i, 8 * seg), src + (valid ? (row0 + int64_t(i) * p.H) * kD + 8 * seg : 0), valid);
  }
}

// dO of a chunk into registers, raw: a thread's kDoPer value pairs (rows threadIdx.x / 16 + 8 u, columns
// v0 + 2 (threadIdx.x % 16) + e), one load an element (32-bit for fp32, else 16-bit), all in flight together and
// converted only when stored (store_do). kdabwd::load_or0 selects on each value as it loads it, so each of its
// loads waited for the one before: 16 global-load latencies a chunk, most of the old K1's step.
constexpr int kDoPer = kC * kVs / 2 / kScanThreads;  // 8
__device__ __forceinline__ void load_do_raw(const KdaTensor& t, int b, int t0, int rows, int hv, int v0, int V, uint32_t (&raw)[kDoPer][2]) {
  const int i0 = threadIdx.x / (kVs / 2), y = v0 + 2 * (threadIdx.x % (kVs / 2));
  const int64_t base = int64_t(b) * t.sb + int64_t(t0 + i0) * t.st + int64_t(hv) * t.sh + y;
  if (t.dtype == DType::kFP32) {
    const auto* x = static_cast<const float*>(t.data);
#pragma unroll
    for (int u = 0; u < kDoPer; ++u)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool ok = i0 + 8 * u < rows && y + e < V;
        raw[u][e] = __float_as_uint(__ldg(x + (ok ? base + 8 * u * t.st + e : 0)));
      }
  } else {
    const auto* x = static_cast<const unsigned short*>(t.data);
#pragma unroll
    for (int u = 0; u < kDoPer; ++u)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool ok = i0 + 8 * u < rows && y + e < V;
        raw[u][e] = __ldg(x + (ok ? base + 8 * u * t.st + e : 0));
      }
  }
}
// The raw pairs of a chunk with `rows` rows into do_s [64][kLdS] as bf16: kdabwd::load_or0's values (0 past the
// chunk's rows and past V), one dtype branch for all of them.
__device__ __forceinline__ void store_do(__nv_bfloat16* do_s, const uint32_t (&raw)[kDoPer][2], DType dt, int rows, int v0, int V) {
  const int i0 = threadIdx.x / (kVs / 2), y = 2 * (threadIdx.x % (kVs / 2));
  auto put = [&](auto&& value) {
#pragma unroll
    for (int u = 0; u < kDoPer; ++u) {
      const bool in = i0 + 8 * u < rows;
      store_pair(do_s + (i0 + 8 * u) * kLdS + y, in && v0 + y < V ? value(raw[u][0]) : 0.f, in && v0 + y + 1 < V ? value(raw[u][1]) : 0.f);
    }
  };
  if (dt == DType::kFP32) put([](uint32_t r) { return __uint_as_float(r); });
  else if (dt == DType::kBF16) put([](uint32_t r) { return __uint_as_float(r << 16); });
  else put([](uint32_t r) { return __half2float(__ushort_as_half(static_cast<unsigned short>(r))); });
}

__global__ void __launch_bounds__(kScanThreads, kScanBlocksPerSm) kda2_scan_kernel(const __grid_constant__ KdaBwdCudaProblem p, Ptrs w,
                                                                                   int slices) {
  extern __shared__ __align__(16) unsigned char smem[];
  auto* kg_s = reinterpret_cast<__nv_bfloat16*>(smem);        // [64][128] Kg, swizzled
  __nv_bfloat16* qg_s = kg_s + kBig;                          // [64][128] Qg, swizzled
  __nv_bfloat16* wn_s = qg_s + kBig;                          // [64][128] -W, swizzled
  __nv_bfloat16* dvl_s = wn_s + kBig;                         // [64][kLdS] dvl
  __nv_bfloat16* ds_s = dvl_s + kC * kLdS;                    // [128][kLdS] bf16(dS'), stored [k][v]
  __nv_bfloat16* dvn_s = ds_s + kD * kLdS;                    // [64][kLdS] bf16(dVnew)
  __nv_bfloat16* do_s = dvn_s + kC * kLdS;                    // [64][kLdS] dO
  float* egc_s = reinterpret_cast<float*>(do_s + kC * kLdS);  // [128] 2^gC
  const int slice = blockIdx.x % slices, hv = (blockIdx.x / slices) % p.H, n = blockIdx.x / (slices * p.H);
  const int v0 = kVs * slice, b = p.varlen ? 0 : n;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3, mi = lane >> 3, r = lane & 7;
  const int first = p.chunk_start[n], count = p.chunk_start[n + 1] - first;
  // dS' fragments: m-tile mt rows 32 warp + 16 mt (+ g8, + 8), n-tile nt columns v0 + 8 nt + 2 t4 (+1).
  float ds[2][4][4];
  const int64_t state0 = (int64_t(n) * p.H + hv) * p.K;
  // f(element, state row a, value column y) over this thread's dS' fragment elements.
  auto each_ds = [&](auto&& f) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(ds[mt][nt][e], 32 * warp + 16 * mt + g8 + 8 * (e >> 1), v0 + 8 * nt + 2 * t4 + (e & 1));
  };
  each_ds([&](float& x, int a, int y) { x = p.dht && a < p.K && y < p.V ? p.dht[p.state_v_first ? state0 * p.V + int64_t(y) * p.K + a : (state0 + a) * p.V + y] : 0.f; });
  // Local chunk c (0 .. count - 1) of the sequence: its rows, *t0 its first token.
  auto chunk_rows = [&](int c, int* t0) {
    *t0 = p.seq_begin[n] + c * kC;
    return min(kC, p.seq_end[n] - *t0);
  };
  // The cp.async groups, one a tile set, committed in the order Qg+2^gC (c), Kg+dvl (c), -W (c), Qg+2^gC (c - 1), ...:
  // each wait is for the group before the newest (wait_group 1). Past the first chunk the groups are empty.
  auto load_q = [&](int c) {
    if (c >= 0) {
      int t0;
      const int rows = chunk_rows(c, &t0);
      load_big(p, w.qg, qg_s, b, t0, rows, hv);
      if (threadIdx.x < kD / 4) cp_async16(egc_s + 4 * threadIdx.x, w.egc + (int64_t(first + c) * p.H + hv) * kD + 4 * threadIdx.x, true);
    }
    cp_async_commit();
  };
  auto load_k = [&](int c) {
    if (c >= 0) {
      int t0;
      const int rows = chunk_rows(c, &t0);
      load_big(p, w.kg, kg_s, b, t0, rows, hv);
#pragma unroll
      for (int u = 0; u < kC * (kVs / 8) / kScanThreads; ++u) {
        const int x = threadIdx.x + u * kScanThreads, i = x / (kVs / 8), seg = x % (kVs / 8);
        const bool valid = i < rows;
        cp_async16(dvl_s + i * kLdS + 8 * seg, w.dvl + (valid ? tok(p, b, t0 + i, hv) * kD + v0 + 8 * seg : 0), valid);
      }
    }
    cp_async_commit();
  };
  auto load_w = [&](int c) {
    int t0;
    const int rows = chunk_rows(c, &t0);
    load_big(p, w.wn, wn_s, b, t0, rows, hv);
    cp_async_commit();
  };
  uint32_t od[kDoPer][2];  // dO of the chunk before, raw (load_do_raw): in flight during this chunk's products
  // ds += A^T B over the chunk's 64 rows: A a swizzled [64][128] tile (this warp's state rows 32 warp..), B [64][kLdS].
  auto state_term = [&](const __nv_bfloat16* at, const __nv_bfloat16* bt) {
#pragma unroll
    for (int ks = 0; ks < kC / 16; ++ks) {
      uint32_t af[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) ldmatrix_x4_trans(af[mt], at + swz(16 * ks + 8 * (mi >> 1) + r, 32 * warp + 16 * mt + 8 * (mi & 1)));
#pragma unroll
      for (int j = 0; j < 4; j += 2) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, bt + (16 * ks + 8 * (mi & 1) + r) * kLdS + 8 * j + 8 * (mi >> 1));
        const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma_bf16(ds[mt][j], af[mt], b0);
          mma_bf16(ds[mt][j + 1], af[mt], b1);
        }
      }
    }
  };
  if (count > 0) {
    load_q(count - 1), load_k(count - 1);
    int t0;
    const int rows = chunk_rows(count - 1, &t0);
    load_do_raw(p.d_o, b, t0, rows, hv, v0, p.V, od);
    store_do(do_s, od, p.d_o.dtype, rows, v0, p.V);
  }
  for (int ci = count - 1; ci >= 0; --ci) {
    const int slot = first + ci;
    int t0;
    const int rows = chunk_rows(ci, &t0);
    // dS' of this chunk: bf16 to shared (the next products' operand; its last readers, the chunk after's
    // Kg dS', are past that chunk's barrier (3)) and to dsp.
    __nv_bfloat16* dsp = w.dsp + ((int64_t(slot) * p.H + hv) * kD) * kD;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int a = 32 * warp + 16 * mt + g8 + 8 * h, y = 8 * nt + 2 * t4;
          store_pair(ds_s + a * kLdS + y, ds[mt][nt][2 * h], ds[mt][nt][2 * h + 1]);
          store_pair(dsp + int64_t(a) * kD + v0 + y, ds[mt][nt][2 * h], ds[mt][nt][2 * h + 1]);
        }
    cp_async_wait<1>();  // this chunk's Qg, 2^gC (its Kg, dvl may be in flight)
    __syncthreads();     // (1) dO, dS', Qg, 2^gC visible; every warp past the chunk after's (-W)^T dVnew
    load_w(ci);          // -W into its free buffer, in flight during Qg^T dO and Kg dS'
    int pt0 = 0, prows = 0;  // the chunk before: its dO in flight during this chunk's three products
    if (ci > 0) prows = chunk_rows(ci - 1, &pt0), load_do_raw(p.d_o, b, pt0, prows, hv, v0, p.V, od);
    // dS = 2^gC . dS' + Qg^T dO + (-W)^T dVnew: warp w state rows 32 w.., k over the chunk's 64 rows.
    // The first two terms here, while dVnew is not yet needed; the same accumulation order as ever.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float e = egc_s[32 * warp + 16 * mt + g8 + 8 * h];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) ds[mt][nt][2 * h] *= e, ds[mt][nt][2 * h + 1] *= e;
      }
    state_term(qg_s, do_s);
    cp_async_wait<1>();  // this chunk's Kg, dvl (its -W may be in flight)
    __syncthreads();     // (2) Kg, dvl visible; Qg, 2^gC, dO read by every warp
    load_q(ci - 1);      // the chunk before's Qg, 2^gC: in flight during Kg dS', (-W)^T dVnew, the next dS' stores
    // dVnew = dvl + Kg dS': warp w rows 16 w.., 4 n-tiles, k over the 128 state rows.
    {
      float dv[4][4];
      const int m0 = 16 * warp;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dv[nt][e] = __bfloat162float(dvl_s[(m0 + g8 + 8 * (e >> 1)) * kLdS + 8 * nt + 2 * t4 + (e & 1)]);
#pragma unroll
      for (int ks = 0; ks < kD / 16; ++ks) {
        uint32_t af[4];
        ldmatrix_x4(af, kg_s + swz(m0 + r + 8 * (mi & 1), 16 * ks + 8 * (mi >> 1)));
#pragma unroll
        for (int j = 0; j < 4; j += 2) {
          uint32_t bf[4];
          ldmatrix_x4_trans(bf, ds_s + (16 * ks + 8 * (mi & 1) + r) * kLdS + 8 * j + 8 * (mi >> 1));
          const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
          mma_bf16(dv[j], af, b0);
          mma_bf16(dv[j + 1], af, b1);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = m0 + g8 + 8 * h, y = 8 * nt + 2 * t4;
          store_pair(dvn_s + i * kLdS + y, dv[nt][2 * h], dv[nt][2 * h + 1]);
          if (i < rows) store_pair(w.dvn + tok(p, b, t0 + i, hv) * kD + v0 + y, dv[nt][2 * h], dv[nt][2 * h + 1]);
        }
    }
    cp_async_wait<1>();  // this chunk's -W (the chunk before's Qg may be in flight)
    __syncthreads();     // (3) dVnew, -W visible; Kg, dvl, dS' read by every warp
    load_k(ci - 1);      // the chunk before's Kg, dvl: in flight during (-W)^T dVnew and that chunk's Qg^T dO
    state_term(wn_s, dvn_s);
    // The chunk before's dO to shared: this chunk's readers of do_s (Qg^T dO) are past barrier (2).
    if (ci > 0) store_do(do_s, od, p.d_o.dtype, prows, v0, p.V);
  }
  if (p.dh0)
    each_ds([&](float& x, int a, int y) {
      if (a < p.K && y < p.V) p.dh0[p.state_v_first ? state0 * p.V + int64_t(y) * p.K + a : (state0 + a) * p.V + y] = x;
    });
}

}  // namespace
}  // namespace kda2

Kda2Layout kda2_layout(int64_t tokens, int64_t chunks, int64_t HV) {
  Kda2Layout l;
  size_t o = 0;
  auto take = [&](size_t bytes) {
    const size_t at = o;
    o += (bytes + 255) / 256 * 256;
    return at;
  };
  const size_t row = size_t(tokens) * HV * kKda2D * 2;  // one bf16 [tokens][HV][128] tensor
  l.qg = take(row), l.kg = take(row), l.wn = take(row), l.dvl = take(row), l.dvn = take(row), l.dw = take(row);
  l.daqk = take(row / 2), l.daqk_lo = take(row / 2), l.da = take(row / 2);  // [tokens][HV][64]
  l.dqi = take(2 * row), l.dki = take(2 * row);  // fp32
  l.egc = take(size_t(chunks) * HV * kKda2D * 4), l.sd = take(size_t(chunks) * HV * kKda2D * 4);
  l.gp = take(size_t(chunks) * HV * 2 * kKda2D * 4);
  l.dsp = take(size_t(chunks) * HV * kKda2D * kKda2D * 2);
  l.bytes = o;
  return l;
}

Status launch_kda2_prep_scan(const KdaBwdCudaProblem& p, const Kda2Layout& l, void* workspace, int chunks, Stream stream) {
  using namespace kda2;
  if (p.K > kKda2D || p.V > kKda2D)
    return Status::unsupported("kda backward (second design): K and V up to " + std::to_string(kKda2D) + ", got " + std::to_string(p.K) +
                               ", " + std::to_string(p.V));
  if (!p.G || !p.Akk || !p.Aqk) return Status::invalid("residuals: the second backward reads the forward's G, Aqk and Akk");
  const Ptrs w = ptrs_of(l, workspace);
  auto s = static_cast<cudaStream_t>(stream);
  // The row loader (kda_bwd2_load.cuh): 16-bit inputs in aligned rows take cp.async, others the generic loads.
  const RowPath path = row_path(p, /*with_h=*/false);
  auto* prep = path == RowPath::kBf16   ? kda2_prep_kernel<RowPath::kBf16>
               : path == RowPath::kFp16 ? kda2_prep_kernel<RowPath::kFp16>
                                        : kda2_prep_kernel<RowPath::kGeneric>;
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem("kda2_prep_kernel", prep, kPrepSmem));
  // K1's three blocks an SM need the largest shared-memory carveout (228 KB): asked for, not left to the default.
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem("kda2_scan_kernel", kda2_scan_kernel, kScanSmem, /*max_carveout=*/true));
  // Empty grids (no chunk, no head or no value column: validation accepts empty shapes) launch nothing.
  if (chunks > 0 && p.H > 0)
    ENCORE_RETURN_IF_ERROR(launch("kda2_prep_kernel", [&] { prep<<<dim3(chunks, p.H), kPrepThreads, kPrepSmem, s>>>(p, w); }));
  const int slices = (p.V + kVs - 1) / kVs;
  if (int64_t(p.N) * p.H * slices > 0)
    ENCORE_RETURN_IF_ERROR(launch("kda2_scan_kernel", [&] { kda2_scan_kernel<<<p.N * p.H * slices, kScanThreads, kScanSmem, s>>>(p, w, slices); }));
  return Status::ok();
}

Status launch_kda2_backward(const KdaBwdCudaProblem& p, const Kda2Layout& l, void* workspace, int chunks, Stream stream) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(p.device));
  ENCORE_RETURN_IF_ERROR(launch_kda2_prep_scan(p, l, workspace, chunks, stream));
  ENCORE_RETURN_IF_ERROR(launch_kda2_state_grads(p, l, workspace, chunks, stream));
  return launch_kda2_wy(p, l, workspace, chunks, stream);
}

}  // namespace encore::cuda
