// encore's EVT nodes of the backward epilogues (primitives 1, 3 and 4 of the five, docs/gemm.md):
// pairwise math over a packed-pair tile input, a packed-pair tile store, block reductions along N
// and along M.
//
//   SwigluBwdPairs<T>  children (dy = the accumulator, zp = the saved Z as 32-bit containers of the
//                      (g, u) pair of T, loaded as the kernel's C tile [M, N] of pairs); per element:
//                        s = σ(g);  y = g·s·u  (returned: D);  dg = dy·u·s·(1 + g(1 − s));  du = dy·g·s
//                      stores dZ[m, (2n, 2n+1)] = (dg, du) as T (row stride ld elements; a thread's
//                      column pair (n, n+1) is one 8-byte store), and the per-(row, CTA tile) partials
//                      Σ_n (g·dg + u·du) (fp32 [M, ceil(N / CTA_N)], unscaled; zdz = (1/d)·Σ_t).
// Elements outside the problem: dy = 0 and Z = 0 (TMA zero-fills), so their partial terms are 0;
// their dZ is not stored. σ uses ex2 + rcp (approximate, ~2 ulp), the exponent clamped at 60.
//
//   ColumnPartials     block reduction along M: passes its child through and writes, per CTA tile,
//                      partials[m_tile, n] = Σ_{m in the tile} in[m, n] (fp32, rows of ld floats; one
//                      row per CTA tile M, all CTA_N columns of the tile written, 0 past N). Each
//                      thread keeps one register per column it holds (32 on a 128-wide tile); at the
//                      last subtile the 8 lanes of a warp that share columns sum over xor 4, 8, 16, lanes
//                      0-3 put the warp's sums in the current D staging buffer, and thread t adds the
//                      warps' sums of column t in warp order: deterministic. Replaces CUTLASS's
//                      Sm90RowReduction (FinalReduction = false), whose callbacks ptxas kept in a 1088 B
//                      stack frame in the rmsnorm_bwd kernel (this node: none).
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

// Register tensor (CPY, CPY_M, CPY_N, EPI_M, EPI_N) with one value per column of the CTA tile the
// thread touches (the transpose of make_row_registers: stride 0 along M).
template <class T, bool kRefSrc, class StoreArgs>
CUTLASS_DEVICE auto make_col_registers(StoreArgs const& args) {
  using TileShape = decltype(args.tile_shape_mnk);
  auto layout = make_layout(take<0, 2>(TileShape{}), make_stride(_0{}, _1{}));
  auto ref = make_tensor(make_gmem_ptr<T>(nullptr), layout);
  auto tCref = fusion::sm90_partition_for_epilogue<kRefSrc>(ref, args.epi_tile, args.tiled_copy, args.thread_idx);
  return make_tensor_like<T>(tCref);
}

struct ColumnPartialsArgs {
  float* partials = nullptr;  // [ceil(M / CTA_M), ld], ld >= round_up(N, CTA_N)
  int64_t ld = 0;
};

struct ColumnPartials : NodeBase<ColumnPartialsArgs> {
  using NodeBase<ColumnPartialsArgs>::NodeBase;

  template <int kTileM, int kTileN, int kThreads, class RTensor, class CTensor, class Residue>
  struct Callbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    static constexpr int kWarps = kThreads / 32;
    CUTLASS_DEVICE Callbacks(RTensor r, CTensor c, Residue res, float* row, int col0, int tid, bool rows_inside)
        : sums(r), coord(c), residue(res), out_row(row), col_origin(col0), thread_idx(tid), inside(rows_inside) {
      fill(sums, 0.0f);
    }
    RTensor sums;      // one register per column of the tile the thread holds
    CTensor coord;     // tCcD
    Residue residue;   // residue_tCcD
    float* out_row;    // partials + m_tile · ld + n_tile · CTA_N
    int col_origin;    // the tile column of the thread's first element
    int thread_idx;    // in the epilogue's thread group
    bool inside;       // the CTA tile has rows inside the problem (a cluster may hold one past M)

    template <class ElementAcc, class ElementIn, int kFrag>
    CUTLASS_DEVICE Array<ElementIn, kFrag> visit(Array<ElementAcc, kFrag> const&, int epi_v, int epi_m, int epi_n,
                                                 Array<ElementIn, kFrag> const& in) {
      Tensor s_mn = sums(_, _, _, epi_m, epi_n);
      Tensor c_mn = coord(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kFrag; ++i)
        if (elem_less(c_mn(epi_v * kFrag + i), residue)) s_mn(epi_v * kFrag + i) += float(in[i]);
      return in;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&& smem, SyncFn const& sync_fn, int, int, bool is_last_iteration, VTensor) {
      if (!is_last_iteration) return;
      using SmemT = typename cute::remove_cvref_t<STensor>::value_type;
      static_assert(decltype(cosize(smem.layout()))::value * sizeof(SmemT) >= sizeof(float) * kWarps * kTileN,
                    "ColumnPartials: the D staging buffer is too small for the warps' column sums");
      float* buf = reinterpret_cast<float*>(raw_pointer_cast(smem.data()));
      Tensor r_flt = filter_zeros(sums);
      Tensor c_flt = filter_zeros(coord, sums.stride());
      const int lane = int(threadIdx.x & 31), warp = thread_idx / 32;
      sync_fn();  // the staging buffer is free (as for CUTLASS's smem reductions)
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(r_flt); ++i) {
        float v = r_flt(i);  // lanes l, l ^ 4, l ^ 8, l ^ 16, ... hold the same columns, other rows
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (lane < 4) buf[warp * kTileN + col_origin + int(get<1>(c_flt(i)))] = v;
      }
      sync_fn();
      if (inside) {
        CUTLASS_PRAGMA_UNROLL
        for (int n = thread_idx; n < kTileN; n += kThreads) {
          float s = 0.0f;
          CUTLASS_PRAGMA_UNROLL
          for (int w = 0; w < kWarps; ++w) s += buf[w * kTileN + n];
          out_row[n] = s;
        }
      }
      sync_fn();  // before the buffer stages D
    }
  };

  template <bool kRefSrc, class... A>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<A...> const& args) {
    using TileShape = decltype(args.tile_shape_mnk);
    constexpr int kTileM = size<0>(TileShape{}), kTileN = size<1>(TileShape{});
    constexpr int kThreads = decltype(size(args.tiled_copy))::value;
    static_assert(kThreads % 32 == 0 && kTileN % 8 == 0, "ColumnPartials: whole warps, 8-column groups");
    auto sums = make_col_registers<float, kRefSrc>(args);
    auto origin = thread_origin(args);
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    float* row = this->params.partials + int64_t(m) * this->params.ld + int64_t(n) * kTileN;
    const int col0 = get<1>(origin) - int(n) * kTileN;
    return Callbacks<kTileM, kTileN, kThreads, decltype(sums), decltype(args.tCcD), decltype(args.residue_tCcD)>(
        sums, args.tCcD, args.residue_tCcD, row, col0, int(args.thread_idx), int64_t(m) * kTileM < int64_t(M));
  }
};

}  // namespace encore::cuda::sm90::nodes
