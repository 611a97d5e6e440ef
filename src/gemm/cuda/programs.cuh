// Epilogue programs of the GEMM-epilogue family as CUTLASS Sm90 EVTs over the fp32 accumulator,
// one struct sm90::<Name> per row of encore/gemm_epilogues.def (the build instantiates each on the
// row's tiles), each a composition of the five primitives (docs/gemm.md):
//   1 elementwise / pairwise transform  Sm90Compute, nodes::SwigluAuxStore, nodes::RopeRotate
//   2 row / column vector load          Sm90ColBroadcast (r[m]), Sm90RowBroadcast (γ[n]), Sm90ScalarBroadcast
//   3 tile load / auxiliary tile store  Sm90SrcFetch (C = residual), Sm90AuxStore (register -> global)
//   3 (second tile input)               Sm90AuxLoad (direct loads), nodes::SwigluBwdPairs (packed pairs in and out)
//   4 block reduction along N / M       nodes::RowPartials, nodes::SwigluBwdPairs / Sm90RowReduction (partials per M-tile)
//   5 stateful transform                nodes::OnlineLse
// Each program names its C and D element types (void = not read / not written), builds its EVT from
// the CTA tile shape, and fills the EVT's arguments from a GemmProblem. A program with
// kWeightKN = true multiplies by W [K, N] un-transposed (acc = A · W: the dgrad programs). A program whose D is
// optional (kOperandDOptional) names its D-less twin in NoStoreTwin; the launcher picks by p.d. A
// program with kATransposed = true reads A stored [K, M] (M-major; the weight-gradient GEMM).
#pragma once
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_store_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "gemm/cuda/launch.hpp"
#include "gemm/cuda/node_backward.cuh"
#include "gemm/cuda/node_ce.cuh"
#include "gemm/cuda/node_pairwise.cuh"
#include "gemm/cuda/node_reductions.cuh"

namespace encore::cuda::sm90 {

namespace fusion = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

template <class Out>
using Identity = fusion::Sm90Compute<cutlass::epilogue::thread::Identity, Out, float, kRound>;
template <class Out>
using Mul = fusion::Sm90Compute<cutlass::multiplies, Out, float, kRound>;
using AddF = fusion::Sm90Compute<cutlass::plus, float, float, kRound>;
// r[m] as fp32; a null pointer reads as 1 (optional row scale).
template <class TileShape>
using RowScaleLoad = fusion::Sm90ColBroadcast<0, TileShape, float, float, cute::Stride<cute::_1, cute::_0, int64_t>>;
// z = r[m] · acc
template <class TileShape, class Out = float>
using ScaledAcc = fusion::Sm90EVT<Mul<Out>, RowScaleLoad<TileShape>, fusion::Sm90AccFetch>;
using RowMajorStride = cute::Stride<int64_t, cute::_1, int64_t>;

// D = r[m] · acc
template <class T>
struct RowScale {
  using ElementC = void;
  using ElementD = T;
  template <class TileShape>
  using Evt = ScaledAcc<TileShape, T>;
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem& p) {
    return {{p.row_scale, 1.0f, {}}, {}, {}};  // {ColBroadcast {ptr, null default, stride}, AccFetch, multiplies}
  }
};

// D = alpha[0] · acc, alpha read from device memory (graph-safe)
template <class T>
struct ScalarScale {
  using ElementC = void;
  using ElementD = T;
  template <class TileShape>
  using Evt = fusion::Sm90EVT<Mul<T>, fusion::Sm90ScalarBroadcast<float>, fusion::Sm90AccFetch>;
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem& p) {
    return {{{}, {p.alpha}, {}}, {}, {}};  // {ScalarBroadcast {values, device pointers, strides}, AccFetch, multiplies}
  }
};

