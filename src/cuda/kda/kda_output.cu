// KDA output kernel (math-kda.md §4): grid (chunk slots, H), 256 threads (8 warps), every chunk in
// parallel once the state pass has written its chunk-start state and Vnew:
//
//   O = Qg h_t + Aqk Vnew     (Qg, Aqk from the chunk kernel; h, Vnew from the state kernel)
//
// Aqk and Vnew arrive as bf16 hi + lo planes (kda_device.cuh) and enter as hi·hi + hi·lo + lo·hi.
// warp w: chunk rows 16 (w % 4).., value columns 64 (w / 4)..; Aqk is lower triangular, so row block
// r needs k-steps 0..r of the second product. o in its dtype for the chunk's valid rows and the
// first V columns (pairs of columns stored as one word where aligned). h and Vnew stay in their
// natural [k][n] layouts (ldmatrix.trans). The whole input (Qg, h, Aqk, Vnew: 103 KB, laid out as in
// the record) arrives by one bulk copy; two blocks per SM.
#include "cuda/kda/kda_device.cuh"

namespace encore::cuda::kda {
namespace {

constexpr int kThreads = 256;

struct OutputSmem {  // byte offsets: the record from Qg on
  static constexpr int kQg = 0;                                      // bf16 [64][136]
  static constexpr int kH = int(WsLayout::kH - WsLayout::kQg);       // bf16 [128][136] h (rows = key channels)
  static constexpr int kAqk = int(WsLayout::kAqk - WsLayout::kQg);   // bf16 [2][64][72] hi, lo
  static constexpr int kVn = int(WsLayout::kVn - WsLayout::kQg);     // bf16 [2][64][136] Vnew hi, lo (rows = tokens)
  static constexpr int kBar = int(WsLayout::kBytes - WsLayout::kQg);  // uint64 mbarrier of the bulk copy
  static constexpr int kBytes = kBar + 16;
};
static_assert(OutputSmem::kBar % 16 == 0 && WsLayout::kQg % 16 == 0, "one 16-byte-multiple bulk copy");
static_assert(OutputSmem::kBytes <= 113 * 1024, "two blocks per SM");

__global__ void __launch_bounds__(kThreads) kda_output_kernel(const __grid_constant__ KdaCudaProblem p, const void* ws) {
  const int slot = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rw = warp % 4, cw = warp / 4, g8 = lane >> 2, t4 = lane & 3;
  const int n = find_seq(p, slot);
  const int b = p.varlen ? 0 : n;
  const int t0 = p.seq_begin[n] + (slot - p.chunk_start[n]) * kC;
  const int rows = min(kC, p.seq_end[n] - t0);
  extern __shared__ __align__(16) unsigned char smem[];
  const auto* rec = static_cast<const unsigned char*>(ws) + (int64_t(slot) * p.H + h) * WsLayout::kBytes;
  auto* bar = reinterpret_cast<uint64_t*>(smem + OutputSmem::kBar);
  if (tid == 0) {
    mbar_init(bar);
    mbar_expect(bar, unsigned(OutputSmem::kBar));
    bulk_copy(smem, rec + WsLayout::kQg, unsigned(OutputSmem::kBar), bar);
  }
  __syncthreads();  // the barrier is initialized
  mbar_wait(bar, 0);
  const auto* Qg = reinterpret_cast<const __nv_bfloat16*>(smem + OutputSmem::kQg);
  const auto* Hs = reinterpret_cast<const __nv_bfloat16*>(smem + OutputSmem::kH);
  const auto* Ahi = reinterpret_cast<const __nv_bfloat16*>(smem + OutputSmem::kAqk) + 16 * rw * kLdC;
  const __nv_bfloat16* Alo = Ahi + WsLayout::kAqkPlane;
  const auto* Vhi = reinterpret_cast<const __nv_bfloat16*>(smem + OutputSmem::kVn) + 64 * cw;
  const __nv_bfloat16* Vlo = Vhi + WsLayout::kVnPlane;
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
