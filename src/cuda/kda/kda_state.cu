// KDA inter-chunk state kernel (math-kda.md §4): grid (N, H, ceil(V / 64)), 512 threads (16 warps);
// the serial pass of one sequence and head over its chunks on a 64-column slice of the state
// S [K, V], on tensor cores (bf16 operands, fp32 accumulation, S itself kept fp32 in registers):
//
//   Vnew = U − W S            warp (rw, cw) = (w % 4, w / 4): chunk rows 16 rw.., columns 16 cw..
//   O    = Qg S + Aqk Vnew    (Aqk lower triangular: k-steps 0..rw)
//   S    = dC ⊙ S + KgT Vnew  state rows 32 rw.., columns 16 cw..
//
// S and Vnew enter the products rounded to bf16, like the chunk operands (as fla does); S itself stays
// fp32. (Carrying them as bf16 hi + lo pairs was measured: o error 3.7e-3 -> 3.4e-3, state pass ~1.3x
// slower; not kept.)
// The chunk's operands (kda_device.cuh's workspace record, written by kda_chunk.cu) are copied into
// shared memory with cp.async one chunk ahead (two stages), so the copy of chunk i + 1 overlaps the
// products of chunk i. The chunk-start state goes to the h residual when requested; o and the final
// state are written from the accumulators.
#include "cuda/kda/kda_device.cuh"

namespace encore::cuda::kda {
namespace {

constexpr int kThreads = 512;
constexpr int kVs = 64;  // value columns per block: 16 per group of 4 warps

struct StateSmem {  // byte offsets; one stage holds a chunk's operands
  static constexpr int kW = 0;                       // bf16 [64][136]
  static constexpr int kQg = kW + kC * kLd * 2;      // bf16 [64][136]
  static constexpr int kKgT = kQg + kC * kLd * 2;    // bf16 [128][72]
  static constexpr int kAqk = kKgT + kD * kLdC * 2;  // bf16 [64][72]
  static constexpr int kU = kAqk + kC * kLdC * 2;    // fp32 [64][64] the block's U columns
  static constexpr int kDC = kU + kC * kVs * 4;      // fp32 [128]
  static constexpr int kStage = kDC + kD * 4;
  static constexpr int kST = 2 * kStage;             // bf16 [64][136] Sᵀ of the block's columns
  static constexpr int kVnT = kST + kVs * kLd * 2;   // bf16 [64][72] Vnewᵀ
  static constexpr int kBytes = kVnT + kVs * kLdC * 2;
};
static_assert(StateSmem::kStage % 16 == 0 && StateSmem::kU % 16 == 0 && StateSmem::kVnT % 16 == 0, "16-byte copies");

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

// Issues the copies of one chunk's record into a stage (16-byte pieces, rows re-strided).
__device__ void prefetch(unsigned char* stage, const unsigned char* rec, int v0, int tid) {
  for (int x = tid; x < 2 * kC * 16; x += kThreads) {  // W, Qg: 64 rows x 16 pieces each
    const int part = x / (kC * 16), r = (x / 16) % kC, ch = x % 16;
    cp_async16(stage + (part ? StateSmem::kQg : StateSmem::kW) + r * kLd * 2 + ch * 16,
               rec + (part ? WsLayout::kQg : WsLayout::kW) + r * kD * 2 + ch * 16);
  }
  for (int x = tid; x < kD * 8; x += kThreads)  // KgT: 128 rows x 8 pieces
    cp_async16(stage + StateSmem::kKgT + (x / 8) * kLdC * 2 + (x % 8) * 16, rec + WsLayout::kKgT + (x / 8) * kC * 2 + (x % 8) * 16);
  for (int x = tid; x < kC * 8; x += kThreads)  // Aqk: 64 rows x 8 pieces
    cp_async16(stage + StateSmem::kAqk + (x / 8) * kLdC * 2 + (x % 8) * 16, rec + WsLayout::kAqk + (x / 8) * kC * 2 + (x % 8) * 16);
  for (int x = tid; x < kC * (kVs / 4); x += kThreads) {  // U columns v0..v0+63: 64 rows x 16 pieces
    const int r = x / (kVs / 4), ch = x % (kVs / 4);
    cp_async16(stage + StateSmem::kU + r * kVs * 4 + ch * 16, rec + WsLayout::kU + (r * kD + v0) * 4 + ch * 16);
  }
  for (int x = tid; x < kD / 4; x += kThreads) cp_async16(stage + StateSmem::kDC + x * 16, rec + WsLayout::kDC + x * 16);
}

__global__ void __launch_bounds__(kThreads, 1) kda_state_kernel(const __grid_constant__ KdaCudaProblem p, const void* ws) {
  const int n = blockIdx.x, h = blockIdx.y, v0 = blockIdx.z * kVs, tid = threadIdx.x, lane = tid % 32;
  const int rw = (tid / 32) % 4, cw = tid / 128;                 // row group, 16-column group
  const int g8 = lane >> 2, t4 = lane & 3, vw = 16 * cw + 2 * t4;  // fragment column vw + 8 nt + e
  const int K = p.K, V = p.V, b = p.varlen ? 0 : n;
  extern __shared__ __align__(16) unsigned char smem[];
  auto* ST = reinterpret_cast<__nv_bfloat16*>(smem + StateSmem::kST);
  auto* VnT = reinterpret_cast<__nv_bfloat16*>(smem + StateSmem::kVnT);
  const auto* base = static_cast<const unsigned char*>(ws);
  auto record = [&](int slot) { return base + (int64_t(slot) * p.H + h) * WsLayout::kBytes; };
  auto scol = [&](int nt, int q) { return vw + 8 * nt + q % 2; };  // column in the slice

  // S[mt][nt][q] = S(c, v0 + vl), c = 32 rw + 16 mt + g8 + 8 (q / 2), vl = scol(nt, q); fp32, whole pass.
  float S[2][2][4];
  auto for_state = [&](auto&& f) {  // f(S element, c, vl) over this thread's fragment
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) f(S[mt][nt][q], 32 * rw + 16 * mt + g8 + 8 * (q / 2), scol(nt, q));
  };
  const int64_t srow0 = (int64_t(n) * p.H + h) * K;  // [N, H, K, V] row of (n, h, c = 0)
  for_state([&](float& s, int c, int vl) {
    const int v = v0 + vl;
    s = (p.h0 && c < K && v < V) ? p.h0[(srow0 + c) * V + v] : 0.f;
  });
  auto write_st = [&] {  // Sᵀ in bf16, the B operand of W S and Qg S
    for_state([&](float& s, int c, int vl) { ST[vl * kLd + c] = __float2bfloat16(s); });
  };
  write_st();

