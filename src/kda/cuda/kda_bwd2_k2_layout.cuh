// The fused K2's (kda_bwd2_k2.cu, kda2_k2_kernel) shared-memory layout, its parking slots for dqi and
// small device helpers; included by kda_bwd2_k2.cu only.
//
// Shared memory, 227,584 bytes of dynamic shared memory (+16 B static: the chunk's indices), one block
// an SM (bf16 tiles [64][136] "T" 17,408 B, [128][136] 34,816 B, fp32 [64][132] 33,792 B):
//   offset      phase A                              phase B
//   0           A [64][72]                           A
//   9,216       S [128][136]                         dA then dL, dAqk, dAqk lo ([64][72] each; after S's last read)
//   44,032      dS' [128][136]                       dki fp32 (after dS''s last read)
//   78,848      dVnew, -W then dW, Vnew hi, Vnew lo  dVnew, dW, v (cp.async from S's last read), M; then one
//                                                    anchored operand (hi, lo: 128 rows each); then the dG and
//                                                    k^.dki fp32 planes
//   148,480     beta v, Kbeta, dO (+16 KB free)      q, k raw 16-bit (T each; cp.async from phase A's end), G fp32
//                                                    (cp.async over dO's tile and the free 16 KB from S's last read)
//   217,088     beta, 1/|k|, sd (`extra`)            beta, 1/|q|, 1/|k|, per-quarter row sums, 2^gC sd, tail sums
// dqi (16 floats a thread) lives in shared memory from its product to phase B's merge (the kernel's park).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kda/cuda/kda_bwd2_device.cuh"

