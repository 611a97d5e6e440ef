// KDA chunked forward on CUDA (math-kda.md §4), first version: fp32 SIMT math, two kernels.
//
//   kda_chunk_kernel   grid (chunk slots, H), 256 threads, one chunk of <= 64 rows:
//     gate activation (precomputed log-decay or the in-kernel softplus / lower-bound gate), optional
//     q/k L2 norm, chunk-local cumulative gate G in log2, then with per-pair factors
//     e_ijc = 2^(G_ic − G_jc) (j <= i, so e <= 1: no overflow for any gate, math-kda.md §8.2's
//     safe path):  Aqk_ij = s Σ_c q_ic k_jc e_ijc (j <= i),  L_ij = β_i Σ_c k_ic k_jc e_ijc (j < i),
//     A = (I + L)^-1 by forward substitution,  W = A (β k ⊙ 2^G),  U = A (β v),
//     Qg = s q ⊙ 2^G,  Kg = k ⊙ 2^(gC − G),  gC = G of the last row (padding rows have g = 0).
//   kda_state_kernel   grid (N, H, V / 32), 256 threads, the serial pass of one sequence and head
//     over its chunks on a 32-column slice of the state S [K, V] (fp32, shared memory); each step
//     stages the chunk's W, Qg, Kg, Aqk, U slice and 2^gC in shared memory, then
//     Vnew = U − W S;  O = Qg S + Aqk Vnew;  S = 2^gC ⊙ S + Kgᵀ Vnew  (8 rows per thread);
//     o and the final state out.
//
// Constraints (dispatch): K, V <= 128, bf16 or fp32 inputs, <= 1024 sequences; sequences start new
// chunks (varlen alignment, §9). Not yet: tensor cores, the saved residuals (Aqk, A, h) for the
// backward; this version keeps everything in fp32 and is far from the speed targets.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "cuda/common/device_guard.hpp"
#include "cuda/kda/kda_launch.hpp"

