// Test helper (CUDA builds only) for KDA serving on CUDA: device mirrors of fp64 host views in a device
// dtype (the host rounded in place, so the CPU reference sees the device's values; outputs poisoned
// with NaN), of whole recurrent-step and pool-prefill calls, and reading device views back.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "encore/kda_serving.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {

inline const Device kCuda{DeviceType::kCUDA, 0};

// Device copies that live as long as the object.
struct DeviceArena {
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  // A device copy of the contiguous host view h in dtype dt (same dtype: the bytes; else converted, and h
  // rounded in place to dt so the reference sees the device's values); poison: NaN instead.
  TensorView mirror(const TensorView& h, DType dt, bool poison = false) {
    if (!h.defined()) return {};
    const int64_t n = h.numel();
    std::vector<unsigned char> bytes(size_t(std::max<int64_t>(n, 1)) * dtype_size(dt));
    if (dt == h.dtype && !poison) {
      std::memcpy(bytes.data(), h.data, size_t(n) * dtype_size(dt));
    } else {
      for (int64_t i = 0; i < n; ++i) {
        store_from_double(bytes.data(), dt, i, poison ? NAN : load_as_double(h.data, h.dtype, i));
        if (!poison) store_from_double(h.data, h.dtype, i, load_as_double(bytes.data(), dt, i));
      }
    }
    bufs.push_back(std::make_unique<DeviceBuffer>(bytes.size()));
    cudaMemcpy(bufs.back()->ptr, bytes.data(), bytes.size(), cudaMemcpyHostToDevice);
    TensorView d = h;
    d.data = bufs.back()->ptr, d.dtype = dt, d.device = kCuda;
    return d;
  }
  // Uninitialized device bytes (a workspace); null for 0 bytes.
  void* bytes(size_t n) {
    if (n == 0) return nullptr;
    bufs.push_back(std::make_unique<DeviceBuffer>(n));
    return bufs.back()->ptr;
  }
};

inline std::vector<unsigned char> fetch_bytes(const TensorView& d) {
  std::vector<unsigned char> b(size_t(d.numel()) * dtype_size(d.dtype));
  cudaMemcpy(b.data(), d.data, b.size(), cudaMemcpyDeviceToHost);
  return b;
}
inline std::vector<double> fetch(const TensorView& d) {
  const std::vector<unsigned char> b = fetch_bytes(d);
  std::vector<double> x(size_t(d.numel()));
  for (size_t i = 0; i < x.size(); ++i) x[i] = load_as_double(b.data(), d.dtype, int64_t(i));
  return x;
}

// The device mirror of a host call: inputs in `in` (g in fp32 when precomputed), o poisoned; states and
// indices as the host's (their bytes).
inline KdaRecurrentArgs to_device(KdaRecurrentArgs& h, DType in, DType gdt, DeviceArena& ar, std::optional<DType> odt = std::nullopt) {
  KdaRecurrentArgs d;
  d.q = ar.mirror(h.q, in), d.k = ar.mirror(h.k, in), d.v = ar.mirror(h.v, in), d.g = ar.mirror(h.g, gdt), d.beta = ar.mirror(h.beta, in);
  d.A_log = ar.mirror(h.A_log, DType::kFP32), d.dt_bias = ar.mirror(h.dt_bias, DType::kFP32);
  d.cu_seqlens = h.cu_seqlens;  // host memory
  d.initial_state = ar.mirror(h.initial_state, h.initial_state.dtype);
  d.state_indices = ar.mirror(h.state_indices, h.state_indices.dtype);
  d.num_accepted_tokens = ar.mirror(h.num_accepted_tokens, h.num_accepted_tokens.dtype);
  d.o = ar.mirror(h.o, odt.value_or(in), /*poison=*/true);  // o in its own dtype when given
  if (h.final_state.defined()) {
    const bool in_place = h.final_state.data == h.initial_state.data;
    d.final_state = in_place ? d.initial_state : ar.mirror(h.final_state, h.final_state.dtype, true);
  }
  return d;
}

// The device mirror of a host call: inputs in `in` (g in fp32 when precomputed), o poisoned, the pool's
// and the indices' bytes.
inline KdaPoolForwardArgs to_device(KdaPoolForwardArgs& h, DType in, DType gdt, DeviceArena& ar) {
  KdaPoolForwardArgs d;
  const KdaForwardArgs& f = h.fwd;
  d.fwd.q = ar.mirror(f.q, in), d.fwd.k = ar.mirror(f.k, in), d.fwd.v = ar.mirror(f.v, in), d.fwd.g = ar.mirror(f.g, gdt);
  d.fwd.beta = ar.mirror(f.beta, in);
  d.fwd.A_log = ar.mirror(f.A_log, DType::kFP32), d.fwd.dt_bias = ar.mirror(f.dt_bias, DType::kFP32);
  d.fwd.cu_seqlens = f.cu_seqlens;  // host memory
  d.fwd.o = ar.mirror(f.o, in, /*poison=*/true);
  d.pool = ar.mirror(h.pool, h.pool.dtype);
  d.state_indices = ar.mirror(h.state_indices, h.state_indices.dtype);
  return d;
}

}  // namespace encore::test
