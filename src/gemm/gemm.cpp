// GEMM-epilogue family dispatch: validate -> CUDA kernel (src/gemm/cuda) or CPU reference;
// finishers and host-side helpers.
#include <algorithm>
#include <cmath>
#include <utility>

#include "core/checks.hpp"
#include "encore/core/device_info.hpp"
#include "encore/gemm.hpp"
#include "gemm/cuda/launch.hpp"  // host-only declarations
#include "gemm/reference/gemm_ref.hpp"

namespace encore {
namespace {

int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / y; }

const std::initializer_list<DType> kIo = {DType::kBF16, DType::kFP16, DType::kFP32};

Status matrix(const char* name, const TensorView& t, int64_t rows, int64_t cols, const char* layout, const TensorView& ref,
              std::initializer_list<DType> dtypes) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  ENCORE_RETURN_IF_ERROR(checks::ndim(name, t, 2, layout));
  if (t.shape[0] != rows || t.shape[1] != cols)
    return Status::invalid(std::string(name) + ": expected " + layout + " = [" + std::to_string(rows) + ", " + std::to_string(cols) +
                           "], got " + t.shape_string());
  ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, t, dtypes));
  ENCORE_RETURN_IF_ERROR(checks::same_device(name, t, "a", ref));
  return Status::ok();
}

Status vector(const char* name, const TensorView& t, int64_t len, const char* layout, const TensorView& ref,
              std::initializer_list<DType> dtypes) {
  ENCORE_RETURN_IF_ERROR(checks::present(name, t));
  ENCORE_RETURN_IF_ERROR(checks::ndim(name, t, 1, layout));
  if (t.shape[0] != len)
    return Status::invalid(std::string(name) + ": expected " + layout + " = [" + std::to_string(len) + "], got " + t.shape_string());
  ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, t, dtypes));
  ENCORE_RETURN_IF_ERROR(checks::same_device(name, t, "a", ref));
  return Status::ok();
}

Status unused(const char* name, const TensorView& t, Epilogue e) {
  if (t.defined()) return Status::invalid(std::string(name) + ": not used by the " + epilogue_name(e) + " epilogue");
  return Status::ok();
}

// 16-byte aligned data and row stride (TMA rows and vector stores).
Status tma_rows(const char* name, const TensorView& t) {
  if (!t.defined()) return Status::ok();
  const int64_t esize = int64_t(dtype_size(t.dtype));
  if (!checks::aligned(t.data, 16) || (t.shape[0] > 1 && (t.strides[0] * esize) % 16 != 0))
    return Status::invalid(std::string(name) + ": data pointer and row stride must be 16-byte aligned on CUDA");
  return Status::ok();
}

Status contiguous_vector(const char* name, const TensorView& t) {
  if (t.defined() && t.shape[0] > 1 && t.strides[0] != 1)
    return Status::invalid(std::string(name) + ": must be contiguous (stride 1) on CUDA, got stride " + std::to_string(t.strides[0]));
  return Status::ok();
}

// Measured on the H200 (docs/gemm_epilogue.md, bench/results/*gemm_epilogue*): ping-pong 128x128,
// whose epilogue overlaps the other warpgroup's mainloop, wins for short K and narrow N; the
// cooperative 128x256 tile's higher mainloop efficiency wins for long K and wide N. SwiGLU, whose
// epilogue is the heaviest (two stores and a silu per pair), keeps ping-pong up to K = 4096 at any
// N: 8B gate/up (8192 x 28672 x 4096) measured 1.037x / 1.065x of cuBLAS on ping-pong against
// 1.056x / 1.085x cooperative in two runs (bench/results/2026-11-29-h200-gemm_epilogue-*-f16a313.json,
// ...-9b2f5a9.json).
bool pingpong_preferred(Epilogue e, int64_t N, int64_t K) {
  if (e == Epilogue::kSwiglu && K <= 4096) return true;
  return K <= 2048 || (K <= 4096 && N <= 8192) || N <= 2048;
}