// y = acc + C;  D = y;  aux = y ⊙ γ;  partials[m, t] = Σ_{n in tile t} y²  (tile = CTA N)
template <class T>
struct ResidualSqsumAux {
  using ElementC = T;
  using ElementD = T;
  template <class TileShape>
  using Evt = fusion::Sm90TopologicalVisitor<
      float,
      cute::tuple<cute::seq<>, cute::seq<>, cute::seq<0, 1>, cute::seq<>, cute::seq<2, 3>, cute::seq<4>, cute::seq<2>, cute::seq<6>>,
      fusion::Sm90AccFetch,                                                   // 0 acc
      fusion::Sm90SrcFetch<T>,                                                // 1 C
      AddF,                                                                   // 2 y = acc + C
      fusion::Sm90RowBroadcast<0, TileShape, T, float>,                       // 3 γ[n]
      Mul<float>,                                                             // 4 y·γ
      fusion::Sm90AuxStore<0, void, T, kRound, RowMajorStride, void, void>,   // 5 aux <- y·γ
      nodes::RowPartials<nodes::Square>,                                      // 6 Σ y² per (row, tile)
      Identity<T>>;                                                           // 7 D = y
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem& p) {
    return {{}, {}, {}, {static_cast<const T*>(p.gamma), T(0), {}}, {}, {static_cast<T*>(p.aux), RowMajorStride{p.ld_aux, cute::_1{}, int64_t(0)}},
            {p.partials, p.ld_partials}, {}};
  }
};

// z = r[m] · acc;  D = z;  aux[m, j] = silu(z[m, 2j]) · z[m, 2j+1]
template <class T>
struct Swiglu {
  using ElementC = void;
  using ElementD = T;
  template <class TileShape>
  using Evt = fusion::Sm90EVT<Identity<T>, fusion::Sm90EVT<nodes::SwigluAuxStore<T>, ScaledAcc<TileShape>>>;
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem& p) {
    return {{{{p.row_scale, 1.0f, {}}, {}, {}}, {static_cast<T*>(p.aux), p.ld_aux}}, {}};
  }
};

// z = r[m] · acc;  D = RoPE(z) (pairs rotated by 2π·pos[m]·f_j)
template <class T>
struct Rope {
  using ElementC = void;
  using ElementD = T;
  template <class TileShape>
  using Evt = fusion::Sm90EVT<Identity<T>, fusion::Sm90EVT<nodes::RopeRotate, ScaledAcc<TileShape>>>;
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem& p) {
    return {{{{p.row_scale, 1.0f, {}}, {}, {}}, {p.pos, p.freq}}, {}};
  }
};

// z = r[m] · acc;  D = RoPE⁻¹(z) (pairs rotated by −2π·pos[m]·f_j: the RoPE backward, e.g. in the
// epilogue of a dQ / dK GEMM, giving the gradient before the rotation)
template <class T>
struct RopeBwd {
  using ElementC = void;
  using ElementD = T;
  template <class TileShape>
  using Evt = fusion::Sm90EVT<Identity<T>, fusion::Sm90EVT<nodes::RopeRotateT<true>, ScaledAcc<TileShape>>>;
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem& p) {
    return {{{{p.row_scale, 1.0f, {}}, {}, {}}, {p.pos, p.freq}}, {}};
  }
};

// D = acc;  partials[m, h] = Σ_{n in head h} acc²  (groups of head_dim = 128 columns: one head per
// 128x128 tile, two per 128x256 tile)
template <class T>
struct QkvHeadSqsum {
  using ElementC = void;
  using ElementD = T;
  template <class TileShape>
  using Evt = fusion::Sm90EVT<Identity<T>, fusion::Sm90EVT<nodes::RowPartials<nodes::Square, kHeadSqsumDim>, fusion::Sm90AccFetch>>;
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem& p) {
    return {{{}, {p.partials, p.ld_partials}}, {}};
  }
};

// Root of a program whose D is void: passes its input through; ElementAux names the element type
// CUTLASS sizes the (unused) D staging with.
template <class T>
struct NoStoreRoot : Identity<float> {
  using Identity<float>::Identity;
  using ElementAux = T;
};

