// CUDA GEMM-epilogue kernels (CUTLASS Sm90 + encore's EVT nodes) against the CPU backend, for every
// epilogue and both finishers: bf16 and fp16, M tails (1, 77, 300), N and K not multiples of the
// tile, padded row strides, every output poisoned (NaN) before the run on both backends, fresh
// random inputs each run. bf16/fp16 outputs use the dtype's tolerance; fp32 statistics (partials,
// target logits, r, lse, loss) a fp32 one (the GPU accumulates in fp32, the CPU in fp64).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "encore/gemm.hpp"
#include "gemm/testing.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {
namespace {

constexpr Tolerance kStatTol{2e-5, 2e-5, 2e-5};

class GemmEpilogueGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

// One operand on both backends: the host tensor (the CPU run reads/writes it), a copy of its
// initial contents on the device, and the CPU result kept apart for the comparison.
struct Operand {
  HostTensor host;
  std::unique_ptr<DeviceBuffer> dev;
  TensorView cpu_view, gpu_view;
  void init(HostTensor h) {
    host = std::move(h);
    dev = std::make_unique<DeviceBuffer>(host.storage_bytes());
    gpu_view = to_device(host, *dev);
    cpu_view = host.view();
  }
  HostTensor fetch() const {
    HostTensor out = host;
    from_device(out, *dev);
    return out;
  }
};

struct Case {
  Epilogue e;
  DType t;
  int64_t M, N, K, pad;
  bool with_row_scale = true, with_d = true, with_target = true;
  GemmTile tile = GemmTile::kAuto;  // for residual_sqsum_aux / lse: cooperative = partial_tile_n 256
  int swizzle = 0;
  GemmRaster raster = GemmRaster::kAuto;
  int n_slices = 0;
};

std::string describe(const Case& c) {
  return std::string(epilogue_name(c.e)) + " " + dtype_name(c.t) + " M" + std::to_string(c.M) + " N" + std::to_string(c.N) + " K" +
         std::to_string(c.K) + " pad" + std::to_string(c.pad) + (c.with_row_scale ? "" : " no-r") + (c.with_d ? "" : " no-d") +
         (c.with_target ? "" : " no-target") + " tile " + gemm_tile_name(c.tile) + " swizzle " + std::to_string(c.swizzle) + " raster " +
         std::to_string(int(c.raster)) + " n_slices " + std::to_string(c.n_slices);
}

void run_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  auto rng = make_rng(uint64_t(c.M * 31 + c.N * 7 + c.K) + uint64_t(c.e));
  // The operands the catalogue row declares (gemm_epilogues.def): inputs random, outputs poisoned.
  // with_row_scale also stands for the other optional inputs (c2, alpha)
  gemm::GemmCase gc = gemm::make_gemm_case(c.e, c.t, c.M, c.N, c.K, c.pad,
                                           {c.with_row_scale, c.with_d, c.with_target, c.tile, c.with_row_scale, c.with_row_scale}, rng);
  GemmEpilogueOptions o = gc.opts;
  o.swizzle = c.swizzle;
  o.raster = c.raster;
  o.n_slices = c.n_slices;
  struct Bound {
    Operand op;
    const char* name;
    bool output;
  };
  std::vector<Bound> bound;
  bound.reserve(16);  // the CPU views point into each Operand's host tensor
  GemmEpilogueArgs g, h;
  for (const gemm::GemmCase::Field& f : gc.fields()) {
    Bound& b = bound.emplace_back();
    b.op.init(*f.tensor);
    b.output = f.output;
    g.*f.arg = b.op.gpu_view;
    h.*f.arg = b.op.cpu_view;
    b.name = f.name;
  }
  Status st = run(g, o);
  ASSERT_TRUE(st) << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  Status sc = run(h, o);
  ASSERT_TRUE(sc) << sc.to_string();
  for (Bound& b : bound) {
    if (!b.output) continue;
    if (b.op.host.dtype == c.t) {  // d, aux: the dtype's tolerance
      ENCORE_EXPECT_CLOSE(b.op.fetch(), b.op.host, c.t, b.name);
    } else {  // fp32 statistics
      // Each element may also be off by half a unit of c.t's last place of the largest statistic: a
      // statistic built from an intermediate that one backend rounds to c.t (aux = x̂⊙γ) can see that
      // rounding flip (rmsnorm_bwd's dγ partials on the H200: one element of 3200 off by 3.1e-5 at
      // -0.0154, rel_rms 1e-6).
      Tolerance tol = kStatTol;
      const double half_ulp = c.t == DType::kBF16 ? 0x1p-9 : c.t == DType::kFP16 ? 0x1p-12 : 0.0;
      double largest = 0;
      for (int64_t i = 0; i < b.op.host.rows; ++i)
        for (int64_t j = 0; j < b.op.host.cols; ++j) largest = std::max(largest, std::fabs(b.op.host.get(i, j)));
      tol.atol += half_ulp * largest;
      auto res_ = compare(b.op.fetch(), b.op.host, tol);
      EXPECT_TRUE(compare_ok(res_, tol)) << b.name << ": rel_rms=" << res_.rel_rms << " bad=" << res_.bad << " " << res_.first_bad;
    }
  }
}

