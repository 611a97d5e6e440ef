// KDA decode, the whole-head single-token kernel (KdaDecodeKernel::kHeads): the step of kda_decode.cu's
// header comment (S̄ = diag(exp g) S; u = β (v − S̄ᵀk̂); S = S̄ + k̂ uᵀ; o = scale (S̄ᵀq̂ + (k̂ᵀq̂) u)) for
// launches whose sequences have at most one token, K = V = 128, a block per (sequence, value head).
// The head's state ([K, V] contiguous in its slot: 32 KB bf16, 64 KB fp32) comes into shared memory
// by one bulk copy (cp.async.bulk, completion on an mbarrier) and leaves by one (cp.async.bulk store):
// no registers hold it in flight, so the bytes in flight an SM are the resident blocks' whole states
// (6 blocks x 32 KB bf16, 3 x 64 KB fp32) rather than the registers' share, and each block moves one
// contiguous range. While the copy is in flight the block loads the token (thread t: q, k, g of row t
// and v of column t), the decay d_t and the sums Σq², Σk², Σqk. Then thread t takes the column pair
// 2 (t % 64), + 1 and the 64 rows of half t / 64: pass 1 sums S̄ᵀk, S̄ᵀq over its rows (the two
// halves' partials added through shared memory), each thread of a pair forms u and o of its two
// columns, pass 2 writes S̄ + k̂ uᵀ back in place, and one thread stores the head.
// Constraints (launch_kda_decode_heads, checked): K = V = 128, every sequence <= 1 token, the fast path's
// inputs (q, k, v, g, beta of one dtype In, aligned), states of one dtype St (fp32 or bf16) with 16-byte
// aligned base and slot stride ([K, V] layout); o any of bf16 / fp16 / fp32, any alignment (pair stores
// where aligned). Index contract and padding as kda_decode.cu's kernels. The copy's wait traps after 2 s:
// like any device fault, that error ends the CUDA context.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/cuda/launch_check.hpp"
#include "common/cuda/pdl.cuh"
#include "kda/cuda/kda_decode.hpp"
#include "kda/cuda/kda_decode_parts.cuh"

namespace encore::cuda {
namespace {

using namespace decode;

constexpr int kHd = 128;            // K = V
constexpr int kHeadThreads = 128;   // a thread per row (token loads) and per (column pair, row half) (passes)
constexpr int kHalfRows = kHd / 2;  // rows of one pass half
static_assert(kHeadThreads == kThreads && kHeadThreads == kHd && kHeadThreads / 32 == 4,
              "a thread per row and column; fill_o's stride; the 4 warps' sums");

template <class St>
constexpr int kHeadBytes = kHd * kHd * int(sizeof(St));

// Shared memory of one block: the head's state, then the per-row factors and the passes' partials.
template <class St>
struct HeadSmem {
  alignas(128) unsigned char state[kHeadBytes<St>];
  float2 dkq[kHd];      // row r: (d_r k_r, d_r q_r), pass 1
  float2 dk[kHd];       // row r: (d_r, k_r), pass 2
  float v[kHd];         // column c: v_c
  float4 part[2][kHd / 2];  // per row half and column pair: (S̄ᵀk, S̄ᵀk, S̄ᵀq, S̄ᵀq) of columns c0, c0 + 1
  float sums[4][3];     // per warp: Σq², Σk², Σqk
  unsigned long long bar;
};

// Blocks an SM by shared memory (227 KB usable, 1 KB reserved a block): the launch bounds.
template <class St>
constexpr int kHeadResident = std::is_same_v<St, float> ? kKdaDecodeResidentHeadsFp32 : kKdaDecodeResidentHeadsBf16;
static_assert(kKdaDecodeResidentHeadsBf16 * (sizeof(HeadSmem<__nv_bfloat16>) + 1024) <= 233472 &&
                  kKdaDecodeResidentHeadsFp32 * (sizeof(HeadSmem<float>) + 1024) <= 233472,
              "the resident blocks' shared memory fits an SM (228 KB, 1 KB reserved a block)");

__device__ __forceinline__ unsigned smem_addr(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }

// bytes (multiple of 16) from global src into shared dst, completing on mbarrier bar (one thread).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem_addr(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits for phase 0 of bar; a copy still incomplete after 2 s traps (a launch error, not a hang).
__device__ __forceinline__ void wait_phase0(unsigned long long* bar) {
  unsigned done = 0;
  const unsigned long long t0 = global_ns();
  for (unsigned tries = 1; !done; ++tries) {
    if ((tries & 1023u) == 0 && global_ns() - t0 > 2000000000ull) __trap();
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar))
        : "memory");
  }
}

