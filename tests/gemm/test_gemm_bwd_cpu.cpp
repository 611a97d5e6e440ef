// Backward GEMM-epilogue rows on the CPU backend (swiglu_bwd, rmsnorm_bwd) and the partials sums:
// against the fp64 staged block backward (src/blocks/reference/llama_block_bwd), against finite
// differences of the forward they differentiate, the ZdZ identity, and bad inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "blocks/reference/llama_block_bwd.hpp"
#include "encore/gemm.hpp"
#include "gemm/problem.hpp"
#include "tests/common/compare.hpp"

namespace encore::test {
namespace {

using reference::Mat;

Mat to_mat(const HostTensor& h) {
  Mat m(size_t(h.rows * h.cols));
  for (int64_t i = 0; i < h.rows; ++i)
    for (int64_t j = 0; j < h.cols; ++j) m[size_t(i * h.cols + j)] = h.get(i, j);
  return m;
}
HostTensor random(DType t, int64_t r, int64_t c, std::mt19937_64& rng, double mean = 0.0, double sd = 1.0) {
  HostTensor h(t, r, c);
  h.fill_normal(rng, mean, sd);
  return h;
}
HostTensor poisoned(DType t, int64_t r, int64_t c) {
  HostTensor h(t, r, c);
  h.poison();
  return h;
}
HostTensor vec(DType t, const Mat& v) {
  HostTensor h = HostTensor::vector(t, int64_t(v.size()));
  for (size_t i = 0; i < v.size(); ++i) h.set(0, int64_t(i), v[i]);
  return h;
}
// max |got − want| over the first `cols` columns of got, relative to max |want|.
double rel_err(const HostTensor& got, const Mat& want, int64_t cols = -1) {
  if (cols < 0) cols = got.cols;
  double e = 0, s = 0;
  for (int64_t i = 0; i < got.rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const double w = want[size_t(i * cols + j)], g = got.get(i, j);
      e = std::isfinite(g) ? std::max(e, std::abs(g - w)) : INFINITY;
      s = std::max(s, std::abs(w));
    }
  return e / std::max(s, 1e-30);
}

// The swiglu_bwd row on fp32 tensors: y, dZ and the zdz partials (tile 128, F = 200: a ragged
// tile) against reference::swiglu_dgrad; PartialsSum kPerRow gives its zdz.
TEST(GemmBwdCpu, SwigluBwdMatchesStagedBlockReference) {
  auto rng = make_rng(101);
  const int64_t M = 13, d = 24, F = 200, tile = 128;
  HostTensor dx = random(DType::kFP32, M, d, rng), w2 = random(DType::kFP32, d, F, rng, 0.0, 0.2), z = random(DType::kFP32, M, 2 * F, rng, 0.0, 2.0);
  HostTensor y = poisoned(DType::kFP32, M, F), dz = poisoned(DType::kFP32, M, 2 * F), parts = poisoned(DType::kFP32, M, 2);
  GemmEpilogueArgs g;
  g.a = dx.view();
  g.w = w2.view();  // [K, N] = [d, F], un-transposed
  g.c = z.view();
  g.d = y.view();
  g.aux = dz.view();
  g.partials = parts.view();
  GemmEpilogueOptions o{Epilogue::kSwigluBwd, int(tile)};
  Status st = run(g, o);
  ASSERT_TRUE(st) << st.to_string();
  const reference::SwigluDgrad ref = reference::swiglu_dgrad(to_mat(dx), M, d, to_mat(w2), F, to_mat(z), 1.0 / double(d), tile);
  EXPECT_LT(rel_err(y, ref.y), 1e-6);
  EXPECT_LT(rel_err(dz, ref.dz), 1e-6);
  Mat parts_ref = ref.zdz_partials;
  for (double& v : parts_ref) v *= double(d);  // the epilogue's partials are unscaled
  EXPECT_LT(rel_err(parts, parts_ref), 1e-6);
  HostTensor zdz = HostTensor::vector(DType::kFP32, M);
  zdz.poison();
  st = run(PartialsSumArgs{parts.view(), zdz.view()}, PartialsSum::kPerRow, float(1.0 / double(d)));
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_LT(rel_err(zdz, ref.zdz), 1e-6);
}

// The rmsnorm_bwd row with alpha and the incoming residual gradient (and without both) against
// reference::rmsnorm_dgrad: dx, aux = x̂⊙γ, dγ partials per 128 rows (M = 300: three tiles, the
// last ragged) and dγ through PartialsSum kPerColumn; N = 40 < the partials' 128 columns (zeros).
TEST(GemmBwdCpu, RmsnormBwdMatchesStagedBlockReference) {
  auto rng = make_rng(102);
  const int64_t M = 300, Nf = 56, d = 40, tile = 128;
  for (bool full : {true, false}) {
    SCOPED_TRACE(full ? "alpha + c2" : "no alpha, no c2");
    HostTensor dzt = random(DType::kFP32, M, Nf, rng), w = random(DType::kFP32, Nf, d, rng, 0.0, 0.2), x = random(DType::kFP32, M, d, rng);
    HostTensor prev = random(DType::kFP32, M, d, rng), gamma = random(DType::kFP32, 1, d, rng, 1.0, 0.3);
    HostTensor r = HostTensor::vector(DType::kFP32, M), zdz = HostTensor::vector(DType::kFP32, M), alpha = HostTensor::vector(DType::kFP32, 1);
    r.fill_uniform(rng, 0.5, 2.0);
    zdz.fill_normal(rng);
    alpha.set(0, 0, 0.375);
    gamma.is_1d = true;
    HostTensor dx = poisoned(DType::kFP32, M, d), aux = poisoned(DType::kFP32, M, d), parts = poisoned(DType::kFP32, 3, tile);
    GemmEpilogueArgs g;
    g.a = dzt.view();
    g.w = w.view();
    g.c = x.view();
    g.gamma = gamma.view();
    g.row_scale = r.view();
    g.zdz = zdz.view();
    g.d = dx.view();
    g.aux = aux.view();
    g.partials = parts.view();
    if (full) {
      g.c2 = prev.view();
      g.alpha = alpha.view();
    }
    Status st = run(g, GemmEpilogueOptions{Epilogue::kRmsnormBwd, int(tile)});
    ASSERT_TRUE(st) << st.to_string();
    const reference::RmsNormDgrad ref = reference::rmsnorm_dgrad(to_mat(dzt), M, Nf, to_mat(w), d, full ? 0.375 : 1.0, to_mat(x), to_mat(r),
                                                                 to_mat(gamma), to_mat(zdz), full ? to_mat(prev) : Mat{}, tile);
    EXPECT_LT(rel_err(dx, ref.dx), 1e-6);
    EXPECT_LT(rel_err(aux, ref.aux), 1e-6);
    EXPECT_LT(rel_err(parts, ref.dgamma_partials, d), 1e-6);
    for (int64_t t = 0; t < 3; ++t)
      for (int64_t n = d; n < tile; ++n) EXPECT_EQ(parts.get(t, n), 0.0) << "padding column " << n;
    HostTensor dgamma = HostTensor::vector(DType::kFP32, d);
    dgamma.poison();
    st = run(PartialsSumArgs{parts.view(), dgamma.view()}, PartialsSum::kPerColumn);
    ASSERT_TRUE(st) << st.to_string();
    EXPECT_LT(rel_err(dgamma, ref.dgamma), 1e-6);
  }
}

// Chain rule, independent of the staged reference: the two rows composed (swiglu_bwd, then the
// partials sum, then rmsnorm_bwd with the residual gradient) give the gradient of
//   L(x, γ) = Σ G ⊙ (swiglu(rmsnorm(x)·γ·w1ᵀ)·w2ᵀ + x)
// checked against central differences in fp64 of the forward (inputs and gradients fp32).
TEST(GemmBwdCpu, ComposedFfnBackwardMatchesFiniteDifferences) {
  auto rng = make_rng(103);
  const int64_t M = 5, d = 16, F = 24;
  const double eps = 1e-5;
  HostTensor x = random(DType::kFP32, M, d, rng), w1 = random(DType::kFP32, 2 * F, d, rng, 0.0, 0.4), w2 = random(DType::kFP32, d, F, rng, 0.0, 0.3);
  HostTensor G = random(DType::kFP32, M, d, rng), gamma = random(DType::kFP32, 1, d, rng, 1.0, 0.3);
  gamma.is_1d = true;
  const Mat X = to_mat(x), W1 = to_mat(w1), W2 = to_mat(w2), Gm = to_mat(G), Gam = to_mat(gamma);
  auto loss = [&](const Mat& xv, const Mat& gv) {
    double L = 0;
    for (int64_t m = 0; m < M; ++m) {
      double ss = 0;
      for (int64_t k = 0; k < d; ++k) ss += xv[size_t(m * d + k)] * xv[size_t(m * d + k)];
      const double r = 1.0 / std::sqrt(ss / double(d) + eps);
      std::vector<double> y(static_cast<size_t>(F));
      for (int64_t j = 0; j < F; ++j) {
        double zg = 0, zu = 0;
        for (int64_t k = 0; k < d; ++k) {
          const double a = r * xv[size_t(m * d + k)] * gv[size_t(k)];
          zg += a * W1[size_t((2 * j) * d + k)];
          zu += a * W1[size_t((2 * j + 1) * d + k)];
        }
        y[size_t(j)] = zg / (1.0 + std::exp(-zg)) * zu;
      }
      for (int64_t n = 0; n < d; ++n) {
        double o = xv[size_t(m * d + n)];
        for (int64_t j = 0; j < F; ++j) o += y[size_t(j)] * W2[size_t(n * F + j)];
        L += Gm[size_t(m * d + n)] * o;
      }
    }
    return L;
  };
  // Forward tensors the backward reads: r, z = (r·x⊙γ)·w1ᵀ.
  HostTensor r = HostTensor::vector(DType::kFP32, M), z(DType::kFP32, M, 2 * F), h(DType::kFP32, M, d);
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0;
    for (int64_t k = 0; k < d; ++k) ss += X[size_t(m * d + k)] * X[size_t(m * d + k)];
    r.set(0, m, 1.0 / std::sqrt(ss / double(d) + eps));
    for (int64_t k = 0; k < d; ++k) h.set(m, k, X[size_t(m * d + k)] * Gam[size_t(k)]);
  }
  GemmEpilogueArgs fw;
  fw.a = h.view();
  fw.w = w1.view();
  fw.d = z.view();
  fw.row_scale = r.view();
  ASSERT_TRUE(run(fw, GemmEpilogueOptions{Epilogue::kRowScale}));
  // Backward: swiglu_bwd (dZ, y, zdz partials), zdz, rmsnorm_bwd with c2 = G (the residual path).
  HostTensor y(DType::kFP32, M, F), dz(DType::kFP32, M, 2 * F), zparts(DType::kFP32, M, 1), zdz = HostTensor::vector(DType::kFP32, M);
  GemmEpilogueArgs sb;
  sb.a = G.view();
  sb.w = w2.view();
  sb.c = z.view();
  sb.d = y.view();
  sb.aux = dz.view();
  sb.partials = zparts.view();
  ASSERT_TRUE(run(sb, GemmEpilogueOptions{Epilogue::kSwigluBwd, 128}));
  ASSERT_TRUE(run(PartialsSumArgs{zparts.view(), zdz.view()}, PartialsSum::kPerRow, float(1.0 / double(d))));
  HostTensor dx(DType::kFP32, M, d), aux(DType::kFP32, M, d), gparts(DType::kFP32, 1, 128), dgamma = HostTensor::vector(DType::kFP32, d);
  GemmEpilogueArgs nb;
  nb.a = dz.view();
  nb.w = w1.view();  // [2F, d] = [K, N]
  nb.c = x.view();
  nb.c2 = G.view();
  nb.gamma = gamma.view();
  nb.row_scale = r.view();
  nb.zdz = zdz.view();
  nb.d = dx.view();
  nb.aux = aux.view();
  nb.partials = gparts.view();
  Status st = run(nb, GemmEpilogueOptions{Epilogue::kRmsnormBwd, 128});
  ASSERT_TRUE(st) << st.to_string();
  ASSERT_TRUE(run(PartialsSumArgs{gparts.view(), dgamma.view()}, PartialsSum::kPerColumn));
  const double hstep = 1e-5;
  double worst = 0, scale = 0;
  auto check = [&](double analytic, const std::function<double(double)>& f) {
    const double fd = (f(hstep) - f(-hstep)) / (2 * hstep);
    worst = std::max(worst, std::abs(analytic - fd));
    scale = std::max(scale, std::abs(fd));
  };
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < d; ++k)
      check(dx.get(m, k), [&](double e) {
        Mat xe = X;
        xe[size_t(m * d + k)] += e;
        return loss(xe, Gam);
      });
  for (int64_t k = 0; k < d; ++k)
    check(dgamma.get(0, k), [&](double e) {
      Mat ge = Gam;
      ge[size_t(k)] += e;
      return loss(X, ge);
    });
  EXPECT_LT(worst / scale, 2e-5) << "max |analytic − finite difference| = " << worst << " of max |gradient| " << scale;
  // ZdZ identity: (1/d)·Σ_j z·dz = mean_k(x̂γ·da) with da = dz·w1 (the norm's input gradient).
  for (int64_t m = 0; m < M; ++m) {
    double lhs = 0, rhs = 0;
    for (int64_t j = 0; j < 2 * F; ++j) lhs += z.get(m, j) * dz.get(m, j);
    for (int64_t k = 0; k < d; ++k) {
      double da = 0;
      for (int64_t j = 0; j < 2 * F; ++j) da += dz.get(m, j) * w1.get(j, k);
      rhs += aux.get(m, k) * da;
    }
    EXPECT_NEAR(zdz.get(0, m), rhs / double(d), 1e-5 * (1 + std::abs(rhs / double(d))));
    EXPECT_NEAR(lhs / double(d), rhs / double(d), 1e-5 * (1 + std::abs(rhs / double(d))));
  }
}

