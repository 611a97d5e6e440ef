// moe_forward's expert compute on CUDA: bf16 grouped GEMMs on CUTLASS's Sm90 pointer-array
// mainloop (TMA + WGMMA, warp-specialized, persistent group tile scheduler) with the SwiGLU fused into
// the up GEMM's epilogue or in a row kernel between them (p.fused_swiglu: moe::moe_fused_swiglu,
// plan.cpp; the row kernel unless ENCORE_MOE_FUSED_SWIGLU asks for the fused one).
//
// Math (group e = expert e = rows [offsets[e], offsets[e + 1]) of the permuted buffers, padding
// rows included; M_e is read on the device, so empty experts are zero-size groups):
//   fused (three grouped GEMMs):
//     gate     h[r, 0:F]   = x_permuted[r] . w13[e][0:F]^T     fp32 accumulate, stored fp32 (gate_up's
//                                                               first F columns, row stride ldh)
//     up+act   act[r, f]   = bf16(silu(h[r, f]) * (x_permuted[r] . w13[e][F + f]^T))   the up GEMM's
//                            epilogue: h read back as its C operand (TMA, per-group descriptors),
//                            the up value straight from the fp32 accumulator; nothing else stored
//   unfused: h[r, 0:2F] = x_permuted[r] . w13[e]^T (fp32), then swiglu_rows_kernel for act;
//   down     y[r, 0:D]   = bf16(act[r] . w2[e]^T)      fp32 accumulate                 [R, D]
//   silu_mul(g, u) = g / (1 + expf(-g)) * u in fp32 (IEEE division, each step rounded), rounded to bf16
//   once (RNE), the same function in both paths, so act and y are meant to be bit-identical
//   between them (MoeForwardGpu.FusedSwigluMatchesUnfused).
// Shapes: x_permuted [R, D], w13 [E, 2F, D] (gate rows then up rows), w2 [E, D, F], h [R, >= 2F]
// fp32, act [R, F], y [R, D] bf16 (unit last stride); D, F multiples of 8 and every row / pointer
// 16-byte aligned (TMA). Padding rows of x_permuted are zero, so their h, act and y rows are zero
// (finite weights). Rows past offsets[E] are not touched.
// Kernels: gate/up and down on the cooperative 128x128x64 tile (two consumer warpgroups, 64 rows
// each), or 128x256x64 with p.wide_tile (moe::moe_wide_tile: from T 2); the fused up GEMM on the
// ping-pong 128x128x64 tile (one warpgroup per tile, so one warpgroup's silu epilogue overlaps the other's mainloop). Cluster 1x1; stages: what remains of
// shared memory after the epilogue's (StageCountAutoCarveout).
// Launch: a one-block kernel writes each GEMM's per-group problem shapes, A / B / C / D pointers and
// strides into the workspace from offsets (no host sync); CUTLASS's own workspace (per-SM TMA
// descriptors) follows, one region per GEMM. No allocation; everything is enqueued on `stream`.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "common/cuda/cutlass_steps.cuh"
#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "moe/cuda/launch.hpp"
#include "moe/cuda/silu_mul.cuh"

namespace encore::cuda {
namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;


// Sm90Compute's functor: out[i] = silu_mul(gate[i], up[i]) (gate = the C fragment, up = the
// accumulator fragment, both fp32).
template <class T>
struct SiluMul {
  CUTLASS_DEVICE T operator()(T const& g, T const& u) const {
    if constexpr (std::is_same_v<T, float>) {
      return silu_mul(g, u);
    } else {
      T out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < int(T::kElements); ++i) out[i] = silu_mul(g[i], u[i]);
      return out;
    }
  }
};

using Bf16 = cutlass::bfloat16_t;
constexpr auto kRoundNearest = cutlass::FloatRoundStyle::round_to_nearest;
// D = TOut(acc).
template <class TOut>
using StoreAcc = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::epilogue::thread::Identity, TOut, float, kRoundNearest>, fusion::Sm90AccFetch>;
// D = bf16(silu_mul(C, acc)), C fp32.
using StoreSiluMul = fusion::Sm90EVT<fusion::Sm90Compute<SiluMul, Bf16, float, kRoundNearest>, fusion::Sm90SrcFetch<float>, fusion::Sm90AccFetch>;