// z = r[m] · acc;  D = z (Lse) or nothing (LseNoStore);  partials = per-tile log-sum-exp; target select
template <class T, class D>
struct LseProgram {
  using ElementC = void;
  using ElementD = D;
  template <class TileShape>
  using Evt = fusion::Sm90EVT<cute::conditional_t<cute::is_void_v<D>, NoStoreRoot<T>, Identity<D>>,
                              fusion::Sm90EVT<nodes::OnlineLse, ScaledAcc<TileShape>>>;
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem& p) {
    return {{{{p.row_scale, 1.0f, {}}, {}, {}}, {p.partials, p.ld_partials, p.target, p.target_logit, p.ignore_index, p.col0, p.n_total}}, {}};
  }
};
template <class T>
struct Lse : LseProgram<T, T> {};
template <class T>
struct LseNoStore : LseProgram<T, void> {};

// D = acc + C
template <class T>
struct ResidualAdd {
  using ElementC = T;
  using ElementD = T;
  template <class TileShape>
  using Evt = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::plus, T, float, kRound>, fusion::Sm90AccFetch, fusion::Sm90SrcFetch<T>>;
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem&) {
    return {{}, {}, {}};  // {AccFetch, SrcFetch (C from the collective's source pointer), plus}
  }
};

// ---- backward programs (docs/math/gemm_epilogues.md §4): dgrad GEMMs through the forward weight, acc = A · W ----

// SwiGLU backward (gemm_swiglu_bwd_zdz): A = dx [M, d], W = w_down [d, F] (K = d, N = F), acc = dy;
// C = the saved Z [M, 2F] as (g, u) pairs, one 32-bit element each (ElementC float is only the
// container: SrcFetch passes the bits through); D = y = silu(g)·u [M, F]; dZ [M, 2F] and the zdz
// partials [M, ceil(F / CTA_N)] stored by the node. Constraints: F a multiple of 8, 16-byte rows.
template <class T>
struct SwigluBwd {
  using ElementC = float;
  using ElementD = T;
  static constexpr bool kWeightKN = true;
  template <class TileShape>
  using Evt = fusion::Sm90EVT<Identity<T>, fusion::Sm90EVT<nodes::SwigluBwdPairs<T>, fusion::Sm90AccFetch, fusion::Sm90SrcFetch<float>>>;
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem& p) {
    return {{{}, {}, {static_cast<T*>(p.aux), p.ld_aux, p.partials, p.ld_partials}}, {}};
  }
};

// dx through the RMSNorm: out = prev + r·(γ·da − x̂·zdz), elementwise over fragments.
template <class A>
struct RmsnormDx {
  CUTLASS_DEVICE A operator()(A const& da, A const& gamma, A const& xh, A const& zdz, A const& r, A const& prev) const {
    A out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < int(A::kElements); ++i) out[i] = fmaf(r[i], fmaf(gamma[i], da[i], -xh[i] * zdz[i]), prev[i]);
    return out;
  }
};

