// encore::DType — element types understood by encore's tensors.
#pragma once
#include <cstddef>
#include <cstdint>

namespace encore {

enum class DType : uint8_t { kBF16, kFP16, kFP32, kFP64, kFP8E4M3, kInt32, kInt64, kUInt8 };  // kUInt8: raw bytes (e8m0 scales, packed e2m1)

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // "bf16", "fp16", "fp32", "fp64", "fp8_e4m3", "int32", "int64", "uint8"
bool dtype_is_float(DType t);

// Scalar conversions used by the CPU backend and tests (round-to-nearest-even, NaN preserved).
float bf16_to_float(uint16_t h);
uint16_t float_to_bf16(float f);
float fp16_to_float(uint16_t h);
uint16_t float_to_fp16(float f);

// Reads element `i` of a buffer of type `t` as double / writes a double rounded to `t`.
// Only for float dtypes (bf16, fp16, fp32, fp64); used by references and tests, never on hot paths.
double load_as_double(const void* base, DType t, int64_t i);
void store_from_double(void* base, DType t, int64_t i, double v);

}  // namespace encore
