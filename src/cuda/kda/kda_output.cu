// KDA output kernel (math-kda.md §4): grid (chunk slots, H), 256 threads (8 warps), every chunk in
// parallel once the state pass has written its chunk-start state and Vnew:
//
//   O = Qg h_t + Aqk Vnew     (Qg, Aqk from the chunk kernel; h, Vnew from the state kernel)
//
// Aqk and Vnew arrive in fp32 and enter as bf16 pairs x = hi + lo (hi·hi + hi·lo + lo·hi): their
// single bf16 roundings were two of the five largest error terms (scripts/kda_rounding_model.py).
// warp w: chunk rows 16 (w % 4).., value columns 64 (w / 4)..; Aqk is lower triangular, so row block
// r needs k-steps 0..r of the second product. o in its dtype for the chunk's valid rows and the
// first V columns (pairs of columns stored as one word where aligned). h and Vnew stay in their
// natural [k][n] layouts (ldmatrix.trans). 103 KB of shared memory: two blocks per SM.
#include "cuda/kda/kda_device.cuh"

namespace encore::cuda::kda {
namespace {

constexpr int kThreads = 256;

struct OutputSmem {  // byte offsets
  static constexpr int kQg = 0;                        // bf16 [64][136]
  static constexpr int kH = kQg + kC * kLd * 2;        // bf16 [128][136] h (rows = key channels)
  static constexpr int kAqk = kH + kD * kLd * 2;       // bf16 [2][64][72] hi, lo
  static constexpr int kVn = kAqk + 2 * kC * kLdC * 2;  // bf16 [2][64][136] Vnew hi, lo (rows = tokens)
  static constexpr int kBar = kVn + 2 * kC * kLd * 2;  // uint64 mbarrier of the bulk copy
  static constexpr int kBytes = kBar + 16;
};
static_assert(OutputSmem::kH == int(WsLayout::kH - WsLayout::kQg), "Qg and H arrive as in the record");
static_assert(OutputSmem::kH % 16 == 0 && OutputSmem::kAqk % 16 == 0 && OutputSmem::kVn % 16 == 0, "16-byte copies");
static_assert(OutputSmem::kBytes <= 113 * 1024, "two blocks per SM");

// Four consecutive floats -> (hi, lo) bf16 at hi[at..at+3], hi[at + lo_offset..] (8-byte stores).
__device__ __forceinline__ void split4(float4 x, __nv_bfloat16* hi, int at, int lo_offset) {
  const float v[4] = {x.x, x.y, x.z, x.w};
  float r[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) r[e] = v[e] - __bfloat162float(__float2bfloat16(v[e]));
  *reinterpret_cast<uint2*>(hi + at) = make_uint2(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]));
  *reinterpret_cast<uint2*>(hi + at + lo_offset) = make_uint2(pack_bf16(r[0], r[1]), pack_bf16(r[2], r[3]));
}

__global__ void __launch_bounds__(kThreads) kda_output_kernel(const __grid_constant__ KdaCudaProblem p, const void* ws) {
  const int slot = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rw = warp % 4, cw = warp / 4, g8 = lane >> 2, t4 = lane & 3;
  const int n = find_seq(p, slot);
  const int b = p.varlen ? 0 : n;
  const int t0 = p.seq_begin[n] + (slot - p.chunk_start[n]) * kC;
  const int rows = min(kC, p.seq_end[n] - t0);
  extern __shared__ __align__(16) unsigned char smem[];
  const auto* rec = static_cast<const unsigned char*>(ws) + (int64_t(slot) * p.H + h) * WsLayout::kBytes;
  // Qg and h (52 KB, adjacent in the record in this layout): one bulk copy, issued by thread 0.
  auto* bar = reinterpret_cast<uint64_t*>(smem + OutputSmem::kBar);
  if (tid == 0) mbar_init(bar);
  __syncthreads();
  if (tid == 0) {
    mbar_expect(bar, unsigned(OutputSmem::kAqk));
    bulk_copy(smem + OutputSmem::kQg, rec + WsLayout::kQg, unsigned(OutputSmem::kAqk), bar);
  }
  auto* Aqk = reinterpret_cast<__nv_bfloat16*>(smem + OutputSmem::kAqk);
  auto* Vn = reinterpret_cast<__nv_bfloat16*>(smem + OutputSmem::kVn);
  const auto* Aqk_ws = reinterpret_cast<const float*>(rec + WsLayout::kAqk);
  const auto* Vn_ws = reinterpret_cast<const float*>(rec + WsLayout::kVn);
  // Every fp32 load is issued before the first conversion (the loads do not wait on each other).
  constexpr int kA4 = kC * kC / 4 / kThreads, kV4 = kC * kD / 4 / kThreads;
  float4 a4[kA4], v4[kV4];
#pragma unroll
  for (int r = 0; r < kA4; ++r) a4[r] = __ldg(reinterpret_cast<const float4*>(Aqk_ws) + tid + r * kThreads);
#pragma unroll
  for (int r = 0; r < kV4; ++r) v4[r] = __ldg(reinterpret_cast<const float4*>(Vn_ws) + tid + r * kThreads);
#pragma unroll
  for (int r = 0; r < kA4; ++r) {
    const int e = 4 * (tid + r * kThreads);
    split4(a4[r], Aqk, (e / kC) * kLdC + e % kC, kC * kLdC);
  }
#pragma unroll
  for (int r = 0; r < kV4; ++r) {
    const int e = 4 * (tid + r * kThreads);
    split4(v4[r], Vn, (e / kD) * kLd + e % kD, kC * kLd);
  }
  mbar_wait(bar, 0);
  __syncthreads();  // the hi/lo tiles of every thread
  const auto* Qg = reinterpret_cast<const __nv_bfloat16*>(smem + OutputSmem::kQg);
  const auto* Hs = reinterpret_cast<const __nv_bfloat16*>(smem + OutputSmem::kH);
  const __nv_bfloat16* Ahi = Aqk + 16 * rw * kLdC;
  const __nv_bfloat16* Alo = Ahi + kC * kLdC;
  const __nv_bfloat16* Vhi = Vn + 64 * cw;
  const __nv_bfloat16* Vlo = Vhi + kC * kLd;
  float y[8][4];
  zero(y);
  warp_mma_kn<8>(y, Qg + 16 * rw * kLd, kLd, Hs + 64 * cw, kLd, kD / 16);
  warp_mma_kn<8>(y, Ahi, kLdC, Vhi, kLd, rw + 1);
  warp_mma_kn<8>(y, Ahi, kLdC, Vlo, kLd, rw + 1);
  warp_mma_kn<8>(y, Alo, kLdC, Vhi, kLd, rw + 1);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {  // columns v, v + 1 of row i
      const int i = 16 * rw + g8 + 8 * hh, v = 64 * cw + 8 * nt + 2 * t4;
      if (i < rows)
        store_pair(p.o, p.o_dtype, int64_t(b) * p.o_sb + int64_t(t0 + i) * p.o_st + int64_t(h) * p.o_sh + v, y[nt][2 * hh],
                   y[nt][2 * hh + 1], p.V - v);
    }
}

}  // namespace

cudaError_t launch_output_kernel(const KdaCudaProblem& p, const void* ws, cudaStream_t stream) {
  const cudaError_t e = cudaFuncSetAttribute(kda_output_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, OutputSmem::kBytes);
  if (e != cudaSuccess) return e;
  kda_output_kernel<<<dim3(unsigned(p.chunk_start[p.N]), unsigned(p.H)), kThreads, OutputSmem::kBytes, stream>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace encore::cuda::kda
