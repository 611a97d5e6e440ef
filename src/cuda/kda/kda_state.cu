// KDA inter-chunk state and output kernel (math-kda.md §4): grid (H · ceil(V / kVs), N), 8 kVs
// threads (kVs = 64: 16 warps, 32: 8 warps, 16: 4 warps); the serial pass of one sequence and head over its
// chunks on a kVs-column slice of the state, with each chunk's output on the way; blockIdx.y ranks
// the sequences longest first (p.seq_by_length), so when the grid exceeds one wave the blocks left
// for later are the short passes (varlen with 160 blocks on 132 SMs: the critical path is the
// longest sequence, not a short one followed by the longest). S [K, V] on tensor cores (bf16
// operands, fp32 accumulation, S itself kept fp32 in registers), warp (rw, cw) = (w % 4, w / 4):
//
//   h_t  = S (chunk-start state; bf16 copy Sb in shared memory), the h residual from fp32 S
//   Vnew = U − W h_t,  O = Qg h_t             chunk rows 16 rw.., columns 16 cw.. (one B operand)
//   O   += Aqk Vnew                           (Aqk, Vnew as bf16 hi + lo: hi·hi + hi·lo + lo·hi;
//                                              Aqk lower triangular: k-steps 0..rw)
//   S    = dC ⊙ S + Kgᵀ Vnew                  state rows 32 rw.., columns 16 cw.. (Kgᵀ by ldmatrix.trans)
//
// o in its dtype for the chunk's valid rows and the first V columns. S and Vnew enter the products
// rounded to bf16, like the chunk operands (as fla does). A chunk's operands (W, Kg, dC, Qg, Aqk:
// one bulk copy; the U slice holding the block's columns: a second) arrive by cp.async.bulk on an
// mbarrier, issued by one thread, one chunk ahead (two stages of 88 KB). S and Vnew sit in shared
// memory in their natural [k][n] layouts (pairs of columns store as one word); the products read
// them with ldmatrix.trans.
#include "cuda/kda/kda_device.cuh"

