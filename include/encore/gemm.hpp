// encore GEMM-epilogue family: D = epilogue(A · Wᵀ), the memory-bound glue of a transformer block
// computed on the fp32 accumulator (docs/gemm.md). A [M, K], W [N, K] (weights stored out x in),
// acc = A · Wᵀ [M, N] in fp32; then one epilogue program from the catalogue
// encore/gemm_epilogues.def, which states each epilogue's math and the operands it reads.
//
// Finishers: rms_final_reduce (r from the sum-of-squares partials), lse_finish (per-row log-sum-exp
// and cross-entropy loss from the LSE partials), partials sums (zdz and dγ of the backward epilogues,
// PartialsSumArgs), the QK-norm + RoPE finish after kQkvHeadSqsum (QkNormRopeArgs; CPU and CUDA), and
// the elementwise RoPE backward with its zdz statistic (RopeBwdZdzArgs; CPU and CUDA).
// Statistics are fp32; D and aux take A's dtype (bf16, fp16, fp32). `partial_tile_n` fixes the column tiles of the partials so every backend
// produces the same layout [M, ceil(N / partial_tile_n)]; 0 (the default) means
// gemm_partial_tile_n(epilogue, M, N, K), the width of the fastest CUDA tile for the shape.
//
// Backends: the CPU reference (fp64 accumulation) for every epilogue and finisher. CUDA: every
// epilogue (on the tiles its catalogue row lists: kRmsnormBwd on the 128x128 ping-pong tile only), rms_final_reduce and lse_finish, on a CUTLASS Sm90 TMA + WGMMA warp-specialized persistent mainloop
// (src/gemm/cuda), with these limits (refused with a clear error otherwise):
//   bf16/fp16 A and W; D, aux, C and gamma in A's dtype; K a multiple of 8 (kWgrad, A stored [K, M]: M instead; rows with
//   W [K, N] take any K, or M, where A's rows are 16-byte aligned, e.g. dlogits [M, V] with V odd in padded rows), N too where D, C or aux is given (lse without D: any N; lse with D and ce_bwd: any N
//   with D's rows 16-byte aligned, e.g. N odd in a D view of rows padded to a multiple of 8: the TMA store writes
//   whole 16-byte units, so columns [N, round_up(N, 8)) of every row, the last one included, are scratch
//   and must be allocated, as in torch.empty(M, round_up(N, 8))[:, :N]); 16-byte aligned
//   matrix rows (SwiGLU aux: 8-byte); contiguous vectors; partial_tile_n 128 or 256 (kResidualSqsumAux, kLse, kSwigluBwd, kCeBwd; 128 for the others) and
//   head_dim = 128 (kQkvHeadSqsum). Tails in M and N are masked. kRope positions must lie in
//   [0, 2^24). kLse targets are device data and cannot be checked before the launch: a target
//   outside [0, N) other than ignore_index yields target_logit = NaN (the CPU backend refuses it); kCeBwd
//   writes such a row NaN.
#pragma once
#include <cstddef>
#include <cstdint>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore {

// One value per row of encore/gemm_epilogues.def, in row order.
enum class Epilogue : uint8_t {
#define ENCORE_GEMM_EPILOGUE(Name, name, operands, tiles) k##Name,
#include "encore/gemm_epilogues.def"
#undef ENCORE_GEMM_EPILOGUE
};
const char* epilogue_name(Epilogue e);  // the row's snake_case name, "unknown" outside the catalogue

