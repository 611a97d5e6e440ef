// KDA intra-chunk kernel (docs/kda.md, "Design"): persistent, one block of 512 threads per SM, each
// block takes (chunk slot, head) items in turn (item = h · slots + slot, stepping by the grid), one
// chunk of <= 64 tokens of one head per item; writes the state kernel's operands (kda_device.cuh's
// workspace record) and the backward's residuals (G, Aqk, Akk). The next item's raw input tiles are
// in flight (TMA) from steps 4 (q) and 5 (gate, k, v) on, each into a tile its step frees;
// W and U leave through shared memory by two bulk stores (TMA). Its profile: docs/kda.md.
//
//   gate activation (precomputed log-decay, in-kernel softplus with optional dt_bias, or the lower
//   bound gate), optional q/k L2 norm, chunk-local cumulative gate G in log2 (fp32);
//   Aqk_ij = s Σ_c q_ic k_jc 2^(G_ic − G_jc) (j <= i),  L_ij = β_i Σ_c k_ic k_jc 2^(G_ic − G_jc) (j < i),
//     on tensor cores with the 16-row sub-block reference r = 16 (i / 16):
//     (q_i ⊙ 2^(G_i − G_r)) · (k_j ⊙ 2^(G_r − G_j)); below the diagonal blocks both factors are <= 1
//     (j < r <= i); inside a diagonal block 2^(G_r − G_j) >= 1 for j > r, so a block whose decay span
//     max (G_r − G_j) exceeds 100 (log2) takes two references (r for rows r..r+7, r + 8 below) when
//     each half's span allows, else the halving references of diag_block_by_halving (exact for any
//     gate: gates of -1000, and a share of the blocks under strong decays such as A_log, dt_bias ~
//     N(0, 1): docs/kda.md);
//   A = (I + L)^-1: diagonal blocks by forward substitution (fp32, one warp each, in registers), then
//     the blocks below by doubling: A_{b,b−1} = −A_bb L_{b,b−1} A_{b−1,b−1} for the 16-row blocks (1,0),
//     (3,2), then the 32-row block A_{32..63,0..31} = −A_{32..63,32..63} L_{32..63,0..31} A_{0..31,0..31}
//     (tensor cores, fp32 operands split in bf16 hi + lo: ~16 significant bits; A enters W and U in bf16);
//   W = A (β k ⊙ 2^G) and U = A (β v) on tensor cores (bf16 operands, fp32 accumulation) as
//   A x_hi + I x_lo with x = x_hi + x_lo in bf16 (A's unit diagonal is exact in bf16), so the
//   dominant diagonal term keeps ~16 bits of x instead of bf16's 8
//   (scripts/kda_rounding_model.py: o 3.95e-3 -> 3.64e-3, final state 2.69e-3 -> 2.12e-3);
//   Qg = s q ⊙ 2^G, Kg = k ⊙ 2^(gC − G), dC = 2^gC with gC = G of the last row (padding rows
//   have g = 0, k = 0, β = 0, so they change nothing).
//
// Constraints (dispatch): K, V <= 128 (padded to 128 with zeros), bf16 or fp32 inputs.
#include <type_traits>

#include "common/cuda/grid_barrier.cuh"  // load_acquire_gpu, store_release_gpu
#include "core/softplus_log2.hpp"
#include "kda/cuda/kda_chunk_parts.cuh"
#include "kda/cuda/kda_device.cuh"
#include "kda/cuda/kda_state_pass.cuh"
#include "kda/cuda/launch.hpp"

