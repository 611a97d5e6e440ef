// Cross-entropy backward on CUDA against the CPU backend: the ce_bwd row (the recomputing low-memory
// path) on both of its tiles, bf16 and fp16, with and without α and the row scale, M tails, vocabularies
// that are not multiples of 8 or of the tile (D with rows padded to 16 bytes: 1001, 4105, GPT-2's
// 50257), N-slices (the target select per slice), ignore_index rows exactly 0 and a device target out of
// range giving a NaN row; lse with stored logits at N odd (padded D) on every tile; the cross_entropy_bwd
// finisher out of place and in place (16-byte and scalar paths). Outputs are poisoned before each run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "encore/gemm.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {
namespace {

class GemmCeGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

// A host tensor with a device copy.
struct Mirror {
  HostTensor host;
  std::unique_ptr<DeviceBuffer> dev;
  TensorView gpu;
  // extra_bytes: device memory past the host tensor's storage (D's last-row padding, see run_ce_case)
  explicit Mirror(HostTensor h, size_t extra_bytes = 0)
      : host(std::move(h)), dev(std::make_unique<DeviceBuffer>(host.storage_bytes() + extra_bytes)) {
    gpu = to_device(host, *dev);
  }
  HostTensor fetch() const {
    HostTensor out = host;
    from_device(out, *dev);
    return out;
  }
};

// The forward's lse of r·A·Wᵀ on the CPU backend (kLse without D, then lse_finish).
HostTensor cpu_lse(const HostTensor& a, const HostTensor& w, const HostTensor* r) {
  const int64_t M = a.rows, N = w.rows;
  HostTensor part(DType::kFP32, M, (N + 127) / 128), lse = HostTensor::vector(DType::kFP32, M);
  GemmEpilogueArgs g;
  g.a = a.view();
  g.w = w.view();
  g.partials = part.view();
  if (r != nullptr) g.row_scale = r->view();
  EXPECT_TRUE(run(g, GemmEpilogueOptions{Epilogue::kLse, 128}));
  EXPECT_TRUE(run(LseFinishArgs{part.view(), lse.view()}));
  return lse;
}

struct CeCase {
  DType t;
  int64_t M, N, K;
  GemmTile tile;
  bool with_r, with_alpha;
  int64_t d_pad = 0;  // extra elements per D row beyond round_up(N, 8)
  int n_slices = 0;
};

void run_ce_case(const CeCase& c) {
  SCOPED_TRACE(std::string(dtype_name(c.t)) + " M" + std::to_string(c.M) + " N" + std::to_string(c.N) + " K" + std::to_string(c.K) + " " +
               gemm_tile_name(c.tile) + (c.with_r ? " r" : "") + (c.with_alpha ? " alpha" : "") + " n_slices " + std::to_string(c.n_slices));
  auto rng = make_rng(uint64_t(c.M * 131 + c.N * 7 + c.K));
  HostTensor a(c.t, c.M, c.K), w(c.t, c.N, c.K), r = HostTensor::vector(DType::kFP32, c.M), target = HostTensor::vector(DType::kInt32, c.M),
      alpha = HostTensor::vector(DType::kFP32, 1), d(c.t, c.M, c.N, (c.N + 7) / 8 * 8 + c.d_pad);
  a.fill_normal(rng);
  w.fill_normal(rng, 0.0, 2.0 / std::sqrt(double(c.K)));
  r.fill_uniform(rng, 0.5, 1.5);
  for (int64_t m = 0; m < c.M; ++m) target.set(0, m, m % 7 == 3 ? -100.0 : double(int64_t(rng() % uint64_t(c.N))));
  alpha.set(0, 0, 1.0 / 37.0);
  d.poison();
  HostTensor lse = cpu_lse(a, w, c.with_r ? &r : nullptr);
  // D's rows are stored in whole 16-byte units (TMA clips at 16-byte granularity of the row): the last
  // row's padding up to round_up(N, 8) must exist too, as in a torch.empty(M, round_up(N, 8))[:, :N] view.
  const int64_t n16 = (c.N + 7) / 8 * 8;
  Mirror ga(a), gw(w), gr(r), gt(target), gal(alpha), gd(d, size_t(n16 - c.N) * dtype_size(c.t)), gl(lse);
  GemmEpilogueArgs h, g;
  h.a = a.view();
  h.w = w.view();
  h.d = d.view();
  h.lse = lse.view();
  h.target = target.view();
  g.a = ga.gpu;
  g.w = gw.gpu;
  g.d = gd.gpu;
  g.lse = gl.gpu;
  g.target = gt.gpu;
  if (c.with_r) {
    h.row_scale = r.view();
    g.row_scale = gr.gpu;
  }
  if (c.with_alpha) {
    h.alpha = alpha.view();
    g.alpha = gal.gpu;
  }
  GemmEpilogueOptions o{Epilogue::kCeBwd};
  o.tile = c.tile;
  o.n_slices = c.n_slices;
  Status st = run(g, o);
  ASSERT_TRUE(st) << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  ASSERT_TRUE(run(h, o));
  HostTensor got = gd.fetch();
  ENCORE_EXPECT_CLOSE(got, d, c.t, "d");
  for (int64_t m = 3; m < c.M; m += 7)
    for (int64_t n = 0; n < c.N; ++n) ASSERT_EQ(got.get(m, n), 0.0) << "ignored row " << m << ", column " << n;
  // The softmax part on its own (the one-hot entries dominate D's RMS): α·p = D + α·onehot against the
  // reference's, and each counted row sums to 0 (Σ p = 1), to a bf16 rounding of each of its terms.
  const double al = c.with_alpha ? 1.0 / 37.0 : 1.0;
  double num = 0, den = 0;
  for (int64_t m = 0; m < c.M; ++m) {
    const int64_t t = int64_t(target.get(0, m));
    if (t < 0) continue;
    double sum = 0, mag = 0;
    for (int64_t n = 0; n < c.N; ++n) {
      const double oh = n == t ? al : 0.0, gp = got.get(m, n) + oh, rp = d.get(m, n) + oh;
      num += (gp - rp) * (gp - rp);
      den += rp * rp;
      sum += got.get(m, n);
      mag += std::abs(got.get(m, n));
    }
    ASSERT_LE(std::abs(sum), 1e-2 * mag + 1e-6) << "row " << m << ": the softmax does not sum to 1";
  }
  EXPECT_LE(std::sqrt(num / std::max(den, 1e-300)), 1e-2) << "softmax part alpha * p, relative RMS";
  // Past round_up(N, 8) D's rows stay untouched (the d_pad columns). Columns [N, round_up(N, 8)) are
  // scratch: the H100/H200 TMA store clips a row at 16-byte granularity, not at N, so they may hold
  // the gradient of the zero-filled W rows; the documented contract (encore/gemm.hpp).
  for (int64_t m = 0; m + 1 < c.M; ++m)
    for (int64_t n = n16; n < got.row_stride; ++n) ASSERT_TRUE(std::isnan(got.get(m, n))) << "row " << m << " written at column " << n << " past round_up(N, 8)";
}

TEST_F(GemmCeGpu, CeBwdOnEveryTile) {
  for (GemmTile tile : {GemmTile::kCooperative128x256, GemmTile::kPingpong128x128})
    for (DType t : {DType::kBF16, DType::kFP16}) {
      run_ce_case({t, 1, 128, 64, tile, true, true});
      run_ce_case({t, 77, 1001, 72, tile, false, true, 8});  // N odd, padded D rows
      run_ce_case({t, 300, 4105, 128, tile, true, false});
      run_ce_case({t, 513, 768, 256, tile, false, false});
    }
}

TEST_F(GemmCeGpu, CeBwdGpt2Vocabulary) {
  run_ce_case({DType::kBF16, 130, 50257, 64, GemmTile::kPingpong128x128, true, true});
  run_ce_case({DType::kBF16, 130, 50257, 64, GemmTile::kAuto, false, true});
}

// N-slices: the one-hot column and D land where one launch puts them (targets in every slice).
TEST_F(GemmCeGpu, CeBwdNSlices) {
  for (GemmTile tile : {GemmTile::kCooperative128x256, GemmTile::kPingpong128x128})
    for (int slices : {2, 3, 64}) run_ce_case({DType::kBF16, 300, 3001, 72, tile, true, true, 0, slices});
}

// A device target outside [0, N) other than ignore_index: its row is NaN, the others are intact.
TEST_F(GemmCeGpu, CeBwdBadDeviceTargetGivesNanRow) {
  const int64_t M = 5, N = 200, K = 32;
  auto rng = make_rng(9);
  HostTensor a(DType::kBF16, M, K), w(DType::kBF16, N, K), target = HostTensor::vector(DType::kInt32, M), d(DType::kBF16, M, N);
  a.fill_normal(rng);
  w.fill_normal(rng, 0.0, 0.2);
  const int32_t ts[M] = {0, 200, 5, -1, -100};
  for (int64_t m = 0; m < M; ++m) target.set(0, m, ts[m]);
  HostTensor lse = cpu_lse(a, w, nullptr);
  d.poison();  // so that the ignored row's zeros are the kernel's
  Mirror ga(a), gw(w), gt(target), gd(d), gl(lse);
  GemmEpilogueArgs g;
  g.a = ga.gpu;
  g.w = gw.gpu;
  g.d = gd.gpu;
  g.lse = gl.gpu;
  g.target = gt.gpu;
  ASSERT_TRUE(run(g, GemmEpilogueOptions{Epilogue::kCeBwd}));
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  HostTensor got = gd.fetch();
  for (int64_t n = 0; n < N; ++n) {
    EXPECT_TRUE(std::isfinite(got.get(0, n)) && std::isfinite(got.get(2, n)));
    EXPECT_TRUE(std::isnan(got.get(1, n)) && std::isnan(got.get(3, n)));
    EXPECT_EQ(got.get(4, n), 0.0);
  }
}

// lse with stored logits at N odd: D's rows padded to 16 bytes, on every tile it has.
TEST_F(GemmCeGpu, LseWithLogitsAtOddN) {
  for (GemmTile tile : {GemmTile::kCooperative128x256, GemmTile::kPingpong128x128, GemmTile::kPingpong64x256})
    for (int64_t N : {int64_t(1001), int64_t(50257)}) {
      SCOPED_TRACE(std::string(gemm_tile_name(tile)) + " N " + std::to_string(N));
      const int64_t M = 77, K = 64, tn = tile == GemmTile::kPingpong128x128 ? 128 : 256;
      auto rng = make_rng(uint64_t(N));
      HostTensor a(DType::kBF16, M, K), w(DType::kBF16, N, K), d(DType::kBF16, M, N, (N + 7) / 8 * 8), part(DType::kFP32, M, (N + tn - 1) / tn),
          target = HostTensor::vector(DType::kInt32, M), tl = HostTensor::vector(DType::kFP32, M);
      a.fill_normal(rng);
      w.fill_normal(rng, 0.0, 0.2);
      for (int64_t m = 0; m < M; ++m) target.set(0, m, m % 7 == 3 ? -100.0 : double(int64_t(rng() % uint64_t(N))));
      d.poison();
      part.poison();
      tl.poison();
      Mirror ga(a), gw(w), gd(d, size_t((N + 7) / 8 * 8 - N) * 2), gp(part), gt(target), gtl(tl);  // D: the last row's padding too
      GemmEpilogueArgs h, g;
      h.a = a.view(), h.w = w.view(), h.d = d.view(), h.partials = part.view(), h.target = target.view(), h.target_logit = tl.view();
      g.a = ga.gpu, g.w = gw.gpu, g.d = gd.gpu, g.partials = gp.gpu, g.target = gt.gpu, g.target_logit = gtl.gpu;
      GemmEpilogueOptions o{Epilogue::kLse, int(tn)};
      if (tile == GemmTile::kPingpong64x256) o.tile = tile;
      Status st = run(g, o);
      ASSERT_TRUE(st) << st.to_string();
      ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
      ASSERT_TRUE(run(h, o));
      ENCORE_EXPECT_CLOSE(gd.fetch(), d, DType::kBF16, "d");
      auto rp = compare(gp.fetch(), part, Tolerance{2e-5, 2e-5, 2e-5});
      EXPECT_TRUE(compare_ok(rp, Tolerance{2e-5, 2e-5, 2e-5})) << "partials " << rp.rel_rms << " " << rp.first_bad;
      auto rt = compare(gtl.fetch(), tl, Tolerance{2e-5, 2e-5, 2e-5});
      EXPECT_TRUE(compare_ok(rt, Tolerance{2e-5, 2e-5, 2e-5})) << "target_logit " << rt.rel_rms << " " << rt.first_bad;
    }
}

// The stored-logits finisher: out of place (16-byte path at N % 8 == 0, scalar otherwise, a padded
// input) and in place, every dtype, against the CPU backend.
TEST_F(GemmCeGpu, CrossEntropyBwdFinisher) {
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32})
    for (int64_t N : {int64_t(4096), int64_t(1001), int64_t(50257)})
      for (bool with_alpha : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " N " + std::to_string(N) + (with_alpha ? " alpha" : ""));
        const int64_t M = 67;
        auto rng = make_rng(uint64_t(N) + uint64_t(t));
        HostTensor logits(t, M, N, (N + 7) / 8 * 8), out(t, M, N), target = HostTensor::vector(DType::kInt32, M),
            lse = HostTensor::vector(DType::kFP32, M), alpha = HostTensor::vector(DType::kFP32, 1);
        logits.fill_normal(rng, 0.0, 2.0);
        for (int64_t m = 0; m < M; ++m) {
          target.set(0, m, m % 5 == 1 ? -100.0 : double(int64_t(rng() % uint64_t(N))));
          lse.set(0, m, std::log(double(N)) + 2.0 + double(m % 3));
        }
        alpha.set(0, 0, 0.125);
        out.poison();
        Mirror gl(logits), go(out), gt(target), gs(lse), ga(alpha);
        CrossEntropyBwdArgs h{logits.view(), lse.view(), target.view(), with_alpha ? alpha.view() : TensorView{}, out.view()};
        CrossEntropyBwdArgs g{gl.gpu, gs.gpu, gt.gpu, with_alpha ? ga.gpu : TensorView{}, go.gpu};
        Status st = run(g);
        ASSERT_TRUE(st) << st.to_string();
        ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
        ASSERT_TRUE(run(h));
        ENCORE_EXPECT_CLOSE(go.fetch(), out, t, "dlogits");
        g.dlogits = gl.gpu;  // in place over the device logits
        ASSERT_TRUE(run(g));
        ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
        ENCORE_EXPECT_CLOSE(gl.fetch(), out, t, "dlogits in place");
      }
}

}  // namespace
}  // namespace encore::test
