// KDA inter-chunk state kernel (math-kda.md §4): grid (H · ceil(V / kVs), N), 8 kVs threads (kVs = 64:
// 16 warps, 32: 8 warps); the serial pass of one sequence and head over its chunks on a kVs-column
// slice of the state; blockIdx.y ranks the sequences longest first (p.seq_by_length), so when the
// grid exceeds one wave the blocks left for later are the short passes (varlen with 160 blocks on
// 132 SMs: the critical path is the longest sequence, not a short one followed by the longest)
// S [K, V], on tensor cores (bf16 operands, fp32 accumulation, S itself kept fp32 in registers):
//
//   h_t  = S (chunk-start state) -> the record's H (bf16) for the output kernel, h residual
//   Vnew = U − W S            warp (rw, cw) = (w % 4, w / 4): chunk rows 16 rw.., columns 16 cw..
//                             -> the record's Vn (bf16 hi + lo) for the output kernel
//   S    = dC ⊙ S + KgT Vnew  state rows 32 rw.., columns 16 cw..
//
// O = Qg h_t + Aqk Vnew is not on this serial path: kda_output.cu computes it for all chunks in
// parallel. S and Vnew enter the products rounded to bf16, like the chunk operands (as fla does).
// The chunk operands this pass needs (W, KgT, dC and the block's U slice: 53 KB) arrive in shared
// memory by two bulk copies (cp.async.bulk on an mbarrier, issued by one thread) two chunks ahead
// (three stages). S and Vnew sit in shared memory in their natural [k][n] layouts (pairs of columns
// store as one word); the products read them with ldmatrix.trans.
#include "cuda/kda/kda_device.cuh"

