// KDA backward for large head dims (128 < K or V <= 256; kda_recurrent.cuh): the token-level BPTT
// of docs/math/kda.md §7 in fp32 on CUDA cores, deterministic (fixed-order sums, no atomics). Launches:
//   0 rematerialize only (no residuals.h): kda_recurrent_fwd_kernel writes the chunk-start states
//     (fp32) into the workspace;
//   then per window w = 0, 1, .. (window w: the w-th chunk from the end of every sequence):
//   1 kda_recurrent_bwd_kernel, persistent (at most kKdaRecurrentMaxBlocks blocks), items (sequence,
//     value head, 32 value columns): dS from d_final_state (w = 0) or the carry of window w − 1; the
//     chunk's states S_{t−1} recomputed from its start state (residuals.h or the checkpoints) into
//     the block's slab, then per token in reverse, for column j (a = e^g ⊙ S_{t−1}, e = v − k̂ᵀa,
//     S_t = a + β k̂ e):
//       dSt = dS + q̃ do_j;  kd = k̂ᵀ dSt;  de = β kd (= dv_j);  dβ += e kd
//       dq̂ += scale S_t do_j;  dk̂ += β dSt e − a de;  dS̄ = dSt − k̂ de;  dg += a ⊙ dS̄;  dS = e^g ⊙ dS̄
//     dS into the carry (dh0 after a sequence's first chunk); dv and dh0 are complete per column,
//     dq̂, dk̂, dg, dβ are sums over the columns: per-tile partials of the window's rows;
//   2 kda_recurrent_finish_kernel, a block per (window row, q/k head), a thread per channel: the tile
//     partials summed in tile order, dq, dk summed over the head's value heads in head order, the
//     L2-norm backward dx = rstd (dy − ŷ (dy·ŷ)), the gate backward (dg w.r.t. the g passed in) and
//     the per-token terms of dA_log, ddt_bias;
//   3 kda_recurrent_gate_reduce_kernel (with dA_log or ddt_bias): those terms summed over the tokens.
// Workspace: kda_bwd_launch.hpp (KdaRecBwdLayout).
#include <algorithm>
#include <string>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "kda/cuda/kda_recurrent.cuh"