struct Cooperative {
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// One bf16 grouped GEMM D_g = program(A_g . B_g^T, C_g) (A_g [M_g, K] row-major, B_g [N, K] K-major),
// D of TOut, C of TC (void: none), on Tile.
template <class TOut, class TC, class Program, class Schedule, class Tile = Shape<_128, _128, _64>>
struct GroupedGemm {
  using T = Bf16;
  using Out = TOut;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using TileShape = Tile;
  using ClusterShape = Shape<_1, _1, _1>;
  static constexpr int kAlign = 16 / sizeof(T);
  static constexpr int kAlignOut = 16 / sizeof(TOut);
  static constexpr int kAlignC = std::is_void_v<TC> ? kAlignOut : int(16 / sizeof(std::conditional_t<std::is_void_v<TC>, char, TC>));

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, TC, cutlass::layout::RowMajor*, kAlignC, TOut, cutlass::layout::RowMajor*, kAlignOut, typename Schedule::Epilogue,
      Program>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor*, kAlign, T, cutlass::layout::ColumnMajor*, kAlign,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::Mainloop>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
};

using GateUpGemm = GroupedGemm<float, void, StoreAcc<float>, Cooperative>;  // gate (N = F) or the unfused gate/up (N = 2F)
using UpSwigluGemm = GroupedGemm<Bf16, float, StoreSiluMul, Pingpong>;      // up (N = F), C = gate, D = act
using DownGemm = GroupedGemm<Bf16, void, StoreAcc<Bf16>, Cooperative>;
using Wide = Shape<_128, _256, _64>;
using GateUpGemmWide = GroupedGemm<float, void, StoreAcc<float>, Cooperative, Wide>;
using DownGemmWide = GroupedGemm<Bf16, void, StoreAcc<Bf16>, Cooperative, Wide>;

// Per-group arrays of one GEMM in the workspace.
template <class G>
struct GroupArrays {
  typename G::Shape3* shapes;
  const typename G::T** a;
  const typename G::T** b;
  const void** c;  // TC const** (reinterpreted at the arguments); unused without C
  void** d;        // TOut**
  typename G::StrideA* sa;
  typename G::StrideB* sb;
  typename G::StrideC* sc;
  typename G::StrideD* sd;
};

// One GEMM's operands: bases, element sizes and the group spec (moe::grouped_operands).
template <class G>
struct FillJob {
  GroupArrays<G> g;
  moe::GroupedGemmSpec s;
  const void* a;
  const void* b;
  const void* c;  // nullptr: no C
  void* d;
  int c_bytes, d_bytes;  // bytes of one C / D element
};

template <class G>
__device__ void fill_group(const FillJob<G>& j, const int32_t* offsets, int e) {
  using T = Bf16;
  const moe::GroupedOperands o = moe::grouped_operands(j.s, offsets, e);
  j.g.shapes[e] = typename G::Shape3(o.m, j.s.n, j.s.k);
  j.g.a[e] = static_cast<const T*>(j.a) + o.a;
  j.g.b[e] = static_cast<const T*>(j.b) + o.b;
  j.g.c[e] = j.c == nullptr ? nullptr : static_cast<const char*>(j.c) + o.c * j.c_bytes;
  j.g.d[e] = static_cast<char*>(j.d) + o.d * j.d_bytes;
  j.g.sa[e] = make_stride(j.s.lda, _1{}, _0{});
  j.g.sb[e] = make_stride(j.s.ldb, _1{}, _0{});
  j.g.sc[e] = make_stride(j.s.ldc, _1{}, _0{});
  j.g.sd[e] = make_stride(j.s.ldd, _1{}, _0{});
}

// Fills every job's arrays: thread e (grid-stride) writes group e of each.
template <class... G>
__global__ void fill_groups_kernel(const int32_t* offsets, int E, FillJob<G>... jobs) {
  for (int e = int(threadIdx.x); e < E; e += int(blockDim.x)) (fill_group(jobs, offsets, e), ...);
}

// act[r, f] = bf16(silu_mul(h[r, f], h[r, F + f])) for rows r < min(offsets[E], rows_bound); 4
// columns per thread (F % 8 == 0, rows 16-byte aligned), a grid-stride loop over rows.
__global__ void __launch_bounds__(256) swiglu_rows_kernel(const float* h, int64_t ldh, __nv_bfloat16* act, int64_t lda, const int32_t* offsets,
                                                          int E, int64_t F, int64_t rows_bound) {
  int64_t rows = offsets[E];
  if (rows > rows_bound) rows = rows_bound;
  const int64_t packs = F / 4;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* hr = h + r * ldh;
    __nv_bfloat16* ar = act + r * lda;
    for (int64_t c = threadIdx.x; c < packs; c += blockDim.x) {
      const float4 g = *reinterpret_cast<const float4*>(hr + 4 * c);
      const float4 u = *reinterpret_cast<const float4*>(hr + F + 4 * c);
      __nv_bfloat162 o[2];
      o[0] = __floats2bfloat162_rn(silu_mul(g.x, u.x), silu_mul(g.y, u.y));
      o[1] = __floats2bfloat162_rn(silu_mul(g.z, u.z), silu_mul(g.w, u.w));
      *reinterpret_cast<uint2*>(ar + 4 * c) = *reinterpret_cast<const uint2*>(o);
    }
  }
}

