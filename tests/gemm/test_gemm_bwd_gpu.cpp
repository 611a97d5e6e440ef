// CUDA backward GEMM-epilogue kernels (swiglu_bwd, rmsnorm_bwd) and the partials sums, against the
// fp64 staged block backward (src/blocks/reference/llama_block_bwd) on the same rounded inputs,
// with docs/math/gemm_epilogues.md §9's rule per output:
//   max|gpu − fp64| <= 2·max|unfused − fp64| + 1e-6·max|fp64|,
// where "unfused" is the same computation as a bf16/fp16 GEMM (fp32 accumulate, rounded output)
// followed by the glue on the rounded GEMM output, each result rounded to the dtype. Fresh random
// inputs each run, odd M, N multiples of 8 but not of the tile, padded rows, outputs poisoned (NaN),
// on each CUDA tile of the row (swiglu_bwd: partial_tile_n 128 / 256).
// Failures print each output's max and RMS error, where the max is, and the bound.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "blocks/reference/llama_block_bwd.hpp"
#include "encore/gemm.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {
namespace {

using reference::Mat;

class GemmBwdGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

Mat to_mat(const HostTensor& h) {
  Mat m(size_t(h.rows * h.cols));
  for (int64_t i = 0; i < h.rows; ++i)
    for (int64_t j = 0; j < h.cols; ++j) m[size_t(i * h.cols + j)] = h.get(i, j);
  return m;
}
// v rounded to dtype t (the unfused computation's stored intermediates and outputs).
double round_to(DType t, double v) {
  HostTensor h(t, 1, 1);
  h.set(0, 0, v);
  return h.get(0, 0);
}
Mat rounded(DType t, Mat v) {
  for (double& x : v) x = round_to(t, x);
  return v;
}

// A host tensor mirrored on the device (inputs copied up; outputs poisoned on both sides).
struct Dev {
  HostTensor host;
  std::unique_ptr<DeviceBuffer> buf;
  TensorView view;
  explicit Dev(HostTensor h, bool output = false) : host(std::move(h)) {
    if (output) host.poison();
    buf = std::make_unique<DeviceBuffer>(host.storage_bytes());
    view = to_device(host, *buf);
  }
  HostTensor fetch() const {
    HostTensor out = host;
    from_device(out, *buf);
    return out;
  }
};

// The §9 rule on the first `cols` columns of got; prints the errors.
void expect_rule(const char* name, const HostTensor& got, const Mat& hi, const Mat& lo, int64_t cols = -1) {
  if (cols < 0) cols = got.cols;
  double e_max = 0, e_sq = 0, lo_max = 0, scale = 0;
  int64_t at_m = -1, at_n = -1, bad = 0;
  for (int64_t m = 0; m < got.rows; ++m)
    for (int64_t n = 0; n < cols; ++n) {
      const size_t i = size_t(m * cols + n);
      const double g = got.get(m, n), e = std::isfinite(g) ? std::abs(g - hi[i]) : INFINITY;
      if (!std::isfinite(g)) ++bad;
      if (e > e_max || at_m < 0) {
        e_max = e;
        at_m = m;
        at_n = n;
      }
      e_sq += std::isfinite(e) ? e * e : 0;
      lo_max = std::max(lo_max, std::abs(lo[i] - hi[i]));
      scale = std::max(scale, std::abs(hi[i]));
    }
  const double bound = 2 * lo_max + 1e-6 * scale;
  std::ostringstream s;
  s << name << ": max|gpu - fp64| = " << e_max << " at (" << at_m << ", " << at_n << ") gpu " << got.get(at_m, at_n) << " fp64 "
    << hi[size_t(at_m * cols + at_n)] << "; rms " << std::sqrt(e_sq / double(got.rows * cols)) << "; unfused max " << lo_max << "; bound "
    << bound << "; max|fp64| " << scale << "; non-finite " << bad;
  EXPECT_TRUE(bad == 0 && e_max <= bound) << s.str();
}

struct Shape {
  int64_t M, N, K, pad;
};
// Odd M (one row; a tail of 77; three tiles and a tail), N multiples of 8 but not of 128.
const Shape kShapes[] = {{1, 136, 72, 0}, {77, 264, 1000, 8}, {301, 520, 256, 16}};

// swiglu_bwd: A = dx [M, d = K], W = w_down [d, F = N], C = Z [M, 2F]; y, dZ, zdz partials; then zdz.
void swiglu_bwd_case(DType t, const Shape& s, int tn) {
  const int64_t M = s.M, F = s.N, d = s.K;
  SCOPED_TRACE(std::string("swiglu_bwd ") + dtype_name(t) + " M" + std::to_string(M) + " F" + std::to_string(F) + " d" + std::to_string(d) +
               " partial_tile_n " + std::to_string(tn));
  auto rng = make_rng(uint64_t(M * 7 + F + d));
  HostTensor dx(t, M, d, d + s.pad), w2(t, d, F, F + s.pad), z(t, M, 2 * F, 2 * F + s.pad);
  dx.fill_normal(rng);
  w2.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(d)));
  z.fill_normal(rng, 0.0, 2.0);
  const int64_t tiles = (F + tn - 1) / tn;
  Dev a(dx), w(w2), c(z), y(HostTensor(t, M, F, F + s.pad), true), dz(HostTensor(t, M, 2 * F, 2 * F + s.pad), true),
      parts(HostTensor(DType::kFP32, M, tiles, tiles + 3), true), zdz(HostTensor::vector(DType::kFP32, M), true);
  GemmEpilogueArgs g;
  g.a = a.view;
  g.w = w.view;
  g.c = c.view;
  g.d = y.view;
  g.aux = dz.view;
  g.partials = parts.view;
  Status st = run(g, GemmEpilogueOptions{Epilogue::kSwigluBwd, tn});
  ASSERT_TRUE(st) << st.to_string();
  st = run(PartialsSumArgs{parts.view, zdz.view}, PartialsSum::kPerRow, float(1.0 / double(d)));
  ASSERT_TRUE(st) << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());

  const Mat Z = to_mat(z);
  const reference::SwigluDgrad hi = reference::swiglu_dgrad(to_mat(dx), M, d, to_mat(w2), F, Z, 1.0 / double(d), tn);
  // Unfused: dy stored in the dtype, the glue on it, each output rounded.
  Mat dy_lo = rounded(t, hi.dy), y_lo(size_t(M * F)), dz_lo(size_t(M * 2 * F)), p_lo(size_t(M * tiles), 0.0), zdz_lo(size_t(M), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < F; ++j) {
      const double gg = Z[size_t(m * 2 * F + 2 * j)], u = Z[size_t(m * 2 * F + 2 * j + 1)], dyv = dy_lo[size_t(m * F + j)];
      const double sg = 1.0 / (1.0 + std::exp(-gg));
      const double dg = round_to(t, dyv * u * sg * (1 + gg * (1 - sg))), du = round_to(t, dyv * gg * sg);
      y_lo[size_t(m * F + j)] = round_to(t, gg * sg * u);
      dz_lo[size_t(m * 2 * F + 2 * j)] = dg;
      dz_lo[size_t(m * 2 * F + 2 * j + 1)] = du;
      p_lo[size_t(m * tiles + j / tn)] += gg * dg + u * du;
      zdz_lo[size_t(m)] += (gg * dg + u * du) / double(d);
    }
  Mat p_hi = hi.zdz_partials;
  for (double& v : p_hi) v *= double(d);  // the kernel's partials are unscaled
  expect_rule("y", y.fetch(), hi.y, y_lo);
  expect_rule("dZ", dz.fetch(), hi.dz, dz_lo);
  expect_rule("zdz partials", parts.fetch(), p_hi, p_lo);
  expect_rule("zdz", zdz.fetch(), hi.zdz, zdz_lo);
}