namespace encore::cuda {

KdaRecBwdLayout kda_recurrent_bwd_layout(int64_t chunks, int64_t N, int64_t H, int64_t K, int64_t V, bool remat, int64_t tokens,
                                         int64_t window_rows, bool gate_terms) {
  using namespace kda_rec;
  KdaRecBwdLayout l;
  const int64_t tiles = col_tiles(int(V)), items = N * H * tiles;
  l.blocks = int(items < kKdaRecurrentMaxBlocks ? items : kKdaRecurrentMaxBlocks);
  l.slab_floats = int64_t(kChunk) * row_count(int(K)) * kThreads;
  int64_t o = 0;
  auto take = [&](int64_t n) {
    const int64_t at = o;
    o += (n + 3) / 4 * 4;  // 16-byte parts
    return at;
  };
  l.ckpt = remat ? take(chunks * H * K * V) : 0;
  l.carry = take(N * H * K * V);
  l.slab = take(l.blocks * l.slab_floats);
  l.pq = take(window_rows * H * tiles * K);
  l.pk = take(window_rows * H * tiles * K);
  l.pg = take(window_rows * H * tiles * K);
  l.pb = take(window_rows * H * tiles);
  l.gdx = gate_terms ? take(tokens * H * K) : 0;
  l.gda = gate_terms ? take(tokens * H) : 0;
  l.floats = o;
  return l;
}

namespace kda_rec {
namespace {

// A chunk-start state element of residuals.h (bf16 or fp32).
__device__ __forceinline__ float load_state(const void* h, DType dt, int64_t off) {
  return dt == DType::kFP32 ? static_cast<const float*>(h)[off] : __bfloat162float(static_cast<const __nv_bfloat16*>(h)[off]);
}

// One window of the backward: chunk chunks_n − 1 − w of every sequence n (those that have one); the
// rows of sequence n's chunk are the window's partial rows row_start[n] .. row_start[n + 1] − 1.
struct Window {
  int w = 0;
  int32_t row_start[kKdaMaxSeqs + 1];
};

// Partial slot of (window row, value head, tile): offset in units of K (pq, pk, pg) or 1 (pb).
__device__ __forceinline__ int64_t part_row(int64_t row, int h, int tile, int H, int tiles) { return (row * H + h) * tiles + tile; }

__global__ void __launch_bounds__(kThreads) kda_recurrent_bwd_kernel(const __grid_constant__ KdaBwdCudaProblem p, const KdaRecBwdLayout L,
                                                                     float* ws, const __grid_constant__ Window win) {
  __shared__ Stage s;
  __shared__ float es[kChunk][kCols];  // e of the chunk's tokens
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int tiles = col_tiles(p.V), nr = row_count(p.K), K = p.K, V = p.V, H = p.H;
  const int items = p.N * H * tiles;
  float* slab = ws + L.slab + int64_t(blockIdx.x) * L.slab_floats + tid;
  const float* ckpt = ws + L.ckpt;
  int step = 0;  // staging buffer parity, alternating over every staged token
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int tile = item % tiles, h = (item / tiles) % H, n = item / (tiles * H);
    const int chunks = p.chunk_start[n + 1] - p.chunk_start[n], c = chunks - 1 - win.w;
    if (c < 0 && !(win.w == 0 && chunks == 0)) continue;  // done in an earlier window (a block-uniform test)
    const int col = tile * kCols + lane;
    const bool cv = col < V;
    const int b = p.varlen ? 0 : n, begin = p.seq_begin[n], end = p.seq_end[n];
    const float* dS_in = win.w == 0 ? p.dht : ws + L.carry;
    float dS[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int k = warp + kWarps * r;
      dS[r] = dS_in && r < nr && k < K && cv ? dS_in[state_off(n, h, k, col, H, K, V, p.state_v_first && win.w == 0)] : 0.f;
    }
    if (c >= 0) {
      const int t0 = begin + c * kChunk, rows = min(kChunk, end - t0);
      const int64_t slot = p.chunk_start[n] + c;
      float S[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int k = warp + kWarps * r;
        const int64_t off = state_off(slot, h, k, col, H, K, V);
        S[r] = r < nr && k < K && cv ? (p.h ? load_state(p.h, p.h_dtype, off) : ckpt[off]) : 0.f;
      }
      // The chunk's states S_{t−1} into the slab (this thread's elements), and e per token.
      TokenRegs next = fetch_token(p, b, t0, h, tile * kCols, nullptr);
      for (int i = 0; i < rows; ++i, ++step) {
        const int buf = step & 1;
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (r < nr) slab[(i * nr + r) * kThreads] = S[r];
        stage_token(p, s, buf, next);
        next = fetch_token(p, b, i + 1 < rows ? t0 + i + 1 : t0 + rows - 1, h, tile * kCols, i + 1 < rows ? nullptr : &p.d_o);
        const float e = delta_step(s, buf, S, nr, warp, lane);
        if (warp == 0) es[i][lane] = e;
      }
      // Reverse over the chunk's tokens.
      for (int i = rows - 1; i >= 0; --i, ++step) {
        const int buf = step & 1, t = t0 + i;
        const int64_t row = win.row_start[n] + i;
        stage_token(p, s, buf, next);
        if (i > 0) next = fetch_token(p, b, t - 1, h, tile * kCols, &p.d_o);
        const float e = es[i][lane], beta = s.beta[buf], dout = s.dout[buf][lane];
        float a[kRows], x[kRows], part = 0.f;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int k = warp + kWarps * r;
          a[r] = r < nr ? s.dec[buf][k] * slab[(i * nr + r) * kThreads] : 0.f;
          x[r] = r < nr ? fmaf(beta * e, s.k[buf][k], a[r]) * dout : 0.f;  // S_t do_j
          dS[r] = r < nr ? fmaf(s.q[buf][k], dout, dS[r]) : 0.f;          // dSt
          part += r < nr ? s.k[buf][k] * dS[r] : 0.f;
        }
        s.red[buf][warp][lane] = part;
        const float rdq = transpose_sum(x);  // row warp + 8 lane
        __syncthreads();
        float kd = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) kd += s.red[buf][w][lane];
        const float de = beta * kd;
        if (warp == 0) {
          if (cv) kda::store(p.dv.data, p.dv.dtype, int64_t(b) * p.dv.sb + int64_t(t) * p.dv.st + int64_t(h) * p.dv.sh + col, de);
          const float db = warp_sum(e * kd);
          if (lane == 0) ws[L.pb + part_row(row, h, tile, H, tiles)] = db;
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) x[r] = r < nr ? beta * dS[r] * e - a[r] * de : 0.f;
        const float rdk = transpose_sum(x);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int k = warp + kWarps * r;
          const float dsb = r < nr ? fmaf(-s.k[buf][k], de, dS[r]) : 0.f;  // dS̄
          x[r] = a[r] * dsb;
          dS[r] = s.dec[buf][k] * dsb;
        }
        const float rdg = transpose_sum(x);
        const int k = warp + kWarps * lane;
        if (lane < nr && k < K) {
          const int64_t at = part_row(row, h, tile, H, tiles) * K + k;
          ws[L.pq + at] = p.scale * rdq;
          ws[L.pk + at] = rdk;
          ws[L.pg + at] = rdg;
        }
      }
    }
    float* dS_out = c <= 0 ? p.dh0 : ws + L.carry;  // the sequence's first chunk done: dh0
    if (dS_out && cv) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int k = warp + kWarps * r;
        if (r < nr && k < K) dS_out[state_off(n, h, k, col, H, K, V, p.state_v_first && c <= 0)] = dS[r];
      }
    }
  }
}

