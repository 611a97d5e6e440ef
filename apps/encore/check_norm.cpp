// `encore check` rows for the norm family: rms_norm / add_rms_norm and qk_norm. With a GPU: the
// CUDA result against the CPU backend within the dtype tolerance (add_rms_norm: y and h; qk_norm:
// V heads and padding untouched). Without one: properties of the CPU result (unit-weight rows and
// heads have RMS 1, h = x + residual, V heads untouched).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "check.hpp"
#include "device_copy.hpp"
#include "encore/norm.hpp"
#include "testing/compare.hpp"

namespace encore::app {
namespace {

using test::HostTensor;

using Row = CheckRow;

struct NormShape {
  int64_t rows, hidden;
};

// Runs one norm op on `dev` (cpu or cuda:0) with its inputs copied there; outputs copied back.
Status run_norm_on(bool add, bool on_gpu, const HostTensor& x, const HostTensor& r, const HostTensor& w,
                   HostTensor& y, HostTensor& h, const RmsNormOptions& o) {
  if (!on_gpu) {
    if (add) return run(AddRmsNormArgs{x.view(), r.view(), w.view(), y.view(), h.view()}, o);
    return run(RmsNormArgs{x.view(), w.view(), y.view()}, o);
  }
  DeviceCopy dx(x.bytes.data(), x.storage_bytes()), dr(r.bytes.data(), r.storage_bytes()), dw(w.bytes.data(), w.storage_bytes()),
      dy(y.bytes.data(), y.storage_bytes()), dh(h.bytes.data(), h.storage_bytes());
  if (!dx.get() || !dr.get() || !dw.get() || !dy.get() || !dh.get()) return Status::cuda_error("device copies failed (no CUDA device?)");
  const Device d{DeviceType::kCUDA, 0};
  Status st = add ? run(AddRmsNormArgs{x.view(dx.get(), d), r.view(dr.get(), d), w.view(dw.get(), d), y.view(dy.get(), d),
                                       h.view(dh.get(), d)}, o)
                  : run(RmsNormArgs{x.view(dx.get(), d), w.view(dw.get(), d), y.view(dy.get(), d)}, o);
  if (st) st = dy.download(y.bytes.data());
  if (st) st = dh.download(h.bytes.data());
  return st;
}

// Without a GPU: with unit weight every output row has RMS 1 (eps = 0), and h = x + residual.
Row check_norm_cpu_properties(bool add, DType t, NormShape s, std::mt19937_64& rng) {
  Row row{add ? "add_rms_norm" : "rms_norm", std::to_string(s.rows) + "x" + std::to_string(s.hidden), dtype_name(t), "cpu"};
  HostTensor x(t, s.rows, s.hidden), r(t, s.rows, s.hidden), w = HostTensor::vector(t, s.hidden), y(t, s.rows, s.hidden),
      h(t, s.rows, s.hidden);
  x.fill_normal(rng, 0.5, 2.0);
  r.fill_normal(rng);
  w.fill_uniform(rng, 1.0, 1.0);
  y.poison();
  h.poison();
  Status st = run_norm_on(add, false, x, r, w, y, h, RmsNormOptions{0.f, 0.f});
  if (!st) {
    row.note = st.to_string();
    return row;
  }
  double worst = 0;
  for (int64_t i = 0; i < s.rows; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < s.hidden; ++j) ss += y.get(i, j) * y.get(i, j);
    double rms = std::sqrt(ss / double(s.hidden));
    worst = std::isfinite(rms) ? std::max(worst, std::fabs(rms - 1.0)) : INFINITY;
    if (add) {
      for (int64_t j = 0; j < s.hidden; ++j) {
        double want = x.get(i, j) + r.get(i, j);
        if (!(std::fabs(h.get(i, j) - want) <= 1e-2 * std::fabs(want) + 1e-6)) worst = INFINITY;
      }
    }
  }
  row.error = worst;
  row.pass = worst <= test::tolerance_for(t).rel_rms;
  row.note = "row RMS of y vs 1";
  return row;
}

Row check_norm_gpu(bool add, DType t, NormShape s, std::mt19937_64& rng) {
  Row row{add ? "add_rms_norm" : "rms_norm", std::to_string(s.rows) + "x" + std::to_string(s.hidden), dtype_name(t), "gpu vs cpu"};
  HostTensor x(t, s.rows, s.hidden), r(t, s.rows, s.hidden), w = HostTensor::vector(t, s.hidden), y(t, s.rows, s.hidden),
      h(t, s.rows, s.hidden);
  x.fill_normal(rng, 0.5, 2.0);
  r.fill_normal(rng);
  w.fill_normal(rng, 1.0, 0.5);
  y.poison();
  h.poison();
  const RmsNormOptions o{1e-6f, 0.f};
  HostTensor y_gpu = y, h_gpu = h, y_cpu = y, h_cpu = h;
  Status st = run_norm_on(add, true, x, r, w, y_gpu, h_gpu, o);
  if (st) st = run_norm_on(add, false, x, r, w, y_cpu, h_cpu, o);
  if (!st) {
    row.note = st.to_string();
    return row;
  }
  auto tol = test::tolerance_for(t);
  auto cy = test::compare(y_gpu, y_cpu, tol);
  row.error = cy.rel_rms;
  row.pass = test::compare_ok(cy, tol);
  if (add) {
    auto ch = test::compare(h_gpu, h_cpu, tol);
    row.pass = row.pass && test::compare_ok(ch, tol);
    row.error = std::max(row.error, ch.rel_rms);
  }
  if (!row.pass) row.note = cy.first_bad;
  return row;
}

CheckRow qk_norm_row(bool gpu, DType t, int64_t tokens, int hq, int hkv, int d, std::mt19937_64& rng) {
  CheckRow row{"qk_norm", std::to_string(tokens) + "x" + std::to_string(hq) + "+" + std::to_string(hkv) + "x" + std::to_string(d),
               dtype_name(t), gpu ? "gpu vs cpu" : "cpu"};
  const int64_t width = int64_t(hq + 2 * hkv) * d;
  HostTensor qkv(t, tokens, width, width + 8), wq = HostTensor::vector(t, d), wk = HostTensor::vector(t, d);
  qkv.fill_normal(rng, 0.3, 2.0);
  wq.fill_normal(rng, 1.0, 0.3);
  wk.fill_normal(rng, 1.0, 0.3);
  if (!gpu) {
    wq.fill_uniform(rng, 1.0, 1.0);
    wk.fill_uniform(rng, 1.0, 1.0);
  }
  const QkNormOptions o{hq, hkv, d, 0.f, 0.f};
  HostTensor cpu = qkv;
  Status st = run(QkNormArgs{cpu.view(), wq.view(), wk.view()}, o);
  if (st && gpu) {
    DeviceCopy dq(qkv.bytes.data(), qkv.storage_bytes()), dwq(wq.bytes.data(), wq.storage_bytes()), dwk(wk.bytes.data(), wk.storage_bytes());
    HostTensor out = qkv;
    st = run(QkNormArgs{qkv.view(dq.get(), kGpu), wq.view(dwq.get(), kGpu), wk.view(dwk.get(), kGpu)}, o);
    if (st) st = dq.download(out.bytes.data());
    if (st) {
      const auto tol = test::tolerance_for(t);
      const auto c = test::compare(out, cpu, tol);
      row.error = c.rel_rms;
      row.pass = test::compare_ok(c, tol);
      // V heads and padding must be untouched.
      const size_t esz = dtype_size(t);
      for (int64_t tok = 0; tok < tokens && row.pass; ++tok) {
        const size_t v0 = size_t(tok * qkv.row_stride + int64_t(hq + hkv) * d) * esz;
        const size_t v1 = size_t(std::min(qkv.storage_elems(), (tok + 1) * qkv.row_stride)) * esz;
        row.pass = std::memcmp(out.bytes.data() + v0, qkv.bytes.data() + v0, v1 - v0) == 0;
        if (!row.pass) row.note = "V heads or padding changed";
      }
      if (!c.first_bad.empty()) row.note = c.first_bad;
    }
  } else if (st) {
    double worst = 0;
    for (int64_t tok = 0; tok < tokens; ++tok)
      for (int j = 0; j < hq + hkv; ++j) {
        double ss = 0;
        for (int e = 0; e < d; ++e) ss += cpu.get(tok, j * d + e) * cpu.get(tok, j * d + e);
        const double rms = std::sqrt(ss / d);
        worst = std::isfinite(rms) ? std::max(worst, std::fabs(rms - 1.0)) : INFINITY;
      }
    const bool v_same = std::memcmp(cpu.bytes.data() + size_t((hq + hkv) * d) * dtype_size(t),
                                    qkv.bytes.data() + size_t((hq + hkv) * d) * dtype_size(t), size_t(hkv * d) * dtype_size(t)) == 0;
    row.error = worst;
    row.pass = v_same && worst <= test::tolerance_for(t).rel_rms;
    row.note = v_same ? "head RMS vs 1" : "V heads changed";
  }
  if (!st) row.note = st.to_string();
  return row;
}

}  // namespace

std::vector<CheckRow> check_norm(bool gpu, std::mt19937_64& rng) {
  const NormShape shapes[] = {{1, 64}, {7, 1000}, {64, 4096}, {300, 4104}, {3, 40000}};
  std::vector<Row> rows;
  for (bool add : {false, true})
    for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32})
      for (NormShape s : shapes) rows.push_back(gpu ? check_norm_gpu(add, t, s, rng) : check_norm_cpu_properties(add, t, s, rng));
  for (DType t : {DType::kBF16, DType::kFP16}) {
    rows.push_back(qk_norm_row(gpu, t, 1, 32, 8, 128, rng));
    rows.push_back(qk_norm_row(gpu, t, 77, 4, 2, 64, rng));
    rows.push_back(qk_norm_row(gpu, t, 300, 3, 1, 256, rng));
  }
  return rows;
}

}  // namespace encore::app
