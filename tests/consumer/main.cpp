// encore_consumer: one op through the installed library. RMSNorm of a small fp32 host array on the
// CPU backend, compared with the formula computed here; exit code 0 only when it matches.
#include <cmath>
#include <cstdio>
#include <vector>

#include "encore/encore.hpp"

int main() {
  constexpr int kRows = 3, kHidden = 37;  // odd hidden: no vector-width assumption
  std::vector<float> x(kRows * kHidden), w(kHidden), y(kRows * kHidden, 0.0f);
  for (int i = 0; i < kRows * kHidden; ++i) x[i] = std::sin(0.37f * i) * 2.0f;
  for (int j = 0; j < kHidden; ++j) w[j] = 0.5f + 0.01f * j;

  encore::RmsNormArgs args;
  args.x = encore::TensorView::contiguous(x.data(), encore::DType::kFP32, {kRows, kHidden});
  args.weight = encore::TensorView::contiguous(w.data(), encore::DType::kFP32, {kHidden});
  args.y = encore::TensorView::contiguous(y.data(), encore::DType::kFP32, {kRows, kHidden});
  encore::RmsNormOptions opts;  // eps 1e-6

  encore::Status st = encore::validate(args, opts);
  if (st) st = encore::run(args, opts);  // CPU tensors: CPU backend, no workspace
  if (!st) {
    std::printf("encore_consumer: FAILED: %s\n", st.to_string().c_str());
    return 1;
  }

  double max_err = 0.0;
  for (int r = 0; r < kRows; ++r) {
    double ss = 0.0;
    for (int j = 0; j < kHidden; ++j) ss += double(x[r * kHidden + j]) * x[r * kHidden + j];
    const double inv = 1.0 / std::sqrt(ss / kHidden + opts.eps);
    for (int j = 0; j < kHidden; ++j) {
      const double want = x[r * kHidden + j] * inv * w[j];
      max_err = std::fmax(max_err, std::fabs(want - y[r * kHidden + j]));
    }
  }
  const bool ok = max_err < 1e-5;
  std::printf("encore_consumer: rms_norm [%d, %d] fp32 on the CPU backend (CUDA built in: %s): max |err| %.2e %s\n",
              kRows, kHidden, encore::built_with_cuda() ? "yes" : "no", max_err, ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}