namespace encore::cuda {
namespace {

constexpr int kC = 64;          // chunk rows
constexpr int kThreads = 256;
constexpr int kVSlice = 32;     // state columns per block of the state pass
constexpr float kLog2e = 1.4426950408889634f;

struct ChunkLayout {  // floats per (chunk, head) in the workspace
  int K, V;
  __host__ __device__ int64_t qg() const { return 0; }
  __host__ __device__ int64_t kg() const { return int64_t(kC) * K; }
  __host__ __device__ int64_t w() const { return 2 * int64_t(kC) * K; }
  __host__ __device__ int64_t u() const { return 3 * int64_t(kC) * K; }
  __host__ __device__ int64_t aqk() const { return u() + int64_t(kC) * V; }
  __host__ __device__ int64_t gc() const { return aqk() + int64_t(kC) * kC; }
  __host__ __device__ int64_t size() const { return gc() + K; }
};

__device__ __forceinline__ void store(void* base, DType dt, int64_t off, float x) {
  if (dt == DType::kBF16) static_cast<__nv_bfloat16*>(base)[off] = __float2bfloat16(x);
  else static_cast<float*>(base)[off] = x;
}

__device__ __forceinline__ float load(const KdaTensor& t, int b, int tok, int h, int c) {
  const int64_t off = int64_t(b) * t.sb + int64_t(tok) * t.st + int64_t(h) * t.sh + c;
  return t.dtype == DType::kBF16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(t.data)[off]) : static_cast<const float*>(t.data)[off];
}

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

__global__ void __launch_bounds__(kThreads) kda_chunk_kernel(const __grid_constant__ KdaCudaProblem p, float* ws) {
  const int slot = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int n = find_seq(p, slot);
  const int b = p.varlen ? 0 : n;
  const int t0 = p.seq_begin[n] + (slot - p.chunk_start[n]) * kC;
  const int rows = min(kC, p.seq_end[n] - t0);
  const int K = p.K, V = p.V, KP = K + 1, VP = V + 1;
  extern __shared__ float smem[];
  float* qs = smem;               // [64][K+1]
  float* ks = qs + kC * KP;       // [64][K+1]
  float* Gs = ks + kC * KP;       // [64][K+1]: gate, then cumulative log2 gate
  float* vs = Gs + kC * KP;       // [64][V+1]
  float* Ls = vs + kC * VP;       // [64][65]
  float* As = Ls + kC * (kC + 1); // [64][65]
  float* bs = As + kC * (kC + 1); // [64] beta
  float* rn = bs + kC;            // [2][64] L2 norm factors

  for (int idx = tid; idx < kC * K; idx += kThreads) {
    const int i = idx / K, c = idx % K;
    float q = 0.f, k = 0.f, g = 0.f;
    if (i < rows) {
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
    qs[i * KP + c] = q;
    ks[i * KP + c] = k;
    Gs[i * KP + c] = g;
  }
  for (int idx = tid; idx < kC * V; idx += kThreads) {
    const int i = idx / V, c = idx % V;
    vs[i * VP + c] = i < rows ? load(p.v, b, t0 + i, h, c) : 0.f;
  }
  if (tid < kC) bs[tid] = tid < rows ? load(p.beta, b, t0 + tid, h, 0) : 0.f;
  __syncthreads();
  // L2 norm factors (one warp per 8 rows) and the cumulative gate (one thread per channel).
  const int warp = tid / 32, lane = tid % 32;
  if (p.l2norm) {
    for (int i = warp; i < kC; i += kThreads / 32) {
      float sq = 0.f, sk = 0.f;
      for (int c = lane; c < K; c += 32) {
        sq += qs[i * KP + c] * qs[i * KP + c];
        sk += ks[i * KP + c] * ks[i * KP + c];
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
  if (tid < K) {
    float acc = 0.f;
    for (int i = 0; i < kC; ++i) {
      acc += Gs[i * KP + tid];
      Gs[i * KP + tid] = acc;
    }
  }
  __syncthreads();
  if (p.l2norm) {
    for (int idx = tid; idx < kC * K; idx += kThreads) {
      const int i = idx / K, c = idx % K;
      qs[i * KP + c] *= rn[i];
      ks[i * KP + c] *= rn[kC + i];
    }
    __syncthreads();
  }
  float* out = ws + (int64_t(slot) * p.H + h) * ChunkLayout{K, V}.size();
  const ChunkLayout L{K, V};
  // Aqk (j <= i) and L (j < i) with per-pair decay factors.
  for (int pair = tid; pair < kC * kC; pair += kThreads) {
    const int i = pair / kC, j = pair % kC;
    float aqk = 0.f, l = 0.f;
    if (j <= i) {
      for (int c = 0; c < K; ++c) {
        const float e = exp2f(Gs[i * KP + c] - Gs[j * KP + c]);
        const float kj = ks[j * KP + c] * e;
        aqk += qs[i * KP + c] * kj;
        l += ks[i * KP + c] * kj;
      }
    }
    out[L.aqk() + pair] = j <= i ? p.scale * aqk : 0.f;
    Ls[i * (kC + 1) + j] = j < i ? bs[i] * l : 0.f;
  }
  __syncthreads();
  // A = (I + L)^-1: row i = e_i − Σ_{m<i} L_im A_m (unit lower triangular).
  for (int idx = tid; idx < kC * (kC + 1); idx += kThreads) As[idx] = 0.f;
  __syncthreads();
  for (int i = 0; i < kC; ++i) {
    if (tid <= i) {
      const int j = tid;
      float s = (i == j) ? 1.f : 0.f;
      for (int m = j; m < i; ++m) s -= Ls[i * (kC + 1) + m] * As[m * (kC + 1) + j];
      As[i * (kC + 1) + j] = s;
    }
    __syncthreads();
  }
  // Residuals: G, Aqk and A rows of the valid tokens, [B, T, H, 64 | K] contiguous.
  if (p.res_G || p.res_Aqk || p.res_Akk) {
    const int64_t tok0 = (int64_t(b) * p.T + t0) * p.H + h;  // token row index of chunk row 0
    for (int idx = tid; idx < rows * kC; idx += kThreads) {
      const int i = idx / kC, j = idx % kC;
      const int64_t off = (tok0 + int64_t(i) * p.H) * kC + j;
      if (p.res_Aqk) store(p.res_Aqk, p.res_dtype, off, out[L.aqk() + i * kC + j]);
      if (p.res_Akk) store(p.res_Akk, p.res_dtype, off, As[i * (kC + 1) + j]);
    }
    if (p.res_G)
      for (int idx = tid; idx < rows * K; idx += kThreads) {
        const int i = idx / K, c = idx % K;
        p.res_G[(tok0 + int64_t(i) * p.H) * K + c] = Gs[i * KP + c];
      }
  }
  // gC, Qg, Kg; then k <- β k 2^G and v <- β v for W and U.
  const float* Glast = Gs + (kC - 1) * KP;
  for (int idx = tid; idx < kC * K; idx += kThreads) {
    const int i = idx / K, c = idx % K;
    const float G = Gs[i * KP + c];
    out[L.qg() + idx] = p.scale * qs[i * KP + c] * exp2f(G);
    out[L.kg() + idx] = ks[i * KP + c] * exp2f(Glast[c] - G);
    if (i == 0) out[L.gc() + c] = Glast[c];
  }
  __syncthreads();
  for (int idx = tid; idx < kC * K; idx += kThreads) {
    const int i = idx / K, c = idx % K;
    ks[i * KP + c] *= bs[i] * exp2f(Gs[i * KP + c]);
  }
  for (int idx = tid; idx < kC * V; idx += kThreads) {
    const int i = idx / V, c = idx % V;
    vs[i * VP + c] *= bs[i];
  }
  __syncthreads();
  for (int idx = tid; idx < kC * K; idx += kThreads) {
    const int i = idx / K, c = idx % K;
    float s = 0.f;
    for (int j = 0; j <= i; ++j) s += As[i * (kC + 1) + j] * ks[j * KP + c];
    out[L.w() + idx] = s;
  }
  for (int idx = tid; idx < kC * V; idx += kThreads) {
    const int i = idx / V, c = idx % V;
    float s = 0.f;
    for (int j = 0; j <= i; ++j) s += As[i * (kC + 1) + j] * vs[j * VP + c];
    out[L.u() + idx] = s;
  }
}

// Rows per thread in the state kernel: thread (r0, column) owns rows r0, r0 + 8, ... of a chunk.
constexpr int kRowStep = kThreads / kVSlice;  // 8
constexpr int kRowsPerThread = kC / kRowStep;  // 8

__global__ void __launch_bounds__(kThreads) kda_state_kernel(const __grid_constant__ KdaCudaProblem p, const float* ws) {
  const int n = blockIdx.x, h = blockIdx.y, v0 = blockIdx.z * kVSlice, tid = threadIdx.x;
  const int K = p.K, V = p.V, b = p.varlen ? 0 : n;
  const int vl = tid % kVSlice, r0 = tid / kVSlice;  // column in the slice, first row
  const int vc = v0 + vl;
  const bool col = vc < V;
  const ChunkLayout L{K, V};
  extern __shared__ float smem[];
  float* S = smem;                    // [K][32] state slice
  float* Vn = S + K * kVSlice;        // [64][32]
  float* Wt = Vn + kC * kVSlice;      // [64][K]
  float* Qt = Wt + kC * K;            // [64][K]
  float* Kt = Qt + kC * K;            // [64][K]
  float* At = Kt + kC * K;            // [64][64] Aqk (zeros above the diagonal)
  float* Ut = At + kC * kC;           // [64][32] U slice
  float* gC = Ut + kC * kVSlice;      // [K]
  for (int idx = tid; idx < K * kVSlice; idx += kThreads) {
    const int c = idx / kVSlice, v = v0 + idx % kVSlice;
    S[idx] = (p.h0 && v < V) ? p.h0[((int64_t(n) * p.H + h) * K + c) * V + v] : 0.f;
  }
  const int begin = p.seq_begin[n], end = p.seq_end[n];
  for (int slot = p.chunk_start[n]; slot < p.chunk_start[n + 1]; ++slot) {
    const float* in = ws + (int64_t(slot) * p.H + h) * L.size();
    const int t0 = begin + (slot - p.chunk_start[n]) * kC;
    const int rows = min(kC, end - t0);
    if (p.res_h)  // the chunk-start state slice
      for (int idx = tid; idx < K * kVSlice; idx += kThreads) {
        const int c = idx / kVSlice, v = v0 + idx % kVSlice;
        if (v < V) store(p.res_h, p.res_dtype, ((int64_t(slot) * p.H + h) * K + c) * V + v, S[idx]);
      }
    // Stage the chunk's operands in shared memory (coalesced); the previous step's reads are done.
    for (int idx = tid; idx < kC * K; idx += kThreads) {
      Wt[idx] = in[L.w() + idx];
      Qt[idx] = in[L.qg() + idx];
      Kt[idx] = in[L.kg() + idx];
    }
    for (int idx = tid; idx < kC * kC; idx += kThreads) At[idx] = in[L.aqk() + idx];
    for (int idx = tid; idx < kC * kVSlice; idx += kThreads) {
      const int i = idx / kVSlice, v = v0 + idx % kVSlice;
      Ut[idx] = v < V ? in[L.u() + i * V + v] : 0.f;
    }
    for (int idx = tid; idx < K; idx += kThreads) gC[idx] = exp2f(in[L.gc() + idx]);
    __syncthreads();
    // Vnew = U − W S and O = Qg S, rows r0 + 8k (independent accumulators).
    float vn[kRowsPerThread], o[kRowsPerThread];
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      vn[k] = Ut[(r0 + k * kRowStep) * kVSlice + vl];
      o[k] = 0.f;
    }
    for (int c = 0; c < K; ++c) {
      const float sv = S[c * kVSlice + vl];
#pragma unroll
      for (int k = 0; k < kRowsPerThread; ++k) {
        vn[k] -= Wt[(r0 + k * kRowStep) * K + c] * sv;
        o[k] += Qt[(r0 + k * kRowStep) * K + c] * sv;
      }
    }
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) Vn[(r0 + k * kRowStep) * kVSlice + vl] = vn[k];
    __syncthreads();
    // O += Aqk Vnew; write o.
    for (int j = 0; j < kC; ++j) {
      const float x = Vn[j * kVSlice + vl];
#pragma unroll
      for (int k = 0; k < kRowsPerThread; ++k) o[k] += At[(r0 + k * kRowStep) * kC + j] * x;
    }
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      const int i = r0 + k * kRowStep;
      if (col && i < rows) {
        const int64_t off = int64_t(b) * p.o_sb + int64_t(t0 + i) * p.o_st + int64_t(h) * p.o_sh + vc;
        if (p.o_dtype == DType::kBF16) static_cast<__nv_bfloat16*>(p.o)[off] = __float2bfloat16(o[k]);
        else static_cast<float*>(p.o)[off] = o[k];
      }
    }
    // S = 2^gC ⊙ S + Kgᵀ Vnew, state rows c = r0 + 8k.
    for (int c0 = r0; c0 < K; c0 += kRowStep * kRowsPerThread) {
      float acc[kRowsPerThread];
#pragma unroll
      for (int k = 0; k < kRowsPerThread; ++k) {
        const int c = c0 + k * kRowStep;
        acc[k] = c < K ? S[c * kVSlice + vl] * gC[c] : 0.f;
      }
      for (int j = 0; j < kC; ++j) {
        const float x = Vn[j * kVSlice + vl];
#pragma unroll
        for (int k = 0; k < kRowsPerThread; ++k) {
          const int c = c0 + k * kRowStep;
          if (c < K) acc[k] += Kt[j * K + c] * x;
        }
      }
#pragma unroll
      for (int k = 0; k < kRowsPerThread; ++k) {
        const int c = c0 + k * kRowStep;
        if (c < K) S[c * kVSlice + vl] = acc[k];
      }
    }
    __syncthreads();
  }
  if (p.final_state)
    for (int idx = tid; idx < K * kVSlice; idx += kThreads) {
      const int c = idx / kVSlice, v = v0 + idx % kVSlice;
      if (v < V) p.final_state[((int64_t(n) * p.H + h) * K + c) * V + v] = S[idx];
    }
}

Status launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Status::cuda_error(std::string("kda forward: ") + what + ": " + cudaGetErrorString(e));
  return Status::ok();
}

}  // namespace

