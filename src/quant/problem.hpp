// The quant family's bottom: the validated FP8 group-quantization and MX (MXFP8 / NVFP4) problems,
// shared by the CPU and CUDA backends, and the FP8 CUDA launch plan.
#pragma once
#include <cstdint>

#include "encore/core/dtype.hpp"
#include "quant/fp8_scale.hpp"

namespace encore::quant {

constexpr int kFp8GroupSize = 128;  // elements per quantization group

struct Fp8QuantProblem {
  const void* x = nullptr;
  int64_t x_stride = 0;  // elements
  uint8_t* q = nullptr;
  int64_t q_stride = 0;
  float* scales = nullptr;
  int64_t scale_stride_m = 0, scale_stride_g = 0;
  int64_t rows = 0, cols = 0;
  int group_size = 128;
  DType dtype = DType::kBF16;
  bool power_of_two = false;
  float eps = 1e-10f;
  int device_index = 0;
};

// `threads` per block, `groups_per_thread` groups per lane group and chunk (1, 2, 4, 8), `grid`
// blocks striding over the chunks, `packs_per_lane` 16-byte packs of a group per lane (1 or 2; a
// group is 128 / (16 / sizeof(T) * packs_per_lane) lanes), `tile_rows` rows per tile of the group
// numbering (a power of two <= 64; 1 = row order; see fp8_group_quant_kernel.cuh).
struct Fp8QuantLaunchPlan {
  int threads = 256;
  int groups_per_thread = 1;
  long long grid = 0;
  int packs_per_lane = 1;
  int tile_rows = 1;
};

// Lanes per group for a plan's packs_per_lane.
inline int fp8_lanes_per_group(DType dtype, int packs_per_lane) { return 128 / (16 / int(dtype_size(dtype)) * packs_per_lane); }

// Groups the kernel numbers for a plan with `tile_rows` (rows padded to whole tiles): what `grid`
// covers.
inline int64_t fp8_numbered_groups(int64_t rows, int64_t cols, int tile_rows) {
  return (rows + tile_rows - 1) / tile_rows * tile_rows * (cols / kFp8GroupSize);
}

// Blocks that cover `numbered_groups` with one chunk per lane group (grid-stride loop not needed):
// ceil(numbered_groups / (threads / lanes per group * groups_per_thread)).
inline long long fp8_full_grid(const Fp8QuantLaunchPlan& plan, DType dtype, int64_t numbered_groups) {
  const int64_t per_block = int64_t(plan.threads / fp8_lanes_per_group(dtype, plan.packs_per_lane)) * plan.groups_per_thread;
  return (numbered_groups + per_block - 1) / per_block;
}

// MXFP8 (e4m3 elements, an e8m0 scale per 32) or NVFP4 (packed e2m1 elements, an e4m3 scale per 16,
// an fp32 global scale) quantization or its inverse (docs/quant.md, "MXFP8 and NVFP4").
enum class MxKind : uint8_t { kMxfp8, kNvfp4 };

struct MxProblem {
  MxKind kind = MxKind::kMxfp8;
  void* x = nullptr;  // [rows, cols] high precision: input of the quantization, output of the inverse
  int64_t x_stride = 0;
  DType dtype = DType::kBF16;
  uint8_t* q = nullptr;  // e4m3 bytes [rows, cols] or e2m1 pairs [rows, cols / 2], low nibble first
  int64_t q_stride = 0;
  uint8_t* scales = nullptr;  // e8m0 / e4m3 bytes
  int64_t scale_stride = 0;   // row-major layout: bytes between rows
  bool swizzled = false;      // the 128x4 tiled layout (fp8_scale.hpp, mx_swizzled_offset)
  bool rceil = false;         // MXFP8: the RCEIL exponent instead of the OCP floor rule
  float* global_scale = nullptr;  // NVFP4: [1] fp32 (output of the quantization, input of the inverse)
  float given_global = 0.0f;      // NVFP4 quantization: > 0 uses it instead of amax / (6 * 448)
  int64_t rows = 0, cols = 0;
};

// Byte offset of the scale of row `row`, block column `col` in either layout.
inline int64_t mx_scale_index(const MxProblem& p, int64_t row, int64_t col, int64_t scale_cols) {
  return p.swizzled ? mx_swizzled_offset(row, col, scale_cols) : row * p.scale_stride + col;
}

// The CUDA launch plan for a problem (quant/plan.cpp).
Fp8QuantLaunchPlan plan_fp8_group_quant(const Fp8QuantProblem& p, int sm_count);

}  // namespace encore::quant