  const int first = p.chunk_start[n], last = p.chunk_start[n + 1], begin = p.seq_begin[n], end = p.seq_end[n];
  if (first < last) prefetch(smem, record(first), v0, tid);
  cp_async_commit();
  for (int slot = first; slot < last; ++slot) {
    const int it = slot - first;
    cp_async_wait_all();
    __syncthreads();  // this chunk's stage and Sᵀ visible; every read of the other stage done
    if (slot + 1 < last) prefetch(smem + ((it + 1) & 1) * StateSmem::kStage, record(slot + 1), v0, tid);
    cp_async_commit();
    const unsigned char* cur = smem + (it & 1) * StateSmem::kStage;
    const auto* Ws = reinterpret_cast<const __nv_bfloat16*>(cur + StateSmem::kW);
    const auto* Qs = reinterpret_cast<const __nv_bfloat16*>(cur + StateSmem::kQg);
    const auto* KgT = reinterpret_cast<const __nv_bfloat16*>(cur + StateSmem::kKgT);
    const auto* Aqk = reinterpret_cast<const __nv_bfloat16*>(cur + StateSmem::kAqk);
    const auto* U = reinterpret_cast<const float*>(cur + StateSmem::kU);
    const auto* dC = reinterpret_cast<const float*>(cur + StateSmem::kDC);
    const int t0 = begin + it * kC, rows = min(kC, end - t0);
    if (p.res_h)  // the chunk-start state
      for_state([&](float& s, int c, int vl) {
        const int v = v0 + vl;
        if (c < K && v < V) store(p.res_h, p.res_dtype, ((int64_t(slot) * p.H + h) * K + c) * V + v, s);
      });
    // Vnew = U − W S and O = Qg S for chunk rows 16 rw.., columns 16 cw..
    float x[2][4], y[2][4];
    zero(x);
    zero(y);
    warp_mma_nt<2>(x, Ws + 16 * rw * kLd, kLd, ST + 16 * cw * kLd, kLd, kD / 16);
    warp_mma_nt<2>(y, Qs + 16 * rw * kLd, kLd, ST + 16 * cw * kLd, kLd, kD / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int i = 16 * rw + g8 + 8 * (q / 2), vl = scol(nt, q);
        VnT[vl * kLdC + i] = __float2bfloat16(U[i * kVs + vl] - x[nt][q]);
      }
    __syncthreads();  // Vnew complete
    warp_mma_nt<2>(y, Aqk + 16 * rw * kLdC, kLdC, VnT + 16 * cw * kLdC, kLdC, rw + 1);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int i = 16 * rw + g8 + 8 * (q / 2), v = v0 + scol(nt, q);
        if (i < rows && v < V) store(p.o, p.o_dtype, int64_t(b) * p.o_sb + int64_t(t0 + i) * p.o_st + int64_t(h) * p.o_sh + v, y[nt][q]);
      }
    // S = dC ⊙ S + KgT Vnew for state rows 32 rw.., columns 16 cw..
    for_state([&](float& s, int c, int) { s *= dC[c]; });
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
      warp_mma_nt<2>(S[mt], KgT + (32 * rw + 16 * mt) * kLdC, kLdC, VnT + 16 * cw * kLdC, kLdC, kC / 16);
    write_st();  // every warp's reads of Sᵀ ended before the Vnew barrier
  }
  if (p.final_state)
    for_state([&](float& s, int c, int vl) {
      const int v = v0 + vl;
      if (c < K && v < V) p.final_state[(srow0 + c) * V + v] = s;
    });
}

}  // namespace

cudaError_t launch_state_kernel(const KdaCudaProblem& p, const void* ws, cudaStream_t stream) {
  const cudaError_t e = cudaFuncSetAttribute(kda_state_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, StateSmem::kBytes);
  if (e != cudaSuccess) return e;
  kda_state_kernel<<<dim3(unsigned(p.N), unsigned(p.H), unsigned((p.V + kVs - 1) / kVs)), kThreads, StateSmem::kBytes, stream>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace encore::cuda::kda