// bytes from shared src to global dst by one thread, waiting until src has been read (the block may exit).
__device__ __forceinline__ void bulk_store(void* dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(__cvta_generic_to_global(dst)),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

template <class In>
__device__ __forceinline__ float ld_in(const void* base, int64_t off) {
  if constexpr (std::is_same_v<In, float>) return __ldg(static_cast<const float*>(base) + off);
  else return __uint_as_float(unsigned(__ldg(static_cast<const unsigned short*>(base) + off)) << 16);
}

// Two state columns of one row in shared memory as floats, and back.
template <class St>
__device__ __forceinline__ float2 ld_pair(const unsigned char* state, int row, int c2) {
  if constexpr (std::is_same_v<St, float>) return reinterpret_cast<const float2*>(state)[row * (kHd / 2) + c2];
  else {
    const unsigned w = reinterpret_cast<const unsigned*>(state)[row * (kHd / 2) + c2];
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
}
template <class St>
__device__ __forceinline__ void st_pair(unsigned char* state, int row, int c2, float a, float b) {
  if constexpr (std::is_same_v<St, float>) reinterpret_cast<float2*>(state)[row * (kHd / 2) + c2] = make_float2(a, b);
  else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    reinterpret_cast<unsigned*>(state)[row * (kHd / 2) + c2] = *reinterpret_cast<const unsigned*>(&h);
  }
}

template <class In, class St, int kSeqs>
__global__ void __launch_bounds__(kHeadThreads, kHeadResident<St>)
    kda_decode_heads_kernel(const __grid_constant__ KdaDecodeParams p, const __grid_constant__ SeqTable<kSeqs> table) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  HeadSmem<St>& sm = *reinterpret_cast<HeadSmem<St>*>(smem_raw);
  wait_for_primary();
  launch_dependents();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int h = int(blockIdx.x % unsigned(p.H)), i = int(blockIdx.x / unsigned(p.H)), n = p.n0 + i, hq = h / p.group;
  const int b = p.varlen ? 0 : n, begin = p.varlen ? table.begin[i] : 0, len = (p.varlen ? table.begin[i + 1] : p.T) - begin;
  if (len == 0 && p.mode != KdaDecodeMode::kStates) return;  // no token: the pool is not touched

  int64_t read_slot;
  if (!start_slot(p, n, b, begin, len, h, 0, kHd, kHd, &read_slot)) return;
  const int64_t write_row = p.mode == KdaDecodeMode::kStates ? (p.fin ? int64_t(n) : -1)
                            : p.mode == KdaDecodeMode::kSlots ? read_slot
                                                              : load_index(p.idx, p.idx64, int64_t(n) * p.idx_s0);
  const int64_t head = int64_t(h) * kHd * kHd;  // elements
  if (read_slot >= 0) {
    if (tid == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(&sm.bar)) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // the init, seen by the copy's completion
      bulk_load(sm.state, static_cast<const St*>(p.init) + read_slot * p.init_stride + head, kHeadBytes<St>, &sm.bar);
    }
  } else {
    for (int e = tid; e < kHeadBytes<St> / 16; e += kHeadThreads) reinterpret_cast<uint4*>(sm.state)[e] = make_uint4(0u, 0u, 0u, 0u);
  }

  const int c2 = tid % (kHd / 2), half = tid / (kHd / 2), c0 = 2 * c2;
  float rq = 1.f, rk = 1.f, qk = 0.f, beta = 0.f;
  if (len == 1) {
    // Row tid's q, k, g and column tid's v; the decay; the block's Σq², Σk², Σqk.
    const float q = ld_in<In>(p.q.data, tok_off(p.q, b, begin, hq) + tid), k = ld_in<In>(p.k.data, tok_off(p.k, b, begin, hq) + tid);
    const float gl = ld_in<In>(p.g.data, tok_off(p.g, b, begin, h) + tid);
    sm.v[tid] = ld_in<In>(p.v.data, tok_off(p.v, b, begin, h) + tid);
    const float rb = ld_in<In>(p.beta.data, tok_off(p.beta, b, begin, h));
    const bool gate = p.gate_in_kernel;
    const float ea = gate && p.A_log ? expf(p.A_log[h]) : 1.f, bias = gate && p.dt_bias ? p.dt_bias[int64_t(h) * kHd + tid] : 0.f;
    const float d = decay(p, gate, gl, bias, ea, true);
    sm.dkq[tid] = make_float2(d * k, d * q);
    sm.dk[tid] = make_float2(d, k);
    float s0 = q * q, s1 = k * k, s2 = q * k;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      s0 += __shfl_xor_sync(0xffffffffu, s0, o);
      s1 += __shfl_xor_sync(0xffffffffu, s1, o);
      s2 += __shfl_xor_sync(0xffffffffu, s2, o);
    }
    if (lane == 0) sm.sums[warp][0] = s0, sm.sums[warp][1] = s1, sm.sums[warp][2] = s2;
    beta = p.beta_sigmoid ? p.beta_scale * sigmoid(rb) : rb;
  }
  __syncthreads();  // the barrier's init, the zeros, the token's factors
  if (read_slot >= 0) wait_phase0(&sm.bar);

  if (len == 1) {
    float QQ = 0.f, KK = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) QQ += sm.sums[w][0], KK += sm.sums[w][1], qk += sm.sums[w][2];
    if (p.l2norm) rq = 1.f / sqrtf(QQ + 1e-6f), rk = 1.f / sqrtf(KK + 1e-6f);
    // Pass 1: S̄ᵀk and S̄ᵀq of columns c0, c0 + 1 over this half's rows.
    float pk0 = 0.f, pk1 = 0.f, pq0 = 0.f, pq1 = 0.f;
    const int r0 = half * kHalfRows;
