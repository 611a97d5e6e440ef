// Testing helper (tests, `encore check`, benchmarks): an owning host buffer for a 2-D (or 1-D) row-strided tensor, random fills that are
// never all-zero, and poison values (NaN) so unwritten outputs fail comparisons.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
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

  // Normal samples (Box-Muller over a splitmix64 stream per 1M-element chunk, seeded by one draw of
  // `rng`, so the fill is a function of rng's state), on up to 16 threads for large tensors: the MoE
  // tests' expert weights are 10^8-10^9 elements.
  void fill_normal(std::mt19937_64& rng, double mean = 0.0, double stddev = 1.0) {
    const uint64_t seed = rng();
    const int64_t n = storage_elems(), chunk = int64_t(1) << 20, chunks = (n + chunk - 1) / chunk;
    auto fill_chunks = [&](int64_t c0, int64_t step) {
      for (int64_t c = c0; c < chunks; c += step) {
        uint64_t state = seed ^ (uint64_t(c) * 0xD1B54A32D192ED03ull);
        auto next = [&state] {  // splitmix64, then 53 bits in (0, 1]
          uint64_t z = (state += 0x9E3779B97F4A7C15ull);
          z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
          z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
          return (double((z ^ (z >> 31)) >> 11) + 1.0) * 0x1p-53;
        };
        const int64_t end = std::min(n, (c + 1) * chunk);
        for (int64_t i = c * chunk; i < end; i += 2) {
          const double r = std::sqrt(-2.0 * std::log(next())), a = 6.283185307179586 * next();
          store_from_double(bytes.data(), dtype, i, mean + stddev * r * std::cos(a));
          if (i + 1 < end) store_from_double(bytes.data(), dtype, i + 1, mean + stddev * r * std::sin(a));
        }
      }
    };
    const int64_t threads = std::min<int64_t>({16, chunks / 4, int64_t(std::thread::hardware_concurrency())});
    if (threads < 2) return fill_chunks(0, 1);
    std::vector<std::thread> pool;
    for (int64_t t = 0; t < threads; ++t) pool.emplace_back(fill_chunks, t, threads);
    for (auto& th : pool) th.join();
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
