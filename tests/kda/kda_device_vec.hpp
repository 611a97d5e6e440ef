// Test helper (CUDA builds only): device copies of the fp64 host vectors of a KdaCase, shared by the
// KDA GPU backward tests.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "encore/core/tensor_view.hpp"
#include "encore/kda.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {

// A device copy of an fp64 host vector in `dt`; the host vector is rounded to `dt` in place so the
// CPU references see exactly the device's inputs.
struct DevVec {
  std::unique_ptr<DeviceBuffer> buf;
  TensorView view;
  size_t n = 0;
  DevVec(std::vector<double>& host, DType dt, std::initializer_list<int64_t> shape) : n(host.size()) {
    std::vector<unsigned char> bytes(std::max<size_t>(host.size(), 1) * dtype_size(dt));
    for (size_t i = 0; i < host.size(); ++i) {
      store_from_double(bytes.data(), dt, int64_t(i), host[i]);
      host[i] = load_as_double(bytes.data(), dt, int64_t(i));
    }
    buf = std::make_unique<DeviceBuffer>(bytes.size());
    cudaMemcpy(buf->ptr, bytes.data(), bytes.size(), cudaMemcpyHostToDevice);
    view = TensorView::contiguous(buf->ptr, dt, shape, Device{DeviceType::kCUDA, 0});
  }
  std::vector<double> fetch() const {
    std::vector<unsigned char> bytes(n * dtype_size(view.dtype));
    cudaMemcpy(bytes.data(), buf->ptr, bytes.size(), cudaMemcpyDeviceToHost);
    std::vector<double> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = load_as_double(bytes.data(), view.dtype, int64_t(i));
    return out;
  }
};

inline std::unique_ptr<DevVec> dev(std::vector<double>& host, DType dt, std::initializer_list<int64_t> shape) {
  return std::make_unique<DevVec>(host, dt, shape);
}
inline std::unique_ptr<DevVec> poisoned(size_t n, DType dt, std::initializer_list<int64_t> shape) {
  std::vector<double> nan(n, NAN);
  return dev(nan, dt, shape);
}

// The CUDA forward of case `c` on device copies of its inputs in `dt` (the gate in fp32 unless the
// kernel computes it), writing o, the final state and the residuals G (fp32), Aqk, Akk and, unless
// `remat`, h (in `rdt`) into poisoned buffers; `a` names them all, `nt` is h's rows (`counted`: the
// chunk count accepted the arguments). run() launches the forward and waits for it.
struct KdaDeviceForward {
  std::unique_ptr<DevVec> q, k, v, g, beta, h0, A_log, dt_bias, o, fin, rG, rAqk, rAkk, rh;
  KdaForwardArgs a;
  int64_t nt = 0;
  bool counted = false;  // kda_chunk_count accepted the arguments

  KdaDeviceForward(KdaCase& c, DType dt, DType rdt, bool remat) {
    const int64_t B = c.B, T = c.T, H = c.Hv(), Hq = c.H, K = c.K, V = c.V, N = c.N();
    const DType gdt = c.opts.use_gate_in_kernel ? dt : DType::kFP32;
    q = dev(c.q, dt, {B, T, Hq, K}), k = dev(c.k, dt, {B, T, Hq, K}), v = dev(c.v, dt, {B, T, H, V}), g = dev(c.g, gdt, {B, T, H, K});
    beta = dev(c.beta, dt, {B, T, H});
    o = poisoned(c.o.size(), dt, {B, T, H, V}), fin = poisoned(c.fin.size(), DType::kFP32, {N, H, K, V});
    a.q = q->view, a.k = k->view, a.v = v->view, a.g = g->view, a.beta = beta->view, a.o = o->view, a.final_state = fin->view;
    if (c.h0) a.initial_state = (h0 = dev(c.init, DType::kFP32, {N, H, K, V}))->view;
    if (!c.A_log.empty()) a.A_log = (A_log = dev(c.A_log, DType::kFP32, {H}))->view;
    if (!c.dt_bias.empty()) a.dt_bias = (dt_bias = dev(c.dt_bias, DType::kFP32, {H * K}))->view;
    if (!c.cu.empty()) a.cu_seqlens = TensorView::contiguous(c.cu.data(), DType::kInt64, {int64_t(c.cu.size())});
    counted = bool(kda_chunk_count(a, c.opts, &nt));
    rG = poisoned(size_t(B * T * H * K), DType::kFP32, {B, T, H, K});
    rAqk = poisoned(size_t(B * T * H * 64), rdt, {B, T, H, 64}), rAkk = poisoned(size_t(B * T * H * 64), rdt, {B, T, H, 64});
    a.residuals.G = rG->view, a.residuals.Aqk = rAqk->view, a.residuals.Akk = rAkk->view;
    if (!remat) a.residuals.h = (rh = poisoned(size_t(nt * H * K * V), rdt, {nt, H, K, V}))->view;
  }
  Status run(const KdaCase& c) {
    DeviceBuffer ws(std::max<size_t>(workspace_bytes(a, c.opts), 16));
    const Status st = encore::run(a, c.opts, ws.ptr);
    if (st) cudaDeviceSynchronize();
    return st;
  }
};

}  // namespace encore::test
