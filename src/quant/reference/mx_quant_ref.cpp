// CPU reference of MXFP8 (e4m3 + e8m0 per 32) and NVFP4 (e2m1 + e4m3 per 16 + fp32 global) quantization and its inverse.
#include "quant/reference/mx_quant_ref.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "encore/quant.hpp"
#include "quant/fp8_scale.hpp"

namespace encore {

uint8_t float_to_e2m1(float v) { return quant::float_to_e2m1_code(v); }
float e2m1_to_float(uint8_t code) { return quant::e2m1_code_to_float(uint8_t(code & 0xf)); }
float e8m0_to_float(uint8_t b) { return b == quant::kE8m0Nan ? NAN : std::ldexp(1.0f, int(b) - quant::kE8m0Bias); }
int64_t mx_swizzled_scale_offset(int64_t row, int64_t col, int64_t scale_cols) { return quant::mx_swizzled_offset(row, col, scale_cols); }

namespace reference {
namespace {

using quant::MxKind;
using quant::MxProblem;

float load(const MxProblem& p, int64_t m, int64_t k) { return float(load_as_double(p.x, p.dtype, m * p.x_stride + k)); }

int block_of(const MxProblem& p) { return p.kind == MxKind::kMxfp8 ? quant::kMxfp8Block : quant::kNvfp4Block; }

// Zeroes a swizzled scale buffer (its padding rows and columns stay 0).
void clear_padding(const MxProblem& p) {
  if (!p.swizzled) return;
  const int64_t sc = p.cols / block_of(p);
  std::memset(p.scales, 0, size_t(quant::mx_padded_rows(p.rows) * quant::mx_padded_scale_cols(sc)));
}

void mxfp8_block(const MxProblem& p, int64_t m, int64_t b) {
  const int64_t k0 = b * quant::kMxfp8Block, sc = p.cols / quant::kMxfp8Block;
  uint8_t* q = p.q + m * p.q_stride + k0;
  uint8_t& scale = p.scales[quant::mx_scale_index(p, m, b, sc)];
  float amax = 0.0f;
  bool finite = true;
  for (int k = 0; k < quant::kMxfp8Block; ++k) {
    const float v = load(p, m, k0 + k);
    finite = finite && std::isfinite(v);
    amax = std::max(amax, std::fabs(v));
  }
  if (!finite) {  // a NaN or infinity: the block's scale is NaN (e8m0 has no infinity), its elements NaN
    scale = quant::kE8m0Nan;
    std::memset(q, 0x7f, quant::kMxfp8Block);
    return;
  }
  const int e = p.rceil ? quant::mxfp8_rceil_exponent(amax) : quant::mxfp8_floor_exponent(amax);
  scale = uint8_t(e + quant::kE8m0Bias);
  for (int k = 0; k < quant::kMxfp8Block; ++k)  // x / 2^e is exact (power of two; below e4m3's range it rounds to 0 anyway)
    q[k] = float_to_e4m3(float(std::ldexp(double(load(p, m, k0 + k)), -e)));
}

// max |x| over the finite elements; the global scale amax / (6 * 448), or 1 where that is 0.
float nvfp4_global(const MxProblem& p) {
  if (p.given_global > 0.0f) return p.given_global;
  float amax = 0.0f;
  for (int64_t m = 0; m < p.rows; ++m)
    for (int64_t k = 0; k < p.cols; ++k) {
      const float v = load(p, m, k);
      if (std::isfinite(v)) amax = std::max(amax, std::fabs(v));
    }
  const float g = amax / (quant::kE2m1Max * quant::kE4m3Max);
  return g > 0.0f ? g : 1.0f;
}

void nvfp4_block(const MxProblem& p, float global, int64_t m, int64_t b) {
  const int64_t k0 = b * quant::kNvfp4Block, sc = p.cols / quant::kNvfp4Block;
  uint8_t* q = p.q + m * p.q_stride + k0 / 2;
  uint8_t& scale = p.scales[quant::mx_scale_index(p, m, b, sc)];
  float x[quant::kNvfp4Block];
  float amax = 0.0f;
  bool finite = true;
  for (int k = 0; k < quant::kNvfp4Block; ++k) {
    x[k] = load(p, m, k0 + k);
    finite = finite && std::isfinite(x[k]);
    amax = std::max(amax, std::fabs(x[k]));
  }
  uint8_t codes[quant::kNvfp4Block] = {};
  if (!finite) {
    scale = 0x7f;  // e4m3 NaN; e2m1 has no NaN, the elements are 0
  } else {
    scale = float_to_e4m3(amax / quant::kE2m1Max / global);  // fp32 ops in this order, then e4m3 RNE saturating
    const float d = e4m3_to_float(scale) * global;          // the block's decode scale
    if (d > 0.0f)
      for (int k = 0; k < quant::kNvfp4Block; ++k) codes[k] = quant::float_to_e2m1_code(x[k] / d);
  }
  for (int k = 0; k < quant::kNvfp4Block; k += 2) q[k / 2] = uint8_t(codes[k] | (codes[k + 1] << 4));
}

}  // namespace

void mx_quant(const MxProblem& p) {
  clear_padding(p);
  const int64_t blocks = p.cols / block_of(p);
  if (p.kind == MxKind::kMxfp8) {
    for (int64_t m = 0; m < p.rows; ++m)
      for (int64_t b = 0; b < blocks; ++b) mxfp8_block(p, m, b);
    return;
  }
  const float global = nvfp4_global(p);
  *p.global_scale = global;
  for (int64_t m = 0; m < p.rows; ++m)
    for (int64_t b = 0; b < blocks; ++b) nvfp4_block(p, global, m, b);
}

void mx_dequant(const MxProblem& p) {
  const int blk = block_of(p);
  const int64_t sc = p.cols / blk;
  const float global = p.kind == MxKind::kNvfp4 ? *p.global_scale : 1.0f;
  for (int64_t m = 0; m < p.rows; ++m)
    for (int64_t k = 0; k < p.cols; ++k) {
      const uint8_t s = p.scales[quant::mx_scale_index(p, m, k / blk, sc)];
      float v;
      if (p.kind == MxKind::kMxfp8) {
        v = e4m3_to_float(p.q[m * p.q_stride + k]) * e8m0_to_float(s);  // exact (a power of two)
      } else {
        const uint8_t pair = p.q[m * p.q_stride + k / 2];
        v = e2m1_to_float(uint8_t(k % 2 ? pair >> 4 : pair & 0xf)) * e4m3_to_float(s) * global;
      }
      store_from_double(p.x, p.dtype, m * p.x_stride + k, double(v));
    }
}

}  // namespace reference
}  // namespace encore