// Σ of x over the block (fixed order: warp butterflies, then the 8 warp sums in order); every thread
// gets it. `red` holds kWarps floats; the leading barrier lets a caller reuse it back to back.
__device__ __forceinline__ float block_sum(float x, float* red) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  x = warp_sum(x);
  __syncthreads();
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += red[w];
  return s;
}

// dx of y = x · rstd for the sum dy of the gradients w.r.t. ŷ (no L2 norm: dx = dy).
__device__ __forceinline__ float l2norm_bwd(const KdaBwdCudaProblem& p, const KdaTensor& in, int b, int t, int hq, int c, float dy,
                                            float* red) {
  if (!p.l2norm) return dy;
  const float x = c < p.K ? load(in, b, t, hq, c) : 0.f;
  const float rstd = 1.f / sqrtf(block_sum(x * x, red) + 1e-6f), y = x * rstd;
  return rstd * (dy - y * block_sum(dy * y, red));
}

__global__ void __launch_bounds__(kThreads) kda_recurrent_finish_kernel(const __grid_constant__ KdaBwdCudaProblem p, const KdaRecBwdLayout L,
                                                                        float* ws, const __grid_constant__ Window win) {
  __shared__ float red[kWarps];
  const int c = threadIdx.x, Hq = p.H / p.group, tiles = col_tiles(p.V), K = p.K, H = p.H;
  const int hq = int(blockIdx.x) % Hq, row = int(blockIdx.x) / Hq;
  int n = 0;  // the last sequence whose rows start at or before this row (it has rows: see Window)
  for (int lo = 0, hi = p.N - 1; lo <= hi;) {
    const int mid = (lo + hi) / 2;
    if (win.row_start[mid] <= row) n = mid, lo = mid + 1;
    else hi = mid - 1;
  }
  const int chunk = p.chunk_start[n + 1] - p.chunk_start[n] - 1 - win.w;
  const int b = p.varlen ? 0 : n, t = p.seq_begin[n] + chunk * kChunk + row - win.row_start[n];
  const int64_t tok = int64_t(b) * p.T + t;
  const bool ck = c < K;
  float dyq = 0.f, dyk = 0.f;
  for (int j = 0; j < p.group; ++j)
    for (int tl = 0; tl < tiles; ++tl) {
      const int64_t at = part_row(row, hq * p.group + j, tl, H, tiles) * K + c;
      dyq += ck ? ws[L.pq + at] : 0.f;
      dyk += ck ? ws[L.pk + at] : 0.f;
    }
  const float dq = l2norm_bwd(p, p.q, b, t, hq, c, dyq, red), dk = l2norm_bwd(p, p.k, b, t, hq, c, dyk, red);
  if (ck) {
    kda::store(p.dq.data, p.dq.dtype, int64_t(b) * p.dq.sb + int64_t(t) * p.dq.st + int64_t(hq) * p.dq.sh + c, dq);
    kda::store(p.dk.data, p.dk.dtype, int64_t(b) * p.dk.sb + int64_t(t) * p.dk.st + int64_t(hq) * p.dk.sh + c, dk);
  }
  for (int j = 0; j < p.group; ++j) {
    const int h = hq * p.group + j;
    const int64_t row0 = part_row(row, h, 0, H, tiles);
    float dy = 0.f;
    for (int tl = 0; tl < tiles; ++tl) dy += ck ? ws[L.pg + (row0 + tl) * K + c] : 0.f;
    float dx = dy, da = 0.f;  // d(g passed in), and this channel's dA_log term
    if (p.gate_in_kernel && ck) {
      gate_backward(p, dy, gate_input(p, load(p.g, b, t, h, c), h, c), gate_scale(p, h), &dx, &da);
    }
    if (ck) {
      kda::store(p.dg.data, p.dg.dtype, int64_t(b) * p.dg.sb + int64_t(t) * p.dg.st + int64_t(h) * p.dg.sh + c, dx);
      if (p.gate_in_kernel) ws[L.gdx + (tok * H + h) * K + c] = dx;  // ddt_bias term
    }
    if (c == 0) {
      float db = 0.f;
      for (int tl = 0; tl < tiles; ++tl) db += ws[L.pb + row0 + tl];
      kda::store(p.dbeta.data, p.dbeta.dtype, int64_t(b) * p.dbeta.sb + int64_t(t) * p.dbeta.st + int64_t(h) * p.dbeta.sh, db);
    }
    if (p.dA_log) {
      const float sa = block_sum(da, red);
      if (c == 0) ws[L.gda + tok * H + h] = sa;  // dA_log term
    }
  }
}