namespace encore::cuda::kda {
namespace {

// Phase profile (launch.hpp, kda_chunk_profile_*): counters and the switch, in this translation unit only.
__device__ unsigned long long g_phase_cycles[kKdaChunkPhases];
__device__ unsigned long long g_phase_blocks;
__device__ int g_phase_on;
// The raw-input test hook (launch.hpp, kda_chunk_raw_inputs): the TMA mask of the last launch,
// and whether a block since found its shared memory not 1024-byte aligned (and read from global memory).
int g_last_raw_fast = 0;
__device__ int g_raw_misaligned;

__device__ __forceinline__ long long cycle_now() {
  long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
  return t;
}

struct PhaseClock {  // thread 0's view: a phase ends when thread 0 leaves its closing barrier
  bool on;
  long long t;
  __device__ explicit PhaseClock(bool enabled) : on(enabled), t(enabled ? cycle_now() : 0) {}
  __device__ void mark(int phase) {
    if (!on) return;
    const long long now = cycle_now();
    atomicAdd(&g_phase_cycles[phase], static_cast<unsigned long long>(now - t));
    t = now;
  }
};

// The chunk items of this block (blockIdx.x, stepping by the grid) on `smem` (the dynamic shared memory,
// ChunkSmem::kBytes): the body of kda_chunk_kernel and the chunk phase of kda_one_launch_kernel.
template <class Problem>  // KdaCudaProblem or KdaCudaProblemFew
__device__ __forceinline__ void chunk_phase(const Problem& p, void* ws, unsigned char* smem) {
  const int K = p.K, V = p.V;
  const int items = p.chunk_start[p.N] * p.H;
  // bit t: input t arrives raw by TMA (else by load8 from global memory in step 1); only where the
  // shared memory starts 1024-byte aligned, as the raw tiles' swizzle assumes (block-uniform).
  const int fast = (smem_addr(smem) & 1023u) == 0 ? p.raw_fast : 0;
  if (threadIdx.x == 0 && fast != p.raw_fast) g_raw_misaligned = 1;
  int* const item_desc = reinterpret_cast<int*>(smem + ChunkSmem::kItem);  // [2][8], buffer (item count) % 2
  auto* const in_bar = reinterpret_cast<uint64_t*>(smem + ChunkSmem::kInBar);  // the raw tiles, a phase per item
  if (threadIdx.x == 0) {
    mbar_init(in_bar);
    mbar_init(reinterpret_cast<uint64_t*>(smem + ChunkSmem::kInvBar), 64);
    if (int(blockIdx.x) < items) ChunkItem(p, blockIdx.x).put(item_desc);
  }
  __syncthreads();  // the barrier and the first descriptor
  ItemScalars next{};
  if (int(blockIdx.x) < items) {
    const ChunkItem first(item_desc);
    issue_raw(p, first, smem, fast, 15, true, threadIdx.x, in_bar);
    next = load_scalars(p, first, threadIdx.x);
  }
  for (int item = blockIdx.x, parity = 0; item < items; item += int(gridDim.x), parity ^= 1) {
    // The item's thread index and view of shared memory, through an offset the compiler cannot see
    // is 0: the addresses derived from them are not hoisted out of the item loop (that kept more
    // registers live than the 128 of a 512-thread block, and spilled).
    int off0 = 0;
    asm volatile("" : "+r"(off0));
    unsigned char* const sm = smem + off0;
    const int tid = int(threadIdx.x) + off0, warp = tid / 32, lane = tid % 32;
    __builtin_assume(tid >= 0 && tid < kThreads);  // the index arithmetic stays unsigned (shifts, masks)
    const int g8 = lane >> 2, t4 = lane & 3;  // mma fragment coordinates
    float* qs = reinterpret_cast<float*>(sm + ChunkSmem::kQ);
    float* ks = reinterpret_cast<float*>(sm + ChunkSmem::kK);
    float* Gs = reinterpret_cast<float*>(sm + ChunkSmem::kG);
    auto* kinv = reinterpret_cast<__nv_bfloat16*>(sm + ChunkSmem::kKinv);
    auto* qr = reinterpret_cast<__nv_bfloat16*>(sm + ChunkSmem::kQr);
    auto* kr = reinterpret_cast<__nv_bfloat16*>(sm + ChunkSmem::kKr);
    auto* kref = reinterpret_cast<__nv_bfloat16*>(sm + ChunkSmem::kKref);
    auto* kbh = qr;                                                          // after step 3
    auto* Abf = reinterpret_cast<__nv_bfloat16*>(sm + ChunkSmem::kAbf);   // after step 3
    auto* vbh = kref;                                                        // after step 3
    float* Ls = reinterpret_cast<float*>(sm + ChunkSmem::kL);
    float* Aq = reinterpret_cast<float*>(sm + ChunkSmem::kAq);
    float* As = reinterpret_cast<float*>(sm + ChunkSmem::kAs);
    float* bs = reinterpret_cast<float*>(sm + ChunkSmem::kBeta);
    float* rn = reinterpret_cast<float*>(sm + ChunkSmem::kRn);
    int* span = reinterpret_cast<int*>(sm + ChunkSmem::kSafe);  // [4] decay span of diagonal block s (float bits, >= 0)
    const ChunkItem it(item_desc + 8 * parity);
    const int slot = it.slot, h = it.h, hq = it.hq, b = it.b, t0 = it.t0, rows = it.rows;
    const ItemScalars cur = next;
    unsigned char* rec = ws_record(ws, slot, p.H, h);
    PhaseClock clk(tid == 0 && g_phase_on);

    // 1. Inputs over the padded [64][128] tile, 8 channels per task: q, k, the gate in log2, β, and
    //    the sums of squares of q and k over each 8 channels; v stays in registers until its tile is
    //    free (step 4). A bf16 tensor with 16-byte aligned rows arrives raw in shared memory first
    //    (TMA, issued in the previous item's steps 4-5 or before the first item); others are read
    //    from global memory by load8. A warp's lanes take 32 consecutive rows
    //    of one 8-channel group, so the raw tile reads, the fp32 tile stores and the (β v)ᵀ stores of
    //    step 4 are free of bank conflicts.
    const float ea = (p.gate_in_kernel && p.A_log) ? expf(cur.a_log) : 1.0f;
    constexpr int kTasks = kC * kD / 8 / kThreads;
    float* dtb = reinterpret_cast<float*>(sm + ChunkSmem::kT);  // dt_bias of this head, [K]
    const bool has_dtb = p.gate_in_kernel && p.dt_bias;
    if (has_dtb && tid < K) dtb[tid] = cur.dtb;
    const float beta = cur.beta;
    if (fast) mbar_wait(in_bar, unsigned(parity));  // this item's raw tiles (the item count's phase)
    clk.mark(0);                                     // the wait for the raw tiles
    float vreg[kTasks][8];
    // Two passes over the tasks: q and v first (q's tile and v's registers are free: the previous
    // item's step 5 ended with a barrier), then, once the previous item's W and U have left their
    // staging over k and G, k and the gate. kFull: a whole chunk of 128-channel inputs all in raw
    // tiles (the common case), without the per-entry range and path checks.
    float* part = reinterpret_cast<float*>(sm + ChunkSmem::kPart);  // [2][16][64] row sums of squares per 8 channels
    auto load_inputs = [&](auto full, auto pass) {
      constexpr bool kFull = decltype(full)::value;
      constexpr int kPass = decltype(pass)::value;  // 0: q and v, 1: k and the gate
#pragma unroll
      for (int r = 0; r < kTasks; ++r) {
        const int task = tid + r * kThreads, i = task % kC, c0 = (task / kC) * 8;
        float x[2][8];  // pass 0: q, v; pass 1: k, gate
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int t = kPass == 0 ? 3 * u : 1 + u;
          const int C = t == 3 ? V : K;
          if (kFull || (i < rows && c0 < C)) {
            if (kFull || (fast >> t & 1)) unpack8(*reinterpret_cast<const uint4*>(raw_tile(sm, t) + raw_at(i, c0)), x[u]);
            else load8(input(p, t), b, t0 + i, t < 2 ? hq : h, c0, C, x[u]);  // q, k: the group's head
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) x[u][e] = 0.f;
          }
        }
        if constexpr (kPass == 0) {
#pragma unroll
          for (int e = 0; e < 8; e += 2) st2(qs + i * kLdF + c0 + e, x[0][e], x[0][e + 1]);  // channel pairs: 8-byte stores
          if (p.l2norm) part[(c0 / 8) * kC + i] = sum_squares8(x[0]);
#pragma unroll
          for (int e = 0; e < 8; ++e) vreg[r][e] = x[1][e];
        } else {
          // The gate in log2 units: the activation on channels < K (the padding stays 0), or the
          // precomputed log-decay times log2 e.
          if (!p.gate_in_kernel) {
#pragma unroll
            for (int e = 0; e < 8; ++e) x[1][e] *= kLog2e;
          } else if (kFull || i < rows) {
            float a[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) a[e] = x[1][e];
            if (has_dtb) {  // two 16-byte loads (dtb is 16-byte aligned, c0 a multiple of 8)
              const float4 d0 = ld4(dtb + c0), d1 = ld4(dtb + c0 + 4);
              const float d[8] = {d0.x, d0.y, d0.z, d0.w, d1.x, d1.y, d1.z, d1.w};
#pragma unroll
              for (int e = 0; e < 8; ++e) a[e] += kFull || c0 + e < K ? d[e] : 0.f;
            }
            if (p.lower_bound_gate) {  // lower_bound · sigmoid(e^A_log x)
#pragma unroll
              for (int e = 0; e < 8; ++e) a[e] = kLog2e * __fdividef(p.lower_bound, 1.0f + __expf(-ea * a[e]));
            } else {  // −e^A_log softplus(x) log2 e = −e^A_log log2(1 + 2^y), y = x log2 e: one exp2 (softplus_log2.hpp)
#pragma unroll
              for (int e = 0; e < 8; ++e) {
                const float y = a[e] * kLog2e;
                a[e] = -ea * softplus_log2(y, fast_exp2(-fabsf(y)));
              }
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) x[1][e] = kFull || c0 + e < K ? a[e] : 0.f;
          }
#pragma unroll
          for (int e = 0; e < 8; e += 2) {
            st2(ks + i * kLdF + c0 + e, x[0][e], x[0][e + 1]);
            st2(Gs + i * kLdF + c0 + e, x[1][e], x[1][e + 1]);
          }
          if (p.l2norm) part[(16 + c0 / 8) * kC + i] = sum_squares8(x[0]);
        }
      }
    };
    const bool full = rows == kC && fast == 15 && K == kD && V == kD;
    if (full) load_inputs(std::true_type{}, std::integral_constant<int, 0>{});
    else load_inputs(std::false_type{}, std::integral_constant<int, 0>{});
    if (tid == 0) bulk_store_wait_read();  // the previous item's W and U have left their staging over k and G
    __syncthreads();  // also: dt_bias in shared memory
    clk.mark(7);      // q and v, the wait for the W and U stores' reads, and the barrier
    if (full) load_inputs(std::true_type{}, std::integral_constant<int, 1>{});
    else load_inputs(std::false_type{}, std::integral_constant<int, 1>{});
    if (tid < kC) bs[tid] = beta;
    if (tid < 4) span[tid] = 0;
    __syncthreads();
    clk.mark(1);
    // The chunk-local cumulative gate G (warps 0-3: a thread per channel down all 64 rows, 16 rows'
    // loads at a time) and, meanwhile, the L2-norm factors of q and k (warps 4-7), applied where q
    // and k are read (steps 2-4), not written back.
    if (warp < 4) {
      float acc = 0.f;
#pragma unroll
      for (int i0 = 0; i0 < kC; i0 += 16) {
        float g[16];
#pragma unroll
        for (int u = 0; u < 16; ++u) g[u] = Gs[(i0 + u) * kLdF + tid];
#pragma unroll
        for (int u = 0; u < 16; ++u) {
          acc += g[u];
          Gs[(i0 + u) * kLdF + tid] = acc;
        }
      }
    } else if (warp < 8) {
      // The L2-norm factors of q and k (1 without the norm), a thread per row and matrix, from step
      // 1's sums over 8-channel groups (in a fixed order).
      const int e = tid - 128;
      float f = 1.f;
      if (p.l2norm) {  // (without the norm step 1 wrote no partials)
        float sa = 0.f, sb = 0.f;
        const float* pr = part + (e / kC) * 16 * kC + e % kC;
#pragma unroll
        for (int g = 0; g < 16; g += 2) {
          sa += pr[g * kC];
          sb += pr[(g + 1) * kC];
        }
        f = rsqrtf(sa + sb + 1e-6f);
      }
      rn[e] = f;
    }
    // Loops over tiles below take a thread's row and column once, then constant strides, so that
    // the addresses are a base plus constants (not a division per entry).
    const int c64 = tid % kC, r64 = tid / kC;  // [*][64] tiles: column, first row (rows step 8)
    __syncthreads();
    clk.mark(2);

