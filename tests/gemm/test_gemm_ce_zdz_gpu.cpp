// On CUDA against the CPU backend: the ce_bwd row's optional zdz partials (Σ_tile z·dℓ) on both tiles
// (partial_tile_n 128: ping-pong, 256: cooperative), bf16 and fp16, M tails, V = 1001 (D rows padded to 8)
// and 1024, ignored rows exactly 0, D unchanged by asking for the partials; the ce_mean finisher (with
// ignored rows, all ignored); the dgrad and wgrad rows over a ragged K / M of A in padded rows (dℓ [M, V]
// with V odd: the last layer's dx = dℓ·W_lm and dW_lm = dℓᵀ·h). Outputs poisoned before each run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "encore/gemm.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {
namespace {

struct Mirror {
  HostTensor host;
  std::unique_ptr<DeviceBuffer> dev;
  TensorView gpu;
  explicit Mirror(const HostTensor& h) : host(h), dev(std::make_unique<DeviceBuffer>(h.storage_bytes())) { gpu = to_device(host, *dev); }
  HostTensor fetch() const {
    HostTensor out = host;
    from_device(out, *dev);
    return out;
  }
};

double rel_rms(const HostTensor& got, const HostTensor& want) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < want.rows; ++i)
    for (int64_t j = 0; j < want.cols; ++j) {
      const double g = got.get(i, j), w = want.get(i, j);
      if (!std::isfinite(g)) return INFINITY;
      num += (g - w) * (g - w);
      den += w * w;
    }
  return std::sqrt(num / std::max(den, 1e-300));
}

TEST(GemmCeZdzGpu, PartialsAgainstCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto rng = make_rng(101);
  for (DType t : {DType::kBF16, DType::kFP16})
    for (int64_t V : {int64_t(1001), int64_t(1024)})
      for (int64_t M : {int64_t(77), int64_t(300)})
        for (int tile : {128, 256}) {
          SCOPED_TRACE(std::string(dtype_name(t)) + " V " + std::to_string(V) + " M " + std::to_string(M) + " tile " + std::to_string(tile));
          const int64_t K = 256, vp = (V + 7) / 8 * 8, tiles = (V + tile - 1) / tile;
          HostTensor a(t, M, K), w(t, V, K), d(t, M, V, vp), part(DType::kFP32, M, tiles), lse(HostTensor::vector(DType::kFP32, M));
          HostTensor target(HostTensor::vector(DType::kInt32, M)), alpha(HostTensor::vector(DType::kFP32, 1)), r(HostTensor::vector(DType::kFP32, M));
          a.fill_normal(rng);
          w.fill_normal(rng, 0.0, 2.0 / std::sqrt(double(K)));
          r.fill_uniform(rng, 0.5, 1.5);
          alpha.set(0, 0, 1.0 / 37.0);
          for (int64_t m = 0; m < M; ++m) target.set(0, m, m % 7 == 3 ? -100.0 : double(int64_t(rng() % uint64_t(V))));
          {  // lse of the stored inputs (the CPU lse row + lse_finish)
            HostTensor lp(DType::kFP32, M, (V + 127) / 128);
            GemmEpilogueArgs l;
            l.a = a.view(), l.w = w.view(), l.row_scale = r.view(), l.partials = lp.view();
            ASSERT_TRUE(run(l, GemmEpilogueOptions{Epilogue::kLse, 128}));
            ASSERT_TRUE(run(LseFinishArgs{lp.view(), lse.view()}));
          }
          d.poison();
          part.poison();
          Mirror ga(a), gw(w), gd(d), gp(part), gl(lse), gt(target), gal(alpha), gr(r);
          GemmEpilogueArgs h, g;
          GemmEpilogueOptions o{Epilogue::kCeBwd};
          o.partial_tile_n = tile;
          h.a = a.view(), h.w = w.view(), h.row_scale = r.view(), h.lse = lse.view(), h.target = target.view(), h.alpha = alpha.view();
          h.d = TensorView::strided(d.view().data, t, {M, V}, {vp, 1});
          h.partials = part.view();
          g.a = ga.gpu, g.w = gw.gpu, g.row_scale = gr.gpu, g.lse = gl.gpu, g.target = gt.gpu, g.alpha = gal.gpu;
          g.d = TensorView::strided(gd.gpu.data, t, {M, V}, {vp, 1}, gd.gpu.device);
          g.partials = gp.gpu;
          ASSERT_TRUE(run(h, o)) << run(h, o).to_string();
          const Status st = run(g, o);
          ASSERT_TRUE(st) << st.to_string();
          ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
          const HostTensor got = gp.fetch(), got_d = gd.fetch();
          EXPECT_LE(rel_rms(got, part), 2e-2) << "partials";
          for (int64_t m = 0; m < M; ++m)
            for (int64_t tt = 0; tt < tiles; ++tt) {
              ASSERT_TRUE(std::isfinite(got.get(m, tt))) << "row " << m << " tile " << tt;
              if (m % 7 == 3) ASSERT_EQ(got.get(m, tt), 0.0) << "ignored row " << m;
            }
          // D is the same with or without the partials
          HostTensor d2 = d;
          d2.poison();
          Mirror gd2(d2);
          GemmEpilogueArgs g2 = g;
          g2.partials = TensorView{};
          g2.d = TensorView::strided(gd2.gpu.data, t, {M, V}, {vp, 1}, gd2.gpu.device);
          GemmEpilogueOptions o2 = o;
          o2.tile = tile == 128 ? GemmTile::kPingpong128x128 : GemmTile::kCooperative128x256;
          ASSERT_TRUE(run(g2, o2));
          ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
          const HostTensor got_d2 = gd2.fetch();
          for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < V; ++n) ASSERT_EQ(got_d.get(m, n), got_d2.get(m, n)) << "D [" << m << ", " << n << "]";
        }
}

