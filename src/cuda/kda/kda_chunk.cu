// KDA intra-chunk kernel (math-kda.md §4, §8.2): grid (chunk slots, H), 512 threads, one chunk of
// <= 64 tokens of one head; writes the state kernel's operands (kda_device.cuh's workspace record)
// and the backward's residuals (G, Aqk, Akk).
//
//   gate activation (precomputed log-decay, in-kernel softplus with optional dt_bias, or the lower
//   bound gate), optional q/k L2 norm, chunk-local cumulative gate G in log2 (fp32);
//   Aqk_ij = s Σ_c q_ic k_jc 2^(G_ic − G_jc) (j <= i),  L_ij = β_i Σ_c k_ic k_jc 2^(G_ic − G_jc) (j < i):
//     blocks below the diagonal on tensor cores with the 16-row sub-block reference r = 16 (i / 16):
//     (q_i ⊙ 2^(G_i − G_r)) · (k_j ⊙ 2^(G_r − G_j)), both factors <= 1 since j < r <= i;
//     the four diagonal 16 x 16 blocks with per-pair factors in fp32 (no exponent can overflow);
//   A = (I + L)^-1: diagonal blocks by forward substitution (one warp each), then block rows
//     A_{s,s'} = −A_ss Σ_{s' <= m < s} L_{s,m} A_{m,s'} (fp32);
//   W = A (β k ⊙ 2^G) and U = A (β v) on tensor cores (bf16 operands, fp32 accumulation);
//   Qg = s q ⊙ 2^G, KgT = (k ⊙ 2^(gC − G))ᵀ, dC = 2^gC with gC = G of the last row (padding rows
//   have g = 0, k = 0, β = 0, so they change nothing).
//
// Constraints (dispatch): K, V <= 128 (padded to 128 with zeros), bf16 or fp32 inputs.
#include "cuda/kda/kda_device.cuh"

namespace encore::cuda::kda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kLdF = kD + 1;  // fp32 [64][129] rows
constexpr int kLdS = kC + 1;  // fp32 [64][65] rows

struct ChunkSmem {  // byte offsets in dynamic shared memory
  static constexpr int kQ = 0;                      // fp32 [64][129] q (L2-normed)
  static constexpr int kK = kQ + kC * kLdF * 4;     // fp32 [64][129] k (L2-normed)
  static constexpr int kG = kK + kC * kLdF * 4;     // fp32 [64][129] gate, then cumulative log2 gate G
  static constexpr int kVbT = kG + kC * kLdF * 4;   // bf16 [128][72] (β v)ᵀ
  static constexpr int kQr = kVbT + kD * kLdC * 2;  // bf16 [64][136] q ⊙ 2^(G − G_r)   | later (β k ⊙ 2^G)ᵀ [128][72]
  static constexpr int kKr = kQr + kC * kLd * 2;    // bf16 [64][136] k ⊙ 2^(G − G_r)
  static constexpr int kKref = kKr + kC * kLd * 2;  // bf16 [96][136] k_j ⊙ 2^(G_16s − G_j), s = 1, 2, 3 | later A bf16 [64][72]
  static constexpr int kL = kKref + 96 * kLd * 2;   // fp32 [64][65] L
  static constexpr int kAq = kL + kC * kLdS * 4;    // fp32 [64][65] Aqk, then A = (I + L)^-1
  static constexpr int kT = kAq + kC * kLdS * 4;    // fp32 [16][65] block-row temporary of the inverse
  static constexpr int kBeta = kT + 16 * kLdS * 4;  // fp32 [64]
  static constexpr int kRn = kBeta + kC * 4;        // fp32 [2][64] L2-norm factors of q and k
  static constexpr int kBytes = kRn + 2 * kC * 4;
};
static_assert(ChunkSmem::kVbT % 16 == 0 && ChunkSmem::kQr % 16 == 0 && ChunkSmem::kKref % 16 == 0, "aligned bf16 tiles");
static_assert(kWarps == 16, "step 6 maps 16 warps");
static_assert(2 * kC * kLd >= kD * kLdC && 96 * kLd >= kC * kLdC, "aliased tiles fit");

// Row offset of reference s's block of k rows inside kref: s = 1 -> 0, 2 -> 16, 3 -> 48.
__device__ __forceinline__ int kref_row(int s) { return 8 * s * (s - 1); }