namespace encore::cuda::kda {
namespace {

constexpr int kStages = 3;

// Shared memory of a block of kVs value columns (64: 512 threads, 32: 256 threads); a stage holds a
// chunk's operands in the record's layout (the whole U slice of the block's columns).
template <int kVs>
struct StateSmem {  // byte offsets
  static constexpr int kThreads = 8 * kVs;                       // 4 row groups x kVs / 16 column groups of warps
  static constexpr int kLdS = kVs + 8;                           // bf16 row stride of S and Vnew
  static constexpr int kW = 0;                                   // bf16 [64][136]
  static constexpr int kKgT = int(WsLayout::kKgT);               // bf16 [128][72]
  static constexpr int kDC = int(WsLayout::kDC);                 // fp32 [128]
  static constexpr int kU = int(WsLayout::kU);                   // fp32 [64][72] the U slice holding the block's columns
  static constexpr int kStage = kU + int(WsLayout::kUSliceBytes);
  static constexpr int kSb = kStages * kStage;                   // bf16 [128][kLdS] S of the block's columns
  static constexpr int kVb = kSb + kD * kLdS * 2;                // bf16 [64][kLdS] Vnew (= its hi part)
  static constexpr int kVlo = kVb + kC * kLdS * 2;               // bf16 [64][kLdS] Vnew − hi (Vb + kC kLdS elements)
  static constexpr int kBar = kVlo + kC * kLdS * 2;              // uint64 [kStages] stage barriers
  static constexpr int kBytes = kBar + kStages * 8;
  static_assert(kUSlice % kVs == 0 && kVs % 16 == 0, "a block's columns lie in one U slice");
  static_assert(kStage % 16 == 0 && kSb % 16 == 0 && kVb % 16 == 0 && kVlo % 16 == 0 && kBar % 16 == 0, "aligned parts");
  static_assert(kBytes <= 227 * 1024, "fits the opt-in shared memory of an sm_90 block");
};

// One thread: the two bulk copies of a chunk's operands (W, KgT, dC; the U slice) into a stage.
__device__ void prefetch(unsigned char* stage, uint64_t* bar, const unsigned char* rec, int slice) {
  mbar_expect(bar, unsigned(WsLayout::kU + WsLayout::kUSliceBytes));
  bulk_copy(stage, rec, unsigned(WsLayout::kU), bar);
  bulk_copy(stage + WsLayout::kU, rec + WsLayout::kU + slice * WsLayout::kUSliceBytes, unsigned(WsLayout::kUSliceBytes), bar);
}

template <int kVs>
__global__ void __launch_bounds__(8 * kVs, 1) kda_state_kernel(const __grid_constant__ KdaCudaProblem p, void* ws) {
  using Sm = StateSmem<kVs>;
  constexpr int kLdS = Sm::kLdS;
  const int nz = (p.V + kVs - 1) / kVs;
  const int n = p.seq_by_length[blockIdx.y], h = blockIdx.x / nz, v0 = (blockIdx.x % nz) * kVs, tid = threadIdx.x, lane = tid % 32;
  const int slice = v0 / kUSlice, uo = v0 % kUSlice;            // the U slice and the block's offset in it
  const int rw = (tid / 32) % 4, cw = tid / 128;                 // row group, 16-column group
  const int g8 = lane >> 2, t4 = lane & 3, vw = 16 * cw + 2 * t4;  // fragment column vw + 8 nt + e
  const int K = p.K, V = p.V;
  extern __shared__ __align__(16) unsigned char smem[];
  auto* Sb = reinterpret_cast<__nv_bfloat16*>(smem + Sm::kSb);
  auto* Vb = reinterpret_cast<__nv_bfloat16*>(smem + Sm::kVb);
  auto* Vlo = reinterpret_cast<__nv_bfloat16*>(smem + Sm::kVlo);
  auto* base = static_cast<unsigned char*>(ws);
  auto record = [&](int slot) { return base + (int64_t(slot) * p.H + h) * WsLayout::kBytes; };

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
  auto write_s = [&] {  // S in bf16, the B operand of W S: column pairs (vl, vl + 1) as one word
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

  const int first = p.chunk_start[n], last = p.chunk_start[n + 1];
  auto* bar = reinterpret_cast<uint64_t*>(smem + Sm::kBar);
  if (tid == 0) {
    for (int k = 0; k < kStages; ++k) mbar_init(bar + k);
    for (int k = 0; k < kStages - 1; ++k)
      if (first + k < last) prefetch(smem + k * Sm::kStage, bar + k, record(first + k), slice);
  }
  __syncthreads();  // barriers initialized
  for (int slot = first; slot < last; ++slot) {
    const int it = slot - first;
    mbar_wait(bar + it % kStages, unsigned(it / kStages) & 1u);  // this chunk's operands have landed
    __syncthreads();  // S visible; every read of stage (it − 1) done
    if (tid == 0 && slot + kStages - 1 < last) {
      const int st = (it + kStages - 1) % kStages;
      prefetch(smem + st * Sm::kStage, bar + st, record(slot + kStages - 1), slice);
    }
    const unsigned char* cur = smem + (it % kStages) * Sm::kStage;
    const auto* Ws = reinterpret_cast<const __nv_bfloat16*>(cur + Sm::kW);
    const auto* KgT = reinterpret_cast<const __nv_bfloat16*>(cur + Sm::kKgT);
    const auto* U = reinterpret_cast<const float*>(cur + Sm::kU) + uo;
    const auto* dC = reinterpret_cast<const float*>(cur + Sm::kDC);
    unsigned char* rec = record(slot);
    auto* H = reinterpret_cast<__nv_bfloat16*>(rec + WsLayout::kH);
    auto* Vn_ws = reinterpret_cast<__nv_bfloat16*>(rec + WsLayout::kVn);
    // The chunk-start state h for the output kernel, copied from S in 16-byte pieces (padding rows
    // and columns are zero), and the h residual.
    for (int x = tid; x < kD * kVs / 8; x += Sm::kThreads)
      *reinterpret_cast<uint4*>(H + (x / (kVs / 8)) * kLd + v0 + (x % (kVs / 8)) * 8) =
          *reinterpret_cast<const uint4*>(Sb + (x / (kVs / 8)) * kLdS + (x % (kVs / 8)) * 8);
    if (p.res_h)
      for_state([&](float& s, int c, int vl) {
        const int v = v0 + vl;
        if (c < K && v < V) store(p.res_h, p.res_dtype, ((int64_t(slot) * p.H + h) * K + c) * V + v, s);
      });
    // Vnew = U − W S for chunk rows 16 rw.., columns 16 cw.. (into shared memory and the record)
    float x[2][4];
    zero(x);
    warp_mma_kn<2>(x, Ws + 16 * rw * kLd, kLd, Sb + 16 * cw, kLdS, kD / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {  // columns vl, vl + 1 of row i
        const int i = 16 * rw + g8 + 8 * hh, vl = vw + 8 * nt;
        const float2 u = *reinterpret_cast<const float2*>(U + i * kULd + vl);
        const float2 vn = make_float2(u.x - x[nt][2 * hh], u.y - x[nt][2 * hh + 1]);
        split_bf16(vn.x, vn.y, Vb + i * kLdS + vl, kC * kLdS);  // Vb (hi, the state update's operand), Vlo
      }
    __syncthreads();  // Vnew complete
    // S = dC ⊙ S + KgT Vnew for state rows 32 rw.., columns 16 cw..
    for_state([&](float& s, int c, int) { s *= dC[c]; });
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
      warp_mma_kn<2>(S[mt], KgT + (32 * rw + 16 * mt) * kLdC, kLdC, Vb + 16 * cw, kLdS, kC / 16);
    write_s();  // every warp's reads of S ended before the Vnew barrier
    // Vnew's hi and lo planes to the record for the output kernel, from shared memory in 16-byte
    // pieces (whole 32-byte sectors; see docs/kda.md for the pair stores), after the state update so
    // the copy is off the serial path (Vb and Vlo are next written after the next chunk's barrier).
    for (int x = tid; x < kC * kVs / 8; x += Sm::kThreads) {
      const int r = x / (kVs / 8), c = (x % (kVs / 8)) * 8;
      *reinterpret_cast<uint4*>(Vn_ws + r * kLd + v0 + c) = *reinterpret_cast<const uint4*>(Vb + r * kLdS + c);
      *reinterpret_cast<uint4*>(Vn_ws + WsLayout::kVnPlane + r * kLd + v0 + c) = *reinterpret_cast<const uint4*>(Vlo + r * kLdS + c);
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
cudaError_t launch_state(const KdaCudaProblem& p, void* ws, cudaStream_t stream) {
  using Sm = StateSmem<kVs>;
  const cudaError_t e = cudaFuncSetAttribute(kda_state_kernel<kVs>, cudaFuncAttributeMaxDynamicSharedMemorySize, Sm::kBytes);
  if (e != cudaSuccess) return e;
  kda_state_kernel<kVs><<<dim3(unsigned(p.H * ((p.V + kVs - 1) / kVs)), unsigned(p.N)), Sm::kThreads, Sm::kBytes, stream>>>(p, ws);
  return cudaGetLastError();
}

cudaError_t launch_state_kernel(const KdaCudaProblem& p, void* ws, int columns, cudaStream_t stream) {
  return columns == 32 ? launch_state<32>(p, ws, stream) : launch_state<64>(p, ws, stream);
}

}  // namespace encore::cuda::kda