// The CUDA tile for these options (partial_tile_n resolved): fixed by the partials' column tile
// for kResidualSqsumAux and kLse, else the requested one or, for kAuto, pingpong_preferred
// (kQkvHeadSqsum's partials are per head on either tile).
Status resolve_tile(const GemmEpilogueArgs& a, const GemmEpilogueOptions& o, GemmTile* tile) {
  const Epilogue e = o.epilogue;
  GemmTile fixed = GemmTile::kAuto;
  const bool has_pp64 = e == Epilogue::kRowScale || e == Epilogue::kSwiglu || e == Epilogue::kResidualSqsumAux || e == Epilogue::kLse;
  if (o.tile == GemmTile::kPingpong64x256 && !has_pp64)
    return Status::unsupported(std::string("tile: pingpong_64x256 exists for row_scale, swiglu, residual_sqsum_aux and lse, not ") +
                               epilogue_name(e));
  if (e == Epilogue::kResidualSqsumAux || e == Epilogue::kLse) {
    if (o.partial_tile_n == 256) fixed = o.tile == GemmTile::kPingpong64x256 ? GemmTile::kPingpong64x256 : GemmTile::kCooperative128x256;
    else if (o.partial_tile_n == 128) fixed = GemmTile::kPingpong128x128;
    else
      return Status::unsupported("partial_tile_n: the CUDA " + std::string(epilogue_name(e)) +
                                 " kernels write partials per tile N, 128 or 256; got " + std::to_string(o.partial_tile_n));
  }
  if (fixed != GemmTile::kAuto) {
    if (o.tile != GemmTile::kAuto && o.tile != fixed)
      return Status::unsupported(std::string("tile: ") + gemm_tile_name(o.tile) + " conflicts with the " + epilogue_name(e) +
                                 " kernel's tile " + gemm_tile_name(fixed) + " (set by partial_tile_n / head_dim)");
    *tile = fixed;
    return Status::ok();
  }
  if (o.tile != GemmTile::kAuto) {
    *tile = o.tile;
    return Status::ok();
  }
  *tile = pingpong_preferred(e, a.w.shape[0], a.a.shape[1]) ? GemmTile::kPingpong128x128 : GemmTile::kCooperative128x256;
  return Status::ok();
}

// What the CUDA kernels accept beyond validate(): bf16/fp16 with every matrix and γ in a's dtype,
// K and N multiples of 8 (16-byte TMA rows), 16-byte aligned rows, contiguous vectors, the
// partials' tile width fixed by the kernel's tile (see resolve_tile).
// `o` has partial_tile_n resolved; hands back the tile the kernel runs on.
Status validate_cuda(const GemmEpilogueArgs& a, const GemmEpilogueOptions& o, GemmTile* tile) {
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("a", a.a, {DType::kBF16, DType::kFP16}));
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"d", &a.d}, {"aux", &a.aux}, {"c", &a.c}, {"gamma", &a.gamma}})
    if (t->defined()) ENCORE_RETURN_IF_ERROR(checks::same_dtype(name, *t, "a", a.a));
  const int64_t M = a.a.shape[0], K = a.a.shape[1], N = a.w.shape[0];
  if (K % 8 != 0) return Status::unsupported("a: K = " + std::to_string(K) + " must be a multiple of 8 on CUDA (16-byte TMA rows)");
  if (N % 8 != 0) return Status::unsupported("w: N = " + std::to_string(N) + " must be a multiple of 8 on CUDA (16-byte TMA rows)");
  if (M >= (int64_t(1) << 31) || N >= (int64_t(1) << 31) || K >= (int64_t(1) << 31)) return Status::unsupported("a: M, N, K must be < 2^31");
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"a", &a.a}, {"w", &a.w}, {"d", &a.d}, {"c", &a.c}})
    ENCORE_RETURN_IF_ERROR(tma_rows(name, *t));
  if (o.epilogue == Epilogue::kResidualSqsumAux) ENCORE_RETURN_IF_ERROR(tma_rows("aux", a.aux));  // vector stores
  if (o.epilogue == Epilogue::kSwiglu && (!checks::aligned(a.aux.data, 8) || (a.aux.shape[0] > 1 && a.aux.strides[0] % 4 != 0)))
    return Status::invalid("aux: data pointer and row stride must be 8-byte aligned on CUDA (4 outputs per store)");
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"gamma", &a.gamma}, {"row_scale", &a.row_scale}, {"pos", &a.pos},
                         {"freq", &a.freq}, {"target", &a.target}, {"target_logit", &a.target_logit}})
    ENCORE_RETURN_IF_ERROR(contiguous_vector(name, *t));
  if (a.freq.defined() && !checks::aligned(a.freq.data, 8)) return Status::invalid("freq: must be 8-byte aligned on CUDA ((hi, lo) pairs)");
  if (a.partials.defined()) ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("partials", a.partials));
  if (o.swizzle != 0 && o.swizzle != 1 && o.swizzle != 2 && o.swizzle != 4 && o.swizzle != 8)
    return Status::invalid("swizzle: must be 0 (auto), 1, 2, 4 or 8, got " + std::to_string(o.swizzle));
  if (o.n_slices < 0) return Status::invalid("n_slices: must be >= 0 (0 = auto), got " + std::to_string(o.n_slices));
  if (uint8_t(o.raster) > uint8_t(GemmRaster::kAlongN))
    return Status::invalid("raster: must be GemmRaster::kAuto, kAlongM or kAlongN, got " + std::to_string(int(o.raster)));
  if (o.epilogue == Epilogue::kQkvHeadSqsum && o.head_dim != cuda::kHeadSqsumDim)
    return Status::unsupported("head_dim: the CUDA qkv_head_sqsum kernel takes head_dim " + std::to_string(cuda::kHeadSqsumDim) + ", got " +
                               std::to_string(o.head_dim));
  if (a.d.defined()) ENCORE_RETURN_IF_ERROR(checks::rows_disjoint("d", a.d));
  if (a.aux.defined()) ENCORE_RETURN_IF_ERROR(checks::rows_disjoint("aux", a.aux));
  return resolve_tile(a, o, tile);
}