// ddt_bias[h, c] = Σ_tokens of the finish kernel's terms (a thread per channel, tokens in order);
// dA_log[h] the same over the per-token terms (thread-strided, then block_sum). A block per value head.
__global__ void __launch_bounds__(kThreads) kda_recurrent_gate_reduce_kernel(const __grid_constant__ KdaBwdCudaProblem p, const KdaRecBwdLayout L,
                                                                             const float* ws, int64_t tokens) {
  __shared__ float red[kWarps];
  const int h = blockIdx.x, c = threadIdx.x, K = p.K, H = p.H;
  if (p.ddt_bias && c < K) {
    float s = 0.f;
    for (int64_t tok = 0; tok < tokens; ++tok) s += ws[L.gdx + (tok * H + h) * K + c];
    p.ddt_bias[h * K + c] = s;
  }
  if (p.dA_log) {
    float s = 0.f;
    for (int64_t tok = c; tok < tokens; tok += kThreads) s += ws[L.gda + tok * H + h];
    s = block_sum(s, red);
    if (c == 0) p.dA_log[h] = s;
  }
}

}  // namespace
}  // namespace kda_rec

size_t kda_recurrent_backward_workspace_bytes(int64_t chunks, int64_t N, int64_t H, int64_t K, int64_t V, bool remat, int64_t tokens,
                                              int64_t window_rows, bool gate_terms) {
  return size_t(kda_recurrent_bwd_layout(chunks, N, H, K, V, remat, tokens, window_rows, gate_terms).floats) * sizeof(float);
}

Status launch_kda_recurrent_backward(const KdaBwdCudaProblem& p, void* workspace, Stream stream) {
  using namespace kda_rec;
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(p.device));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t tokens = int64_t(p.B) * p.T, chunks = p.chunk_start[p.N];
  int windows = 1;
  int64_t window_rows = 0;
  for (int n = 0; n < p.N; ++n) {
    windows = std::max(windows, p.chunk_start[n + 1] - p.chunk_start[n]);
    window_rows += std::min(kChunk, p.seq_end[n] - p.seq_begin[n]);
  }
  const KdaRecBwdLayout L = kda_recurrent_bwd_layout(chunks, p.N, p.H, p.K, p.V, p.h == nullptr, tokens, window_rows, p.gate_in_kernel);
  float* ws = static_cast<float*>(workspace);
  const int items = p.N * p.H * col_tiles(p.V);
  if (!p.h && chunks > 0) {
    RecurrentOut out;
    out.h = ws + L.ckpt;
    out.h_dtype = DType::kFP32;
    ENCORE_RETURN_IF_ERROR(launch("kda recurrent backward: checkpoints (kda_recurrent_fwd_kernel)",
                                  [&] { kda_recurrent_fwd_kernel<KdaBwdCudaProblem><<<items, kThreads, 0, s>>>(p, out); }));
  }
  const int64_t Hq = p.H / p.group;
  Window win;  // ~4 KB, on the stack
  for (int w = 0; w < windows && items > 0; ++w) {
    win.w = w;
    int32_t rows = 0;
    for (int n = 0; n < p.N; ++n) {
      win.row_start[n] = rows;
      const int c = p.chunk_start[n + 1] - p.chunk_start[n] - 1 - w;
      if (c >= 0) rows += std::min(kChunk, p.seq_end[n] - p.seq_begin[n] - c * kChunk);
    }
    win.row_start[p.N] = rows;
    ENCORE_RETURN_IF_ERROR(launch("kda recurrent backward (kda_recurrent_bwd_kernel)",
                                  [&] { kda_recurrent_bwd_kernel<<<L.blocks, kThreads, 0, s>>>(p, L, ws, win); }));
    if (rows > 0)
      ENCORE_RETURN_IF_ERROR(launch("kda recurrent backward: finish (kda_recurrent_finish_kernel)",
                                    [&] { kda_recurrent_finish_kernel<<<unsigned(rows * Hq), kThreads, 0, s>>>(p, L, ws, win); }));
  }
  if (p.dA_log || p.ddt_bias)
    return launch("kda recurrent backward: gate reduction (kda_recurrent_gate_reduce_kernel)",
                  [&] { kda_recurrent_gate_reduce_kernel<<<p.H, kThreads, 0, s>>>(p, L, ws, tokens); });
  return Status::ok();
}

}  // namespace encore::cuda