const int64_t kShapes[][4] = {{1, 256, 64, 0}, {77, 136, 72, 8}, {300, 520, 1000, 0}, {512, 768, 256, 16}};

const GemmTile kTiles[] = {GemmTile::kCooperative128x256, GemmTile::kPingpong128x128};

// Every row of the catalogue on every tile it is instantiated on, with and without its optional
// operands: a new epilogue is covered by its row alone.
TEST_F(GemmEpilogueGpu, EveryEpilogueOnEveryTile) {
  const std::pair<uint8_t, GemmTile> tiles[] = {{kTileCoop256, GemmTile::kCooperative128x256},
                                                {kTilePp128, GemmTile::kPingpong128x128},
                                                {kTilePp64, GemmTile::kPingpong64x256}};
  const int64_t shapes[][4] = {{1, 128, 64, 0}, {77, 256, 72, 8}, {300, 640, 1000, 0}};
  for (int i = 0; i < gemm_epilogue_count(); ++i) {
    const Epilogue e = Epilogue(i);
    const GemmEpilogueInfo* info = gemm_epilogue_info(e);
    const bool optional =
        info->operands & (kOperandDOptional | kOperandRowScaleOptional | kOperandTarget | kOperandC2Optional | kOperandAlphaOptional);
    for (auto [flag, tile] : tiles) {
      if (!(info->tiles & flag)) continue;
      for (DType t : {DType::kBF16, DType::kFP16})
        for (const auto& s : shapes) {
          run_case({e, t, s[0], s[1], s[2], s[3], true, true, true, tile});
          if (optional) run_case({e, t, s[0], s[1], s[2], s[3], false, !(info->operands & kOperandDOptional), false, tile});
        }
    }
  }
}

TEST_F(GemmEpilogueGpu, RowScaleAndScalarScale) {
  for (GemmTile tile : kTiles)
    for (Epilogue e : {Epilogue::kRowScale, Epilogue::kScalarScale})
      for (DType t : {DType::kBF16, DType::kFP16})
        for (const auto& s : kShapes) run_case({e, t, s[0], s[1], s[2], s[3], true, true, true, tile});
}

TEST_F(GemmEpilogueGpu, ResidualSqsumAux) {
  for (GemmTile tile : kTiles)
    for (DType t : {DType::kBF16, DType::kFP16})
      for (const auto& s : kShapes) run_case({Epilogue::kResidualSqsumAux, t, s[0], s[1], s[2], s[3], true, true, true, tile});
}

TEST_F(GemmEpilogueGpu, SwigluWithAndWithoutRowScale) {
  for (GemmTile tile : kTiles)
    for (DType t : {DType::kBF16, DType::kFP16})
      for (const auto& s : kShapes) {
        run_case({Epilogue::kSwiglu, t, s[0], s[1], s[2], s[3], true, true, true, tile});
        run_case({Epilogue::kSwiglu, t, s[0], s[1], s[2], s[3], false, true, true, tile});
      }
}

