// `encore check` rows for the gemm family (the GEMM epilogues row_scale and lse). With a GPU: the
// CUDA result against the CPU backend (d within the dtype tolerance, the lse partials within
// 2e-5). Without one: the CPU result's d equals a direct double GEMM times the row scale.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "check.hpp"
#include "device_copy.hpp"
#include "encore/gemm.hpp"
#include "testing/compare.hpp"

namespace encore::app {
namespace {

using test::HostTensor;
constexpr test::Tolerance kStatTol{2e-5, 2e-5, 2e-5};

// Runs epilogue e over (a, w) on the CPU and, with a GPU, on CUDA; compares d and the partials.
CheckRow gemm_row(bool gpu, Epilogue e, DType t, int64_t M, int64_t N, int64_t K, std::mt19937_64& rng) {
  CheckRow row{std::string("gemm_") + epilogue_name(e), std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K),
               dtype_name(t), gpu ? "gpu vs cpu" : "cpu"};
  HostTensor a(t, M, K), w(t, N, K), d(t, M, N), r = HostTensor::vector(DType::kFP32, M);
  a.fill_normal(rng);
  w.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(K)));
  r.fill_uniform(rng, 0.5, 1.5);
  d.poison();
  const int64_t tiles = e == Epilogue::kLse ? (N + 127) / 128 : 0;
  HostTensor parts(DType::kFP32, M, std::max<int64_t>(tiles, 1));
  parts.poison();
  auto args = [&](HostTensor& dd, HostTensor& pp, const std::vector<void*>& dev) {
    const bool on_gpu = !dev.empty();
    const Device where = on_gpu ? kGpu : Device{};
    GemmEpilogueArgs g;
    g.a = a.view(on_gpu ? dev[0] : a.bytes.data(), where);
    g.w = w.view(on_gpu ? dev[1] : w.bytes.data(), where);
    g.d = dd.view(on_gpu ? dev[2] : dd.bytes.data(), where);
    g.row_scale = r.view(on_gpu ? dev[3] : r.bytes.data(), where);
    if (e == Epilogue::kLse) g.partials = pp.view(on_gpu ? dev[4] : pp.bytes.data(), where);
    return g;
  };
  GemmEpilogueOptions o{e};
  HostTensor d_cpu = d, p_cpu = parts;
  Status st = run(args(d_cpu, p_cpu, {}), o);
  if (st && gpu) {
    HostTensor d_gpu = d, p_gpu = parts;
    DeviceCopy da(a.bytes.data(), a.storage_bytes()), dw(w.bytes.data(), w.storage_bytes()), dd(d.bytes.data(), d.storage_bytes()),
        dr(r.bytes.data(), r.storage_bytes()), dp(parts.bytes.data(), parts.storage_bytes());
    st = run(args(d_gpu, p_gpu, {da.get(), dw.get(), dd.get(), dr.get(), dp.get()}), o);
    if (st) st = dd.download(d_gpu.bytes.data());
    if (st) st = dp.download(p_gpu.bytes.data());
    if (st) {
      const auto tol = test::tolerance_for(t);
      const auto cd = test::compare(d_gpu, d_cpu, tol);
      row.error = cd.rel_rms;
      row.pass = test::compare_ok(cd, tol);
      row.note = cd.first_bad;
      if (e == Epilogue::kLse) {
        const auto cp = test::compare(p_gpu, p_cpu, kStatTol);
        row.error = std::max(row.error, cp.rel_rms);
        row.pass = row.pass && test::compare_ok(cp, kStatTol);
        if (!cp.first_bad.empty()) row.note = "partials " + cp.first_bad;
      }
    }
  } else if (st) {
    // d = r ⊙ (a·wᵀ) against a direct double GEMM (the logits of lse are d as well).
    double num = 0, den = 0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += a.get(m, k) * w.get(n, k);
        const double ref = s * r.get(0, m);
        num += (d_cpu.get(m, n) - ref) * (d_cpu.get(m, n) - ref);
        den += ref * ref;
      }
    row.error = std::sqrt(num / std::max(den, 1e-300));
    row.pass = std::isfinite(row.error) && row.error <= test::tolerance_for(t).rel_rms;
    row.note = "d vs direct GEMM";
  }
  if (!st) row.note = st.to_string();
  return row;
}

}  // namespace

std::vector<CheckRow> check_gemm(bool gpu, std::mt19937_64& rng) {
  std::vector<CheckRow> rows;
  for (DType t : {DType::kBF16, DType::kFP16}) {
    rows.push_back(gemm_row(gpu, Epilogue::kRowScale, t, 77, 136, 72, rng));
    rows.push_back(gemm_row(gpu, Epilogue::kLse, t, 130, 520, 64, rng));
  }
  return rows;
}

}  // namespace encore::app
