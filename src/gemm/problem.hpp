// The GEMM-epilogue family's bottom: the validated problems the dispatch hands to the CUDA
// launchers (raw pointers, element strides; no CUDA or CUTLASS types).
#pragma once
#include <cstdint>

#include <utility>

#include "encore/core/dtype.hpp"
#include "encore/gemm.hpp"

namespace encore::gemm {

// The head width of kQkvHeadSqsum on CUDA (its partials' column group; the tile N is 1 or 2 heads).
constexpr int kHeadSqsumDim = 128;

struct GemmProblem {
  const void* a = nullptr;
  int64_t lda = 0;
  const void* w = nullptr;
  int64_t ldw = 0;
  void* d = nullptr;  // null: D not written (kLse only)
  int64_t ldd = 0;
  int M = 0, N = 0, K = 0;
  DType dtype = DType::kBF16;
  const void* c = nullptr;  // tile input C (residual, saved x; kOperandCPairs: Z [M, 2N] as (2n, 2n+1) pairs, ldc in elements of c)
  int64_t ldc = 0;
  const void* c2 = nullptr;  // second tile input (kOperandC2Optional), null = 0
  int64_t ldc2 = 0;
  const float* zdz = nullptr;  // [M] contiguous (kOperandZdz)
  void* aux = nullptr;  // [M, N]; kSwiglu [M, N/2]; kSwigluBwd [M, 2N]
  int64_t ld_aux = 0;
  const void* gamma = nullptr;       // [N], contiguous
  const float* row_scale = nullptr;  // [M] contiguous, null = 1
  const float* alpha = nullptr;      // [1] (device pointer); null = 1 where optional
  float* partials = nullptr;         // [M, tiles] fp32; column partials [ceil(M / 128), round_up(N, tile N)], packed
  int64_t ld_partials = 0;
  const int32_t* pos = nullptr;   // [M] contiguous (kRope)
  const float* freq = nullptr;    // [N] contiguous (kRope)
  const int32_t* target = nullptr;  // [M] contiguous (kLse, optional)
  float* target_logit = nullptr;    // [M] contiguous
  const float* lse = nullptr;       // [M] contiguous (kCeBwd)
  int ignore_index = -100;
  int col0 = 0;     // kLse over an N-slice: global column of the slice's column 0 (target select)
  int n_total = 0;  // kLse over an N-slice: the whole N (0: N)
  int swizzle = 1;  // persistent tile scheduler: tiles per swizzle group (1, 2, 4, 8; 0 until launch_sliced resolves auto)
  int raster = 0;   // persistent tile scheduler order: 0 heuristic, 1 along M, 2 along N
  int device = 0;
  int sm_count = 0;
};

// QK-norm + RoPE finish (gemm/cuda/qk_norm_rope.cu).
struct QkNormRopeProblem {
  void* qkv = nullptr;
  int64_t ld_qkv = 0;
  DType dtype = DType::kBF16;
  const float* partials = nullptr;
  int64_t ld_partials = 0;
  const void* q_weight = nullptr;  // contiguous, qkv's dtype or fp32 (weight_fp32)
  const void* k_weight = nullptr;
  bool weight_fp32 = false;
  const int32_t* pos = nullptr;  // contiguous
  const float* freq = nullptr;   // contiguous, 8-byte aligned
  int M = 0, num_q_heads = 0, qk_heads = 0, head_dim = 0;
  float eps = 1e-6f;
};

// RoPE backward + zdz (gemm/cuda/rope_bwd_zdz.cu).
struct RopeBwdZdzProblem {
  const void* y = nullptr;
  const void* dy = nullptr;
  void* dz = nullptr;
  int64_t ld_y = 0, ld_dy = 0, ld_dz = 0;
  DType dtype = DType::kBF16;
  const int32_t* pos = nullptr;  // contiguous
  const float* freq = nullptr;   // contiguous, 8-byte aligned
  float* zdz = nullptr;          // contiguous
  int M = 0, N = 0;
  float scale = 1.0f;
};

// ---- CUDA launch plans (plan.cpp; the measurements behind each rule are in docs/gemm.md) ------

// Tile shape (M, N) of a resolved tile (never kAuto).
std::pair<int64_t, int64_t> tile_mn(GemmTile t);
// The tile for GemmTile::kAuto when the partials do not fix it (every epilogue by the same rule on N and K).
GemmTile auto_tile(int64_t N, int64_t K);
// Scheduler swizzle (tiles per group; the padding it adds to the tile grid bounded) and raster order for
// swizzle = 0 / GemmRaster::kAuto.
int auto_swizzle(int64_t M, int64_t N, GemmTile t);
GemmRaster auto_raster(GemmTile t);
// Consecutive N-slices of whole tiles to launch over for n_slices = 0.
int auto_slices(int64_t M, int64_t N, GemmTile t, int sm_count);

}  // namespace encore::gemm