size_t kda_forward_workspace_bytes(int64_t chunks, int64_t H, int64_t K, int64_t V) {
  return size_t(chunks * H * ChunkLayout{int(K), int(V)}.size()) * sizeof(float);
}

Status launch_kda_forward(const KdaCudaProblem& p, void* workspace, Stream stream) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(p.device));
  const int chunks = p.chunk_start[p.N];
  if (chunks == 0) return Status::ok();
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const size_t smem1 = sizeof(float) * size_t(3 * kC * (p.K + 1) + kC * (p.V + 1) + 2 * kC * (kC + 1) + 3 * kC);
  const size_t smem2 = sizeof(float) * size_t(p.K * kVSlice + 2 * kC * kVSlice + 3 * kC * p.K + kC * kC + p.K);
  if (cudaFuncSetAttribute(kda_chunk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem1)) != cudaSuccess)
    return launched("shared memory for the chunk kernel");
  if (cudaFuncSetAttribute(kda_state_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem2)) != cudaSuccess)
    return launched("shared memory for the state kernel");
  float* ws = static_cast<float*>(workspace);
  kda_chunk_kernel<<<dim3(unsigned(chunks), unsigned(p.H)), kThreads, smem1, s>>>(p, ws);
  ENCORE_RETURN_IF_ERROR(launched("chunk kernel"));
  kda_state_kernel<<<dim3(unsigned(p.N), unsigned(p.H), unsigned((p.V + kVSlice - 1) / kVSlice)), kThreads, smem2, s>>>(p, ws);
  return launched("state kernel");
}

}  // namespace encore::cuda
