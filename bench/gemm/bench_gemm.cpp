// Suite "gemm_epilogue": every CUDA GEMM-epilogue kernel against cuBLAS's plain GEMM of the same
// shape in the same run (the speed of light of a fused epilogue), and the GEMM-residual-RMSNorm-GEMM
// forward chain (residual_sqsum_aux -> rms_final_reduce -> row_scale) against the two
// cuBLAS GEMMs alone and against the unfused path (cuBLAS GEMM, encore add_rms_norm, cuBLAS GEMM),
// on each tile configuration, at the LLaMA 1B / 8B / 70B sizes with M = 8192 and 16384 tokens, bf16;
// the LM head (vocab 128256) for LSE; and the shifted block forward against its four cuBLAS GEMMs.
// Weights are [N, K] (out x in); inputs rotate so the working set exceeds L2.
#include <cublas_v2.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"
#include "encore/gemm.hpp"
#include "encore/blocks/llama.hpp"
#include "encore/norm.hpp"

namespace encore::bench {
namespace {

const Device kDev{DeviceType::kCUDA, 0};
constexpr DType kT = DType::kBF16;

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

// One rotation set: every operand any epilogue reads or writes, at fixed offsets; `ops` (the row's
// operand flags) sizes the optional tiles: C and aux [M, N] ([M, 2N] for packed pairs), c2 [M, N].
struct Layout {
  int64_t M = 0, N = 0, K = 0;
  size_t a = 0, w = 0, d = 0, c = 0, c2 = 0, aux = 0, gamma = 0, r = 0, partials = 0, pos = 0, freq = 0, target = 0, logit = 0, bytes = 0;
  int64_t tiles = 0;
  Layout(int64_t m, int64_t n, int64_t k, uint32_t ops) : M(m), N(n), K(k) {
    tiles = (N + 127) / 128;
    size_t off = 0;
    auto take = [&](size_t bytes) { size_t at = off; off = align256(off + bytes); return at; };
    a = take(size_t(M * K) * 2);
    w = take(size_t(N * K) * 2);  // [N, K] or [K, N] (kOperandWeightKN)
    d = take(size_t(M * N) * 2);  // also cuBLAS's output
    c = (ops & (kOperandC | kOperandCPairs)) ? take(size_t(M * N) * 2 * ((ops & kOperandCPairs) ? 2 : 1)) : 0;
    c2 = (ops & kOperandC2Optional) ? take(size_t(M * N) * 2) : 0;
    aux = (ops & (kOperandAux | kOperandAuxHalf | kOperandAuxDouble)) ? take(size_t(M * N) * 2 * ((ops & kOperandAuxDouble) ? 2 : 1)) : 0;
    gamma = take(size_t(N) * 2);
    r = take(size_t(M) * 4);  // r = 1; also zdz and alpha
    // tile partials [M, ceil(N / 128)] or column partials [ceil(M / 128), round_up(N, 256)]
    partials = take(std::max(size_t(M * tiles), size_t(gemm_column_partials_rows(M) * ((N + 255) / 256 * 256))) * 4);
    pos = take(size_t(M) * 4);
    freq = take(size_t(N) * 4);
    target = take(size_t(M) * 4);
    logit = take(size_t(M) * 4);
    bytes = off;
  }
};

// Valid values for the operands that random bits would break (r, positions, frequencies, targets).
void fill_valid(const Rotation& rot, const Layout& L) {
  std::vector<float> ones(size_t(L.M), 1.0f), freq(size_t(L.N));
  std::vector<int32_t> pos(size_t(L.M)), target(size_t(L.M));
  for (int64_t m = 0; m < L.M; ++m) {
    pos[size_t(m)] = int32_t(m % 8192);
    target[size_t(m)] = int32_t((m * 7919) % L.N);
  }
  const int heads = int(L.N / 128);
  if (!rope_freq_turns(heads, heads * 2 / 3, 128, 500000.0, TensorView::contiguous(freq.data(), DType::kFP32, {L.N}))) freq.assign(freq.size(), 0.0f);
  for (long long i = 0; i < rot.sets; ++i) {
    char* b = rot.set(i);
    check_cuda(cudaMemcpy(b + L.r, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice), "r");
    check_cuda(cudaMemcpy(b + L.pos, pos.data(), pos.size() * 4, cudaMemcpyHostToDevice), "pos");
    check_cuda(cudaMemcpy(b + L.freq, freq.data(), freq.size() * 4, cudaMemcpyHostToDevice), "freq");
    check_cuda(cudaMemcpy(b + L.target, target.data(), target.size() * 4, cudaMemcpyHostToDevice), "target");
  }
}

TensorView mat(char* b, size_t off, int64_t r, int64_t c, DType t = kT) { return TensorView::contiguous(b + off, t, {r, c}, kDev); }
TensorView vec(char* b, size_t off, int64_t n, DType t) { return TensorView::contiguous(b + off, t, {n}, kDev); }

// The operands of epilogue `e` over set `b` (A [M, K] or [K, M], W [N, K] or [K, N]), as its catalogue row
// declares; optional inputs (c2, alpha) given.
GemmEpilogueArgs make_args(Epilogue e, char* b, const Layout& L, bool store_d, int partial_tile_n) {
  const int64_t M = L.M, N = L.N, K = L.K;
  const uint32_t ops = gemm_epilogue_info(e)->operands;
  auto uses = [ops](uint32_t flags) { return (ops & flags) != 0; };
  GemmEpilogueArgs g;
  g.a = uses(kOperandATransposed) ? mat(b, L.a, K, M) : mat(b, L.a, M, K);  // wgrad: A stored [K, M]
  g.w = uses(kOperandWeightKN) ? mat(b, L.w, K, N) : mat(b, L.w, N, K);
  if (uses(kOperandD) || (uses(kOperandDOptional) && store_d)) g.d = mat(b, L.d, M, N);
  if (uses(kOperandC | kOperandCPairs)) g.c = mat(b, L.c, M, uses(kOperandCPairs) ? 2 * N : N);
  if (uses(kOperandC2Optional)) g.c2 = mat(b, L.c2, M, N);
  if (uses(kOperandZdz)) g.zdz = vec(b, L.r, M, DType::kFP32);
  if (uses(kOperandAux | kOperandAuxHalf | kOperandAuxDouble))
    g.aux = mat(b, L.aux, M, uses(kOperandAuxHalf) ? N / 2 : uses(kOperandAuxDouble) ? 2 * N : N);
  if (uses(kOperandGamma)) g.gamma = vec(b, L.gamma, N, kT);
  if (uses(kOperandRowScale | kOperandRowScaleOptional)) g.row_scale = vec(b, L.r, M, DType::kFP32);
  if (uses(kOperandPos)) g.pos = vec(b, L.pos, M, DType::kInt32);
  if (uses(kOperandFreq)) g.freq = vec(b, L.freq, N, DType::kFP32);
  if (uses(kOperandAlpha | kOperandAlphaOptional)) g.alpha = vec(b, L.r, 1, DType::kFP32);
  if (uses(kOperandTilePartials)) g.partials = mat(b, L.partials, M, (N + partial_tile_n - 1) / partial_tile_n, DType::kFP32);
  if (uses(kOperandColumnPartials))
    g.partials = mat(b, L.partials, gemm_column_partials_rows(M), (N + partial_tile_n - 1) / partial_tile_n * partial_tile_n, DType::kFP32);
  if (uses(kOperandHeadPartials)) g.partials = mat(b, L.partials, M, N / 128, DType::kFP32);
  if (uses(kOperandTarget)) {
    g.target = vec(b, L.target, M, DType::kInt32);
    g.target_logit = vec(b, L.logit, M, DType::kFP32);
  }
  if (uses(kOperandLse)) {  // ce_bwd: lse = 1 (the r buffer), targets in range
    g.target = vec(b, L.target, M, DType::kInt32);
    g.lse = vec(b, L.r, M, DType::kFP32);
  }
  return g;
}

// The operand flags of epilogue e (they size the Layout's optional buffers).
uint32_t operands_of(Epilogue e) { return gemm_epilogue_info(e)->operands; }

// ENCORE_BENCH_FILTER: run only the cases whose "<name> <tile> <size>" contains it (profiling).
bool selected(const std::string& key) {
  const char* f = std::getenv("ENCORE_BENCH_FILTER");
  return f == nullptr || key.find(f) != std::string::npos;
}


// cuBLAS D [M, N] = A [M, K] · W [N, K]ᵀ (w_kn: A · W with W [K, N], the dgrad layout; a_t: A stored
// [K, M], the wgrad layout), bf16 in/out, fp32 accumulate.
void cublas_gemm(cublasHandle_t h, const void* a, const void* w, void* d, int M, int N, int K, bool w_kn = false, bool a_t = false) {
  const float one = 1.f, zero = 0.f;
  cublasGemmEx(h, w_kn ? CUBLAS_OP_N : CUBLAS_OP_T, a_t ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, w_kn ? N : K, a,
               CUDA_R_16BF, a_t ? M : K, &zero, d,
               CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

struct Ctx {
  Report& report;
  const TimeOptions& topts;
  cudaStream_t stream;
  cublasHandle_t handle;
  size_t l2;
};

// Times each contender in turn, `rounds` times over (a third of the samples each), and returns
// each one's median over the rounds: GPU clocks drift over a long GEMM run, and interleaving keeps
// that drift out of the ratios between contenders.
std::vector<double> interleaved(Ctx& x, const std::vector<std::function<void(long long)>>& contenders, long long sets, int rounds = 3) {
  TimeOptions o = x.topts;
  o.samples = std::max(5, o.samples / rounds);
  std::vector<std::vector<double>> t(contenders.size());
  for (int r = 0; r < rounds; ++r)
    for (size_t c = 0; c < contenders.size(); ++c) t[c].push_back(time_launches(contenders[c], x.stream, o, sets).median_us);
  std::vector<double> out;
  for (auto& v : t) {
    std::sort(v.begin(), v.end());
    out.push_back(v[v.size() / 2]);
  }
  return out;
}

Record record(const std::string& name, const std::string& size, int64_t M, int64_t N, int64_t K) {
  Record r;
  r.suite = "gemm_epilogue";
  r.name = name;
  r.params = {{"dtype", "bf16"}, {"size", size}, {"M", std::to_string(M)}, {"N", std::to_string(N)}, {"K", std::to_string(K)}};
  return r;
}

// A tile-scheduler setting: swizzle (0 = auto) and raster order.
struct Schedule {
  int swizzle = 0;
  GemmRaster raster = GemmRaster::kAuto;
};
const char* raster_name(GemmRaster r) { return r == GemmRaster::kAlongM ? "M" : r == GemmRaster::kAlongN ? "N" : "auto"; }

// Options that run epilogue e on tile t: the partials epilogues pick their tile by partial_tile_n
// (128: ping-pong 128x128, 256: cooperative unless the 64x256 tile is asked for), the others by tile.
GemmEpilogueOptions tile_options(Epilogue e, GemmTile t) {
  GemmEpilogueOptions o{e};
  const bool by_partials = gemm_epilogue_info(e)->operands & (kOperandTilePartials | kOperandColumnPartials);
  if (by_partials) o.partial_tile_n = t == GemmTile::kPingpong128x128 ? 128 : 256;
  if (!by_partials || t == GemmTile::kPingpong64x256) o.tile = t;
  return o;
}

// Whether the catalogue instantiates epilogue e on tile t.
bool has_tile(Epilogue e, GemmTile t) {
  const uint8_t tiles = gemm_epilogue_info(e)->tiles;
  return t == GemmTile::kCooperative128x256 ? (tiles & kTileCoop256) : t == GemmTile::kPingpong128x128 ? (tiles & kTilePp128) : (tiles & kTilePp64);
}

// Times epilogue e on each tile it has (the cuBLAS GEMM once, in the same run); with `schedules`,
// each tile at each of those scheduler settings; `tiles` restricts the tiles.
void kernel_vs_cublas(Ctx& x, Epilogue e, const std::string& size, int64_t M, int64_t N, int64_t K, bool store_d = true,
                      std::vector<Schedule> schedules = {Schedule{}},
                      std::vector<GemmTile> tiles = {GemmTile::kCooperative128x256, GemmTile::kPingpong128x128, GemmTile::kPingpong64x256}) {
  std::vector<std::pair<GemmEpilogueOptions, GemmTile>> variants;  // options and the tile they run on
  for (GemmTile t : tiles) {
    if (!has_tile(e, t)) continue;
    GemmEpilogueOptions o = tile_options(e, t);
    const std::string key = std::string("gemm_") + epilogue_name(e) + (store_d ? "" : "_no_d") + " " + gemm_tile_name(t) + " " + size;
    for (const Schedule& z : schedules) {
      o.swizzle = z.swizzle;
      o.raster = z.raster;
      if (selected(key + (z.swizzle ? " swizzle" + std::to_string(z.swizzle) + " raster " + raster_name(z.raster) : "")))
        variants.push_back({o, t});
    }
  }
  if (variants.empty()) return;
  Layout L(M, N, K, operands_of(e));
  Rotation rot = make_rotation(L.bytes, x.l2, FillKind::kBF16);
  fill_valid(rot, L);
  // A variant the library refuses at this shape (a row whose operands this bench cannot build, a
  // shape the kernel does not take) is skipped with its reason, not aborted on: one launch each first.
  for (size_t vi = 0; vi < variants.size();) {
    const GemmEpilogueOptions& o = variants[vi].first;
    const Status st = run(make_args(e, rot.set(0), L, store_d, o.partial_tile_n), o, nullptr, x.stream);
    if (st.is_ok()) {
      ++vi;
      continue;
    }
    std::printf("  %-24s %-19s %-4s %6lld x %6lld x %6lld: skipped (%s)\n", (std::string("gemm_") + epilogue_name(e)).c_str(),
                gemm_tile_name(variants[vi].second), size.c_str(), (long long)M, (long long)N, (long long)K, st.to_string().c_str());
    std::fflush(stdout);
    variants.erase(variants.begin() + long(vi));
  }
  check_cuda(cudaStreamSynchronize(x.stream), epilogue_name(e));
  if (variants.empty()) {
    free_rotation(rot);
    return;
  }
  std::vector<std::function<void(long long)>> contenders = {[&](long long i) {
    char* b = rot.set(i);
    cublas_gemm(x.handle, b + L.a, b + L.w, b + L.d, int(M), int(N), int(K), operands_of(e) & kOperandWeightKN,
                operands_of(e) & kOperandATransposed);
  }};
  for (const auto& [o, tile] : variants)
    contenders.push_back([&, o](long long i) {
      check_status(run(make_args(e, rot.set(i), L, store_d, o.partial_tile_n), o, nullptr, x.stream), epilogue_name(e));
    });
  const std::vector<double> times = interleaved(x, contenders, rot.sets);
  const double cublas_us = times[0];
  for (size_t vi = 0; vi < variants.size(); ++vi) {
    const auto& [o, tile] = variants[vi];
    const double us = times[vi + 1];
    const double flops = 2.0 * double(M) * double(N) * double(K);
    std::string name = std::string("gemm_") + epilogue_name(e) + (store_d ? "" : "_no_d");
    Record r = record(name, size, M, N, K);
    r.params.push_back({"tile", gemm_tile_name(tile)});
    const std::string swz = o.swizzle ? std::to_string(o.swizzle) : "auto";
    r.params.push_back({"swizzle", swz});
    r.params.push_back({"raster", raster_name(o.raster)});
    r.metrics = {{"time_us", us}, {"cublas_gemm_us", cublas_us}, {"ratio_vs_cublas", us / cublas_us}, {"tflops", flops / (us * 1e-6) / 1e12}};
    x.report.records.push_back(r);
    std::printf("  %-24s %-19s s:%-4s r:%-4s %-4s %6lld x %6lld x %6lld: %9.1f us (cuBLAS GEMM %9.1f us, %.3fx)  %.0f TFLOP/s\n",
                name.c_str(), gemm_tile_name(tile), swz.c_str(), raster_name(o.raster), size.c_str(), (long long)M, (long long)N, (long long)K, us, cublas_us,
                us / cublas_us, flops / (us * 1e-6) / 1e12);
    std::fflush(stdout);
  }
  free_rotation(rot);
}

// ENCORE_BENCH_FILTER containing "slices": epilogue e on `tile` launched over S consecutive
// N-slices (GemmEpilogueOptions::n_slices) for each S in `slices`, against the one cuBLAS GEMM of
// the whole shape. A persistent CTA walks ~tiles / 132 tiles in a static order; fewer tiles per
// launch leave less room for the CTAs to drift apart and lose the weight tiles they share in L2
// (docs/gemm.md, N-slices). ENCORE_BENCH_SLICES=S runs one S (for ncu).
void sliced_vs_cublas(Ctx& x, Epilogue e, const std::string& size, int64_t M, int64_t N, int64_t K, GemmTile tile, std::vector<int> slices,
                      bool store_d = true) {
  const std::string name = std::string("gemm_") + epilogue_name(e) + (store_d ? "" : "_no_d") + "_nslices";
  if (!selected(name + " " + gemm_tile_name(tile) + " " + size)) return;
  if (const char* only = std::getenv("ENCORE_BENCH_SLICES")) slices = {std::atoi(only)};
  Layout L(M, N, K, operands_of(e));
  Rotation rot = make_rotation(L.bytes, x.l2, FillKind::kBF16);
  fill_valid(rot, L);
  const GemmEpilogueOptions o = tile_options(e, tile);
  std::vector<std::function<void(long long)>> contenders = {[&](long long i) {
    char* b = rot.set(i);
    cublas_gemm(x.handle, b + L.a, b + L.w, b + L.d, int(M), int(N), int(K), operands_of(e) & kOperandWeightKN,
                operands_of(e) & kOperandATransposed);
  }};
  for (int S : slices)
    contenders.push_back([&, S](long long i) {
      GemmEpilogueOptions os = o;
      os.n_slices = S;
      check_status(run(make_args(e, rot.set(i), L, store_d, o.partial_tile_n), os, nullptr, x.stream), "sliced");
    });
  const std::vector<double> times = interleaved(x, contenders, rot.sets);
  free_rotation(rot);
  for (size_t si = 0; si < slices.size(); ++si) {
    Record r = record(name, size, M, N, K);
    r.params.push_back({"tile", gemm_tile_name(tile)});
    r.params.push_back({"slices", std::to_string(slices[si])});
    r.metrics = {{"time_us", times[si + 1]}, {"cublas_gemm_us", times[0]}, {"ratio_vs_cublas", times[si + 1] / times[0]}};
    x.report.records.push_back(r);
    std::printf("  %-28s %-19s %-4s %6lld x %6lld x %6lld in %2d N-slices (0 = auto): %9.1f us (cuBLAS GEMM %9.1f us, %.3fx)\n", name.c_str(),
                gemm_tile_name(tile), size.c_str(), (long long)M, (long long)N, (long long)K, slices[si], times[si + 1], times[0],
                times[si + 1] / times[0]);
    std::fflush(stdout);
  }
}

// h = a·Woᵀ + res;  z = rmsnorm(h)·γ · Wupᵀ  (Wo [D, D], Wup [2F, D]).
void chain_grg(Ctx& x, const std::string& size, int64_t M, int64_t D, int64_t F, int partial_tile_n) {
  if (!selected("chain_grg " + std::to_string(partial_tile_n) + " " + size)) return;
  const int64_t N2 = 2 * F;
  size_t off = 0;
  auto take = [&](size_t bytes) { size_t at = off; off = align256(off + bytes); return at; };
  const size_t a = take(size_t(M * D) * 2), wo = take(size_t(D * D) * 2), res = take(size_t(M * D) * 2), gamma = take(size_t(D) * 2),
               h = take(size_t(M * D) * 2), aux = take(size_t(M * D) * 2), parts = take(size_t(M * ((D + 127) / 128)) * 4),
               r = take(size_t(M) * 4), wup = take(size_t(N2 * D) * 2), z = take(size_t(M * N2) * 2), tmp = take(size_t(M * D) * 2);
  Rotation rot = make_rotation(off, x.l2, FillKind::kBF16);
  const int64_t tiles = (D + partial_tile_n - 1) / partial_tile_n;
  GemmEpilogueOptions o1{Epilogue::kResidualSqsumAux};
  o1.partial_tile_n = partial_tile_n;
  auto fused_fn = [&](long long i) {
    char* b = rot.set(i);
    GemmEpilogueArgs g1;
    g1.a = mat(b, a, M, D);
    g1.w = mat(b, wo, D, D);
    g1.d = mat(b, h, M, D);
    g1.c = mat(b, res, M, D);
    g1.aux = mat(b, aux, M, D);
    g1.gamma = vec(b, gamma, D, kT);
    g1.partials = mat(b, parts, M, tiles, DType::kFP32);
    check_status(run(g1, o1, nullptr, x.stream), "residual_sqsum_aux");
    check_status(run(RmsFinalReduceArgs{g1.partials, vec(b, r, M, DType::kFP32)}, D, 1e-6f, x.stream), "rms_final_reduce");
    GemmEpilogueArgs g2;
    g2.a = g1.aux;
    g2.w = mat(b, wup, N2, D);
    g2.d = mat(b, z, M, N2);
    g2.row_scale = vec(b, r, M, DType::kFP32);
    check_status(run(g2, GemmEpilogueOptions{Epilogue::kRowScale}, nullptr, x.stream), "row_scale");
  };
  auto gemms_fn = [&](long long i) {
    char* b = rot.set(i);
    cublas_gemm(x.handle, b + a, b + wo, b + h, int(M), int(D), int(D));
    cublas_gemm(x.handle, b + aux, b + wup, b + z, int(M), int(N2), int(D));
  };
  auto unfused_fn = [&](long long i) {
    char* b = rot.set(i);
    cublas_gemm(x.handle, b + a, b + wo, b + tmp, int(M), int(D), int(D));
    AddRmsNormArgs n{mat(b, tmp, M, D), mat(b, res, M, D), vec(b, gamma, D, kT), mat(b, aux, M, D), mat(b, h, M, D)};
    check_status(run(n, RmsNormOptions{}, nullptr, x.stream), "add_rms_norm");
    cublas_gemm(x.handle, b + aux, b + wup, b + z, int(M), int(N2), int(D));
  };
  const std::vector<double> times = interleaved(x, {fused_fn, gemms_fn, unfused_fn}, rot.sets);
  const double fused = times[0], gemms = times[1], unfused = times[2];
  free_rotation(rot);
  Record rec = record("chain_gemm_residual_rmsnorm_gemm_fwd", size, M, N2, D);
  rec.params.push_back({"F", std::to_string(F)});
  rec.params.push_back({"partial_tile_n", std::to_string(partial_tile_n)});
  rec.metrics = {{"time_us", fused}, {"cublas_gemms_us", gemms}, {"unfused_us", unfused},
                 {"ratio_vs_gemms", fused / gemms}, {"speedup_vs_unfused", unfused / fused}};
  x.report.records.push_back(rec);
  std::printf("  chain grg fwd (partials %d) %-4s D %5lld F %5lld: fused %9.1f us, cuBLAS GEMMs alone %9.1f us (%.3fx), unfused cuBLAS+add_rms_norm %9.1f us (%.3fx faster)\n",
              partial_tile_n, size.c_str(), (long long)D, (long long)F, fused, gemms, fused / gemms, unfused,
              unfused / fused);
  std::fflush(stdout);
}

// The block's tensors at fixed offsets in one rotation set: its arguments (args) and cuBLAS's
// scratch input (tmp); fill() writes valid positions and RoPE frequencies into every set.
struct BlockBuffers {
  int64_t M, d, F, nqkv;
  size_t y0, x0, w0, w1, w2, w3, g0, g1, pos, freq, x1, x2, z1, qkv, r1, r2, tmp, bytes = 0;
  BlockBuffers(int64_t m, int64_t dd, int64_t f, int64_t n) : M(m), d(dd), F(f), nqkv(n) {
    auto take = [&](size_t b) { size_t at = bytes; bytes = align256(bytes + b); return at; };
    y0 = take(size_t(M * d) * 2), x0 = take(size_t(M * d) * 2), w0 = take(size_t(d * d) * 2), w1 = take(size_t(2 * F * d) * 2);
    w2 = take(size_t(d * F) * 2), w3 = take(size_t(nqkv * d) * 2), g0 = take(size_t(d) * 2), g1 = take(size_t(d) * 2);
    pos = take(size_t(M) * 4), freq = take(size_t(nqkv) * 4), x1 = take(size_t(M * d) * 2), x2 = take(size_t(M * d) * 2);
    z1 = take(size_t(M * 2 * F) * 2), qkv = take(size_t(M * nqkv) * 2), r1 = take(size_t(M) * 4), r2 = take(size_t(M) * 4);
    tmp = take(size_t(M * 2 * F) * 2);
  }
  LlamaBlockArgs args(char* b) const {
    return LlamaBlockArgs{mat(b, y0, M, d), mat(b, x0, M, d), mat(b, w0, d, d), mat(b, w1, 2 * F, d), mat(b, w2, d, F),
                          mat(b, w3, nqkv, d), vec(b, g0, d, kT), vec(b, g1, d, kT), vec(b, pos, M, DType::kInt32),
                          vec(b, freq, nqkv, DType::kFP32), mat(b, x1, M, d), mat(b, x2, M, d), mat(b, z1, M, 2 * F),
                          mat(b, qkv, M, nqkv), vec(b, r1, M, DType::kFP32), vec(b, r2, M, DType::kFP32)};
  }
  // Step k (0-3) of the block as cuBLAS's plain GEMM: o-proj, gate/up, down (on scratch input), QKV.
  void cublas_step(cublasHandle_t h, char* b, int k) const {
    if (k == 0) cublas_gemm(h, b + y0, b + w0, b + x1, int(M), int(d), int(d));
    if (k == 1) cublas_gemm(h, b + x1, b + w1, b + z1, int(M), int(2 * F), int(d));
    if (k == 2) cublas_gemm(h, b + tmp, b + w2, b + x2, int(M), int(d), int(F));
    if (k == 3) cublas_gemm(h, b + x2, b + w3, b + qkv, int(M), int(nqkv), int(d));
  }
  void fill(const Rotation& rot, int head_dim) const {
    std::vector<int32_t> hpos(static_cast<size_t>(M));
    for (int64_t m = 0; m < M; ++m) hpos[size_t(m)] = int32_t(m % 8192);
    std::vector<float> hfreq(static_cast<size_t>(nqkv));
    const int heads = int(nqkv / head_dim);
    check_status(rope_freq_turns(heads, heads * 2 / 3, head_dim, 500000.0, TensorView::contiguous(hfreq.data(), DType::kFP32, {nqkv})), "freq");
    for (long long i = 0; i < rot.sets; ++i) {
      check_cuda(cudaMemcpy(rot.set(i) + pos, hpos.data(), hpos.size() * 4, cudaMemcpyHostToDevice), "pos");
      check_cuda(cudaMemcpy(rot.set(i) + freq, hfreq.data(), hfreq.size() * 4, cudaMemcpyHostToDevice), "freq");
    }
  }
};

// The block's rotation sets, filled (valid positions and frequencies), and its workspace.
struct BlockSetup {
  const BlockBuffers B;
  Rotation rot;
  void* ws = nullptr;
  BlockSetup(const Ctx& x, int64_t M, int64_t d, int64_t F, int64_t nqkv, int head_dim)
      : B(M, d, F, nqkv), rot(make_rotation(B.bytes, x.l2, FillKind::kBF16)) {
    B.fill(rot, head_dim);
    check_cuda(cudaMalloc(&ws, workspace_bytes(B.args(rot.set(0)), LlamaBlockOptions{})), "block workspace");
  }
  BlockSetup(const BlockSetup&) = delete;
  BlockSetup& operator=(const BlockSetup&) = delete;
  ~BlockSetup() {
    check_cuda(cudaFree(ws), "free");
    free_rotation(rot);
  }
};

// The shifted LLaMA block forward (encore/blocks/llama.hpp) against its four GEMMs in cuBLAS alone.
void block_forward(Ctx& x, const std::string& size, int64_t M, int64_t d, int64_t F, int64_t nqkv, int head_dim) {
  if (!selected("llama_block_forward " + size)) return;
  std::vector<double> times;
  {
    const BlockSetup S(x, M, d, F, nqkv, head_dim);
    auto fused_fn = [&](long long i) { check_status(run(S.B.args(S.rot.set(i)), LlamaBlockOptions{}, S.ws, x.stream), "llama_block"); };
    auto gemms_fn = [&](long long i) {
      for (int k = 0; k < 4; ++k) S.B.cublas_step(x.handle, S.rot.set(i), k);
    };
    times = interleaved(x, {fused_fn, gemms_fn}, S.rot.sets);
  }
  Record rec = record("llama_block_forward", size, M, d, d);
  rec.params.push_back({"F", std::to_string(F)});
  rec.params.push_back({"Nqkv", std::to_string(nqkv)});
  rec.metrics = {{"time_us", times[0]}, {"cublas_gemms_us", times[1]}, {"ratio_vs_gemms", times[0] / times[1]}};
  x.report.records.push_back(rec);
  std::printf("  llama_block_forward %-4s M %5lld d %5lld F %5lld Nqkv %5lld: %9.1f us, its 4 GEMMs in cuBLAS %9.1f us (%.3fx)\n", size.c_str(),
              (long long)M, (long long)d, (long long)F, (long long)nqkv, times[0], times[1], times[0] / times[1]);
  std::fflush(stdout);
}

// ENCORE_BENCH_FILTER containing "breakdown": the block forward's four steps (llama_block's
// run_step, default options, each with its rms_final_reduce) and its four cuBLAS GEMMs, each step
// between CUDA events, the two sequences alternating over 30 iterations after 3 warm-up ones,
// enqueued back to back; per-step medians. Shows which step carries the block's ratio to its GEMMs
// in sequence (the per-kernel ratios, timed one kernel at a time, add up to less than the block's).
void block_breakdown(Ctx& x, const std::string& size, int64_t M, int64_t d, int64_t F, int64_t nqkv, int head_dim) {
  if (!selected("breakdown " + size)) return;
  const BlockSetup S(x, M, d, F, nqkv, head_dim);
  const BlockBuffers& B = S.B;
  const Rotation& rot = S.rot;
  void* const ws = S.ws;
  // Events per iteration, synchronized once at the end: the host enqueues ahead of the GPU, so no
  // step waits for its launch (a sync per iteration put the host's launch time into step 1).
  constexpr int kIters = 33, kEvents = 10;
  std::vector<cudaEvent_t> all(size_t(kIters) * kEvents);
  for (auto& e : all) check_cuda(cudaEventCreate(&e), "event");
  std::vector<std::vector<float>> enc(4), cub(4);
  auto timed_steps = [&](cudaEvent_t* ev, auto&& step) {  // ev[0], then ev[k + 1] after step k
    check_cuda(cudaEventRecord(ev[0], x.stream), "ev");
    for (int k = 0; k < 4; ++k) {
      step(k);
      check_cuda(cudaEventRecord(ev[k + 1], x.stream), "ev");
    }
  };
  auto encore_steps = [&](cudaEvent_t* ev, char* b) {
    const LlamaBlockArgs a = B.args(b);
    timed_steps(ev, [&](int k) { check_status(run_step(a, LlamaBlockOptions{}, ws, k, x.stream), "llama_block step"); });
  };
  auto cublas_steps = [&](cudaEvent_t* ev, char* b) { timed_steps(ev + 5, [&](int k) { B.cublas_step(x.handle, b, k); }); };
  // ENCORE_BREAKDOWN_SEPARATE=1: all of encore's iterations, then all of cuBLAS's (each sustained
  // alone, as a timing loop of one contender runs), instead of alternating them.
  const bool separate = std::getenv("ENCORE_BREAKDOWN_SEPARATE") != nullptr;
  for (int it = 0; it < kIters; ++it) {
    encore_steps(all.data() + size_t(it) * kEvents, rot.set(it % rot.sets));
    if (!separate) cublas_steps(all.data() + size_t(it) * kEvents, rot.set((it + 1) % rot.sets));
  }
  if (separate)
    for (int it = 0; it < kIters; ++it) cublas_steps(all.data() + size_t(it) * kEvents, rot.set((it + 1) % rot.sets));
  check_cuda(cudaStreamSynchronize(x.stream), "sync");
  for (int it = 3; it < kIters; ++it) {
    cudaEvent_t* ev = all.data() + size_t(it) * kEvents;
    for (int k = 0; k < 4; ++k) {
      float ms = 0.f;
      check_cuda(cudaEventElapsedTime(&ms, ev[k], ev[k + 1]), "elapsed");
      enc[size_t(k)].push_back(ms * 1000.f);
      check_cuda(cudaEventElapsedTime(&ms, ev[5 + k], ev[6 + k]), "elapsed");
      cub[size_t(k)].push_back(ms * 1000.f);
    }
  }
  for (auto& e : all) cudaEventDestroy(e);
  const char* names[4] = {"o-proj + residual + sqsum (+ rms_final_reduce)", "gate/up + SwiGLU", "down + residual + sqsum (+ rms_final_reduce)",
                          "QKV + RoPE"};
  auto median = [](std::vector<float> v) { std::sort(v.begin(), v.end()); return double(v[v.size() / 2]); };
  double te = 0, tc = 0;
  for (int k = 0; k < 4; ++k) {
    const double e = median(enc[size_t(k)]), c = median(cub[size_t(k)]);
    te += e;
    tc += c;
    Record r = record("llama_block_step", size, M, d, d);
    r.params.push_back({"order", separate ? "separate" : "alternating"});
    r.params.push_back({"step", std::to_string(k + 1)});
    r.metrics = {{"time_us", e}, {"cublas_gemm_us", c}, {"ratio_vs_cublas", e / c}};
    x.report.records.push_back(r);
    std::printf("  block step %d %-4s M %5lld %-48s: %9.1f us, cuBLAS GEMM in its sequence %9.1f us (%.3fx)\n", k + 1, size.c_str(),
                (long long)M, names[k], e, c, e / c);
  }
  std::printf("  block steps %-4s M %5lld summed (%s): %9.1f us, cuBLAS %9.1f us (%.3fx)\n", size.c_str(), (long long)M,
              separate ? "separate" : "alternating", te, tc, te / tc);
  std::fflush(stdout);
}

}  // namespace

void run_gemm_epilogue_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return;
  cublasSetStream(handle, stream);
  Ctx x{report, topts, stream, handle, info->l2_bytes};
  const int64_t M = 8192;
  struct Size { const char* name; int64_t D, F, q_heads, kv_heads, head_dim; };
  const Size sizes[] = {{"1B", 2048, 8192, 32, 8, 64}, {"8B", 4096, 14336, 32, 8, 128}, {"70B", 8192, 28672, 64, 8, 128}};
  for (const Size& s : sizes) {
    const int64_t qkv = (s.q_heads + 2 * s.kv_heads) * s.head_dim;
    for (int64_t m : {int64_t(8192), int64_t(16384)}) {
      block_forward(x, s.name, m, s.D, s.F, qkv, int(s.head_dim));
      block_breakdown(x, s.name, m, s.D, s.F, qkv, int(s.head_dim));
      kernel_vs_cublas(x, Epilogue::kResidualSqsumAux, s.name, m, s.D, s.D);
      kernel_vs_cublas(x, Epilogue::kRowScale, s.name, m, 2 * s.F, s.D);
      kernel_vs_cublas(x, Epilogue::kSwiglu, s.name, m, 2 * s.F, s.D);
      kernel_vs_cublas(x, Epilogue::kScalarScale, s.name, m, s.D, s.F);
      kernel_vs_cublas(x, Epilogue::kResidualSqsumAux, s.name, m, s.D, s.F);  // the block's down projection
      kernel_vs_cublas(x, Epilogue::kRope, s.name, m, qkv, s.D);
      if (s.head_dim == 128) kernel_vs_cublas(x, Epilogue::kQkvHeadSqsum, s.name, m, qkv, s.D);
      // The block backward's dgrads (W [K, N] un-transposed), each beside the plain dgrad of its shape:
      // the down projection's through the SwiGLU, the gate/up and QKV ones through the RMSNorm.
      for (Epilogue e : {Epilogue::kSwigluBwd, Epilogue::kDgrad}) kernel_vs_cublas(x, e, s.name, m, s.F, s.D);
      for (Epilogue e : {Epilogue::kRmsnormBwd, Epilogue::kDgrad}) kernel_vs_cublas(x, e, s.name, m, s.D, 2 * s.F);
      for (Epilogue e : {Epilogue::kRmsnormBwd, Epilogue::kDgrad}) kernel_vs_cublas(x, e, s.name, m, s.D, qkv);
    }
    chain_grg(x, s.name, M, s.D, s.F, 128);
    chain_grg(x, s.name, M, s.D, s.F, 256);
  }
  // Scheduler sweeps, selected with ENCORE_BENCH_FILTER: "swizzle" (the 8B gate/up GEMMs at each
  // swizzle), "raster" (the widest GEMMs, 70B gate/up, 8B gate/up and the LM head's LSE, in each
  // raster order).
  const std::string filter = std::getenv("ENCORE_BENCH_FILTER") ? std::getenv("ENCORE_BENCH_FILTER") : "";
  if (filter.find("swizzle") != std::string::npos) {
    for (Epilogue e : {Epilogue::kRowScale, Epilogue::kSwiglu})
      kernel_vs_cublas(x, e, "8B", M, 2 * 14336, 4096, true, {Schedule{1}, Schedule{2}, Schedule{4}, Schedule{8}});
    // The LM head (1002 N-tiles, 486 tiles per CTA): weight re-reads from DRAM against swizzle and
    // order (docs/gemm.md); one variant for ncu with e.g.
    // ENCORE_BENCH_FILTER="gemm_lse_no_d pingpong_128x128 8B swizzle2 raster N".
    std::vector<Schedule> lm;
    for (int z : {1, 2, 4, 8})
      for (GemmRaster r : {GemmRaster::kAlongM, GemmRaster::kAlongN}) lm.push_back(Schedule{z, r});
    kernel_vs_cublas(x, Epilogue::kLse, "8B", M, 128256, 4096, /*store_d=*/false, lm,
                     {GemmTile::kCooperative128x256, GemmTile::kPingpong128x128});
  }
  if (filter.find("slices") != std::string::npos) {
    // tiles per CTA at S = 1: LM head pp128 486 (M = 8192) / 972 (16384), coop 243; 8B gate/up pp128 217 at M = 16384
    // (109 at 8192, like the 70B gate/up on coop: slicing did not help there, 2026-11-30-h200-gemm_epilogue-nslices-*.json)
    sliced_vs_cublas(x, Epilogue::kLse, "8B", M, 128256, 4096, GemmTile::kPingpong128x128, {1, 2, 3, 6, 0}, false);
    sliced_vs_cublas(x, Epilogue::kLse, "8B", M, 128256, 4096, GemmTile::kPingpong128x128, {1, 3, 0}, true);
    sliced_vs_cublas(x, Epilogue::kLse, "8B", 16384, 128256, 4096, GemmTile::kPingpong128x128, {1, 3, 6, 0}, false);
    sliced_vs_cublas(x, Epilogue::kLse, "8B", M, 128256, 4096, GemmTile::kCooperative128x256, {1, 2, 3, 0}, false);
    sliced_vs_cublas(x, Epilogue::kSwiglu, "8B", 16384, 2 * 14336, 4096, GemmTile::kPingpong128x128, {1, 2, 0});
  }
  if (filter.find("raster") != std::string::npos) {
    // Swizzle 8 (the auto swizzle) in each raster order; a first sweep over swizzles 1-8 x raster
    // (bench/results/2026-11-29-h200-gemm_epilogue-raster-sweep-aecd32a.json) had swizzle 8 best everywhere.
    const std::vector<Schedule> orders = {Schedule{8, GemmRaster::kAuto}, Schedule{8, GemmRaster::kAlongM}, Schedule{8, GemmRaster::kAlongN}};
    for (Epilogue e : {Epilogue::kSwiglu, Epilogue::kRowScale})
      kernel_vs_cublas(x, e, "70B", M, 2 * 28672, 8192, true, orders, {GemmTile::kCooperative128x256});
    kernel_vs_cublas(x, Epilogue::kSwiglu, "8B", M, 2 * 14336, 4096, true, orders);
    kernel_vs_cublas(x, Epilogue::kLse, "8B", M, 128256, 4096, /*store_d=*/false, orders);
  }
  if (filter.find("lse_chunk") != std::string::npos) {
    // The loss in chunks of rows (the fused linear cross-entropy with its gradients in the forward runs gemm_lse on
    // M / 8 rows at a time): the 8B LM head at M 1024 / 2048 / 4096 on each tile, the plan's schedule (auto_swizzle
    // bounds CUTLASS's padding of the tile grid) and swizzle 1 / 4 / 8 in each raster order.
    const std::vector<Schedule> orders = {Schedule{}, Schedule{8, GemmRaster::kAuto}, Schedule{4, GemmRaster::kAuto},
                                          Schedule{8, GemmRaster::kAlongM}, Schedule{8, GemmRaster::kAlongN}, Schedule{1, GemmRaster::kAlongN}};
    for (int64_t m : {1024, 2048, 4096})
      kernel_vs_cublas(x, Epilogue::kLse, "8B lse_chunk M" + std::to_string(m), m, 128256, 4096, /*store_d=*/true, orders);
  }
  kernel_vs_cublas(x, Epilogue::kLse, "8B", M, 128256, 4096, /*store_d=*/false);
  kernel_vs_cublas(x, Epilogue::kLse, "8B", M, 128256, 4096, /*store_d=*/true);
  kernel_vs_cublas(x, Epilogue::kLse, "8B", 16384, 128256, 4096, /*store_d=*/false);
  // Every catalogue row on every tile it has at one square 8B shape (the rows above place each
  // epilogue on the block GEMM it serves; this pass covers a new row without a line of its own).
  for (int i = 0; i < gemm_epilogue_count(); ++i) kernel_vs_cublas(x, Epilogue(i), "catalogue", M, 4096, 4096);
  cublasDestroy(handle);
}

}  // namespace encore::bench