// Sequence of chunk slot `slot`: the last n with chunk_start[n] <= slot.
__device__ int find_seq(const KdaCudaProblem& p, int slot) {
  int lo = 0, hi = p.N - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.chunk_start[mid] <= slot) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__global__ void __launch_bounds__(kThreads) kda_chunk_kernel(const __grid_constant__ KdaCudaProblem p, void* ws) {
  const int slot = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g8 = lane >> 2, t4 = lane & 3;  // mma fragment coordinates
  const int n = find_seq(p, slot);
  const int b = p.varlen ? 0 : n;
  const int t0 = p.seq_begin[n] + (slot - p.chunk_start[n]) * kC;
  const int rows = min(kC, p.seq_end[n] - t0);
  const int K = p.K, V = p.V;
  extern __shared__ __align__(16) unsigned char smem[];
  float* qs = reinterpret_cast<float*>(smem + ChunkSmem::kQ);
  float* ks = reinterpret_cast<float*>(smem + ChunkSmem::kK);
  float* Gs = reinterpret_cast<float*>(smem + ChunkSmem::kG);
  auto* vbT = reinterpret_cast<__nv_bfloat16*>(smem + ChunkSmem::kVbT);
  auto* qr = reinterpret_cast<__nv_bfloat16*>(smem + ChunkSmem::kQr);
  auto* kr = reinterpret_cast<__nv_bfloat16*>(smem + ChunkSmem::kKr);
  auto* kref = reinterpret_cast<__nv_bfloat16*>(smem + ChunkSmem::kKref);
  auto* kbT = qr;     // after the intra-chunk products
  auto* Abf = kref;   // after the intra-chunk products
  float* Ls = reinterpret_cast<float*>(smem + ChunkSmem::kL);
  float* Aq = reinterpret_cast<float*>(smem + ChunkSmem::kAq);
  float* As = Aq;     // after Aqk is written out
  float* Ts = reinterpret_cast<float*>(smem + ChunkSmem::kT);
  float* bs = reinterpret_cast<float*>(smem + ChunkSmem::kBeta);
  float* rn = reinterpret_cast<float*>(smem + ChunkSmem::kRn);
  unsigned char* rec = ws_record(ws, slot, p.H, h);

  // 1. Inputs over the padded [64][128] tile: q, k, the gate in log2; beta; then (β v)ᵀ.
#pragma unroll 4
  for (int idx = tid; idx < kC * kD; idx += kThreads) {
    const int i = idx / kD, c = idx % kD;
    float q = 0.f, k = 0.f, g = 0.f;
    if (i < rows && c < K) {
      q = load(p.q, b, t0 + i, h, c);
      k = load(p.k, b, t0 + i, h, c);
      float x = load(p.g, b, t0 + i, h, c);
      if (p.gate_in_kernel) {
        if (p.dt_bias) x += p.dt_bias[h * K + c];
        const float ea = p.A_log ? expf(p.A_log[h]) : 1.0f;
        x = p.lower_bound_gate ? p.lower_bound / (1.0f + expf(-ea * x)) : -ea * (x > 20.f ? x : log1pf(expf(x)));
      }
      g = x * kLog2e;
    }
    qs[i * kLdF + c] = q;
    ks[i * kLdF + c] = k;
    Gs[i * kLdF + c] = g;
  }
  if (tid < kC) bs[tid] = tid < rows ? load(p.beta, b, t0 + tid, h, 0) : 0.f;
  __syncthreads();
#pragma unroll 4
  for (int idx = tid; idx < kC * kD; idx += kThreads) {
    const int i = idx / kD, c = idx % kD;
    const float v = (i < rows && c < V) ? load(p.v, b, t0 + i, h, c) : 0.f;
    vbT[c * kLdC + i] = __float2bfloat16(bs[i] * v);
  }
  if (p.l2norm) {  // one warp per row
    for (int i = warp; i < kC; i += kWarps) {
      float sq = 0.f, sk = 0.f;
      for (int c = lane; c < kD; c += 32) {
        sq += qs[i * kLdF + c] * qs[i * kLdF + c];
        sk += ks[i * kLdF + c] * ks[i * kLdF + c];
      }
      for (int o = 16; o > 0; o >>= 1) {
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        sk += __shfl_xor_sync(0xffffffffu, sk, o);
      }
      if (lane == 0) {
        rn[i] = rsqrtf(sq + 1e-6f);
        rn[kC + i] = rsqrtf(sk + 1e-6f);
      }
    }
  }
  if (tid < kD) {  // cumulative gate, one thread per channel
    float acc = 0.f;
    for (int i = 0; i < kC; ++i) {
      acc += Gs[i * kLdF + tid];
      Gs[i * kLdF + tid] = acc;
    }
  }
  __syncthreads();
  if (p.l2norm) {
    for (int idx = tid; idx < kC * kD; idx += kThreads) {
      const int i = idx / kD, c = idx % kD;
      qs[i * kLdF + c] *= rn[i];
      ks[i * kLdF + c] *= rn[kC + i];
    }
    __syncthreads();
  }

  // 2. Operands of the products below the diagonal blocks, and the state kernel's Qg, KgT, dC.
  auto* Qg = reinterpret_cast<__nv_bfloat16*>(rec + WsLayout::kQg);
  auto* KgT = reinterpret_cast<__nv_bfloat16*>(rec + WsLayout::kKgT);
  auto* dC = reinterpret_cast<float*>(rec + WsLayout::kDC);
  for (int idx = tid; idx < kC * kD; idx += kThreads) {
    const int i = idx / kD, c = idx % kD;
    const float G = Gs[i * kLdF + c], f = exp2f(G - Gs[(i & ~15) * kLdF + c]);
    const float q = qs[i * kLdF + c];
    qr[i * kLd + c] = __float2bfloat16(q * f);
    kr[i * kLd + c] = __float2bfloat16(ks[i * kLdF + c] * f);
    Qg[idx] = __float2bfloat16(p.scale * q * exp2f(G));
  }
  for (int idx = tid; idx < 96 * kD; idx += kThreads) {
    const int R = idx / kD, c = idx % kD;
    const int s = R < 16 ? 1 : (R < 48 ? 2 : 3), j = R - kref_row(s);
    kref[R * kLd + c] = __float2bfloat16(ks[j * kLdF + c] * exp2f(Gs[16 * s * kLdF + c] - Gs[j * kLdF + c]));
  }
  for (int idx = tid; idx < kD * kC; idx += kThreads) {
    const int c = idx / kC, j = idx % kC;
    KgT[idx] = __float2bfloat16(ks[j * kLdF + c] * exp2f(Gs[(kC - 1) * kLdF + c] - Gs[j * kLdF + c]));
  }
  if (tid < kD) dC[tid] = exp2f(Gs[(kC - 1) * kLdF + tid]);
  __syncthreads();

  // 3. Aqk and L: six blocks below the diagonal per matrix on tensor cores (warp per block) ...
  for (int task = warp; task < 12; task += kWarps) {
    const bool is_l = task >= 6;
    const int pair = task % 6;  // (s, s') = (1,0) (2,0) (2,1) (3,0) (3,1) (3,2)
    const int s = pair < 1 ? 1 : (pair < 3 ? 2 : 3), sp = pair - (s == 1 ? 0 : (s == 2 ? 1 : 3));
    float acc[2][4];
    zero(acc);
    warp_mma_nt<2>(acc, (is_l ? kr : qr) + 16 * s * kLd, kLd, kref + (kref_row(s) + 16 * sp) * kLd, kLd, kD / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = 16 * s + g8 + 8 * hh, j = 16 * sp + 8 * nt + 2 * t4;
        const float f = is_l ? bs[i] : p.scale;
        float* dst = (is_l ? Ls : Aq) + i * kLdS + j;
        dst[0] = f * acc[nt][2 * hh];
        dst[1] = f * acc[nt][2 * hh + 1];
      }
  }
  // ... the diagonal blocks with per-pair factors (fp32; one thread per pair j <= i of the 4 x 136),
  // zeros above the diagonal blocks.
  for (int e = tid; e < 4 * 136; e += kThreads) {
    const int blk = e / 136, r = e % 136;
    int il = int((sqrtf(8.f * r + 1.f) - 1.f) * 0.5f);
    if ((il + 1) * (il + 2) / 2 <= r) ++il;  // guard the float square root
    if (il * (il + 1) / 2 > r) --il;
    const int i = 16 * blk + il, j = 16 * blk + r - il * (il + 1) / 2;
    float aqk = 0.f, l = 0.f;
#pragma unroll 8
    for (int c = 0; c < K; ++c) {
      const float kj = ks[j * kLdF + c] * exp2f(Gs[i * kLdF + c] - Gs[j * kLdF + c]);
      aqk += qs[i * kLdF + c] * kj;
      l += ks[i * kLdF + c] * kj;
    }
    Aq[i * kLdS + j] = p.scale * aqk;
    Ls[i * kLdS + j] = j < i ? bs[i] * l : 0.f;
    if (j < i) Aq[j * kLdS + i] = Ls[j * kLdS + i] = 0.f;  // the mirrored entry above the diagonal
  }
  for (int e = tid; e < kC * kC; e += kThreads) {
    const int i = e / kC, j = e % kC;
    if (j / 16 > i / 16) Aq[i * kLdS + j] = Ls[i * kLdS + j] = 0.f;
  }
  __syncthreads();

  // 4. Aqk out (workspace bf16, residual), G residual, and (β k ⊙ 2^G)ᵀ for W.
  auto* Aqk_ws = reinterpret_cast<__nv_bfloat16*>(rec + WsLayout::kAqk);
  for (int e = tid; e < kC * kC; e += kThreads) Aqk_ws[e] = __float2bfloat16(Aq[(e / kC) * kLdS + e % kC]);
  const int64_t tok0 = (int64_t(b) * p.T + t0) * p.H + h;  // token row index of chunk row 0
  if (p.res_Aqk)
    for (int e = tid; e < rows * kC; e += kThreads)
      store(p.res_Aqk, p.res_dtype, (tok0 + int64_t(e / kC) * p.H) * kC + e % kC, Aq[(e / kC) * kLdS + e % kC]);
  if (p.res_G)
    for (int e = tid; e < rows * K; e += kThreads) p.res_G[(tok0 + int64_t(e / K) * p.H) * K + e % K] = Gs[(e / K) * kLdF + e % K];
  for (int idx = tid; idx < kD * kC; idx += kThreads) {
    const int c = idx / kC, j = idx % kC;
    kbT[c * kLdC + j] = __float2bfloat16(bs[j] * ks[j * kLdF + c] * exp2f(Gs[j * kLdF + c]));
  }
  __syncthreads();

  // 5. A = (I + L)^-1 (unit lower triangular) into As (over Aqk; zeros above the diagonal blocks stay).
  if (warp < 4 && lane < 16) {  // diagonal block `warp`, column `lane`: X_ij = δ_ij − Σ_{j<=m<i} L_im X_mj
    const int o = 16 * warp, j = lane;
    for (int i = 0; i < 16; ++i) {
      float s = i == j ? 1.f : 0.f;
      for (int m = j; m < i; ++m) s -= Ls[(o + i) * kLdS + o + m] * As[(o + m) * kLdS + o + j];
      As[(o + i) * kLdS + o + j] = j <= i ? s : 0.f;
    }
  }
  __syncthreads();
  for (int s = 1; s < 4; ++s) {  // block row s, columns [0, 16 s)
    const int o = 16 * s;
    for (int e = tid; e < 16 * o; e += kThreads) {  // T = Σ_{s' <= m < s} L_{s,m} A_{m,s'}
      const int i = e / o, j = e % o;
      float acc = 0.f;
#pragma unroll 4
      for (int m = j & ~15; m < o; ++m) acc += Ls[(o + i) * kLdS + m] * As[m * kLdS + j];
      Ts[i * kLdS + j] = acc;
    }
    __syncthreads();
    for (int e = tid; e < 16 * o; e += kThreads) {  // A_{s,s'} = −A_ss T
      const int i = e / o, j = e % o;
      float acc = 0.f;
#pragma unroll 4
      for (int m = 0; m <= i; ++m) acc += As[(o + i) * kLdS + o + m] * Ts[m * kLdS + j];
      As[(o + i) * kLdS + j] = -acc;
    }
    __syncthreads();
  }
  for (int e = tid; e < kC * kC; e += kThreads) Abf[(e / kC) * kLdC + e % kC] = __float2bfloat16(As[(e / kC) * kLdS + e % kC]);
  if (p.res_Akk)
    for (int e = tid; e < rows * kC; e += kThreads)
      store(p.res_Akk, p.res_dtype, (tok0 + int64_t(e / kC) * p.H) * kC + e % kC, As[(e / kC) * kLdS + e % kC]);
  __syncthreads();

  // 6. W = A (β k ⊙ 2^G) (bf16) and U = A (β v) (fp32): warp = (16-row block, matrix, 64-column half).
  const int r0 = 16 * (warp % 4), half = warp / 8;
  const bool is_u = (warp / 4) % 2;
  auto* W = reinterpret_cast<__nv_bfloat16*>(rec + WsLayout::kW);
  auto* U = reinterpret_cast<float*>(rec + WsLayout::kU);
  float acc[8][4];
  zero(acc);
  warp_mma_nt<8>(acc, Abf + r0 * kLdC, kLdC, (is_u ? vbT : kbT) + half * 64 * kLdC, kLdC, kC / 16);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = r0 + g8 + 8 * hh, c = half * 64 + 8 * nt + 2 * t4;
      if (is_u) *reinterpret_cast<float2*>(U + i * kD + c) = make_float2(acc[nt][2 * hh], acc[nt][2 * hh + 1]);
      else *reinterpret_cast<uint32_t*>(W + i * kD + c) = pack_bf16(acc[nt][2 * hh], acc[nt][2 * hh + 1]);
    }
}

}  // namespace

cudaError_t launch_chunk_kernel(const KdaCudaProblem& p, void* ws, cudaStream_t stream) {
  const cudaError_t e = cudaFuncSetAttribute(kda_chunk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, ChunkSmem::kBytes);
  if (e != cudaSuccess) return e;
  kda_chunk_kernel<<<dim3(unsigned(p.chunk_start[p.N]), unsigned(p.H)), kThreads, ChunkSmem::kBytes, stream>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace encore::cuda::kda