namespace encore::cuda::kda {
namespace {

constexpr int kStages = 2;
// Independent accumulator chains per product: the narrow blocks (4 or 8 warps, registers to spare)
// split each product's k-steps over two accumulator sets (even and odd k-steps) so that dependent
// mma chains are half as long (a block of 16 columns is alone on its SM at B = 1, one warp per
// scheduler: its step time is the latency of those chains); 64 columns (16 warps) stay at the
// 128-register limit with one.
template <int kVs>
constexpr int kChains = kVs <= 32 ? 2 : 1;

// Shared memory of a block of kVs value columns (64: 512 threads, 32: 256, 16: 128); a stage holds a
// chunk's operands in the record's layout (the whole U slice of the block's columns).
template <int kVs>
struct StateSmem {  // byte offsets
  static constexpr int kThreads = 8 * kVs;                       // 4 row groups x kVs / 16 column groups of warps
  static constexpr int kLdS = kVs + 8;                           // bf16 row stride of S and Vnew
  static constexpr int kStage = int(WsLayout::kU + WsLayout::kUSliceBytes);  // W .. Aqk, then the U slice at WsLayout::kU
  static constexpr int kSb = kStages * kStage;                   // bf16 [128][kLdS] S of the block's columns
  static constexpr int kVb = kSb + kD * kLdS * 2;                // bf16 [64][kLdS] Vnew (= its hi part)
  static constexpr int kVlo = kVb + kC * kLdS * 2;               // bf16 [64][kLdS] Vnew − hi (Vb + kC kLdS elements)
  static constexpr int kBar = kVlo + kC * kLdS * 2;              // uint64 [kStages] stage barriers
  static constexpr int kBytes = kBar + kStages * 8;
  static_assert(kUSlice % kVs == 0 && kVs % 16 == 0, "a block's columns lie in one U slice");
  static_assert(kStage % 16 == 0 && kSb % 16 == 0 && kVb % 16 == 0 && kVlo % 16 == 0 && kBar % 16 == 0, "aligned parts");
  static_assert(kBytes <= 227 * 1024, "fits the opt-in shared memory of an sm_90 block");
};

// One thread: the two bulk copies of a chunk's operands (W .. Aqk; the U slice) into a stage.
__device__ void prefetch(unsigned char* stage, uint64_t* bar, const unsigned char* rec, int slice) {
  mbar_expect(bar, unsigned(WsLayout::kU + WsLayout::kUSliceBytes));
  bulk_copy(stage, rec, unsigned(WsLayout::kU), bar);
  bulk_copy(stage + WsLayout::kU, rec + WsLayout::kU + slice * WsLayout::kUSliceBytes, unsigned(WsLayout::kUSliceBytes), bar);
}

// a += b over mma accumulator fragments.
template <int N>
__device__ __forceinline__ void add_tiles(float (&a)[N][4], const float (&b)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int q = 0; q < 4; ++q) a[n][q] += b[n][q];
}
template <int M, int N>
__device__ __forceinline__ void add_tiles(float (&a)[M][N][4], const float (&b)[M][N][4]) {
#pragma unroll
  for (int m = 0; m < M; ++m) add_tiles(a[m], b[m]);
}

template <int kVs>
__global__ void __launch_bounds__(8 * kVs, 1) kda_state_kernel(const __grid_constant__ KdaCudaProblem p, const void* ws) {
  using Sm = StateSmem<kVs>;
  constexpr int kLdS = Sm::kLdS;
  const int nz = state_column_blocks(p.V, kVs);
  const int n = p.seq_by_length[blockIdx.y], h = blockIdx.x / nz, v0 = (blockIdx.x % nz) * kVs, tid = threadIdx.x, lane = tid % 32;
  const int slice = v0 / kUSlice, uo = v0 % kUSlice;            // the U slice and the block's offset in it
  const int rw = (tid / 32) % 4, cw = tid / 128;                 // row group, 16-column group
  const int g8 = lane >> 2, t4 = lane & 3, vw = 16 * cw + 2 * t4;  // fragment column vw + 8 nt + e
  const int K = p.K, V = p.V;
  const int b = p.varlen ? 0 : n;
  extern __shared__ __align__(16) unsigned char smem[];
  auto* Sb = reinterpret_cast<__nv_bfloat16*>(smem + Sm::kSb);
  auto* Vb = reinterpret_cast<__nv_bfloat16*>(smem + Sm::kVb);

  // S[mt][nt][q] = S(c, v0 + vl), c = 32 rw + 16 mt + g8 + 8 (q / 2), vl = vw + 8 nt + q % 2; fp32.
  float S[2][2][4];
  auto for_state = [&](auto&& f) {  // f(S element, c, vl) over this thread's fragment
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) f(S[mt][nt][q], 32 * rw + 16 * mt + g8 + 8 * (q / 2), vw + 8 * nt + q % 2);
  };
  const int64_t srow0 = (int64_t(n) * p.H + h) * K;  // [N, H, K, V] row of (n, h, c = 0)
  for_state([&](float& s, int c, int vl) {
    const int v = v0 + vl;
    s = (p.h0 && c < K && v < V) ? p.h0[(srow0 + c) * V + v] : 0.f;
  });
  auto write_s = [&] {  // S in bf16, the B operand of W S and Qg S: column pairs (vl, vl + 1) as one word
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          *reinterpret_cast<uint32_t*>(Sb + (32 * rw + 16 * mt + g8 + 8 * hh) * kLdS + vw + 8 * nt) =
              pack_bf16(S[mt][nt][2 * hh], S[mt][nt][2 * hh + 1]);
  };
  write_s();

