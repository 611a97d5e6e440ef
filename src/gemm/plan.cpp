// Launch heuristics of the GEMM-epilogue family's CUDA kernels: tile, partials width, scheduler
// swizzle and raster, N-slices. Each rule states the H200 measurement behind it (docs/gemm.md).
#include <algorithm>

#include "gemm/checks.hpp"
#include "gemm/problem.hpp"

namespace encore {

// With scheduler swizzle the ping-pong tile matches or beats the cooperative one for both partials
// epilogues at the o-projection and LM-head shapes (residual 0.92-1.03x of cuBLAS vs 1.00-1.32x;
// LSE 1.08x vs 1.08-1.12x), so the partials are per 128 columns. For long K (>= 12288, the down
// projection of 8B/70B) the residual epilogue's share of the time is small and the cooperative
// tile's mainloop wins (the same shape without the residual: 0.97-1.01x of cuBLAS cooperative vs
// 1.01-1.08x ping-pong), so the partials are per 256.
// swiglu_bwd (the down projection's dgrad, K = d) on the cooperative tile from K 8192: at 70B
// (M 8192 / 16384, N 28672, K 8192) 1.101x / 1.060x of cuBLAS against 1.168x / 1.145x ping-pong; at
// 8B (K 4096) ping-pong 1.022x / 1.119x against 1.118x / 1.103x, at 1B ping-pong ahead too.
// rmsnorm_bwd on the cooperative tile from K 12288 (the gate/up dgrad, K = 2F): at 8B (M 8192 / 16384,
// N 4096, K 28672) ping-pong ran 1.70x / 1.83x of cuBLAS on an H100 where the plain dgrad ran 1.02x on
// the cooperative tile and 1.56x / 1.66x on ping-pong (bench/results/2026-12-07-h100-gemm_epilogue-8B.json);
// at K 3072-6144 ping-pong stays (cooperative measured 1.2-1.47x of cuBLAS there against 0.97-1.2x).
int gemm_partial_tile_n(Epilogue e, int64_t, int64_t, int64_t K) {
  const GemmEpilogueInfo* info = gemm_epilogue_info(e);
  if (info == nullptr || !(info->operands & (kOperandTilePartials | kOperandTilePartialsOptional | kOperandColumnPartials))) return 0;
  if (e == Epilogue::kSwigluBwd) return K >= 8192 ? 256 : 128;
  return (e == Epilogue::kResidualSqsumAux || e == Epilogue::kRmsnormBwd) && K >= 12288 ? 256 : 128;
}

namespace gemm {

std::pair<int64_t, int64_t> tile_mn(GemmTile t) {
  if (t == GemmTile::kCooperative128x256) return {128, 256};
  if (t == GemmTile::kPingpong64x256) return {64, 256};
  return {128, 128};
}

// Ping-pong 128x128, whose epilogue overlaps the other warpgroup's mainloop, wins for short K and
// narrow N; the cooperative 128x256 tile's higher mainloop efficiency wins for long K and wide N.
// SwiGLU included: 8B gate/up (M 8192 / 16384 x 28672 x 4096) ran 1.040x / 1.043x of cuBLAS on the
// cooperative tile against 1.262x / 1.260x on ping-pong on an H100 (the 8B JSON above); on an H200
// ping-pong had led by 2% (1.037x against 1.056x).
GemmTile auto_tile(int64_t N, int64_t K) {
  const bool pingpong = K <= 2048 || (K <= 4096 && N <= 8192) || N <= 2048;
  return pingpong ? GemmTile::kPingpong128x128 : GemmTile::kCooperative128x256;
}

// Groups of 8 tiles keep A and W panels in L2 across the persistent schedule (5-25% on wide
// problems); small grids stay unswizzled. CUTLASS's persistent scheduler pads the tile grid in both
// dimensions to a multiple of swizzle x cluster (tile_scheduler_params.h: round_up(problem_blocks,
// (1 << log_swizzle) * cluster)) and runs the padding tiles like any other (zero-filled loads, clipped
// stores), so the swizzle is the largest of 8, 4, 2 whose padding adds at most 1/16 of the tiles in
// each dimension (2x1 clusters): at M 1024 on a 128-row tile swizzle 8 pads 8 row tiles to 16, twice
// the work, where 4 pads none: the 8B LM head's gemm_lse at M 1024 ran 3065 us at swizzle 8 against 1652 us
// on this rule's 4 (1.12x of cuBLAS; H100, ENCORE_BENCH_FILTER=lse_chunk, bench/results/2026-12-07-h100-gemm_epilogue-lse_chunk-223a141.json).
// The shapes of the measurements above (M 8192, 16384) keep 8.
int auto_swizzle(int64_t M, int64_t N, GemmTile t) {
  if (M < 1024 || N < 1024) return 1;
  const auto [tm, tn] = tile_mn(t);
  const int64_t mt = ceil_div(M, tm), nt = ceil_div(N, tn);
  for (int s : {8, 4, 2}) {
    const int64_t pad_m = ceil_div(mt, 2 * s) * 2 * s - mt, pad_n = ceil_div(nt, s) * s - nt;
    if (16 * pad_m <= mt && 16 * pad_n <= nt) return s;
  }
  return 1;
}

// Along N (the scheduler walks the W panels while a swizzle group of A row panels stays in L2) on
// the cooperative and 128x128 ping-pong tiles: against CUTLASS's heuristic (along M when there are
// more N tiles than M tiles), swizzle 8, two runs: 70B gate/up SwiGLU 1.033x / 1.040x of cuBLAS along
// N against 1.077x / 1.055x along M; LM-head LSE on ping-pong 128x128 1.025x against 1.064x. The
// 64x256 ping-pong tile measured slower along N and keeps the heuristic.
GemmRaster auto_raster(GemmTile t) { return t != GemmTile::kPingpong64x256 ? GemmRaster::kAlongN : GemmRaster::kAuto; }

// The LM head's LSE at 486 tiles per CTA ran 1.034-1.087x of cuBLAS in one launch and 1.003-1.026x
// in 3 slices (162 per CTA); at M = 16384 (972 per CTA) 1.047x vs 1.002x in 6; the 8B gate/up SwiGLU
// at M = 16384 (217 per CTA) 1.078x vs 1.060x in 2; at ~109 tiles per CTA slicing did not help. Not
// on the 64x256 ping-pong tile: its raster order is CUTLASS's heuristic on the launch's shape, which
// flips on a slice (LM-head LSE at M = 16384: 1.23x of cuBLAS in 6 slices, ~1.05x in one).
int auto_slices(int64_t M, int64_t N, GemmTile t, int sm_count) {
  constexpr int64_t kMaxPerCta = 200, kTargetPerCta = 165;
  if (t == GemmTile::kPingpong64x256) return 1;
  const auto [tm, tn] = tile_mn(t);
  const int64_t m_tiles = ceil_div(M, 2 * tm) * 2;  // 2x1 clusters
  const int64_t n_tiles = ceil_div(N, tn), per_cta = ceil_div(m_tiles * n_tiles, sm_count);
  if (per_cta <= kMaxPerCta) return 1;
  return int(std::min<int64_t>(n_tiles, ceil_div(per_cta, kTargetPerCta)));
}

}  // namespace gemm
}  // namespace encore