    // 2. Operands of the intra-chunk products (reference r = first row of each 16-row block), the
    //    state kernel's Qg, Kg, dC, and whether each diagonal block's decay span allows the tensor cores.
    auto* Qg = reinterpret_cast<__nv_bfloat16*>(rec + WsLayout::kQg);
    auto* Kg = reinterpret_cast<__nv_bfloat16*>(rec + WsLayout::kKg);
    auto* dC = reinterpret_cast<float*>(rec + WsLayout::kDC);
    // A thread takes the channel pair (cp, cp + 1) of rows r64 + 8 it: 8-byte loads, 4-byte stores.
    float span4[4] = {0.f, 0.f, 0.f, 0.f};  // max (G_r − G_i) per diagonal block over this thread's entries
    const int cp = 2 * c64;
    float2 Gref[4];  // G at the block starts r = 16 s (the references)
#pragma unroll
    for (int s4 = 0; s4 < 4; ++s4) Gref[s4] = ld2(Gs + 16 * s4 * kLdF + cp);
    const float2 Gl = ld2(Gs + (kC - 1) * kLdF + cp);  // gC, the last row's G
    const int qk_at = tile_at(r64, cp);  // Qg and Kg (swizzled, wgmma operands) at row r64; rows r64 + 8 it keep its XOR
#pragma unroll
    for (int it = 0; it < kC * kD / 2 / kThreads; ++it) {  // row i = tid / 64 + 8 it: block it / 2, warp-uniform
      const int i = r64 + 8 * it, blk = it / 2;
      const float rq = rn[i], rk = rn[kC + i];  // the L2-norm factors
      const float2 G = ld2(Gs + i * kLdF + cp), q = scale2(ld2(qs + i * kLdF + cp), rq), k = scale2(ld2(ks + i * kLdF + cp), rk);
      const float d0 = G.x - Gref[blk].x, d1 = G.y - Gref[blk].y, f0 = fast_exp2(d0), f1 = fast_exp2(d1);
      span4[blk] = fmaxf(span4[blk], fmaxf(-d0, -d1));
      st_u32(qr + i * kLd + cp, pack_bf16(q.x * f0, q.y * f1));
      st_u32(kr + i * kLd + cp, pack_bf16(k.x * f0, k.y * f1));
      st_u32(kinv + i * kLd + cp, pack_bf16(-d0 <= kMaxDiagSpan ? k.x * fast_exp2(-d0) : 0.f, -d1 <= kMaxDiagSpan ? k.y * fast_exp2(-d1) : 0.f));
      st_u32(Qg + qk_at + 8 * kC * it, pack_bf16(p.scale * q.x * fast_exp2(G.x), p.scale * q.y * fast_exp2(G.y)));
      st_u32(Kg + qk_at + 8 * kC * it, pack_bf16(k.x * fast_exp2(Gl.x - G.x), k.y * fast_exp2(Gl.y - G.y)));
#pragma unroll
      for (int sref = blk + 1; sref < 4; ++sref)  // row i of reference sref's block of kref (i < 16 sref)
        st_u32(kref + (kref_row(sref) + i) * kLd + cp, pack_bf16(k.x * fast_exp2(Gref[sref].x - G.x), k.y * fast_exp2(Gref[sref].y - G.y)));
    }
    if (tid < kD) dC[tid] = fast_exp2(Gs[(kC - 1) * kLdF + tid]);
#pragma unroll
    for (int t = 0; t < 4; ++t) {  // the spans of the diagonal blocks: warp maxima, then shared (bits of floats >= 0 order as ints)
      float v = span4[t];
      for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
      if (lane == 0 && v > 0.f) atomicMax(span + t, __float_as_int(v));
    }
    __syncthreads();
    clk.mark(3);

