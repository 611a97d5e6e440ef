// Epilogue programs of the GEMM-epilogue family as CUTLASS Sm90 EVTs over the fp32 accumulator,
// one struct sm90::<Name> per row of encore/gemm_epilogues.def (the build instantiates each on the
// row's tiles), each a composition of the five primitives (docs/gemm.md):
//   1 elementwise / pairwise transform  Sm90Compute, nodes::SwigluAuxStore, nodes::RopeRotate
//   2 row / column vector load          Sm90ColBroadcast (r[m]), Sm90RowBroadcast (γ[n]), Sm90ScalarBroadcast
//   3 tile load / auxiliary tile store  Sm90SrcFetch (C = residual), Sm90AuxStore (register -> global)
//   4 block reduction along N           nodes::RowPartials
//   5 stateful transform                nodes::OnlineLse
// Each program names its C and D element types (void = not read / not written), builds its EVT from
// the CTA tile shape, and fills the EVT's arguments from a GemmProblem. A program whose D is
// optional (kOperandDOptional) names its D-less twin in NoStoreTwin; the launcher picks by p.d.
#pragma once
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_store_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "gemm/cuda/launch.hpp"
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
