// GEMM-epilogue family dispatch: the catalogue (encore/gemm_epilogues.def), validation of the
// operands each row declares, then the CUDA launcher of (epilogue, tile) or the CPU reference.
#include <algorithm>
#include <string>
#include <utility>

#include "encore/core/device_info.hpp"
#include "encore/gemm.hpp"
#include "gemm/checks.hpp"
#include "gemm/cuda/launch.hpp"  // host-only declarations
#include "gemm/problem.hpp"
#include "gemm/reference/gemm_ref.hpp"

namespace encore {
namespace {

using gemm::contiguous_vector;
using gemm::kIo;
using gemm::matrix;
using gemm::tma_rows;
using gemm::vector;

constexpr GemmEpilogueInfo kCatalogue[] = {
#define ENCORE_GEMM_EPILOGUE(Name, name, operands, tiles) {Epilogue::k##Name, #name, (operands), uint8_t(tiles)},
#include "encore/gemm_epilogues.def"
#undef ENCORE_GEMM_EPILOGUE
};
constexpr int kCatalogueSize = int(sizeof(kCatalogue) / sizeof(kCatalogue[0]));

constexpr bool catalogue_in_enum_order() {
  for (int i = 0; i < kCatalogueSize; ++i)
    if (int(kCatalogue[i].epilogue) != i) return false;
  return true;
}
static_assert(catalogue_in_enum_order(), "gemm_epilogues.def: rows must be in Epilogue order");

Status unused(const char* name, const TensorView& t, Epilogue e) {
  if (t.defined()) return Status::invalid(std::string(name) + ": not used by the " + epilogue_name(e) + " epilogue");
  return Status::ok();
}

// N of the GEMM: w's rows, or its columns for a row that uses w un-transposed (kOperandWeightKN).
int64_t gemm_n(const GemmEpilogueArgs& a, const GemmEpilogueInfo& info) { return a.w.shape[(info.operands & kOperandWeightKN) ? 1 : 0]; }
// M and K of the GEMM: a is [M, K], or [K, M] for a row that uses a transposed (kOperandATransposed).
int64_t gemm_m(const GemmEpilogueArgs& a, const GemmEpilogueInfo& info) { return a.a.shape[(info.operands & kOperandATransposed) ? 1 : 0]; }
int64_t gemm_k(const GemmEpilogueArgs& a, const GemmEpilogueInfo& info) { return a.a.shape[(info.operands & kOperandATransposed) ? 0 : 1]; }

uint8_t tile_flag(GemmTile t) {
  switch (t) {
    case GemmTile::kCooperative128x256: return kTileCoop256;
    case GemmTile::kPingpong128x128: return kTilePp128;
    case GemmTile::kPingpong64x256: return kTilePp64;
    case GemmTile::kAuto: break;
  }
  return 0;
}

// The epilogues instantiated on `t`, for error messages.
std::string epilogues_on(GemmTile t) {
  std::string s;
  for (const GemmEpilogueInfo& i : kCatalogue)
    if (i.tiles & tile_flag(t)) s += (s.empty() ? "" : ", ") + std::string(i.name);
  return s;
}

// Whether this call writes partials whose layout follows the kernel's tile (required ones, or optional
// tile partials that are given).
bool tile_fixed_by_partials(const GemmEpilogueArgs& a, const GemmEpilogueInfo& info) {
  return (info.operands & (kOperandTilePartials | kOperandColumnPartials)) ||
         ((info.operands & kOperandTilePartialsOptional) && a.partials.defined());
}

// The CUDA tile for these options (partial_tile_n resolved): fixed by the partials' column tile
// for epilogues with per-tile partials (the partials are per CTA tile N), else the requested one
// or, for kAuto, the plan's (gemm::auto_tile). Every tile must be instantiated for the epilogue.
Status resolve_tile(const GemmEpilogueArgs& a, const GemmEpilogueOptions& o, const GemmEpilogueInfo& info, GemmTile* tile) {
  const Epilogue e = o.epilogue;
  if (o.tile != GemmTile::kAuto && !(info.tiles & tile_flag(o.tile)))
    return Status::unsupported(std::string("tile: ") + gemm_tile_name(o.tile) + " exists for " + epilogues_on(o.tile) + ", not " +
                               epilogue_name(e));
  GemmTile chosen = o.tile;
  if (tile_fixed_by_partials(a, info)) {
    GemmTile fixed = GemmTile::kAuto;
    if (o.partial_tile_n == 256) fixed = o.tile == GemmTile::kPingpong64x256 ? GemmTile::kPingpong64x256 : GemmTile::kCooperative128x256;
    else if (o.partial_tile_n == 128) fixed = GemmTile::kPingpong128x128;
    else
      return Status::unsupported("partial_tile_n: the CUDA " + std::string(epilogue_name(e)) +
                                 " kernels write partials per tile N, 128 or 256; got " + std::to_string(o.partial_tile_n));
    if (o.tile != GemmTile::kAuto && o.tile != fixed)
      return Status::unsupported(std::string("tile: ") + gemm_tile_name(o.tile) + " conflicts with the " + epilogue_name(e) +
                                 " kernel's tile " + gemm_tile_name(fixed) + " (set by partial_tile_n)");
    chosen = fixed;
  } else if (chosen == GemmTile::kAuto) {
    chosen = gemm::auto_tile(gemm_n(a, info), gemm_k(a, info));
    if (!(info.tiles & tile_flag(chosen)))
      chosen = chosen == GemmTile::kPingpong128x128 ? GemmTile::kCooperative128x256 : GemmTile::kPingpong128x128;
  }
  if (!(info.tiles & tile_flag(chosen)))
    return Status::unsupported(std::string("tile: the ") + epilogue_name(e) + " epilogue has no " + gemm_tile_name(chosen) + " kernel");
  *tile = chosen;
  return Status::ok();
}

// What the CUDA kernels accept beyond validate(): bf16/fp16 with every matrix and γ in a's dtype,
// K and N multiples of 8 (16-byte TMA rows), 16-byte aligned rows, contiguous vectors, the
// partials' tile width fixed by the kernel's tile (see resolve_tile).
// `o` has partial_tile_n resolved; hands back the tile the kernel runs on.
Status validate_cuda(const GemmEpilogueArgs& a, const GemmEpilogueOptions& o, const GemmEpilogueInfo& info, GemmTile* tile) {
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("a", a.a, {DType::kBF16, DType::kFP16}));
  for (auto [name, t] :
       {std::pair<const char*, const TensorView*>{"d", &a.d}, {"aux", &a.aux}, {"c", &a.c}, {"c2", &a.c2}, {"gamma", &a.gamma}})
    if (t->defined()) ENCORE_RETURN_IF_ERROR(checks::same_dtype(name, *t, "a", a.a));
  const int64_t M = gemm_m(a, info), K = gemm_k(a, info), N = gemm_n(a, info);
  // A's contiguous extent (K, or M for A stored [K, M]) may be ragged where A's rows are padded to
  // 16 bytes and W holds it along its rows (W [K, N]: the dgrad and wgrad rows): the TMA loads take any
  // extent and zero-fill past it (e.g. the LM head's dlogits [M, V] with V odd in rows padded to 8).
  const bool a_t = (info.operands & kOperandATransposed) != 0;
  const int64_t a_inner = a_t ? M : K;
  const bool a_padded = (a.a.strides[0] * int64_t(dtype_size(a.a.dtype))) % 16 == 0 && (info.operands & kOperandWeightKN);
  if (a_inner % 8 != 0 && !a_padded)
    return Status::unsupported(std::string("a: ") + (a_t ? "M = " : "K = ") + std::to_string(a_inner) + " must be a multiple of 8 on CUDA (" +
                               (a_t ? "a is [K, M], M contiguous: " : "") + "16-byte TMA rows), or a's rows padded to 16 bytes" +
                               ((info.operands & kOperandWeightKN) ? "" : " with w [K, N]"));
  // [M, N] tiles (D, C, aux) move by TMA, which needs 16-byte rows; without them (lse with no D)
  // any N works: W's rows are K-contiguous and the epilogue masks the columns past N.
  const bool n_tiles = a.d.defined() || a.c.defined() || a.aux.defined();
  // kLse and kCeBwd move only D and read no column vector: any N where D's rows stay 16-byte aligned
  // (TMA clips the columns past N; CUTLASS's own alignment check sees N rounded up, sm90_gemm.cuh).
  const bool ragged_d = (o.epilogue == Epilogue::kLse || o.epilogue == Epilogue::kCeBwd) && !a.c.defined() && !a.aux.defined();
  if (ragged_d && N % 8 != 0 && a.d.defined() && a.d.shape[0] > 1 && (a.d.strides[0] * int64_t(dtype_size(a.d.dtype))) % 16 != 0)
    return Status::unsupported("d: row stride " + std::to_string(a.d.strides[0]) + " elements is not 16-byte aligned (N = " + std::to_string(N) +
                               "); on CUDA pass a D view of rows padded to a multiple of " + std::to_string(16 / dtype_size(a.d.dtype)) +
                               " elements, e.g. torch.empty(M, round_up(N, 8))[:, :N]");
  if (n_tiles && !ragged_d && N % 8 != 0)
    return Status::unsupported("w: N = " + std::to_string(N) +
                               " must be a multiple of 8 on CUDA when the epilogue stores or reads [M, N] tiles (16-byte TMA rows)");
  if (M >= (int64_t(1) << 31) || N >= (int64_t(1) << 31) || K >= (int64_t(1) << 31)) return Status::unsupported("a: M, N, K must be < 2^31");
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"a", &a.a}, {"w", &a.w}, {"d", &a.d}, {"c", &a.c}, {"c2", &a.c2}})
    ENCORE_RETURN_IF_ERROR(tma_rows(name, *t));
  if (info.operands & (kOperandAux | kOperandAuxDouble)) ENCORE_RETURN_IF_ERROR(tma_rows("aux", a.aux));  // vector stores
  if (info.operands & kOperandColumnPartials) {  // the kernel writes rows of round_up(N, tile N), packed
    if (a.partials.strides[1] != 1 || (a.partials.shape[0] > 1 && a.partials.strides[0] != a.partials.shape[1]))
      return Status::unsupported("partials: the column partials must be contiguous on CUDA (row stride " + std::to_string(a.partials.shape[1]) +
                                 "), got strides [" + std::to_string(a.partials.strides[0]) + ", " + std::to_string(a.partials.strides[1]) + "]");
    if (!checks::aligned(a.partials.data, 16)) return Status::invalid("partials: must be 16-byte aligned on CUDA");
    if (o.n_slices > 1)
      return Status::unsupported(std::string("n_slices: the ") + info.name + " kernel runs in one launch (its column partials span all of N)");
  }
  if ((info.operands & kOperandAuxHalf) && (!checks::aligned(a.aux.data, 8) || (a.aux.shape[0] > 1 && a.aux.strides[0] % 4 != 0)))
    return Status::invalid("aux: data pointer and row stride must be 8-byte aligned on CUDA (4 outputs per store)");
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"gamma", &a.gamma}, {"row_scale", &a.row_scale}, {"pos", &a.pos},
                         {"freq", &a.freq}, {"target", &a.target}, {"target_logit", &a.target_logit}, {"zdz", &a.zdz}, {"lse", &a.lse}})
    ENCORE_RETURN_IF_ERROR(contiguous_vector(name, *t));
  if (a.freq.defined() && !checks::aligned(a.freq.data, 8)) return Status::invalid("freq: must be 8-byte aligned on CUDA ((hi, lo) pairs)");
  if (a.partials.defined()) ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("partials", a.partials));
  if (o.swizzle != 0 && o.swizzle != 1 && o.swizzle != 2 && o.swizzle != 4 && o.swizzle != 8)
    return Status::invalid("swizzle: must be 0 (auto), 1, 2, 4 or 8, got " + std::to_string(o.swizzle));
  if (o.n_slices < 0) return Status::invalid("n_slices: must be >= 0 (0 = auto), got " + std::to_string(o.n_slices));
  if (uint8_t(o.raster) > uint8_t(GemmRaster::kAlongN))
    return Status::invalid("raster: must be GemmRaster::kAuto, kAlongM or kAlongN, got " + std::to_string(int(o.raster)));
  if ((info.operands & kOperandHeadPartials) && o.head_dim != cuda::kHeadSqsumDim)
    return Status::unsupported("head_dim: the CUDA " + std::string(info.name) + " kernel takes head_dim " + std::to_string(cuda::kHeadSqsumDim) +
                               ", got " + std::to_string(o.head_dim));
  if (a.d.defined()) ENCORE_RETURN_IF_ERROR(checks::rows_disjoint("d", a.d));
  if (a.aux.defined()) ENCORE_RETURN_IF_ERROR(checks::rows_disjoint("aux", a.aux));
  return resolve_tile(a, o, info, tile);
}