  // o of this thread's columns v0 + vw (+ 8): element offset at token 0, and (the common case, every
  // (row, column pair) a 4-byte aligned bf16 word inside V) a pointer that steps a chunk at a time.
  const int64_t o_off = int64_t(b) * p.o_sb + int64_t(h) * p.o_sh + v0 + vw;
  const bool o_pairs = p.o_dtype == DType::kBF16 && (reinterpret_cast<uintptr_t>(p.o) & 3) == 0 && p.o_sb % 2 == 0 &&
                       p.o_st % 2 == 0 && p.o_sh % 2 == 0 && v0 + kVs <= V;  // v0 + vw is even
  const int seq_begin = p.seq_begin[n], seq_end = p.seq_end[n];  // once (an indexed constant load each step otherwise)
  __nv_bfloat16* o_chunk = static_cast<__nv_bfloat16*>(p.o) + o_off + int64_t(seq_begin) * p.o_st;  // row 0 of the current chunk
  const int first = p.chunk_start[n], last = p.chunk_start[n + 1];
  auto* bar = reinterpret_cast<uint64_t*>(smem + Sm::kBar);
  if (tid == 0) {
    for (int k = 0; k < kStages; ++k) mbar_init(bar + k);
    for (int k = 0; k < kStages - 1; ++k)
      if (first + k < last) prefetch(smem + k * Sm::kStage, bar + k, ws_record(ws, first + k, p.H, h), slice);
  }
  __syncthreads();  // barriers initialized
  for (int slot = first; slot < last; ++slot) {
    const int it = slot - first;
    mbar_wait(bar + it % kStages, unsigned(it / kStages) & 1u);  // this chunk's operands have landed
    __syncthreads();  // S visible; every read of stage (it − 1) and of Vb done
    if (tid == 0 && slot + kStages - 1 < last) {
      const int st = (it + kStages - 1) % kStages;
      prefetch(smem + st * Sm::kStage, bar + st, ws_record(ws, slot + kStages - 1, p.H, h), slice);
    }
    const unsigned char* cur = smem + (it % kStages) * Sm::kStage;
    const auto* Ws = reinterpret_cast<const __nv_bfloat16*>(cur + WsLayout::kW);
    const auto* Kg = reinterpret_cast<const __nv_bfloat16*>(cur + WsLayout::kKg);
    const auto* dC = reinterpret_cast<const float*>(cur + WsLayout::kDC);
    const auto* Ahi = reinterpret_cast<const __nv_bfloat16*>(cur + WsLayout::kAqk) + 16 * rw * kLdC;
    const auto* U = reinterpret_cast<const float*>(cur + WsLayout::kU) + uo;
    if (p.res_h)  // the chunk-start state, from fp32 S
      for_state([&](float& s, int c, int vl) {
        const int v = v0 + vl;
        if (c < K && v < V) store(p.res_h, p.res_dtype, ((int64_t(slot) * p.H + h) * K + c) * V + v, s);
      });
    // Vnew = U − W h_t and O = Qg h_t for chunk rows 16 rw.., columns 16 cw.. (the two A tiles share
    // each B fragment of h_t); Vnew into shared memory as hi + lo.
    static_assert((WsLayout::kQg - WsLayout::kW) % 2 == 0, "Qg a whole number of bf16 after W");
    constexpr int kCh = kChains<kVs>;
    float2 u[2][2];  // this thread's U entries, loaded before the products (ncu: loaded after them, between
                     // the Vnew stores, their latency stalled every warp before the step's middle barrier)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) u[nt][hh] = *reinterpret_cast<const float2*>(U + (16 * rw + g8 + 8 * hh) * kULd + vw + 8 * nt);
    float xc[kCh][2][2][4] = {};  // [chain][0] W h_t, [chain][1] O
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks)
      warp_mma_tiles_step<2, 2, true>(xc[ks % kCh], Ws + 16 * rw * kLd, kLd, int(WsLayout::kQg - WsLayout::kW) / 2, Sb + 16 * cw, kLdS, ks);
    auto& xo = xc[0];
    if constexpr (kCh == 2) add_tiles(xo, xc[1]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {  // columns vl, vl + 1 of row i
        const int i = 16 * rw + g8 + 8 * hh, vl = vw + 8 * nt;
        split_bf16(u[nt][hh].x - xo[0][nt][2 * hh], u[nt][hh].y - xo[0][nt][2 * hh + 1], Vb + i * kLdS + vl, kC * kLdS);  // Vb (hi), Vlo
      }
    __syncthreads();  // Vnew complete; every read of Sb done
    // S = dC ⊙ S + Kgᵀ Vnew for state rows 32 rw.., columns 16 cw.. (both row tiles share each B
    // fragment), and O += Aqk_hi Vnew_hi + Aqk_lo Vnew_hi (sharing B) + Aqk_hi Vnew_lo over k-steps
    // 0..rw (Aqk is zero above the diagonal).
    for_state([&](float& s, int c, int) { s *= dC[c]; });
    float s2[2][2][4] = {};  // the odd k-steps' chain (two chains only)
    float oy[2][2][4] = {};  // [0] O, [1] Aqk_lo Vnew_hi
    float ol[2][4] = {};     // Aqk_hi Vnew_lo (its own chain on the narrow blocks)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) oy[0][nt][q] = xo[1][nt][q];
    const auto s_step = [&](int ks) {
      warp_mma_tiles_step<2, 2, true, true>(kCh == 2 && ks % 2 ? s2 : S, Kg + 32 * rw, kLd, 16, Vb + 16 * cw, kLdS, ks);
    };
    const auto o_step = [&](int ks) {
      warp_mma_tiles_step<2, 2, true>(oy, Ahi, kLdC, int(WsLayout::kAqkPlane), Vb + 16 * cw, kLdS, ks);
      warp_mma_step<2, true>(kCh == 2 ? ol : oy[0], Ahi, kLdC, Vb + kC * kLdS + 16 * cw, kLdS, ks);
    };
    if constexpr (kVs == 64) {
      // The two products' k-steps interleaved (independent mma chains side by side; O's loop unrolled
      // with a warp-uniform predicate) and S back to shared memory after both, so no store sits
      // between their loads (ncu, session 13: state<64> -3.5% varlen and B4; the same on 16 columns
      // made B1 7% slower, so the narrow blocks keep the products one after the other).
      static_assert(kCh == 1, "the 64-column blocks keep one chain (no s2 to add)");
#pragma unroll
      for (int ks = 0; ks < kC / 16; ++ks) {
        s_step(ks);
        if (ks <= rw) o_step(ks);
      }
      write_s();
    } else {
#pragma unroll
      for (int ks = 0; ks < kC / 16; ++ks) s_step(ks);
      if constexpr (kCh == 2) add_tiles(S, s2);
      write_s();
      for (int ks = 0; ks <= rw; ++ks) o_step(ks);
    }
    if constexpr (kCh == 2) add_tiles(oy[1], ol);
    // o rows t0 + i (i < rows), columns v < V
    const int t0 = seq_begin + it * kC, rows = min(kC, seq_end - t0);
    if (o_pairs) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = 16 * rw + g8 + 8 * hh;
        if (i < rows) {
          __nv_bfloat16* const row = o_chunk + int64_t(i) * p.o_st;
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
            *reinterpret_cast<uint32_t*>(row + 8 * nt) =
                pack_bf16(oy[0][nt][2 * hh] + oy[1][nt][2 * hh], oy[0][nt][2 * hh + 1] + oy[1][nt][2 * hh + 1]);
        }
      }
      o_chunk += int64_t(kC) * p.o_st;
    } else {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = 16 * rw + g8 + 8 * hh;
        if (i < rows)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
            store_pair(p.o, p.o_dtype, o_off + int64_t(t0 + i) * p.o_st + 8 * nt, oy[0][nt][2 * hh] + oy[1][nt][2 * hh],
                       oy[0][nt][2 * hh + 1] + oy[1][nt][2 * hh + 1], V - (v0 + vw + 8 * nt));
      }
    }
  }
  if (p.final_state)
    for_state([&](float& s, int c, int vl) {
      const int v = v0 + vl;
      if (c < K && v < V) p.final_state[(srow0 + c) * V + v] = s;
    });
}

}  // namespace

template <int kVs>
cudaError_t launch_state(const KdaCudaProblem& p, const void* ws, cudaStream_t stream) {
  using Sm = StateSmem<kVs>;
  const cudaError_t e = cudaFuncSetAttribute(kda_state_kernel<kVs>, cudaFuncAttributeMaxDynamicSharedMemorySize, Sm::kBytes);
  if (e != cudaSuccess) return e;
  kda_state_kernel<kVs><<<dim3(unsigned(p.H * state_column_blocks(p.V, kVs)), unsigned(p.N)), Sm::kThreads, Sm::kBytes, stream>>>(p, ws);
  return cudaGetLastError();
}

cudaError_t launch_state_kernel(const KdaCudaProblem& p, const void* ws, int columns, cudaStream_t stream) {
  return columns == 16 ? launch_state<16>(p, ws, stream) : columns == 32 ? launch_state<32>(p, ws, stream) : launch_state<64>(p, ws, stream);
}

}  // namespace encore::cuda::kda
