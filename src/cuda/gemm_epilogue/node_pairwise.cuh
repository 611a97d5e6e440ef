// encore's pairwise EVT nodes (primitive 1, pairwise form, of math-coda.md §6) over adjacent
// accumulator columns (2j, 2j+1). In the WGMMA accumulator layout every thread holds columns in
// aligned pairs, so fragment elements (2i, 2i+1) are one pair; the GPU tests check it against the
// CPU reference.
//
//   SwigluAuxStore<T>  passes z through; stores aux[m, j] = silu(z[m, 2j]) · z[m, 2j+1] (T, row
//                      stride ld): the half-width SwiGLU output next to the kept pre-activation.
//                      Row offsets are computed once per tile; interior tiles skip bounds checks.
//   RopeRotate         rotates each pair by θ = 2π·pos[m]·f_j: (a, b) → (a·cosθ − b·sinθ, b·cosθ + a·sinθ),
//                      f_j = freq[2j] + freq[2j+1] (fp32 hi + lo, turns per position); pairs with
//                      f_j = 0 pass through. The phase is reduced to [−1/2, 1/2] turns exactly
//                      (pos·hi split into its rounded product and error by fma) before the hardware
//                      sin/cos (absolute error ~1e-6 on [−π, π]), so large positions stay accurate.
#pragma once
#include "cuda/gemm_epilogue/node_support.cuh"

namespace encore::cuda::sm90::nodes {

template <class T>
struct SwigluAuxArgs {
  T* aux = nullptr;
  int64_t ld = 0;
};

template <class T>
struct SwigluAuxStore : NodeBase<SwigluAuxArgs<T>> {
  using NodeBase<SwigluAuxArgs<T>>::NodeBase;

  template <class OTensor, class CTensor, class Residue>
  struct Callbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE Callbacks(OTensor o, T* b, CTensor c, Residue r, bool f) : row_off(o), base(b), coord(c), residue(r), full(f) {}
    OTensor row_off;  // per row: m · ld
    T* base;          // aux + (this thread's first column) / 2
    CTensor coord;
    Residue residue;
    bool full;

    template <bool kFull, class In, class O, class C>
    CUTLASS_DEVICE void store(In const& in, int v0, O const& o_mn, C const& c_mn) {
      static_assert(int(In::kElements) % 2 == 0, "pairwise nodes need whole column pairs per fragment");
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < int(In::kElements); i += 2) {
        auto c = c_mn(v0 + i);
        if (!kFull && !elem_less(c, residue)) continue;  // N is even, so column 2j+1 is inside too
        const float g = float(in[i]), u = float(in[i + 1]);
        const float silu = __fdividef(g, 1.0f + fast_exp2(-1.4426950408889634f * g));
        base[o_mn(v0 + i) + int(get<1>(c)) / 2] = T(silu * u);
      }
    }

    template <class ElementAcc, class ElementIn, int kFrag>
    CUTLASS_DEVICE Array<ElementIn, kFrag> visit(Array<ElementAcc, kFrag> const&, int epi_v, int epi_m, int epi_n,
                                                 Array<ElementIn, kFrag> const& in) {
      Tensor o_mn = row_off(_, _, _, epi_m, epi_n);
      Tensor c_mn = coord(_, _, _, epi_m, epi_n);
      if (full) store<true>(in, epi_v * kFrag, o_mn, c_mn);
      else store<false>(in, epi_v * kFrag, o_mn, c_mn);
      return in;
    }
  };

  template <bool kRefSrc, class... A>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<A...> const& args) {
    auto origin = thread_origin(args);
    auto row_off = make_row_registers<int64_t, kRefSrc>(args);
    const int64_t ld = this->params.ld;
    fill_rows(row_off, args, int64_t(0), [&](int m) { return int64_t(m) * ld; });
    T* base = this->params.aux + get<1>(origin) / 2;
    return Callbacks<decltype(row_off), decltype(args.tCcD), decltype(args.residue_tCcD)>(row_off, base, args.tCcD, args.residue_tCcD,
                                                                                          full_tile(args));
  }
};

struct RopeArgs {
  const int32_t* pos = nullptr;  // [M]
  const float* freq = nullptr;   // [N]: (hi, lo) per pair
};

struct RopeRotate : NodeBase<RopeArgs> {
  using NodeBase<RopeArgs>::NodeBase;

  template <class PTensor, class CTensor, class Residue, class Origin>
  struct Callbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE Callbacks(PTensor p, CTensor c, Residue r, Origin o, RopeArgs const& a)
        : pos(p), coord(c), residue(r), origin(o), params(a) {}
    PTensor pos;  // per-row positions
    CTensor coord;
    Residue residue;
    Origin origin;
    RopeArgs const& params;

    template <class ElementAcc, class ElementIn, int kFrag>
    CUTLASS_DEVICE Array<float, kFrag> visit(Array<ElementAcc, kFrag> const&, int epi_v, int epi_m, int epi_n,
                                             Array<ElementIn, kFrag> const& in) {
      static_assert(kFrag % 2 == 0, "pairwise nodes need whole column pairs per fragment");
      Tensor c_mn = coord(_, _, _, epi_m, epi_n);
      Tensor p_mn = pos(_, _, _, epi_m, epi_n);
      // Loads first (all of them, so they overlap), then the rotations; f = 0 rotates by exactly 0.
      float2 f[kFrag / 2];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kFrag; i += 2) {
        auto c = c_mn(epi_v * kFrag + i);
        const int n = elem_less(c, residue) ? get<1>(origin) + int(get<1>(c)) : 0;
        f[i / 2] = __ldg(reinterpret_cast<const float2*>(params.freq + n));
      }
      Array<float, kFrag> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kFrag; i += 2) {
        const float a = float(in[i]), b = float(in[i + 1]);
        const float p = float(p_mn(epi_v * kFrag + i));
        const float hi = f[i / 2].x, lo = f[i / 2].y;
        const float prod = p * hi, err = fmaf(p, hi, -prod);  // p·hi = prod + err exactly (|p| < 2^24)
        const float turns = (prod - rintf(prod)) + fmaf(p, lo, err);
        float s, co;
        __sincosf(6.283185307179586f * turns, &s, &co);  // |θ| <= π: absolute error ~1e-6
        out[i] = a * co - b * s;
        out[i + 1] = b * co + a * s;
      }
      return out;
    }
  };

  template <bool kRefSrc, class... A>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<A...> const& args) {
    auto pos = make_row_registers<int, kRefSrc>(args);
    const int32_t* p = this->params.pos;
    fill_rows(pos, args, 0, [&](int m) { return __ldg(p + m); });
    auto origin = thread_origin(args);
    return Callbacks<decltype(pos), decltype(args.tCcD), decltype(args.residue_tCcD), decltype(origin)>(pos, args.tCcD, args.residue_tCcD,
                                                                                                        origin, this->params);
  }
};

}  // namespace encore::cuda::sm90::nodes