// RMSNorm backward (gemm_residual_partial_rmsnorm_bwd): A = dz [M, N_fwd], W = the consumer's weight
// [N_fwd, d] (K = N_fwd, N = d); da = α·acc (α from device memory, 1 when absent); x̂ = r[m]·x (C = x);
// D = c2 + r[m]·(γ⊙da − x̂·zdz[m]) (c2, the incoming residual gradient, direct loads, 0 when absent);
// aux = x̂⊙γ; dγ partials Σ_{m in CTA tile} da·x̂ by nodes::ColumnPartials, written packed
// [ceil(M / CTA_M), round_up(N, CTA_N)] (no final reduction: deterministic, a finisher sums them).
template <class T>
struct RmsnormBwd {
  using ElementC = T;
  using ElementD = T;
  static constexpr bool kWeightKN = true;
  template <class TileShape>
  using Evt = fusion::Sm90TopologicalVisitor<
      float,
      cute::tuple<cute::seq<>, cute::seq<>, cute::seq<1, 0>, cute::seq<>, cute::seq<>, cute::seq<4, 3>, cute::seq<>, cute::seq<5, 6>,
                  cute::seq<7>, cute::seq<2, 5>, cute::seq<9>, cute::seq<>, cute::seq<>, cute::seq<2, 6, 5, 11, 4, 12>>,
      fusion::Sm90AccFetch,                                                    // 0 acc
      fusion::Sm90ScalarBroadcast<float>,                                      // 1 α
      Mul<float>,                                                              // 2 da = α·acc
      fusion::Sm90SrcFetch<T>,                                                 // 3 x
      RowScaleLoad<TileShape>,                                                 // 4 r[m]
      Mul<float>,                                                              // 5 x̂ = r·x
      fusion::Sm90RowBroadcast<0, TileShape, T, float>,                        // 6 γ[n]
      Mul<float>,                                                              // 7 x̂·γ
      fusion::Sm90AuxStore<0, void, T, kRound, RowMajorStride, void, void>,    // 8 aux <- x̂·γ
      Mul<float>,                                                              // 9 da·x̂
      nodes::ColumnPartials,                                                   // 10 dγ partials
      RowScaleLoad<TileShape>,                                                 // 11 zdz[m]
      fusion::Sm90AuxLoad<0, void, T, RowMajorStride, void, void, 8, true>,    // 12 c2 (null: 0)
      fusion::Sm90Compute<RmsnormDx, T, float, kRound>>;                       // 13 D
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem& p) {
    return {{},
            {{1.0f}, {p.alpha}, {}},
            {},
            {},
            {p.row_scale, 1.0f, {}},
            {},
            {static_cast<const T*>(p.gamma), T(0), {}},
            {},
            {static_cast<T*>(p.aux), RowMajorStride{p.ld_aux, cute::_1{}, int64_t(0)}},
            {},
            {p.partials, p.ld_partials},
            {p.zdz, 0.0f, {}},
            {static_cast<const T*>(p.c2), T(0), RowMajorStride{p.ldc2, cute::_1{}, int64_t(0)}},
            {}};
  }
};

// ---- plain GEMMs of the backward ----

// D = acc = A · W, W [K, N] un-transposed (a dgrad through a forward weight stored out x in: d_y0 = dx1 · w0)
template <class T>
struct Dgrad {
  using ElementC = void;
  using ElementD = T;
  static constexpr bool kWeightKN = true;
  template <class TileShape>
  using Evt = fusion::Sm90EVT<Identity<T>, fusion::Sm90AccFetch>;
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem&) {
    return {{}, {}};  // {AccFetch, identity}
  }
};

// D = α·acc (α from device memory, 1 when absent), acc = Aᵀ · W with A stored [K, M] (M-major: the
// tokens run along K) and W [K, N] (N-major): the weight gradient dW = dzᵀ · x
template <class T>
struct Wgrad {
  using ElementC = void;
  using ElementD = T;
  static constexpr bool kWeightKN = true;
  static constexpr bool kATransposed = true;
  template <class TileShape>
  using Evt = fusion::Sm90EVT<Mul<T>, fusion::Sm90ScalarBroadcast<float>, fusion::Sm90AccFetch>;
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem& p) {
    return {{{1.0f}, {p.alpha}, {}}, {}, {}};  // {ScalarBroadcast {value 1, device pointer (null: the value)}, AccFetch, multiplies}
  }
};

// Cross-entropy backward on the recomputed logits (kCeBwd): z = r[m]·acc (A = the normed hidden, W = W_lm);
// D = α·(e^(z − lse[m]) − [n == target[m]]), 0 on ignore_index rows (nodes::CrossEntropyGrad). D may have
// N odd with 16-byte rows (TMA clips the columns past N). Optional partials Σ_tile z·D (null: none).
template <class T>
struct CeBwd {
  using ElementC = void;
  using ElementD = T;
  template <class TileShape>
  using Evt = fusion::Sm90EVT<Identity<T>, fusion::Sm90EVT<nodes::CrossEntropyGrad, ScaledAcc<TileShape>>>;
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem& p) {
    return {{{{p.row_scale, 1.0f, {}}, {}, {}}, {p.lse, p.target, p.alpha, p.ignore_index, p.col0, p.n_total, p.partials, p.ld_partials}}, {}};
  }
};

// The D-less twin of a program with an optional D (none by default).
template <template <class> class Program>
struct NoStoreTwin {
  static constexpr bool kHas = false;
};
template <>
struct NoStoreTwin<Lse> {
  static constexpr bool kHas = true;
  template <class T>
  using type = LseNoStore<T>;
};

}  // namespace encore::cuda::sm90
