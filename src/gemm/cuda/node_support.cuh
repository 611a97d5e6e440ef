// Shared machinery of encore's own EVT nodes (node_*.cuh): the boilerplate every Sm90 visitor
// node needs, the global coordinates of a thread's accumulator elements, and register tensors
// indexed by (row, column part) of the CTA tile.
//
// The consumer-store arguments give each thread tCcD, the coordinates of its elements relative to
// its first element (static), and residue_tCcD = (M, N) − (global coordinates of that element).
// So the global coordinates of element i are (M, N) − residue_tCcD + tCcD(i), and an element is
// inside the problem iff tCcD(i) < residue_tCcD componentwise.
//
// Row registers hold one value per row of the CTA tile a thread touches (the per-tile statistics of
// the reduction nodes, per-row inputs such as positions); a per-tile statistic covers the CTA tile
// N columns, so the partials' column width is the tile N of the kernel's configuration.
//
// Cross-thread reduction: in the Hopper WGMMA accumulator layout a row of a warp's 16-row slab is
// held by the 4 lanes of a quad (lanes 4r..4r+3), each with 2 of every 8 columns, and no other warp
// holds that row in this tile; so a row's value is complete after reducing over the quad (shuffle
// xor 1 and 2), and lane 4r stores it. The GPU tests check every partial against the CPU.
#pragma once
#include <utility>

#include "common/cuda/fast_math.cuh"  // kLog2e, fast_exp2, fast_rcp
#include "cute/tensor.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

namespace encore::cuda::sm90::nodes {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;
using cutlass::Array;

// Host/params boilerplate of a node with no shared memory, no workspace and no producer loads;
// Derived::Arguments must be an aggregate (it is also the device Params).
template <class Args>
struct NodeBase {
  struct SharedStorage {};
  using Arguments = Args;
  using Params = Args;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE NodeBase() {}
  CUTLASS_HOST_DEVICE NodeBase(Params const& p, SharedStorage const&) : params(p) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  template <class... A>
  CUTLASS_DEVICE auto get_producer_load_callbacks(fusion::detail::ProducerLoadArgs<A...> const&) {
    return fusion::detail::EmptyProducerLoadCallbacks{};
  }
};

// Global (m, n) of the thread's first element (see above).
template <class StoreArgs>
CUTLASS_DEVICE auto thread_origin(StoreArgs const& args) {
  auto [M, N, K, L] = args.problem_shape_mnkl;
  return make_coord(int(M) - int(get<0>(args.residue_tCcD)), int(N) - int(get<1>(args.residue_tCcD)));
}

// Register tensor (CPY, CPY_M, CPY_N, EPI_M, EPI_N) with one value per row of the CTA tile the
// thread touches: the tile seen as (CTA_M, CTA_N) with stride 0 along N, partitioned like the
// accumulator and compacted (the stride-0 modes stay aliased).
template <class T, bool kRefSrc, class StoreArgs>
CUTLASS_DEVICE auto make_row_registers(StoreArgs const& args) {
  using TileShape = decltype(args.tile_shape_mnk);
  auto layout = make_layout(take<0, 2>(TileShape{}), make_stride(_1{}, _0{}));
  auto ref = make_tensor(make_gmem_ptr<T>(nullptr), layout);
  auto tCref = fusion::sm90_partition_for_epilogue<kRefSrc>(ref, args.epi_tile, args.tiled_copy, args.thread_idx);
  return make_tensor_like<T>(tCref);
}

// Column kGroups * n_tile + group of a [M, n_tiles * kGroups] row-major buffer (row stride ld) seen
// over this CTA's tile, one address per row, partitioned like the accumulator (kGroups values per
// row and tile, e.g. one per head of a tile of two heads).
template <bool kRefSrc, int kGroups = 1, class T, class StoreArgs>
CUTLASS_DEVICE auto make_row_gmem(T* ptr, int64_t ld, StoreArgs const& args, int group = 0) {
  using TileShape = decltype(args.tile_shape_mnk);
  constexpr int kTileM = size<0>(TileShape{});
  auto [m, n, k, l] = args.tile_coord_mnkl;
  T* base = ptr + int64_t(m) * kTileM * ld + int64_t(n) * kGroups + group;
  auto g = make_tensor(make_gmem_ptr<T>(base), make_layout(take<0, 2>(TileShape{}), make_stride(ld, _0{})));
  return fusion::sm90_partition_for_epilogue<kRefSrc>(g, args.epi_tile, args.tiled_copy, args.thread_idx);
}

// True when the whole CTA tile lies inside the problem (no element needs a bounds check).
template <class StoreArgs>
CUTLASS_DEVICE bool full_tile(StoreArgs const& args) {
  using TileShape = decltype(args.tile_shape_mnk);
  return int(get<0>(args.residue_cD)) >= int(size<0>(TileShape{})) && int(get<1>(args.residue_cD)) >= int(size<1>(TileShape{}));
}

// Elements per thread in one epilogue subtile.
template <class CTensor>
constexpr int kSubtileElems = decltype(size(take<0, 3>(shape(std::declval<CTensor>()))))::value;

// Sum over the 4 lanes of a quad (the lanes that share an accumulator row).
CUTLASS_DEVICE float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}
CUTLASS_DEVICE int quad_lane() { return int(threadIdx.x & 3); }  // position in the quad
CUTLASS_DEVICE bool quad_leader() { return quad_lane() == 0; }

// Fills one value per accumulator row: regs[row] = fn(m) for rows m inside the problem, `outside`
// for the others.
template <class RTensor, class StoreArgs, class Fn>
CUTLASS_DEVICE void fill_rows(RTensor& regs, StoreArgs const& args, typename RTensor::value_type outside, Fn fn) {
  auto origin = thread_origin(args);
  auto [M, N, K, L] = args.problem_shape_mnkl;
  Tensor r_flt = filter_zeros(regs);
  Tensor c_flt = filter_zeros(args.tCcD, regs.stride());
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(r_flt); ++i) {
    const int m = get<0>(origin) + int(get<0>(c_flt(i)));
    r_flt(i) = m < int(M) ? fn(m) : outside;
  }
}

}  // namespace encore::cuda::sm90::nodes
