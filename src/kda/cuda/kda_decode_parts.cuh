// The building blocks of the KDA decode kernels (kda_decode.cu): the thread mapping's constants, the input loads (per
// dtype, and the raw-then-convert TokenLoad of the compile-time kernels), the o stores, the varlen token
// table, the block-wide sums of a token (one barrier) and its outputs, the packed state row of the
// single-token kernels, the gate's decay, the index contract (slot resolution, in two dependent loads) and
// the o rows of padding and bad sequences. Header comment of kda_decode.cu: the math and the work split.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/cuda/fast_math.cuh"  // fast_exp2, kLog2e
#include "core/softplus_log2.hpp"
#include "kda/cuda/kda_decode.hpp"
#include "kda/cuda/kda_device.cuh"  // kda::sigmoid

namespace encore::cuda::decode {

constexpr int kThreads = 128, kWarps = 4, kColLanes = 8, kRowLanes = 4;
static_assert(kColLanes * kRowLanes == 32, "a warp: 8 column groups x 4 row groups");

__device__ __forceinline__ bool aligned(const void* p, unsigned bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; }

__device__ __forceinline__ float half_bits(DType dt, unsigned short u) {
  return dt == DType::kBF16 ? __uint_as_float(unsigned(u) << 16) : __half2float(__ushort_as_half(u));
}
// Two 16-bit values packed in a 32-bit word (lower address first).
__device__ __forceinline__ void half_pair(DType dt, unsigned w, float& a, float& b) {
  a = half_bits(dt, static_cast<unsigned short>(w & 0xffffu));
  b = half_bits(dt, static_cast<unsigned short>(w >> 16));
}
// The 16-bit values of a vector word (uint2: 4, uint4: 8; lower address first) as floats.
template <class Vec>
__device__ __forceinline__ void unpack_halves(DType dt, const Vec& u, float* x) {
  const unsigned* w = reinterpret_cast<const unsigned*>(&u);
#pragma unroll
  for (int i = 0; i < int(sizeof(Vec) / 4); ++i) half_pair(dt, w[i], x[2 * i], x[2 * i + 1]);
}
__device__ __forceinline__ unsigned short to_half_bits(DType dt, float x) {
  return dt == DType::kBF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}
// Two values as 16-bit words of dt (bf16 / fp16) in one 32-bit word, a at the lower address.
__device__ __forceinline__ unsigned pack_pair(DType dt, float a, float b) {
  return unsigned(to_half_bits(dt, a)) | (unsigned(to_half_bits(dt, b)) << 16);
}
// Four values as 16-bit words of dt, lower address first.
__device__ __forceinline__ uint2 pack_halves4(DType dt, const float (&x)[4]) {
  return make_uint2(pack_pair(dt, x[0], x[1]), pack_pair(dt, x[2], x[3]));
}

// N consecutive input elements at element offset `off` (channels c0 .. c0 + N - 1 of C; 0 past C):
// 16-byte (8-byte) vector loads where all are in range and the address is aligned, element loads otherwise.
template <int N>
__device__ __forceinline__ void load_vec(const void* base, DType dt, int64_t off, int c0, int C, float (&x)[N]) {
  const bool full = c0 + N <= C;
  if (dt == DType::kFP32) {
    const float* p = static_cast<const float*>(base) + off;
    if constexpr (N % 4 == 0) {
      if (full && aligned(p, 16)) {
#pragma unroll
        for (int j = 0; j < N / 4; ++j) {
          const float4 f = __ldg(reinterpret_cast<const float4*>(p) + j);
          x[4 * j] = f.x, x[4 * j + 1] = f.y, x[4 * j + 2] = f.z, x[4 * j + 3] = f.w;
        }
        return;
      }
    }
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] = c0 + j < C ? __ldg(p + j) : 0.f;
    return;
  }
  const unsigned short* p = static_cast<const unsigned short*>(base) + off;
  if constexpr (N % 4 == 0) {
    using Vec = std::conditional_t<N % 8 == 0, uint4, uint2>;  // 16 or 8 bytes: 8 or 4 values
    constexpr int kPer = int(sizeof(Vec)) / 2;
    if (full && aligned(p, sizeof(Vec))) {
#pragma unroll
      for (int j = 0; j < N / kPer; ++j) unpack_halves(dt, __ldg(reinterpret_cast<const Vec*>(p) + j), x + kPer * j);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < N; ++j) x[j] = c0 + j < C ? half_bits(dt, __ldg(p + j)) : 0.f;
}

__device__ __forceinline__ float load_one(const void* base, DType dt, int64_t off) {
  if (dt == DType::kFP32) return __ldg(static_cast<const float*>(base) + off);
  return half_bits(dt, __ldg(static_cast<const unsigned short*>(base) + off));
}

// o columns c0 .. c0 + C - 1 (those < V; C = 4 or 8) of one token row at element offset off.
template <int C>
__device__ __forceinline__ void store_o(void* base, DType dt, int64_t off, int c0, int V, const float (&x)[C]) {
  if (dt == DType::kFP32) {
    float* p = static_cast<float*>(base) + off;
    if (c0 + C <= V && aligned(p, 16)) {
#pragma unroll
      for (int j = 0; j < C / 4; ++j) reinterpret_cast<float4*>(p)[j] = make_float4(x[4 * j], x[4 * j + 1], x[4 * j + 2], x[4 * j + 3]);
      return;
    }
#pragma unroll
    for (int j = 0; j < C; ++j)
      if (c0 + j < V) p[j] = x[j];
    return;
  }
  unsigned short* p = static_cast<unsigned short*>(base) + off;
  if (c0 + C <= V && aligned(p, 2 * C)) {
    if constexpr (C == 8) {
      const uint2 lo = pack_halves4(dt, {x[0], x[1], x[2], x[3]}), hi = pack_halves4(dt, {x[4], x[5], x[6], x[7]});
      *reinterpret_cast<uint4*>(p) = make_uint4(lo.x, lo.y, hi.x, hi.y);
    } else {
      *reinterpret_cast<uint2*>(p) = pack_halves4(dt, x);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < C; ++j)
    if (c0 + j < V) p[j] = to_half_bits(dt, x[j]);
}

__device__ __forceinline__ int64_t load_index(const void* p, bool i64, int64_t off) {
  return i64 ? __ldg(static_cast<const long long*>(p) + off) : int64_t(__ldg(static_cast<const int*>(p) + off));
}

using kda::sigmoid;

// One token's inputs for this thread as floats: q, k, g of its R rows (raw), v of its C columns, β (raw).
template <int R, int C>
struct Token {
  float q[R], k[R], g[R], v[C], beta;
};

__device__ __forceinline__ int64_t tok_off(const KdaDecodeTensor& t, int b, int tok, int h) {
  return int64_t(b) * t.sb + int64_t(tok) * t.st + int64_t(h) * t.sh;
}

// The token loads. In = void: any dtypes and alignments (element loads where a vector would not be
// aligned; converted at once). In = float / __nv_bfloat16 (K = V = 128, every input and o of that dtype,
// the vector accesses aligned: the dispatch checked): the raw vectors are loaded first and converted
// at use (get), so a token's loads are in flight together with the index and state loads.
template <int R, class In, int C>
struct TokenLoad {
  Token<R, C> x;
  __device__ __forceinline__ void load(const KdaDecodeParams& p, int b, int tok, int h, int hq, int row0, int c0) {
    load_vec<R>(p.q.data, p.q.dtype, tok_off(p.q, b, tok, hq) + row0, row0, p.K, x.q);
    load_vec<R>(p.k.data, p.k.dtype, tok_off(p.k, b, tok, hq) + row0, row0, p.K, x.k);
    load_vec<R>(p.g.data, p.g.dtype, tok_off(p.g, b, tok, h) + row0, row0, p.K, x.g);
    load_vec<C>(p.v.data, p.v.dtype, tok_off(p.v, b, tok, h) + c0, c0, p.V, x.v);
    x.beta = load_one(p.beta.data, p.beta.dtype, tok_off(p.beta, b, tok, h));
  }
  __device__ __forceinline__ const Token<R, C>& get() const { return x; }
};

template <int C>
struct TokenLoad<8, float, C> {
  float4 q[2], k[2], g[2], v[C / 4];
  float beta;
  Token<8, C> x;
  __device__ __forceinline__ void load(const KdaDecodeParams& p, int b, int tok, int h, int hq, int row0, int c0) {
    const float4* pq = reinterpret_cast<const float4*>(static_cast<const float*>(p.q.data) + tok_off(p.q, b, tok, hq) + row0);
    const float4* pk = reinterpret_cast<const float4*>(static_cast<const float*>(p.k.data) + tok_off(p.k, b, tok, hq) + row0);
    const float4* pg = reinterpret_cast<const float4*>(static_cast<const float*>(p.g.data) + tok_off(p.g, b, tok, h) + row0);
    q[0] = __ldg(pq), q[1] = __ldg(pq + 1), k[0] = __ldg(pk), k[1] = __ldg(pk + 1), g[0] = __ldg(pg), g[1] = __ldg(pg + 1);
    const float4* pv = reinterpret_cast<const float4*>(static_cast<const float*>(p.v.data) + tok_off(p.v, b, tok, h) + c0);
#pragma unroll
    for (int j = 0; j < C / 4; ++j) v[j] = __ldg(pv + j);
    beta = __ldg(static_cast<const float*>(p.beta.data) + tok_off(p.beta, b, tok, h));
  }
  __device__ __forceinline__ const Token<8, C>& get() {
    auto put = [](const float4* a, float* y, int n) {
      for (int j = 0; j < n; ++j) y[4 * j] = a[j].x, y[4 * j + 1] = a[j].y, y[4 * j + 2] = a[j].z, y[4 * j + 3] = a[j].w;
    };
    put(q, x.q, 2), put(k, x.k, 2), put(g, x.g, 2), put(v, x.v, C / 4);
    x.beta = beta;
    return x;
  }
};

template <int C>
struct TokenLoad<8, __nv_bfloat16, C> {
  uint4 q, k, g;
  std::conditional_t<C == 8, uint4, uint2> v;
  unsigned short beta;
  Token<8, C> x;
  __device__ __forceinline__ void load(const KdaDecodeParams& p, int b, int tok, int h, int hq, int row0, int c0) {
    auto at = [](const KdaDecodeTensor& t, int64_t off) { return static_cast<const unsigned short*>(t.data) + off; };
    q = __ldg(reinterpret_cast<const uint4*>(at(p.q, tok_off(p.q, b, tok, hq) + row0)));
    k = __ldg(reinterpret_cast<const uint4*>(at(p.k, tok_off(p.k, b, tok, hq) + row0)));
    g = __ldg(reinterpret_cast<const uint4*>(at(p.g, tok_off(p.g, b, tok, h) + row0)));
    v = __ldg(reinterpret_cast<const decltype(v)*>(at(p.v, tok_off(p.v, b, tok, h) + c0)));
    beta = __ldg(at(p.beta, tok_off(p.beta, b, tok, h)));
  }
  __device__ __forceinline__ const Token<8, C>& get() {
    unpack_halves(DType::kBF16, q, x.q), unpack_halves(DType::kBF16, k, x.k), unpack_halves(DType::kBF16, g, x.g);
    unpack_halves(DType::kBF16, v, x.v);
    x.beta = half_bits(DType::kBF16, beta);
    return x;
  }
};

// The varlen token table of a launch: sequence n0 + i has tokens [begin[i], begin[i + 1]) of batch row 0.
template <int kSeqs>
struct SeqTable {
  int32_t begin[kSeqs + 1];
};

// The block-wide sums of one token: per column S̄ᵀk, S̄ᵀq over the K rows, and Σq², Σk², Σqk. Shuffles over
// the warp's 4 row groups, then the warps' partials through shared memory buffer buf (one barrier).
template <int C>
struct TokenSums {
  float PK[C], PQ[C], QQ, KK, QK;
};
template <int C>
__device__ __forceinline__ void block_sums(float (&pk)[C], float (&pq)[C], float qq, float kk, float qk, int buf,
                                           float (&red)[2][kWarps][kColLanes][2 * C], float (&scal)[2][kWarps][4], TokenSums<C>& out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, cl = lane & 7, rl = lane >> 3;
#pragma unroll
  for (int o = 8; o < 32; o <<= 1) {  // over the warp's 4 row groups (lane bits 3, 4)
#pragma unroll
    for (int c = 0; c < C; ++c) {
      pk[c] += __shfl_xor_sync(0xffffffffu, pk[c], o);
      pq[c] += __shfl_xor_sync(0xffffffffu, pq[c], o);
    }
    qq += __shfl_xor_sync(0xffffffffu, qq, o);
    kk += __shfl_xor_sync(0xffffffffu, kk, o);
    qk += __shfl_xor_sync(0xffffffffu, qk, o);
  }
  if (rl == 0) {
#pragma unroll
    for (int j = 0; j < C / 4; ++j) {
      *reinterpret_cast<float4*>(&red[buf][warp][cl][4 * j]) = make_float4(pk[4 * j], pk[4 * j + 1], pk[4 * j + 2], pk[4 * j + 3]);
      *reinterpret_cast<float4*>(&red[buf][warp][cl][C + 4 * j]) = make_float4(pq[4 * j], pq[4 * j + 1], pq[4 * j + 2], pq[4 * j + 3]);
    }
  }
  if (lane == 0) scal[buf][warp][0] = qq, scal[buf][warp][1] = kk, scal[buf][warp][2] = qk;
  __syncthreads();  // buffer buf is rewritten at token t + 2, after every thread passed token t + 1's barrier
#pragma unroll
  for (int c = 0; c < C; ++c) out.PK[c] = out.PQ[c] = 0.f;
  out.QQ = out.KK = out.QK = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
#pragma unroll
    for (int c = 0; c < C; ++c) out.PK[c] += red[buf][w][cl][c], out.PQ[c] += red[buf][w][cl][C + c];
    out.QQ += scal[buf][w][0], out.KK += scal[buf][w][1], out.QK += scal[buf][w][2];
  }
}

// From a token's block sums, this thread's 4 columns of u = β (v − S̄ᵀk̂) and o = scale (S̄ᵀq̂ + (k̂ᵀq̂) u);
// returns k's L2-norm factor (1 without the norm).
template <int R, int C>
__device__ __forceinline__ float token_out(const KdaDecodeParams& p, const Token<R, C>& x, const TokenSums<C>& s, float (&u)[C],
                                           float (&out)[C]) {
  const float rq = p.l2norm ? 1.f / sqrtf(s.QQ + 1e-6f) : 1.f, rk = p.l2norm ? 1.f / sqrtf(s.KK + 1e-6f) : 1.f;
  const float beta = p.beta_sigmoid ? p.beta_scale * sigmoid(x.beta) : x.beta;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    u[c] = beta * (x.v[c] - rk * s.PK[c]);
    out[c] = p.scale * rq * fmaf(rk * s.QK, u[c], s.PQ[c]);
  }
  return rk;
}