#ifdef ENCORE_WITH_CUDA
cuda::GemmProblem make_problem(const GemmEpilogueArgs& a, const GemmEpilogueOptions& o, GemmTile tile, int sm_count) {
  cuda::GemmProblem p;
  p.a = a.a.data;
  p.lda = a.a.strides[0];
  p.w = a.w.data;
  p.ldw = a.w.strides[0];
  p.d = a.d.data;
  p.ldd = a.d.defined() ? a.d.strides[0] : 0;
  p.M = int(a.a.shape[0]);
  p.N = int(a.w.shape[0]);
  p.K = int(a.a.shape[1]);
  p.dtype = a.a.dtype;
  p.c = a.c.data;
  p.ldc = a.c.defined() ? a.c.strides[0] : 0;
  p.aux = a.aux.data;
  p.ld_aux = a.aux.defined() ? a.aux.strides[0] : 0;
  p.gamma = a.gamma.data;
  p.row_scale = static_cast<const float*>(a.row_scale.data);
  p.alpha = static_cast<const float*>(a.alpha.data);
  p.partials = static_cast<float*>(a.partials.data);
  p.ld_partials = a.partials.defined() ? a.partials.strides[0] : 0;
  p.pos = static_cast<const int32_t*>(a.pos.data);
  p.freq = static_cast<const float*>(a.freq.data);
  p.target = static_cast<const int32_t*>(a.target.data);
  p.target_logit = static_cast<float*>(a.target_logit.data);
  p.ignore_index = o.ignore_index;
  // Auto swizzle: groups of 8 tiles keep A and W panels in L2 across the persistent schedule; on the
  // H200 it was worth 5-25% on wide problems (docs/gemm_epilogue.md). Small grids stay unswizzled.
  p.swizzle = o.swizzle > 0 ? o.swizzle : (p.M >= 1024 && p.N >= 1024 ? 8 : 1);
  // Auto raster: along N (the scheduler walks the W panels while a swizzle group of A row panels
  // stays in L2) on the cooperative and 128x128 ping-pong tiles. Measured on the H200 against
  // CUTLASS's heuristic (along M when there are more N tiles than M tiles), swizzle 8, two runs
  // (bench/results/2026-11-29-h200-gemm_epilogue-raster-*.json): 70B gate/up SwiGLU 1.033x / 1.040x
  // of cuBLAS along N against 1.077x / 1.055x along M; LM-head LSE on ping-pong 128x128 1.025x
  // against 1.064x. The 64x256 ping-pong tile measured slower along N and keeps the heuristic (0).
  const GemmRaster raster = o.raster != GemmRaster::kAuto ? o.raster
                            : tile != GemmTile::kPingpong64x256 ? GemmRaster::kAlongN
                                                                : GemmRaster::kAuto;
  p.raster = raster == GemmRaster::kAlongM ? 1 : raster == GemmRaster::kAlongN ? 2 : 0;
  p.device = a.a.device.index;
  p.sm_count = sm_count;
  return p;
}

// Tile shape (M, N) of a resolved tile.
std::pair<int64_t, int64_t> tile_mn(GemmTile t) {
  if (t == GemmTile::kCooperative128x256) return {128, 256};
  if (t == GemmTile::kPingpong64x256) return {64, 256};
  return {128, 128};
}

// The number of N-slices for options.n_slices = 0: measured on the H200 (N-slices experiment,
// bench/results/2026-11-30-h200-gemm_epilogue-nslices-*.json), the LM head's LSE at 486 tiles per
// CTA ran 1.034-1.087x of cuBLAS in one launch and 1.003-1.026x in 3 slices (162 per CTA); at
// M = 16384 (972 per CTA) 1.047x vs 1.002x in 6; the 8B gate/up SwiGLU at M = 16384 (217 per CTA)
// 1.078x vs 1.060x in 2; at ~109 tiles per CTA (8B and 70B gate/up, M = 8192) slicing did not help.
// Not on the 64x256 ping-pong tile: its raster order is CUTLASS's heuristic on the launch's shape,
// which flips on a slice (LM-head LSE at M = 16384: 1.23x of cuBLAS in 6 slices, ~1.05x in one).
int auto_slices(int64_t M, int64_t N, GemmTile t, int sm_count) {
  constexpr int64_t kMaxPerCta = 200, kTargetPerCta = 165;
  if (t == GemmTile::kPingpong64x256) return 1;
  const auto [tm, tn] = tile_mn(t);
  const int64_t m_tiles = ceil_div(M, 2 * tm) * 2;  // 2x1 clusters
  const int64_t n_tiles = ceil_div(N, tn), per_cta = ceil_div(m_tiles * n_tiles, sm_count);
  if (per_cta <= kMaxPerCta) return 1;
  return int(std::min<int64_t>(n_tiles, ceil_div(per_cta, kTargetPerCta)));
}

