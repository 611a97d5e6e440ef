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
// kernels) keep the slice packed as loaded (bf16: 16 registers, not 32) and unpack it at use, on the plan's
// width (KdaDecodePlan, kda/plan.cpp's rule): 32 columns a block (8 bf16 / 5 fp32 blocks an SM) or 8
// columns a thread, 64 a block (16-byte state accesses, 4 blocks an SM); with the plan's prefetch each
// block also sends the state slice of the block one wave after it (blockIdx + SMs x resident blocks) to
// L2 by one bulk prefetch a row. Every launch may be a programmatic dependent launch (p.pdl: the first
// instruction waits for the previous grid). The gate and decay in log2 units on one exp2 (softplus_log2).
// State traffic: loads and stores with the streaming cache hint (read once, written once). The varlen
// token table is a launch parameter sized to the launch (none for fixed length, 64 or 1024 sequences).
// The helpers are in kda_decode_parts.cuh.
//
// Index contract on the device (no host sync): a sequence whose num_accepted_tokens is outside
// [1, S], whose start index or any of its per-token indices ([N, S]) is >= P writes nothing to the pool
// and NaN into its rows of o (the error shows in the output); a start index < 0 is padding (o rows 0,
// the pool untouched). Duplicate slots among a call's sequences are the caller's contract (not checked).
// Constraints (dispatch): K, V <= 256; bf16 / fp16 / fp32 inputs and o with unit last stride; fp32 or
// bf16 states with contiguous [H, K, V] rows; fp32 A_log, dt_bias.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "common/cuda/pdl.cuh"
#include "kda/cuda/kda_decode.hpp"
#include "kda/cuda/kda_decode_parts.cuh"  // the kernels' building blocks

namespace encore::cuda {
namespace {

using namespace decode;

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


// The R state rows row0 .. row0 + R - 1 (those < K; others 0) of this thread's 4 columns from element
// offset base (row r at base + r V). St = void: the dtype at run time (all loads issued before any
// conversion); float / __nv_bfloat16: that dtype, vector accesses (the dispatch checked their alignment).
// vf (St = void only; fla's state_v_first): the state is stored transposed, element (row, column) at
// (base - row0 V - c0) + column K + row: one scalar access per element.
template <int R, class St>
__device__ __forceinline__ void load_rows(const void* data, DType dt, bool vec, int64_t base, int row0, int K, int c0, int V,
                                          float (&S)[R][4], bool vf = false) {
  if constexpr (std::is_void_v<St>) {
    if (vf) {
      const int64_t head = base - int64_t(row0) * V - c0;
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int64_t off = head + int64_t(c0 + c) * K + row0 + r;
          S[r][c] = row0 + r < K && c0 + c < V ? (dt == DType::kBF16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(data)[off])
                                                                      : static_cast<const float*>(data)[off])
                                               : 0.f;
        }
      return;
    }
  }
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
                                           const float (&S)[R][4], bool vf = false) {
  if constexpr (std::is_void_v<St>) {
    if (vf) {
      const int64_t head = base - int64_t(row0) * V - c0;
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          if (row0 + r < K && c0 + c < V) kda::store(data, dt, head + int64_t(c0 + c) * K + row0 + r, S[r][c]);
      return;
    }
  }
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


// The kernel (header comment at the top of this file). R: state rows per thread (16 R >= K). kDim: K = V
// = kDim known at compile time (row offsets become immediates), 0: p.K, p.V. In, St: the inputs' and the
// states' dtypes known at compile time (kDim 128 only), void: read at run time. kOne (compile-time kernels
// only): every sequence of the launch has at most one token; the state slice stays packed in its pool
// dtype in registers (bf16: half the registers of fp32), unpacked at use, so more blocks fit an SM and more
// state bytes are in flight. kC: value columns per thread (4; 8 for the single-token kernels at larger
// batches: 16-byte bf16 state accesses, 64 columns a block). kSeqs: the varlen token table's size.
// Resident blocks an SM the kernel is built for (its launch bounds).
template <int kDim, class St, bool kOne, int kC>
constexpr int kResident = !kOne       ? (kDim == 128 ? 4 : 2)
                           : kC == 8   ? kKdaDecodeResident64
                           : std::is_same_v<St, float> ? kKdaDecodeResident32Fp32
                                                       : kKdaDecodeResident32Bf16;

// bytes (a multiple of 16) from a 16-byte aligned global address into L2, without waiting (sm_90).
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(__cvta_generic_to_global(p)), "r"(bytes) : "memory");
}

