// encore's block-reduction EVT nodes (primitive 4 and 5 of math-coda.md §6), each passing its
// input through unchanged:
//
//   RowPartials<Fn>  partials[m, t] = Σ_{n in tile t} Fn(x[m, n]) over the CTA tile's columns: the
//                    sum-of-squares partials of the deferred RMSNorm (tile 256) and of the per-head
//                    QK-norm (tile = head_dim).
//   OnlineLse        stateful (max, Σexp) per row carried across the epilogue subtiles, written as
//                    partials[m, t] = log Σ_{n in tile t} e^{x[m, n]};
//                            optionally selects x[m, target[m]] into target_logit[m] (0 for
//                            target == ignore_index, NaN for any other target outside [0, N)).
//
// Partials are fp32 [M, ceil(N / CTA_N)] with row stride ld; every (row, tile) with a column
// inside the problem is written exactly once per launch, in a fixed order (deterministic).
#pragma once
#include <cmath>

#include "cuda/gemm_epilogue/node_support.cuh"

namespace encore::cuda::sm90::nodes {

struct PartialsArgs {
  float* partials = nullptr;
  int64_t ld = 0;
};

struct Square {
  CUTLASS_DEVICE float operator()(float x) const { return x * x; }
};

template <class Fn>
struct RowPartials : NodeBase<PartialsArgs> {
  using NodeBase<PartialsArgs>::NodeBase;

  template <class RTensor, class GTensor, class CTensor, class Residue>
  struct Callbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE Callbacks(RTensor r, GTensor g, CTensor c, Residue res) : acc(r), gmem(g), coord(c), residue(res) {
      fill(acc, 0.0f);
    }
    RTensor acc;     // (CPY, CPY_M, CPY_N, EPI_M, EPI_N) one register per row
    GTensor gmem;    // same shape, the partials' addresses
    CTensor coord;   // tCcD
    Residue residue; // residue_tCcD

    template <class ElementAcc, class ElementIn, int kFrag>
    CUTLASS_DEVICE Array<ElementIn, kFrag> visit(Array<ElementAcc, kFrag> const&, int epi_v, int epi_m, int epi_n,
                                                 Array<ElementIn, kFrag> const& in) {
      Tensor acc_mn = acc(_, _, _, epi_m, epi_n);
      Tensor c_mn = coord(_, _, _, epi_m, epi_n);
      Fn fn;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kFrag; ++i)
        if (elem_less(c_mn(epi_v * kFrag + i), residue)) acc_mn(epi_v * kFrag + i) += fn(float(in[i]));
      return in;
    }

    CUTLASS_DEVICE void end() {
      Tensor r_flt = filter_zeros(acc);
      Tensor g_flt = filter_zeros(gmem);
      Tensor c_flt = filter_zeros(coord, acc.stride());
      const bool leader = quad_leader();
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(r_flt); ++i) {
        const float v = quad_sum(r_flt(i));
        if (leader && elem_less(c_flt(i), residue)) g_flt(i) = v;
      }
    }
  };

  template <bool kRefSrc, class... A>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<A...> const& args) {
    auto r = make_row_registers<float, kRefSrc>(args);
    auto g = make_row_gmem<kRefSrc>(this->params.partials, this->params.ld, args);
    return Callbacks<decltype(r), decltype(g), decltype(args.tCcD), decltype(args.residue_tCcD)>(r, g, args.tCcD, args.residue_tCcD);
  }
};

struct OnlineLseArgs {
  float* partials = nullptr;
  int64_t ld = 0;
  const int32_t* target = nullptr;  // optional
  float* target_logit = nullptr;    // with target
  int ignore_index = -100;
};

struct OnlineLse : NodeBase<OnlineLseArgs> {
  using NodeBase<OnlineLseArgs>::NodeBase;
  static constexpr float kLog2e = 1.4426950408889634f;
  static constexpr float kLn2 = 0.6931471805599453f;

  template <class RTensor, class GTensor, class TTensor, class CTensor, class Residue, class Origin>
  struct Callbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE Callbacks(RTensor mx_, RTensor sum_, GTensor g, TTensor t, CTensor c, Residue res, Origin o, int n_total,
                             OnlineLseArgs const& p)
        : mx(mx_), sum(sum_), gmem(g), target(t), coord(c), residue(res), origin(o), N(n_total), params(p) {
      fill(mx, -INFINITY);
      fill(sum, 0.0f);
    }
    RTensor mx, sum;   // running max and Σ 2^(x·log2e − max), base-2 scaled, per row
    GTensor gmem;
    TTensor target;    // per-row target (one part per tile)
    CTensor coord;
    Residue residue;
    Origin origin;
    int N;
    OnlineLseArgs const& params;

    template <class ElementAcc, class ElementIn, int kFrag>
    CUTLASS_DEVICE Array<ElementIn, kFrag> visit(Array<ElementAcc, kFrag> const&, int epi_v, int epi_m, int epi_n,
                                                 Array<ElementIn, kFrag> const& in) {
      Tensor mx_mn = mx(_, _, _, epi_m, epi_n);
      Tensor sum_mn = sum(_, _, _, epi_m, epi_n);
      Tensor t_mn = target(_, _, _, epi_m, epi_n);
      Tensor c_mn = coord(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kFrag; ++i) {
        const int v = epi_v * kFrag + i;
        if (!elem_less(c_mn(v), residue)) continue;
        const float x = float(in[i]);
        // One exp2 per element: the smaller of (x, max) is exponentiated against the larger.
        const float x2 = x * kLog2e, m = mx_mn(v);
        const float e = exp2f(-fabsf(x2 - m));
        const bool grows = x2 > m;
        sum_mn(v) = grows ? fmaf(sum_mn(v), (m == -INFINITY ? 0.0f : e), 1.0f) : sum_mn(v) + e;
        mx_mn(v) = grows ? x2 : m;
        if (params.target != nullptr) {
          const int n = get<1>(origin) + int(get<1>(c_mn(v)));
          const int t = t_mn(v);
          const int64_t row = get<0>(origin) + int(get<0>(c_mn(v)));
          if (n == t) params.target_logit[row] = x;
          else if (n == 0 && (t < 0 || t >= N)) params.target_logit[row] = t == params.ignore_index ? 0.0f : NAN;
        }
      }
      return in;
    }

    CUTLASS_DEVICE void end() {
      Tensor m_flt = filter_zeros(mx);
      Tensor s_flt = filter_zeros(sum);
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
          if (mn != -INFINITY) {
            s = s * exp2f(m - mn) + so * exp2f(mo - mn);
            m = mn;
          }
        }
        if (leader && elem_less(c_flt(i), residue)) g_flt(i) = (m + log2f(s)) * kLn2;
      }
    }
  };

  template <bool kRefSrc, class... A>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<A...> const& args) {
    auto mx = make_row_registers<float, kRefSrc>(args);
    auto sum = make_row_registers<float, kRefSrc>(args);
    auto g = make_row_gmem<kRefSrc>(this->params.partials, this->params.ld, args);
    auto t = make_row_registers<int, kRefSrc>(args);
    if (this->params.target != nullptr) load_row_ints(t, this->params.target, 1, args);
    auto origin = thread_origin(args);
    auto [M, N, K, L] = args.problem_shape_mnkl;
    return Callbacks<decltype(mx), decltype(g), decltype(t), decltype(args.tCcD), decltype(args.residue_tCcD), decltype(origin)>(
        mx, sum, g, t, args.tCcD, args.residue_tCcD, origin, int(N), this->params);
  }
};

}  // namespace encore::cuda::sm90::nodes