// Runs the launcher over `slices` consecutive N-slices of whole tiles: W's rows and the
// column-indexed operands (D, C, aux, gamma: all in p.dtype after validate_cuda; freq; the partials,
// whose column tile is the tile N or, for kQkvHeadSqsum, a head that divides it) offset to each
// slice; the LSE target select takes the slice's first global column.
Status launch_sliced(cuda::GemmLauncher launch, const cuda::GemmProblem& p, Epilogue e, int partial_tile_n, GemmTile t, int slices,
                     Stream stream) {
  const int64_t unit = tile_mn(t).second, units = ceil_div(p.N, unit);
  slices = int(std::min<int64_t>(std::max(slices, 1), units));
  if (slices == 1) return launch(p, stream);
  auto at = [](const void* base, int64_t elems, size_t esize) {
    return base == nullptr ? nullptr : static_cast<char*>(const_cast<void*>(base)) + elems * int64_t(esize);
  };
  const size_t es = dtype_size(p.dtype);
  const int64_t part_w = e == Epilogue::kQkvHeadSqsum ? cuda::kHeadSqsumDim : partial_tile_n;
  for (int s = 0; s < slices; ++s) {
    const int64_t n0 = units * s / slices * unit, n1 = std::min<int64_t>(p.N, units * (s + 1) / slices * unit);
    cuda::GemmProblem q = p;
    q.N = int(n1 - n0);
    q.w = at(p.w, n0 * p.ldw, es);
    q.d = at(p.d, n0, es);
    q.c = at(p.c, n0, es);
    q.aux = at(p.aux, e == Epilogue::kSwiglu ? n0 / 2 : n0, es);
    q.gamma = at(p.gamma, n0, es);
    q.freq = reinterpret_cast<const float*>(at(p.freq, n0, sizeof(float)));
    q.partials = part_w > 0 ? reinterpret_cast<float*>(at(p.partials, n0 / part_w, sizeof(float))) : p.partials;
    q.col0 = int(n0);
    q.n_total = p.N;
    ENCORE_RETURN_IF_ERROR(launch(q, stream));
  }
  return Status::ok();
}

// The launcher of (epilogue, tile); tile is resolved (never kAuto).
cuda::GemmLauncher launcher(Epilogue e, GemmTile t) {
  const bool coop = t == GemmTile::kCooperative128x256;
  if (t == GemmTile::kPingpong64x256) {
    switch (e) {
      case Epilogue::kRowScale: return cuda::launch_row_scale_pp64;
      case Epilogue::kSwiglu: return cuda::launch_swiglu_pp64;
      case Epilogue::kResidualSqsumAux: return cuda::launch_residual_sqsum_aux_pp64;
      case Epilogue::kLse: return cuda::launch_lse_pp64;
      default: return nullptr;  // refused by resolve_tile
    }
  }
  switch (e) {
    case Epilogue::kResidualSqsumAux: return coop ? cuda::launch_residual_sqsum_aux_coop256 : cuda::launch_residual_sqsum_aux_pp128;
    case Epilogue::kRowScale: return coop ? cuda::launch_row_scale_coop256 : cuda::launch_row_scale_pp128;
    case Epilogue::kSwiglu: return coop ? cuda::launch_swiglu_coop256 : cuda::launch_swiglu_pp128;
    case Epilogue::kRope: return coop ? cuda::launch_rope_coop256 : cuda::launch_rope_pp128;
    case Epilogue::kQkvHeadSqsum: return coop ? cuda::launch_qkv_head_sqsum_coop256 : cuda::launch_qkv_head_sqsum_pp128;
    case Epilogue::kLse: return coop ? cuda::launch_lse_coop256 : cuda::launch_lse_pp128;
    case Epilogue::kScalarScale: return coop ? cuda::launch_scalar_scale_coop256 : cuda::launch_scalar_scale_pp128;
  }
  return nullptr;
}
#endif

Status no_cuda(const TensorView& t) {
  return Status::unsupported("a: on " + t.device.to_string() + " but encore was built without CUDA (ENCORE_CUDA=OFF)");
}

}  // namespace

// Measured (bench/results/*gemm_epilogue*): with scheduler swizzle the ping-pong tile matches or
// beats the cooperative one for both partials epilogues at the o-projection and LM-head shapes
// (residual 0.92-1.03x of cuBLAS vs 1.00-1.32x; LSE 1.08x vs 1.08-1.12x), so the partials are per
// 128 columns. For long K (>= 12288, the down projection of 8B/70B) the residual epilogue's share
// of the time is small and the cooperative tile's mainloop wins (the same shape without the
// residual: 0.97-1.01x of cuBLAS cooperative vs 1.01-1.08x ping-pong), so the partials are per 256.
int gemm_partial_tile_n(Epilogue e, int64_t, int64_t, int64_t K) {
  if (e == Epilogue::kResidualSqsumAux) return K >= 12288 ? 256 : 128;
  return e == Epilogue::kLse ? 128 : 0;
}