#ifdef ENCORE_WITH_CUDA
cuda::GemmProblem make_problem(const GemmEpilogueArgs& a, const GemmEpilogueOptions& o, const GemmEpilogueInfo& info, GemmTile tile,
                               int sm_count) {
  cuda::GemmProblem p;
  p.a = a.a.data;
  p.lda = a.a.strides[0];
  p.w = a.w.data;
  p.ldw = a.w.strides[0];
  p.d = a.d.data;
  // D's row stride goes into its TMA descriptor, which needs a 16-byte multiple; a single row's stride
  // addresses nothing, so an aligned one stands in (e.g. a packed [1, N] D with N odd).
  const int64_t d_vec = a.d.defined() ? 16 / int64_t(dtype_size(a.d.dtype)) : 1;
  p.ldd = !a.d.defined() ? 0 : a.d.shape[0] == 1 ? (a.d.shape[1] + d_vec - 1) / d_vec * d_vec : a.d.strides[0];
  p.M = int(gemm_m(a, info));
  p.N = int(gemm_n(a, info));
  p.K = int(gemm_k(a, info));
  p.dtype = a.a.dtype;
  p.c = a.c.data;
  // (g, u) pairs travel as one 32-bit element of the kernel's C: its row stride counts pairs
  p.ldc = !a.c.defined() ? 0 : (info.operands & kOperandCPairs) ? a.c.strides[0] / 2 : a.c.strides[0];
  p.c2 = a.c2.data;
  p.ldc2 = a.c2.defined() ? a.c2.strides[0] : 0;
  p.zdz = static_cast<const float*>(a.zdz.data);
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
  p.lse = static_cast<const float*>(a.lse.data);
  p.ignore_index = o.ignore_index;
  p.swizzle = o.swizzle;  // 0: auto_swizzle per launch (launch_sliced)
  const GemmRaster raster = o.raster != GemmRaster::kAuto ? o.raster : gemm::auto_raster(tile);
  p.raster = raster == GemmRaster::kAlongM ? 1 : raster == GemmRaster::kAlongN ? 2 : 0;
  p.device = a.a.device.index;
  p.sm_count = sm_count;
  return p;
}

