// The moe family's bottom: validated routing, dispatch, expert-MLP and combine problems (raw pointers,
// strides in elements), shared by the CPU reference and the CUDA kernels, and the dispatch plan.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/host_device.hpp"
#include "encore/core/dtype.hpp"

#if defined(__CUDACC_RTC__) && !defined(INFINITY)
#define INFINITY __int_as_float(0x7f800000)  // NVRTC (the JIT'd moe kernels, docs/jit.md) has no <cmath> macros
#endif

namespace encore::moe {

// A group's score in the grouped top-k: the sum of its two largest values with a correction bias
// (DeepSeek-V3), its largest without (DeepSeek-V2). Shared by the CPU reference and the routing
// kernel, so both compare the same values in the same order and pick the same groups.
ENCORE_HOST_DEVICE inline double group_score(const double* c, int size, bool top2) {
  double a = c[0], b = -INFINITY;
  for (int i = 1; i < size; ++i) {
    if (c[i] > a) {
      b = a;
      a = c[i];
    } else if (c[i] > b) {
      b = c[i];
    }
  }
  return top2 && size > 1 ? a + b : a;
}

constexpr size_t kBufferAlign = 256;  // bytes: alignment of workspaces and of each carved buffer

inline size_t round_up_bytes(size_t n, size_t a = kBufferAlign) { return (n + a - 1) / a * a; }

struct RoutingProblem {
  const void* logits = nullptr;
  DType logits_dtype = DType::kFP32;
  int64_t logits_stride = 0;
  const void* bias = nullptr;  // nullptr: no correction bias
  DType bias_dtype = DType::kFP32;
  int64_t bias_stride = 1;
  int32_t* topk_ids = nullptr;
  int64_t ids_stride = 0;
  float* topk_weights = nullptr;
  int64_t weights_stride = 0;
  int64_t tokens = 0;
  int num_experts = 0, top_k = 0;
  bool sigmoid = false, renormalize = true;
  int n_group = 1, topk_group = 1;
  float routed_scaling_factor = 1.0f;
};

struct DispatchProblem {
  const int32_t* topk_ids = nullptr;
  int64_t ids_stride = 0;
  int64_t tokens = 0;
  int top_k = 0, num_experts = 0, align_m = 1;
  int32_t* counts = nullptr;   // [E], stride 1 (validated contiguous)
  int32_t* offsets = nullptr;  // [E + 1]
  int32_t* slot_rows = nullptr;
  int64_t slot_stride = 0;
  int32_t* row_slots = nullptr;  // [rows]
  int64_t rows = 0;              // R
  const void* x = nullptr;       // nullptr: maps only
  int64_t x_stride = 0;
  void* x_permuted = nullptr;
  int64_t xp_stride = 0;  // elements of x_permuted (bytes when fp8)
  int64_t hidden = 0;
  DType dtype = DType::kBF16;  // x's
  float* x_scales = nullptr;   // [R, D / 128]: x_permuted is fp8 e4m3, quantized in the gather
  int64_t scales_stride = 0;
  bool fp8_power_of_two = false;
  float fp8_eps = 1e-10f;
  int32_t* cursors = nullptr;  // workspace: [E]
};

// Per-expert SwiGLU MLP over the permuted rows (moe_forward's middle): rows of expert e are
// [offsets[e], offsets[e] + counts[e]); the padding up to offsets[e + 1] is zeroed in act and y.
struct ExpertMlpProblem {
  const void* x_permuted = nullptr;
  int64_t xp_stride = 0;
  void* act = nullptr;  // [R, F]
  int64_t act_stride = 0;
  void* y = nullptr;  // [R, D]
  int64_t y_stride = 0;
  const void* w13 = nullptr;  // [E, 2F, D]
  int64_t w13_stride_e = 0, w13_stride_n = 0;
  const void* w2 = nullptr;  // [E, D, F]
  int64_t w2_stride_e = 0, w2_stride_n = 0;
  const int32_t* counts = nullptr;
  const int32_t* offsets = nullptr;
  int num_experts = 0;
  int64_t hidden = 0, intermediate = 0;
  DType dtype = DType::kBF16;
};

// moe_forward's expert compute on CUDA (cuda/grouped_gemm.cu): bf16 grouped GEMMs over the
// expert-contiguous rows, group e = rows [offsets[e], offsets[e + 1]) (the padding rows included:
// x_permuted's are zero, so act's and y's come out zero), and the SwiGLU between them. Two paths with
// the same numbers (h in fp32 from the fp32 accumulator, silu in fp32, act rounded once):
//   fused (fused_swiglu, the default):  gate_up[r, 0:F] = x_permuted[r] . w13[e][0:F]^T (fp32);
//     act[r] = bf16(silu(gate_up[r, 0:F]) * (x_permuted[r] . w13[e][F:2F]^T)) in the up GEMM's
//     epilogue (the gate read back as its C operand); columns [F, 2F) of gate_up are not written;
//   unfused: gate_up[r] = x_permuted[r] . w13[e]^T (fp32, [R, 2F]), then a row kernel for act;
// then y[r] = act[r] . w2[e]^T (x's dtype). Group sizes are read on the device (offsets).
struct ExpertGemmProblem {
  ExpertMlpProblem mlp;
  float* gate_up = nullptr;  // [R, 2F] fp32
  int64_t gate_up_stride = 0;
  void* workspace = nullptr;  // per-group shapes, pointers, strides and CUTLASS's workspace
  size_t workspace_bytes = 0;
  int64_t rows_bound = 0;  // rows that may be in use this call: moe_permuted_rows(T, k, E, align_m)
  int sm_count = 0;
  bool fused_swiglu = false;  // moe_fused_swiglu()
  bool wide_tile = false;     // moe_wide_tile(T): gate / gate-up and down on 128x256 tiles
};

// Which SwiGLU path a call takes (plan.cpp). ENCORE_MOE_FUSED_SWIGLU, read at every call: unset,
// empty, "auto" or "0" the unfused one (gate_up [R, 2F] fp32 and a row kernel); any other value the
// fused one (the SwiGLU in the up GEMM's epilogue). On the H200 (docs/moe.md) the unfused path on
// the 128x256 tiles beats both fused paths at every measured T on Qwen3-30B-A3B and the
// DeepSeek-V3-like shape (the fused one 0.5-58% slower), so the fused one is opt-in.
bool moe_fused_swiglu();

// The decode GEMV (cuda/decode_mlp.cu) instead of the grouped GEMMs: ENCORE_MOE_DECODE, read at every
// call: "0" never; unset or empty at T <= kDecodeDefaultRows (H200: 0.68-0.90x of the unfused GEMMs'
// time at T 1-4 on Qwen3-30B-A3B and the DeepSeek-V3-like shape, 1.06x at T 8, 1.20x at 16); any
// other value wherever it applies: T <= kDecodeMaxRows (each expert then holds at most T rows: the
// routing picks k distinct experts per token). Always also T * max(D, F) bf16 of staged rows within
// kDecodeMaxSmem.
constexpr int kDecodeDefaultRows = 4;
constexpr int kDecodeMaxRows = 16;
constexpr int64_t kDecodeMaxSmem = 96 * 1024;
bool moe_decode_gemv(int64_t tokens, int64_t hidden, int64_t intermediate);
// The cooperative grouped GEMMs' tile: ENCORE_MOE_GEMM_TILE, read at every call: "128x256" the
// 128 x 256 x 64 tile (two consumer warpgroups of 64 x 256) for the gate / up and down GEMMs,
// "128x128" the 128 x 128 x 64 tile; unset or anything else the rule: 128x256 from
// kWideTileMinTokens tokens (H200, ae785e1: 0.80-0.87x of the 128x128 time at T 1-16384 on the
// DeepSeek-V3-like shape, 0.86-0.95x at T 2-16384 on Qwen3-30B-A3B, 1.08x at its T 1; at T <= 4 the
// decode GEMV runs by default). The fused up + SwiGLU GEMM keeps its 128 x 128 ping-pong tile.
constexpr int64_t kWideTileMinTokens = 2;
bool moe_wide_tile(int64_t tokens);

// One grouped GEMM D_e = A_e . B_e^T (+ C_e) over the expert blocks, as element offsets from each
// operand's base: A_e and C_e, D_e start at row offsets[e] (row strides lda, ldc, ldd), B_e at
// e * b_stride_e + b_row0 * ldb (b_row0: the first weight row, F for the up half of w13).
struct GroupedGemmSpec {
  int64_t lda = 0, b_stride_e = 0, b_row0 = 0, ldb = 0, ldc = 0, ldd = 0;
  int n = 0, k = 0;
};
struct GroupedOperands {
  int32_t m;  // offsets[e + 1] - offsets[e] (0: an empty expert, no tile)
  int64_t a, b, c, d;
};
ENCORE_HOST_DEVICE inline GroupedOperands grouped_operands(const GroupedGemmSpec& s, const int32_t* offsets, int e) {
  const int64_t r0 = offsets[e];
  return {offsets[e + 1] - offsets[e], r0 * s.lda, int64_t(e) * s.b_stride_e + s.b_row0 * s.ldb, r0 * s.ldc, r0 * s.ldd};
}
// The specs of the fused path: gate (N = F, D = gate_up's first F columns), up (N = F, C = the
// gate, D = act), down (N = D, K = F). The unfused gate/up GEMM is `gate` with n = 2F.
struct ExpertGemmSpecs {
  GroupedGemmSpec gate, up, down;
};
inline ExpertGemmSpecs expert_gemm_specs(const ExpertGemmProblem& p) {
  const ExpertMlpProblem& m = p.mlp;
  const int F = int(m.intermediate), D = int(m.hidden);
  ExpertGemmSpecs s;
  s.gate = {m.xp_stride, m.w13_stride_e, 0, m.w13_stride_n, 0, p.gate_up_stride, F, D};
  s.up = {m.xp_stride, m.w13_stride_e, F, m.w13_stride_n, p.gate_up_stride, m.act_stride, F, D};
  s.down = {m.act_stride, m.w2_stride_e, 0, m.w2_stride_n, 0, m.y_stride, D, F};
  return s;
}

// Bytes of the grouped GEMMs' workspace for E experts: per group and GEMM (three on the fused path)
// a problem shape, four pointers and four strides (rounded generously), plus kGroupedGemmCutlassBytes
// per GEMM for CUTLASS's own workspace (its TMA descriptors per SM; checked against the real size at run).
constexpr size_t kGroupedGemmPerExpertBytes = 256;
constexpr size_t kGroupedGemmCutlassBytes = size_t(1) << 20;
constexpr int kGroupedGemmCount = 3;
inline size_t grouped_gemm_workspace_bytes(int num_experts) {
  return round_up_bytes(size_t(num_experts) * kGroupedGemmPerExpertBytes * kGroupedGemmCount + 32 * kBufferAlign) +
         kGroupedGemmCount * kGroupedGemmCutlassBytes;
}

struct CombineProblem {
  const void* expert_out = nullptr;
  int64_t eo_stride = 0;
  DType eo_dtype = DType::kBF16;
  const int32_t* slot_rows = nullptr;
  int64_t slot_stride = 0;
  const float* weights = nullptr;
  int64_t weights_stride = 0;
  void* out = nullptr;
  int64_t out_stride = 0;
  DType out_dtype = DType::kBF16;
  int64_t tokens = 0, hidden = 0;
  int top_k = 0;
};

// How the CUDA dispatch runs (plan.cpp, cuda/dispatch.cu): decode (few (token, k) pairs): one block
// counts, scans and ranks; prefill: per-chunk histograms, a scan over chunks and experts, a stable
// per-chunk scatter (one warp per chunk). Then, in both, the gather on a grid of up to plan.grid
// blocks (a warp per 2 KB of a row). Both give the reference's layout.
enum class DispatchPath : uint8_t { kSingleBlock, kCountThenScatter };
// The kernels that write the maps (cuda/dispatch_kernel.cuh): decode runs the first, prefill the other
// three, in this order; the gather follows either.
enum class DispatchMapKernel : uint8_t { kSingleBlock, kHistogram, kScan, kScatter };

// CUDA limits of the moe ops (validate returns unsupported beyond them).
constexpr int kCudaRoutingMaxExperts = 512;    // routing: one warp per token, E / 32 scores per lane
// The routing kernel's scores per lane: ceil(E / 32) rounded up to a power of two (1 .. 16).
inline int routing_per_lane(int num_experts) {
  int per_lane = 1;
  while (per_lane * 32 < num_experts) per_lane *= 2;
  return per_lane;
}
constexpr int kCudaDispatchMaxExperts = 1024;  // dispatch: E counters in shared memory
constexpr int64_t kDispatchChunkPairs = 512;   // prefill: (token, k) pairs per histogram / scatter chunk
constexpr int kDispatchGatherBlocksPerSm = 5;  // gather: 256-thread blocks per SM (its launch bounds: <= 48 registers)

struct DispatchPlan {
  DispatchPath path = DispatchPath::kSingleBlock;
  int threads = 256;
  long long grid = 1;          // at most this many blocks in the gather pass (both paths)
  long long chunks = 1;        // prefill: histogram / scatter chunks of kDispatchChunkPairs pairs
  // max(the CPU reference's E int32 cursors, the prefill histograms [E, chunks] int32), rounded up
  // to kBufferAlign; independent of the path and of sm_count, so either path can run in it.
  size_t workspace_bytes = 0;
};

DispatchPlan plan_moe_dispatch(int64_t tokens, int top_k, int num_experts, int sm_count);
// The same plan with the path forced (tests: both CUDA paths on one problem).
DispatchPlan plan_moe_dispatch(int64_t tokens, int top_k, int num_experts, int sm_count, DispatchPath path);

}  // namespace encore::moe

