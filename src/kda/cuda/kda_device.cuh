// Device helpers shared by the two KDA forward kernels (kda_chunk.cu, kda_state.cu): the per
// (chunk, head) workspace layout that connects them, input loads, the raw-tile layout and its TMA
// copy, and the warp-level bf16 tensor-core product on shared-memory tiles.
//
// Workspace, per (chunk slot, head), bytes; head dims padded to 128 with zeros; all written by the
// chunk kernel in the state kernel's shared-memory layout, so that one bulk copy moves W .. dC and a
// second one the block's slice of U. The bf16 tiles are wgmma operands in the 128-byte swizzled
// layout (tile_at: [C / 64][rows][64], the 16-byte pieces of row i permuted by XOR with i % 8; each
// tile 1024-byte aligned in the record, so a 1024-byte aligned copy of it is what wgmma expects):
//   W    bf16 [64][128]   A (β k ⊙ 2^G)                   (rows = chunk tokens, K = key channels)
//   Kg   bf16 [64][128]   k ⊙ 2^(gC − G)                  (the state kernel's A = Kgᵀ: MN-major)
//   Qg   bf16 [64][128]   s q ⊙ 2^G
//   Aqk  bf16 [2][64][64] s (q k^T ⊙ decay), zero above the diagonal, as hi + lo planes
//   dC   fp32 [128]       2^gC, the chunk's total decay per key channel
//   U    fp32 [8][64][16] A (β v), by 16-column slices of the value channels (u_at)
// A value x in hi + lo planes is hi = bf16(x), lo = bf16(x − hi) (split_bf16): the state kernel's
// output product takes hi·hi + hi·lo + lo·hi of Aqk and Vnew, so both enter with ~16 significant
// bits (their single bf16 roundings were two of the five largest error terms,
// scripts/kda_rounding_model.py).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda/bulk_copy.cuh"
#include "common/cuda/fast_math.cuh"
#include "common/cuda/launch_check.hpp"
#include "kda/cuda/launch.hpp"

namespace encore::cuda::kda {

constexpr int kC = 64;    // chunk rows
constexpr int kD = 128;   // padded head dim (K, V <= 128 on CUDA)
constexpr int kLd = kD + 8;  // bf16 row stride of [*, 128] shared tiles: conflict-free mma fragments
constexpr int kLdC = kC + 8; // bf16 row stride of [*, 64] shared tiles

// Value-column blocks per head of a state kernel of `columns` columns (its grid: H of these x N).
__host__ __device__ constexpr int state_column_blocks(int V, int columns) { return (V + columns - 1) / columns; }

constexpr int kUSlice = 16;  // value columns per U slice: a state block of kVs columns copies kVs / 16 adjacent slices
// Element (i, c) of U in the record's slices, fp32 [128 / 16][64][16]: the pair (c, c + 1) of row i
// (c even) sits at column c ^ 8 in rows with bit 1 set, so that the pair loads and stores of four
// rows x four pairs (a half-warp of an accumulator fragment) fall in distinct banks.
__host__ __device__ constexpr int u_at(int i, int c) { return (c / kUSlice) * (kC * kUSlice) + i * kUSlice + ((c % kUSlice) ^ (((i >> 1) & 1) << 3)); }

struct WsLayout {  // byte offsets inside one (chunk, head) record
  static constexpr int64_t kTile = int64_t(kC) * kD * 2;  // W, Kg, Qg
  static constexpr int64_t kW = 0;
  static constexpr int64_t kKg = kW + kTile;
  static constexpr int64_t kQg = kKg + kTile;
  static constexpr int64_t kAqk = kQg + kTile;
  static constexpr int64_t kAqkPlane = int64_t(kC) * kC;  // elements from hi to lo
  static constexpr int64_t kDC = kAqk + 2 * kAqkPlane * 2;
  static constexpr int64_t kU = kDC + kD * 4;  // = bytes of W .. dC, the first bulk copy
  static constexpr int64_t kUSliceBytes = int64_t(kC) * kUSlice * 4;
  static constexpr int64_t kBytes = kU + (kD / kUSlice) * kUSliceBytes;
};
static_assert(WsLayout::kKg % 1024 == 0 && WsLayout::kQg % 1024 == 0 && WsLayout::kAqk % 1024 == 0 &&
                  (WsLayout::kAqk + WsLayout::kAqkPlane * 2) % 1024 == 0,
              "swizzled tiles 1024-byte aligned in the record");
static_assert(WsLayout::kBytes % 16 == 0 && WsLayout::kU % 16 == 0 && WsLayout::kDC % 16 == 0 && WsLayout::kUSliceBytes % 16 == 0,
              "16-byte parts");

__device__ __forceinline__ const unsigned char* ws_record(const void* ws, int slot, int H, int h) {
  return static_cast<const unsigned char*>(ws) + (int64_t(slot) * H + h) * WsLayout::kBytes;
}
__device__ __forceinline__ unsigned char* ws_record(void* ws, int slot, int H, int h) {
  return const_cast<unsigned char*>(ws_record(static_cast<const void*>(ws), slot, H, h));
}
// The one-launch forward's flags after the slots x H records: one uint64 per chunk item (h · slots + slot).
__device__ __forceinline__ unsigned long long* chunk_flags(void* ws, int slots, int H) {
  return reinterpret_cast<unsigned long long*>(static_cast<unsigned char*>(ws) + int64_t(slots) * H * WsLayout::kBytes);
}

__device__ __forceinline__ float load(const KdaTensor& t, int b, int tok, int h, int c) {
  const int64_t off = int64_t(b) * t.sb + int64_t(tok) * t.st + int64_t(h) * t.sh + c;
  if (t.dtype == DType::kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(t.data)[off]);
  if (t.dtype == DType::kFP16) return __half2float(static_cast<const __half*>(t.data)[off]);
  return static_cast<const float*>(t.data)[off];
}

// Eight bf16 values (one 16-byte word) as floats.
__device__ __forceinline__ void unpack8(const uint4& u, float (&x)[8]) {
  const auto* p2 = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __bfloat1622float2(p2[e]);
    x[2 * e] = f.x;
    x[2 * e + 1] = f.y;
  }
}

