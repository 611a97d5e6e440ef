// The fixed Hopper GEMM mainloop of the GEMM-epilogue family, parameterized by an epilogue visitor
// tree (EVT) and a tile configuration.
//
// Math:    acc = A · Wᵀ in fp32 (A [M, K] row-major, or stored [K, M] for a program with kATransposed, W [N, K] row-major = K-major B; or acc = A · W for a
//          program with kWeightKN, W [K, N] row-major = N-major B, the dgrad GEMMs), then D = EVT(acc)
//          stored row-major [M, N] (no C operand unless the EVT fetches it).
// Mainloop: CUTLASS 3.x Sm90 TMA + WGMMA, warp-specialized, persistent (cooperative or ping-pong
//          schedule per TileConfig), stages = what shared memory leaves after the epilogue.
// Constraints (validated by the dispatch): bf16/fp16 A and W, K and N multiples of 8 (16-byte TMA
//          rows; a ragged K or N where the rows are padded to 16 bytes), 16-byte aligned base pointers
//          and row strides. M is free (TMA masks the tail).
#pragma once
#include <cuda_runtime.h>

#include <tuple>
#include <type_traits>

#include "common/cuda/cutlass_steps.cuh"
#include "common/cuda/launch_check.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "encore/core/status.hpp"
#include "gemm/cuda/launch.hpp"
#include "gemm/cuda/programs.cuh"

namespace encore::cuda::sm90 {

using namespace cute;

// A tile configuration: CTA tile, cluster, and the matching kernel/epilogue schedules.
template <int kTileM, int kTileN, int kTileK, int kClusterM, int kClusterN, bool kCooperative>
struct TileConfig {
  using TileShape = Shape<Int<kTileM>, Int<kTileN>, Int<kTileK>>;
  using ClusterShape = Shape<Int<kClusterM>, Int<kClusterN>, _1>;
  using KernelSchedule = cute::conditional_t<kCooperative, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                             cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using EpilogueSchedule = cute::conditional_t<kCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                               cutlass::epilogue::TmaWarpSpecialized>;
};

// The tile configurations encore ships (GemmTile in the public API).
using Cooperative128x256 = TileConfig<128, 256, 64, 2, 1, true>;  // 2 consumer warpgroups share a tile
using Pingpong128x128 = TileConfig<128, 128, 64, 2, 1, false>;    // one warpgroup's epilogue overlaps the other's mainloop
using Pingpong64x256 = TileConfig<64, 256, 64, 2, 1, false>;      // ping-pong on the wide tile

// Whether a program multiplies by W [K, N] un-transposed (Program::kWeightKN; default W [N, K]).
template <class Program, class = void>
struct WeightKN : std::false_type {};
template <class Program>
struct WeightKN<Program, std::void_t<decltype(Program::kWeightKN)>> : std::bool_constant<Program::kWeightKN> {};

// Whether a program reads A stored [K, M] (Program::kATransposed; default A [M, K]).
template <class Program, class = void>
struct ATransposed : std::false_type {};
template <class Program>
struct ATransposed<Program, std::void_t<decltype(Program::kATransposed)>> : std::bool_constant<Program::kATransposed> {};

// GEMM for element type T with epilogue program `Program` (its Evt<TileShape>, ElementC and
// ElementD; void C = no source tile, void D = no output tile).
template <class T, class Config, class Program>
struct Sm90Gemm {
  using ElementC = typename Program::ElementC;
  using ElementD = typename Program::ElementD;
  static constexpr int kAlign = 16 / sizeof(T);
  static constexpr int kAlignC = cute::is_void_v<ElementC> ? kAlign : 16 / int(sizeof(cute::conditional_t<cute::is_void_v<ElementC>, T, ElementC>));
  static constexpr bool kWeightKN = WeightKN<Program>::value;
  // B = Wᵀ: W [N, K] is K-major (column-major B); W [K, N] un-transposed is N-major (row-major B).
  using LayoutB = cute::conditional_t<kWeightKN, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
  static constexpr bool kATransposed = ATransposed<Program>::value;
  // A [M, K] row-major is K-major; A stored [K, M] (M contiguous) is column-major A, M-major in shared
  // memory (GMMA reads either major for 16-bit types).
  using LayoutA = cute::conditional_t<kATransposed, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using Fusion = typename Program::template Evt<typename Config::TileShape>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::TileShape, typename Config::ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      ElementC, cutlass::layout::RowMajor, kAlignC,  // source tile (void: none)
      ElementD, cutlass::layout::RowMajor, kAlign,
      typename Config::EpilogueSchedule, Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      T, LayoutA, kAlign,                            // A [M, K] or stored [K, M]
      T, LayoutB, kAlign,                            // B = Wᵀ (W [N, K]) or W [K, N]
      float, typename Config::TileShape, typename Config::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideC = typename Kernel::StrideC;
  using StrideD = typename Kernel::StrideD;

