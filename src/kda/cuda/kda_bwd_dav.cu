// KDA backward, kernel 2 (docs/math/kda.md §6 stage 1), dAv, grid (chunk slots, H), 256 threads,
// chunk-parallel: from dO, the record's Vnew and the residual Aqk (scale included):
//   dAqk = tril(dO Vnew^T) (diagonal included)  [64][64]     dVnew(intra) = Aqk^T dO  [64][V]
// into the record (fp32; entries outside the valid rows' triangle zero). Both products on tensor
// cores, split bf16 operands from zero-padded fp32 tiles; warp w owns rows 16 (w % 4) .. + 16 and half
// the columns of each product. K, V <= 128; 85 KB shared.
#include "kda/cuda/kda_bwd_mma.cuh"

namespace encore::cuda::kdabwd {
namespace {

constexpr int kThreads = 256;
constexpr size_t kSmemTc = (2 * kC * kLd + kC * kLdA) * sizeof(float);

__global__ void __launch_bounds__(kThreads) kda_bwd_dav_tc_kernel(const __grid_constant__ KdaBwdCudaProblem p, float* ws) {
  extern __shared__ float smem[];
  float* sdO = smem;              // [64][kLd] dO (zero-padded to 128 columns, rows >= `rows` zero)
  float* sVn = sdO + kC * kLd;    // [64][kLd] Vnew
  float* sAqk = sVn + kC * kLd;   // [64][kLdA] Aqk, valid triangle only
  const int slot = blockIdx.x, h = blockIdx.y, V = p.V, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int m0 = 16 * (warp & 3), nh = warp >> 2;
  const ChunkInfo ci = chunk_info(p, slot);
  const int rows = ci.rows;
  float* rec = ws_rec(ws, p, slot, h);
  const float* cre = rec;
  stage<32, kThreads>(
      kC * kMaxD, [&](int e) { const int i = e >> 7, y = e & 127; return load_or0(p.d_o, ci.b, ci.t0 + i, h, y, i < rows && y < V); },
      [&](int e, float x) { sdO[(e >> 7) * kLd + (e & 127)] = x; });
  stage<32, kThreads>(
      kC * kMaxD, [&](int e) { const int i = e >> 7, y = e & 127; return ldg_or0(cre + p.ws.vn, i * V + y, i < rows && y < V); },
      [&](int e, float x) { sVn[(e >> 7) * kLd + (e & 127)] = x; });
  stage<16, kThreads>(
      kC * kC,
      [&](int e) {
        const int i = e >> 6, j = e & 63;
        return load_any_or0(p.Aqk, p.aqk_dtype, tok(p, ci.b, ci.t0 + i, h) * kC + j, i < rows && j <= i);
      },
      [&](int e, float x) { sAqk[(e >> 6) * kLdA + (e & 63)] = x; });
  __syncthreads();
  {
    float c[4][4];  // dAqk = tril(dO Vnew^T): rows m0 .., columns 32 nh ..
    zero(c);
    warp_gemm<4, true, true>(c, sdO + m0 * kLd, kLd, sVn + 32 * nh * kLd, kLd, kMaxD / 16);
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int i = m0 + g + 8 * (q >> 1), j = 32 * nh + 8 * n + 2 * t + (q & 1);
        rec[p.ws.daqk + i * kC + j] = (i < rows && j <= i) ? c[n][q] : 0.f;
      }
  }
  {
    float c[8][4];  // dVnew = Aqk^T dO: rows (j) m0 .., columns 64 nh ..
    zero(c);
    warp_gemm<8, false, false>(c, sAqk + m0, kLdA, sdO + 64 * nh, kLd, kC / 16);
    store_acc(c, rec + p.ws.dvn, V, m0, 64 * nh, V, 1.0f);
  }
}

}  // namespace

Status launch_dav(const KdaBwdCudaProblem& p, float* ws, int slots, cudaStream_t s) {
  constexpr const char* what = "kda backward: dAv kernel (kda_bwd_dav_tc_kernel)";
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kda_bwd_dav_tc_kernel, kSmemTc));
  return launch(what, [&] { kda_bwd_dav_tc_kernel<<<dim3(slots, p.H), kThreads, kSmemTc, s>>>(p, ws); });
}

}  // namespace encore::cuda::kdabwd