TEST_F(GemmEpilogueGpu, Rope) {
  for (GemmTile tile : kTiles)
    for (DType t : {DType::kBF16, DType::kFP16})
      for (const auto& s : kShapes) {
        run_case({Epilogue::kRope, t, s[0], s[1], s[2], s[3], true, true, true, tile});
        run_case({Epilogue::kRope, t, s[0], s[1], s[2], s[3], false, true, true, tile});
      }
}

// The RoPE backward (inverse rotation) on its one tile, with and without the row scale, large
// positions (make_gemm_case draws them up to 200000) and V-like heads (f = 0) included.
TEST_F(GemmEpilogueGpu, RopeBwd) {
  for (DType t : {DType::kBF16, DType::kFP16})
    for (const auto& s : kShapes) {
      run_case({Epilogue::kRopeBwd, t, s[0], s[1], s[2], s[3], true, true, true, GemmTile::kPingpong128x128});
      run_case({Epilogue::kRopeBwd, t, s[0], s[1], s[2], s[3], false, true, true, GemmTile::kAuto});
    }
}

TEST_F(GemmEpilogueGpu, QkvHeadSqsum) {
  // One head per 128x128 ping-pong tile, two per cooperative 128x256 tile (N = 640: the last tile
  // holds one head).
  for (GemmTile tile : {GemmTile::kPingpong128x128, GemmTile::kCooperative128x256})
    for (DType t : {DType::kBF16, DType::kFP16}) {
      run_case({Epilogue::kQkvHeadSqsum, t, 1, 128, 64, 0, true, true, true, tile});
      run_case({Epilogue::kQkvHeadSqsum, t, 300, 640, 1000, 8, true, true, true, tile});
      run_case({Epilogue::kQkvHeadSqsum, t, 513, 768, 256, 0, true, true, true, tile});
    }
}

TEST_F(GemmEpilogueGpu, LseVariants) {
  for (GemmTile tile : kTiles) {
    for (DType t : {DType::kBF16, DType::kFP16})
      for (const auto& s : kShapes) {
        run_case({Epilogue::kLse, t, s[0], s[1], s[2], s[3], true, true, true, tile});
        run_case({Epilogue::kLse, t, s[0], s[1], s[2], s[3], false, false, false, tile});
      }
    run_case({Epilogue::kLse, DType::kBF16, 200, 4104, 128, 0, true, false, true, tile});  // many tiles, ragged last tile
  }
}

// The ping-pong 64x256 tile, on the epilogues that have it.
TEST_F(GemmEpilogueGpu, Pingpong64x256) {
  const GemmTile t64 = GemmTile::kPingpong64x256;
  for (DType t : {DType::kBF16, DType::kFP16})
    for (const auto& s : kShapes) {
      run_case({Epilogue::kRowScale, t, s[0], s[1], s[2], s[3], true, true, true, t64});
      run_case({Epilogue::kSwiglu, t, s[0], s[1], s[2], s[3], true, true, true, t64});
      run_case({Epilogue::kResidualSqsumAux, t, s[0], s[1], s[2], s[3], true, true, true, t64});
      run_case({Epilogue::kLse, t, s[0], s[1], s[2], s[3], true, true, true, t64});
      run_case({Epilogue::kLse, t, s[0], s[1], s[2], s[3], false, false, false, t64});
    }
}

// Every tile-scheduler order and a few swizzles on grids of many tiles in both directions (the
// scheduler maps work to tiles differently in each; every output must still be written once).
TEST_F(GemmEpilogueGpu, SchedulerSettings) {
  for (GemmRaster r : {GemmRaster::kAlongM, GemmRaster::kAlongN})
    for (int z : {1, 2, 8})
      for (GemmTile tile : {GemmTile::kCooperative128x256, GemmTile::kPingpong64x256}) {
        Case c{Epilogue::kSwiglu, DType::kBF16, 700, 2056, 64, 0, true, true, true, tile};
        c.swizzle = z;
        c.raster = r;
        run_case(c);
        c.e = Epilogue::kLse;
        run_case(c);
      }
}