  // Arguments for A [M, K] (row stride lda), W [N, K] (ldw), C and D [M, N] (ldc, ldd).
  static typename Gemm::Arguments arguments(const GemmProblem& p, typename Fusion::Arguments fusion) {
    const int M = p.M, N = p.N, K = p.K;
    StrideA sa = cutlass::make_cute_packed_stride(StrideA{}, make_shape(M, K, 1));
    StrideB sb = cutlass::make_cute_packed_stride(StrideB{}, make_shape(N, K, 1));
    StrideC sc = cutlass::make_cute_packed_stride(StrideC{}, make_shape(M, N, 1));
    StrideD sd = cutlass::make_cute_packed_stride(StrideD{}, make_shape(M, N, 1));
    if constexpr (kATransposed) get<1>(sa) = p.lda;  // A [K, M]: stride along K
    else get<0>(sa) = p.lda;  // row strides may exceed the packed ones
    if constexpr (kWeightKN) get<1>(sb) = p.ldw;  // W [K, N]: stride along K
    else get<0>(sb) = p.ldw;
    if constexpr (!cute::is_void_v<ElementC>) get<0>(sc) = p.ldc;
    if constexpr (!cute::is_void_v<ElementD>) get<0>(sd) = p.ldd;
    // The batch stride enters D's TMA descriptor, which needs every stride 16-byte aligned: the packed
    // M·N is not when N is odd (kLse / kCeBwd with padded D rows), ldd·M is (L = 1: never stepped).
    if constexpr (!cute::is_void_v<ElementD>) get<2>(sd) = p.ldd * int64_t(M);
    // Likewise A's (its contiguous K, or M when stored [K, M], may be odd in padded rows).
    get<2>(sa) = p.lda * int64_t(kATransposed ? K : M);
    cutlass::KernelHardwareInfo hw;
    hw.device_id = p.device;
    hw.sm_count = p.sm_count;
    using PtrC = cute::conditional_t<cute::is_void_v<ElementC>, const void*, const ElementC*>;
    using PtrD = cute::conditional_t<cute::is_void_v<ElementD>, void*, ElementD*>;
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {M, N, K, 1},
                                  {static_cast<const T*>(p.a), sa, static_cast<const T*>(p.w), sb},
                                  {fusion, static_cast<PtrC>(p.c), sc, static_cast<PtrD>(p.d), sd},
                                  hw};
    args.scheduler.max_swizzle_size = p.swizzle;
    using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.raster_order = p.raster == 1 ? Raster::AlongM : p.raster == 2 ? Raster::AlongN : Raster::Heuristic;
    return args;
  }
};

// Whether two problems are the same launch (every field: the kernel's Params are a function of the
// problem alone). The size check makes a new GemmProblem field fail to compile until it is compared.
inline bool same_problem(const GemmProblem& x, const GemmProblem& y) {
  static_assert(sizeof(GemmProblem) == 232, "GemmProblem changed: compare the new field in same_problem");
  auto tie = [](const GemmProblem& p) {
    return std::tie(p.a, p.lda, p.w, p.ldw, p.d, p.ldd, p.M, p.N, p.K, p.dtype, p.c, p.ldc, p.c2, p.ldc2, p.zdz, p.aux, p.ld_aux,
                    p.gamma, p.row_scale, p.alpha, p.partials, p.ld_partials, p.pos, p.freq, p.target, p.target_logit, p.lse,
                    p.ignore_index, p.col0, p.n_total, p.swizzle, p.raster, p.device, p.sm_count);
  };
  return tie(x) == tie(y);
}