// rmsnorm_bwd: A = dz [M, N_fwd = K], W [N_fwd, d = N], C = x, C2 = the residual gradient, γ, r,
// zdz, α; dx, aux = x̂⊙γ, dγ partials per 128 rows; then dγ.
void rmsnorm_bwd_case(DType t, const Shape& s, bool with_c2_alpha, int tn) {
  const int64_t M = s.M, d = s.N, Nf = s.K;
  SCOPED_TRACE(std::string("rmsnorm_bwd ") + dtype_name(t) + " M" + std::to_string(M) + " d" + std::to_string(d) + " N_fwd" + std::to_string(Nf) +
               (with_c2_alpha ? " alpha + c2" : " no alpha, no c2") + " partial_tile_n " + std::to_string(tn));
  auto rng = make_rng(uint64_t(M * 5 + d + Nf * 3) + (with_c2_alpha ? 1 : 0));
  HostTensor dzt(t, M, Nf, Nf + s.pad), w3(t, Nf, d, d + s.pad), x(t, M, d, d + s.pad), prev(t, M, d, d + s.pad), gamma = HostTensor::vector(t, d);
  HostTensor r = HostTensor::vector(DType::kFP32, M), zdzv = HostTensor::vector(DType::kFP32, M), alpha = HostTensor::vector(DType::kFP32, 1);
  dzt.fill_normal(rng);
  w3.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(Nf)));
  x.fill_normal(rng);
  prev.fill_normal(rng);
  gamma.fill_normal(rng, 1.0, 0.3);
  r.fill_uniform(rng, 0.5, 2.0);
  zdzv.fill_normal(rng, 0.0, 0.5);
  const double al = with_c2_alpha ? 0.375 : 1.0;
  alpha.set(0, 0, al);
  const int64_t ptiles = gemm_column_partials_rows(M), pcols = (d + tn - 1) / tn * tn;
  Dev a(dzt), w(w3), c(x), c2(prev), gm(gamma), rr(r), zz(zdzv), aa(alpha), dx(HostTensor(t, M, d, d + s.pad), true),
      aux(HostTensor(t, M, d, d + s.pad), true), parts(HostTensor(DType::kFP32, ptiles, pcols), true), dgamma(HostTensor::vector(DType::kFP32, d), true);
  GemmEpilogueArgs g;
  g.a = a.view;
  g.w = w.view;
  g.c = c.view;
  g.gamma = gm.view;
  g.row_scale = rr.view;
  g.zdz = zz.view;
  g.d = dx.view;
  g.aux = aux.view;
  g.partials = parts.view;
  if (with_c2_alpha) {
    g.c2 = c2.view;
    g.alpha = aa.view;
  }
  Status st = run(g, GemmEpilogueOptions{Epilogue::kRmsnormBwd, tn});
  ASSERT_TRUE(st) << st.to_string();
  st = run(PartialsSumArgs{parts.view, dgamma.view}, PartialsSum::kPerColumn);
  ASSERT_TRUE(st) << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());

  const Mat X = to_mat(x), R = to_mat(r), G = to_mat(gamma), ZD = to_mat(zdzv), P = with_c2_alpha ? to_mat(prev) : Mat{};
  const reference::RmsNormDgrad hi = reference::rmsnorm_dgrad(to_mat(dzt), M, Nf, to_mat(w3), d, al, X, R, G, ZD, P, 128);
  // Unfused: da = α·(dz·w) stored in the dtype, the norm's glue on it.
  Mat da_lo = rounded(t, hi.da), dx_lo(size_t(M * d)), aux_lo(size_t(M * d)), p_lo(size_t(ptiles * pcols), 0.0), dg_lo(size_t(d), 0.0);
  Mat p_hi(size_t(ptiles * pcols), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < d; ++n) {
      const size_t i = size_t(m * d + n);
      const double xh = R[size_t(m)] * X[i];
      dx_lo[i] = round_to(t, (P.empty() ? 0.0 : P[i]) + R[size_t(m)] * (G[size_t(n)] * da_lo[i] - xh * ZD[size_t(m)]));
      aux_lo[i] = round_to(t, xh * G[size_t(n)]);
      p_lo[size_t((m / 128) * pcols + n)] += da_lo[i] * xh;
      p_hi[size_t((m / 128) * pcols + n)] = hi.dgamma_partials[size_t((m / 128) * d + n)];
      dg_lo[size_t(n)] += da_lo[i] * xh;
    }
  expect_rule("dx", dx.fetch(), hi.dx, dx_lo);
  expect_rule("aux", aux.fetch(), hi.aux, aux_lo);
  expect_rule("dgamma partials", parts.fetch(), p_hi, p_lo);  // columns >= d: 0 on every side
  expect_rule("dgamma", dgamma.fetch(), hi.dgamma, dg_lo);
}