// Launches over N-slices (GemmEpilogueOptions::n_slices): every epilogue on every tile it has, a
// ragged last tile, padded rows, slice counts that split the tiles unevenly or exceed them; the
// column-indexed operands (D, C, aux at half width, gamma, freq, partials) and the LSE target select
// (targets in every slice, ignore_index rows) must land where one launch puts them.
TEST_F(GemmEpilogueGpu, NSlices) {
  const Epilogue all[] = {Epilogue::kRowScale, Epilogue::kScalarScale, Epilogue::kResidualSqsumAux, Epilogue::kSwiglu,
                          Epilogue::kRope, Epilogue::kQkvHeadSqsum, Epilogue::kLse};
  for (Epilogue e : all)
    for (GemmTile tile : {GemmTile::kCooperative128x256, GemmTile::kPingpong128x128, GemmTile::kPingpong64x256}) {
      const bool has_pp64 = e == Epilogue::kRowScale || e == Epilogue::kSwiglu || e == Epilogue::kResidualSqsumAux || e == Epilogue::kLse;
      if (tile == GemmTile::kPingpong64x256 && !has_pp64) continue;
      const int64_t N = e == Epilogue::kQkvHeadSqsum ? 1280 : 1288;  // per-head partials need whole heads
      for (int slices : {2, 3, 64}) {
        Case c{e, DType::kBF16, 300, N, 72, 8, true, true, true, tile};
        c.n_slices = slices;
        run_case(c);
      }
    }
  Case c{Epilogue::kLse, DType::kFP16, 129, 3000, 64, 0, true, false, true, GemmTile::kPingpong128x128};
  c.n_slices = 5;
  run_case(c);
}

// Auto slicing: a problem where each CTA would walk more than 200 tiles in one launch (2 M-tiles x
// 13300 N-tiles of 128 on 132 SMs) runs in slices; LSE with targets (a vocabulary of 1.7M) and row_scale.
// Without D the LSE takes any vocabulary width (GPT-2's 50257, LLaMA's 128256 + 1), on every tile.
TEST_F(GemmEpilogueGpu, LseWithoutLogitsTakesAnyN) {
  for (GemmTile tile : {GemmTile::kCooperative128x256, GemmTile::kPingpong128x128, GemmTile::kPingpong64x256}) {
    run_case({Epilogue::kLse, DType::kBF16, 77, 4105, 72, 8, true, false, true, tile});
    run_case({Epilogue::kLse, DType::kFP16, 130, 50257, 64, 0, false, false, true, tile});
  }
  run_case({Epilogue::kLse, DType::kBF16, 3, 128257, 64, 0, true, false, true, GemmTile::kPingpong128x128});
}

TEST_F(GemmEpilogueGpu, AutoSlices) {
  run_case({Epilogue::kLse, DType::kBF16, 3, 13300 * 128 - 64, 16, 0, true, false, true, GemmTile::kPingpong128x128});
  run_case({Epilogue::kRowScale, DType::kBF16, 2, 13300 * 128 - 64, 16, 0, true, true, true, GemmTile::kPingpong128x128});
}

// The tile kAuto picks must run too (it is what users get).
TEST_F(GemmEpilogueGpu, AutoTile) {
  for (Epilogue e : {Epilogue::kRowScale, Epilogue::kSwiglu, Epilogue::kRope}) run_case({e, DType::kBF16, 2048, 8192, 16, 0});
}

