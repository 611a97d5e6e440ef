// moe_forward's expert compute on CUDA: two bf16 grouped GEMMs on CUTLASS's Sm90 pointer-array
// mainloop (TMA + WGMMA, warp-specialized cooperative, persistent group tile scheduler) and the
// SwiGLU between them.
//
// Math (group e = expert e = rows [offsets[e], offsets[e + 1]) of the permuted buffers, padding
// rows included; M_e is read on the device, so empty experts are zero-size groups):
//   gate/up  h[r, 0:2F]  = x_permuted[r] . w13[e]^T    fp32 accumulate, stored fp32   [R, 2F]
//   swiglu   act[r, f]   = bf16(silu(h[r, f]) * h[r, F + f])   (silu(g) = g / (1 + e^-g), fp32)
//   down     y[r, 0:D]   = bf16(act[r] . w2[e]^T)      fp32 accumulate                 [R, D]
// Shapes: x_permuted [R, D], w13 [E, 2F, D], w2 [E, D, F], act [R, F], y [R, D] bf16 (unit last
// stride); D, F multiples of 8 and every row / pointer 16-byte aligned (TMA). Padding rows of
// x_permuted are zero, so their h, act and y rows are zero (finite weights). Rows past offsets[E]
// are not touched.
// Launch: a one-block kernel writes each GEMM's per-group problem shapes, A / B / D pointers and
// strides into the workspace from offsets (no host sync); CUTLASS's own workspace (per-SM TMA
// descriptors) follows. No allocation; everything is enqueued on `stream`.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>

#include "common/cuda/device_guard.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "moe/cuda/launch.hpp"

namespace encore::cuda {
namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

// One bf16 grouped GEMM D_g = A_g . B_g^T (A_g [M_g, K] row-major, B_g [N, K] K-major), D of TOut.
template <class TOut>
struct GroupedGemm {
  using T = cutlass::bfloat16_t;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using TileShape = Shape<_128, _128, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  static constexpr int kAlign = 16 / sizeof(T);
  static constexpr int kAlignOut = 16 / sizeof(TOut);
  using Fusion = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::epilogue::thread::Identity, TOut, float, cutlass::FloatRoundStyle::round_to_nearest>,
                                 fusion::Sm90AccFetch>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, void, cutlass::layout::RowMajor*, kAlignOut, TOut, cutlass::layout::RowMajor*, kAlignOut,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor*, kAlign, T, cutlass::layout::ColumnMajor*, kAlign,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

using GateUpGemm = GroupedGemm<float>;
using DownGemm = GroupedGemm<cutlass::bfloat16_t>;

// Per-group arrays of one GEMM in the workspace.
template <class G>
struct GroupArrays {
  typename G::Shape3* shapes;
  const typename G::T** a;
  const typename G::T** b;
  void** d;  // TOut** (reinterpreted at the arguments)
  typename G::StrideA* sa;
  typename G::StrideB* sb;
  typename G::StrideD* sd;
};

// One GEMM's group description: A rows start at offsets[e] * lda, B at e * b_stride_e, D at
// offsets[e] * ldd (elements); N, K fixed.
struct GroupSpec {
  const void* a;
  int64_t lda;
  const void* b;
  int64_t b_stride_e, ldb;
  void* d;
  int64_t ldd;
  int n, k;
  int d_bytes;  // bytes of one D element
};

// Fills both GEMMs' arrays: thread e (grid-stride) writes group e. M_e = offsets[e + 1] - offsets[e].
template <class G1, class G2>
__global__ void fill_groups_kernel(const int32_t* offsets, int E, GroupArrays<G1> g1, GroupSpec s1, GroupArrays<G2> g2, GroupSpec s2) {
  for (int e = int(threadIdx.x); e < E; e += int(blockDim.x)) {
    const int32_t r0 = offsets[e], m = offsets[e + 1] - r0;
    using T = cutlass::bfloat16_t;
    g1.shapes[e] = typename G1::Shape3(m, s1.n, s1.k);
    g1.a[e] = static_cast<const T*>(s1.a) + int64_t(r0) * s1.lda;
    g1.b[e] = static_cast<const T*>(s1.b) + int64_t(e) * s1.b_stride_e;
    g1.d[e] = static_cast<char*>(s1.d) + int64_t(r0) * s1.ldd * s1.d_bytes;
    g1.sa[e] = make_stride(s1.lda, _1{}, _0{});
    g1.sb[e] = make_stride(s1.ldb, _1{}, _0{});
    g1.sd[e] = make_stride(s1.ldd, _1{}, _0{});
    g2.shapes[e] = typename G2::Shape3(m, s2.n, s2.k);
    g2.a[e] = static_cast<const T*>(s2.a) + int64_t(r0) * s2.lda;
    g2.b[e] = static_cast<const T*>(s2.b) + int64_t(e) * s2.b_stride_e;
    g2.d[e] = static_cast<char*>(s2.d) + int64_t(r0) * s2.ldd * s2.d_bytes;
    g2.sa[e] = make_stride(s2.lda, _1{}, _0{});
    g2.sb[e] = make_stride(s2.ldb, _1{}, _0{});
    g2.sd[e] = make_stride(s2.ldd, _1{}, _0{});
  }
}

// act[r, f] = bf16(silu(h[r, f]) * h[r, F + f]) for rows r < min(offsets[E], rows_bound); 4 columns
// per thread (F % 8 == 0, rows 16-byte aligned), a grid-stride loop over rows.
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
      const float gv[4] = {g.x, g.y, g.z, g.w}, uv[4] = {u.x, u.y, u.z, u.w};
      __nv_bfloat162 o[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float a0 = gv[2 * i] / (1.0f + expf(-gv[2 * i])) * uv[2 * i];
        const float a1 = gv[2 * i + 1] / (1.0f + expf(-gv[2 * i + 1])) * uv[2 * i + 1];
        o[i] = __floats2bfloat162_rn(a0, a1);
      }
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
  g.d = c.take<void*>(size_t(E));
  g.sa = c.take<typename G::StrideA>(size_t(E));
  g.sb = c.take<typename G::StrideB>(size_t(E));
  g.sd = c.take<typename G::StrideD>(size_t(E));
  return g;
}

template <class G>
typename G::Gemm::Arguments arguments(const GroupArrays<G>& g, int E, int device, int sm_count) {
  using TOut = typename G::CollectiveEpilogue::ElementD;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  typename G::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                   {E, g.shapes, nullptr},
                                   {g.a, g.sa, g.b, g.sb},
                                   {{}, nullptr, nullptr, reinterpret_cast<TOut**>(g.d), g.sd},
                                   hw};
  return args;
}