// C state columns of one row as loaded, in the pool's dtype (the single-token kernels): fp32 one or two
// 16-byte words, bf16 an 8-byte (C = 4) or 16-byte (C = 8) word; unpacked to floats at use.
template <class St, int C>
struct PackedRow {
  static constexpr int kBytes = C * int(sizeof(St));
  using Vec = std::conditional_t<kBytes == 8, uint2, uint4>;
  static constexpr int kVecs = kBytes / int(sizeof(Vec));
  Vec w[kVecs];
  __device__ __forceinline__ void load(const St* p) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) w[i] = __ldcs(reinterpret_cast<const Vec*>(p) + i);
  }
  __device__ __forceinline__ void store(St* p) const {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) __stcs(reinterpret_cast<Vec*>(p) + i, w[i]);
  }
  __device__ __forceinline__ void unpack(float (&x)[C]) const {
    const unsigned* u = reinterpret_cast<const unsigned*>(w);
    if constexpr (std::is_same_v<St, float>) {
#pragma unroll
      for (int j = 0; j < C; ++j) x[j] = __uint_as_float(u[j]);
    } else {
#pragma unroll
      for (int j = 0; j < C / 2; ++j) half_pair(DType::kBF16, u[j], x[2 * j], x[2 * j + 1]);
    }
  }
  __device__ __forceinline__ void pack(const float (&x)[C]) {
    unsigned* u = reinterpret_cast<unsigned*>(w);
    if constexpr (std::is_same_v<St, float>) {
#pragma unroll
      for (int j = 0; j < C; ++j) u[j] = __float_as_uint(x[j]);
    } else {
#pragma unroll
      for (int j = 0; j < C / 2; ++j) {  // one cvt.rn.bf16x2.f32 a pair (x[2j] in the lower half)
        const __nv_bfloat162 b = __floats2bfloat162_rn(x[2 * j], x[2 * j + 1]);
        u[j] = *reinterpret_cast<const unsigned*>(&b);
      }
    }
  }
};

