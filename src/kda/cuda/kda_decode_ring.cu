// KDA decode, the persistent single-token kernel: the recurrent step of include/encore/kda_serving.hpp
// (fla-core 0.6.0's fused_recurrent_kda_fwd) for launches whose sequences have at most one token (the
// decode step), software-pipelined over a shared-memory ring of state slices. The math is kda_decode.cu's:
// per sequence, value head h and its token (q̂, k̂ L2-normed when asked, g the activated gate, β optionally
// σ(β) or 2σ(β)):
//   S̄ = diag(exp g) S;  e = v − S̄ᵀk̂;  u = β e;  S = S̄ + k̂ uᵀ;  o = scale · Sᵀq̂
// computed as o = scale · (S̄ᵀq̂ + (k̂ᵀq̂) u), the sums S̄ᵀk = Sᵀ(d ∘ k), S̄ᵀq = Sᵀ(d ∘ q) (d = exp g) in one
// pass over the state with the raw q, k; the L2-norm factors (Σq², Σk², Σqk of the same pass) scale the
// sums afterwards: one block-wide reduction (one barrier) per unit.
//
// Shapes and constraints (kda_decode.cu's launch_fast picks this kernel): K = V = 128; q, k, v, g, β bf16
// with aligned 16-byte vectors, o any dtype (unit last stride); states St = __nv_bfloat16 or float, one dtype,
// contiguous [H, 128, 128] rows whose 8-column accesses are 16-byte aligned; fp32 A_log, dt_bias; every
// sequence <= 1 token (p.max_len <= 1); fixed length (T <= 1) or varlen (the token table of kda_decode.cu);
// the modes kStates (row n of init if present -> row n of fin if present), kSlots (idx[n] read and written)
// and kTokenSlots (read idx[n, num_accepted_tokens[n] - 1], write idx[n, 0]), with kda_decode.cu's index
// contract: bad indices -> NaN o rows and nothing written, a start index < 0 -> zero o rows, pool untouched.
//
// Work: a unit is (sequence i, value head h, 64-column tile), numbered as kda_decode.cu's blockIdx
// ((i · H + h) · 2 + tile); the thread mapping is its 8-column single-token kernel's (128 threads; warp w,
// lane l: columns 8 (l % 8) .. + 7 of the tile, rows 8 (4 w + l / 8) .. + 7). grid = min(units, SMs x
// resident blocks an SM); block b takes units b, b + grid, b + 2 grid, ... Per block a ring of kStages
// stages (bf16: 3 x 16 KB, 4 blocks an SM; fp32: 2 x 32 KB, 3 blocks an SM), each one unit's state slice.
// Each thread copies its own 8 rows x 8 columns into a stage by cp.async.cg (16-byte copies, L2 evict-first;
// its word (r, i) at [(r · words + i) · 128 + thread] x 16 bytes: a warp's 16-byte accesses conflict-free),
// so cp.async.wait_group alone orders its reads (no block barrier for the ring; the unit's sums keep their
// one barrier, double-buffered by the parity of the sums taken). Iteration j of a block (unit j of its list):
//   1. settle unit j + S - 1's slots (indices loaded in iteration j - 1) and issue its stage: one commit
//      group per iteration, empty where the unit reads nothing (padding, bad indices, past the end);
//      kStates without init: zero-filled by cp.async (source size 0), so every unit computes from a stage;
//   2. load unit j + S's indices (its num_accepted_tokens loaded in iteration j - 1) and unit j + S + 1's
//      num_accepted_tokens: the two dependent index loads an iteration apart, neither waited on here;
//   3. load unit j + 1's q, k, g, v, β, A_log, dt_bias into registers (double buffer, raw bf16 words);
//   4. wait for unit j's group (wait_group S - 1) and compute it: pass 1 over the stage (decay, the two
//      sums, Σq², Σk², Σqk), the block sums, u and o, pass 2 over the stage (the update, packed by one
//      cvt.rn.bf16x2 a pair), the state stored from registers to the pool (st.global.cs), o as kda_decode.cu.
// While a block computes unit j, units j + 1 .. j + S - 1 are in flight (bf16: 32 KB a block, 128 KB an SM;
// fp32: 32 KB a block, 96 KB an SM) and unit j - 1's stores drain: the compute is overlapped with memory,
// where the one-shot kernel (load, compute, store, exit) has no load in flight while it computes.
//
// Expected time (not measured: written without a GPU): bytes a step (each touched state read and written
// once, bf16: 64 KB a (sequence, head); plus q, k, v, g, β, o, the indices) / ~3.0 TB/s, e.g. batch 64,
// H = 32, bf16 pool: 134 MB, ~45 us. Target: <= 1.1x the floor of `encore bench kda_decode` from batch 64
// with a bf16 pool (the one-shot kernel: 1.25-1.35x; fp32 pools: 1.08x, where this kernel must not lose:
// else kRingF32 = false). To measure first on a GPU: the tests KdaServingGpu.* and
// tests/python/test_kda_serving_cuda.py (the index contract, padding, varlen, kStates in place: batches of
// >= 2 units a resident block take this kernel, e.g. N >= 32 at H = 32), then the suite kda_decode, both pool
// dtypes, against the one-shot kernels in the same run (kRing = false in kda_decode.cu).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "common/cuda/launch_check.hpp"
#include "common/cuda/pdl.cuh"
#include "kda/cuda/kda_decode.hpp"
#include "kda/cuda/kda_decode_parts.cuh"