// Reductions are deterministic (fixed-order sums, no atomics): two launches on the same inputs give
// bitwise equal partials, outputs and target logits.
TEST_F(GemmEpilogueGpu, PartialsAreDeterministic) {
  auto rng = make_rng(11);
  const int64_t M = 300, N = 1000, K = 512;
  HostTensor a(DType::kBF16, M, K), w(DType::kBF16, N, K), c(DType::kBF16, M, N), gamma = HostTensor::vector(DType::kBF16, N);
  a.fill_normal(rng);
  w.fill_normal(rng, 0.0, 0.05);
  c.fill_normal(rng);
  gamma.fill_normal(rng, 1.0, 0.1);
  HostTensor target = HostTensor::vector(DType::kInt32, M);
  for (int64_t m = 0; m < M; ++m) target.set(0, m, double(m % N));
  DeviceBuffer da(a.storage_bytes()), dw(w.storage_bytes()), dc(c.storage_bytes()), dg(gamma.storage_bytes()), dt(target.storage_bytes());
  const TensorView va = to_device(a, da), vw = to_device(w, dw), vc = to_device(c, dc), vg = to_device(gamma, dg), vt = to_device(target, dt);
  for (Epilogue e : {Epilogue::kResidualSqsumAux, Epilogue::kLse}) {
    SCOPED_TRACE(epilogue_name(e));
    HostTensor d(DType::kBF16, M, N), aux(DType::kBF16, M, N), parts(DType::kFP32, M, (N + 127) / 128),
        logit = HostTensor::vector(DType::kFP32, M);
    std::vector<HostTensor> runs;
    for (int rep = 0; rep < 2; ++rep) {
      DeviceBuffer dd(d.storage_bytes()), dx(aux.storage_bytes()), dp(parts.storage_bytes()), dl(logit.storage_bytes());
      GemmEpilogueArgs g;
      g.a = va;
      g.w = vw;
      g.d = to_device(d, dd);
      g.partials = to_device(parts, dp);
      if (e == Epilogue::kResidualSqsumAux) {
        g.c = vc;
        g.gamma = vg;
        g.aux = to_device(aux, dx);
      } else {
        g.target = vt;
        g.target_logit = to_device(logit, dl);
      }
      ASSERT_TRUE(run(g, GemmEpilogueOptions{e}));
      ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
      for (auto [h, b] : {std::pair<HostTensor*, DeviceBuffer*>{&d, &dd}, {&parts, &dp}, {&logit, &dl}}) {
        HostTensor out = *h;
        from_device(out, *b);
        runs.push_back(out);
      }
    }
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(runs[i].bytes, runs[i + 3].bytes) << "output " << i << " differs between launches";
  }
}

// QK-norm + RoPE finish on CUDA against the CPU backend on the same qkv and partials.
TEST_F(GemmEpilogueGpu, QkNormRopeFinish) {
  auto rng = make_rng(31);
  for (DType t : {DType::kBF16, DType::kFP16}) {
    SCOPED_TRACE(dtype_name(t));
    const int hq = 8, hkv = 2, hd = 128, heads = hq + 2 * hkv;
    const int64_t M = 77, N = int64_t(heads) * hd;
    HostTensor qkv(t, M, N, N + 8), part(DType::kFP32, M, heads), qw = HostTensor::vector(t, hd), kw = HostTensor::vector(t, hd);
    HostTensor pos = HostTensor::vector(DType::kInt32, M), freq = HostTensor::vector(DType::kFP32, N);
    qkv.fill_normal(rng);
    part.fill_uniform(rng, 10.0, 300.0);
    qw.fill_normal(rng, 1.0, 0.2);
    kw.fill_normal(rng, 1.0, 0.2);
    for (int64_t m = 0; m < M; ++m) pos.set(0, m, double(int64_t(rng() % 100000)));
    ASSERT_TRUE(rope_freq_turns(heads, hq + hkv, hd, 1000000.0, freq.view()));
    DeviceBuffer dq(qkv.storage_bytes()), dp(part.storage_bytes()), dqw(qw.storage_bytes()), dkw(kw.storage_bytes()), dpos(pos.storage_bytes()),
        df(freq.storage_bytes());
    QkNormRopeArgs g{to_device(qkv, dq), to_device(part, dp), to_device(qw, dqw), to_device(kw, dkw), to_device(pos, dpos), to_device(freq, df)};
    const QkNormRopeOptions o{hq, hkv, hd, 1e-6f};
    Status st = run(g, o);
    ASSERT_TRUE(st) << st.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    HostTensor cpu = qkv;
    ASSERT_TRUE(run(QkNormRopeArgs{cpu.view(), part.view(), qw.view(), kw.view(), pos.view(), freq.view()}, o));
    HostTensor gpu = qkv;
    from_device(gpu, dq);
    ENCORE_EXPECT_CLOSE(gpu, cpu, t, "qkv");
  }
}

