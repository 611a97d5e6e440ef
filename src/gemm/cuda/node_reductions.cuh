// encore's block-reduction EVT nodes (primitives 4 and 5 of the five, docs/gemm.md), each passing its
// input through unchanged:
//
//   RowPartials<Fn, kGroupN>  partials[m, t] = Σ_{n in group t} Fn(x[m, n]) over groups of kGroupN
//                    columns (0: the CTA tile's columns): the sum-of-squares partials of the
//                    deferred RMSNorm (per tile, 128 or 256) and of the per-head QK-norm (groups of
//                    head_dim, on a tile of one or two heads).
//   OnlineLse        stateful (max, Σexp) per row carried across the epilogue subtiles, written as
//                    partials[m, t] = log Σ_{n in tile t} e^{x[m, n]};
//                            optionally selects x[m, target[m]] into target_logit[m] (0 for
//                            target == ignore_index, NaN for any other target outside [0, N)).
//
// Partials are fp32 [M, ceil(N / CTA_N)] (RowPartials: [M, ceil(N / kGroupN)], N a multiple of
// kGroupN) with row stride ld; every (row, tile or group) with a column inside the problem is
// written exactly once per launch, in a fixed order (deterministic).
#pragma once
#include <cfloat>
#include <cmath>

#include "gemm/cuda/node_support.cuh"

namespace encore::cuda::sm90::nodes {

struct PartialsArgs {
  float* partials = nullptr;
  int64_t ld = 0;
};

// Fn of RowPartials must map 0 to 0 (elements outside the problem are 0 and not masked).
struct Square {
  CUTLASS_DEVICE float operator()(float x) const { return x * x; }
};

template <class Fn, int kGroupN = 0>
struct RowPartials : NodeBase<PartialsArgs> {
  using NodeBase<PartialsArgs>::NodeBase;

  // kGroups column groups of kGroupCols columns per CTA tile, one row register tensor each; the
  // epilogue subtile epi_n lies in group epi_n / (EPI_N / kGroups) (subtiles never straddle a group:
  // static_assert).
  template <int kGroups, int kGroupCols, class RTensor, class GTensor, class CTensor, class Residue>
  struct Callbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    static constexpr int kEpiN = decltype(size<4>(shape(std::declval<CTensor>())))::value;
    static_assert(kEpiN % kGroups == 0, "epilogue subtiles must not straddle a column group");
    CUTLASS_DEVICE Callbacks(RTensor const (&r)[kGroups], GTensor const (&g)[kGroups], CTensor c, Residue res)
        : coord(c), residue(res) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kGroups; ++j) {
        acc[j] = r[j];
        gmem[j] = g[j];
        fill(acc[j], 0.0f);
      }
    }
    RTensor acc[kGroups];  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N) one register per row, per group
    GTensor gmem[kGroups]; // same shape, the partials' addresses
    CTensor coord;         // tCcD
    Residue residue;       // residue_tCcD

    template <class ElementAcc, class ElementIn, int kFrag>
    CUTLASS_DEVICE Array<ElementIn, kFrag> visit(Array<ElementAcc, kFrag> const&, int epi_v, int epi_m, int epi_n,
                                                 Array<ElementIn, kFrag> const& in) {
      // No bounds check: outside the problem the inputs are exactly 0 (TMA zero-fills A, W and C)
      // and Fn(0) = 0.
      Fn fn;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kGroups; ++j) {
        if (kGroups > 1 && epi_n / (kEpiN / kGroups) != j) continue;
        Tensor acc_mn = acc[j](_, _, _, epi_m, epi_n);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kFrag; ++i) acc_mn(epi_v * kFrag + i) += fn(float(in[i]));
      }
      return in;
    }

    CUTLASS_DEVICE void end() {
      const bool leader = quad_leader();
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kGroups; ++j) {
        Tensor r_flt = filter_zeros(acc[j]);
        Tensor g_flt = filter_zeros(gmem[j]);
        Tensor c_flt = filter_zeros(coord, acc[j].stride());
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(r_flt); ++i) {
          const float v = quad_sum(r_flt(i));
          // The group's first column stands for the group (N is a multiple of the group width).
          const auto c = make_coord(get<0>(c_flt(i)), get<1>(c_flt(i)) + j * kGroupCols);
          if (leader && elem_less(c, residue)) g_flt(i) = v;
        }
      }
    }
  };

  template <bool kRefSrc, class... A>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<A...> const& args) {
    using TileShape = decltype(args.tile_shape_mnk);
    constexpr int kTileN = size<1>(TileShape{});
    constexpr int kW = kGroupN == 0 ? kTileN : kGroupN;
    static_assert(kTileN % kW == 0, "column groups must tile the CTA tile N");
    constexpr int kGroups = kTileN / kW;
    using R = decltype(make_row_registers<float, kRefSrc>(args));
    using G = decltype(make_row_gmem<kRefSrc, kGroups>(this->params.partials, this->params.ld, args));
    R r[kGroups];
    G g[kGroups];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kGroups; ++j) {
      r[j] = make_row_registers<float, kRefSrc>(args);
      g[j] = make_row_gmem<kRefSrc, kGroups>(this->params.partials, this->params.ld, args, j);
    }
    return Callbacks<kGroups, kW, R, G, decltype(args.tCcD), decltype(args.residue_tCcD)>(r, g, args.tCcD, args.residue_tCcD);
  }
};

