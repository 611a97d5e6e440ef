// `encore check` rows for the gemm family: one row per catalogue entry (encore/gemm_epilogues.def)
// and dtype, its operands built from the row's flags (gemm/testing.hpp). With a GPU: every output
// of the CUDA run against the CPU backend (D and aux within the dtype tolerance, fp32 statistics
// within 2e-5). Without one: the CPU run writes every output with finite values (no poison left),
// and row_scale's D equals a direct double GEMM times the row scale.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "check.hpp"
#include "device_copy.hpp"
#include "encore/gemm.hpp"
#include "gemm/testing.hpp"
#include "testing/compare.hpp"

namespace encore::app {
namespace {

using test::HostTensor;
constexpr test::Tolerance kStatTol{2e-5, 2e-5, 2e-5};

bool all_finite(const HostTensor& t) {
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t c = 0; c < t.cols; ++c)
      if (!std::isfinite(t.get(r, c))) return false;
  return true;
}

// d = r ⊙ (a·wᵀ) against a direct double GEMM: the relative RMS error.
double row_scale_error(gemm::GemmCase& gc) {
  double num = 0, den = 0;
  const HostTensor &a = *gc.a, &w = *gc.w, &d = *gc.d, &r = *gc.row_scale;
  for (int64_t m = 0; m < a.rows; ++m)
    for (int64_t n = 0; n < w.rows; ++n) {
      double s = 0;
      for (int64_t k = 0; k < a.cols; ++k) s += a.get(m, k) * w.get(n, k);
      const double ref = s * r.get(0, m);
      num += (d.get(m, n) - ref) * (d.get(m, n) - ref);
      den += ref * ref;
    }
  return std::sqrt(num / std::max(den, 1e-300));
}

CheckRow gemm_row(bool gpu, Epilogue e, DType t, int64_t M, int64_t N, int64_t K, std::mt19937_64& rng) {
  CheckRow row{std::string("gemm_") + epilogue_name(e), std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K),
               dtype_name(t), gpu ? "gpu vs cpu" : "cpu"};
  gemm::GemmCase gc = gemm::make_gemm_case(e, t, M, N, K, 0, {}, rng);
  gemm::GemmCase cpu = gc;  // the CPU run writes into its own copy
  Status st = run(cpu.host_args(), cpu.opts);
  if (st && gpu) {
    std::vector<std::unique_ptr<DeviceCopy>> dev;
    GemmEpilogueArgs g;
    const std::vector<gemm::GemmCase::Field> fields = gc.fields();
    for (const gemm::GemmCase::Field& f : fields) {
      dev.push_back(std::make_unique<DeviceCopy>(f.tensor->bytes.data(), f.tensor->storage_bytes()));
      g.*f.arg = f.tensor->view(dev.back()->get(), kGpu);
    }
    st = run(g, gc.opts);
    const std::vector<gemm::GemmCase::Field> want = cpu.fields();
    row.pass = bool(st);
    for (size_t i = 0; st && i < fields.size(); ++i) {
      if (!fields[i].output) continue;
      HostTensor got = *fields[i].tensor;
      st = dev[i]->download(got.bytes.data());
      if (!st) break;
      const bool stat = got.dtype != t;
      const test::Tolerance tol = stat ? kStatTol : test::tolerance_for(t);
      const auto cmp = test::compare(got, *want[i].tensor, tol);
      row.error = std::max(row.error, cmp.rel_rms);
      if (!test::compare_ok(cmp, tol)) {
        row.pass = false;
        row.note = std::string(fields[i].name) + ": " + cmp.first_bad;
      }
    }
  } else if (st) {
    row.pass = true;
    for (const gemm::GemmCase::Field& f : cpu.fields())
      if (f.output && !all_finite(*f.tensor)) {
        row.pass = false;
        row.note = "an output is not finite or not written";
      }
    if (e == Epilogue::kRowScale) {
      row.error = row_scale_error(cpu);
      row.pass = row.pass && std::isfinite(row.error) && row.error <= test::tolerance_for(t).rel_rms;
    }
    if (row.pass) row.note = e == Epilogue::kRowScale ? "d vs direct GEMM" : "outputs written, finite";
  }
  if (!st) {
    row.pass = false;
    row.note = st.to_string();
  }
  return row;
}

}  // namespace

std::vector<CheckRow> check_gemm(bool gpu, std::mt19937_64& rng) {
  std::vector<CheckRow> rows;
  for (int i = 0; i < gemm_epilogue_count(); ++i)
    for (DType t : {DType::kBF16, DType::kFP16}) rows.push_back(gemm_row(gpu, Epilogue(i), t, 77, 256, 72, rng));
  return rows;
}

}  // namespace encore::app
