// Host entry of the CUDA KDA backward (no CUDA types). The dispatch (src/kda/kda.cpp) has validated
// the problem and the forward's residuals; sequences travel as launch parameters (as the forward's),
// so the launches read no host memory, never allocate and never synchronize.
//
// Workspace: one fp32 record per (chunk slot, head), KdaBwdLayout below (offsets in floats, rows
// padded to 64 with zeros, head dims as given): Qg, Kg, W [64][K]; Vn (U, then Vnew) [64][V];
// dVn (Aqk^T dO, then + Kg dS') [64][V]; dAqk [64][64]; dh (dS', the chunk-END state cotangent)
// [K][V]; hs (the chunk-start state, rematerialize mode only) [K][V]; gC [K] (log2); the gate-gradient
// partials pdt (sum over the chunk's rows of d(raw gate)) and pdA (of the dA_log terms) [K]; acc, an
// accumulator tile [64][K] of kernel 3b (which also reuses Qg, Kg, W once kernel 3a is done with them);
// the tensor-core kernel 3b-1's products for kernel 3b: dw (-dVn S^T) [64][K], da (dVn v^T) [64][64],
// dbv (rowsum(A^T dVn . v)) [64], sd (rowsum(S . dS')) [K].
#pragma once
#include <cstddef>
#include <cstdint>

#include "kda/cuda/launch.hpp"

namespace encore::cuda {

struct KdaOutTensor {  // [B, T, H, C] (or [B, T, H], C = 1) output: element strides; bf16 or fp32
  void* data = nullptr;
  DType dtype = DType::kFP32;
  int64_t sb = 0, st = 0, sh = 0;
};

struct KdaBwdLayout {  // offsets in floats inside one (chunk slot, head) record; rec = its size
  int64_t qg = 0, kg = 0, w = 0, vn = 0, dvn = 0, daqk = 0, dh = 0, hs = 0, gc = 0, pdt = 0, pda = 0, acc = 0;
  int64_t dw = 0, da = 0, dbv = 0, sd = 0, rec = 0;
};
KdaBwdLayout kda_bwd_layout(int64_t K, int64_t V, bool remat);

struct KdaBwdCudaProblem {
  int B = 0, T = 0, H = 0, K = 0, V = 0, N = 0;  // H: value heads
  int group = 1;                                 // value heads per q/k head: q, k, dq, dk have H / group heads
  float scale = 1.0f;
  bool l2norm = false, gate_in_kernel = false, lower_bound_gate = false;
  float lower_bound = -5.0f;
  KdaTensor q, k, v, g, beta, d_o;
  const float* A_log = nullptr;    // [H] or null
  const float* dt_bias = nullptr;  // [H * K] or null
  const float* h0 = nullptr;       // [N, H, K, V] or null
  const float* dht = nullptr;      // [N, H, K, V] or null (zero cotangent)
  // The forward's residuals, contiguous: G fp32 [B, T, H, K]; Aqk, Akk [B, T, H, 64]; h [NT, H, K, V]
  // (null: rematerialize the chunk-start states).
  const float* G = nullptr;
  const void* Aqk = nullptr;
  const void* Akk = nullptr;
  const void* h = nullptr;
  DType aqk_dtype = DType::kFP32, akk_dtype = DType::kFP32, h_dtype = DType::kFP32;
  KdaOutTensor dq, dk, dv, dg, dbeta;
  float* dh0 = nullptr;       // [N, H, K, V] or null
  bool state_v_first = false;  // h0, dht, dh0 are [N, H, V, K] (fla's state_v_first; residuals h stays [.., K, V])
  float* dA_log = nullptr;    // [H] or null
  float* ddt_bias = nullptr;  // [H * K] or null
  KdaBwdLayout ws;
  bool varlen = false;
  int32_t seq_begin[kKdaMaxSeqs];
  int32_t seq_end[kKdaMaxSeqs];
  int32_t chunk_start[kKdaMaxSeqs + 1];
  int device = 0;
};

// tokens = B * T. With group > 1 the workspace also holds fp32 per-value-head partials of dq and dk
// ([B, T, H, K] each, after the records), summed over each group in head order by a last launch.
// The backward for large head dims (128 < K or V <= 256; kda_recurrent_bwd.cu): token-recurrent,
// fp32 on CUDA cores, residuals.h optional (absent: it rematerializes the chunk-start states), G, Aqk,
// Akk not read; one pass per window (the w-th chunk from the end of every sequence). Workspace in
// floats (16-byte aligned parts): ckpt, the chunk-start states [NT][H][K][V] (rematerialize only);
// carry, dS between windows [N][H][K][V]; slab, per persistent block (at most kKdaRecurrentMaxBlocks)
// the states of one chunk, slab_floats = 64 · ceil(K / 8) · 256; pq, pk, pg [rows][H][tiles][K] and
// pb [rows][H][tiles], the per-32-column-tile partials of dq̂, dk̂, dg, dβ of one window (tiles =
// ceil(V / 32), rows = window_rows = Σ_n min(64, len_n)); gdx [tokens][H][K], gda [tokens][H], the
// per-token ddt_bias and dA_log terms (gate_terms: the in-kernel gate only).
constexpr int kKdaRecurrentMaxBlocks = 512;
struct KdaRecBwdLayout {
  int64_t ckpt = 0, carry = 0, slab = 0, pq = 0, pk = 0, pg = 0, pb = 0, gdx = 0, gda = 0, floats = 0, slab_floats = 0;
  int blocks = 0;
};
KdaRecBwdLayout kda_recurrent_bwd_layout(int64_t chunks, int64_t N, int64_t H, int64_t K, int64_t V, bool remat, int64_t tokens,
                                         int64_t window_rows, bool gate_terms);
size_t kda_recurrent_backward_workspace_bytes(int64_t chunks, int64_t N, int64_t H, int64_t K, int64_t V, bool remat, int64_t tokens,
                                              int64_t window_rows, bool gate_terms);
Status launch_kda_recurrent_backward(const KdaBwdCudaProblem& p, void* workspace, Stream stream);

// The chunk-local cumulative gate G (fp32 [B, T, H, K] contiguous, the forward's residual) into G, for a
// backward whose forward did not save it (kda_bwd_gate_cumsum.cu).
Status launch_kda_gate_cumsum(const KdaBwdCudaProblem& p, float* G, int chunks, Stream stream);

size_t kda_backward_workspace_bytes(int64_t chunks, int64_t H, int64_t K, int64_t V, bool remat, int64_t tokens = 0, int64_t group = 1);
Status launch_kda_backward(const KdaBwdCudaProblem& p, void* workspace, Stream stream);

}  // namespace encore::cuda
