// The second CUDA KDA backward (docs/kda.md, "The second backward"), stages K0 (chunk-parallel prep),
// K1 (the reverse state-cotangent scan), K2a (the per-chunk products with the states) and K2b (the WY
// and intra-chunk gradients with the gate and L2-norm tails), for the saved-h path; run(KdaBackwardArgs)
// takes it for bf16 / fp16 inputs (kda_backward_kernels, kda/plan.cpp). Host entry, no CUDA types.
//
// Intermediates, bf16 unless said, in the caller's workspace (Kda2Layout), channel dimension padded
// to kKda2D = 128 with zeros; tokens = B * T (token index b * T + t), HV value heads, NT chunk slots:
//   qg  [tokens][HV][128]  Qg = scale q^ . 2^G          (q^: q after the optional L2 norm)
//   kg  [tokens][HV][128]  Kg = k^ . 2^(gC - G)
//   wn  [tokens][HV][128]  -W = -A (beta k^ . 2^G)       (A = (I + L)^-1, the forward's Akk)
//   dvl [tokens][HV][128]  Aqk^T dO                     (the intra-chunk part of dVnew)
//   egc [NT][HV][128]      fp32 2^gC                    (gC: G at the chunk's last valid row)
//   dsp [NT][HV][128][128] dS' per chunk, [K][V]        (the cotangent of the chunk's END state)
//   dvn [tokens][HV][128]  dVnew = Aqk^T dO + Kg dS'    (rounded to bf16, as the scan used it)
// K2a (the state products, kda_bwd2_grad.cu), with Vnew = A (beta v) + (-W) S recomputed in shared memory:
//   dqi [tokens][HV][128]  fp32 scale (dO S^T) . 2^G     (dq's inter-chunk part)
//   dki [tokens][HV][128]  fp32 (Vnew dS'^T) . 2^(gC - G) (dk's inter-chunk part)
//   dw  [tokens][HV][128]  dW = -dVnew S^T
//   daqk, daqk_lo [tokens][HV][64]  dAqk = tril(dO Vnew^T) as a bf16 hi + lo pair (Vnew too, in K2a's
//                          shared memory: rounded to bf16 alone, the two moved dA_log by up to 4e-2)
//   da  [tokens][HV][64]   dA = dVnew (beta v)^T + dW Kbeta^T, i >= j
//   sd  [NT][HV][128]      fp32 rowsum_V(S . dS')       (the chunk's last-row dG term, times 2^gC)
// K2b (the WY and intra-chunk gradients and the tails, kda_bwd2_wy.cu): dq, dk, dv, dg, dbeta into the
// problem's outputs (grouped value heads: dq, dk per value head over dqi, dki, then summed), and
//   gp  [NT][HV][2][128]   fp32 per-chunk partials of ddt_bias and dA_log (summed per head last)
// and dh0 [N, HV, K, V] fp32 into the problem's dh0 (when given). G, Aqk, Akk come from the
// forward's residuals (required); rows past a sequence's end are never written.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kda/cuda/kda_bwd_launch.hpp"

namespace encore::cuda {

constexpr int kKda2D = 128;  // padded channel width of the intermediates (K, V <= 128)

struct Kda2Layout {  // byte offsets into the workspace, each 256-byte aligned; bytes = the total
  size_t qg = 0, kg = 0, wn = 0, dvl = 0, egc = 0, dsp = 0, dvn = 0, dw = 0, daqk = 0, daqk_lo = 0, da = 0, dqi = 0, dki = 0, sd = 0, gp = 0,
         bytes = 0;
};
Kda2Layout kda2_layout(int64_t tokens, int64_t chunks, int64_t HV);

// K0 then K1 on `stream` for K, V <= 128 (refused otherwise); p.dh0 receives dh0 when set.
Status launch_kda2_prep_scan(const KdaBwdCudaProblem& p, const Kda2Layout& layout, void* workspace, int chunks, Stream stream);
// K2a after K0 and K1 (needs the saved chunk-start states p.h).
Status launch_kda2_state_grads(const KdaBwdCudaProblem& p, const Kda2Layout& layout, void* workspace, int chunks, Stream stream);
// K2b after K2a, then the gate and group reductions.
Status launch_kda2_wy(const KdaBwdCudaProblem& p, const Kda2Layout& layout, void* workspace, int chunks, Stream stream);
// The whole second backward (saved-h path): K0, K1, K2a, K2b and the reductions, on the problem's device.
Status launch_kda2_backward(const KdaBwdCudaProblem& p, const Kda2Layout& layout, void* workspace, int chunks, Stream stream);

}  // namespace encore::cuda