// ---- bad input -------------------------------------------------------------------------------

// rmsnorm_bwd's operands: A = dz, W, C = the saved x, gamma, the row rstd, zdz; D = dx, aux, dγ partials.
GemmEpilogueArgs rmsnorm_bwd_args(const HostTensor& a, const HostTensor& w, const HostTensor& x, const HostTensor& gamma,
                                  const HostTensor& rstd, const HostTensor& zdz, HostTensor& d, HostTensor& aux,
                                  HostTensor& partials) {
  GemmEpilogueArgs n;
  n.a = a.view();
  n.w = w.view();
  n.c = x.view();
  n.gamma = gamma.view();
  n.row_scale = rstd.view();
  n.zdz = zdz.view();
  n.d = d.view();
  n.aux = aux.view();
  n.partials = partials.view();
  return n;
}

void expect_error(const Status& st, const std::string& needle) {
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
}

TEST(GemmBwdCpu, RefusesBadShapesAndDtypes) {
  const int64_t M = 4, K = 16, N = 8;
  HostTensor a(DType::kBF16, M, K), w(DType::kBF16, K, N), wt(DType::kBF16, N, K), z(DType::kBF16, M, 2 * N), y(DType::kBF16, M, N),
      dz(DType::kBF16, M, 2 * N), parts(DType::kFP32, M, 1), zhalf(DType::kBF16, M, N);
  GemmEpilogueArgs s;
  s.a = a.view();
  s.w = w.view();
  s.c = z.view();
  s.d = y.view();
  s.aux = dz.view();
  s.partials = parts.view();
  const GemmEpilogueOptions so{Epilogue::kSwigluBwd, 128};
  EXPECT_TRUE(run(s, so));
  GemmEpilogueArgs b = s;
  b.w = wt.view();  // [N, K] where [K, N] is expected
  expect_error(run(b, so), "w: expected [K, N] with K = 16 (a's columns), got [8, 16] (the swiglu_bwd epilogue multiplies by w un-transposed)");
  b = s;
  b.c = zhalf.view();
  expect_error(run(b, so), "c: expected [M, 2N] (pairs) = [4, 16], got [4, 8]");
  b = s;
  b.aux = zhalf.view();
  expect_error(run(b, so), "aux: expected [M, 2N] = [4, 16], got [4, 8]");
  b = s;
  b.zdz = parts.view();
  expect_error(run(b, so), "zdz: not used by the swiglu_bwd epilogue");

  HostTensor x(DType::kBF16, M, N), aux(DType::kBF16, M, N), gamma = HostTensor::vector(DType::kBF16, N), cparts(DType::kFP32, 1, 128),
      c2_int(DType::kInt32, M, N), wide(DType::kFP32, 1, 64);
  HostTensor r = HostTensor::vector(DType::kFP32, M), zdz = HostTensor::vector(DType::kFP32, M);
  GemmEpilogueArgs n = rmsnorm_bwd_args(a, w, x, gamma, r, zdz, y, aux, cparts);
  const GemmEpilogueOptions no{Epilogue::kRmsnormBwd, 128};
  Status ok = run(n, no);
  EXPECT_TRUE(ok) << ok.to_string();
  b = n;
  b.zdz = TensorView{};
  expect_error(run(b, no), "zdz: tensor is missing");
  b = n;
  b.partials = wide.view();
  expect_error(run(b, no), "partials: expected [ceil(M / 128), round_up(N, partial_tile_n)] = [1, 128], got [1, 64]");
  b = n;
  b.partials = parts.view();  // tile-partials layout where column partials are expected
  expect_error(run(b, no), "partials: expected [ceil(M / 128), round_up(N, partial_tile_n)] = [1, 128], got [4, 1]");
  b = n;
  b.c2 = c2_int.view();
  expect_error(run(b, no), "c2: dtype must be one of");
  b = n;
  b.c2 = y.view();  // the output as the residual-gradient input: D overlaps c2
  expect_error(run(b, no), "overlap");
  b = n;
  b.pos = r.view();
  expect_error(run(b, no), "pos: not used by the rmsnorm_bwd epilogue");

  // The partials sums.
  HostTensor out3 = HostTensor::vector(DType::kFP32, 3), out200 = HostTensor::vector(DType::kFP32, 200), p(DType::kFP32, 4, 128);
  expect_error(run(PartialsSumArgs{p.view(), out3.view()}, PartialsSum::kPerRow), "out: expected [rows] = [4], got [3]");
  expect_error(run(PartialsSumArgs{p.view(), out200.view()}, PartialsSum::kPerColumn), "out: expected [n] with n <= 128");
  expect_error(run(PartialsSumArgs{p.view(), out3.view()}, static_cast<PartialsSum>(7)), "axis: must be");
  HostTensor pb(DType::kBF16, 4, 128);
  expect_error(run(PartialsSumArgs{pb.view(), out3.view()}, PartialsSum::kPerColumn), "partials: dtype must be one of {fp32}, got bf16");
}