#pragma unroll 8
    for (int r = r0; r < r0 + kHalfRows; ++r) {
      const float2 s = ld_pair<St>(sm.state, r, c2), f = sm.dkq[r];
      pk0 = fmaf(s.x, f.x, pk0), pk1 = fmaf(s.y, f.x, pk1);
      pq0 = fmaf(s.x, f.y, pq0), pq1 = fmaf(s.y, f.y, pq1);
    }
    sm.part[half][c2] = make_float4(pk0, pk1, pq0, pq1);
    __syncthreads();
    const float4 a = sm.part[0][c2], z = sm.part[1][c2];  // both threads of a pair: the same sums in the same order
    pk0 = a.x + z.x, pk1 = a.y + z.y, pq0 = a.z + z.z, pq1 = a.w + z.w;
    // u and o of the two columns (both halves: each needs u).
    const float u0 = beta * (sm.v[c0] - rk * pk0), u1 = beta * (sm.v[c0 + 1] - rk * pk1);
    if (half == 0) {
      const float o0 = p.scale * rq * fmaf(rk * qk, u0, pq0), o1 = p.scale * rq * fmaf(rk * qk, u1, pq1);
      const int64_t off = int64_t(b) * p.o_sb + int64_t(begin) * p.o_st + int64_t(h) * p.o_sh + c0;
      if (p.o_dtype == DType::kFP32) {  // o's dtype and alignment are its own (not the inputs')
        float* po = static_cast<float*>(p.o) + off;
        if (aligned(po, 8)) *reinterpret_cast<float2*>(po) = make_float2(o0, o1);
        else po[0] = o0, po[1] = o1;
      } else {  // bf16 or fp16
        unsigned short* po = static_cast<unsigned short*>(p.o) + off;
        if (aligned(po, 4)) *reinterpret_cast<unsigned*>(po) = pack_pair(p.o_dtype, o0, o1);
        else po[0] = to_half_bits(p.o_dtype, o0), po[1] = to_half_bits(p.o_dtype, o1);
      }
    }
    // Pass 2: S = S̄ + k̂ uᵀ in place.
#pragma unroll 8
    for (int r = r0; r < r0 + kHalfRows; ++r) {
      const float2 s = ld_pair<St>(sm.state, r, c2), f = sm.dk[r];
      const float kr = rk * f.y;
      st_pair<St>(sm.state, r, c2, fmaf(kr, u0, s.x * f.x), fmaf(kr, u1, s.y * f.x));
    }
  }
  if (write_row < 0) return;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the passes' writes, seen by the bulk store
  __syncthreads();
  if (tid == 0) bulk_store(static_cast<St*>(p.fin) + write_row * p.fin_stride + head, sm.state, kHeadBytes<St>);
}

template <class In, class St>
Status launch_heads(const KdaDecodeParams& p, const int32_t* begin, cudaStream_t s) {
  auto go = [&](auto table) {
    using Table = decltype(table);
    if (begin)
      for (int i = 0; i <= p.N; ++i) table.begin[i] = begin[i];
    constexpr int kSeqs = int(sizeof(Table) / sizeof(int32_t)) - 1;
    auto* kernel = kda_decode_heads_kernel<In, St, kSeqs>;
    constexpr size_t kSmem = sizeof(HeadSmem<St>);
    ENCORE_RETURN_IF_ERROR(set_dynamic_smem("kda decode (kda_decode_heads_kernel)", kernel, kSmem, true));
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = pdl_config(dim3(unsigned(int64_t(p.N) * p.H)), dim3(kHeadThreads), kSmem, s, p.pdl, attr);
    return launch_api("kda decode (kda_decode_heads_kernel)", [&] { return cudaLaunchKernelEx(&cfg, kernel, p, table); });
  };
  if (!begin) return go(SeqTable<0>{});
  if (p.N <= kKdaDecodeSeqTableSmall) return go(SeqTable<kKdaDecodeSeqTableSmall>{});
  return go(SeqTable<kKdaDecodeSeqTable>{});
}

}  // namespace

Status launch_kda_decode_heads(const KdaDecodeParams& p, const int32_t* begin, Stream stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const DType st = p.init ? p.init_dtype : p.fin_dtype;
  if (!kda_decode_wide_kernels_apply(p))
    return Status::invalid("kda decode (whole heads): needs K = V = 128, one token a sequence, aligned inputs of one dtype and "
                           "16-byte aligned [K, V] states of one dtype (fp32 or bf16)");
  const bool bf16_in = p.q.dtype == DType::kBF16;
  if (st == DType::kBF16) return bf16_in ? launch_heads<__nv_bfloat16, __nv_bfloat16>(p, begin, s) : launch_heads<float, __nv_bfloat16>(p, begin, s);
  return bf16_in ? launch_heads<__nv_bfloat16, float>(p, begin, s) : launch_heads<float, float>(p, begin, s);
}

}  // namespace encore::cuda