// exp of the activated gate of one state row (0 for rows past K: in_range false), in log2 units on one
// exp2 (the chunk kernel's form): softplus(x) log2 e = log2(1 + 2^y), y = x log2 e, by softplus_log2
// (relative error <= 2.5e-5 for every y, small values included, where log(1 + e^x) would round 1 + e^x
// to 1). gate: p.gate_in_kernel (passed in: read once by the caller, which keeps the multi-token kernels'
// registers); gl: the gate input (the log-gate itself without it); bias: dt_bias of the row, ea: e^A_log
// (0 and 1 without them).
__device__ __forceinline__ float decay(const KdaDecodeParams& p, bool gate, float gl, float bias, float ea, bool in_range) {
  float l2 = gl * kLog2e;
  if (gate) {
    const float x = gl + bias;
    if (p.lower_bound_gate) {
      l2 = kLog2e * p.lower_bound / (1.f + __expf(-ea * x));
    } else {
      const float y = x * kLog2e;
      l2 = -ea * softplus_log2(y, fast_exp2(-fabsf(y)));
    }
  }
  return in_range ? fast_exp2(l2) : 0.f;
}
// The index contract of the pool modes (kSlots, kTokenSlots; kda_decode.cu's header comment) for a
// sequence of len >= 1 tokens: num_accepted_tokens[n] (1 without it), then the start index idx[n,
// accepted - 1] and (kTokenSlots) every token's idx[n, t]. read: the slot read (< 0: padding: o rows 0, the
// pool untouched); bad: accepted outside [1, S], the start index or, kTokenSlots, a per-token index >= P
// (NaN o rows, nothing written).
struct SlotPlan {
  int64_t read;
  bool bad;
};
__device__ __forceinline__ SlotPlan resolve_slots(const KdaDecodeParams& p, int n, int len) {
  const int64_t accepted = p.nat ? load_index(p.nat, p.nat64, int64_t(n) * p.nat_s0) : 1;
  const int64_t col = accepted >= 1 && accepted <= p.S ? accepted - 1 : 0, row = int64_t(n) * p.idx_s0;
  SlotPlan r;
  r.read = load_index(p.idx, p.idx64, row + col * p.idx_s1);
  const int64_t first = p.mode == KdaDecodeMode::kTokenSlots ? load_index(p.idx, p.idx64, row) : r.read;  // beside the start
  r.bad = accepted < 1 || accepted > p.S || r.read >= p.P;
  if (r.bad || r.read < 0 || p.mode != KdaDecodeMode::kTokenSlots) return r;
  r.bad = first >= p.P;
  for (int t = 1; t < len; ++t) r.bad |= load_index(p.idx, p.idx64, row + int64_t(t) * p.idx_s1) >= p.P;
  return r;
}

