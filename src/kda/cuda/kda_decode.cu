// KDA decode: the recurrent step of include/encore/kda_serving.hpp (fla-core 0.6.0's
// fused_recurrent_kda_fwd) over a state pool, specialized for 1 to a few tokens per sequence (any
// length is correct). Per sequence, value head h and token t, with the transformed inputs (q̂, k̂
// L2-normed when asked, g the activated gate, β optionally σ(β) or 2σ(β)):
//   S̄ = diag(exp g_t) S;  e = v_t − S̄ᵀk̂;  u = β e;  S = S̄ + k̂ uᵀ;  o_t = scale · Sᵀq̂
// computed as o_t = scale · (S̄ᵀq̂ + (k̂ᵀq̂) u), so one pass over the state gives both S̄ᵀk and S̄ᵀq:
// the raw q, k enter the pass and the L2-norm factors (from Σq², Σk², Σqk of the same pass) scale the
// sums afterwards: one block-wide reduction (one barrier) per token.
//
// Work split (as fla's Triton kernel: a program per [K, 32-column] slice of one head's state, the
// tokens in a loop): a block of 128 threads per (sequence, value head, 32 value columns),
// blockIdx.x = (i · H + h) · tiles + tile. Warp w, lane l: column group l % 8 (columns 4 (l % 8) ..
// + 3 of the slice), row group 4 w + l / 8 holding the R contiguous state rows from (4 w + l / 8) · R
// (R = 2, 4, 8, 16 for K <= 32, 64, 128, 256): the fp32 slice lives in 4R registers per thread from the
// one load of the pool to the one store (a warp's load of one register row covers 4 state rows x 128
// bytes (fp32) / 64 bytes (bf16): full sectors). q, k, g of the thread's rows are one or two 16-byte
// loads (bf16), v 4 columns, β one value. The sums over K: in-thread over R rows, shuffles over the 4
// row groups of a warp, then the 4 warps' partials through shared memory (double-buffered by token
// parity, one barrier per token). bf16 pools convert on load and store; the state stays fp32 in
// registers across tokens. Single-token launches (every sequence <= 1 token, the decode step; compile-time
// kernels) keep the slice packed as loaded (bf16: 16 registers, not 32) and unpack it at use: at small
// batches 32 columns a block (8 bf16 / 5 fp32 blocks an SM), once the grid at 64 columns still covers every
// SM twice 8 columns a thread, 64 a block (16-byte bf16 state accesses, 128 B of state a thread in flight,
// 4 blocks an SM). The gate and decay in log2 units on one exp2 (softplus_log2). State traffic: loads and stores with the
// streaming cache hint (read once, written once). The varlen token table is a launch parameter sized to
// the launch (none for fixed length, 64 or 1024 sequences).
//
// Index contract on the device (no host sync): a sequence whose num_accepted_tokens is outside
// [1, S], whose start index or any of its per-token indices ([N, S]) is >= P writes nothing to the pool
// and NaN into its rows of o (the error shows in the output); a start index < 0 is padding (o rows 0,
// the pool untouched). Duplicate slots among a call's sequences are the caller's contract (not checked).
// Constraints (dispatch): K, V <= 256; bf16 / fp16 / fp32 inputs and o with unit last stride; fp32 or
// bf16 states with contiguous [H, K, V] rows; fp32 A_log, dt_bias.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/fast_math.cuh"  // fast_exp2
#include "common/cuda/launch_check.hpp"
#include "core/softplus_log2.hpp"
#include "kda/cuda/kda_decode.hpp"
#include "kda/cuda/kda_device.cuh"  // kda::sigmoid