    // 3. Aqk and L, one 16 x 16 block of both per task (warps 0-9; the two share the B operand): the 6
    //    blocks below the diagonal (tasks 4-9, warps 0-5), the 4 diagonal blocks (tasks 0-3, warps
    //    6-9), each diagonal warp then inverting its block of I + L (forward_substitution). Warps 10-15,
    //    meanwhile: zeros in the 6 blocks above the diagonal.
    static_assert(ChunkSmem::kKr - ChunkSmem::kQr == kC * kLd * 2, "kr follows qr: one A-tile stride");
    if (warp < 10) {
      const int task = warp < 6 ? warp + 4 : warp - 6;
      const bool diag = task < 4;
      int s, sp;
      if (diag) {
        s = sp = task;
      } else {
        const int pair = task - 4;  // (s, s') = (1,0) (2,0) (2,1) (3,0) (3,1) (3,2)
        s = pair < 1 ? 1 : (pair < 3 ? 2 : 3);
        sp = pair - (s == 1 ? 0 : (s == 2 ? 1 : 3));
      }
      const bool wide = diag && !(__int_as_float(span[s]) <= kMaxDiagSpan);
      const bool two_refs = wide && half_block_span(Gs, 16 * s, lane) <= kMaxDiagSpan &&
                            half_block_span(Gs, 16 * s + 8, lane) <= kMaxDiagSpan;  // warp-uniform
      if (two_refs) {
        float acc[2][3][4] = {};
        diag_block_two_refs(qs, ks, Gs, rn, 16 * s, acc);
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int part = 0; part < 4; ++part)  // 3: the zeros above the diagonal (rows 0-7, columns 8-15)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int i = 16 * s + g8 + (part == 0 || part == 3 ? 0 : 8), j = 16 * s + 2 * t4 + e + (part >= 2 ? 8 : 0);
              const float x = part == 3 ? 0.f : acc[m][part][(part == 0 ? 0 : 2) + e];
              const bool keep = m == 1 ? j < i : j <= i;
              (m == 1 ? Ls : Aq)[i * kLdS + j] = keep ? (m == 1 ? bs[i] : p.scale) * x : 0.f;
            }
      } else if (wide) {  // too wide for two references (more than 2^100 within 8 rows, e.g. gates of -1000)
        float lv[4][4] = {}, dg[2][4] = {};
        diag_block_by_halving(qs, ks, Gs, rn, 16 * s, lv, dg);
#pragma unroll
        for (int l = 0; l < 4; ++l)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int w = 8 >> l, n = 2 * t4 + e;
            if (g8 / w != n / w) continue;  // not a pair of this level
            const int i = 16 * s + 2 * w * (g8 / w) + w + g8 % w, j = 16 * s + 2 * w * (n / w) + n % w;
            Aq[i * kLdS + j] = p.scale * lv[l][e];
            Ls[i * kLdS + j] = bs[i] * lv[l][2 + e];
          }
#pragma unroll
        for (int e = 0; e < 2; ++e)  // the diagonal: column tile 0 rows g8, tile 1 rows 8 + g8
          if (g8 == 2 * t4 + e) {
            const int i0 = 16 * s + g8, i1 = i0 + 8;
            Aq[i0 * kLdS + i0] = p.scale * dg[0][e];
            Aq[i1 * kLdS + i1] = p.scale * dg[1][2 + e];
            Ls[i0 * kLdS + i0] = Ls[i1 * kLdS + i1] = 0.f;
          }
        for (int e = lane; e < 256; e += 32) {  // the zeros above the diagonal of both
          const int i = 16 * s + e / 16, j = 16 * s + e % 16;
          if (j > i) Aq[i * kLdS + j] = Ls[i * kLdS + j] = 0.f;
        }
      } else {
        float acc[2][2][4] = {};  // [0] Aqk (A = qr rows), [1] L (A = kr rows)
        const __nv_bfloat16* B = diag ? kinv + 16 * s * kLd : kref + (kref_row(s) + 16 * sp) * kLd;
        for (int ks_ = 0; ks_ < kD / 16; ++ks_) warp_mma_tiles_step<2, 2>(acc, qr + 16 * s * kLd, kLd, kC * kLd, B, kLd, ks_);
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const int i = 16 * s + g8 + 8 * (q / 2), j = 16 * sp + 8 * nt + 2 * t4 + q % 2;
              const bool keep = !diag || (m == 1 ? j < i : j <= i);
              (m == 1 ? Ls : Aq)[i * kLdS + j] = keep ? (m == 1 ? bs[i] : p.scale) * acc[m][nt][q] : 0.f;
            }
      }
      if (diag) {
        __syncwarp();  // this warp's block of L
        forward_substitution(Ls, As, 16 * s, lane);
      }
    } else {
      // The next item's descriptor (read in step 5), by a thread of these lightly loaded warps.
      if (tid == 10 * 32 && item + int(gridDim.x) < items) ChunkItem(p, item + int(gridDim.x)).put(item_desc + 8 * (parity ^ 1));
      for (int e = tid - 10 * 32; e < 6 * 256; e += 6 * 32) {  // above-diagonal block (s', s) = (0,1) (0,2) (0,3) (1,2) (1,3) (2,3)
        const int blk = e / 256, r = 16 * (blk < 3 ? 0 : (blk < 5 ? 1 : 2)), cblk = blk < 3 ? blk + 1 : (blk < 5 ? blk - 1 : 3);
        const int i = r + (e % 256) / 16, j = 16 * cblk + e % 16;
        Aq[i * kLdS + j] = 0.f;
      }
    }
    __syncthreads();
    clk.mark(4);
    // The next item's raw q goes in flight now (its tile aliases kinv, last read in step 3); the
    // gate's after step 4 (over Aqk), k and v at step 5's start (over L and A).
    const bool has_next = item + int(gridDim.x) < items;
    if (has_next && tid == 0) issue_raw(p, ChunkItem(item_desc + 8 * (parity ^ 1)), sm, fast, 1, true, tid, in_bar);

    // 4. Every thread: its β v entries as bf16 hi (the product's B operand) + lo (over the q
    //    tile, free now: step 5's identity part). Then, side by side:
    //    warps 4-15: Aqk out (workspace bf16 hi + lo, residual), the G residual, β k ⊙ 2^G likewise
    //      (hi, lo over q), A's diagonal blocks (inverted in step 3) and the zeros above
    //      them in bf16 (Abf, step 5's operand) and the residual;
    //    warps 0-3: the blocks of A = (I + L)^-1 below the diagonal by doubling, on tensor cores
    //      with fp32 operands split in bf16 hi + lo (mma_split: ~16 significant bits; A enters step
    //      5 in bf16 anyway), in two levels (X_ab: block of X;
    //      P..Q: rows or columns P to Q; A is zero above its diagonal blocks):
    //        level 1, warps 0 and 1, 16 x 16 blocks (1,0) and (3,2): A_{b,b−1} = −(A_bb L_{b,b−1}) A_{b−1,b−1};
    //        level 2, warps 0-3 (16 rows x 16 columns each), rows 32..63 x columns 0..31:
    //          A_{32..63,0..31} = −(A_{32..63,32..63} L_{32..63,0..31}) A_{0..31,0..31},
    //      each product in parentheses kept in registers as the next one's A operand; level 1
    //      writes A_{1,0} and A_{3,2} to As too (level 2 reads them).
    auto* vlo = reinterpret_cast<__nv_bfloat16*>(sm + ChunkSmem::kQ);                  // over q (free now)
    auto* klo = reinterpret_cast<__nv_bfloat16*>(sm + ChunkSmem::kQ + kRawTileBytes);  // over q