namespace encore::cuda::decode {
namespace {

constexpr int kDim = 128;                       // K = V
constexpr int kRowsT = 8, kColsT = 8;           // state rows and value columns a thread
constexpr int kTileCols = kColsT * kColLanes;   // 64 value columns a unit
constexpr int kTiles = kDim / kTileCols;        // 2 units a (sequence, head)
static_assert(kRowsT * kWarps * kRowLanes == kDim, "the 128 rows over 4 warps x 4 row groups x 8");

template <class St>
struct Ring {
  static constexpr bool kF32 = std::is_same_v<St, float>;
  static constexpr int kStages = kF32 ? 2 : 3;
  static constexpr int kWords = kColsT * int(sizeof(St)) / 16;           // 16-byte words of a thread's row: bf16 1, fp32 2
  static constexpr int kStageBytes = kThreads * kRowsT * kWords * 16;   // bf16 16 KB, fp32 32 KB
  static constexpr int kSmem = kStages * kStageBytes;                    // dynamic; + 4.2 KB static (the sums)
  static constexpr int kMinBlocks = kF32 ? 3 : 4;                        // resident blocks an SM the smem allows
};

__device__ __forceinline__ unsigned smem_u32(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// 16 bytes global -> shared, bypassing L1; `bytes` of them read (0: a zero fill that reads nothing).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, unsigned bytes, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(__cvta_generic_to_global(src)),
               "r"(bytes), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// x / H by a multiply and a shift (x < 2^31; H = 1: mul 0), set on the host (Granlund-Montgomery, as
// CUTLASS's FastDivmod): q = umulhi(x, mul) >> shr, mul = ceil(2^(31 + l) / H), shr = l - 1, l = ceil(log2 H).
struct DivH {
  unsigned mul, shr;
};
DivH div_by(int H) {
  if (H <= 1) return {0u, 0u};
  int l = 0;
  while ((1ll << l) < H) ++l;
  return {unsigned(((1ull << (31 + l)) + unsigned(H) - 1) / unsigned(H)), unsigned(l - 1)};
}

// One unit's place: sequence i (global n), value head h, tile; its batch row b and tokens [begin, begin + len).
struct Unit {
  int i, n, h, tile, b, begin, len;
};
template <int kSeqs>
__device__ __forceinline__ Unit unit_at(const KdaDecodeParams& p, const SeqTable<kSeqs>& table, DivH div, unsigned u) {
  Unit x;
  x.tile = int(u % unsigned(kTiles));
  const unsigned hu = u / unsigned(kTiles), i = div.mul ? __umulhi(hu, div.mul) >> div.shr : hu;
  x.i = int(i), x.h = int(hu - i * unsigned(p.H)), x.n = p.n0 + x.i;
  x.b = p.varlen ? 0 : x.n;
  x.begin = p.varlen ? table.begin[x.i] : 0;
  x.len = (p.varlen ? table.begin[x.i + 1] : p.T) - x.begin;
  return x;
}

// What a unit does, settled before its stage is issued: kRun reads row `read` into its stage (< 0: zeros),
// computes and writes row `write` (< 0: none); kZero / kNaN only write its o rows (padding / bad indices);
// kNone nothing (no tokens in a pool mode, or past the last unit).
enum : int { kNone = 0, kRun = 1, kZero = 2, kNaN = 3 };
struct Plan {
  int64_t read, write;
  int kind;
};

// A unit's token inputs for this thread, raw (converted at use), and its head's gate parameters.
struct UnitIn {
  TokenLoad<kRowsT, __nv_bfloat16, kColsT> tok;
  float a_log, bias[kRowsT];
};

// The kernel (header comment at the top of this file). St: the states' dtype; kSeqs: the varlen token table's size.
template <class St, int kSeqs>
__global__ void __launch_bounds__(kThreads, Ring<St>::kMinBlocks)
    kda_decode_ring_kernel(const __grid_constant__ KdaDecodeParams p, const __grid_constant__ SeqTable<kSeqs> table, const DivH div) {
  using Rg = Ring<St>;
  using Row = PackedRow<St, kColsT>;
  using Word = typename Row::Vec;
  static_assert(sizeof(Word) == 16 && Row::kVecs == Rg::kWords, "a row: 16-byte words");
  constexpr int S = Rg::kStages;
  extern __shared__ __align__(16) unsigned char ring[];
  __shared__ __align__(16) float red[2][kWarps][kColLanes][2 * kColsT];  // the sums' partials, double-buffered
  __shared__ float scal[2][kWarps][4];
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, cl = lane & 7, rl = lane >> 3;
  const int row0 = (warp * kRowLanes + rl) * kRowsT;
  const unsigned units = unsigned(p.N) * unsigned(p.H) * unsigned(kTiles), grid = gridDim.x;
  const uint64_t policy = evict_first_policy();
  const bool pooled = p.mode != KdaDecodeMode::kStates;
  wait_for_primary();   // PDL (p.pdl): the previous kernel's writes first
  launch_dependents();  // one wave: the next PDL launch may come in (its blocks wait for this grid's end)

  auto col0 = [&](const Unit& g) { return g.tile * kTileCols + cl * kColsT; };
  // This thread's first state element in a row of the pool / states.
  auto state_off = [&](const Unit& g) { return int64_t(g.h) * kDim * kDim + int64_t(row0) * kDim + col0(g); };
  // The index loads of unit u (pool modes; nothing past the end): num_accepted_tokens, then the indices.
  auto accepted_of = [&](unsigned u) -> int64_t { return pooled && u < units ? load_accepted(p, unit_at(p, table, div, u).n) : 1; };
  auto slots_of = [&](unsigned u, int64_t accepted) -> SlotIndices {
    return pooled && u < units ? load_slots(p, unit_at(p, table, div, u).n, accepted) : SlotIndices{-1, -1};
  };
  auto plan_of = [&](unsigned u, int64_t accepted, const SlotIndices& ix) -> Plan {
    Plan x{-1, -1, kNone};
    if (u >= units) return x;
    const Unit g = unit_at(p, table, div, u);
    if (!pooled) return Plan{p.init ? int64_t(g.n) : -1, one_token_write(p, g.n, g.len, -1, [] { return int64_t(-1); }), kRun};
    if (g.len <= 0) return x;  // no tokens: the pool is not touched
    const SlotPlan s = settle_slots(p, g.n, g.len, accepted, ix);
    return Plan{s.read, one_token_write(p, g.n, g.len, s.read, [&] { return ix.first; }), s.bad ? kNaN : s.read < 0 ? kZero : kRun};
  };
  // Unit u's stage: this thread's rows by cp.async (zero-filled without a row to read); one commit group always.
  auto issue = [&](const Plan& x, unsigned u, int stage) {
    if (x.kind == kRun) {
      const unsigned dst = smem_u32(ring) + unsigned(stage * Rg::kStageBytes + tid * 16);
      const bool from = x.read >= 0;
      const St* src = from ? static_cast<const St*>(p.init) + x.read * p.init_stride + state_off(unit_at(p, table, div, u)) : nullptr;
#pragma unroll
      for (int r = 0; r < kRowsT; ++r) {
#pragma unroll
        for (int w = 0; w < Rg::kWords; ++w)
          cp_async16(dst + unsigned((r * Rg::kWords + w) * kThreads * 16), from ? src + r * kDim + w * (16 / int(sizeof(St))) : p.q.data,
                     from ? 16u : 0u, policy);
      }
    }
    cp_async_commit();
  };
  auto load_in = [&](UnitIn& in, unsigned u) {
    const Unit g = unit_at(p, table, div, u);
    in.tok.load(p, g.b, g.begin, g.h, g.h / p.group, row0, col0(g));
    const bool gate = p.gate_in_kernel;
    in.a_log = gate && p.A_log ? __ldg(p.A_log + g.h) : 0.f;
#pragma unroll
    for (int r = 0; r < kRowsT; ++r) in.bias[r] = 0.f;
    if (gate && p.dt_bias) load_vec<kRowsT>(p.dt_bias, DType::kFP32, int64_t(g.h) * kDim + row0, row0, kDim, in.bias);
  };
  auto runs = [&](const Plan& x, unsigned u) { return x.kind == kRun && u < units && unit_at(p, table, div, u).len == 1; };

  // Prologue: units 0 .. S - 2 settled and issued, unit S - 1's indices and unit S's num_accepted_tokens loaded.
  const unsigned u0 = blockIdx.x;
  Plan plan[S];
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    const unsigned u = u0 + unsigned(s) * grid;
    const int64_t a = accepted_of(u);
    plan[s] = plan_of(u, a, slots_of(u, a));
    issue(plan[s], u, s);
  }
  int64_t acc_next = accepted_of(u0 + unsigned(S - 1) * grid);              // unit j + S - 1's
  SlotIndices ix_next = slots_of(u0 + unsigned(S - 1) * grid, acc_next);
  int64_t acc_after = accepted_of(u0 + unsigned(S) * grid);                // unit j + S's
  UnitIn cur, nxt;
  if (runs(plan[0], u0)) load_in(cur, u0);

  int phase = 0;            // sums taken: their buffer parity
  int issue_stage = S - 1;  // (j + S - 1) % S
  int stage = 0;            // j % S
#pragma unroll 1
  for (unsigned u = u0; u < units; u += grid) {
    // 1. unit j + S - 1: settle and issue.
    const unsigned u_issue = u + unsigned(S - 1) * grid;
    plan[S - 1] = plan_of(u_issue, acc_next, ix_next);
    issue(plan[S - 1], u_issue, issue_stage);
    issue_stage = issue_stage == S - 1 ? 0 : issue_stage + 1;
    // 2. the indices of unit j + S, num_accepted_tokens of unit j + S + 1 (used an iteration later).
    ix_next = slots_of(u_issue + grid, acc_after);
    acc_next = acc_after;
    acc_after = accepted_of(u_issue + 2 * grid);
    // 3. unit j + 1's inputs.
    if (runs(plan[1], u + grid)) load_in(nxt, u + grid);

    // 4. unit j.
    cp_async_wait<S - 1>();
    const Plan& x = plan[0];
    if (x.kind != kNone) {
      const Unit g = unit_at(p, table, div, u);
      if (x.kind != kRun) {
        fill_o(p, g.b, g.begin, g.len, g.h, g.tile * kTileCols, kTileCols, kDim, x.kind == kNaN);
      } else {
        const Word* words = reinterpret_cast<const Word*>(ring + stage * Rg::kStageBytes) + tid;  // word (r, w) at [(r kWords + w) 128]
        auto row_at = [&](int r) {
          Row row;
#pragma unroll
          for (int w = 0; w < Rg::kWords; ++w) row.w[w] = words[(r * Rg::kWords + w) * kThreads];
          return row;
        };
        St* dst = x.write >= 0 ? static_cast<St*>(p.fin) + x.write * p.fin_stride + state_off(g) : nullptr;
        if (g.len == 1) {
          const Token<kRowsT, kColsT>& t = cur.tok.get();
          const float ea = gate_ea(p, cur.a_log);
          float d[kRowsT], pk[kColsT] = {}, pq[kColsT] = {}, qq = 0.f, kk = 0.f, qk = 0.f;
#pragma unroll
          for (int r = 0; r < kRowsT; ++r) {  // pass 1: S̄ᵀk = Sᵀ(d ∘ k), S̄ᵀq = Sᵀ(d ∘ q)
            d[r] = decay(p, p.gate_in_kernel, t.g[r], cur.bias[r], ea, true);
            qq = fmaf(t.q[r], t.q[r], qq);
            kk = fmaf(t.k[r], t.k[r], kk);
            qk = fmaf(t.q[r], t.k[r], qk);
            float sr[kColsT];
            row_at(r).unpack(sr);
            const float dk = d[r] * t.k[r], dq = d[r] * t.q[r];
#pragma unroll
            for (int c = 0; c < kColsT; ++c) {
              pk[c] = fmaf(sr[c], dk, pk[c]);
              pq[c] = fmaf(sr[c], dq, pq[c]);
            }
          }
          TokenSums<kColsT> sum;
          block_sums<kColsT>(pk, pq, qq, kk, qk, phase & 1, red, scal, sum);
          ++phase;
          float uu[kColsT], out[kColsT];
          const float rk = token_out(p, t, sum, uu, out);
#pragma unroll
          for (int r = 0; r < kRowsT; ++r) {  // pass 2: S = S̄ + k̂ uᵀ, stored from registers
            Row row = row_at(r);
            float sr[kColsT];
            row.unpack(sr);
            const float kr = rk * t.k[r];
#pragma unroll
            for (int c = 0; c < kColsT; ++c) sr[c] = fmaf(kr, uu[c], sr[c] * d[r]);
            row.pack(sr);
            if (dst) row.store(dst + r * kDim);
          }
          if (warp == 0 && rl == 0) {
            const int c0 = col0(g);
            store_o<kColsT>(p.o, p.o_dtype, int64_t(g.b) * p.o_sb + int64_t(g.begin) * p.o_st + int64_t(g.h) * p.o_sh + c0, c0, kDim, out);
          }
        } else if (dst) {  // no token (kStates): the state as read
#pragma unroll
          for (int r = 0; r < kRowsT; ++r) row_at(r).store(dst + r * kDim);
        }
      }
    }
    stage = stage == S - 1 ? 0 : stage + 1;
#pragma unroll
    for (int s = 0; s < S - 1; ++s) plan[s] = plan[s + 1];
    cur = nxt;
  }
  cp_async_wait<0>();  // only empty groups are left; none outlives the block
}

template <class St, int kSeqs>
Status launch_typed(const KdaDecodeParams& p, const SeqTable<kSeqs>& table, cudaStream_t s) {
  constexpr const char* what = "kda decode (kda_decode_ring_kernel)";
  auto* kernel = kda_decode_ring_kernel<St, kSeqs>;
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kernel, Ring<St>::kSmem, /*max_carveout=*/true));
  static const int per_sm = [&] {  // a property of the kernel on Hopper: asked once
    int n = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, Ring<St>::kSmem) == cudaSuccess ? n : 0;
  }();
  if (per_sm < 1) return Status::internal(std::string(what) + ": no block of it fits an SM");
  const int64_t units = int64_t(p.N) * p.H * kTiles, resident = int64_t(p.sm_count > 0 ? p.sm_count : 1) * per_sm;
  const unsigned grid = unsigned(units < resident ? units : resident);
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = pdl_config(dim3(grid), dim3(kThreads), Ring<St>::kSmem, s, p.pdl, attr);
  return launch_api(what, [&] { return cudaLaunchKernelEx(&cfg, kernel, p, table, div_by(p.H)); });
}

template <class St>
Status launch_st(const KdaDecodeParams& p, const int32_t* begin, cudaStream_t s) {
  auto go = [&](auto table) {
    if (begin)
      for (int i = 0; i <= p.N; ++i) table.begin[i] = begin[i];
    return launch_typed<St>(p, table, s);
  };
  if (!begin) return go(SeqTable<0>{});
  if (p.N <= kKdaDecodeSeqTableSmall) return go(SeqTable<kKdaDecodeSeqTableSmall>{});
  return go(SeqTable<kKdaDecodeSeqTable>{});
}

}  // namespace

Status launch_ring(const KdaDecodeParams& p, const int32_t* begin, cudaStream_t s) {
  const DType st = p.init ? p.init_dtype : p.fin_dtype;
  return st == DType::kBF16 ? launch_st<__nv_bfloat16>(p, begin, s) : launch_st<float>(p, begin, s);
}

}  // namespace encore::cuda::decode