namespace encore::cuda {
namespace {

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

// State columns c0 .. c0 + 3 of one row at element offset off (fp32 or bf16; 0 past V), streaming:
// vec = the 4-column vector access is aligned (the dispatch checked base, row stride and V).
__device__ __forceinline__ void load_state4(const void* base, DType dt, int64_t off, int c0, int V, bool vec, float (&x)[4]) {
  if (dt == DType::kFP32) {
    const float* p = static_cast<const float*>(base) + off;
    if (vec && c0 + 4 <= V) {
      const float4 f = __ldcs(reinterpret_cast<const float4*>(p));
      x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
      return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = c0 + j < V ? __ldcs(p + j) : 0.f;
    return;
  }
  const unsigned short* p = static_cast<const unsigned short*>(base) + off;
  if (vec && c0 + 4 <= V) {
    unpack_halves(DType::kBF16, __ldcs(reinterpret_cast<const uint2*>(p)), x);
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) x[j] = c0 + j < V ? half_bits(DType::kBF16, __ldcs(p + j)) : 0.f;
}

__device__ __forceinline__ void store_state4(void* base, DType dt, int64_t off, int c0, int V, bool vec, const float (&x)[4]) {
  if (dt == DType::kFP32) {
    float* p = static_cast<float*>(base) + off;
    if (vec && c0 + 4 <= V) {
      __stcs(reinterpret_cast<float4*>(p), make_float4(x[0], x[1], x[2], x[3]));
      return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (c0 + j < V) __stcs(p + j, x[j]);
    return;
  }
  unsigned short* p = static_cast<unsigned short*>(base) + off;
  if (vec && c0 + 4 <= V) {
    __stcs(reinterpret_cast<uint2*>(p), pack_halves4(DType::kBF16, x));
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (c0 + j < V) __stcs(p + j, to_half_bits(DType::kBF16, x[j]));
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

// C state columns of one row as loaded, in the pool's dtype (St known at compile time): fp32 one or two
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

// The R state rows row0 .. row0 + R - 1 (those < K; others 0) of this thread's 4 columns from element
// offset base (row r at base + r V). St = void: the dtype at run time (all loads issued before any
// conversion); float / __nv_bfloat16: that dtype, vector accesses (the dispatch checked their alignment).
template <int R, class St>
__device__ __forceinline__ void load_rows(const void* data, DType dt, bool vec, int64_t base, int row0, int K, int c0, int V,
                                          float (&S)[R][4]) {
  if constexpr (!std::is_void_v<St>) {
    PackedRow<St, 4> w[R];  // every row's load issued before any conversion
#pragma unroll
    for (int r = 0; r < R; ++r) w[r].load(static_cast<const St*>(data) + base + r * V);
#pragma unroll
    for (int r = 0; r < R; ++r) w[r].unpack(S[r]);
  } else {
    if (vec && c0 + 4 <= V) {  // whole vectors: the loads of all rows first
      if (dt == DType::kFP32) {
        const float* p = static_cast<const float*>(data) + base;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float4 f = row0 + r < K ? __ldcs(reinterpret_cast<const float4*>(p + int64_t(r) * V)) : make_float4(0.f, 0.f, 0.f, 0.f);
          S[r][0] = f.x, S[r][1] = f.y, S[r][2] = f.z, S[r][3] = f.w;
        }
      } else {
        const unsigned short* p = static_cast<const unsigned short*>(data) + base;
        uint2 raw[R];
#pragma unroll
        for (int r = 0; r < R; ++r) raw[r] = row0 + r < K ? __ldcs(reinterpret_cast<const uint2*>(p + int64_t(r) * V)) : make_uint2(0u, 0u);
#pragma unroll
        for (int r = 0; r < R; ++r) unpack_halves(DType::kBF16, raw[r], S[r]);
      }
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (row0 + r < K) load_state4(data, dt, base + int64_t(r) * V, c0, V, false, S[r]);
        else S[r][0] = S[r][1] = S[r][2] = S[r][3] = 0.f;
      }
    }
  }
}

template <int R, class St>
__device__ __forceinline__ void store_rows(void* data, DType dt, bool vec, int64_t base, int row0, int K, int c0, int V,
                                           const float (&S)[R][4]) {
  if constexpr (!std::is_void_v<St>) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      PackedRow<St, 4> w;
      w.pack(S[r]);
      w.store(static_cast<St*>(data) + base + r * V);
    }
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (row0 + r < K) store_state4(data, dt, base + int64_t(r) * V, c0, V, vec, S[r]);
  }
}

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

// The kernel (header comment at the top of this file). R: state rows per thread (16 R >= K). kDim: K = V
// = kDim known at compile time (row offsets become immediates), 0: p.K, p.V. In, St: the inputs' and the
// states' dtypes known at compile time (kDim 128 only), void: read at run time. kOne (compile-time kernels
// only): every sequence of the launch has at most one token; the state slice stays packed in its pool
// dtype in registers (bf16: half the registers of fp32), unpacked at use, so more blocks fit an SM and more
// state bytes are in flight. kC: value columns per thread (4; 8 for the single-token kernels at larger
// batches: 16-byte bf16 state accesses, 64 columns a block). kSeqs: the varlen token table's size.
template <int R, int kDim, class In, class St, bool kOne, int kC, int kSeqs>
__global__ void __launch_bounds__(kThreads, !kOne ? (kDim == 128 ? 4 : 2) : kC == 8 ? 4 : std::is_same_v<St, float> ? 5 : 8)
    kda_decode_kernel(const __grid_constant__ KdaDecodeParams p, const __grid_constant__ SeqTable<kSeqs> table) {
  static_assert(kC == 4 || (kOne && kC == 8), "8 columns a thread: the single-token kernels only");
  constexpr int kCols = kC * kColLanes;                              // value columns per block
  __shared__ __align__(16) float red[2][kWarps][kColLanes][2 * kC];  // per warp and column group: S̄ᵀk (kC), S̄ᵀq (kC)
  __shared__ float scal[2][kWarps][4];                               // per warp: Σq², Σk², Σqk
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, cl = lane & 7, rl = lane >> 3;
  const int K = kDim ? kDim : p.K, V = kDim ? kDim : p.V;
  const int tiles = (V + kCols - 1) / kCols;
  const int tile = int(blockIdx.x % unsigned(tiles)), h = int((blockIdx.x / unsigned(tiles)) % unsigned(p.H));
  const int i = int(blockIdx.x / unsigned(tiles * p.H)), n = p.n0 + i, hq = h / p.group;
  const int b = p.varlen ? 0 : n, begin = p.varlen ? table.begin[i] : 0, len = (p.varlen ? table.begin[i + 1] : p.T) - begin;
  const int row0 = (warp * kRowLanes + rl) * R, c0 = tile * kCols + cl * kC;
  const int64_t head_off = int64_t(h) * K * V + int64_t(row0) * V + c0;  // this thread's first state element in a row
  if (len == 0 && p.mode != KdaDecodeMode::kStates) return;  // no tokens: the pool is not touched

  // The first token's inputs first: their loads overlap the index and state loads below.
  TokenLoad<R, In, kC> tl;
  if (len > 0) tl.load(p, b, begin, h, hq, row0, c0);

  // The slot this sequence starts from (-1: zeros, or padding with indices) and whether its indices are bad.
  int64_t read_slot = -1;
  if (p.mode == KdaDecodeMode::kStates) {
    if (p.init) read_slot = n;
  } else {
    bool bad = false;
    int64_t col = 0;
    if (p.nat) {
      const int64_t a = load_index(p.nat, p.nat64, int64_t(n) * p.nat_s0);
      bad = a < 1 || a > p.S;
      col = bad ? 0 : a - 1;
    }
    if (!bad) {
      read_slot = load_index(p.idx, p.idx64, int64_t(n) * p.idx_s0 + col * p.idx_s1);
      bad = read_slot >= p.P;
    }
    if (!bad && read_slot >= 0 && p.mode == KdaDecodeMode::kTokenSlots)
      for (int t = 0; t < len; ++t) bad |= load_index(p.idx, p.idx64, int64_t(n) * p.idx_s0 + int64_t(t) * p.idx_s1) >= p.P;
    if (bad || read_slot < 0) {  // bad indices: NaN rows, nothing written to the pool; padding: zero rows
      const float fill = bad ? __int_as_float(0x7fffffff) : 0.f;
      for (int e = tid; e < len * kCols; e += kThreads) {
        const int t = e / kCols, c = tile * kCols + e % kCols;
        if (c >= V) continue;
        const int64_t off = int64_t(b) * p.o_sb + int64_t(begin + t) * p.o_st + int64_t(h) * p.o_sh + c;
        if (p.o_dtype == DType::kFP32) static_cast<float*>(p.o)[off] = fill;
        else static_cast<unsigned short*>(p.o)[off] = to_half_bits(p.o_dtype, fill);
      }
      return;
    }
  }

  // The gate's per-head parameters (in-kernel gate): e^A_log and dt_bias of this thread's rows.
  const bool gate = p.gate_in_kernel;
  const float ea = gate && p.A_log ? expf(p.A_log[h]) : 1.f;
  float bias[R];
#pragma unroll
  for (int r = 0; r < R; ++r) bias[r] = 0.f;
  // exp of the activated gate of row row0 + r (0 past K), in log2 units on one exp2 (the chunk kernel's
  // form): softplus(x) log2 e = log2(1 + 2^y), y = x log2 e, by softplus_log2 (relative error <= 2.5e-5 for
  // every y, small values included, where log(1 + e^x) would round 1 + e^x to 1).
  auto decay = [&](float gl, int r) {
    float l2 = gl * kLog2e;
    if (gate) {
      const float x = gl + bias[r];
      if (p.lower_bound_gate) {
        l2 = kLog2e * p.lower_bound / (1.f + __expf(-ea * x));
      } else {
        const float y = x * kLog2e;
        l2 = -ea * softplus_log2(y, fast_exp2(-fabsf(y)));
      }
    }
    return row0 + r < K ? fast_exp2(l2) : 0.f;
  };
  auto store_out = [&](int t, const float (&out)[kC]) {
    if (warp == 0 && rl == 0)
      store_o<kC>(p.o, p.o_dtype, int64_t(b) * p.o_sb + int64_t(begin + t) * p.o_st + int64_t(h) * p.o_sh + c0, c0, V, out);
  };

  if constexpr (kOne) {  // at most one token: the packed slice from one load to one store
    using Row = PackedRow<St, kC>;
    Row st[R];
    if (read_slot >= 0) {
      const St* src = static_cast<const St*>(p.init) + read_slot * p.init_stride + head_off;
#pragma unroll
      for (int r = 0; r < R; ++r) st[r].load(src + r * V);
    } else {
      float zero[kC] = {};
#pragma unroll
      for (int r = 0; r < R; ++r) st[r].pack(zero);
    }
    if (gate && p.dt_bias) load_vec<R>(p.dt_bias, DType::kFP32, int64_t(h) * K + row0, row0, K, bias);
    int64_t write_row = -1;  // kSlots: the slot read; kStates: row n; kTokenSlots: idx[n, 0] (its one token's state)
    if (p.mode == KdaDecodeMode::kSlots) write_row = read_slot;
    else if (p.mode == KdaDecodeMode::kStates) write_row = p.fin ? n : -1;
    else if (len == 1) write_row = load_index(p.idx, p.idx64, int64_t(n) * p.idx_s0);
    if (len == 1) {
      const Token<R, kC>& x = tl.get();
      float d[R], pk[kC] = {}, pq[kC] = {}, qq = 0.f, kk = 0.f, qk = 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        d[r] = decay(x.g[r], r);
        qq = fmaf(x.q[r], x.q[r], qq);
        kk = fmaf(x.k[r], x.k[r], kk);
        qk = fmaf(x.q[r], x.k[r], qk);
        float sr[kC];
        st[r].unpack(sr);
        if constexpr (kC == 8) {  // S̄ᵀk = Sᵀ(d ∘ k): two FMAs an element (the 4-column kernel: registers first)
          const float dk = d[r] * x.k[r], dq = d[r] * x.q[r];
#pragma unroll
          for (int c = 0; c < kC; ++c) {
            pk[c] = fmaf(sr[c], dk, pk[c]);
            pq[c] = fmaf(sr[c], dq, pq[c]);
          }
        } else {
#pragma unroll
          for (int c = 0; c < kC; ++c) {
            const float sd = sr[c] * d[r];
            pk[c] = fmaf(sd, x.k[r], pk[c]);
            pq[c] = fmaf(sd, x.q[r], pq[c]);
          }
        }
      }
      TokenSums<kC> sum;
      block_sums<kC>(pk, pq, qq, kk, qk, 0, red, scal, sum);
      float u[kC], out[kC];
      const float rk = token_out(p, x, sum, u, out);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float kr = rk * x.k[r];
        float sr[kC];
        st[r].unpack(sr);
#pragma unroll
        for (int c = 0; c < kC; ++c) sr[c] = fmaf(kr, u[c], sr[c] * d[r]);
        st[r].pack(sr);
      }
      store_out(0, out);
    }
    if (write_row >= 0) {
      St* dst = static_cast<St*>(p.fin) + write_row * p.fin_stride + head_off;
#pragma unroll
      for (int r = 0; r < R; ++r) st[r].store(dst + r * V);
    }
    return;
  } else {
    float S[R][4];
    if (read_slot >= 0) {
      load_rows<R, St>(p.init, p.init_dtype, p.init_vec, read_slot * p.init_stride + head_off, row0, K, c0, V, S);
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r) S[r][0] = S[r][1] = S[r][2] = S[r][3] = 0.f;
    }
    if (gate && p.dt_bias) load_vec<R>(p.dt_bias, DType::kFP32, int64_t(h) * K + row0, row0, K, bias);

#pragma unroll 1
    for (int t = 0; t < len; ++t) {
      if (t > 0) tl.load(p, b, begin + t, h, hq, row0, c0);
      const Token<R, 4>& x = tl.get();
      float pk[4] = {0.f, 0.f, 0.f, 0.f}, pq[4] = {0.f, 0.f, 0.f, 0.f}, qq = 0.f, kk = 0.f, qk = 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float d = decay(x.g[r], r);
        qq = fmaf(x.q[r], x.q[r], qq);
        kk = fmaf(x.k[r], x.k[r], kk);
        qk = fmaf(x.q[r], x.k[r], qk);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          S[r][c] *= d;
          pk[c] = fmaf(S[r][c], x.k[r], pk[c]);
          pq[c] = fmaf(S[r][c], x.q[r], pq[c]);
        }
      }
      TokenSums<4> sum;
      block_sums<4>(pk, pq, qq, kk, qk, t & 1, red, scal, sum);
      float u[4], out[4];
      const float rk = token_out(p, x, sum, u, out);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float kr = rk * x.k[r];