// The operands an epilogue reads or writes (GemmEpilogueInfo::operands); a and w always. Every
// operand an epilogue does not use must be absent (validate refuses it).
enum GemmOperand : uint32_t {
  kOperandD = 1u << 0,                 // d [M, N], written
  kOperandDOptional = 1u << 1,         // d [M, N], written when given
  kOperandAux = 1u << 2,               // aux [M, N], written
  kOperandAuxHalf = 1u << 3,           // aux [M, N / 2], written
  kOperandC = 1u << 4,                 // c [M, N], read
  kOperandGamma = 1u << 5,             // gamma [N]
  kOperandRowScale = 1u << 6,          // row_scale [M] fp32, required
  kOperandRowScaleOptional = 1u << 7,  // row_scale [M] fp32, optional (absent: 1)
  kOperandPos = 1u << 8,               // pos [M] int32
  kOperandFreq = 1u << 9,              // freq [N] fp32 (hi, lo) pairs
  kOperandAlpha = 1u << 10,            // alpha [1] fp32
  kOperandTilePartials = 1u << 11,     // partials [M, ceil(N / partial_tile_n)] fp32, written
  kOperandHeadPartials = 1u << 12,     // partials [M, N / head_dim] fp32, written
  kOperandTarget = 1u << 13,           // target [M] int32 and target_logit [M] fp32, optional together
  kOperandColumnPairs = 1u << 14,      // N even: columns (2j, 2j+1) form pairs
  kOperandWeightKN = 1u << 15,         // w is [K, N] (N contiguous), used un-transposed: acc = A · W (a dgrad
                                       //   through a forward weight [N_fwd, d] stored out x in)
  kOperandCPairs = 1u << 16,           // c [M, 2N], read as (c[m, 2n], c[m, 2n+1]) pairs (the saved SwiGLU Z)
  kOperandAuxDouble = 1u << 17,        // aux [M, 2N], written as (2n, 2n+1) pairs (dZ, packed like Z)
  kOperandC2Optional = 1u << 18,       // c2 [M, N], a second tile input, read when given (absent: 0)
  kOperandZdz = 1u << 19,              // zdz [M] fp32, required
  kOperandAlphaOptional = 1u << 20,    // alpha [1] fp32, optional (absent: 1)
  kOperandColumnPartials = 1u << 21,   // partials [ceil(M / 128), round_up(N, partial_tile_n)] fp32, written:
                                       //   per-M-tile column sums (block reduction along M); columns >= N are 0
  kOperandLse = 1u << 22,              // lse [M] fp32 and target [M] int32, required together (kCeBwd; ignore_index rows: D = 0)
  kOperandTilePartialsOptional = 1u << 23,  // partials [M, ceil(N / partial_tile_n)] fp32, written when given (kCeBwd:
                                            //   Σ_tile z·D, the zdz of the norm before the LM head)
  // (bit 28, apart from the bits above, which other rows' flags extend)
  kOperandATransposed = 1u << 28,      // a is [K, M] (M contiguous), used transposed: acc = Aᵀ-stored · W (the weight
                                       //   gradients dW = dzᵀ·x over the tokens: a = dz [tokens, N_out] as stored); M a
                                       //   multiple of 8 on CUDA (16-byte TMA rows)
};

// The CUDA tiles an epilogue is instantiated on (GemmEpilogueInfo::tiles).
// kTileNone: a row with the CPU reference only (its CUDA program not instantiated yet).
enum GemmTileSet : uint8_t { kTileNone = 0, kTileCoop256 = 1u << 0, kTilePp128 = 1u << 1, kTilePp64 = 1u << 2 };

struct GemmEpilogueInfo {
  Epilogue epilogue;
  const char* name;
  uint32_t operands;  // GemmOperand flags
  uint8_t tiles;      // GemmTileSet flags
};
// The catalogue, in row order: gemm_epilogue_count() rows; gemm_epilogue_info(e) is null for a
// value outside it.
int gemm_epilogue_count();
const GemmEpilogueInfo* gemm_epilogue_info(Epilogue e);

// CUDA tile configuration: cooperative 128x256x64 (two warpgroups share each tile) or ping-pong
// 128x128x64 (a warpgroup's epilogue overlaps the other's mainloop); kAuto picks by epilogue and
// shape (docs/gemm.md). For kResidualSqsumAux, kLse, kSwigluBwd and kCeBwd the partials' column tile
// is the tile N, so partial_tile_n picks the tile (256: cooperative, 128: ping-pong); kQkvHeadSqsum writes
// one partial per head on either tile. Ignored by the CPU backend.
// kPingpong64x256 (ping-pong with 64x256 tiles: the epilogue overlap of ping-pong with the wide
// tile's operand reuse) exists for row_scale, swiglu, residual_sqsum_aux and lse (partials per 256
// columns); it is chosen explicitly only, while its measurements decide on kAuto.
enum class GemmTile : uint8_t { kAuto, kCooperative128x256, kPingpong128x128, kPingpong64x256 };
const char* gemm_tile_name(GemmTile t);

// CUDA persistent tile scheduler order: kAlongM walks down the M tiles of one column of tiles (the W
// panel stays in L2) before moving along N, kAlongN the other way. kAuto: along N on the
// cooperative and 128x128 ping-pong tiles (measured faster on the widest GEMMs, docs/gemm.md),
// CUTLASS's heuristic on 64x256 (along M when there are more N tiles than M tiles). With swizzle s
// the walk covers s tiles of the other dimension at a time. Ignored by the CPU backend.
enum class GemmRaster : uint8_t { kAuto, kAlongM, kAlongN };