// The len token rows of o, columns col0 .. col0 + cols - 1 (those < V), of a padding sequence (0) or one
// with bad indices (NaN), by the block's threads.
__device__ __forceinline__ void fill_o(const KdaDecodeParams& p, int b, int begin, int len, int h, int col0, int cols, int V, bool bad) {
  const float fill = bad ? __int_as_float(0x7fffffff) : 0.f;
  for (int e = int(threadIdx.x); e < len * cols; e += kThreads) {
    const int t = e / cols, c = col0 + e % cols;
    if (c >= V) continue;
    const int64_t off = int64_t(b) * p.o_sb + int64_t(begin + t) * p.o_st + int64_t(h) * p.o_sh + c;
    if (p.o_dtype == DType::kFP32) static_cast<float*>(p.o)[off] = fill;
    else static_cast<unsigned short*>(p.o)[off] = to_half_bits(p.o_dtype, fill);
  }
}

// The slot sequence n's block starts from (-1: zeros) into *read; false when the block is done: a pool
// mode's padding sequence (o rows 0) or bad indices (NaN o rows, nothing written), its o columns col0 ..
// col0 + cols - 1 of V filled by fill_o. kStates: row n when there is an initial state.
__device__ __forceinline__ bool start_slot(const KdaDecodeParams& p, int n, int b, int begin, int len, int h, int col0, int cols,
                                           int V, int64_t* read) {
  *read = -1;
  if (p.mode == KdaDecodeMode::kStates) {
    if (p.init) *read = n;
    return true;
  }
  const SlotPlan slots = resolve_slots(p, n, len);
  *read = slots.read;
  if (!slots.bad && slots.read >= 0) return true;
  fill_o(p, b, begin, len, h, col0, cols, V, slots.bad);
  return false;
}

}  // namespace encore::cuda::decode