// Limits of the CUDA kernels checked before any device access.
TEST(GemmBwdCpu, RefusesCudaLimits) {
  const int64_t M = 130, K = 16, N = 8;  // two M-tiles of column partials
  HostTensor a(DType::kBF16, M, K), w(DType::kBF16, K, N), x(DType::kBF16, M, N), y(DType::kBF16, M, N), aux(DType::kBF16, M, N),
      gamma = HostTensor::vector(DType::kBF16, N), cparts(DType::kFP32, 2, 256), cparts_pad(DType::kFP32, 2, 128, 136);
  HostTensor r = HostTensor::vector(DType::kFP32, M), zdz = HostTensor::vector(DType::kFP32, M);
  GemmEpilogueArgs n = rmsnorm_bwd_args(a, w, x, gamma, r, zdz, y, aux, cparts);
  for (TensorView* t : {&n.a, &n.w, &n.c, &n.gamma, &n.row_scale, &n.zdz, &n.d, &n.aux, &n.partials}) t->device = Device{DeviceType::kCUDA, 0};
  GemmEpilogueOptions o{Epilogue::kRmsnormBwd, 256};
  o.n_slices = 2;
  Status st = run(n, o);
  EXPECT_FALSE(st.is_ok());
  // Either the kernel is not instantiated on that tile yet or the slicing is refused: both are clear errors.
  EXPECT_TRUE(st.message().find("n_slices: the rmsnorm_bwd kernel runs in one launch") != std::string::npos ||
              st.message().find("tile:") != std::string::npos)
      << st.message();
  o = GemmEpilogueOptions{Epilogue::kRmsnormBwd, 128};
  n.partials = cparts_pad.view();
  n.partials.device = Device{DeviceType::kCUDA, 0};
  expect_error(run(n, o), "partials: the column partials must be contiguous on CUDA");
}