// Runs the launcher over `slices` consecutive N-slices of whole tiles: W's rows and the
// column-indexed operands (D, C, aux, gamma: all in p.dtype after validate_cuda; freq; the partials,
// whose column tile is the tile N or a head that divides it) offset to each slice; the LSE target
// select takes the slice's first global column. An automatic swizzle (p.swizzle 0) is chosen for each
// launch's own width (auto_swizzle): CUTLASS pads every launch's tile grid to a multiple of it.
Status launch_sliced(cuda::GemmLauncher launch, const cuda::GemmProblem& p, const GemmEpilogueInfo& info, int partial_tile_n, GemmTile t,
                     int slices, Stream stream) {
  auto go = [&](cuda::GemmProblem q) {
    if (q.swizzle == 0) q.swizzle = gemm::auto_swizzle(q.M, q.N, t);
    return launch(q, stream);
  };
  const int64_t unit = gemm::tile_mn(t).second, units = gemm::ceil_div(p.N, unit);
  slices = int(std::min<int64_t>(std::max(slices, 1), units));
  if (slices == 1) return go(p);
  auto at = [](const void* base, int64_t elems, size_t esize) {
    return base == nullptr ? nullptr : static_cast<char*>(const_cast<void*>(base)) + elems * int64_t(esize);
  };
  const size_t es = dtype_size(p.dtype);
  const int64_t part_w = (info.operands & kOperandHeadPartials) ? cuda::kHeadSqsumDim : partial_tile_n;
  for (int s = 0; s < slices; ++s) {
    const int64_t n0 = units * s / slices * unit, n1 = std::min<int64_t>(p.N, units * (s + 1) / slices * unit);
    cuda::GemmProblem q = p;
    q.N = int(n1 - n0);
    q.w = at(p.w, (info.operands & kOperandWeightKN) ? n0 : n0 * p.ldw, es);
    q.d = at(p.d, n0, es);
    q.c = at(p.c, (info.operands & kOperandCPairs) ? 2 * n0 : n0, es);
    q.c2 = at(p.c2, n0, es);
    q.aux = at(p.aux, (info.operands & kOperandAuxHalf) ? n0 / 2 : (info.operands & kOperandAuxDouble) ? 2 * n0 : n0, es);
    q.gamma = at(p.gamma, n0, es);
    q.freq = reinterpret_cast<const float*>(at(p.freq, n0, sizeof(float)));
    q.partials = part_w > 0 ? reinterpret_cast<float*>(at(p.partials, n0 / part_w, sizeof(float))) : p.partials;
    q.col0 = int(n0);
    q.n_total = p.N;
    ENCORE_RETURN_IF_ERROR(go(q));
  }
  return Status::ok();
}
#endif

}  // namespace

