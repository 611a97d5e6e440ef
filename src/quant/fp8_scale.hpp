// The quant family's scale formulas (FP8 e4m3 group scale from core/fp8.hpp; MXFP8 e8m0 exponents,
// NVFP4 e2m1 codes, the 128x4 swizzled scale index), one definition for the CPU reference and the
// CUDA kernels.
#pragma once
#include <cmath>
#include <cstdint>

#include "core/fp8.hpp"
#include "core/host_device.hpp"

namespace encore::quant {

// The FP8 e4m3 group scale and its CPU group loop live in core/fp8.hpp (the MoE dispatch's fused
// quantization shares them); the quant family's names for them.
using ::encore::fp8_group_scale;
using ::encore::fp8_inverse_scale;
using ::encore::kE4m3Max;
#ifndef __CUDACC_RTC__
using ::encore::fp8_quantize_group;
#endif

// ---- MX formats (docs/quant.md, "MXFP8 and NVFP4") ----
constexpr int kMxfp8Block = 32;   // elements per e8m0 scale
constexpr int kNvfp4Block = 16;   // elements per e4m3 scale
constexpr int kE4m3Emax = 8;      // exponent of e4m3's largest normal (448 = 1.75 * 2^8)
constexpr float kE2m1Max = 6.0f;  // largest e2m1 magnitude
constexpr int kE8m0Bias = 127;
constexpr uint8_t kE8m0Nan = 0xff;

ENCORE_HOST_DEVICE inline int mx_clamp_exponent(int e) { return e < -kE8m0Bias ? -kE8m0Bias : (e > kE8m0Bias ? kE8m0Bias : e); }

// OCP MX v1.0 (section 6.3): shared_exp = floor(log2(amax)) - emax_elem, clamped to e8m0's
// [-127, 127]; amax = 0 gives -127. Exact (frexp), for subnormal amax too. amax finite, >= 0.
ENCORE_HOST_DEVICE inline int mxfp8_floor_exponent(float amax) {
  if (amax == 0.0f) return -kE8m0Bias;
  int e;
  frexpf(amax, &e);  // amax = f * 2^e, f in [0.5, 1): floor(log2(amax)) = e - 1
  return mx_clamp_exponent(e - 1 - kE4m3Emax);
}

// "RCEIL" (cuBLAS / Transformer Engine / torchao RCEIL): the smallest e with 2^e >= fl32(amax / 448),
// clamped to [-127, 127]; so no element saturates.
ENCORE_HOST_DEVICE inline int mxfp8_rceil_exponent(float amax) {
  const float d = amax / kE4m3Max;
  if (d == 0.0f) return -kE8m0Bias;
  int e;
  const float f = frexpf(d, &e);
  return mx_clamp_exponent(f == 0.5f ? e - 1 : e);
}

// e2m1 (sign bit 3, exponent bits 2-1, mantissa bit 0; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6): round
// to nearest, ties to the even code, saturating at 6; the sign kept (-0 is 0x8). NaN: not
// representable, the callers never pass one.
ENCORE_HOST_DEVICE inline uint8_t float_to_e2m1_code(float v) {
  const uint8_t sign = copysignf(1.0f, v) < 0.0f ? 0x8 : 0x0;
  const float a = fabsf(v);
  uint8_t m;
  if (a <= 0.25f) m = 0;        // tie 0.25 -> 0
  else if (a < 0.75f) m = 1;    // tie 0.75 -> 1.0 (code 2)
  else if (a <= 1.25f) m = 2;   // tie 1.25 -> 1.0
  else if (a < 1.75f) m = 3;    // tie 1.75 -> 2.0 (code 4)
  else if (a <= 2.5f) m = 4;    // tie 2.5 -> 2.0
  else if (a < 3.5f) m = 5;     // tie 3.5 -> 4.0 (code 6)
  else if (a <= 5.0f) m = 6;    // tie 5 -> 4.0
  else m = 7;                   // saturate at 6
  return uint8_t(sign | m);
}

ENCORE_HOST_DEVICE inline float e2m1_code_to_float(uint8_t c) {
  const int m = c & 7;
  const float mag = m < 2 ? 0.5f * float(m) : float(1 << ((m >> 1) - 1)) * (1.0f + 0.5f * float(m & 1));
  return (c & 0x8) ? -mag : mag;
}

// The 128x4 tiled ("32x4x4") scale layout of Blackwell's block-scaled GEMMs (CUTLASS
// Sm1xxBlockScaledConfig, cuBLAS VEC32_UE8M0 / VEC16_UE4M3): rows padded to 128, scale columns to 4;
// tiles of 128 rows x 4 scale columns are 512 contiguous bytes, tiles in row-of-tiles order (the
// column tiles of one row tile adjacent); inside a tile, row r and column c sit at
// (r % 32) * 16 + (r % 128) / 32 * 4 + c % 4.
ENCORE_HOST_DEVICE inline int64_t mx_padded_rows(int64_t rows) { return (rows + 127) / 128 * 128; }
ENCORE_HOST_DEVICE inline int64_t mx_padded_scale_cols(int64_t scale_cols) { return (scale_cols + 3) / 4 * 4; }
ENCORE_HOST_DEVICE inline int64_t mx_swizzled_offset(int64_t row, int64_t col, int64_t scale_cols) {
  const int64_t col_tiles = (scale_cols + 3) / 4;
  return ((row / 128) * col_tiles + col / 4) * 512 + (row % 32) * 16 + (row % 128) / 32 * 4 + col % 4;
}

}  // namespace encore::quant