TEST(GemmCeZdzGpu, CeMean) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto rng = make_rng(103);
  for (int64_t M : {int64_t(1), int64_t(1000), int64_t(5000)})
    for (bool all_ignored : {false, true}) {
      HostTensor target(HostTensor::vector(DType::kInt32, M)), rows(HostTensor::vector(DType::kFP32, M)), d_loss(HostTensor::vector(DType::kFP32, 1));
      HostTensor loss(HostTensor::vector(DType::kFP32, 1)), alpha(HostTensor::vector(DType::kFP32, 1));
      for (int64_t m = 0; m < M; ++m) {
        target.set(0, m, all_ignored || m % 3 == 1 ? -100.0 : double(m % 50));
        rows.set(0, m, target.get(0, m) == -100.0 ? 0.0 : 1.0 + double(rng() % 1000) / 100.0);
      }
      d_loss.set(0, 0, 0.5);
      loss.poison();
      alpha.poison();
      Mirror gt(target), gr(rows), gdl(d_loss), gloss(loss), ga(alpha);
      ASSERT_TRUE(run(CeMeanArgs{target.view(), rows.view(), loss.view(), d_loss.view(), alpha.view()}));
      const Status st = run(CeMeanArgs{gt.gpu, gr.gpu, gloss.gpu, gdl.gpu, ga.gpu});
      ASSERT_TRUE(st) << st.to_string();
      ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
      EXPECT_NEAR(gloss.fetch().get(0, 0), loss.get(0, 0), 1e-5 * std::max(1.0, std::fabs(loss.get(0, 0)))) << "M " << M;
      EXPECT_NEAR(ga.fetch().get(0, 0), alpha.get(0, 0), 1e-7) << "M " << M;
      if (all_ignored) EXPECT_EQ(gloss.fetch().get(0, 0), 0.0);
    }
}

// dx = dℓ·W_lm (dgrad, K = V odd) and dW_lm = dℓᵀ·h (wgrad, M = V odd) from dℓ in rows padded to 8.
TEST(GemmCeZdzGpu, RaggedKAndMOfPaddedA) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto rng = make_rng(107);
  for (int64_t V : {int64_t(1001), int64_t(13)}) {
    const int64_t M = 300, d = 256, vp = (V + 7) / 8 * 8;
    HostTensor dl(DType::kBF16, M, V, vp), w(DType::kBF16, V, d), h(DType::kBF16, M, d), dx(DType::kBF16, M, d), dw(DType::kBF16, V, d);
    dl.fill_normal(rng);  // the padding columns too (finite): read or not, they meet W's zero-filled rows or land past M
    w.fill_normal(rng);
    h.fill_normal(rng);
    for (auto [e, a, ww, out] : {std::tuple<Epilogue, HostTensor*, HostTensor*, HostTensor*>{Epilogue::kDgrad, &dl, &w, &dx},
                                 {Epilogue::kWgrad, &dl, &h, &dw}}) {
      SCOPED_TRACE(std::string(epilogue_name(e)) + " V " + std::to_string(V));
      out->poison();
      HostTensor ref = *out;
      Mirror ga(*a), gw(*ww), go(*out);
      GemmEpilogueArgs hc, gc;
      hc.a = TensorView::strided(a->view().data, DType::kBF16, {M, V}, {vp, 1});
      hc.w = ww->view(), hc.d = ref.view();
      gc.a = TensorView::strided(ga.gpu.data, DType::kBF16, {M, V}, {vp, 1}, ga.gpu.device);
      gc.w = gw.gpu, gc.d = go.gpu;
      ASSERT_TRUE(run(hc, GemmEpilogueOptions{e}));
      const Status st = run(gc, GemmEpilogueOptions{e});
      ASSERT_TRUE(st) << st.to_string();
      ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
      EXPECT_LE(rel_rms(go.fetch(), ref), 8e-3);
    }
  }
}

}  // namespace
}  // namespace encore::test