// Eight fp16 values (one 16-byte word) as floats.
__device__ __forceinline__ void unpack8_half(const uint4& u, float (&x)[8]) {
  const auto* p2 = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __half22float2(p2[e]);
    x[2 * e] = f.x;
    x[2 * e + 1] = f.y;
  }
}

// Channels c0..c0+7 of token `tok` (zeros at c >= C): one 16-byte load (bf16, fp16) or two (fp32) when
// the address is 16-byte aligned and all eight are in range, element loads otherwise.
__device__ __forceinline__ void load8(const KdaTensor& t, int b, int tok, int h, int c0, int C, float (&x)[8]) {
  const int64_t off = int64_t(b) * t.sb + int64_t(tok) * t.st + int64_t(h) * t.sh + c0;
  const bool bf = t.dtype == DType::kBF16, hf = t.dtype == DType::kFP16;
  const char* ptr = static_cast<const char*>(t.data) + off * (bf || hf ? 2 : 4);
  if (c0 + 8 <= C && (reinterpret_cast<uintptr_t>(ptr) & 15) == 0) {
    if (bf) {
      unpack8(__ldg(reinterpret_cast<const uint4*>(ptr)), x);
    } else if (hf) {
      unpack8_half(__ldg(reinterpret_cast<const uint4*>(ptr)), x);
    } else {
      const float4 lo = __ldg(reinterpret_cast<const float4*>(ptr)), hi = __ldg(reinterpret_cast<const float4*>(ptr) + 1);
      x[0] = lo.x, x[1] = lo.y, x[2] = lo.z, x[3] = lo.w, x[4] = hi.x, x[5] = hi.y, x[6] = hi.z, x[7] = hi.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = c0 + e < C ? load(t, b, tok, h, c0 + e) : 0.f;
  }
}

__device__ __forceinline__ void store(void* base, DType dt, int64_t off, float x) {
  if (dt == DType::kBF16) static_cast<__nv_bfloat16*>(base)[off] = __float2bfloat16(x);
  else if (dt == DType::kFP16) static_cast<__half*>(base)[off] = __float2half_rn(x);
  else static_cast<float*>(base)[off] = x;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (lower address / lower k)
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Two values as bf16 hi + lo pairs: *hi = (bf16(x), bf16(y)), *(hi + plane) = the remainders.
__device__ __forceinline__ void split_bf16(float x, float y, __nv_bfloat16* hi, int64_t plane) {
  const float rx = x - __bfloat162float(__float2bfloat16(x)), ry = y - __bfloat162float(__float2bfloat16(y));
  *reinterpret_cast<uint32_t*>(hi) = pack_bf16(x, y);
  *reinterpret_cast<uint32_t*>(hi + plane) = pack_bf16(rx, ry);
}

// Elements off and off + 1 (of which the first `n` exist: n <= 0 stores nothing): one 4-byte (bf16,
// fp16) or 8-byte (fp32) store when both exist and the address is aligned for it, element stores otherwise.
__device__ __forceinline__ void store_pair(void* base, DType dt, int64_t off, float x, float y, int n) {
  if (n <= 0) return;
  if (dt == DType::kBF16) {
    auto* p = static_cast<__nv_bfloat16*>(base) + off;
    if (n >= 2 && (reinterpret_cast<uintptr_t>(p) & 3) == 0) {
      *reinterpret_cast<uint32_t*>(p) = pack_bf16(x, y);
      return;
    }
  } else if (dt == DType::kFP16) {
    auto* p = static_cast<__half*>(base) + off;
    if (n >= 2 && (reinterpret_cast<uintptr_t>(p) & 3) == 0) {
      *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
      return;
    }
  } else {
    auto* p = static_cast<float*>(base) + off;
    if (n >= 2 && (reinterpret_cast<uintptr_t>(p) & 7) == 0) {
      *reinterpret_cast<float2*>(p) = make_float2(x, y);
      return;
    }
  }
  store(base, dt, off, x);
  if (n >= 2) store(base, dt, off + 1, y);
}

// Sequence of chunk slot `slot`: the last n with chunk_start[n] <= slot.
template <class P>  // KdaCudaProblem or KdaCudaProblemFew
__device__ __forceinline__ int find_seq(const P& p, int slot) {
  int lo = 0, hi = p.N - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.chunk_start[mid] <= slot) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// A raw input tile in shared memory: bf16 [64][128] (16 KB) as two boxes of 64 channels, each
// [64 rows][128 bytes] with the 16-byte pieces of row i permuted by XOR with i % 8 — the layout a
// TMA tile copy with 128-byte swizzle writes into a 1024-byte aligned box — so that 8 consecutive
// rows at the same channels fall in 8 different bank groups (a warp reading 32 rows of one
// 8-channel piece is conflict-free).
// The general form for tiles of kRows rows ([C / 64][kRows][64]; also the state kernel's transposed
// operands): the offset of row i, channels c0..c0+7 (c0 % 8 == 0), in elements (kUnit 1) or bytes
// (kUnit 2).
template <int kRows, int kUnit = 1>
__host__ __device__ constexpr int sw128_at(int i, int c0) {
  return (c0 >> 6) * (kRows * 64 * kUnit) + i * (64 * kUnit) + (((c0 >> 3) ^ i) & 7) * (8 * kUnit);
}
__device__ __forceinline__ int raw_at(int i, int c0) { return sw128_at<kC>(i, c0); }
// Element (i, c) of a 64-row tile in that layout (any c: the record's W, Kg, Qg and Aqk planes).
__device__ __forceinline__ int tile_at(int i, int c) { return raw_at(i, c & ~7) + (c & 7); }
constexpr int kRawTileBytes = kC * kD * 2;
constexpr int kRawBoxBytes = kC * 64 * 2;

// One TMA tile copy of the box at (channel c, head h, token t, batch b) of a 4-D tensor map (a
// __grid_constant__ parameter) into shared memory, counted on `bar`.
__device__ __forceinline__ void tma_load_4d(void* dst, const void* map, int c, int h, int t, int b, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(
          smem_addr(dst)),
      "l"(map), "r"(c), "r"(h), "r"(t), "r"(b), "r"(smem_addr(bar))
      : "memory");
}

// ---- mma.sync m16n8k16, bf16 inputs, fp32 accumulators ----------------------------------------
// Fragment ownership, lane = 4 g + t:
//   A 16x16 row-major: a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B 16x8 (k x n):    b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
//   C 16x8:            c0 c1 (g, 2t..2t+1)   c2 c3 (g+8, 2t..2t+1)
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- fp32 operands on bf16 tensor cores, as hi + lo pairs (x = hi + lo, ~16 significant bits) ----
// An fp32 pair as bf16 words: hi = (bf16(x), bf16(y)), lo = the remainders in bf16 — split_bf16's
// values, in registers (one packed conversion; expressing either through the other changes the SASS
// of the kernel that uses it, measured as it is).
__device__ __forceinline__ void split_pair(float x, float y, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h2 = __floats2bfloat162_rn(x, y);
  const float2 f = __bfloat1622float2(h2);
  hi = *reinterpret_cast<const uint32_t*>(&h2);
  lo = pack_bf16(x - f.x, y - f.y);
}
// The A fragment (16 x 16) at x of a row-major fp32 tile (row stride ld, even; x 8-byte aligned).
__device__ __forceinline__ void a_frag_split(const float* x, int ld, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 v = *reinterpret_cast<const float2*>(x + (g + 8 * (q & 1)) * ld + 2 * t + 8 * (q >> 1));
    split_pair(v.x, v.y, hi[q], lo[q]);
  }
}
// The A fragment of k-step ks from accumulator fragments c[2 ks], c[2 ks + 1] (a 16-row product
// used as the next product's A operand without leaving registers).
template <int N>
__device__ __forceinline__ void a_frag_split(const float (&c)[N][4], int ks, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) split_pair(c[2 * ks + (q >> 1)][2 * (q & 1)], c[2 * ks + (q >> 1)][2 * (q & 1) + 1], hi[q], lo[q]);
}
// The B fragment (16 x 8, k x n) at x of an fp32 tile stored [k][n] (row stride ld).
__device__ __forceinline__ void b_frag_split(const float* x, int ld, uint32_t (&hi)[2], uint32_t (&lo)[2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int q = 0; q < 2; ++q) split_pair(x[(2 * t + 8 * q) * ld + g], x[(2 * t + 8 * q + 1) * ld + g], hi[q], lo[q]);
}
// c[n] += a b[n] for split operands over N n-tiles: lo·hi + hi·lo + hi·hi (the lo·lo term, ~2^-16
// relative, is left out), the n-tiles interleaved so that no mma waits on the one before it.
template <int N>
__device__ __forceinline__ void mma_split(float (&c)[N][4], const uint32_t (&ahi)[4], const uint32_t (&alo)[4],
                                          const uint32_t (&bhi)[N][2], const uint32_t (&blo)[N][2]) {
#pragma unroll
  for (int n = 0; n < N; ++n) mma_bf16(c[n], alo, bhi[n]);
#pragma unroll
  for (int n = 0; n < N; ++n) mma_bf16(c[n], ahi, blo[n]);
#pragma unroll
  for (int n = 0; n < N; ++n) mma_bf16(c[n], ahi, bhi[n]);
}


