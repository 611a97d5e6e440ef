// The ce_bwd row's optional zdz partials and the ce_mean finisher on the CPU backend: partials[m, t] =
// Σ_{n in tile t} z·D against fp64 sums over the stored inputs (N odd and a multiple of 8, with and without
// the row scale, ignored rows, the identity Σ_n z·dℓ = α·(Σ_n p·z − z_target)); ce_mean's loss and α with
// ignored rows and an all-ignored batch (0, no NaN); bad input; the CUDA rule for a ragged K / M of A in
// padded rows (the dgrad and wgrad through dℓ with V odd).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "encore/gemm.hpp"
#include "tests/common/compare.hpp"

namespace encore::test {
namespace {

TensorView vec_view(std::vector<float>& v) { return TensorView::contiguous(v.data(), DType::kFP32, {int64_t(v.size())}); }
TensorView ivec_view(std::vector<int32_t>& v) { return TensorView::contiguous(v.data(), DType::kInt32, {int64_t(v.size())}); }

TEST(GemmCeZdzCpu, PartialsAgainstFp64) {
  auto rng = make_rng(31);
  for (DType t : {DType::kFP32, DType::kBF16})
    for (int64_t N : {int64_t(1001), int64_t(264)})
      for (int tile : {128, 256})
        for (bool with_r : {false, true}) {
          const int64_t M = 37, K = 24, tiles = (N + tile - 1) / tile;
          HostTensor a(t, M, K), w(t, N, K), d(t, M, N, (N + 7) / 8 * 8), part(DType::kFP32, M, tiles, tiles + 1);
          a.fill_normal(rng);
          w.fill_normal(rng, 0.0, 2.0 / std::sqrt(double(K)));
          d.poison();
          part.poison();
          std::vector<float> r(static_cast<size_t>(M), 1.0f), lse(static_cast<size_t>(M)), alpha{0.37f};
          std::vector<int32_t> target(static_cast<size_t>(M));
          std::vector<double> z(static_cast<size_t>(M * N));
          for (int64_t m = 0; m < M; ++m) {
            if (with_r) r[size_t(m)] = 0.5f + float(rng() % 100) / 100.0f;
            target[size_t(m)] = m % 6 == 1 ? -100 : int32_t(rng() % uint64_t(N));
            double mx = -INFINITY;
            for (int64_t n = 0; n < N; ++n) {
              double s = 0;
              for (int64_t k = 0; k < K; ++k) s += a.get(m, k) * w.get(n, k);
              z[size_t(m * N + n)] = double(r[size_t(m)]) * s;
              mx = std::max(mx, z[size_t(m * N + n)]);
            }
            double s = 0;
            for (int64_t n = 0; n < N; ++n) s += std::exp(z[size_t(m * N + n)] - mx);
            lse[size_t(m)] = float(mx + std::log(s));
          }
          GemmEpilogueArgs g;
          g.a = a.view();
          g.w = w.view();
          g.d = TensorView::strided(d.view().data, t, {M, N}, {d.row_stride, 1});
          g.lse = vec_view(lse);
          g.target = ivec_view(target);
          g.alpha = vec_view(alpha);
          if (with_r) g.row_scale = vec_view(r);
          g.partials = part.view();
          GemmEpilogueOptions o{Epilogue::kCeBwd};
          o.partial_tile_n = tile;
          ASSERT_TRUE(validate(g, o)) << validate(g, o).to_string();
          ASSERT_TRUE(run(g, o)) << run(g, o).to_string();
          double num = 0, den = 0;
          for (int64_t m = 0; m < M; ++m) {
            double row = 0, pz = 0;
            for (int64_t tt = 0; tt < tiles; ++tt) {
              double want = 0;
              for (int64_t n = tt * tile; n < std::min(N, (tt + 1) * tile); ++n) {
                const double zz = z[size_t(m * N + n)];
                const double dl = target[size_t(m)] == -100 ? 0.0 : alpha[0] * (std::exp(zz - lse[size_t(m)]) - (n == target[size_t(m)] ? 1.0 : 0.0));
                want += zz * dl;
                pz += std::exp(zz - lse[size_t(m)]) * zz;
              }
              const double got = part.get(m, tt);
              ASSERT_TRUE(std::isfinite(got)) << "row " << m << " tile " << tt;
              num += (got - want) * (got - want);
              den += want * want;
              row += got;
            }
            // Σ_n z·dℓ = α·(Σ_n p·z − z_target) on counted rows, 0 on ignored rows
            const int32_t y = target[size_t(m)];
            const double ident = y == -100 ? 0.0 : alpha[0] * (pz - z[size_t(m * N + y)]);
            EXPECT_NEAR(row, ident, 1e-6 * (1.0 + std::abs(ident))) << "row " << m;  // fp32 partials
            if (y == -100) EXPECT_EQ(row, 0.0);
          }
          EXPECT_LE(std::sqrt(num / std::max(den, 1e-300)), 1e-7) << "partials (fp32) vs fp64, N " << N << " tile " << tile;
        }
}

TEST(GemmCeZdzCpu, PartialsOptionalAndShapes) {
  auto rng = make_rng(32);
  const int64_t M = 9, N = 50, K = 16;
  HostTensor a(DType::kFP32, M, K), w(DType::kFP32, N, K), d(DType::kFP32, M, N);
  a.fill_normal(rng);
  w.fill_normal(rng);
  std::vector<float> lse(static_cast<size_t>(M), 5.0f);
  std::vector<int32_t> target(static_cast<size_t>(M), 3);
  GemmEpilogueArgs g;
  g.a = a.view();
  g.w = w.view();
  g.d = d.view();
  g.lse = vec_view(lse);
  g.target = ivec_view(target);
  GemmEpilogueOptions o{Epilogue::kCeBwd};
  EXPECT_TRUE(run(g, o));  // without partials, as before
  HostTensor bad(DType::kFP32, M, 2);  // ceil(50 / 128) = 1 column
  g.partials = bad.view();
  const Status st = validate(g, o);
  EXPECT_FALSE(st);
  EXPECT_NE(st.message().find("partials"), std::string::npos) << st.message();
  HostTensor good(DType::kFP32, M, 1);
  g.partials = good.view();
  EXPECT_TRUE(run(g, o));
  EXPECT_EQ(gemm_partial_tile_n(Epilogue::kCeBwd, M, N, K), 128);
}

TEST(GemmCeZdzCpu, CeMean) {
  std::vector<int32_t> target = {3, -100, 7, 1, -100};
  std::vector<float> rows = {1.5f, 0.0f, 2.0f, 0.25f, 0.0f}, loss{NAN}, d_loss{2.0f}, alpha{NAN};
  CeMeanArgs c{ivec_view(target), vec_view(rows), vec_view(loss), vec_view(d_loss), vec_view(alpha)};
  ASSERT_TRUE(run(c)) << run(c).to_string();
  EXPECT_FLOAT_EQ(loss[0], 3.75f / 3.0f);
  EXPECT_FLOAT_EQ(alpha[0], 2.0f / 3.0f);
  std::vector<int32_t> ignored(4, -100);
  c.target = ivec_view(ignored);
  c.loss_rows = TensorView::contiguous(rows.data(), DType::kFP32, {4});
  ASSERT_TRUE(run(c));
  EXPECT_EQ(loss[0], 0.0f);
  EXPECT_EQ(alpha[0], 0.0f);
  // alpha alone; a custom ignore_index
  CeMeanArgs only{ivec_view(target), {}, {}, vec_view(d_loss), vec_view(alpha)};
  ASSERT_TRUE(run(only, 7));
  EXPECT_FLOAT_EQ(alpha[0], 2.0f / 4.0f);
  // bad input
  CeMeanArgs no_rows{ivec_view(target), {}, vec_view(loss), {}, {}};
  EXPECT_FALSE(run(no_rows));
  CeMeanArgs short_rows{ivec_view(target), TensorView::contiguous(rows.data(), DType::kFP32, {3}), vec_view(loss), {}, {}};
  EXPECT_NE(run(short_rows).message().find("loss_rows"), std::string::npos);
  CeMeanArgs alias{ivec_view(target), vec_view(rows), TensorView::contiguous(rows.data(), DType::kFP32, {1}), {}, {}};
  EXPECT_FALSE(run(alias));
}

// On CUDA (checked before any device access): the dgrad / wgrad rows through dlogits [M, V] with V odd take
// it in rows padded to 16 bytes (A's contiguous K, or M for wgrad, ragged), not in packed rows; the forward
// rows (W [N, K]) keep K % 8.
TEST(GemmCeZdzCpu, CudaRaggedKOfPaddedA) {
  const Device gpu{DeviceType::kCUDA, 0};
  const int64_t M = 16, V = 1001, d = 64;
  HostTensor packed(DType::kBF16, M, V), padded(DType::kBF16, M, V, 1008), w(DType::kBF16, V, d), dx(DType::kBF16, M, d), h(DType::kBF16, M, d);
  HostTensor dw(DType::kBF16, V, d), wt(DType::kBF16, d, V, 1008), z(DType::kBF16, M, d);
  auto on_gpu = [&](GemmEpilogueArgs g) {
    for (TensorView* v : {&g.a, &g.w, &g.d}) v->device = gpu;
    return g;
  };
  auto limit = [](const Status& st) { return st.message().find("must be a multiple of 8") != std::string::npos; };
  GemmEpilogueArgs g;
  g.w = w.view();
  g.d = dx.view();
  g.a = packed.view();
  Status st = run(on_gpu(g), GemmEpilogueOptions{Epilogue::kDgrad});
  EXPECT_TRUE(limit(st)) << st.to_string();
  EXPECT_NE(st.message().find("K = 1001"), std::string::npos) << st.to_string();
  g.a = padded.view();
  st = run(on_gpu(g), GemmEpilogueOptions{Epilogue::kDgrad});
  EXPECT_FALSE(st);  // no device here; the limit passed
  EXPECT_FALSE(limit(st)) << st.to_string();
  // wgrad dW_lm = dℓᵀ·h: a = dℓ [tokens, V] stored, M = V
  GemmEpilogueArgs wg;
  wg.a = packed.view();
  wg.w = h.view();
  wg.d = dw.view();
  st = run(on_gpu(wg), GemmEpilogueOptions{Epilogue::kWgrad});
  EXPECT_TRUE(limit(st)) << st.to_string();
  EXPECT_NE(st.message().find("M = 1001"), std::string::npos) << st.to_string();
  wg.a = padded.view();
  st = run(on_gpu(wg), GemmEpilogueOptions{Epilogue::kWgrad});
  EXPECT_FALSE(st);  // host memory labelled CUDA: refused (no device here, or the device-memory check)
  EXPECT_FALSE(limit(st)) << st.to_string();
  // a forward row with W [N, K], K = 1001: refused even with padded rows of A (W's rows are K long)
  GemmEpilogueArgs f;
  f.a = padded.view();
  f.w = wt.view();
  f.d = z.view();
  st = run(on_gpu(f), GemmEpilogueOptions{Epilogue::kScalarScale});
  EXPECT_FALSE(st);
}

}  // namespace
}  // namespace encore::test
