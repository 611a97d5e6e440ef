#include "encore/core/dtype.hpp"

#include <cmath>
#include <cstring>

namespace encore {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kBF16: case DType::kFP16: return 2;
    case DType::kFP32: case DType::kInt32: return 4;
    case DType::kFP64: case DType::kInt64: return 8;
    case DType::kFP8E4M3: case DType::kUInt8: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
    case DType::kFP64: return "fp64";
    case DType::kFP8E4M3: return "fp8_e4m3";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

bool dtype_is_float(DType t) { return t != DType::kInt32 && t != DType::kInt64 && t != DType::kUInt8; }

float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                        // round to nearest even
  return uint16_t(u >> 16);
}

float fp16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  int exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  float v;
  if (exp == 0) {
    v = std::ldexp(float(mant), -24);
  } else if (exp == 31) {
    v = mant ? NAN : INFINITY;
  } else {
    v = std::ldexp(float(mant | 0x400u), exp - 25);
  }
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u |= sign;
  std::memcpy(&v, &u, 4);
  return v;
}

uint16_t float_to_fp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  float a = std::fabs(f);
  if (std::isnan(f)) return uint16_t(sign | 0x7e00u);
  if (a >= 65520.0f) return uint16_t(sign | 0x7c00u);  // rounds to infinity
  if (a < std::ldexp(1.0f, -14)) {                     // subnormal: multiples of 2^-24
    float q = std::nearbyint(a * 16777216.0f);          // default rounding mode: nearest even
    return uint16_t(sign | uint16_t(q));
  }
  int e;
  float m = std::frexp(a, &e);                  // a = m * 2^e, m in [0.5, 1)
  float q = std::nearbyint(m * 2048.0f);         // 11 significant bits
  if (q == 2048.0f) { q = 1024.0f; e += 1; }
  if (e + 14 >= 31) return uint16_t(sign | 0x7c00u);
  return uint16_t(sign | uint16_t((e + 14) << 10) | (uint16_t(q) & 0x3ffu));
}

double load_as_double(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFP16: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFP32: return static_cast<const float*>(base)[i];
    case DType::kFP64: return static_cast<const double*>(base)[i];
    case DType::kInt32: return static_cast<const int32_t*>(base)[i];
    case DType::kInt64: return double(static_cast<const int64_t*>(base)[i]);
    case DType::kFP8E4M3: case DType::kUInt8: break;
  }
  return NAN;
}

void store_from_double(void* base, DType t, int64_t i, double v) {
  switch (t) {
    case DType::kBF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(float(v)); return;
    case DType::kFP16: static_cast<uint16_t*>(base)[i] = float_to_fp16(float(v)); return;
    case DType::kFP32: static_cast<float*>(base)[i] = float(v); return;
    case DType::kFP64: static_cast<double*>(base)[i] = v; return;
    case DType::kInt32: static_cast<int32_t*>(base)[i] = int32_t(v); return;
    case DType::kInt64: static_cast<int64_t*>(base)[i] = int64_t(v); return;
    case DType::kFP8E4M3: case DType::kUInt8: return;
  }
}

}  // namespace encore