#pragma unroll
    for (int r = 0; r < kTasks; ++r) {
      const int task = tid + r * kThreads, i = task % kC, c0 = (task / kC) * 8;
      const float bi = bs[i];  // once: the compiler cannot move loads of bs past the tile stores
      float bv[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) bv[e] = bi * vreg[r][e];
      store_hi_lo(bv, vbh, vlo, i, c0);
    }
    const int64_t tok0 = (int64_t(b) * p.T + t0) * p.H + h;  // token row index of chunk row 0
    if (warp >= 4) {
      auto* Aqk_ws = reinterpret_cast<__nv_bfloat16*>(rec + WsLayout::kAqk);
      for (int i = warp - 4; i < kC; i += kWarps - 4) {  // column pairs (j, j + 1), a warp a row
        const int j = 2 * lane;
        split_bf16(Aq[i * kLdS + j], Aq[i * kLdS + j + 1], Aqk_ws + tile_at(i, j), WsLayout::kAqkPlane);
      }
      if (p.res_Aqk)
        for (int e = tid - 128; e < rows * kC; e += kThreads - 128)
          store(p.res_Aqk, p.res_dtype, (tok0 + int64_t(e / kC) * p.H) * kC + e % kC, Aq[(e / kC) * kLdS + e % kC]);
      if (p.res_G)
        for (int e = tid - 128; e < rows * K; e += kThreads - 128) p.res_G[(tok0 + int64_t(e / K) * p.H) * K + e % K] = Gs[(e / K) * kLdF + e % K];
      for (int task = tid - 128; task < kC * kD / 8; task += kThreads - 128) {  // row j, channels c0..c0+7 (a warp: 32 rows)
        const int j = task % kC, c0 = (task / kC) * 8;
        const float bj = bs[j] * rn[kC + j];  // β and the L2-norm factor of row j
        float kx[8], gx[8];
#pragma unroll
        for (int e = 0; e < 8; e += 2) {  // channel pairs: 8-byte loads, all before the stores
          const float2 k2 = ld2(ks + j * kLdF + c0 + e), g2 = ld2(Gs + j * kLdF + c0 + e);
          kx[e] = k2.x, kx[e + 1] = k2.y, gx[e] = g2.x, gx[e + 1] = g2.y;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) kx[e] = bj * kx[e] * fast_exp2(gx[e]);
        store_hi_lo(kx, kbh, klo, j, c0);
      }
      for (int e = tid - 128; e < kC * kC / 8; e += kThreads - 128) {  // A's diagonal blocks and the zeros above them in bf16
        const int i = e / (kC / 8), j = 8 * (e % (kC / 8));
        if (j / 16 >= i / 16) {
          float a[8] = {};
          if (j / 16 == i / 16) {
            const float4 a0 = ld4(As + i * kLdS + j), a1 = ld4(As + i * kLdS + j + 4);
            a[0] = a0.x, a[1] = a0.y, a[2] = a0.z, a[3] = a0.w, a[4] = a1.x, a[5] = a1.y, a[6] = a1.z, a[7] = a1.w;
          }
          store8_bf16(Abf + i * kLdC + j, a);
          if (p.res_Akk && i < rows)
            for (int u = 0; u < 8; ++u) store(p.res_Akk, p.res_dtype, (tok0 + int64_t(i) * p.H) * kC + j + u, a[u]);
        }
      }
    } else {
      const auto put = [&](int i, int j, float x, float y, bool fp32) {  // A(i, j..j+1), for rows of the chunk
        if (fp32) st2(As + i * kLdS + j, x, y);
        st_u32(Abf + i * kLdC + j, pack_bf16(x, y));
        if (p.res_Akk && i < rows) {
          const int64_t e = (tok0 + int64_t(i) * p.H) * kC + j;
          store(p.res_Akk, p.res_dtype, e, x);
          store(p.res_Akk, p.res_dtype, e + 1, y);
        }
      };
      // B fragments of n-tiles n0.. of X (an fp32 [k][n] tile, rows ks..) for one k-step.
      const auto b_frags = [&](auto& bh, auto& bl, const float* x) {
#pragma unroll
        for (int nt = 0; nt < int(sizeof(bh) / sizeof(bh[0])); ++nt) b_frag_split(x + 8 * nt, kLdS, bh[nt], bl[nt]);
      };
      uint32_t ah[4], al[4];
      if (warp < 2) {  // level 1, block (b, b − 1) with rows o..o+15
        const int o = 16 + 32 * warp;
        float P[2][4] = {}, Q[2][4] = {};
        uint32_t bh[2][2], bl[2][2];
        a_frag_split(As + o * kLdS + o, kLdS, ah, al);
        b_frags(bh, bl, Ls + o * kLdS + o - 16);
        mma_split(P, ah, al, bh, bl);
        a_frag_split(P, 0, ah, al);
        b_frags(bh, bl, As + (o - 16) * kLdS + o - 16);
        mma_split(Q, ah, al, bh, bl);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) put(o + g8 + 8 * hh, o - 16 + 8 * nt + 2 * t4, -Q[nt][2 * hh], -Q[nt][2 * hh + 1], true);
      }
      {
        // Level 1's blocks in As: warps 0-1 arrive, warps 0-3 wait (an mbarrier phase per item; a
        // named barrier here made compute-sanitizer racecheck report hazards everywhere, docs/gotchas.md).
        auto* const inv_bar = reinterpret_cast<uint64_t*>(sm + ChunkSmem::kInvBar);
        if (warp < 2) mbar_arrive(inv_bar);
        mbar_wait(inv_bar, unsigned(parity));
        const int mt = warp & 1, nh = warp >> 1, r0 = 32 + 16 * mt;  // rows r0.., columns 16 nh..
        float P[4][4] = {}, Q[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < 2; ++ks)
          if (ks <= mt) {  // block (mt, ks) of A_{32..63,32..63}: zero for ks > mt
            uint32_t bh[4][2], bl[4][2];
            a_frag_split(As + r0 * kLdS + 32 + 16 * ks, kLdS, ah, al);
            b_frags(bh, bl, Ls + (32 + 16 * ks) * kLdS);
            mma_split(P, ah, al, bh, bl);
          }
#pragma unroll
        for (int ks = 0; ks < 2; ++ks)
          if (ks >= nh) {  // block (ks, nh) of A_{0..31,0..31}: zero for ks < nh
            uint32_t bh[2][2], bl[2][2];
            a_frag_split(P, ks, ah, al);
            b_frags(bh, bl, As + 16 * ks * kLdS + 16 * nh);
            mma_split(Q, ah, al, bh, bl);
          }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) put(r0 + g8 + 8 * hh, 16 * nh + 8 * nt + 2 * t4, -Q[nt][2 * hh], -Q[nt][2 * hh + 1], false);
      }
    }
    __syncthreads();
    clk.mark(5);
    if (has_next && tid == 0) issue_raw(p, ChunkItem(item_desc + 8 * (parity ^ 1)), sm, fast, 4, false, tid, in_bar);  // the gate, over Aqk

    // 5. W = A (β k ⊙ 2^G) (bf16) and U = A (β v) (fp32): warp = (matrix, 32-column quarter, two
    //    16-row blocks), the products with the hi operands, then I · lo (identity_lo_step).
    //    First the next item's k and v go in flight (L and A are free now; q went in step 4, the gate
    //    just before). W and U are staged in shared memory in the record's layout (over k and G, free
    //    since step 4, so each warp stores its results as soon as its products are done) and leave by
    //    two bulk stores, so the record writes are whole lines from the TMA engine instead of 256
    //    scattered warp stores (this step was the kernel's MIO-bound one). Thread 0 waits for the stores' shared-memory reads before step 1
    //    of the next item writes k and G.
    if (has_next) {
      const ChunkItem nx(item_desc + 8 * (parity ^ 1));
      issue_raw(p, nx, sm, fast, 2 | 8, false, tid, in_bar);  // k and v, over L and A
      next = load_scalars(p, nx, tid);
    }
    // Warp w: matrix is_u = w & 1, columns cq = 32 ((w >> 1) & 3).., row blocks {0, 3} (w < 8) or
    // {1, 2}: A is zero above its diagonal blocks, so row block rb takes k-steps 0..rb only, and
    // each warp's two row blocks come to 5 k-steps (the B fragments of the k-steps both take are
    // loaded once).
    const bool is_u = warp & 1;
    const int cq = 32 * ((warp >> 1) & 3), rb0 = warp < 8 ? 0 : 1, rb1 = 3 - rb0;
    const __nv_bfloat16* Bx = is_u ? vbh : kbh;
    auto* W = reinterpret_cast<__nv_bfloat16*>(sm + ChunkSmem::kWStage);  // staging: the record's W (tile_at)
    auto* U = reinterpret_cast<float*>(sm + ChunkSmem::kUStage);           // staging: the record's U (u_at)
    float acc[2][4][4] = {};  // [row block rb0, rb1][n-tile]
    const int bl[2] = {raw_b_lane(cq), raw_b_lane(cq + 16)};  // this lane's B row offsets (raw_b_frags)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {  // the A fragments of row blocks rb0 (k-steps 0..rb0) and rb1 (0..rb1); B shared
      if (ks > rb1) continue;
      const int m = lane >> 3, r = lane & 7;
      uint32_t a0[4], a1[4];
      if (ks <= rb0) ldmatrix_x4(a0, Abf + (16 * rb0 + r + 8 * (m & 1)) * kLdC + 8 * (m >> 1) + 16 * ks);
      ldmatrix_x4(a1, Abf + (16 * rb1 + r + 8 * (m & 1)) * kLdC + 8 * (m >> 1) + 16 * ks);