// can_implement -> initialize (CUTLASS's workspace at `ws`, ws_bytes) -> run on `stream`.
template <class G>
Status run_grouped(const typename G::Gemm::Arguments& args, void* ws, size_t ws_bytes, cudaStream_t stream, const char* name) {
  typename G::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    return Status::unsupported(std::string(name) + ": CUTLASS cannot implement this grouped problem (alignment or shape)");
  const size_t need = G::Gemm::get_workspace_size(args);
  if (need > ws_bytes)
    return Status::internal(std::string(name) + ": CUTLASS needs a workspace of " + std::to_string(need) + " bytes, more than the " +
                            std::to_string(ws_bytes) + " reserved (moe::kGroupedGemmCutlassBytes)");
  if (gemm.initialize(args, ws, stream) != cutlass::Status::kSuccess)
    return Status::cuda_error(std::string(name) + ": initialize failed: " + cudaGetErrorString(cudaGetLastError()));
  if (gemm.run(stream) != cutlass::Status::kSuccess)
    return Status::cuda_error(std::string(name) + ": launch failed: " + cudaGetErrorString(cudaGetLastError()));
  return Status::ok();
}

}  // namespace

Status launch_moe_expert_gemms(const moe::ExpertGemmProblem& p, int device_index, Stream stream) {
  const moe::ExpertMlpProblem& m = p.mlp;
  if (m.dtype != DType::kBF16) return Status::unsupported(std::string("x: moe_forward on CUDA takes bf16, got ") + dtype_name(m.dtype));
  const int E = m.num_experts;
  const int64_t D = m.hidden, F = m.intermediate;
  if (p.rows_bound == 0 || E == 0) return Status::ok();
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  auto s = static_cast<cudaStream_t>(stream);

  Carver c{static_cast<char*>(p.workspace), p.workspace_bytes};
  const GroupArrays<GateUpGemm> g1 = carve<GateUpGemm>(c, E);
  const GroupArrays<DownGemm> g2 = carve<DownGemm>(c, E);
  char* cutlass_ws1 = c.take<char>(moe::kGroupedGemmCutlassBytes);
  char* cutlass_ws2 = c.take<char>(moe::kGroupedGemmCutlassBytes);
  if (!c.fits())
    return Status::internal("moe grouped gemm: workspace of " + std::to_string(p.workspace_bytes) + " bytes, " + std::to_string(c.at) +
                            " needed (moe::grouped_gemm_workspace_bytes)");

  const GroupSpec s1{m.x_permuted, m.xp_stride, m.w13, m.w13_stride_e, m.w13_stride_n, p.gate_up, p.gate_up_stride, int(2 * F), int(D), 4};
  const GroupSpec s2{m.act, m.act_stride, m.w2, m.w2_stride_e, m.w2_stride_n, m.y, m.y_stride, int(D), int(F), 2};
  fill_groups_kernel<GateUpGemm, DownGemm><<<1, 1024, 0, s>>>(m.offsets, E, g1, s1, g2, s2);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status::cuda_error(std::string("moe grouped gemm: group fill launch: ") + cudaGetErrorString(e));

  ENCORE_RETURN_IF_ERROR(run_grouped<GateUpGemm>(arguments(g1, E, device_index, p.sm_count), cutlass_ws1, moe::kGroupedGemmCutlassBytes, s,
                                                 "moe gate/up grouped gemm"));
  const long long cap = 8LL * (p.sm_count > 0 ? p.sm_count : 132);
  const unsigned grid = unsigned(p.rows_bound < cap ? p.rows_bound : cap);
  swiglu_rows_kernel<<<grid, 256, 0, s>>>(p.gate_up, p.gate_up_stride, static_cast<__nv_bfloat16*>(m.act), m.act_stride, m.offsets, E, F,
                                          p.rows_bound);
  e = cudaGetLastError();
  if (e != cudaSuccess) return Status::cuda_error(std::string("moe swiglu launch: ") + cudaGetErrorString(e));
  return run_grouped<DownGemm>(arguments(g2, E, device_index, p.sm_count), cutlass_ws2, moe::kGroupedGemmCutlassBytes, s,
                               "moe down grouped gemm");
}

}  // namespace encore::cuda
