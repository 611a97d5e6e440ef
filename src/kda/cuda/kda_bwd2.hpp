// The second CUDA KDA backward (docs/kda.md, "The second backward"), stages K0 (chunk-parallel prep),
// K1 (the reverse state-cotangent scan) and K2 (fused, kda_bwd2_k2.cu; or split: K2a, the per-chunk
// products with the states, then K2b, the WY and intra-chunk gradients with the gate and L2-norm
// tails), for the saved-h path; run(KdaBackwardArgs)
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
// The fused K2 (Kda2K2::kFused, kda_bwd2_k2.cu: K2a's products and K2b in one block)
// keeps dqi, dki, dW, dAqk hi + lo, dA and sd on chip: its layout has none of them (offset 0, no
// bytes), except dqi, dki with grouped value heads (the fp32 per-value-head partials of dq, dk).
#pragma once
#include <cstddef>
#include <cstdint>

#include "kda/cuda/kda_bwd_launch.hpp"

namespace encore::cuda {

constexpr int kKda2D = 128;  // padded channel width of the intermediates (K, V <= 128)

// K2 as one fused kernel (16-bit q and k) or as K2a then K2b (the split path: any input dtype, its
// intermediates in the workspace for the stage tests; run's choice until the fused one is measured ahead).
// Declared with the plan (kda/plan.hpp: kda2_k2 is run's choice).
using Kda2K2 = ::encore::kda::Kda2K2;

struct Kda2Layout {  // byte offsets into the workspace, each 256-byte aligned; bytes = the total
  size_t qg = 0, kg = 0, wn = 0, dvl = 0, egc = 0, dsp = 0, dvn = 0, dw = 0, daqk = 0, daqk_lo = 0, da = 0, dqi = 0, dki = 0, sd = 0, gp = 0,
         bytes = 0;
};
// group: value heads per q/k head (the fused layout keeps dqi, dki for group > 1 only).
Kda2Layout kda2_layout(int64_t tokens, int64_t chunks, int64_t HV, Kda2K2 k2, int64_t group);

// K0 then K1 on `stream` for K, V <= 128 (refused otherwise); p.dh0 receives dh0 when set.
Status launch_kda2_prep_scan(const KdaBwdCudaProblem& p, const Kda2Layout& layout, void* workspace, int chunks, Stream stream);
// K2a after K0 and K1 (needs the saved chunk-start states p.h).
Status launch_kda2_state_grads(const KdaBwdCudaProblem& p, const Kda2Layout& layout, void* workspace, int chunks, Stream stream);
// K2b after K2a, then the gate and group reductions.
Status launch_kda2_wy(const KdaBwdCudaProblem& p, const Kda2Layout& layout, void* workspace, int chunks, Stream stream);
// The fused K2 after K0 and K1 (16-bit q and k; Status::unsupported otherwise), then the reductions.
Status launch_kda2_k2(const KdaBwdCudaProblem& p, const Kda2Layout& layout, void* workspace, int chunks, Stream stream);
// The closing reductions after K2b or the fused K2: dA_log, ddt_bias from gp; grouped dq, dk from dqi, dki.
Status launch_kda2_reductions(const KdaBwdCudaProblem& p, const Kda2Layout& layout, void* workspace, int chunks, Stream stream);
// The whole second backward (saved-h path): K0, K1, K2 (fused, or K2a then K2b) and the reductions, on
// the problem's device; `layout` from kda2_layout with the same k2.
Status launch_kda2_backward(const KdaBwdCudaProblem& p, const Kda2Layout& layout, void* workspace, int chunks, Stream stream,
                            Kda2K2 k2);

}  // namespace encore::cuda
