// encore's cross-entropy backward EVT node (docs/math/gemm_epilogues.md §4.5), the epilogue of the
// recomputed LM-head GEMM (kCeBwd): from the logits z of the accumulator tile,
//   out[m, n] = α·(e^(z[m, n] − lse[m]) − [n == target[m]])
// with lse[m] and target[m] read once per row and tile, α once per tile from device memory (null: 1).
// Rows whose target == ignore_index give exactly 0 (selected, so even a non-finite logit gives 0); a row
// whose target lies outside [0, N) otherwise gives NaN (lse taken as NaN), so a bad target on the device
// is visible in the gradient. Columns past N are computed but never stored (TMA clips D).
// Optional (partials non-null): the per-(row, CTA tile) partials Σ_n z·out (fp32 [M, ceil(N / CTA_N)],
// row stride ld_partials), the zdz of the RMSNorm before the LM head (docs/math/gemm_epilogues.md §2),
// like SwigluBwdPairs' zdz partials: one register per row, the quad's sum stored by its leader (rows past
// M are marked in t_rel and skipped). Past N, z = 0 (TMA zero-fills W), so those terms are 0 without a
// mask.
#pragma once
#include <cmath>

#include "gemm/cuda/node_support.cuh"

namespace encore::cuda::sm90::nodes {

struct CeGradArgs {
  const float* lse = nullptr;       // [M]
  const int32_t* target = nullptr;  // [M]
  const float* alpha = nullptr;     // [1] device memory, null = 1
  int ignore_index = -100;
  int col0 = 0;     // global column of this launch's column 0 (a launch over an N-slice)
  int n_total = 0;  // the whole N (0: this launch's N)
  float* partials = nullptr;  // [M, ceil(N / CTA_N)], optional
  int64_t ld_partials = 0;
};

struct CrossEntropyGrad : NodeBase<CeGradArgs> {
  using NodeBase<CeGradArgs>::NodeBase;
  static constexpr int kIgnored = -(1 << 30);  // t_rel of an ignored row (no column matches it)
  static constexpr int kOutside = kIgnored - 1;  // t_rel of a row past M (computed, never stored)

  template <class LTensor, class ITensor, class CTensor>
  struct Callbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE Callbacks(LTensor l, ITensor t, LTensor s, CTensor c, float a, float* part, int ld_part)
        : lse2(l), t_rel(t), sums(s), coord(c), alpha(a), partials(part), ld_partials(ld_part) {
      fill(sums, 0.0f);
    }
    LTensor lse2;   // per row: lse·log2e (+inf: ignored row, NaN: target out of range)
    ITensor t_rel;  // per row: target − this thread's first global column (kIgnored, kOutside: no column matches)
    LTensor sums;   // per row: Σ z·out over this tile's columns (kept also without partials: one FFMA)
    CTensor coord;  // tCcD
    float alpha;
    float* partials;  // the partial of the thread's first row and this tile, or null
    int ld_partials;

    template <class ElementAcc, class ElementIn, int kFrag>
    CUTLASS_DEVICE Array<float, kFrag> visit(Array<ElementAcc, kFrag> const&, int epi_v, int epi_m, int epi_n,
                                             Array<ElementIn, kFrag> const& in) {
      Tensor l_mn = lse2(_, _, _, epi_m, epi_n);
      Tensor t_mn = t_rel(_, _, _, epi_m, epi_n);
      Tensor c_mn = coord(_, _, _, epi_m, epi_n);
      Tensor s_mn = sums(_, _, _, epi_m, epi_n);
      Array<float, kFrag> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kFrag; ++i) {
        const int v = epi_v * kFrag + i;
        const float z = float(in[i]);
        const float p = fast_exp2(fmaf(z, kLog2e, -l_mn(v)));
        out[i] = t_mn(v) == kIgnored ? 0.0f : alpha * (int(get<1>(c_mn(v))) == t_mn(v) ? p - 1.0f : p);
        s_mn(v) = fmaf(z, out[i], s_mn(v));
      }
      return out;
    }

    CUTLASS_DEVICE void end() {
      if (partials == nullptr) return;  // uniform over the CTA: the quad shuffles below see every lane
      const bool leader = quad_leader();
      Tensor r_flt = filter_zeros(sums);
      Tensor t_flt = filter_zeros(t_rel);
      Tensor c_flt = filter_zeros(coord, sums.stride());
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(r_flt); ++i) {
        const float v = quad_sum(r_flt(i));
        if (leader && t_flt(i) != kOutside) partials[int64_t(get<0>(c_flt(i))) * ld_partials] = v;
      }
    }
  };

  template <bool kRefSrc, class... A>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<A...> const& args) {
    auto lse2 = make_row_registers<float, kRefSrc>(args);
    auto t_rel = make_row_registers<int, kRefSrc>(args);
    auto origin = thread_origin(args);
    auto [M, N, K, L] = args.problem_shape_mnkl;
    const CeGradArgs& p = this->params;
    const int n_total = p.n_total > 0 ? p.n_total : int(N);
    const int n0 = p.col0 + get<1>(origin);  // global column of this thread's first column
    fill_rows(lse2, args, 0.0f, [&](int m) {
      const int t = __ldg(p.target + m);
      return t == p.ignore_index ? INFINITY : (t < 0 || t >= n_total) ? NAN : __ldg(p.lse + m) * kLog2e;
    });
    fill_rows(t_rel, args, kOutside, [&](int m) {
      const int t = __ldg(p.target + m);
      return t == p.ignore_index ? kIgnored : t - n0;
    });
    const float alpha = p.alpha != nullptr ? __ldg(p.alpha) : 1.0f;
    auto sums = make_row_registers<float, kRefSrc>(args);
    auto [m_tile, n_tile, k_tile, l_tile] = args.tile_coord_mnkl;
    float* part = p.partials != nullptr ? p.partials + int64_t(get<0>(origin)) * p.ld_partials + int64_t(n_tile) : nullptr;
    return Callbacks<decltype(lse2), decltype(t_rel), decltype(args.tCcD)>(lse2, t_rel, sums, args.tCcD, alpha, part, int(p.ld_partials));
  }
};

}  // namespace encore::cuda::sm90::nodes