namespace encore::cuda::kda2 {
namespace {

constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kQuads = kD * kD / 4 / kThreads;  // (state row, 4 columns) quads of S a thread stages (generic path)
constexpr int kLdF = kD + 4;                    // fp32 row stride of [64][128] tiles
constexpr int kAnchorRows = 96;                 // rows of the anchored operands: 16 + 32 + 48
constexpr int kOperandRows = 128;               // an operand's hi half, then its lo half kOperandRows rows on
constexpr float kDiagSpan = 60.f;               // the diagonal blocks on tensor cores where a block's G spans <= this (log2)
constexpr int kQuarters = 4;                    // column quarters of the [64 x 128] fragments (warp >> 2)
constexpr int kParts = kThreads / kKda2D, kPartRows = kC / kParts;  // the dg tail: 4 parts of 16 rows per channel
constexpr size_t kSmall = size_t(kC) * kLdC * 2;                    // bf16 [64][kLdC]
constexpr size_t kTile = size_t(kC) * kLd * 2;                      // bf16 [64][kLd]
constexpr size_t kState = size_t(kD) * kLd * 2;                     // bf16 [128][kLd]
constexpr size_t kTileF = size_t(kC) * kLdF * 4;                    // fp32 [64][kLdF]
constexpr size_t kRegion = 2 * size_t(kOperandRows) * kLd * 2;      // one anchored operand, hi + lo
constexpr size_t kOffS = kSmall, kOffD = kOffS + kState, kOffR = kOffD + kState, kOffQ = kOffR + kRegion;
constexpr size_t kOffF = kOffQ + 2 * kTile + kTileF;
constexpr size_t kSmem = kOffF + size_t(3 * kC + kQuarters * 3 * kC + kD + 2 * kParts * kD + kThreads) * 4;
static_assert(3 * kSmall <= kState && kTileF <= kState, "dA, dAqk hi + lo fit S's zone; dki dS''s");
static_assert(4 * kTile <= kRegion && 3 * kTile + kSmall <= kRegion && 2 * kTileF <= kRegion, "the region's tenants fit");
static_assert(kSmem + 16 <= 232448, "one block of at most 227 KB (with the 16 B of static indices)");
// dqi's parking slots (kThreads floats each): 4 past M in the region; 3 past dAqk lo in S's zone and one
// split over the 1 KB tails of S's and dS''s zones; 4 in the float arrays (dbeta parts, the dg tail's sums, one after).
static_assert(3 * kTile + kSmall + 4 * kThreads * 4 <= kRegion && 3 * kSmall + 7 * kThreads * 2 <= kState &&
                  kTileF + kThreads * 2 <= kState,
              "dqi's parking fits");

// Raw 16-bit input values (fp16 when kHalf, else bf16) to float and back (exact for values of that type).
template <bool kHalf>
__device__ __forceinline__ float raw_to_float(uint32_t bits) {
  if constexpr (kHalf) return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  else return __uint_as_float(bits << 16);
}
template <bool kHalf>
__device__ __forceinline__ uint32_t float_to_raw(float x) {
  if constexpr (kHalf) return __half_as_ushort(__float2half_rn(x));
  else return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// First row of row block b's anchored k^ rows (b = 1..3) and of column block b's q~ / beta k^ rows (b = 0..2).
__device__ __forceinline__ int row_base(int b) { return b == 1 ? 0 : b == 2 ? 16 : 48; }
__device__ __forceinline__ int col_base(int b) { return b == 0 ? 0 : b == 1 ? 48 : 80; }

// warp_mma over k in a rolled loop of kSteps k-steps (16 each) an iteration: the same MMAs on each
// accumulator in the same k order (the same bits), but the compiler no longer loads every fragment of
// a product ahead of its first MMA (up to ~96 registers at K = 128, which evicted dqi, the row
// addresses and the accumulators of phase B into local memory).
template <int KD, int NT, bool kTransA, bool kBkn, int kSteps = 2>
__device__ __forceinline__ void mma_k(float (&acc)[NT][4], const __nv_bfloat16* a, int lda, int m0, const __nv_bfloat16* b, int ldb, int n0) {
  constexpr int kK = 16 * (KD / 16 < kSteps ? KD / 16 : kSteps);
  static_assert(KD % kK == 0, "whole iterations");
#pragma unroll 1
  for (int k0 = 0; k0 < KD; k0 += kK)
    warp_mma<kK, NT, kTransA, kBkn>(acc, a + (kTransA ? k0 * lda : k0), lda, m0, b + (kBkn ? k0 * ldb : k0), ldb, n0);
}

// The float arrays past kOffF (floats): beta [64], 1/|q| [64], 1/|k| [64], dbeta parts [4][64], dq^.q^ [4][64],
// dk^.k^ [4][64], extra [128] (sd, then 2^gC sd), the dg tail's part sums [2][4][128], one more slot [512].
constexpr size_t kOffDbp = kOffF + 3 * kC * 4, kOffDotk = kOffDbp + 2 * kQuarters * kC * 4, kOffTail = kOffDotk + (kQuarters * kC + kD) * 4;

// dqi's parking slots (the kernel's park(t, j, e); exact fp32 round trips): thread t's float for dqi's
// n-tile j, element e, from dqi's product (dqi_parked_early) or else from the last reads of S, dO and
// Vnew (phase A's dAqk) on, through phase B's merge. n-tile 3 in float arrays phase B fills only after
// the merge (dbeta parts and dq^.q^ sums, the dg tail's sums, one slot past them); n-tile 2 past M in
// the region; n-tile 1 past dAqk lo in S's zone (e < 3) and in the 1 KB tails of S's and dS''s zones
// (e = 3: threads < 256 dS''s); n-tile 0 in row paddings no code reads or writes (4 floats a row, thread
// t at row t / 4: bank-conflict free), of q and k's tiles (e = 0), A's and the dk^.k^ sums (e = 1),
// dki's and G's (e = 2), dA / dL's, dAqk's and dAqk lo's (e = 3). t is read at each site (tid_here), so
// that no site's slot addresses are held in registers for another's.
__device__ __forceinline__ bool dqi_parked_early(int j, int e) { return j == 3 || (j == 0 && e < 2); }
static_assert(kOffTail + (2 * kParts * kD + kThreads) * 4 == kSmem, "the float arrays as kSmem counts them");

}  // namespace
}  // namespace encore::cuda::kda2