// Finishers on device data against the CPU ones over the same partials.
TEST_F(GemmEpilogueGpu, Finishers) {
  auto rng = make_rng(5);
  const int64_t M = 333, T = 17;
  HostTensor parts(DType::kFP32, M, T, T + 5);
  parts.fill_uniform(rng, 0.0, 40.0);
  for (int64_t t = 0; t < T; ++t) parts.set(5, t, -INFINITY);  // an all -inf row: lse -inf
  HostTensor target = HostTensor::vector(DType::kInt32, M), logit = HostTensor::vector(DType::kFP32, M);
  for (int64_t m = 0; m < M; ++m) {
    target.set(0, m, m % 5 == 0 ? -100.0 : double(m % 11));
    logit.set(0, m, double(m % 13) * 0.5);
  }
  HostTensor r = HostTensor::vector(DType::kFP32, M), lse = r, loss = r;
  r.poison();
  lse.poison();
  loss.poison();
  DeviceBuffer dp(parts.storage_bytes()), dt(target.storage_bytes()), dl(logit.storage_bytes()), dr(r.storage_bytes()),
      dlse(lse.storage_bytes()), dloss(loss.storage_bytes());
  RmsFinalReduceArgs g1{to_device(parts, dp), to_device(r, dr)};
  ASSERT_TRUE(run(g1, 4096, 1e-5f));
  HostTensor r_cpu = r;
  ASSERT_TRUE(run(RmsFinalReduceArgs{parts.view(), r_cpu.view()}, 4096, 1e-5f));
  HostTensor r_gpu = r;
  from_device(r_gpu, dr);
  // row 5 is -inf: r = rsqrt(-inf) = NaN on both; compare the others
  r_gpu.set(0, 5, 0.0);
  r_cpu.set(0, 5, 0.0);
  ENCORE_EXPECT_CLOSE(r_gpu, r_cpu, DType::kFP32, "r");

  LseFinishArgs g2{g1.partials, to_device(lse, dlse), to_device(target, dt), to_device(logit, dl), to_device(loss, dloss)};
  ASSERT_TRUE(run(g2));
  HostTensor lse_cpu = lse, loss_cpu = loss;
  ASSERT_TRUE(run(LseFinishArgs{parts.view(), lse_cpu.view(), target.view(), logit.view(), loss_cpu.view()}));
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  HostTensor lse_gpu = lse, loss_gpu = loss;
  from_device(lse_gpu, dlse);
  from_device(loss_gpu, dloss);
  EXPECT_TRUE(std::isinf(lse_gpu.get(0, 5)) && lse_gpu.get(0, 5) < 0);
  lse_gpu.set(0, 5, 0.0);
  lse_cpu.set(0, 5, 0.0);
  loss_gpu.set(0, 5, 0.0);
  loss_cpu.set(0, 5, 0.0);
  auto r1 = compare(lse_gpu, lse_cpu, kStatTol), r2 = compare(loss_gpu, loss_cpu, kStatTol);
  EXPECT_TRUE(compare_ok(r1, kStatTol)) << "lse " << r1.first_bad << " rel_rms " << r1.rel_rms;
  EXPECT_TRUE(compare_ok(r2, kStatTol)) << "loss " << r2.first_bad << " rel_rms " << r2.rel_rms;
}

TEST_F(GemmEpilogueGpu, RefusesUnalignedShapes) {
  HostTensor a(DType::kBF16, 4, 12), w(DType::kBF16, 8, 12), d(DType::kBF16, 4, 8);
  DeviceBuffer da(a.storage_bytes()), dw(w.storage_bytes()), dd(d.storage_bytes()), dr(16);
  const Device gpu{DeviceType::kCUDA, 0};
  GemmEpilogueArgs g;
  g.a = a.view(da.ptr, gpu);
  g.w = w.view(dw.ptr, gpu);
  g.d = d.view(dd.ptr, gpu);
  g.row_scale = TensorView::contiguous(dr.ptr, DType::kFP32, {4}, gpu);
  Status st = run(g, GemmEpilogueOptions{Epilogue::kRowScale});
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("K = 12 must be a multiple of 8"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace encore::test