struct OnlineLseArgs {
  float* partials = nullptr;
  int64_t ld = 0;
  const int32_t* target = nullptr;  // optional
  float* target_logit = nullptr;    // with target
  int ignore_index = -100;
  int col0 = 0;     // global column of this launch's column 0 (a launch over an N-slice of the vocabulary)
  int n_total = 0;  // the vocabulary's N (0: this launch's N)
};

// Per epilogue subtile: visit() stashes x·log2e (−inf outside the problem), raises the row maxima
// and selects target logits; reduce() rescales the row sums to the new maxima once per row and adds
// 2^(x·log2e − max) per element (one FFMA-free ex2 and an add). State is base-2; end() combines
// the quad and writes ln Σ.
struct OnlineLse : NodeBase<OnlineLseArgs> {
  using NodeBase<OnlineLseArgs>::NodeBase;
  static constexpr float kLn2 = 0.6931471805599453f;

  template <class RTensor, class ITensor, class GTensor, class CTensor, class Residue, class Origin>
  struct Callbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    static constexpr int kSub = kSubtileElems<CTensor>;
    CUTLASS_DEVICE Callbacks(RTensor mx_, RTensor sum_, RTensor prev_, ITensor t_rel_, GTensor g, CTensor c, Residue res, Origin o,
                             bool full_, int n_total, OnlineLseArgs const& p)
        : mx(mx_), sum(sum_), prev(prev_), t_rel(t_rel_), gmem(g), coord(c), residue(res), origin(o), full(full_), N(n_total),
          col0(p.col0), target(p.target), target_logit(p.target_logit), ignore_index(p.ignore_index) {
      fill(mx, -INFINITY);
      fill(sum, 0.0f);
    }
    RTensor mx, sum, prev;  // per row: running max (base 2), Σ 2^(x2 − max), max before this subtile
    ITensor t_rel;          // per row: target column − this thread's first column (out of reach when no target)
    GTensor gmem;
    CTensor coord;
    Residue residue;
    Origin origin;
    bool full;
    int N;     // the whole vocabulary's
    int col0;  // global column of this launch's column 0
    const int32_t* target;
    float* target_logit;
    int ignore_index;
    float xs[kSub];

    CUTLASS_DEVICE void begin_loop(int, int) { copy(mx, prev); }

