// encore quant family: FP8 e4m3 per-token-group quantization; MXFP8 and NVFP4 (below).
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

// ---- MXFP8 and NVFP4 (docs/quant.md, "MXFP8 and NVFP4"): CPU backend and CUDA kernels, bit-identical.
// On CUDA (all tensors on one device; asynchronous on `stream`, no allocation, CUDA-graph safe):
// x's data pointer and row stride 16-byte aligned, q's a multiple of 8 bytes (MXFP8) / 4 (NVFP4),
// M * K / 8 < 2^31. NVFP4 with a computed global scale makes two passes over x (amax, then the
// quantization; global_scale holds the amax in between). ----
//
// MXFP8 (OCP Microscaling v1.0): per row and block of 32 consecutive columns, with amax the block's max |x|:
//   e = floor(log2(amax)) - 8 (kFloor, the spec's rule) or the smallest e with 2^e >= fl32(amax / 448)
//       (kRceil, cuBLAS's / torchao's RCEIL), clamped to [-127, 127]; amax = 0 gives -127
//   scale byte = e + 127 (e8m0);  q = e4m3_rn_satfinite(x / 2^e)
//   a NaN or infinity in the block: scale 0xff (NaN) and every element 0x7f (NaN)
// NVFP4: global = amax(x) / (6 * 448) over the finite values (1 if that is 0; or the caller's);
//   per block of 16: s = e4m3_rn_satfinite(fl32(fl32(amax / 6) / global)), d = fl32(float(s) * global),
//   q = e2m1_rn_satfinite(fl32(x / d)) (0 where d is 0), two codes a byte, the even column in the low nibble;
//   a NaN or infinity in the block: s = 0x7f (NaN), codes 0.
// Scales: row-major [M, K / block] (unit last stride, rows any stride >= K / block), or kSwizzled, the
// 128x4-tiled layout Blackwell's block-scaled GEMMs read: a contiguous [ceil(M/128)*128,
// ceil(K/block/4)*4] buffer (its padding written 0) holding scale (r, c) at mx_swizzled_scale_offset.
enum class MxScaleLayout : uint8_t { kRowMajor, kSwizzled };
enum class MxScaleRounding : uint8_t { kFloor, kRceil };

struct MxQuantOptions {
  MxScaleLayout scale_layout = MxScaleLayout::kRowMajor;
  MxScaleRounding rounding = MxScaleRounding::kFloor;  // MXFP8 only
  float global_scale = 0.0f;  // NVFP4 only: > 0 (finite) uses it (a calibrated scale), 0 computes amax / 2688
};

struct Mxfp8QuantArgs {
  TensorView x;       // [M, K] bf16, fp16 or fp32, K a multiple of 32
  TensorView q;       // [M, K] fp8 e4m3, output
  TensorView scales;  // uint8 e8m0, output: [M, K / 32] or the swizzled buffer
};
struct Nvfp4QuantArgs {
  TensorView x;             // [M, K] bf16, fp16 or fp32, K a multiple of 16
  TensorView q;             // [M, K / 2] uint8 (e2m1 pairs), output
  TensorView scales;        // fp8 e4m3, output: [M, K / 16] or the swizzled buffer
  TensorView global_scale;  // [1] fp32, output (the value used)
};
Status validate(const Mxfp8QuantArgs& args, const MxQuantOptions& opts);
Status validate(const Nvfp4QuantArgs& args, const MxQuantOptions& opts);
size_t workspace_bytes(const Mxfp8QuantArgs& args, const MxQuantOptions& opts);
size_t workspace_bytes(const Nvfp4QuantArgs& args, const MxQuantOptions& opts);
Status run(const Mxfp8QuantArgs& args, const MxQuantOptions& opts, void* workspace = nullptr, Stream stream = nullptr);
Status run(const Nvfp4QuantArgs& args, const MxQuantOptions& opts, void* workspace = nullptr, Stream stream = nullptr);

// The inverses (CPU or CUDA, same constraints): x = float(q) * 2^(s - 127), resp. e2m1(q) * float(s) *
// global (fp32, left to right). x: fp32 or bf16 [M, K]; scales in the layout opts.scale_layout names.
struct Mxfp8DequantArgs {
  TensorView q, scales, x;
};
struct Nvfp4DequantArgs {
  TensorView q, scales, global_scale, x;
};
Status run(const Mxfp8DequantArgs& args, const MxQuantOptions& opts, Stream stream = nullptr);
Status run(const Nvfp4DequantArgs& args, const MxQuantOptions& opts, Stream stream = nullptr);

// Host conversions: e2m1 round to nearest even, saturating at +-6 (code: sign bit 3); e8m0 (0xff NaN).
uint8_t float_to_e2m1(float v);
float e2m1_to_float(uint8_t code);
float e8m0_to_float(uint8_t b);
// Byte offset of scale (row, col) in the swizzled layout of a [*, scale_cols] scale matrix:
// ((row / 128) * ceil(scale_cols / 4) + col / 4) * 512 + (row % 32) * 16 + (row % 128) / 32 * 4 + col % 4.
int64_t mx_swizzled_scale_offset(int64_t row, int64_t col, int64_t scale_cols);

}  // namespace encore
