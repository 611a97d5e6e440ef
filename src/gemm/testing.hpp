// Internal helper of the GEMM-epilogue family for tests, `encore check` and benchmarks (never in
// include/): the host operands of one epilogue problem, built from its catalogue row's operand
// flags (encore/gemm_epilogues.def), so every row is exercised without code of its own. Inputs are
// random (never all zero), outputs poisoned (NaN) so an unwritten element fails a comparison.
#pragma once
#include <algorithm>
#include <cmath>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "encore/gemm.hpp"
#include "testing/host_tensor.hpp"

namespace encore::gemm {

struct GemmCaseChoice {
  bool row_scale = true;  // give an optional row scale
  bool d = true;          // give an optional D
  bool target = true;     // give the optional targets
  GemmTile tile = GemmTile::kAuto;  // tile-partials rows: cooperative / 64x256 mean partial_tile_n 256
  bool c2 = true;                   // give an optional second tile input
  bool alpha = true;                // give an optional alpha
};

struct GemmCase {
  using Tensor = std::optional<test::HostTensor>;
  GemmEpilogueOptions opts;
  Tensor a, w, d, aux, c, c2, zdz, gamma, row_scale, pos, freq, alpha, partials, target, target_logit, lse;

  // Each GemmEpilogueArgs field with the case's tensor behind it (absent ones left out), and
  // whether the epilogue writes it.
  struct Field {
    const char* name;
    TensorView GemmEpilogueArgs::*arg;
    test::HostTensor* tensor;
    bool output;
  };
  std::vector<Field> fields() {
    std::vector<Field> f;
    auto add = [&](const char* name, TensorView GemmEpilogueArgs::*arg, Tensor& t, bool output) {
      if (t) f.push_back({name, arg, &*t, output});
    };
    add("a", &GemmEpilogueArgs::a, a, false);
    add("w", &GemmEpilogueArgs::w, w, false);
    add("d", &GemmEpilogueArgs::d, d, true);
    add("aux", &GemmEpilogueArgs::aux, aux, true);
    add("c", &GemmEpilogueArgs::c, c, false);
    add("c2", &GemmEpilogueArgs::c2, c2, false);
    add("zdz", &GemmEpilogueArgs::zdz, zdz, false);
    add("gamma", &GemmEpilogueArgs::gamma, gamma, false);
    add("row_scale", &GemmEpilogueArgs::row_scale, row_scale, false);
    add("pos", &GemmEpilogueArgs::pos, pos, false);
    add("freq", &GemmEpilogueArgs::freq, freq, false);
    add("alpha", &GemmEpilogueArgs::alpha, alpha, false);
    add("partials", &GemmEpilogueArgs::partials, partials, true);
    add("target", &GemmEpilogueArgs::target, target, false);
    add("target_logit", &GemmEpilogueArgs::target_logit, target_logit, true);
    add("lse", &GemmEpilogueArgs::lse, lse, false);
    return f;
  }
  GemmEpilogueArgs host_args() {
    GemmEpilogueArgs g;
    for (const Field& f : fields()) g.*f.arg = f.tensor->view();
    return g;
  }
};

// The operands of epilogue e over A [M, K] and W [N, K] of dtype t (matrix rows padded by `pad`
// elements); opts.epilogue, partial_tile_n, head_dim (128) and tile set. N must suit the row (even
// for column pairs; a multiple of 128 for head partials on CUDA). Rows with W [K, N]
// (kOperandWeightKN) get it so; rows with A stored [K, M] (kOperandATransposed) get it so, with M
// rounded up to a multiple of 8 (its rows are M-contiguous: 16-byte TMA rows on CUDA).
inline GemmCase make_gemm_case(Epilogue e, DType t, int64_t M, int64_t N, int64_t K, int64_t pad, const GemmCaseChoice& ch,
                               std::mt19937_64& rng) {
  using test::HostTensor;
  const uint32_t ops = gemm_epilogue_info(e)->operands;
  auto uses = [ops](uint32_t flags) { return (ops & flags) != 0; };
  GemmCase gc;
  gc.opts.epilogue = e;
  if (uses(kOperandTilePartials | kOperandColumnPartials)) {
    gc.opts.partial_tile_n = ch.tile == GemmTile::kCooperative128x256 || ch.tile == GemmTile::kPingpong64x256 ? 256 : 128;
    if (ch.tile == GemmTile::kPingpong64x256) gc.opts.tile = ch.tile;
  } else {
    gc.opts.tile = ch.tile;
  }
  auto output = [](HostTensor h) {
    h.poison();
    return h;
  };
  if (uses(kOperandATransposed)) {
    M = (M + 7) / 8 * 8;
    gc.a = HostTensor(t, K, M, M + pad);
  } else {
    gc.a = HostTensor(t, M, K, K + pad);
  }
  gc.a->fill_normal(rng);
  if (uses(kOperandWeightKN)) gc.w = HostTensor(t, K, N, N + pad);  // acc = A · W
  else gc.w = HostTensor(t, N, K, K + pad);
  gc.w->fill_normal(rng, 0.0, 1.0 / std::sqrt(double(K)));
  if (uses(kOperandD) || (uses(kOperandDOptional) && ch.d)) gc.d = output(HostTensor(t, M, N, N + pad));
  if (uses(kOperandRowScale) || (uses(kOperandRowScaleOptional) && ch.row_scale)) {
    gc.row_scale = HostTensor::vector(DType::kFP32, M);
    gc.row_scale->fill_uniform(rng, 0.25, 2.25);
  }
  if (uses(kOperandC | kOperandCPairs)) {
    const int64_t cn = uses(kOperandCPairs) ? 2 * N : N;
    gc.c = HostTensor(t, M, cn, cn + pad);
    gc.c->fill_normal(rng);
  }
  if (uses(kOperandC2Optional) && ch.c2) {
    gc.c2 = HostTensor(t, M, N, N + pad);
    gc.c2->fill_normal(rng);
  }
  if (uses(kOperandZdz)) {
    gc.zdz = HostTensor::vector(DType::kFP32, M);
    gc.zdz->fill_normal(rng);
  }
  if (uses(kOperandGamma)) {
    gc.gamma = HostTensor::vector(t, N);
    gc.gamma->fill_normal(rng, 1.0, 0.2);
  }
  if (uses(kOperandAux | kOperandAuxHalf | kOperandAuxDouble)) {
    const int64_t aux_n = uses(kOperandAuxHalf) ? N / 2 : uses(kOperandAuxDouble) ? 2 * N : N;
    gc.aux = output(HostTensor(t, M, aux_n, aux_n + pad));
  }
  if (uses(kOperandPos)) {
    gc.pos = HostTensor::vector(DType::kInt32, M);
    for (int64_t m = 0; m < M; ++m) gc.pos->set(0, m, double(int64_t(rng() % 200000)));  // large positions: exact phase reduction
  }
  if (uses(kOperandFreq)) {
    gc.freq = HostTensor::vector(DType::kFP32, N);
    const int head_dim = N % 128 == 0 ? 128 : 8;
    const int heads = int(N / head_dim);
    (void)rope_freq_turns(heads, std::max(1, heads * 2 / 3), head_dim, 500000.0, gc.freq->view());
  }
  if (uses(kOperandTilePartials)) {
    const int64_t tiles = (N + gc.opts.partial_tile_n - 1) / gc.opts.partial_tile_n;
    gc.partials = output(HostTensor(DType::kFP32, M, tiles, tiles + 3));
  }
  if (uses(kOperandColumnPartials)) {  // packed rows (the CUDA kernel's layout)
    const int64_t cols = (N + gc.opts.partial_tile_n - 1) / gc.opts.partial_tile_n * gc.opts.partial_tile_n;
    gc.partials = output(HostTensor(DType::kFP32, gemm_column_partials_rows(M), cols));
  }
  if (uses(kOperandHeadPartials)) {
    gc.opts.head_dim = 128;
    gc.partials = output(HostTensor(DType::kFP32, M, std::max<int64_t>(N / 128, 1)));
  }
  if (uses(kOperandTarget) && ch.target) {
    gc.target = HostTensor::vector(DType::kInt32, M);
    for (int64_t m = 0; m < M; ++m)
      gc.target->set(0, m, m % 7 == 3 ? double(gc.opts.ignore_index) : double(int64_t(rng() % uint64_t(N))));
    gc.target_logit = output(HostTensor::vector(DType::kFP32, M));
  }
  if (uses(kOperandLse)) {  // kCeBwd: targets always (ignore_index rows among them), lse near the rows' true values
    gc.target = HostTensor::vector(DType::kInt32, M);
    gc.lse = HostTensor::vector(DType::kFP32, M);
    for (int64_t m = 0; m < M; ++m) {
      gc.target->set(0, m, m % 7 == 3 ? double(gc.opts.ignore_index) : double(int64_t(rng() % uint64_t(N))));
      gc.lse->set(0, m, std::log(double(N)) + 1.0 + double(int64_t(rng() % 1000)) / 1000.0);
    }
  }
  if (uses(kOperandAlpha) || (uses(kOperandAlphaOptional) && ch.alpha)) {
    gc.alpha = HostTensor::vector(DType::kFP32, 1);
    gc.alpha->set(0, 0, -1.25);
  }
  return gc;
}

}  // namespace encore::gemm