// The partials' column tile that partial_tile_n = 0 stands for: 128 (the ping-pong tile, measured
// fastest for both partials epilogues) for the epilogues with tile or column partials, 256 for
// kResidualSqsumAux at K >= 12288 and for kSwigluBwd at K >= 8192; 0 for the other epilogues. Size tile partials [M, ceil(N / it)],
// column partials [gemm_column_partials_rows(M), round_up(N, it)].
int gemm_partial_tile_n(Epilogue e, int64_t M, int64_t N, int64_t K);
// Rows of column partials (kOperandColumnPartials): one per 128 rows of A (the CUDA tile M).
constexpr int64_t kColumnPartialsTileM = 128;
inline int64_t gemm_column_partials_rows(int64_t M) { return (M + kColumnPartialsTileM - 1) / kColumnPartialsTileM; }

struct GemmEpilogueOptions {
  Epilogue epilogue = Epilogue::kRowScale;
  int partial_tile_n = 0;    // epilogues with partials: 0 = gemm_partial_tile_n(...); CUDA: 128 or 256

  int head_dim = 128;        // kQkvHeadSqsum
  int ignore_index = -100;   // kLse with target: rows whose target equals it get target_logit 0; kCeBwd: D = 0 there
  GemmTile tile = GemmTile::kAuto;
  int swizzle = 0;  // CUDA tile-scheduler swizzle (1, 2, 4 or 8 tiles); 0 = auto
  GemmRaster raster = GemmRaster::kAuto;  // CUDA tile-scheduler order
  // CUDA: launches over that many consecutive N-slices of whole tiles (1 = one launch); 0 = auto:
  // one launch unless a persistent CTA would walk more than 200 tiles, else slices of at most ~165
  // tiles per CTA (not on kPingpong64x256, whose raster order follows each launch's shape). The
  // static persistent schedule lets CTAs drift apart over a long walk and lose the weight tiles
  // they share in L2 (the LM head read 19.5 GB from DRAM in one launch, 7.8 GB in six;
  // docs/gemm.md). Bitwise the same results for any value. Ignored by the CPU backend.
  int n_slices = 0;
};

struct GemmEpilogueArgs {
  TensorView a;             // [M, K] ([K, M] for kOperandATransposed rows)
  TensorView w;             // [N, K] ([K, N] for kOperandWeightKN rows)
  TensorView d;             // [M, N] (optional for kLse)
  TensorView aux;           // [M, N] (kResidualSqsumAux) or [M, N/2] (kSwiglu)
  TensorView c;             // [M, N] tile input (kResidualSqsumAux: residual; kRmsnormBwd: saved x) or [M, 2N] pairs (kSwigluBwd: Z)
  TensorView c2;            // [M, N] second tile input (kRmsnormBwd: the incoming residual gradient, optional)
  TensorView zdz;           // [M] fp32 (kRmsnormBwd: (1/d)·Σ_j z·dz of the consumer GEMM's output)
  TensorView gamma;         // [N] (kResidualSqsumAux)
  TensorView row_scale;     // [M] fp32 r (kRowScale; optional for kSwiglu, kRope, kLse)
  TensorView pos;           // [M] int32 positions (kRope)
  TensorView freq;          // [N] fp32: frequency of pair j in turns per position as hi + lo = freq[2j] + freq[2j+1]
  TensorView alpha;         // [1] fp32 (kScalarScale)
  TensorView partials;      // fp32 [M, tiles] (tile partials), [M, N / head_dim] (kQkvHeadSqsum) or
                            // [ceil(M / 128), round_up(N, partial_tile_n)] (column partials, kRmsnormBwd)
  TensorView target;        // [M] int32 (kLse, optional; kCeBwd, required)
  TensorView target_logit;  // [M] fp32 (kLse with target)
  TensorView lse;           // [M] fp32 (kCeBwd: the forward's log-sum-exp, lse_finish)
};

Status validate(const GemmEpilogueArgs& args, const GemmEpilogueOptions& opts);
size_t workspace_bytes(const GemmEpilogueArgs& args, const GemmEpilogueOptions& opts);
Status run(const GemmEpilogueArgs& args, const GemmEpilogueOptions& opts, void* workspace = nullptr, Stream stream = nullptr);

// r[m] = rsqrt(Σ_t partials[m, t] / hidden + eps), summed in tile order (deterministic).
struct RmsFinalReduceArgs {
  TensorView partials;  // [M, tiles] fp32
  TensorView r;         // [M] fp32, output
};
Status run(const RmsFinalReduceArgs& args, int64_t hidden, float eps, Stream stream = nullptr);

