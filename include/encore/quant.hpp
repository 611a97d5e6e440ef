// encore quant family: FP8 e4m3 per-token-group quantization.
//
//   For each row m and group g of `group_size` consecutive columns:
//     amax  = max(max_k |x[m, g*G + k]|, eps)
//     s     = amax / 448                        (448 = largest finite e4m3 value)
//     s     = 2^ceil(log2(s))  if power_of_two_scales (exact, via frexp)
//     q[m, g*G + k] = e4m3(x * (1/s))           (1/s rounded once; round to nearest even, saturating)
//     scales[m, g]  = s                         (fp32)
//   Dequantization: x' = float(q) * s.
//
// x: [M, K] bf16, fp16 or fp32 with unit last stride, row stride a multiple of 16 bytes; K a
// multiple of group_size (128). q: [M, K] fp8 e4m3, row stride a multiple of 16 elements.
// scales: [M, K / group_size] fp32 with any strides: row-major (strides {K/G, 1}) or column-major
// (strides {1, ld} with ld >= M, e.g. padded for TMA) are the usual layouts.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdint>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore {

struct Fp8GroupQuantOptions {
  int group_size = 128;
  bool power_of_two_scales = false;
  float eps = 1e-10f;  // amax floor, so an all-zero group gets a finite scale
};

struct Fp8GroupQuantArgs {
  TensorView x;       // [M, K]
  TensorView q;       // [M, K] fp8 e4m3, output
  TensorView scales;  // [M, K / group_size] fp32, output
};

Status validate(const Fp8GroupQuantArgs& args, const Fp8GroupQuantOptions& opts);
size_t workspace_bytes(const Fp8GroupQuantArgs& args, const Fp8GroupQuantOptions& opts);
Status run(const Fp8GroupQuantArgs& args, const Fp8GroupQuantOptions& opts, void* workspace = nullptr,
           Stream stream = nullptr);

// The inverse, x = float(q) * scale, on the CPU backend only (tests, debugging). x: fp32 or bf16.
struct Fp8GroupDequantArgs {
  TensorView q;       // [M, K] fp8 e4m3
  TensorView scales;  // [M, K / group_size] fp32
  TensorView x;       // [M, K], output
};
Status run(const Fp8GroupDequantArgs& args, const Fp8GroupQuantOptions& opts);

// e4m3 ("fn": no infinities, max 448) host conversions: round to nearest even, saturating to +-448.
uint8_t float_to_e4m3(float v);
float e4m3_to_float(uint8_t b);

}  // namespace encore