#pragma unroll
      for (int n = 0; n < 4; n += 2) {
        uint32_t b0[2], b1[2];
        raw_b_frags(Bx + bl[n / 2] + 64 * 16 * ks, b0, b1);
        if (ks <= rb0) {
          mma_bf16(acc[0][n], a0, b0);
          mma_bf16(acc[0][n + 1], a0, b1);
        }
        mma_bf16(acc[1][n], a1, b0);
        mma_bf16(acc[1][n + 1], a1, b1);
      }
    }
    // The staging offsets of this thread's columns, once: its rows i are g8 modulo 8, so the swizzle
    // terms of W (tile_at, by i % 8) and of U (u_at, by bit 1 of i) are those of row g8.
    int st_at[4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int c = cq + 8 * nt + 2 * t4;
      st_at[nt] = is_u ? u_at(g8, c) - kUSlice * g8 : tile_at(g8, c) - 64 * g8;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r0 = 16 * (j ? rb1 : rb0);
      identity_lo_step(acc[j], is_u ? vlo : klo, r0, bl);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int i = r0 + g8 + 8 * hh;
          if (is_u)
            *reinterpret_cast<float2*>(U + kUSlice * i + st_at[nt]) = make_float2(acc[j][nt][2 * hh], acc[j][nt][2 * hh + 1]);
          else *reinterpret_cast<uint32_t*>(W + 64 * i + st_at[nt]) = pack_bf16(acc[j][nt][2 * hh], acc[j][nt][2 * hh + 1]);
        }
    }
    fence_proxy_async_shared();  // the staged W and U visible to the bulk stores
    __syncthreads();
    if (tid == 0) {
      bulk_store(rec + WsLayout::kW, W, unsigned(WsLayout::kKg - WsLayout::kW));
      bulk_store(rec + WsLayout::kU, U, unsigned(WsLayout::kBytes - WsLayout::kU));
      bulk_store_commit();
    }
    clk.mark(6);
    if (clk.on) atomicAdd(&g_phase_blocks, 1ull);
  }
  if (threadIdx.x == 0) bulk_store_wait_all();  // the last item's stores complete before the block's shared memory goes
}

