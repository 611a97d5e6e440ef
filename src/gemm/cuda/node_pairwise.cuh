// encore's pairwise EVT nodes (primitive 1, pairwise form; docs/gemm.md) over adjacent
// accumulator columns (2j, 2j+1). In the WGMMA accumulator layout every thread holds columns in
// aligned pairs, so fragment elements (2i, 2i+1) are one pair; the GPU tests check it against the
// CPU reference.
//
//   SwigluAuxStore<T>  passes z through; stores aux[m, j] = silu(z[m, 2j]) · z[m, 2j+1] (T, row
//                      stride ld): the half-width SwiGLU output next to the kept pre-activation.
//                      Stores go out as one 8-byte store per lane and subtile row after a 4x4
//                      transpose over the quad (two shuffles of packed 16-bit pairs); aux needs
//                      8-byte aligned rows. Two pairs share one reciprocal (silu_mul2).
//   RopeRotate         rotates each pair by θ = 2π·pos[m]·f_j: (a, b) → (a·cosθ − b·sinθ, b·cosθ + a·sinθ),
//                      f_j = freq[2j] + freq[2j+1] (fp32 hi + lo, turns per position); pairs with
//                      f_j = 0 pass through. The phase is reduced to [−1/2, 1/2] turns exactly
//                      (pos·hi split into its rounded product and error by fma) before the hardware
//                      sin/cos (absolute error ~1e-6 on [−π, π]), so large positions stay accurate.
//   RopeRotateT<true>  the inverse rotation (θ → −θ): (a, b) → (a·cosθ + b·sinθ, b·cosθ − a·sinθ), the
//                      RoPE backward (rope_bwd); RopeRotate = RopeRotateT<false>.
#pragma once
#include "gemm/cuda/node_support.cuh"

namespace encore::cuda::sm90::nodes {

// silu(g0)·u0 and silu(g1)·u1 with one reciprocal, g·u·d_other / (d0·d1), d = 1 + 2^(−g·log2 e):
// an ex2 per pair and a reciprocal per two pairs on the MUFU pipe (was ex2 + rcp per pair). The
// exponent is clamped at 60 so d0·d1 stays finite: for g < −41.6, silu(g) is computed as g·2^−60
// instead of g·e^g (both below 1e−16·|g|); a NaN in one pair does not reach the other.
CUTLASS_DEVICE float2 silu_mul2(float g0, float u0, float g1, float u1) {
  const float d0 = 1.0f + fast_exp2(fminf(-kLog2e * g0, 60.0f));
  const float d1 = 1.0f + fast_exp2(fminf(-kLog2e * g1, 60.0f));
  const float r = fast_rcp(d0 * d1);
  return make_float2(g0 * u0 * (d1 * r), g1 * u1 * (d0 * r));
}

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
    static constexpr int kPairs = kSubtileElems<CTensor> / 2;
    CUTLASS_DEVICE Callbacks(OTensor o, T* b, CTensor c, Residue r, int m_left, int n_left, bool f)
        : row_off(o), base(b), coord(c), residue(r), rows_left(m_left), cols_left(n_left), full(f) {}
    OTensor row_off;  // per row: m · ld
    T* base;          // aux + (the quad's first column) / 2
    CTensor coord;
    Residue residue;
    int rows_left;    // M − this thread's first row
    int cols_left;    // N − the quad's first column
    bool full;
    float out[kPairs];  // silu(gate)·up of this subtile's pairs

