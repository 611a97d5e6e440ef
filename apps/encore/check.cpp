#include "check.hpp"
#include "device_copy.hpp"

#include <cstdio>
#include <string>
#include <vector>

#include "encore/core/device_info.hpp"
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

}  // namespace

int run_check(bool force_cpu) {
  const bool gpu = !force_cpu && cuda_device_count() > 0;
  if (gpu) {
    const DeviceInfo* info = nullptr;
    if (get_device_info(0, &info)) std::printf("encore check: GPU %s (%d SMs) against the CPU backend\n", info->name.c_str(), info->sm_count);
  } else {
    std::printf("encore check: no CUDA device: CPU backend only (property checks; nothing to compare against)\n");
  }
  std::mt19937_64 rng(std::random_device{}());
  const NormShape shapes[] = {{1, 64}, {7, 1000}, {64, 4096}, {300, 4104}, {3, 40000}};
  std::vector<Row> rows;
  for (bool add : {false, true})
    for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32})
      for (NormShape s : shapes) rows.push_back(gpu ? check_norm_gpu(add, t, s, rng) : check_norm_cpu_properties(add, t, s, rng));
  for (auto& r : check_qk_norm(gpu, rng)) rows.push_back(r);
  for (auto& r : check_fp8_group_quant(gpu, rng)) rows.push_back(r);
  for (auto& r : check_gemm_kda(gpu, rng)) rows.push_back(r);

  std::printf("%-16s %-12s %-6s %-11s %-10s %s\n", "op", "shape", "dtype", "mode", "error", "result");
  int failed = 0;
  for (const Row& r : rows) {
    failed += !r.pass;
    std::printf("%-16s %-12s %-6s %-11s %-10.3g %s%s%s\n", r.op.c_str(), r.shape.c_str(), r.dtype.c_str(), r.mode.c_str(),
                r.error, r.pass ? "PASS" : "FAIL", r.note.empty() ? "" : "  ", r.note.c_str());
  }
  std::printf("check: %zu passed, %d failed\n", rows.size() - size_t(failed), failed);
  return failed ? 1 : 0;
}

}  // namespace encore::app