int gemm_epilogue_count() { return kCatalogueSize; }

const GemmEpilogueInfo* gemm_epilogue_info(Epilogue e) { return int(e) < kCatalogueSize ? &kCatalogue[int(e)] : nullptr; }

const char* epilogue_name(Epilogue e) {
  const GemmEpilogueInfo* info = gemm_epilogue_info(e);
  return info != nullptr ? info->name : "unknown";
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

Status validate(const GemmEpilogueArgs& a, const GemmEpilogueOptions& o) {
  const GemmEpilogueInfo* info = gemm_epilogue_info(o.epilogue);
  if (info == nullptr)
    return Status::invalid("epilogue: value " + std::to_string(int(o.epilogue)) + " is not in the catalogue (0 to " +
                           std::to_string(kCatalogueSize - 1) + ")");
  const uint32_t ops = info->operands;
  const bool a_t = (ops & kOperandATransposed) != 0;  // a [K, M]
  ENCORE_RETURN_IF_ERROR(checks::present("a", a.a));
  ENCORE_RETURN_IF_ERROR(checks::ndim("a", a.a, 2, a_t ? "[K, M]" : "[M, K]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("a", a.a, kIo));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("a", a.a));
  const int64_t M = gemm_m(a, *info), K = gemm_k(a, *info);
  const Epilogue e = o.epilogue;
  auto uses = [ops](uint32_t flags) { return (ops & flags) != 0; };
  const bool w_kn = uses(kOperandWeightKN);  // w [K, N], acc = A · W
  ENCORE_RETURN_IF_ERROR(checks::present("w", a.w));
  ENCORE_RETURN_IF_ERROR(checks::ndim("w", a.w, 2, w_kn ? "[K, N]" : "[N, K]"));
  if (a.w.shape[w_kn ? 0 : 1] != K)
    return Status::invalid(std::string("w: expected ") + (w_kn ? "[K, N]" : "[N, K]") + " with K = " + std::to_string(K) + " (a's columns), got " +
                           a.w.shape_string() + (a_t ? " (a is [K, M])" : "") + (w_kn ? " (the " + std::string(epilogue_name(e)) + " epilogue multiplies by w un-transposed)" : ""));
  ENCORE_RETURN_IF_ERROR(checks::same_dtype("w", a.w, "a", a.a));
  ENCORE_RETURN_IF_ERROR(checks::same_device("w", a.w, "a", a.a));
  ENCORE_RETURN_IF_ERROR(checks::unit_last_stride("w", a.w));
  const int64_t N = gemm_n(a, *info);
  const std::initializer_list<DType> out_types = {a.a.dtype, DType::kFP32};
  const std::initializer_list<DType> f32 = {DType::kFP32};

  if (uses(kOperandD) || (uses(kOperandDOptional) && a.d.defined())) {
    ENCORE_RETURN_IF_ERROR(matrix("d", a.d, M, N, "[M, N]", a.a, out_types));
    ENCORE_RETURN_IF_ERROR(checks::no_overlap("d", a.d, "a", a.a));
    ENCORE_RETURN_IF_ERROR(checks::no_overlap("d", a.d, "w", a.w));
  }
  if (uses(kOperandColumnPairs) && N % 2 != 0)
    return Status::invalid("w: N = " + std::to_string(N) + " must be even for the " + epilogue_name(e) + " epilogue (column pairs)");

  // Every operand the epilogue does not read must be absent.
  const std::pair<const char*, const TensorView*> operands[] = {
      {"d", &a.d},         {"aux", &a.aux},     {"c", &a.c},               {"c2", &a.c2},         {"zdz", &a.zdz},
      {"gamma", &a.gamma}, {"row_scale", &a.row_scale}, {"pos", &a.pos},   {"freq", &a.freq},     {"alpha", &a.alpha},
      {"partials", &a.partials}, {"target", &a.target}, {"target_logit", &a.target_logit}, {"lse", &a.lse}};
  const uint32_t flags[] = {kOperandD | kOperandDOptional, kOperandAux | kOperandAuxHalf | kOperandAuxDouble, kOperandC | kOperandCPairs,
                            kOperandC2Optional, kOperandZdz, kOperandGamma, kOperandRowScale | kOperandRowScaleOptional, kOperandPos,
                            kOperandFreq, kOperandAlpha | kOperandAlphaOptional,
                            kOperandTilePartials | kOperandTilePartialsOptional | kOperandHeadPartials | kOperandColumnPartials,
                            kOperandTarget | kOperandLse, kOperandTarget,
                            kOperandLse};
  for (size_t i = 0; i < std::size(operands); ++i)
    if (!uses(flags[i])) ENCORE_RETURN_IF_ERROR(unused(operands[i].first, *operands[i].second, e));

  if (uses(kOperandAux | kOperandAuxHalf | kOperandAuxDouble)) {
    const bool half = uses(kOperandAuxHalf), dbl = uses(kOperandAuxDouble);
    ENCORE_RETURN_IF_ERROR(matrix("aux", a.aux, M, half ? N / 2 : dbl ? 2 * N : N, half ? "[M, N / 2]" : dbl ? "[M, 2N]" : "[M, N]", a.a, out_types));
    ENCORE_RETURN_IF_ERROR(checks::no_overlap("aux", a.aux, "d", a.d));
  }
  if (uses(kOperandC)) ENCORE_RETURN_IF_ERROR(matrix("c", a.c, M, N, "[M, N]", a.a, kIo));
  if (uses(kOperandCPairs)) ENCORE_RETURN_IF_ERROR(matrix("c", a.c, M, 2 * N, "[M, 2N] (pairs)", a.a, kIo));
  if (uses(kOperandC2Optional) && a.c2.defined()) ENCORE_RETURN_IF_ERROR(matrix("c2", a.c2, M, N, "[M, N]", a.a, kIo));
  if (uses(kOperandZdz)) ENCORE_RETURN_IF_ERROR(vector("zdz", a.zdz, M, "[M]", a.a, f32));
  // The dgrad rows' tile inputs are read while D / aux are written: no overlap (the forward rows keep
  // accepting C = D in place).
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"c", &a.c}, {"c2", &a.c2}})
    if (uses(kOperandWeightKN) && t->defined()) {
      if (a.d.defined()) ENCORE_RETURN_IF_ERROR(checks::no_overlap("d", a.d, name, *t));
      if (a.aux.defined()) ENCORE_RETURN_IF_ERROR(checks::no_overlap("aux", a.aux, name, *t));
    }
  if (uses(kOperandGamma)) ENCORE_RETURN_IF_ERROR(vector("gamma", a.gamma, N, "[N]", a.a, kIo));
  if (uses(kOperandRowScale) || (uses(kOperandRowScaleOptional) && a.row_scale.defined()))
    ENCORE_RETURN_IF_ERROR(vector("row_scale", a.row_scale, M, "[M]", a.a, f32));
  if (uses(kOperandPos)) ENCORE_RETURN_IF_ERROR(vector("pos", a.pos, M, "[M]", a.a, {DType::kInt32}));
  if (uses(kOperandFreq)) ENCORE_RETURN_IF_ERROR(vector("freq", a.freq, N, "[N] (hi, lo) pairs", a.a, f32));
  if (uses(kOperandAlpha) || (uses(kOperandAlphaOptional) && a.alpha.defined()))
    ENCORE_RETURN_IF_ERROR(vector("alpha", a.alpha, 1, "[1]", a.a, f32));
  if (uses(kOperandHeadPartials)) {
    if (o.head_dim <= 0 || N % o.head_dim != 0)
      return Status::invalid("head_dim: " + std::to_string(o.head_dim) + " must be positive and divide N = " + std::to_string(N));
    ENCORE_RETURN_IF_ERROR(matrix("partials", a.partials, M, N / o.head_dim, "[M, tiles]", a.a, f32));
  }
  if (uses(kOperandTilePartials | kOperandColumnPartials) || (uses(kOperandTilePartialsOptional) && a.partials.defined())) {
    if (o.partial_tile_n < 0) return Status::invalid("partial_tile_n: must be positive or 0 (auto), got " + std::to_string(o.partial_tile_n));
    const int64_t tile = o.partial_tile_n > 0 ? o.partial_tile_n : gemm_partial_tile_n(e, M, N, K), tiles = gemm::ceil_div(N, tile);
    if (uses(kOperandTilePartials | kOperandTilePartialsOptional))
      ENCORE_RETURN_IF_ERROR(matrix("partials", a.partials, M, tiles, "[M, tiles]", a.a, f32));
    else
      ENCORE_RETURN_IF_ERROR(matrix("partials", a.partials, gemm_column_partials_rows(M), tiles * tile,
                                    "[ceil(M / 128), round_up(N, partial_tile_n)]", a.a, f32));
  }
  if (uses(kOperandLse)) {
    ENCORE_RETURN_IF_ERROR(vector("lse", a.lse, M, "[M]", a.a, f32));
    ENCORE_RETURN_IF_ERROR(vector("target", a.target, M, "[M]", a.a, {DType::kInt32}));
  }
  if (uses(kOperandTarget) && a.target.defined()) {
    ENCORE_RETURN_IF_ERROR(vector("target", a.target, M, "[M]", a.a, {DType::kInt32}));
    ENCORE_RETURN_IF_ERROR(vector("target_logit", a.target_logit, M, "[M]", a.a, f32));
  } else if (uses(kOperandTarget) && a.target_logit.defined()) {
    return Status::invalid("target_logit: needs target");
  }
  return Status::ok();
}