const char* gemm_tile_name(GemmTile t) {
  switch (t) {
    case GemmTile::kAuto: return "auto";
    case GemmTile::kCooperative128x256: return "cooperative_128x256";
    case GemmTile::kPingpong128x128: return "pingpong_128x128";
    case GemmTile::kPingpong64x256: return "pingpong_64x256";
  }
  return "unknown";
}

const char* epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::kResidualSqsumAux: return "residual_sqsum_aux";
    case Epilogue::kRowScale: return "row_scale";
    case Epilogue::kSwiglu: return "swiglu";
    case Epilogue::kRope: return "rope";
    case Epilogue::kQkvHeadSqsum: return "qkv_head_sqsum";
    case Epilogue::kLse: return "lse";
    case Epilogue::kScalarScale: return "scalar_scale";
  }
  return "unknown";
}

Status validate(const GemmEpilogueArgs& a, const GemmEpilogueOptions& o) {
  ENCORE_RETURN_IF_ERROR(checks::present("a", a.a));
  ENCORE_RETURN_IF_ERROR(checks::ndim("a", a.a, 2, "[M, K]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("a", a.a, kIo));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("a", a.a));
  const int64_t M = a.a.shape[0], K = a.a.shape[1];
  ENCORE_RETURN_IF_ERROR(checks::present("w", a.w));
  ENCORE_RETURN_IF_ERROR(checks::ndim("w", a.w, 2, "[N, K]"));
  if (a.w.shape[1] != K) return Status::invalid("w: expected [N, K] with K = " + std::to_string(K) + " (a's columns), got " + a.w.shape_string());
  ENCORE_RETURN_IF_ERROR(checks::same_dtype("w", a.w, "a", a.a));
  ENCORE_RETURN_IF_ERROR(checks::same_device("w", a.w, "a", a.a));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("w", a.w));
  const int64_t N = a.w.shape[0];
  const Epilogue e = o.epilogue;
  const std::initializer_list<DType> out_types = {a.a.dtype, DType::kFP32};
  const std::initializer_list<DType> f32 = {DType::kFP32};

  const bool needs_d = e != Epilogue::kLse;
  if (needs_d || a.d.defined()) {
    ENCORE_RETURN_IF_ERROR(matrix("d", a.d, M, N, "[M, N]", a.a, out_types));
    ENCORE_RETURN_IF_ERROR(checks::no_overlap("d", a.d, "a", a.a));
    ENCORE_RETURN_IF_ERROR(checks::no_overlap("d", a.d, "w", a.w));
  }
  const bool pairs = e == Epilogue::kSwiglu || e == Epilogue::kRope;
  if (pairs && N % 2 != 0) return Status::invalid("w: N = " + std::to_string(N) + " must be even for the " + epilogue_name(e) + " epilogue (column pairs)");

  // Per-epilogue operands; every operand an epilogue does not read must be absent.
  const bool uses_aux = e == Epilogue::kResidualSqsumAux || e == Epilogue::kSwiglu;
  const bool uses_r = e == Epilogue::kRowScale || e == Epilogue::kSwiglu || e == Epilogue::kRope || e == Epilogue::kLse;
  const bool uses_partials = e == Epilogue::kResidualSqsumAux || e == Epilogue::kLse || e == Epilogue::kQkvHeadSqsum;
  if (!uses_aux) ENCORE_RETURN_IF_ERROR(unused("aux", a.aux, e));
  if (e != Epilogue::kResidualSqsumAux) {
    ENCORE_RETURN_IF_ERROR(unused("c", a.c, e));
    ENCORE_RETURN_IF_ERROR(unused("gamma", a.gamma, e));
  }
  if (!uses_r) ENCORE_RETURN_IF_ERROR(unused("row_scale", a.row_scale, e));
  if (e != Epilogue::kRope) {
    ENCORE_RETURN_IF_ERROR(unused("pos", a.pos, e));
    ENCORE_RETURN_IF_ERROR(unused("freq", a.freq, e));
  }
  if (e != Epilogue::kScalarScale) ENCORE_RETURN_IF_ERROR(unused("alpha", a.alpha, e));
  if (!uses_partials) ENCORE_RETURN_IF_ERROR(unused("partials", a.partials, e));
  if (e != Epilogue::kLse) {
    ENCORE_RETURN_IF_ERROR(unused("target", a.target, e));
    ENCORE_RETURN_IF_ERROR(unused("target_logit", a.target_logit, e));
  }

  if (uses_aux) {
    const int64_t aux_n = e == Epilogue::kSwiglu ? N / 2 : N;
    ENCORE_RETURN_IF_ERROR(matrix("aux", a.aux, M, aux_n, e == Epilogue::kSwiglu ? "[M, N / 2]" : "[M, N]", a.a, out_types));
    ENCORE_RETURN_IF_ERROR(checks::no_overlap("aux", a.aux, "d", a.d));
  }
  if (e == Epilogue::kResidualSqsumAux) {
    ENCORE_RETURN_IF_ERROR(matrix("c", a.c, M, N, "[M, N]", a.a, kIo));
    ENCORE_RETURN_IF_ERROR(vector("gamma", a.gamma, N, "[N]", a.a, kIo));
  }
  if (e == Epilogue::kRowScale || (uses_r && a.row_scale.defined()))
    ENCORE_RETURN_IF_ERROR(vector("row_scale", a.row_scale, M, "[M]", a.a, f32));
  if (e == Epilogue::kRope) {
    ENCORE_RETURN_IF_ERROR(vector("pos", a.pos, M, "[M]", a.a, {DType::kInt32}));
    ENCORE_RETURN_IF_ERROR(vector("freq", a.freq, N, "[N] (hi, lo) pairs", a.a, f32));
  }
  if (e == Epilogue::kScalarScale) ENCORE_RETURN_IF_ERROR(vector("alpha", a.alpha, 1, "[1]", a.a, f32));
  if (uses_partials) {
    int64_t tiles = 0;
    if (e == Epilogue::kQkvHeadSqsum) {
      if (o.head_dim <= 0 || N % o.head_dim != 0)
        return Status::invalid("head_dim: " + std::to_string(o.head_dim) + " must be positive and divide N = " + std::to_string(N));
      tiles = N / o.head_dim;
    } else {
      if (o.partial_tile_n < 0) return Status::invalid("partial_tile_n: must be positive or 0 (auto), got " + std::to_string(o.partial_tile_n));
      tiles = ceil_div(N, o.partial_tile_n > 0 ? o.partial_tile_n : gemm_partial_tile_n(e, M, N, K));
    }
    ENCORE_RETURN_IF_ERROR(matrix("partials", a.partials, M, tiles, "[M, tiles]", a.a, f32));
  }
  if (e == Epilogue::kLse && a.target.defined()) {
    ENCORE_RETURN_IF_ERROR(vector("target", a.target, M, "[M]", a.a, {DType::kInt32}));
    ENCORE_RETURN_IF_ERROR(vector("target_logit", a.target_logit, M, "[M]", a.a, f32));
  } else if (e == Epilogue::kLse && a.target_logit.defined()) {
    return Status::invalid("target_logit: needs target");
  }
  return Status::ok();
}

size_t workspace_bytes(const GemmEpilogueArgs&, const GemmEpilogueOptions&) { return 0; }

Status run(const GemmEpilogueArgs& a, const GemmEpilogueOptions& opts, void*, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, opts));
  GemmEpilogueOptions o = opts;  // partial_tile_n resolved: every backend writes the same layout
  if (o.partial_tile_n == 0) o.partial_tile_n = gemm_partial_tile_n(o.epilogue, a.a.shape[0], a.w.shape[0], a.a.shape[1]);
  if (a.a.device.is_cuda()) {
    GemmTile tile = GemmTile::kAuto;
    ENCORE_RETURN_IF_ERROR(validate_cuda(a, o, &tile));
#ifdef ENCORE_WITH_CUDA
    const DeviceInfo* info = nullptr;
    ENCORE_RETURN_IF_ERROR(get_device_info(a.a.device.index, &info));
    const cuda::GemmProblem p = make_problem(a, o, tile, info->sm_count);
    const int slices = o.n_slices > 0 ? o.n_slices : auto_slices(p.M, p.N, tile, info->sm_count);
    return launch_sliced(launcher(o.epilogue, tile), p, o.epilogue, o.partial_tile_n, tile, slices, stream);
#else
    (void)stream;
    (void)tile;
    return no_cuda(a.a);
#endif
  }
  if (o.epilogue == Epilogue::kLse && a.target.defined()) {  // host data: check the targets
    const int64_t N = a.w.shape[0];
    for (int64_t m = 0; m < a.a.shape[0]; ++m) {
      const int32_t t = static_cast<const int32_t*>(a.target.data)[m * a.target.strides[0]];
      if (t != o.ignore_index && (t < 0 || t >= N))
        return Status::invalid("target: row " + std::to_string(m) + " has target " + std::to_string(t) + ", outside [0, " + std::to_string(N) +
                               ") and not ignore_index (" + std::to_string(o.ignore_index) + ")");
    }
  }
  reference::gemm_epilogue(a, o);
  return Status::ok();
}