// Carves [base, base + bytes) into 256-byte aligned regions.
struct Carver {
  char* base;
  size_t bytes, at = 0;
  template <class X>
  X* take(size_t n) {
    X* p = reinterpret_cast<X*>(base + at);
    at += (n * sizeof(X) + 255) / 256 * 256;
    return p;
  }
  bool fits() const { return at <= bytes; }
};

template <class G>
GroupArrays<G> carve(Carver& c, int E) {
  GroupArrays<G> g;
  g.shapes = c.take<typename G::Shape3>(size_t(E));
  g.a = c.take<const typename G::T*>(size_t(E));
  g.b = c.take<const typename G::T*>(size_t(E));
  g.c = c.take<const void*>(size_t(E));
  g.d = c.take<void*>(size_t(E));
  g.sa = c.take<typename G::StrideA>(size_t(E));
  g.sb = c.take<typename G::StrideB>(size_t(E));
  g.sc = c.take<typename G::StrideC>(size_t(E));
  g.sd = c.take<typename G::StrideD>(size_t(E));
  return g;
}

// G's arguments over the arrays filled for A, a GEMM of the same operand types on another tile (the
// arrays' types do not depend on the tile).
template <class G, class A>
typename G::Gemm::Arguments arguments(const GroupArrays<A>& g, int E, int device, int sm_count) {
  static_assert(std::is_same_v<typename G::Shape3, typename A::Shape3> && std::is_same_v<typename G::StrideA, typename A::StrideA> &&
                std::is_same_v<typename G::StrideB, typename A::StrideB> && std::is_same_v<typename G::StrideC, typename A::StrideC> &&
                std::is_same_v<typename G::StrideD, typename A::StrideD> && std::is_same_v<typename G::Out, typename A::Out>);
  using TOut = typename G::Out;
  using TC = typename G::CollectiveEpilogue::ElementC;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  typename G::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                   {E, g.shapes, nullptr},
                                   {g.a, g.sa, g.b, g.sb},
                                   {{}, std::is_void_v<TC> ? nullptr : reinterpret_cast<TC const**>(g.c), std::is_void_v<TC> ? nullptr : g.sc,
                                    reinterpret_cast<TOut**>(g.d), g.sd},
                                   hw};
  return args;
}

// can_implement -> initialize (CUTLASS's workspace at `ws`, ws_bytes; the Params' TMA descriptors checked)
// -> launch on `stream` (common/cuda/cutlass_steps.cuh: each step's failure names the GEMM, the step and
// the code).
template <class G>
Status run_grouped(const typename G::Gemm::Arguments& args, void* ws, size_t ws_bytes, cudaStream_t stream, const char* name) {
  typename G::Gemm gemm;
  ENCORE_RETURN_IF_ERROR(cutlass_steps::can_implement<typename G::Gemm>(args, name));
  const size_t need = G::Gemm::get_workspace_size(args);
  if (need > ws_bytes)
    return Status::internal(std::string(name) + ": CUTLASS needs a workspace of " + std::to_string(need) + " bytes, more than the " +
                            std::to_string(ws_bytes) + " reserved (moe::kGroupedGemmCutlassBytes)");
  ENCORE_RETURN_IF_ERROR(cutlass_steps::initialize(gemm, args, ws, stream, name));
  return cutlass_steps::launch<typename G::Kernel>(gemm.params(), stream, name);
}

}  // namespace