#pragma unroll
        for (int c = 0; c < 4; ++c) S[r][c] = fmaf(kr, u[c], S[r][c]);
      }
      store_out(t, out);
      if (p.mode == KdaDecodeMode::kTokenSlots) {  // the state after token t into slot idx[n, t] (skipped where < 0)
        const int64_t w = load_index(p.idx, p.idx64, int64_t(n) * p.idx_s0 + int64_t(t) * p.idx_s1);
        if (w >= 0) store_rows<R, St>(p.fin, p.fin_dtype, p.fin_vec, w * p.fin_stride + head_off, row0, K, c0, V, S);
      }
    }

    int64_t write_row = -1;  // the final state's row: the slot read (idx [N]) or row n (no indices)
    if (p.mode == KdaDecodeMode::kSlots) write_row = read_slot;
    else if (p.mode == KdaDecodeMode::kStates && p.fin) write_row = n;
    if (write_row >= 0) store_rows<R, St>(p.fin, p.fin_dtype, p.fin_vec, write_row * p.fin_stride + head_off, row0, K, c0, V, S);
  }
}

// The launch (a block per sequence, head and kC * 8 value columns) with the token table sized to the
// launch: fixed length carries none, <= 64 sequences a small one.
template <int R, int kDim = 0, class In = void, class St = void, bool kOne = false, int kC = 4>
Status launch_rows(const KdaDecodeParams& p, const int32_t* begin, cudaStream_t s) {
  const unsigned blocks = unsigned(int64_t(p.N) * p.H * ((p.V + kC * kColLanes - 1) / (kC * kColLanes)));
  auto go = [&](auto table) {
    using Table = decltype(table);
    if (begin)
      for (int i = 0; i <= p.N; ++i) table.begin[i] = begin[i];
    constexpr int kSeqs = int(sizeof(Table) / sizeof(int32_t)) - 1;
    return launch("kda decode (kda_decode_kernel)",
                  [&] { kda_decode_kernel<R, kDim, In, St, kOne, kC, kSeqs><<<blocks, kThreads, 0, s>>>(p, table); });
  };
  if (!begin) return go(SeqTable<0>{});
  if (p.N <= kKdaDecodeSeqTableSmall) return go(SeqTable<kKdaDecodeSeqTableSmall>{});
  return go(SeqTable<kKdaDecodeSeqTable>{});
}

