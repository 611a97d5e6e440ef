// encore's EVT node of the SwiGLU backward (primitives 1, 3 and 4 of the five, docs/gemm.md):
// pairwise math over a packed-pair tile input, a packed-pair tile store, a block reduction along N.
//
//   SwigluBwdPairs<T>  children (dy = the accumulator, zp = the saved Z as 32-bit containers of the
//                      (g, u) pair of T, loaded as the kernel's C tile [M, N] of pairs); per element:
//                        s = σ(g);  y = g·s·u  (returned: D);  dg = dy·u·s·(1 + g(1 − s));  du = dy·g·s
//                      stores dZ[m, (2n, 2n+1)] = (dg, du) as T (row stride ld elements; a thread's
//                      column pair (n, n+1) is one 8-byte store), and the per-(row, CTA tile) partials
//                      Σ_n (g·dg + u·du) (fp32 [M, ceil(N / CTA_N)], unscaled; zdz = (1/d)·Σ_t).
// Elements outside the problem: dy = 0 and Z = 0 (TMA zero-fills), so their partial terms are 0;
// their dZ is not stored. σ uses ex2 + rcp (approximate, ~2 ulp), the exponent clamped at 60.
#pragma once
#include "gemm/cuda/node_support.cuh"

namespace encore::cuda::sm90::nodes {

template <class T>
struct SwigluBwdArgs {
  T* dz = nullptr;  // [M, 2N]
  int64_t ld_dz = 0;
  float* partials = nullptr;  // [M, ceil(N / CTA_N)]
  int64_t ld_partials = 0;
};

template <class T>
struct SwigluBwdPairs : NodeBase<SwigluBwdArgs<T>> {
  using NodeBase<SwigluBwdArgs<T>>::NodeBase;

  template <class RTensor, class CTensor, class Residue, class Origin>
  struct Callbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE Callbacks(RTensor r, CTensor c, Residue res, Origin o, SwigluBwdArgs<T> const& p, int n_tile)
        : sums(r), coord(c), residue(res), origin(o), dz(p.dz), ld(p.ld_dz), partials(p.partials + n_tile), ld_partials(p.ld_partials) {
      fill(sums, 0.0f);
    }
    RTensor sums;  // per row: Σ (g·dg + u·du) over this tile's columns
    CTensor coord;
    Residue residue;
    Origin origin;
    T* dz;
    int64_t ld;
    float* partials;  // column n_tile of the partials
    int64_t ld_partials;

    template <class ElementAcc, class ElementDy, class ElementZ, int kFrag>
    CUTLASS_DEVICE Array<float, kFrag> visit(Array<ElementAcc, kFrag> const&, int epi_v, int epi_m, int epi_n,
                                             Array<ElementDy, kFrag> const& dy, Array<ElementZ, kFrag> const& zp) {
      static_assert(kFrag % 2 == 0, "SwigluBwdPairs stores whole column pairs");
      static_assert(sizeof(ElementZ) == 4, "Z arrives as 32-bit containers of (g, u)");
      Tensor c_mn = coord(_, _, _, epi_m, epi_n);
      Tensor s_mn = sums(_, _, _, epi_m, epi_n);
      Array<float, kFrag> y;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kFrag; i += 2) {
        uint32_t packed[2];
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < 2; ++h) {
          const int v = i + h;
          const Array<T, 2> gu = reinterpret_cast<Array<T, 2> const&>(zp[v]);
          const float g = float(gu[0]), u = float(gu[1]), d = float(dy[v]);
          const float s = fast_rcp(1.0f + fast_exp2(fminf(-kLog2e * g, 60.0f)));
          const float gs = g * s;
          y[v] = gs * u;
          const float du = d * gs, dg = d * u * s * fmaf(g, 1.0f - s, 1.0f);
          s_mn(epi_v * kFrag + v) += fmaf(g, dg, u * du);
          Array<T, 2> out;
          out[0] = T(dg);
          out[1] = T(du);
          packed[h] = reinterpret_cast<uint32_t const&>(out);
        }
        const auto c = c_mn(epi_v * kFrag + i);
        if (elem_less(c, residue)) {  // N is even: the pair's second column is inside too
          const int64_t m = get<0>(origin) + int(get<0>(c)), n = get<1>(origin) + int(get<1>(c));
          *reinterpret_cast<uint2*>(dz + m * ld + 2 * n) = make_uint2(packed[0], packed[1]);
        }
      }
      return y;
    }

    CUTLASS_DEVICE void end() {
      const bool leader = quad_leader();
      Tensor r_flt = filter_zeros(sums);
      Tensor c_flt = filter_zeros(coord, sums.stride());
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(r_flt); ++i) {
        const float v = quad_sum(r_flt(i));
        if (leader && elem_less(c_flt(i), residue)) partials[(get<0>(origin) + int64_t(get<0>(c_flt(i)))) * ld_partials] = v;
      }
    }
  };

  template <bool kRefSrc, class... A>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<A...> const& args) {
    auto sums = make_row_registers<float, kRefSrc>(args);
    auto origin = thread_origin(args);
    auto [m, n, k, l] = args.tile_coord_mnkl;
    return Callbacks<decltype(sums), decltype(args.tCcD), decltype(args.residue_tCcD), decltype(origin)>(
        sums, args.tCcD, args.residue_tCcD, origin, this->params, int(n));
  }
};

}  // namespace encore::cuda::sm90::nodes
