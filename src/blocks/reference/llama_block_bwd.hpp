// CPU reference (fp64) of the shifted LLaMA block's BACKWARD, stage by stage as the fused schedule of
// docs/math/gemm_epilogues.md §5 computes it, so that each future dgrad-epilogue kernel can be
// tested against its own stage. The forward is encore/blocks/llama.hpp:
//   x1 = y0·w0ᵀ + x0;  r1 = rsqrt(mean(x1²) + eps);  z1 = (r1·x1 ⊙ γ0)·w1ᵀ [M, 2F] (gate 2j, up 2j+1)
//   y1 = silu(z1[:, 2j])·z1[:, 2j+1] [M, F];  x2 = y1·w2ᵀ + x1;  r2;  qkv = RoPE((r2·x2 ⊙ γ1)·w3ᵀ)
// with RoPE per column pair (a, b) -> (a·c − b·s, b·c + a·s), θ = 2π·frac(pos[m]·(freq[2j] + freq[2j+1])).
// Shapes: y0, x0, x1, x2 [M, d]; w0 [d, d]; w1 [2F, d]; w2 [d, F]; w3 [N, d]; γ0, γ1 [d]; qkv [M, N];
// r1, r2 [M]; pos [M]; freq [N]. Incoming gradients: d_qkv [M, N] (attention of layer l+1) and d_x2
// [M, d] (the residual gradient from block l+1). x̂ = r·x, zdz[m] = (1/d)·Σ_j z[m,j]·dz[m,j].
//
//   (a) rope_bwd_zdz:      dz2 = Rᵀ·d_qkv per pair;  zdz2 = (1/d)·Σ_j qkv·d_qkv  (post-RoPE, R orthogonal)
//       gemm_rmsnorm_bwd:  da2 = dz2·w3;  dx = d_x2 + r2·(γ1⊙da2 − x̂2·zdz2)  (gradient at x2)
//                          aux = x̂2⊙γ1;  dγ1 partials P[t, n] = Σ_{m∈tile t} da2·x̂2;  dw3 = dz2ᵀ·aux
//   (b) gemm_swiglu_bwd_zdz: dy1 = dx·w2 [M, F];  s = σ(g), dg = dy1·u·s·(1 + g(1 − s)), du = dy1·g·s
//                          dz1 = (dg, du) pairs [M, 2F];  y1 = g·s·u recomputed;
//                          zdz1 partials = (1/d)·Σ_{j∈tile} (g·dg + u·du);  dw2 = dxᵀ·y1
//   (c) gemm_rmsnorm_bwd:  da1 = dz1·w1;  dx1 = dx + r1·(γ0⊙da1 − x̂1·zdz1);  aux = x̂1⊙γ0;  dγ0;  dw1 = dz1ᵀ·aux
//   (d) plain GEMMs:       d_y0 = dx1·w0;  dw0 = dx1ᵀ·y0;  d_x0 = dx1 (the residual passes through)
//
// First layer (docs/math/gemm_epilogues.md §5): qkv = RoPE(rmsnorm(x)·γ @ w3) alone; its backward is
// stage (a) with the residual gradient of the first block as dX_prev (qkv_norm_backward). Last layer +
// loss: steps 1-3, then logits = (r2·x2 ⊙ γf)·W_lmᵀ [M, V], lse, mean cross-entropy over the rows whose
// target is not ignore_index: dℓ = softmax − onehot (unscaled, 0 on ignored rows), dloss = 1/count (0
// when every row is ignored: loss 0, no NaN), then gemm_rmsnorm_bwd(A = dℓ, W_lm, γf, x2, r2, α = dloss,
// zdz = dloss·Σ_n ℓ·dℓ / d), dW_lm = dloss·dℓᵀ·(x̂2⊙γf), and stages (b)-(d).
// Internal (no public API yet): the fused kernels' tests read these stages.
#pragma once
#include <cstdint>
#include <vector>

#include "encore/blocks/llama.hpp"