    template <class ElementAcc, class ElementIn, int kFrag>
    CUTLASS_DEVICE Array<ElementIn, kFrag> visit(Array<ElementAcc, kFrag> const&, int epi_v, int, int, Array<ElementIn, kFrag> const& in) {
      static_assert(kFrag % 4 == 0, "SwigluAuxStore takes two column pairs at a time");
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kFrag; i += 4) {
        const float2 s = silu_mul2(float(in[i]), float(in[i + 1]), float(in[i + 2]), float(in[i + 3]));
        out[(epi_v * kFrag + i) / 2] = s.x;
        out[(epi_v * kFrag + i) / 2 + 1] = s.y;
      }
      return in;
    }

    // Per subtile row: the quad holds 4 groups of 8 columns, lane q the pair (2q, 2q+1) of each, so
    // the 4 outputs of group G are spread over the quad. A 4x4 transpose over the quad gives lane q
    // all of group q: one 8-byte store of 4 consecutive outputs. The values travel as packed 16-bit
    // pairs (low half first), two shuffles per row:
    //   stage 1 (xor 1): keep groups (b0, b0 + 2) of (a0, a2 | a1, a3), send the other pair; the lane
    //     then holds groups b0 and b0 + 2 from lanes q and q ^ 1;
    //   stage 2 (xor 2): keep group q (half b1 of both words, ordered by lane), send the other group;
    //     lanes (q & 2, q | 1) come from this lane, the other two from lane q ^ 2.
    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int epi_m, int epi_n, bool, VTensor) {
      Tensor c_mn = coord(_, _, _, epi_m, epi_n);
      Tensor o_mn = row_off(_, _, _, epi_m, epi_n);
      const int q = quad_lane(), b0 = q & 1, b1 = (q >> 1) & 1;
      // __byte_perm selectors of group half h from (keep, recv) ordered by lane: bytes of half h are
      // (2h, 2h + 1) in keep and (4 + 2h, 5 + 2h) in recv.
      auto selector = [&](int h) {
        const uint32_t k = 2 * h | (2 * h + 1) << 4, r = (4 + 2 * h) | (5 + 2 * h) << 4;
        return b0 ? r | k << 8 : k | r << 8;
      };
      const uint32_t sel_own = selector(b1), sel_send = selector(1 - b1);
      CUTLASS_PRAGMA_UNROLL
      for (int p = 0; p < kPairs; ++p) {
        const int dm = int(get<0>(c_mn(2 * p))), dn = int(get<1>(c_mn(2 * p)));
        if (dn % 32 != 0) continue;  // not group 0 of a subtile row
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        CUTLASS_PRAGMA_UNROLL
        for (int p2 = 0; p2 < kPairs; ++p2) {
          const int dm2 = int(get<0>(c_mn(2 * p2))), dn2 = int(get<1>(c_mn(2 * p2)));
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < 4; ++g)
            if (dm2 == dm && dn2 == dn + 8 * g) v[g] = out[p2];
        }
        const uint32_t p02 = pack2(v[0], v[2]), p13 = pack2(v[1], v[3]);
        const uint32_t keep = b0 ? p13 : p02;
        const uint32_t recv = __shfl_xor_sync(0xffffffffu, b0 ? p02 : p13, 1);
        const uint32_t own = __byte_perm(keep, recv, sel_own);
        const uint32_t other = __shfl_xor_sync(0xffffffffu, __byte_perm(keep, recv, sel_send), 2);
        const uint2 packed = b1 ? make_uint2(other, own) : make_uint2(own, other);
        const bool inside = full || (dm < rows_left && dn + 8 * q < cols_left);
        if (inside) *reinterpret_cast<uint2*>(base + o_mn(2 * p) + dn / 2 + 4 * q) = packed;
      }
    }

    // Two values of T packed in 32 bits, lo in the low half.
    CUTLASS_DEVICE static uint32_t pack2(float lo, float hi) {
      Array<T, 2> a;
      a[0] = T(lo);
      a[1] = T(hi);
      return reinterpret_cast<uint32_t const&>(a);
    }
  };

  template <bool kRefSrc, class... A>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<A...> const& args) {
    static_assert(decltype(size<1>(args.epi_tile))::value == 32, "SwigluAuxStore packs 4 groups of 8 columns per subtile row");
    auto origin = thread_origin(args);
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto row_off = make_row_registers<int64_t, kRefSrc>(args);
    const int64_t ld = this->params.ld;
    fill_rows(row_off, args, int64_t(0), [&](int m) { return int64_t(m) * ld; });
    const int quad_n = get<1>(origin) - 2 * quad_lane();
    T* base = this->params.aux + quad_n / 2;
    return Callbacks<decltype(row_off), decltype(args.tCcD), decltype(args.residue_tCcD)>(
        row_off, base, args.tCcD, args.residue_tCcD, int(M) - get<0>(origin), int(N) - quad_n, full_tile(args));
  }
};

struct RopeArgs {
  const int32_t* pos = nullptr;  // [M]
  const float* freq = nullptr;   // [N]: (hi, lo) per pair
};

template <bool kInverse>
struct RopeRotateT : NodeBase<RopeArgs> {
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
        if constexpr (kInverse) s = -s;                  // sin(−θ)
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
using RopeRotate = RopeRotateT<false>;

}  // namespace encore::cuda::sm90::nodes