size_t workspace_bytes(const GemmEpilogueArgs&, const GemmEpilogueOptions&) { return 0; }

namespace gemm {

Status check_run(const GemmEpilogueArgs& a, const GemmEpilogueOptions& opts, GemmEpilogueOptions* resolved, GemmTile* tile) {
  ENCORE_RETURN_IF_ERROR(validate(a, opts));
  const GemmEpilogueInfo& info = *gemm_epilogue_info(opts.epilogue);
  GemmEpilogueOptions o = opts;  // partial_tile_n resolved: every backend writes the same layout
  if (o.partial_tile_n == 0) o.partial_tile_n = gemm_partial_tile_n(o.epilogue, gemm_m(a, info), gemm_n(a, info), gemm_k(a, info));
  GemmTile t = GemmTile::kAuto;
  if (a.a.device.is_cuda()) {
    ENCORE_RETURN_IF_ERROR(validate_cuda(a, o, info, &t));
    ENCORE_RETURN_IF_ERROR(checks::device_memory({{"a", &a.a}, {"w", &a.w}, {"d", &a.d}, {"aux", &a.aux}, {"c", &a.c}, {"c2", &a.c2},
                                                  {"zdz", &a.zdz}, {"gamma", &a.gamma}, {"row_scale", &a.row_scale}, {"pos", &a.pos},
                                                  {"freq", &a.freq}, {"alpha", &a.alpha}, {"partials", &a.partials}, {"target", &a.target},
                                                  {"target_logit", &a.target_logit}, {"lse", &a.lse}}));
  }
  if (resolved) *resolved = o;
  if (tile) *tile = t;
  return Status::ok();
}

}  // namespace gemm