Status launch_moe_expert_gemms(const moe::ExpertGemmProblem& p, int device_index, Stream stream) {
  const moe::ExpertMlpProblem& m = p.mlp;
  if (m.dtype != DType::kBF16) return Status::unsupported(std::string("x: moe_forward on CUDA takes bf16, got ") + dtype_name(m.dtype));
  const int E = m.num_experts;
  const int64_t F = m.intermediate;
  if (p.rows_bound == 0 || E == 0) return Status::ok();
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  auto s = static_cast<cudaStream_t>(stream);

  Carver c{static_cast<char*>(p.workspace), p.workspace_bytes};
  const GroupArrays<GateUpGemm> g_gate = carve<GateUpGemm>(c, E);
  const GroupArrays<UpSwigluGemm> g_up = carve<UpSwigluGemm>(c, E);
  const GroupArrays<DownGemm> g_down = carve<DownGemm>(c, E);
  char* cutlass_ws[moe::kGroupedGemmCount];
  for (char*& w : cutlass_ws) w = c.take<char>(moe::kGroupedGemmCutlassBytes);
  if (!c.fits())
    return Status::internal("moe grouped gemm: workspace of " + std::to_string(p.workspace_bytes) + " bytes, " + std::to_string(c.at) +
                            " needed (moe::grouped_gemm_workspace_bytes)");

  moe::ExpertGemmSpecs sp = moe::expert_gemm_specs(p);
  if (!p.fused_swiglu) sp.gate.n = int(2 * F);  // the unfused gate/up GEMM: both halves of w13
  const FillJob<GateUpGemm> j_gate{g_gate, sp.gate, m.x_permuted, m.w13, nullptr, p.gate_up, 4, 4};
  const FillJob<UpSwigluGemm> j_up{g_up, sp.up, m.x_permuted, m.w13, p.gate_up, m.act, 4, 2};
  const FillJob<DownGemm> j_down{g_down, sp.down, m.act, m.w2, nullptr, m.y, 2, 2};
  ENCORE_RETURN_IF_ERROR(launch("moe grouped gemm: group fill", [&] {
    fill_groups_kernel<GateUpGemm, UpSwigluGemm, DownGemm><<<1, 1024, 0, s>>>(m.offsets, E, j_gate, j_up, j_down);
  }));

  const size_t ws = moe::kGroupedGemmCutlassBytes;
  // The gate (or gate/up) GEMM on the chosen tile, over g_gate's arrays.
  auto gate = [&](const char* name) {
    return p.wide_tile ? run_grouped<GateUpGemmWide>(arguments<GateUpGemmWide>(g_gate, E, device_index, p.sm_count), cutlass_ws[0], ws, s, name)
                       : run_grouped<GateUpGemm>(arguments<GateUpGemm>(g_gate, E, device_index, p.sm_count), cutlass_ws[0], ws, s, name);
  };
  if (p.fused_swiglu) {
    ENCORE_RETURN_IF_ERROR(gate("moe gate grouped gemm"));
    ENCORE_RETURN_IF_ERROR(run_grouped<UpSwigluGemm>(arguments<UpSwigluGemm>(g_up, E, device_index, p.sm_count), cutlass_ws[1], ws, s,
                                                     "moe up + swiglu grouped gemm"));
  } else {
    ENCORE_RETURN_IF_ERROR(gate("moe gate/up grouped gemm"));
    const long long cap = 8LL * (p.sm_count > 0 ? p.sm_count : 132);
    const unsigned grid = unsigned(p.rows_bound < cap ? p.rows_bound : cap);
    ENCORE_RETURN_IF_ERROR(launch("moe swiglu rows", [&] {
      swiglu_rows_kernel<<<grid, 256, 0, s>>>(p.gate_up, p.gate_up_stride, static_cast<__nv_bfloat16*>(m.act), m.act_stride, m.offsets, E, F,
                                              p.rows_bound);
    }));
  }
  if (p.wide_tile)
    return run_grouped<DownGemmWide>(arguments<DownGemmWide>(g_down, E, device_index, p.sm_count), cutlass_ws[2], ws, s, "moe down grouped gemm");
  return run_grouped<DownGemm>(arguments<DownGemm>(g_down, E, device_index, p.sm_count), cutlass_ws[2], ws, s, "moe down grouped gemm");
}

}  // namespace encore::cuda
