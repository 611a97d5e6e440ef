// KDA backward, kernel 3a (docs/math/kda.md §6 stage 2, the serial part): the dh recurrence per
// (sequence, head, 64 value columns), grid (N, H, ceil(V / 64)), 256 threads, chunks last to first:
//   dS' = dht[n] (0 without it) at the sequence's last chunk;  per chunk: dh[chunk] = dS' (record)
//   dVnew = Aqk^T dO + Kg dS'  (completes the record's dVn in place)
//   dS = Diag(2^gC) dS' + Qg^T dO - W^T dVnew  -> dS' of the previous chunk; dh0[n] after the first.
// Sequences without chunks write dh0 = dht (or 0). The chunk-parallel rest of the reverse pass (WY,
// intra-chunk, reverse cumsum, gate and L2-norm tails) reads dh from the record: kda_bwd_inter.cu and
// kda_bwd_grads_tc.cu. Both products on tensor cores with split bf16 operands: the A operands Kg,
// Qg^T, W^T from the record, each copied into one [64][132] shared tile with every load in flight
// before the products that read it; the B operands dS', dO, -dVnew from fp32 shared tiles. The state
// dS stays fp32 in shared memory, each element updated by its owner; the state step adds the Qg^T dO
// and W^T (-dVnew) products in two passes. K, V <= 128; 104 KB shared (two blocks per SM).
#include "kda/cuda/kda_bwd_mma.cuh"

namespace encore::cuda::kdabwd {
namespace {

constexpr int kThreads = 256;
constexpr int kCols = 64;           // value columns per block
static_assert(kCols == 64 && kMaxD == 128, "the staged loads index by shifts");
constexpr int kLdS = kCols + 4;     // fp32 row stride of its [*][64] tiles
constexpr size_t kSmemTc = (kMaxD * kLdS + 2 * kC * kLdS + kMaxD + size_t(kC) * kLd) * sizeof(float);

__global__ void __launch_bounds__(kThreads) kda_bwd_dh_tc_kernel(const __grid_constant__ KdaBwdCudaProblem p, float* ws) {
  extern __shared__ float smem[];
  float* sdS = smem;                // [128][kLdS] dS' (rows >= K, columns >= nc zero)
  float* sdO = sdS + kMaxD * kLdS;  // [64][kLdS] dO columns
  float* sdV = sdO + kC * kLdS;     // [64][kLdS] -dVnew columns
  float* sGc = sdV + kC * kLdS;     // [128]
  float* sX = sGc + kMaxD;          // [64][kLd] the record tile of the products at hand
  const int n = blockIdx.x, h = blockIdx.y, K = p.K, V = p.V, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int y0 = blockIdx.z * kCols, nc = min(kCols, V - y0);
  const int b = p.varlen ? 0 : n;
  const int64_t s0 = (int64_t(n) * p.H + h) * K * V;
  const int cs = p.state_v_first ? 1 : V, vs = p.state_v_first ? K : 1;  // element (a, y) at a cs + y vs (state_v_first: [V, K])
  const int ksteps = (K + 15) / 16;
  const float* dht = p.dht ? p.dht : ws;  // a valid address for ldg_or0's dropped loads
  stage<32, kThreads>(
      kMaxD * kCols, [&](int e) { const int a = e >> 6, y = e & 63; return ldg_or0(dht, s0 + (a * cs + (y0 + y) * vs), a < K && y < nc && p.dht); },
      [&](int e, float x) { sdS[(e >> 6) * kLdS + (e & 63)] = x; });
  __syncthreads();
  const int first = p.chunk_start[n], last = p.chunk_start[n + 1];
  for (int slot = last - 1; slot >= first; --slot) {
    float* rec = ws_rec(ws, p, slot, h);
    const int t0 = p.seq_begin[n] + (slot - first) * kC, rows = min(kC, p.seq_end[n] - t0);
    for (int e = tid; e < K * kCols; e += kThreads) {
      const int a = e / kCols, y = e - a * kCols;
      if (y < nc) rec[p.ws.dh + a * V + y0 + y] = sdS[a * kLdS + y];
    }
    stage<16, kThreads>(
        kC * kCols, [&](int e) { const int i = e >> 6, y = e & 63; return load_or0(p.d_o, b, t0 + i, h, y0 + y, i < rows && y < nc); },
        [&](int e, float x) { sdO[(e >> 6) * kLdS + (e & 63)] = x; });
    if (tid < K) sGc[tid] = rec[p.ws.gc + tid];
    stage_record_tile<kThreads>(sX, rec + p.ws.kg, K);
    __syncthreads();
    {  // dVnew += Kg dS': warp rows 16 (w % 4) .., columns 32 (w / 4) ..
      const int m0 = 16 * (warp & 3), c0 = 32 * (warp >> 2);
      float c[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int i = m0 + g + 8 * (q >> 1), y = c0 + 8 * nt + 2 * t + (q & 1);
          c[nt][q] = y < nc ? rec[p.ws.dvn + i * V + y0 + y] : 0.f;
        }
#pragma unroll 2
      for (int ks = 0; ks < ksteps; ++ks) {
        uint32_t ahi[4], alo[4], bhi[4][2], blo[4][2];
        frag_a<true>(sX + m0 * kLd + 16 * ks, kLd, ahi, alo);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) frag_b<false>(sdS + 16 * ks * kLdS + c0 + 8 * nt, kLdS, bhi[nt], blo[nt]);
        mma_split<4>(c, ahi, alo, bhi, blo);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int i = m0 + g + 8 * (q >> 1), y = c0 + 8 * nt + 2 * t + (q & 1);
          if (y < nc) rec[p.ws.dvn + i * V + y0 + y] = c[nt][q];
          sdV[i * kLdS + y] = -c[nt][q];  // 0 at y >= nc (dS' and dVnew columns there are 0)
        }
    }
    __syncthreads();
    const int a0 = 16 * warp;
    // dS = Diag(2^gC) dS' + Qg^T dO + W^T (-dVnew): warp rows (channels) a0 .., all 64 columns.
    stage_record_tile<kThreads>(sX, rec + p.ws.qg, K);
    __syncthreads();
    if (a0 < K)
      decayed_state_step(sdS, kLdS, sGc, K, a0, [&](float (&c)[8][4], int ks) { state_term(c, sX, a0, ks, sdO, kLdS); });
    __syncthreads();
    stage_record_tile<kThreads>(sX, rec + p.ws.w, K);
    __syncthreads();
    if (a0 < K)
      decayed_state_step<false>(sdS, kLdS, sGc, K, a0, [&](float (&c)[8][4], int ks) { state_term(c, sX, a0, ks, sdV, kLdS); });
    __syncthreads();
  }
  if (p.dh0)
    for (int e = tid; e < K * kCols; e += kThreads) {
      const int a = e / kCols, y = e - a * kCols;
      if (y < nc) p.dh0[s0 + (a * cs + (y0 + y) * vs)] = sdS[a * kLdS + y];
    }
}

}  // namespace

Status launch_dh(const KdaBwdCudaProblem& p, float* ws, cudaStream_t s) {
  constexpr const char* what = "kda backward: dh kernel (kda_bwd_dh_tc_kernel)";
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem(what, kda_bwd_dh_tc_kernel, kSmemTc));
  return launch(what, [&] { kda_bwd_dh_tc_kernel<<<dim3(p.N, p.H, (p.V + kCols - 1) / kCols), kThreads, kSmemTc, s>>>(p, ws); });
}

}  // namespace encore::cuda::kdabwd