// ---- The CUDA expert-parallel all-to-all's kernel argument and error record (ep_device.cpp fills
// them, cuda/ep_kernels.cu reads them). The memory layout, the cells and the protocol are the CPU
// emulation's (reference/ep_emulation.hpp), with one difference: a receiver waits on each (sender,
// local expert) count cell instead of a per-sender dispatch flag (each count is released after that
// expert's rows), so the dispatch flag cell stays unused. ----
namespace encore::moe::ep {

constexpr int kEpMaxWorld = 8;

// The group's failures: each rank's first one in its detail slot (claimed by CAS, written, fenced),
// then the group's first by a CAS on `abort` ({epoch << 32 | rank + 1}; 0 while healthy); every spin
// loop of every rank gives up once it is set. Read by the host after the streams are synchronized
// (EpDeviceAllToAll::status): detail[abort's rank] is complete by then.
struct EpErrorDetail {
  unsigned int claimed;
  uint32_t phase, what;  // EpPhase, EpWhat
  int32_t peer, index;   // the other rank (or -1); the token, entry or expert concerned
  unsigned long long expected, seen;
};
constexpr size_t kEpErrorRecordBytes = 1024;  // reserved before rank memory (>= sizeof(EpErrorRecord))
struct EpErrorRecord {
  unsigned long long abort;
  EpErrorDetail detail[kEpMaxWorld];
};
static_assert(sizeof(EpErrorRecord) <= kEpErrorRecordBytes, "the reserved error record");
enum EpPhase : uint32_t { kEpPhaseDispatch = 1, kEpPhaseReceive = 2, kEpPhaseCombine = 3, kEpPhaseSync = 4 };
enum EpWhat : uint32_t {
  kEpBadExpert = 1,        // topk_ids entry outside [0, E): index = t * k + j, seen = the id
  kEpDuplicateExpert = 2,  // a token lists an expert twice: index = t * k + j, seen = the id
  kEpTimeoutCount = 3,     // a sender's count cell: peer = sender, index = the global expert
  kEpBadCount = 4,         // a count above max_tokens
  kEpBadSlot = 5,          // a received row's source slot outside [0, max_tokens * k)
  kEpTimeoutToken = 6,     // a token's combine counter: index = t, expected {n | k}
  kEpTimeoutFlag = 7,      // a peer's combine flag: peer = that rank
  kEpBadTokenCount = 8,    // the device token count outside [0, m]: seen = it, expected = m (x's rows)
};

struct EpDeviceParams {
  uint8_t* mem[kEpMaxWorld] = {};  // every rank's memory as this rank addresses it (mapped peers)
  EpErrorRecord* err = nullptr;
  int world = 1, rank = 0, e_local = 0, top_k = 0, num_experts = 0;
  uint32_t* epoch_dev = nullptr;  // [round, live tokens] of this rank on the device: ep_round_kernel increments the
                                  // round first in every dispatch (a CUDA graph's replays are rounds of their own)
                                  // and copies the clamped m_dev
  unsigned long long timeout_ns = 0;
  int64_t max_tokens = 0, m = 0;  // m: x's rows (the token count, or its bound when m_dev is given)
  const int32_t* m_dev = nullptr;  // the live token count on the device (CUDA graphs: one capture, any count <= m)
  int64_t row_bytes = 0, scale_bytes = 0, token_stride = 0, region_bytes = 0, region_header = 0, combine_header = 0,
          combine_row_bytes = 0;
  int64_t y_row_bytes = 0;     // an expert output row: H * bytes of `dtype`
  DType dtype = DType::kBF16;  // the expert outputs' (the combine's); the dispatched rows are row_bytes of bytes
  // dispatch inputs (device): x [m, H], topk_ids [m, k], scales [m, scale_bytes] (scale_bytes > 0)
  const uint8_t* x = nullptr;
  const int32_t* ids = nullptr;
  const uint8_t* scales = nullptr;
  // what this rank received (its device buffers): counts_from [W, E_l]; table [E_l * W + 1], the rows'
  // exclusive prefix in (local expert, sender) order; counts [E_l]; offsets [E_l + 1]; per row the
  // origin rank and slot t * k + j; rows [max_rows, row_bytes]; scales [max_rows, scale_bytes]
  int32_t *counts_from = nullptr, *table = nullptr, *counts = nullptr, *offsets = nullptr, *src_rank = nullptr, *src_slot = nullptr;
  uint8_t *rx = nullptr, *rscales = nullptr;
  int64_t max_rows = 0;
  // combine inputs: expert_out [rows, H] (dtype) in the received order; topk_weights [m, k] fp32;
  // out [m, H] of out_dtype
  const uint8_t* y = nullptr;
  const float* weights = nullptr;
  void* out = nullptr;
  DType out_dtype = DType::kBF16;
  int grid = 1;  // blocks of the row loops (the spin kernels stay small: on one GPU every rank's kernels share it)
};

// One peer-memory allocation as this process maps it (cuda/ep_vmm.cu): its address, bytes (rounded to
// the allocation granularity), the driver's allocation handle, and the exported file descriptor (-1 for
// an imported one).
struct EpPeerMemory {
  void* ptr = nullptr;
  size_t bytes = 0;
  unsigned long long handle = 0;
  int fd = -1;
};

}  // namespace encore::moe::ep