Status run(const RmsFinalReduceArgs& a, int64_t hidden, float eps, Stream stream) {
  ENCORE_RETURN_IF_ERROR(checks::present("partials", a.partials));
  ENCORE_RETURN_IF_ERROR(checks::ndim("partials", a.partials, 2, "[M, tiles]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("partials", a.partials, {DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(vector("r", a.r, a.partials.shape[0], "[M]", a.partials, {DType::kFP32}));
  if (hidden <= 0) return Status::invalid("hidden: must be positive, got " + std::to_string(hidden));
  if (!(eps >= 0.0f) || !std::isfinite(eps)) return Status::invalid("eps: must be finite and >= 0");
  if (a.partials.device.is_cuda()) {
    ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("partials", a.partials));
    ENCORE_RETURN_IF_ERROR(contiguous_vector("r", a.r));
#ifdef ENCORE_WITH_CUDA
    return cuda::launch_rms_final_reduce(static_cast<const float*>(a.partials.data), a.partials.strides[0], int(a.partials.shape[0]),
                                         int(a.partials.shape[1]), static_cast<float*>(a.r.data), hidden, eps, stream);
#else
    (void)stream;
    return no_cuda(a.partials);
#endif
  }
  reference::rms_final_reduce(a, hidden, eps);
  return Status::ok();
}

Status run(const LseFinishArgs& a, int ignore_index, Stream stream) {
  ENCORE_RETURN_IF_ERROR(checks::present("partials", a.partials));
  ENCORE_RETURN_IF_ERROR(checks::ndim("partials", a.partials, 2, "[M, tiles]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("partials", a.partials, {DType::kFP32}));
  const int64_t M = a.partials.shape[0];
  ENCORE_RETURN_IF_ERROR(vector("lse", a.lse, M, "[M]", a.partials, {DType::kFP32}));
  if (a.target.defined()) {
    ENCORE_RETURN_IF_ERROR(vector("target", a.target, M, "[M]", a.partials, {DType::kInt32}));
    ENCORE_RETURN_IF_ERROR(vector("target_logit", a.target_logit, M, "[M]", a.partials, {DType::kFP32}));
    ENCORE_RETURN_IF_ERROR(vector("loss", a.loss, M, "[M]", a.partials, {DType::kFP32}));
  } else if (a.loss.defined() || a.target_logit.defined()) {
    return Status::invalid("loss: needs target and target_logit");
  }
  if (a.partials.device.is_cuda()) {
    ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("partials", a.partials));
    for (auto [name, t] : {std::pair<const char*, const TensorView*>{"lse", &a.lse}, {"target", &a.target}, {"target_logit", &a.target_logit},
                           {"loss", &a.loss}})
      ENCORE_RETURN_IF_ERROR(contiguous_vector(name, *t));
#ifdef ENCORE_WITH_CUDA
    return cuda::launch_lse_finish(static_cast<const float*>(a.partials.data), a.partials.strides[0], int(a.partials.shape[0]),
                                   int(a.partials.shape[1]), static_cast<float*>(a.lse.data), static_cast<const int32_t*>(a.target.data),
                                   static_cast<const float*>(a.target_logit.data), static_cast<float*>(a.loss.data), ignore_index, stream);
#else
    (void)stream;
    return no_cuda(a.partials);
#endif
  }
  reference::lse_finish(a, ignore_index);
  return Status::ok();
}

Status run(const QkNormRopeArgs& a, const QkNormRopeOptions& o, Stream stream) {
  ENCORE_RETURN_IF_ERROR(checks::present("qkv", a.qkv));
  ENCORE_RETURN_IF_ERROR(checks::ndim("qkv", a.qkv, 2, "[M, N]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("qkv", a.qkv, kIo));
  if (o.num_q_heads < 1 || o.num_kv_heads < 1 || o.head_dim < 2 || o.head_dim % 2 != 0)
    return Status::invalid("num_q_heads, num_kv_heads: must be >= 1 and head_dim even (got " + std::to_string(o.num_q_heads) + ", " +
                           std::to_string(o.num_kv_heads) + ", " + std::to_string(o.head_dim) + ")");
  const int64_t M = a.qkv.shape[0], heads = int64_t(o.num_q_heads) + 2 * o.num_kv_heads, N = heads * o.head_dim;
  if (a.qkv.shape[1] != N)
    return Status::invalid("qkv: expected [M, (num_q_heads + 2 * num_kv_heads) * head_dim] = [" + std::to_string(M) + ", " + std::to_string(N) +
                           "], got " + a.qkv.shape_string());
  ENCORE_RETURN_IF_ERROR(matrix("partials", a.partials, M, heads, "[M, heads]", a.qkv, {DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(vector("q_weight", a.q_weight, o.head_dim, "[head_dim]", a.qkv, {a.qkv.dtype, DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(vector("k_weight", a.k_weight, o.head_dim, "[head_dim]", a.qkv, {a.qkv.dtype, DType::kFP32}));
  ENCORE_RETURN_IF_ERROR(vector("pos", a.pos, M, "[M]", a.qkv, {DType::kInt32}));
  ENCORE_RETURN_IF_ERROR(vector("freq", a.freq, N, "[N] (hi, lo) pairs", a.qkv, {DType::kFP32}));
  if (!(o.eps >= 0.0f) || !std::isfinite(o.eps)) return Status::invalid("eps: must be finite and >= 0");
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("qkv", a.qkv, "partials", a.partials));
  if (a.qkv.device.is_cuda()) {
    if (a.q_weight.dtype != a.k_weight.dtype) return Status::invalid("k_weight: dtype must match q_weight's on CUDA");
    for (auto [name, t] : {std::pair<const char*, const TensorView*>{"q_weight", &a.q_weight}, {"k_weight", &a.k_weight}, {"pos", &a.pos},
                           {"freq", &a.freq}})
      ENCORE_RETURN_IF_ERROR(contiguous_vector(name, *t));
    if (!checks::aligned(a.freq.data, 8)) return Status::invalid("freq: must be 8-byte aligned on CUDA ((hi, lo) pairs)");
    ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("qkv", a.qkv));
    ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("partials", a.partials));
    if (M >= (int64_t(1) << 31)) return Status::unsupported("qkv: M must be < 2^31");
#ifdef ENCORE_WITH_CUDA
    cuda::QkNormRopeProblem p;
    p.qkv = a.qkv.data;
    p.ld_qkv = a.qkv.strides[0];
    p.dtype = a.qkv.dtype;
    p.partials = static_cast<const float*>(a.partials.data);
    p.ld_partials = a.partials.strides[0];
    p.q_weight = a.q_weight.data;
    p.k_weight = a.k_weight.data;
    p.weight_fp32 = a.q_weight.dtype == DType::kFP32;
    p.pos = static_cast<const int32_t*>(a.pos.data);
    p.freq = static_cast<const float*>(a.freq.data);
    p.M = int(M);
    p.num_q_heads = o.num_q_heads;
    p.qk_heads = o.num_q_heads + o.num_kv_heads;
    p.head_dim = o.head_dim;
    p.eps = o.eps;
    return cuda::launch_qk_norm_rope(p, stream);
#else
    (void)stream;
    return no_cuda(a.qkv);
#endif
  }
  reference::qk_norm_rope(a, o);
  return Status::ok();
}

Status interleave_gate_up(const TensorView& gate, const TensorView& up, const TensorView& out) {
  ENCORE_RETURN_IF_ERROR(checks::present("gate", gate));
  ENCORE_RETURN_IF_ERROR(checks::ndim("gate", gate, 2, "[F, K]"));
  const int64_t F = gate.shape[0], K = gate.shape[1];
  ENCORE_RETURN_IF_ERROR(matrix("up", up, F, K, "[F, K]", gate, {gate.dtype}));
  ENCORE_RETURN_IF_ERROR(matrix("out", out, 2 * F, K, "[2F, K]", gate, {gate.dtype}));
  if (gate.device.is_cuda()) return Status::unsupported("gate: interleave_gate_up takes CPU tensors");
  for (int64_t f = 0; f < F; ++f)
    for (int64_t k = 0; k < K; ++k) {
      store_from_double(out.data, out.dtype, (2 * f) * out.strides[0] + k * out.strides[1],
                        load_as_double(gate.data, gate.dtype, f * gate.strides[0] + k * gate.strides[1]));
      store_from_double(out.data, out.dtype, (2 * f + 1) * out.strides[0] + k * out.strides[1],
                        load_as_double(up.data, up.dtype, f * up.strides[0] + k * up.strides[1]));
    }
  return Status::ok();
}

Status rope_freq_turns(int num_heads, int rotary_heads, int head_dim, double base, const TensorView& freq) {
  if (num_heads < 1 || rotary_heads < 0 || rotary_heads > num_heads)
    return Status::invalid("rotary_heads: must lie in [0, num_heads], with num_heads >= 1");
  if (head_dim < 2 || head_dim % 2 != 0) return Status::invalid("head_dim: must be even and >= 2, got " + std::to_string(head_dim));
  if (!(base > 1.0)) return Status::invalid("base: must be > 1");
  ENCORE_RETURN_IF_ERROR(checks::present("freq", freq));
  ENCORE_RETURN_IF_ERROR(checks::ndim("freq", freq, 1, "[num_heads * head_dim]"));
  ENCORE_RETURN_IF_ERROR(checks::dim_equals("freq", freq, 0, int64_t(num_heads) * head_dim, "num_heads * head_dim"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("freq", freq, {DType::kFP32}));
  if (freq.device.is_cuda()) return Status::unsupported("freq: rope_freq_turns fills a CPU tensor");
  auto* f = static_cast<float*>(freq.data);
  const int pairs_per_head = head_dim / 2;
  for (int h = 0; h < num_heads; ++h)
    for (int i = 0; i < pairs_per_head; ++i) {
      const double turns = h < rotary_heads ? std::pow(base, -2.0 * i / head_dim) / 6.283185307179586 : 0.0;
      const float hi = float(turns), lo = float(turns - double(hi));
      const int64_t j = int64_t(h) * pairs_per_head + i;
      f[(2 * j) * freq.strides[0]] = hi;
      f[(2 * j + 1) * freq.strides[0]] = lo;
    }
  return Status::ok();
}

}  // namespace encore
