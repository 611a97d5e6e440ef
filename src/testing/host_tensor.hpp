// Testing helper (tests, `encore check`, benchmarks): an owning host buffer for a 2-D (or 1-D) row-strided tensor, random fills that are
// never all-zero, and poison values (NaN) so unwritten outputs fail comparisons.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "encore/core/tensor_view.hpp"

namespace encore::test {

struct HostTensor {
  DType dtype = DType::kFP32;
  int64_t rows = 1, cols = 1, row_stride = 1;
  bool is_1d = false;
  std::vector<unsigned char> bytes;

  HostTensor() = default;
  // [rows, cols] with row stride >= cols (elements).
  HostTensor(DType t, int64_t r, int64_t c, int64_t stride = 0)
      : dtype(t), rows(r), cols(c), row_stride(stride ? stride : c),
        bytes(size_t(((r - 1) * (stride ? stride : c) + c) * int64_t(dtype_size(t))) + 16) {}
  static HostTensor vector(DType t, int64_t n) {
    HostTensor h(t, 1, n);
    h.is_1d = true;
    return h;
  }

  int64_t storage_elems() const { return (rows - 1) * row_stride + cols; }
  size_t storage_bytes() const { return size_t(storage_elems()) * dtype_size(dtype); }
  int64_t index(int64_t r, int64_t c) const { return r * row_stride + c; }
  double get(int64_t r, int64_t c) const { return load_as_double(bytes.data(), dtype, index(r, c)); }
  void set(int64_t r, int64_t c, double v) { store_from_double(bytes.data(), dtype, index(r, c), v); }

  TensorView view(void* data, Device dev = {}) const {
    if (is_1d) return TensorView::contiguous(data, dtype, {cols}, dev);
    return TensorView::strided(data, dtype, {rows, cols}, {row_stride, 1}, dev);
  }
  // A host view (ops read inputs through it; outputs are written through it).
  TensorView view() const { return view(const_cast<unsigned char*>(bytes.data())); }

  void fill_normal(std::mt19937_64& rng, double mean = 0.0, double stddev = 1.0) {
    std::normal_distribution<double> d(mean, stddev);
    for (int64_t i = 0; i < storage_elems(); ++i) store_from_double(bytes.data(), dtype, i, d(rng));
  }
  void fill_uniform(std::mt19937_64& rng, double lo, double hi) {
    std::uniform_real_distribution<double> d(lo, hi);
    for (int64_t i = 0; i < storage_elems(); ++i) store_from_double(bytes.data(), dtype, i, d(rng));
  }
  void poison() {
    for (int64_t i = 0; i < storage_elems(); ++i) store_from_double(bytes.data(), dtype, i, NAN);
  }
};

inline std::mt19937_64 make_rng(uint64_t salt) {
  // Fresh inputs each run: seed from the clock, mixed with a per-test salt; printed on failure.
  return std::mt19937_64(uint64_t(std::random_device{}()) ^ (salt * 0x9E3779B97F4A7C15ull));
}

}  // namespace encore::test