Status run(const GemmEpilogueArgs& a, const GemmEpilogueOptions& opts, void*, Stream stream) {
  GemmEpilogueOptions o;
  GemmTile tile = GemmTile::kAuto;
  ENCORE_RETURN_IF_ERROR(gemm::check_run(a, opts, &o, &tile));
  const GemmEpilogueInfo& info = *gemm_epilogue_info(o.epilogue);
  if (a.a.device.is_cuda()) {
#ifdef ENCORE_WITH_CUDA
    const DeviceInfo* dev = nullptr;
    ENCORE_RETURN_IF_ERROR(get_device_info(a.a.device.index, &dev));
    cuda::DeviceGuard guard;  // the kernels (and CUTLASS's TMA descriptors) on a's device, with its context current
    ENCORE_RETURN_IF_ERROR(guard.set(a.a.device.index));
    const cuda::GemmLauncher launch = cuda::gemm_launcher(o.epilogue, tile);
    if (launch == nullptr)
      return Status::internal(std::string("gemm: no CUDA kernel for ") + info.name + " on " + gemm_tile_name(tile) + " in this build");
    const cuda::GemmProblem p = make_problem(a, o, info, tile, dev->sm_count);
    const int slices = (info.operands & kOperandColumnPartials) ? 1 : o.n_slices > 0 ? o.n_slices : gemm::auto_slices(p.M, p.N, tile, dev->sm_count);
    return launch_sliced(launch, p, info, o.partial_tile_n, tile, slices, stream);
#else
    (void)stream;
    (void)tile;
    return gemm::no_cuda(a.a);
#endif
  }
  if ((info.operands & (kOperandTarget | kOperandLse)) && a.target.defined()) {  // host data: check the targets
    const int64_t N = gemm_n(a, info);
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

}  // namespace encore