// K = V = 128 with every input and o in one dtype (bf16 or fp32), their vector accesses aligned, and
// aligned states of one dtype: the compile-time kernels. Launches whose sequences have at most one token
// take the single-token kernels, with 8 columns a thread (64 a block) once the grid at 64 columns still
// fills every SM twice (fewer, wider blocks move more bytes each; at small batches the 32-column blocks
// spread the state over more SMs).
template <class In>
Status launch_fast(const KdaDecodeParams& p, const int32_t* begin, cudaStream_t s) {
  const bool same = p.mode != KdaDecodeMode::kStates || !p.init || !p.fin || p.init_dtype == p.fin_dtype;
  const DType st = p.init ? p.init_dtype : p.fin_dtype;
  if (!same) return launch_rows<8, 128>(p, begin, s);
  if (p.max_len > 1) {
    if (st == DType::kBF16) return launch_rows<8, 128, In, __nv_bfloat16>(p, begin, s);
    return launch_rows<8, 128, In, float>(p, begin, s);
  }
  const bool wide = p.states16 && int64_t(p.N) * p.H * 2 >= 2 * int64_t(p.sm_count);
  if (st == DType::kBF16)
    return wide ? launch_rows<8, 128, In, __nv_bfloat16, true, 8>(p, begin, s) : launch_rows<8, 128, In, __nv_bfloat16, true>(p, begin, s);
  return wide ? launch_rows<8, 128, In, float, true, 8>(p, begin, s) : launch_rows<8, 128, In, float, true>(p, begin, s);
}

}  // namespace