// can_implement -> Params -> launch on `stream` (common/cuda/cutlass_steps.cuh: each step's failure a
// Status naming the kernel, the step and the code; the kernels used here need no workspace).
// can_implement sees M, N and K rounded up to the 16-byte alignment: the dispatch has checked every
// operand's rows (validate_cuda), the TMA descriptors take any extent and clip (stores) or zero-fill
// (loads) past it: kLse / kCeBwd store D with N odd where D's rows are padded, and the dgrad / wgrad rows
// read an A whose contiguous K (or M) is odd in padded rows (CUTLASS's check would ask the extents
// themselves to be aligned).
// Host cost: the Params (TMA descriptors included) of the last problem are kept per kernel and
// thread, so a call repeating it (same shapes and addresses: a training step's or a benchmark's
// loop) only launches (make_args, which builds CUTLASS's Arguments, runs only on a new problem); the kernel's shared-memory attribute is set once per kernel and device
// (set_dynamic_smem; CUTLASS's initialize sets it on every call). The caller has made p.device current (the dispatch's
// DeviceGuard: also a current context, which the descriptors' encoding needs).
template <class G, class MakeArgs>
Status run_gemm(const GemmProblem& p, MakeArgs&& make_args, cudaStream_t stream, const char* name) {
  using Kernel = typename G::Kernel;
  struct Last {
    bool valid = false;
    GemmProblem problem;
    typename Kernel::Params params;
  };
  thread_local Last last;
  if (!(last.valid && same_problem(last.problem, p))) {
    last.valid = false;
    const typename G::Gemm::Arguments args = make_args();
    typename G::Gemm::Arguments check = args;
    auto up = [](int x) { return (x + G::kAlign - 1) / G::kAlign * G::kAlign; };
    cute::get<0>(check.problem_shape) = up(cute::get<0>(args.problem_shape));
    cute::get<1>(check.problem_shape) = up(cute::get<1>(args.problem_shape));
    cute::get<2>(check.problem_shape) = up(cute::get<2>(args.problem_shape));
    ENCORE_RETURN_IF_ERROR(cutlass_steps::can_implement<typename G::Gemm>(check, name));
    if (G::Gemm::get_workspace_size(args) != 0) return Status::internal(std::string(name) + ": kernel unexpectedly needs a workspace");
    constexpr int smem = Kernel::SharedStorageSize;
    if (smem >= (48 << 10)) ENCORE_RETURN_IF_ERROR(set_dynamic_smem(name, cutlass::device_kernel<Kernel>, size_t(smem)));
    ENCORE_RETURN_IF_ERROR(cutlass_steps::make_params<Kernel>(args, &last.params, name));
    last.problem = p;
    last.valid = true;
  }
  return cutlass_steps::launch<Kernel>(last.params, stream, name);
}

// Launches the GEMM with epilogue program Family<T> (see programs.cuh) on `Config`, for
// the problem's dtype.
template <template <class> class Family, class Config, class T>
Status launch_typed(const GemmProblem& p, cudaStream_t stream, const char* name) {
  using G = Sm90Gemm<T, Config, Family<T>>;
  return run_gemm<G>(p, [&] { return G::arguments(p, Family<T>::template arguments<typename G::Fusion>(p)); }, stream, name);
}

template <template <class> class Family, class Config>
Status launch_family(const GemmProblem& p, Stream stream, const char* name) {
  auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::kBF16) return launch_typed<Family, Config, cutlass::bfloat16_t>(p, s, name);
  if (p.dtype == DType::kFP16) return launch_typed<Family, Config, cutlass::half_t>(p, s, name);
  return Status::unsupported(std::string("a: ") + name + " on CUDA takes bf16 or fp16, got " + dtype_name(p.dtype));
}

// Launches program Program on Config; a program with a D-less twin (NoStoreTwin, programs.cuh)
// runs the twin when the problem has no D.
template <template <class> class Program, class Config>
Status launch_program(const GemmProblem& p, Stream stream, const char* name) {
  if constexpr (NoStoreTwin<Program>::kHas) {
    if (p.d == nullptr) return launch_family<NoStoreTwin<Program>::template type, Config>(p, stream, name);
  }
  return launch_family<Program, Config>(p, stream, name);
}

}  // namespace encore::cuda::sm90