template <int R, int kDim, class In, class St, bool kOne, int kC, int kSeqs>
__global__ void __launch_bounds__(kThreads, kResident<kDim, St, kOne, kC>)
    kda_decode_kernel(const __grid_constant__ KdaDecodeParams p, const __grid_constant__ SeqTable<kSeqs> table) {
  static_assert(kC == 4 || (kOne && kC == 8), "8 columns a thread: the single-token kernels only");
  wait_for_primary();   // PDL (p.pdl): the previous kernel's writes first
  launch_dependents();  // the next PDL launch may come in once every block has started
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

  // The slot this sequence starts from (-1: zeros); padding and bad indices end the block here.
  int64_t read_slot;
  if (!start_slot(p, n, b, begin, len, h, tile * kCols, kCols, V, &read_slot)) return;

  // The gate's per-head parameters (in-kernel gate): e^A_log and dt_bias of this thread's rows.
  const bool gate = p.gate_in_kernel;
  const float ea = gate && p.A_log ? expf(p.A_log[h]) : 1.f;
  float bias[R];
#pragma unroll
  for (int r = 0; r < R; ++r) bias[r] = 0.f;
  auto decay = [&](float gl, int r) { return decode::decay(p, gate, gl, bias[r], ea, row0 + r < K); };
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
      if (p.prefetch && tid < K) {  // row tid of the slice of the block one wave ahead, into L2 ([N] slots or rows)
        const unsigned ahead = blockIdx.x + unsigned(p.sm_count) * unsigned(kResident<kDim, St, kOne, kC>);
        if (ahead < gridDim.x && p.mode != KdaDecodeMode::kTokenSlots) {
          const int t2 = int(ahead % unsigned(tiles)), h2 = int((ahead / unsigned(tiles)) % unsigned(p.H));
          const int n2 = p.n0 + int(ahead / unsigned(tiles * p.H));
          const int64_t slot = p.mode == KdaDecodeMode::kStates ? int64_t(n2) : load_index(p.idx, p.idx64, int64_t(n2) * p.idx_s0);
          if (slot >= 0 && slot < p.P)
            prefetch_l2(static_cast<const St*>(p.init) + slot * p.init_stride + int64_t(h2) * K * V + int64_t(tid) * V + t2 * kCols,
                        unsigned(kCols * sizeof(St)));
        }
      }
    } else {
      float zero[kC] = {};
#pragma unroll
      for (int r = 0; r < R; ++r) st[r].pack(zero);
    }
    if (gate && p.dt_bias) load_vec<R>(p.dt_bias, DType::kFP32, int64_t(h) * K + row0, row0, K, bias);
    // kStates: row n (with a final state); kSlots: the slot read; kTokenSlots (len is 1 here): idx[n, 0], its
    // one token's state (read again, an L1 hit, rather than held in a register from resolve_slots)
    const int64_t write_row = p.mode == KdaDecodeMode::kStates ? (p.fin ? int64_t(n) : -1)
                              : p.mode == KdaDecodeMode::kSlots ? read_slot
                                                                : load_index(p.idx, p.idx64, int64_t(n) * p.idx_s0);
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
      load_rows<R, St>(p.init, p.init_dtype, p.init_vec, read_slot * p.init_stride + head_off, row0, K, c0, V, S, p.state_v_first);
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
        if (w >= 0) store_rows<R, St>(p.fin, p.fin_dtype, p.fin_vec, w * p.fin_stride + head_off, row0, K, c0, V, S, p.state_v_first);
      }
    }

    int64_t write_row = -1;  // the final state's row: the slot read (idx [N]) or row n (no indices)
    if (p.mode == KdaDecodeMode::kSlots) write_row = read_slot;
    else if (p.mode == KdaDecodeMode::kStates && p.fin) write_row = n;
    if (write_row >= 0) store_rows<R, St>(p.fin, p.fin_dtype, p.fin_vec, write_row * p.fin_stride + head_off, row0, K, c0, V, S, p.state_v_first);
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
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = pdl_config(dim3(blocks), dim3(kThreads), 0, s, p.pdl, attr);
    return launch_api("kda decode (kda_decode_kernel)",
                      [&] { return cudaLaunchKernelEx(&cfg, kda_decode_kernel<R, kDim, In, St, kOne, kC, kSeqs>, p, table); });
  };
  if (!begin) return go(SeqTable<0>{});
  if (p.N <= kKdaDecodeSeqTableSmall) return go(SeqTable<kKdaDecodeSeqTableSmall>{});
  return go(SeqTable<kKdaDecodeSeqTable>{});
}

// K = V = 128 with every input in one dtype (bf16 or fp32; o any), their vector accesses aligned, and
// aligned states of one dtype: the compile-time kernels. Launches whose sequences have at most one token
// take the single-token kernel p.kernel names (kda/plan.hpp's rule): 32 or 64 columns a block.
template <class In>
Status launch_fast(const KdaDecodeParams& p, const int32_t* begin, cudaStream_t s) {
  const bool same = p.mode != KdaDecodeMode::kStates || !p.init || !p.fin || p.init_dtype == p.fin_dtype;
  const DType st = p.init ? p.init_dtype : p.fin_dtype;
  if (!same) return launch_rows<8, 128>(p, begin, s);
  if (p.max_len > 1) {
    if (st == DType::kBF16) return launch_rows<8, 128, In, __nv_bfloat16>(p, begin, s);
    return launch_rows<8, 128, In, float>(p, begin, s);
  }
  if (p.states16 && p.kernel == KdaDecodeKernel::kHeads) return launch_kda_decode_heads(p, begin, s);
  const bool wide = p.states16 && p.kernel == KdaDecodeKernel::kColumns64;  // (p.prefetch: set with states16 only)
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
    const bool fast = p.fast && !p.state_v_first;  // the compile-time kernels take the [K, V] layout only
    if (fast && p.q.dtype == DType::kBF16) return launch_fast<__nv_bfloat16>(p, begin, s);
    if (fast && p.q.dtype == DType::kFP32) return launch_fast<float>(p, begin, s);
    return launch_rows<8, 128>(p, begin, s);
  }
  if (p.K <= 2 * kWarps * kRowLanes) return launch_rows<2>(p, begin, s);
  if (p.K <= 4 * kWarps * kRowLanes) return launch_rows<4>(p, begin, s);
  if (p.K <= 8 * kWarps * kRowLanes) return launch_rows<8>(p, begin, s);
  return launch_rows<16>(p, begin, s);
}

}  // namespace encore::cuda