// lse[m] = log Σ_t exp(partials[m, t]); with target: loss[m] = lse[m] − target_logit[m] (0 when
// target[m] == ignore_index).
struct LseFinishArgs {
  TensorView partials;      // [M, tiles] fp32
  TensorView lse;           // [M] fp32, output
  TensorView target;        // [M] int32 (optional)
  TensorView target_logit;  // [M] fp32 (with target)
  TensorView loss;          // [M] fp32, output (with target)
};
Status run(const LseFinishArgs& args, int ignore_index = -100, Stream stream = nullptr);

// The mean cross-entropy over the rows that count and its backward scale, as device scalars (graph-safe:
// the count n = #{m : target[m] != ignore_index} is device data):
//   loss[0] = Σ_{counted m} loss_rows[m] / n,   alpha[0] = d_loss[0] / n   (both 0 when n = 0: no NaN)
// loss needs loss_rows (lse_finish's per-row loss), alpha needs d_loss; either pair may be absent. One CTA,
// fixed-order sums (deterministic). CPU and CUDA backends.
struct CeMeanArgs {
  TensorView target;     // [M] int32
  TensorView loss_rows;  // [M] fp32 (with loss)
  TensorView loss;       // [1] fp32, output (optional)
  TensorView d_loss;     // [1] fp32 (with alpha): the gradient of the mean loss
  TensorView alpha;      // [1] fp32, output (optional): d_loss / n, the α of kCeBwd
};
Status run(const CeMeanArgs& args, int ignore_index = -100, Stream stream = nullptr);

// Cross-entropy backward on stored logits (the path that keeps the forward's kLse D;
// docs/math/gemm_epilogues.md §4.5), elementwise:
//   dlogits[m, n] = α·(e^(logits[m, n] − lse[m]) − [n == target[m]]),
// 0 on rows whose target == ignore_index; α = alpha[0] read from (device) memory, 1 when
// absent (e.g. grad_output / count: graph-safe). logits and dlogits [M, N] of one dtype (bf16/fp16; fp32
// on the CPU backend), any N and row strides; dlogits may be logits itself (in place) but must not
// overlap it otherwise. The CPU backend refuses a target outside [0, N) other than ignore_index; on CUDA
// (device data, not checkable before the launch) such a row is written NaN. CPU and CUDA backends.
struct CrossEntropyBwdArgs {
  TensorView logits;   // [M, N], read
  TensorView lse;      // [M] fp32
  TensorView target;   // [M] int32
  TensorView alpha;    // [1] fp32, optional
  TensorView dlogits;  // [M, N] logits' dtype, written (may be logits)
};
Status run(const CrossEntropyBwdArgs& args, int ignore_index = -100, Stream stream = nullptr);

// QK-norm + RoPE finish after kQkvHeadSqsum (models with QK-norm), in place on
// qkv [M, (num_q_heads + 2 * num_kv_heads) * head_dim] (head order Q, K, V):
//   each Q / K head h of row m:  x ← x · rsqrt(partials[m, h] / head_dim + eps) · w  (w = q_weight for
//   Q heads, k_weight for K heads), then the RoPE of kRope over its column pairs with pos[m] and freq
//   (rope_freq_turns layout over all N columns); V heads are untouched. partials: the kQkvHeadSqsum
//   output [M, heads] (only the Q and K heads are read). CPU and CUDA backends.
struct QkNormRopeArgs {
  TensorView qkv;       // [M, N] bf16 / fp16 / fp32, in place
  TensorView partials;  // [M, N / head_dim] fp32
  TensorView q_weight;  // [head_dim], qkv's dtype or fp32
  TensorView k_weight;  // [head_dim]
  TensorView pos;       // [M] int32
  TensorView freq;      // [N] fp32
};
struct QkNormRopeOptions {
  int num_q_heads = 0, num_kv_heads = 0, head_dim = 128;
  float eps = 1e-6f;
};
Status run(const QkNormRopeArgs& args, const QkNormRopeOptions& opts, Stream stream = nullptr);