namespace encore::reference {

using Mat = std::vector<double>;  // row-major

// The schedule's GEMMs on fp64 row-major matrices (weights [N, K], out × in).
Mat matmul_nt(const Mat& a, int64_t M, int64_t K, const Mat& w, int64_t N);  // a[M,K]·w[N,K]ᵀ -> [M,N] (forward)
Mat matmul_nn(const Mat& a, int64_t M, int64_t N, const Mat& w, int64_t K);  // a[M,N]·w[N,K]  -> [M,K] (dgrad)
Mat matmul_tn(const Mat& a, int64_t M, int64_t N, const Mat& b, int64_t K);  // a[M,N]ᵀ·b[M,K] -> [N,K] (wgrad)
// The forward's rotation of pair j at position pos: cos θ, sin θ (freq = the [N] (hi, lo) table).
void rope_cos_sin(int64_t pos, const Mat& freq, int64_t j, double* c, double* s);

struct LlamaBlockDims {
  int64_t M = 0, d = 0, F = 0, N = 0;  // tokens, hidden, FFN width, QKV width
};

// The forward's inputs and saved tensors in fp64.
struct LlamaBlockBwdInputs {
  LlamaBlockDims dims;
  Mat y0, x0, w0, w1, w2, w3, gamma0, gamma1, freq;
  std::vector<int64_t> pos;
  Mat x1, x2, z1, qkv, r1, r2;  // saved by llama_block_forward
};
// Reads a forward's inputs and outputs (any float dtype, any strides, CPU tensors) into fp64.
LlamaBlockBwdInputs load_block_bwd_inputs(const LlamaBlockArgs& a);

struct LlamaBlockBwdOptions {
  int64_t dgamma_tile_m = 128;  // rows per dγ partial (the dgrad kernel's M tile)
  int64_t zdz_tile_n = 128;     // columns of dy1 (of F) per zdz1 partial; the reference's own layout (zdz1, their
                                //   sum, does not depend on it; the CUDA block takes gemm_partial_tile_n)
};

// rope_bwd_zdz (§4.3).
struct RopeBwd {
  Mat dz;   // [M, N] Rᵀ·dy per pair (pairs with frequency 0 pass through)
  Mat zdz;  // [M] scale·Σ_j y·dy over the post-RoPE saved y
};
RopeBwd rope_bwd_zdz(const Mat& y, const Mat& dy, int64_t M, int64_t N, const std::vector<int64_t>& pos, const Mat& freq, double scale);

// gemm_rmsnorm_bwd (§4.1) over dz [M, N] and the consumer's weight w [N, d].
struct RmsNormDgrad {
  Mat da;               // [M, d] α·dz·w
  Mat dx;               // [M, d] dX_prev + r·(γ⊙da − x̂·zdz)
  Mat aux;              // [M, d] x̂⊙γ
  Mat dgamma_partials;  // [ceil(M / tile_m), d] Σ_{m∈tile} da·x̂
  Mat dgamma;           // [d] Σ_t partials (in t order)
};
// dx_prev empty: no residual gradient accumulated.
RmsNormDgrad rmsnorm_dgrad(const Mat& dz, int64_t M, int64_t N, const Mat& w, int64_t d, double alpha, const Mat& x, const Mat& r,
                           const Mat& gamma, const Mat& zdz, const Mat& dx_prev, int64_t tile_m);

// gemm_swiglu_bwd_zdz (§4.2) over dx [M, d], w2 [d, F], z [M, 2F].
struct SwigluDgrad {
  Mat dy;           // [M, F] the accumulator dx·w2 (gradient of the SwiGLU output)
  Mat dz;           // [M, 2F] (dg, du) pairs, packed like z
  Mat y;            // [M, F] SwiGLU output recomputed (the down-proj wgrad's operand)
  Mat zdz_partials; // [M, ceil(F / tile_n)] scale·Σ_{j∈tile} (g·dg + u·du)
  Mat zdz;          // [M] Σ_t partials (in t order)
};
SwigluDgrad swiglu_dgrad(const Mat& dx, int64_t M, int64_t d, const Mat& w2, int64_t F, const Mat& z, double scale, int64_t tile_n);

// Stage (a), and the whole first-layer backward: RoPE backward then the norm's dgrad into x, dw3.
struct QkvNormBwd {
  RopeBwd rope;
  RmsNormDgrad norm;  // norm.dx: gradient at x (dX_prev included), norm.dgamma: dγ
  Mat dw3;            // [N, d] dz2ᵀ·aux
};
QkvNormBwd qkv_norm_backward(const Mat& x, const Mat& r, const Mat& gamma, const Mat& w3, const Mat& qkv, const Mat& d_qkv,
                             const std::vector<int64_t>& pos, const Mat& freq, const Mat& dx_prev, int64_t M, int64_t d, int64_t N,
                             int64_t tile_m);

// Stages (b)-(d), from the gradient at x2 (dx2) down to the block's inputs.
struct FfnOprojBwd {
  SwigluDgrad swiglu;  // (b)
  Mat dw2;             // [d, F] dxᵀ·y1
  RmsNormDgrad norm1;  // (c) norm1.dx: gradient at x1, norm1.dgamma: dγ0
  Mat dw1;             // [2F, d] dz1ᵀ·(x̂1⊙γ0)
  Mat d_y0, d_x0;      // (d) [M, d]
  Mat dw0;             // [d, d] dx1ᵀ·y0
};
FfnOprojBwd ffn_oproj_backward(const LlamaBlockBwdInputs& in, const Mat& dx2, const LlamaBlockBwdOptions& o);

// The whole shifted-block backward: stage (a) with d_x2 as dX_prev, then (b)-(d).
struct LlamaBlockBwd {
  QkvNormBwd qkv;   // (a): qkv.norm.dgamma = dγ1, qkv.dw3 = dW3
  FfnOprojBwd ffn;  // (b)-(d): d_y0, d_x0, dW0, dW1, dW2, dγ0
};
LlamaBlockBwd llama_block_backward(const LlamaBlockBwdInputs& in, const Mat& d_qkv, const Mat& d_x2, const LlamaBlockBwdOptions& o = {});

// Cross-entropy backward (§4.5) from the logits and their lse (a real kernel overwrites the logits).
struct CrossEntropyBwd {
  Mat loss_rows;      // [M] lse − ℓ[target] (0 on ignored rows)
  double loss = 0;    // mean over the counted rows (0 when none)
  int64_t count = 0;  // rows whose target is not ignore_index
  double dloss = 0;   // 1/count (0 when none)
  Mat dlogits;        // [M, V] softmax − onehot, unscaled (0 on ignored rows)
  Mat zdz_rows;       // [M] Σ_n ℓ·dℓ (unscaled)
};
CrossEntropyBwd cross_entropy_backward(const Mat& logits, const Mat& lse, int64_t M, int64_t V, const std::vector<int64_t>& target,
                                       int64_t ignore_index);

// Last layer + loss: `in` as for a block (its x2, r2 feed the final norm; w3, gamma1, qkv, freq, pos
// are not read), then the head.
struct LlamaHeadInputs {
  int64_t V = 0;
  Mat w_lm, gamma_final;  // [V, d], [d]
  Mat logits, lse;        // [M, V] (r2·x2 ⊙ γf)·W_lmᵀ, [M]
  std::vector<int64_t> target;
  int64_t ignore_index = -100;
};
struct LlamaLastLayerBwd {
  CrossEntropyBwd ce;
  RmsNormDgrad norm;  // α = dloss; norm.dx: gradient at x2, norm.dgamma: dγf
  Mat dw_lm;          // [V, d] dloss·dℓᵀ·(x̂2⊙γf)
  FfnOprojBwd ffn;
};
LlamaLastLayerBwd llama_last_layer_backward(const LlamaBlockBwdInputs& in, const LlamaHeadInputs& head, const LlamaBlockBwdOptions& o = {});

}  // namespace encore::reference