    template <bool kFull, class In, class Mx, class T, class C>
    CUTLASS_DEVICE void stash(In const& in, int v0, Mx& mx_mn, T const& t_mn, C const& c_mn) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < int(In::kElements); ++i) {
        const int v = v0 + i;
        const float x = float(in[i]);
        const bool inside = kFull || elem_less(c_mn(v), residue);
        const float x2 = inside ? x * kLog2e : -INFINITY;
        xs[v] = x2;
        mx_mn(v) = fmaxf(mx_mn(v), x2);
        if (int(get<1>(c_mn(v))) == t_mn(v) && inside) target_logit[get<0>(origin) + int(get<0>(c_mn(v)))] = x;
      }
    }

    template <class ElementAcc, class ElementIn, int kFrag>
    CUTLASS_DEVICE Array<ElementIn, kFrag> visit(Array<ElementAcc, kFrag> const&, int epi_v, int epi_m, int epi_n,
                                                 Array<ElementIn, kFrag> const& in) {
      Tensor mx_mn = mx(_, _, _, epi_m, epi_n);
      Tensor t_mn = t_rel(_, _, _, epi_m, epi_n);
      Tensor c_mn = coord(_, _, _, epi_m, epi_n);
      if (full) stash<true>(in, epi_v * kFrag, mx_mn, t_mn, c_mn);
      else stash<false>(in, epi_v * kFrag, mx_mn, t_mn, c_mn);
      return in;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int epi_m, int epi_n, bool, VTensor) {
      // Rows with no element inside yet keep max −inf: use 0 as their base (their terms are 0).
      Tensor m_flt = filter_zeros(mx), p_flt = filter_zeros(prev), s_flt = filter_zeros(sum);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(m_flt); ++i) {
        if (m_flt(i) == -INFINITY) m_flt(i) = -FLT_MAX;  // finite: 2^(−inf − base) = 0, 2^(base − base) = 1
        s_flt(i) *= fast_exp2(p_flt(i) - m_flt(i));
      }
      Tensor mx_mn = mx(_, _, _, epi_m, epi_n), sum_mn = sum(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < kSub; ++v) sum_mn(v) += fast_exp2(xs[v] - mx_mn(v));
    }

    CUTLASS_DEVICE void end() {
      Tensor m_flt = filter_zeros(mx);
      Tensor s_flt = filter_zeros(sum);
      Tensor t_flt = filter_zeros(t_rel);
      Tensor g_flt = filter_zeros(gmem);
      Tensor c_flt = filter_zeros(coord, mx.stride());
      const bool leader = quad_leader();
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(m_flt); ++i) {
        float m = m_flt(i), s = s_flt(i);
        CUTLASS_PRAGMA_UNROLL
        for (int lane_mask = 1; lane_mask <= 2; lane_mask <<= 1) {
          const float mo = __shfl_xor_sync(0xffffffffu, m, lane_mask), so = __shfl_xor_sync(0xffffffffu, s, lane_mask);
          const float mn = fmaxf(m, mo);
          s = s * fast_exp2(m - mn) + so * fast_exp2(mo - mn);
          m = mn;
        }
        if (!leader || !elem_less(c_flt(i), residue)) continue;
        g_flt(i) = (m + __log2f(s)) * kLn2;
        // Rows whose target is not a column: 0 for ignore_index, NaN otherwise (written once, by
        // the leader of the tile holding global column 0).
        const int n0 = col0 + get<1>(origin), t = t_flt(i) + n0;
        if (target != nullptr && n0 == 0 && (t < 0 || t >= N))
          target_logit[get<0>(origin) + int(get<0>(c_flt(i)))] = t == ignore_index ? 0.0f : NAN;
      }
    }
  };

  template <bool kRefSrc, class... A>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<A...> const& args) {
    auto mx = make_row_registers<float, kRefSrc>(args);
    auto sum = make_row_registers<float, kRefSrc>(args);
    auto prev = make_row_registers<float, kRefSrc>(args);
    auto g = make_row_gmem<kRefSrc>(this->params.partials, this->params.ld, args);
    auto origin = thread_origin(args);
    auto t_rel = make_row_registers<int, kRefSrc>(args);
    const int32_t* target = this->params.target;
    const int n0 = this->params.col0 + get<1>(origin);  // global column of this thread's first column
    fill_rows(t_rel, args, -(1 << 30), [&](int m) { return target != nullptr ? __ldg(target + m) - n0 : -(1 << 30); });
    auto [M, N, K, L] = args.problem_shape_mnkl;
    const int n_total = this->params.n_total > 0 ? this->params.n_total : int(N);
    return Callbacks<decltype(mx), decltype(t_rel), decltype(g), decltype(args.tCcD), decltype(args.residue_tCcD), decltype(origin)>(
        mx, sum, prev, t_rel, g, args.tCcD, args.residue_tCcD, origin, full_tile(args), n_total, this->params);
  }
};

}  // namespace encore::cuda::sm90::nodes