// Four 8 x 8 bf16 matrices from shared memory (ldmatrix.x4): lane l gives the address of row l % 8
// of matrix l / 8 (16 contiguous bytes, 16-byte aligned); r[m] is matrix m in mma fragment order
// (lane 4 g + t holds row g, elements 2t and 2t + 1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* row) {
  const unsigned a = smem_addr(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// The same with each 8 x 8 matrix transposed on the way (ldmatrix.x4.trans): lane l gives row l % 8
// of matrix l / 8 as stored; r[m] holds, at lane 4 g + t, stored column g, rows 2t and 2t + 1.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* row) {
  const unsigned a = smem_addr(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// acc[m][n] (16 x 8 tiles) += A_m · B over k-step ks (k = 16 ks .. 16 ks + 15): A_m = 16 rows at
// `a` + m a_stride (row stride lda, k contiguous); B stored [n][k] (8 NT rows at `b`, k contiguous);
// bf16 in shared memory, rows 16-byte aligned. Each A tile's four 8 x 8 quarters come in one
// ldmatrix, two n-tiles of B in another, and each B fragment serves all MT A tiles.
template <int MT, int NT>
__device__ __forceinline__ void warp_mma_tiles_step(float (&acc)[MT][NT][4], const __nv_bfloat16* a, int lda, int a_stride,
                                                    const __nv_bfloat16* b, int ldb, int ks) {
  static_assert(NT % 2 == 0, "n-tiles come in pairs");
  const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
  uint32_t af[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    ldmatrix_x4(af[mt], a + mt * a_stride + (r + 8 * (m & 1)) * lda + 8 * (m >> 1) + 16 * ks);  // quarters (0,0) (8,0) (0,8) (8,8)
#pragma unroll
  for (int n = 0; n < NT; n += 2) {
    uint32_t bf[4];  // (n 0, k 0) (n 0, k 8) (n 8, k 0) (n 8, k 8) of n-tiles n, n + 1
    ldmatrix_x4(bf, b + (n * 8 + r + 8 * (m >> 1)) * ldb + 8 * (m & 1) + 16 * ks);
    const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mma_bf16(acc[mt][n], af[mt], b0);
      mma_bf16(acc[mt][n + 1], af[mt], b1);
    }
  }
}

// ---- the in-kernel gate (any problem type with K, dt_bias, A_log, gate_in_kernel, lower_bound_gate,
// lower_bound) ----------------------------------------------------------------------------------

// The gate's input x (raw g + dt_bias) and e^A_log (1 without A_log), for the in-kernel gate.
template <class P>
__device__ __forceinline__ float gate_input(const P& p, float raw, int h, int c) {
  return p.dt_bias ? raw + p.dt_bias[h * p.K + c] : raw;
}
template <class P>
__device__ __forceinline__ float gate_scale(const P& p, int h) {
  return p.A_log ? expf(p.A_log[h]) : 1.f;
}
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// The activated gate (natural log): the precomputed g, −e^A softplus(x), or lb · σ(e^A x).
template <class P>
__device__ __forceinline__ float gate_act(const P& p, float raw, int h, int c) {
  if (!p.gate_in_kernel) return raw;
  const float x = gate_input(p, raw, h, c), ea = gate_scale(p, h);
  return p.lower_bound_gate ? p.lower_bound * sigmoid(ea * x) : -ea * softplus(x);
}

// The in-kernel gate's backward at input x (raw g + dt_bias) with ea = e^A_log: dx = dy · d(gate)/dx,
// the gradient w.r.t. the g passed in (and dt_bias), and da = dy · d(gate)/dA_log.
// On the fast intrinsics (a few ulp; gradients): with e = exp(-|y|), sigmoid(y) = 1 / (1 + e) for
// y >= 0 and e / (1 + e) below, softplus(y) = max(y, 0) + log(1 + e).
template <class P>
__device__ __forceinline__ void gate_backward(const P& p, float dy, float x, float ea, float* dx, float* da) {
  const float y = p.lower_bound_gate ? ea * x : x;
  const float e = __expf(-fabsf(y)), r = __fdividef(1.f, 1.f + e), sg = y >= 0.f ? r : e * r;
  if (p.lower_bound_gate) {
    *dx = dy * p.lower_bound * sg * (1.f - sg) * ea;
    *da = *dx * x;
  } else {
    *dx = dy * -ea * sg;
    *da = dy * -ea * (fmaxf(y, 0.f) + __logf(1.f + e));
  }
}


}  // namespace encore::cuda::kda

namespace encore::cuda::kda {

// The two kernels of the forward, launched in order on `stream` by launch_kda_forward.
// blocks: the chunk kernel is persistent, this many blocks (one per SM, or fewer; at most one per item).
template <class P>  // KdaCudaProblem or KdaCudaProblemFew
Status launch_chunk_kernel(const P& p, void* ws, int blocks, cudaStream_t stream);
// columns: value columns per state-kernel block, 64, 32 or 16.
template <class P>
Status launch_state_kernel(const P& p, const void* ws, int columns, cudaStream_t stream);
// The whole forward in one kernel (kda_one_launch_kernel, kda_chunk.cu): the chunk items, then the state
// blocks of `columns`, connected by the flags after the records; epoch distinct per launch.
Status launch_one_kernel(const KdaCudaProblemFew& p, void* ws, int columns, unsigned long long epoch, cudaStream_t stream);

}  // namespace encore::cuda::kda