template <class Problem>  // KdaCudaProblem or KdaCudaProblemFew
__global__ void __launch_bounds__(kThreads, 1) kda_chunk_kernel(const __grid_constant__ Problem p, void* ws) {
  extern __shared__ __align__(1024) unsigned char smem[];
  chunk_phase(p, ws, smem);
}

// The one-launch forward (KdaLaunchPlan::launches 1): a grid of max(chunk items, state blocks) blocks, at
// most one wave (the plan's condition). Block b runs chunk item b (item = h · slots + slot, as the chunk
// kernel), then sets its flag, then block b of the state kernel's grid (x = b % (H · column blocks), y =
// b / that), whose thread 0 acquires the flag of each chunk (slot, h) before the bulk copy of its record.
// Flags: one uint64 per chunk item after the records (chunk_flags), set to this launch's epoch (a host
// counter, distinct per launch), so the workspace needs no clearing. The record's W and U leave by bulk
// stores (async proxy): thread 0 waits for their completion (chunk_phase's end) and fences the async proxy
// before the release; the reader fences it after the acquire, before its bulk copy. The state pass's bulk
// copies land on shared memory the chunk phase wrote by ordinary stores: every thread fences the async
// proxy for shared memory before the barrier that ends the phase. The launch is cooperative (all blocks
// resident at once, or the launch fails and the two kernels run instead), so a block that waits on a chunk
// item never holds the SM the item's block needs.
template <int kVs, class P>
__global__ void __launch_bounds__(kThreads, 1) kda_one_launch_kernel(const __grid_constant__ P p, void* ws, unsigned long long epoch) {
  extern __shared__ __align__(1024) unsigned char smem[];
  // (nothing is held in registers across the chunk phase: it uses all 128)
  if (int(blockIdx.x) < p.chunk_start[p.N] * p.H) {
    chunk_phase(p, ws, smem);
    __threadfence();  // this thread's record stores (Qg, Kg, dC, Aqk) before the flag
    fence_proxy_async_shared();  // its shared-memory stores before the state pass's bulk copies over them
    __syncthreads();
    if (threadIdx.x == 0) {
      mbar_inval(reinterpret_cast<uint64_t*>(smem + ChunkSmem::kInBar));  // the chunk phase's barriers are done (their bytes lie past the state pass's)
      mbar_inval(reinterpret_cast<uint64_t*>(smem + ChunkSmem::kInvBar));
      fence_proxy_async_global();  // the completed bulk stores (W, U) before the flag
      const int slots = p.chunk_start[p.N], chunk_items = slots * p.H;
      unsigned long long* const flags = chunk_flags(ws, slots, p.H);
      for (int item = int(blockIdx.x); item < chunk_items; item += int(gridDim.x)) store_release_gpu(flags + item, epoch);
    }
    __syncthreads();  // the chunk phase's shared memory is free
  }
  const int per_seq = p.H * state_column_blocks(p.V, kVs);
  if (int(blockIdx.x) >= per_seq * p.N) return;
  state::state_pass<kVs>(p, ws, blockIdx.x % unsigned(per_seq), blockIdx.x / unsigned(per_seq), smem, [&p, ws, epoch](int slot, int h) {
    const int slots = p.chunk_start[p.N];
    const unsigned long long* f = chunk_flags(ws, slots, p.H) + (int64_t(h) * slots + slot);
    while (load_acquire_gpu(f) != epoch) __nanosleep(64);
    fence_proxy_async_global();  // the record's bytes for the bulk copy that follows
  });
}

}  // namespace

}  // namespace encore::cuda::kda