Status launch_kda_decode(const KdaDecodeParams& p, const int32_t* begin, int device, Stream stream) {
  const int64_t blocks = int64_t(p.N) * p.H * ((p.V + 4 * kColLanes - 1) / (4 * kColLanes));  // at 4 columns a thread (the most)
  if (blocks == 0) return Status::ok();
  if (blocks >= (int64_t(1) << 31) || p.K > kKdaDecodeMaxHeadDim || p.V > kKdaDecodeMaxHeadDim)
    return Status::unsupported("kda decode: grid of " + std::to_string(blocks) + " blocks or K = " + std::to_string(p.K) + ", V = " +
                               std::to_string(p.V) + " out of the kernel's range");
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.K == 128 && p.V == 128) {  // Kimi-Linear's heads
    if (p.fast && p.q.dtype == DType::kBF16) return launch_fast<__nv_bfloat16>(p, begin, s);
    if (p.fast && p.q.dtype == DType::kFP32) return launch_fast<float>(p, begin, s);
    return launch_rows<8, 128>(p, begin, s);
  }
  if (p.K <= 2 * kWarps * kRowLanes) return launch_rows<2>(p, begin, s);
  if (p.K <= 4 * kWarps * kRowLanes) return launch_rows<4>(p, begin, s);
  if (p.K <= 8 * kWarps * kRowLanes) return launch_rows<8>(p, begin, s);
  return launch_rows<16>(p, begin, s);
}

}  // namespace encore::cuda
