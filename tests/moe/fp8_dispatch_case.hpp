// The fused FP8 dispatch's test cases (test_moe_dispatch_fp8_cpu.cpp, test_moe_dispatch_fp8_gpu.cpp): random routing and
// x (bf16 values stored as bf16 or fp32, a few rows of wide range, one NaN), and host buffers for the
// outputs, poisoned (x_permuted 0xab bytes, x_scales NaN, maps -7).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "encore/moe.hpp"

namespace encore::test {

struct Fp8DispatchCase {
  const char* name;
  int64_t T;
  int k, E, align;
  int64_t D;
  DType dtype;  // x: kBF16 or kFP32
  bool power_of_two;
};

struct Fp8DispatchHost {
  Fp8DispatchCase c;
  int64_t R = 0;
  std::vector<int32_t> ids, counts, offsets, slot_rows, row_slots;
  std::vector<float> xf;        // x's values (bf16-representable)
  std::vector<uint16_t> xb;     // x as bf16 bits (dtype kBF16)
  std::vector<uint8_t> q;       // x_permuted, e4m3
  std::vector<float> scales;    // [R, D / 128]
  std::vector<int32_t> ws;

  explicit Fp8DispatchHost(const Fp8DispatchCase& cs, uint64_t seed) : c(cs) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    ids.resize(size_t(c.T * c.k));
    for (int64_t t = 0; t < c.T; ++t) {  // k distinct experts per token; expert E - 1 never picked (when E > k)
      std::vector<int32_t> pool;
      for (int e = 0; e < (c.E > c.k ? c.E - 1 : c.E); ++e) pool.push_back(e);
      std::shuffle(pool.begin(), pool.end(), rng);
      for (int j = 0; j < c.k; ++j) ids[size_t(t * c.k + j)] = pool[size_t(j)];
    }
    xf.resize(size_t(c.T * c.D));
    for (int64_t t = 0; t < c.T; ++t) {
      const float scale = t % 7 == 3 ? 1e-3f : (t % 7 == 5 ? 300.f : 1.f);  // rows of small and large magnitude
      for (int64_t d = 0; d < c.D; ++d) {
        uint32_t bits;
        const float v = scale * nd(rng);
        std::memcpy(&bits, &v, 4);
        bits &= 0xffff0000u;  // bf16-representable
        std::memcpy(&xf[size_t(t * c.D + d)], &bits, 4);
      }
    }
    if (c.T > 2) xf[size_t(2 * c.D + 5)] = NAN;  // one NaN: its group's amax ignores it, its code is NaN
    xb.resize(xf.size());
    for (size_t i = 0; i < xf.size(); ++i) {
      uint32_t bits;
      std::memcpy(&bits, &xf[i], 4);
      xb[i] = uint16_t(bits >> 16);
    }
    R = moe_permuted_rows(c.T, c.k, c.E, c.align);
    counts.assign(size_t(c.E), -7);
    offsets.assign(size_t(c.E + 1), -7);
    slot_rows.assign(size_t(c.T * c.k), -7);
    row_slots.assign(size_t(R), -7);
    q.assign(size_t(R * c.D), 0xab);
    scales.assign(size_t(R * (c.D / 128)), NAN);
  }
  void* x_data() { return c.dtype == DType::kBF16 ? static_cast<void*>(xb.data()) : static_cast<void*>(xf.data()); }
  MoeDispatchOptions options() const {
    MoeDispatchOptions o{c.E, c.align};
    o.fp8_power_of_two_scales = c.power_of_two;
    return o;
  }
  // The arguments over this object's host buffers.
  MoeDispatchArgs args() {
    auto m = [](void* p, DType t, int64_t r, int64_t cl) { return TensorView::contiguous(p, t, {r, cl}); };
    auto v = [](void* p, DType t, int64_t n) { return TensorView::contiguous(p, t, {n}); };
    MoeDispatchArgs a{m(ids.data(), DType::kInt32, c.T, c.k),       m(x_data(), c.dtype, c.T, c.D),
                      v(counts.data(), DType::kInt32, c.E),         v(offsets.data(), DType::kInt32, c.E + 1),
                      m(slot_rows.data(), DType::kInt32, c.T, c.k), v(row_slots.data(), DType::kInt32, R),
                      m(q.data(), DType::kFP8E4M3, R, c.D)};
    a.x_scales = m(scales.data(), DType::kFP32, R, c.D / 128);
    return a;
  }
};

inline const std::vector<Fp8DispatchCase>& fp8_dispatch_cases() {
  static const std::vector<Fp8DispatchCase> cases = {
      {"bf16_T37_k3_E6_align16_D256", 37, 3, 6, 16, 256, DType::kBF16, false},
      {"bf16_T1_k8_E64_align1_D7168", 1, 8, 64, 1, 7168, DType::kBF16, true},
      {"fp32_T50_k2_E4_align8_D384", 50, 2, 4, 8, 384, DType::kFP32, false},
      {"bf16_T300_k6_E32_align128_D1152", 300, 6, 32, 128, 1152, DType::kBF16, false},
      {"fp32_T9_k1_E1_align4_D128", 9, 1, 1, 4, 128, DType::kFP32, true},
  };
  return cases;
}

}  // namespace encore::test