// swiglu_bwd's partial_tile_n 128: the ping-pong 128x128 kernel; 256: the cooperative 128x256 one.
TEST_F(GemmBwdGpu, SwigluBwd) {
  for (int tn : {128, 256})
    for (DType t : {DType::kBF16, DType::kFP16})
      for (const Shape& s : kShapes) swiglu_bwd_case(t, s, tn);
}

// rmsnorm_bwd's partial_tile_n 128: the ping-pong 128x128 kernel; 256: the cooperative 128x256 one.
TEST_F(GemmBwdGpu, RmsnormBwd) {
  for (int tn : {128, 256})
    for (DType t : {DType::kBF16, DType::kFP16})
      for (const Shape& s : kShapes)
        for (bool full : {true, false}) rmsnorm_bwd_case(t, s, full, tn);
}

// Shapes the kernels refuse on CUDA, with the reason.
TEST_F(GemmBwdGpu, RefusesUnalignedN) {
  HostTensor a(DType::kBF16, 3, 16), w(DType::kBF16, 16, 12), z(DType::kBF16, 3, 24), y(DType::kBF16, 3, 12), dz(DType::kBF16, 3, 24),
      parts(DType::kFP32, 3, 1);
  Dev da(a), dw(w), dc(z), dd(y, true), dx(dz, true), dp(parts, true);
  GemmEpilogueArgs g;
  g.a = da.view;
  g.w = dw.view;
  g.c = dc.view;
  g.d = dd.view;
  g.aux = dx.view;
  g.partials = dp.view;
  Status st = run(g, GemmEpilogueOptions{Epilogue::kSwigluBwd, 128});
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("N = 12 must be a multiple of 8 on CUDA"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace encore::test