// The launch plan's partials tile (src/gemm/plan.cpp): swiglu_bwd on 256 columns (the cooperative
// tile) from K 8192, rmsnorm_bwd from K 12288.
TEST(GemmBwdPlan, PartialTileByShape) {
  EXPECT_EQ(gemm_partial_tile_n(Epilogue::kSwigluBwd, 8192, 8192, 2048), 128);
  EXPECT_EQ(gemm_partial_tile_n(Epilogue::kSwigluBwd, 8192, 14336, 4096), 128);
  EXPECT_EQ(gemm_partial_tile_n(Epilogue::kSwigluBwd, 8192, 28672, 8192), 256);
  EXPECT_EQ(gemm_partial_tile_n(Epilogue::kRmsnormBwd, 8192, 4096, 6144), 128);
  EXPECT_EQ(gemm_partial_tile_n(Epilogue::kRmsnormBwd, 8192, 4096, 28672), 256);
}

// The scheduler swizzle (src/gemm/plan.cpp): CUTLASS pads the tile grid to a multiple of swizzle x cluster (2x1) and
// computes the padding, so the swizzle is the largest whose padding stays within 1/16 of the tiles.
TEST(GemmPlan, SwizzleBoundsThePadding) {
  using gemm::auto_swizzle;
  const GemmTile coop = GemmTile::kCooperative128x256, pp = GemmTile::kPingpong128x128;
  EXPECT_EQ(auto_swizzle(8192, 128256, coop), 8);   // 64 x 501 tiles: 64 x 504
  EXPECT_EQ(auto_swizzle(16384, 28672, pp), 8);
  EXPECT_EQ(auto_swizzle(2048, 128256, coop), 8);   // 16 row tiles
  EXPECT_EQ(auto_swizzle(1024, 128256, coop), 4);   // 8 row tiles: swizzle 8 would run 16
  EXPECT_EQ(auto_swizzle(1536, 128256, coop), 2);   // 12 row tiles: 8 and 4 pad to 16
  EXPECT_EQ(auto_swizzle(1152, 4096, pp), 1);       // 9 row tiles: 2 pads to 12
  EXPECT_EQ(auto_swizzle(512, 128256, coop), 1);    // small grids unswizzled
  EXPECT_EQ(auto_swizzle(8192, 512, coop), 1);
  EXPECT_EQ(auto_swizzle(8192, 1280, pp), 2);       // 10 column tiles: 8 and 4 pad to 16 and 12
  EXPECT_EQ(auto_swizzle(1024, 128256, GemmTile::kPingpong64x256), 8);  // 16 row tiles of 64
}

}  // namespace
}  // namespace encore::test
