// `encore check` rows for the kda family (the KDA forward). With a GPU: the CUDA result against
// the CPU backend (o and the final state within 5e-3 relative RMS). Without one: the CPU forward
// over a sequence equals two halves chained through the final state.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "check.hpp"
#include "device_copy.hpp"
#include "encore/kda.hpp"
#include "testing/compare.hpp"

namespace encore::app {
namespace {

using test::HostTensor;

// KDA forward (precomputed gates, keys without the L2 norm but small) of one [1, T, H, 64] problem.
struct KdaData {
  int64_t T, H, D = 64;
  HostTensor q, k, v, g, beta;
  KdaData(int64_t t, int64_t h, DType dt, std::mt19937_64& rng)
      : T(t), H(h), q(dt, T * H, D), k(dt, T * H, D), v(dt, T * H, D), g(DType::kFP32, T * H, D), beta(dt, T * H, 1) {
    q.fill_normal(rng);
    k.fill_normal(rng, 0.0, 0.1);  // β|k|² < 1: the contractive regime (see tests/kda/test_kda_gpu.cpp)
    v.fill_normal(rng);
    g.fill_uniform(rng, -0.2, 0.0);
    beta.fill_uniform(rng, 0.1, 0.9);
  }
};

// One forward over tokens [t0, t0 + T) (host arrays, or their device copies in `dev`); the CUDA
// workspace is sized by workspace_bytes.
Status kda_run(const KdaData& x, const std::vector<void*>& dev, void* o, void* fin, const void* h0, int64_t t0, int64_t T) {
  const bool on_gpu = !dev.empty();
  const Device where = on_gpu ? kGpu : Device{};
  const int64_t H = x.H, D = x.D;
  auto at = [&](const HostTensor& h, int i, int64_t width) {
    char* base = on_gpu ? static_cast<char*>(dev[size_t(i)]) : reinterpret_cast<char*>(const_cast<unsigned char*>(h.bytes.data()));
    return base + size_t(t0 * H * width) * dtype_size(h.dtype);
  };
  KdaForwardArgs a;
  a.q = TensorView::contiguous(at(x.q, 0, D), x.q.dtype, {1, T, H, D}, where);
  a.k = TensorView::contiguous(at(x.k, 1, D), x.k.dtype, {1, T, H, D}, where);
  a.v = TensorView::contiguous(at(x.v, 2, D), x.v.dtype, {1, T, H, D}, where);
  a.g = TensorView::contiguous(at(x.g, 3, D), DType::kFP32, {1, T, H, D}, where);
  a.beta = TensorView::contiguous(at(x.beta, 4, 1), x.beta.dtype, {1, T, H}, where);
  a.o = TensorView::contiguous(o, DType::kFP32, {1, T, H, D}, where);
  a.final_state = TensorView::contiguous(fin, DType::kFP32, {1, H, D, D}, where);
  if (h0) a.initial_state = TensorView::contiguous(const_cast<void*>(h0), DType::kFP32, {1, H, D, D}, where);
  KdaOptions opts;
  opts.output_final_state = true;
  if (!on_gpu) return run(a, opts);
  DeviceCopy ws(nullptr, std::max<size_t>(workspace_bytes(a, opts), 16));
  return run(a, opts, ws.get());
}

CheckRow kda_row(bool gpu, DType t, int64_t T, int64_t H, std::mt19937_64& rng) {
  CheckRow row{"kda_forward", std::to_string(T) + "x" + std::to_string(H) + "x64", dtype_name(t), gpu ? "gpu vs cpu" : "cpu"};
  KdaData x(T, H, t, rng);
  const size_t on = size_t(T * H * 64), fn = size_t(H * 64 * 64);
  std::vector<float> o(on, NAN), fin(fn, NAN);
  Status st = kda_run(x, {}, o.data(), fin.data(), nullptr, 0, T);
  double err = 0;
  auto rel = [](const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
      den += double(b[i]) * b[i];
    }
    return std::isfinite(num) ? std::sqrt(num / std::max(den, 1e-300)) : INFINITY;
  };
  if (st && gpu) {
    DeviceCopy dq(x.q.bytes.data(), x.q.storage_bytes()), dk(x.k.bytes.data(), x.k.storage_bytes()), dv(x.v.bytes.data(), x.v.storage_bytes()),
        dg(x.g.bytes.data(), x.g.storage_bytes()), db(x.beta.bytes.data(), x.beta.storage_bytes()), dout(o.data(), on * 4),
        dfin(fin.data(), fn * 4);
    std::vector<float> og(on, NAN), fg(fn, NAN);
    st = kda_run(x, {dq.get(), dk.get(), dv.get(), dg.get(), db.get()}, dout.get(), dfin.get(), nullptr, 0, T);
    if (st) st = dout.download(og.data());
    if (st) st = dfin.download(fg.data());
    err = std::max(rel(og, o), rel(fg, fin));
    row.note = "rel-RMS of o and the final state";
  } else if (st) {
    // Two halves chained through the state equal the whole sequence.
    const int64_t half = T / 2;
    std::vector<float> o2(on, NAN), f1(fn, NAN), f2(fn, NAN);
    st = kda_run(x, {}, o2.data(), f1.data(), nullptr, 0, half);
    if (st) st = kda_run(x, {}, o2.data() + size_t(half * H * 64), f2.data(), f1.data(), half, T - half);
    err = std::max(rel(o2, o), rel(f2, fin));
    row.note = "two chained halves vs whole";
  }
  row.error = err;
  row.pass = st.is_ok() && err <= (gpu ? 5e-3 : 1e-5);
  if (!st) row.note = st.to_string();
  return row;
}

}  // namespace

std::vector<CheckRow> check_kda(bool gpu, std::mt19937_64& rng) {
  std::vector<CheckRow> rows;
  for (DType t : {DType::kFP32, DType::kBF16}) rows.push_back(kda_row(gpu, t, 150, 2, rng));
  return rows;
}

}  // namespace encore::app