// Backward of the QK-norm + RoPE finish (training, models with QK-norm): x is the forward's input qkv
// (the kQkvHeadSqsum GEMM's output, saved before the in-place finish), dy the gradient of its output.
// Per Q / K head h of row m, with r = rsqrt(partials[m, h] / D + eps), w = q_weight or k_weight:
//   dn = Rᵀ·dy per column pair (the inverse rotation);  dx = r·(w⊙dn) − r³·x·(1/D)·Σ_e w_e·dn_e·x_e;
//   dq_weight[e] = Σ_{m, Q heads} dn_e·r·x_e (dk_weight over the K heads), summed in a fixed order;
// V heads: dx = dy. dx may be dy (in place). dq_weight, dk_weight: fp32 [head_dim], outputs.
// CPU and CUDA backends; CUDA: workspace_bytes of device memory (the weight gradients' partials).
struct QkNormRopeBwdArgs {
  TensorView dy;                    // [M, N] qkv's dtype
  TensorView x;                     // [M, N] the forward's input (pre-norm qkv)
  TensorView partials;              // [M, N / head_dim] fp32: the forward's kQkvHeadSqsum partials
  TensorView q_weight, k_weight;    // [head_dim], as in the forward
  TensorView pos;                   // [M] int32
  TensorView freq;                  // [N] fp32
  TensorView dx;                    // [M, N] output (may alias dy)
  TensorView dq_weight, dk_weight;  // [head_dim] fp32 outputs
};
size_t workspace_bytes(const QkNormRopeBwdArgs& args, const QkNormRopeOptions& opts);
Status run(const QkNormRopeBwdArgs& args, const QkNormRopeOptions& opts, void* workspace = nullptr, Stream stream = nullptr);

// RoPE backward with the zdz row statistic (docs/math/gemm_epilogues.md §4.3; stage (a) of the LLaMA
// block backward), elementwise (not a GEMM). With y = the forward's kRope output (post-RoPE, saved) and
// dy its gradient:
//   dz[m, 2j], dz[m, 2j+1] = Rᵀ(θ)·(dy[m, 2j], dy[m, 2j+1]):  (a·cosθ + b·sinθ, b·cosθ − a·sinθ),
//                            θ = 2π·pos[m]·f_j, f_j = freq[2j] + freq[2j+1] (rope_freq_turns; f = 0 passes through)
//   zdz[m] = scale · Σ_j y[m, j]·dy[m, j]   (= scale · Σ_j z·dz for the pre-RoPE z: R is orthogonal)
// zdz feeds kRmsnormBwd (scale = 1/hidden). y, dy, dz [M, N] in one dtype (bf16/fp16; fp32 on the CPU
// backend), N even; dz must not overlap y or dy; zdz [M] fp32. CPU and CUDA backends (the CUDA kernel
// reduces each row in a fixed order: deterministic).
struct RopeBwdZdzArgs {
  TensorView y;     // [M, N] saved post-RoPE output
  TensorView dy;    // [M, N] its gradient
  TensorView pos;   // [M] int32
  TensorView freq;  // [N] fp32 (hi, lo) pairs
  TensorView dz;    // [M, N] output: the gradient before the rotation
  TensorView zdz;   // [M] fp32 output
};
Status run(const RopeBwdZdzArgs& args, float scale, Stream stream = nullptr);

// Deterministic sums of an epilogue's partials, in index order:
//   kPerRow     out[m] = scale · Σ_t partials[m, t]  (zdz = (1/d)·Σ_t of kSwigluBwd's tile partials)
//   kPerColumn  out[n] = scale · Σ_t partials[t, n]  (dγ from kRmsnormBwd's column partials; out may be
//               narrower than the partials: out [N] of partials [tiles, round_up(N, tile)])
enum class PartialsSum : uint8_t { kPerRow, kPerColumn };
struct PartialsSumArgs {
  TensorView partials;  // fp32 [rows, cols]
  TensorView out;       // fp32 [rows] (kPerRow) or [n <= cols] (kPerColumn)
};
Status run(const PartialsSumArgs& args, PartialsSum axis, float scale = 1.0f, Stream stream = nullptr);

// out[2j] = gate[j], out[2j+1] = up[j] (rows of [F, K] weights; out [2F, K]); CPU tensors.
Status interleave_gate_up(const TensorView& gate, const TensorView& up, const TensorView& out);

// RoPE frequencies for kRope over N = num_heads * head_dim columns whose first `rotary_heads`
// heads rotate (Q and K, rotate-half partners permuted to adjacent columns) and the rest (V) do
// not: pair j of a rotary head, i = j mod (head_dim/2), turns f_i = base^(−2i/head_dim) / 2π,
// stored as an fp32 (hi, lo) pair. freq: [N] fp32, CPU tensor.
Status rope_freq_turns(int num_heads, int rotary_heads, int head_dim, double base, const TensorView& freq);

}  // namespace encore