namespace encore::cuda {

Status kda_chunk_profile_enable(bool on) {
  const int v = on ? 1 : 0;
  if (cudaMemcpyToSymbol(kda::g_phase_on, &v, sizeof(v)) != cudaSuccess)
    return Status::cuda_error(std::string("kda profile: ") + cudaGetErrorString(cudaGetLastError()));
  return Status::ok();
}

Status kda_chunk_raw_inputs(int* mask) {
  int misaligned = 0;
  const int zero = 0;
  if (cudaMemcpyFromSymbol(&misaligned, kda::g_raw_misaligned, sizeof(int)) != cudaSuccess ||
      cudaMemcpyToSymbol(kda::g_raw_misaligned, &zero, sizeof(int)) != cudaSuccess)
    return Status::cuda_error(std::string("kda raw inputs: ") + cudaGetErrorString(cudaGetLastError()));
  *mask = misaligned ? 0 : kda::g_last_raw_fast;
  return Status::ok();
}

Status kda_chunk_profile_read(unsigned long long cycles[kKdaChunkPhases], unsigned long long* blocks) {
  unsigned long long zero[kKdaChunkPhases + 1] = {};
  if (cudaMemcpyFromSymbol(cycles, kda::g_phase_cycles, sizeof(unsigned long long) * kKdaChunkPhases) != cudaSuccess ||
      cudaMemcpyFromSymbol(blocks, kda::g_phase_blocks, sizeof(unsigned long long)) != cudaSuccess ||
      cudaMemcpyToSymbol(kda::g_phase_cycles, zero, sizeof(unsigned long long) * kKdaChunkPhases) != cudaSuccess ||
      cudaMemcpyToSymbol(kda::g_phase_blocks, zero, sizeof(unsigned long long)) != cudaSuccess)
    return Status::cuda_error(std::string("kda profile: ") + cudaGetErrorString(cudaGetLastError()));
  return Status::ok();
}

}  // namespace encore::cuda

namespace encore::cuda::kda {

template <class P>
Status launch_chunk_kernel(const P& p, void* ws, int blocks, cudaStream_t stream) {
  constexpr const char* what = "kda forward: chunk kernel (kda_chunk_kernel)";
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kda_chunk_kernel<P>, ChunkSmem::kBytes));
  const int64_t items = int64_t(p.chunk_start[p.N]) * p.H;
  g_last_raw_fast = p.raw_fast;
  return launch(what, [&] { kda_chunk_kernel<P><<<unsigned(items < blocks ? items : blocks), kThreads, ChunkSmem::kBytes, stream>>>(p, ws); });
}
template Status launch_chunk_kernel(const KdaCudaProblem&, void*, int, cudaStream_t);
template Status launch_chunk_kernel(const KdaCudaProblemFew&, void*, int, cudaStream_t);

template <int kVs>
Status launch_one(const KdaCudaProblemFew& p, void* ws, unsigned long long epoch, cudaStream_t stream) {
  constexpr const char* what = "kda forward: one-launch kernel (kda_one_launch_kernel)";
  constexpr int kSmem = ChunkSmem::kBytes > state::StateSmem<kVs>::kAlloc ? ChunkSmem::kBytes : state::StateSmem<kVs>::kAlloc;
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kda_one_launch_kernel<kVs, KdaCudaProblemFew>, kSmem));
  const int chunk_items = p.chunk_start[p.N] * p.H, state_items = p.H * state_column_blocks(p.V, kVs) * p.N;
  const int grid = chunk_items > state_items ? chunk_items : state_items;
  ENCORE_RETURN_IF_ERROR(launch_gate(what));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(grid > 0 ? grid : 1)), cfg.blockDim = dim3(kThreads), cfg.dynamicSmemBytes = kSmem, cfg.stream = stream;
  cudaLaunchAttribute coop{};
  coop.id = cudaLaunchAttributeCooperative;
  coop.val.cooperative = 1;
  cfg.attrs = &coop, cfg.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kda_one_launch_kernel<kVs, KdaCudaProblemFew>, p, ws, epoch);
  if (e == cudaErrorCooperativeLaunchTooLarge) {  // not all resident now (other work, an SM limit): two kernels
    (void)cudaGetLastError();
    return Status::unsupported("kda forward: the one-launch grid is not resident at once");
  }
  if (e == cudaSuccess) g_last_raw_fast = p.raw_fast;
  return launch_result(what, e);
}

// 16 or 32 columns (kda::one_launch_fits): at 64 the state pass and the chunk phase in one kernel
// spilled 72 bytes a thread (ptxas, 128 registers), at 32 16 bytes, at 16 none.
Status launch_one_kernel(const KdaCudaProblemFew& p, void* ws, int columns, unsigned long long epoch, cudaStream_t stream) {
  if (columns != 16 && columns != 32)
    return Status::internal("kda forward: the one-launch kernel takes 16 or 32 state columns, got " + std::to_string(columns));
  return columns == 16 ? launch_one<16>(p, ws, epoch, stream) : launch_one<32>(p, ws, epoch, stream);
}

}  // namespace encore::cuda::kda
