// Epilogue programs of the GEMM-epilogue family as CUTLASS Sm90 EVTs over the fp32 accumulator,
// one alias per catalogue entry, each a composition of the primitives (math-coda.md §6):
//   row-vector load (Sm90ColBroadcast: r[m]), scalar load from device memory (Sm90ScalarBroadcast),
//   elementwise compute (Sm90Compute), accumulator fetch (Sm90AccFetch).
#pragma once
#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cuda/gemm_epilogue/gemm_epilogue_launch.hpp"

namespace encore::cuda::sm90 {

namespace fusion = cutlass::epilogue::fusion;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// D = r[m] · acc
template <class T>
struct RowScale {
  template <class TileShape>
  using Evt = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, T, float, kRound>,
                              fusion::Sm90ColBroadcast<0, TileShape, float, float, cute::Stride<cute::_1, cute::_0, int64_t>>,
                              fusion::Sm90AccFetch>;
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem& p) {
    return {{p.row_scale, 0.0f, {}}, {}, {}};  // {ColBroadcast {ptr, null default, stride}, AccFetch, multiplies}
  }
};

// D = alpha[0] · acc, alpha read from device memory (graph-safe)
template <class T>
struct ScalarScale {
  template <class TileShape>
  using Evt = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, T, float, kRound>, fusion::Sm90ScalarBroadcast<float>,
                              fusion::Sm90AccFetch>;
  template <class Fusion>
  static typename Fusion::Arguments arguments(const GemmProblem& p) {
    return {{{}, {p.alpha}, {}}, {}, {}};  // {ScalarBroadcast {values, device pointers, strides}, AccFetch, multiplies}
  }
};

}  // namespace encore::cuda::sm90
