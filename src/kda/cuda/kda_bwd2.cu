// The second CUDA KDA backward, stages K0 and K1 (kda_bwd2.hpp; math: docs/math/kda.md §6; the CPU
// ground truth stage by stage: src/kda/reference/kda_chunked_bwd.cpp). Every product one
// mma.sync m16n8k16 on bf16 operands with fp32 accumulation; fp32 for G, the exp2 factors and the
// state cotangent.
//
// K0 kda2_prep_kernel, grid (chunk slots, HV), 256 threads: per chunk and value head, from q, k, beta,
//   dO and the residuals G, Akk (A), Aqk: Qg, Kg, Kbeta = beta k^ . 2^G (shared), -W = -A Kbeta
//   (64 x 128 x 64), dvl = Aqk^T dO (64 x 128 x 64), 2^gC. Writes qg, kg, wn, dvl, egc.
// K1 kda2_scan_kernel, one block of 128 threads per (sequence, value head, 32 value columns): the
//   reverse pass over the sequence's chunks, dS' [K x 32] fp32 in registers (warp w: state rows
//   32w..32w+31), the next chunk's Kg, Qg, -W, dvl, 2^gC tiles in flight (cp.async, two stages):
//     dsp[c] = bf16(dS');  dVnew = dvl + Kg dS' (64 x 32 x 128) -> bf16 -> dvn;
//     dS = 2^gC . dS' + Qg^T dO + (-W)^T dVnew (128 x 32 x 64, twice)  -> dS' of the chunk before;
//   dS after a sequence's first chunk is dh0. Starts from dht (or 0).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "kda/cuda/kda_bwd2.hpp"
#include "kda/cuda/kda_bwd2_device.cuh"

namespace encore::cuda {
namespace kda2 {
namespace {

using kda::ldmatrix_x4;
using kda::ldmatrix_x4_trans;
using kda::mma_bf16;

constexpr int kVs = 32;        // value columns per scan block
constexpr int kLdS = kVs + 8;  // of [*][32] tiles

// ---- K0: prep ------------------------------------------------------------------------------------

constexpr int kPrepThreads = 256;
constexpr size_t kPrepSmem = size_t(2 * kC * kLdC + 2 * kC * kLd) * sizeof(__nv_bfloat16);  // A, Aqk, Kbeta, dO

__global__ void __launch_bounds__(kPrepThreads) kda2_prep_kernel(const __grid_constant__ KdaBwdCudaProblem p, Ptrs w) {
  extern __shared__ __align__(16) unsigned char smem[];
  auto* a_s = reinterpret_cast<__nv_bfloat16*>(smem);  // [64][kLdC]  A (Akk)
  __nv_bfloat16* aqk_s = a_s + kC * kLdC;               // [64][kLdC]  Aqk
  __nv_bfloat16* kb_s = aqk_s + kC * kLdC;              // [64][kLd]   Kbeta
  __nv_bfloat16* do_s = kb_s + kC * kLd;                // [64][kLd]   dO
  const int slot = blockIdx.x, hv = blockIdx.y, hq = hv / p.group;
  const ChunkInfo ci = chunk_info(p, slot);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c0 = 4 * lane;
  const int64_t last = tok(p, ci.b, ci.t0 + ci.rows - 1, hv);
  float gc[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) gc[e] = ldg_or0(p.G, last * p.K + c0 + e, c0 + e < p.K);
  if (warp == 0) {
#pragma unroll
    for (int e = 0; e < 4; ++e) w.egc[(int64_t(slot) * p.H + hv) * kD + c0 + e] = c0 + e < p.K ? exp2f(gc[e]) : 0.f;
  }
  for (int i = warp; i < kC; i += kPrepThreads / 32) {
    const bool valid = i < ci.rows;
    const int t = ci.t0 + (valid ? i : 0);
    const int64_t row = tok(p, ci.b, t, hv);
    // Straight-line loads (kda_bwd_device.cuh, ld*_or0): a row's loads are in flight together.
    float q[4], k[4], g[4], o[4];
    const float beta = load_or0(p.beta, ci.b, t, hv, 0, valid);
    load4(p.q, ci.b, t, hq, c0, p.K, valid, q), load4(p.k, ci.b, t, hq, c0, p.K, valid, k);
    load_g4(p.G, row, p.K, c0, valid, g), load4(p.d_o, ci.b, t, hv, c0, p.V, valid, o);
    float sq = q[0] * q[0] + q[1] * q[1] + q[2] * q[2] + q[3] * q[3], sk = k[0] * k[0] + k[1] * k[1] + k[2] * k[2] + k[3] * k[3];
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, s);
      sk += __shfl_xor_sync(0xffffffffu, sk, s);
    }
    const float rq = p.l2norm ? rsqrtf(sq + 1e-6f) : 1.f, rk = p.l2norm ? rsqrtf(sk + 1e-6f) : 1.f;
    float qg[4], kg[4], kb[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float eg = exp2f(g[e]);  // g <= 0 past the chunk start: <= 1
      qg[e] = valid ? p.scale * q[e] * rq * eg : 0.f;
      kg[e] = valid ? k[e] * rk * exp2f(gc[e] - g[e]) : 0.f;  // gC <= G: <= 1
      kb[e] = valid ? beta * k[e] * rk * eg : 0.f;
    }
    if (valid) {
      const int64_t at = (row) * kD + c0;
      store_pair(w.qg + at, qg[0], qg[1]), store_pair(w.qg + at + 2, qg[2], qg[3]);
      store_pair(w.kg + at, kg[0], kg[1]), store_pair(w.kg + at + 2, kg[2], kg[3]);
    }
    store_pair(kb_s + i * kLd + c0, kb[0], kb[1]), store_pair(kb_s + i * kLd + c0 + 2, kb[2], kb[3]);
    store_pair(do_s + i * kLd + c0, o[0], o[1]), store_pair(do_s + i * kLd + c0 + 2, o[2], o[3]);
    // A and Aqk rows: lower triangular with the diagonal (A's is 1), columns j <= i.
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int j = 2 * lane + e;
      const bool in = valid && j <= i;
      a_s[i * kLdC + j] = __float2bfloat16(load_any_or0(p.Akk, p.akk_dtype, row * kC + j, in));
      aqk_s[i * kLdC + j] = __float2bfloat16(load_any_or0(p.Aqk, p.aqk_dtype, row * kC + j, in));
    }
  }
  __syncthreads();
  // -W = -(A Kbeta) and dvl = Aqk^T dO: warp w owns rows 16 (w % 4).. and columns 64 (w / 4)..
  const int m0 = 16 * (warp & 3), n0 = 64 * (warp >> 2), g8 = lane >> 2, t4 = lane & 3;
  float acc[8][4];
  auto write = [&](__nv_bfloat16* dst, float mult) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = m0 + g8 + 8 * h;
        if (i < ci.rows)
          store_pair(dst + tok(p, ci.b, ci.t0 + i, hv) * kD + n0 + 8 * j + 2 * t4, mult * acc[j][2 * h], mult * acc[j][2 * h + 1]);
      }
  };
  zero(acc);
  warp_mma<kC, 8, false, true>(acc, a_s, kLdC, m0, kb_s, kLd, n0);
  write(w.wn, -1.f);
  zero(acc);
  warp_mma<kC, 8, true, true>(acc, aqk_s, kLdC, m0, do_s, kLd, n0);
  write(w.dvl, 1.f);
}

// ---- K1: the reverse scan --------------------------------------------------------------------------

constexpr int kScanThreads = 128;
// One stage: Kg, Qg, -W [64][kLd]; dvl [64][kLdS]; 2^gC [128] fp32.
constexpr int kStageElems = 3 * kC * kLd + kC * kLdS;
constexpr size_t kStageBytes = size_t(kStageElems) * sizeof(__nv_bfloat16) + kD * sizeof(float);
constexpr size_t kScanSmem = 2 * kStageBytes + size_t(kD * kLdS + 2 * kC * kLdS) * sizeof(__nv_bfloat16);  // + dS', dVnew, dO

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

struct Stage {
  __nv_bfloat16 *kg, *qg, *wn, *dvl;
  float* egc;
};
__device__ __forceinline__ Stage stage_at(unsigned char* base) {
  Stage s;
  s.kg = reinterpret_cast<__nv_bfloat16*>(base);
  s.qg = s.kg + kC * kLd;
  s.wn = s.qg + kC * kLd;
  s.dvl = s.wn + kC * kLd;
  s.egc = reinterpret_cast<float*>(s.dvl + kC * kLdS);
  return s;
}

// Chunk `slot`'s tiles (rows t0 .. t0 + rows of batch b) into stage s: cp.async, rows past `rows` zero.
__device__ __forceinline__ void load_stage(const KdaBwdCudaProblem& p, const Ptrs& w, const Stage& s, int slot, int b, int t0, int rows,
                                           int hv, int v0) {
  for (int x = threadIdx.x; x < 3 * kC * (kD / 8); x += kScanThreads) {
    const int tile = x / (kC * (kD / 8)), rem = x % (kC * (kD / 8)), i = rem / (kD / 8), seg = rem % (kD / 8);
    const __nv_bfloat16* src = tile == 0 ? w.kg : tile == 1 ? w.qg : w.wn;
    __nv_bfloat16* dst = tile == 0 ? s.kg : tile == 1 ? s.qg : s.wn;
    const bool valid = i < rows;
    cp_async16(dst + i * kLd + 8 * seg, src + (valid ? tok(p, b, t0 + i, hv) * kD + 8 * seg : 0), valid);
  }
  for (int x = threadIdx.x; x < kC * (kVs / 8); x += kScanThreads) {
    const int i = x / (kVs / 8), seg = x % (kVs / 8);
    const bool valid = i < rows;
    cp_async16(s.dvl + i * kLdS + 8 * seg, w.dvl + (valid ? tok(p, b, t0 + i, hv) * kD + v0 + 8 * seg : 0), valid);
  }
  for (int x = threadIdx.x; x < kD / 4; x += kScanThreads) cp_async16(s.egc + 4 * x, w.egc + (int64_t(slot) * p.H + hv) * kD + 4 * x, true);
  cp_async_commit();
}

__global__ void __launch_bounds__(kScanThreads) kda2_scan_kernel(const __grid_constant__ KdaBwdCudaProblem p, Ptrs w, int slices) {
  extern __shared__ __align__(16) unsigned char smem[];
  auto* ds_s = reinterpret_cast<__nv_bfloat16*>(smem + 2 * kStageBytes);  // [128][kLdS] bf16(dS'), stored [k][v]
  __nv_bfloat16* dvn_s = ds_s + kD * kLdS;                                  // [64][kLdS] bf16(dVnew)
  __nv_bfloat16* do_s = dvn_s + kC * kLdS;                                  // [64][kLdS] dO
  const int slice = blockIdx.x % slices, hv = (blockIdx.x / slices) % p.H, n = blockIdx.x / (slices * p.H);
  const int v0 = kVs * slice, b = p.varlen ? 0 : n;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3;
  const int first = p.chunk_start[n], count = p.chunk_start[n + 1] - first;
  // dS' fragments: m-tile mt rows 32 warp + 16 mt (+ g8, + 8), n-tile nt columns v0 + 8 nt + 2 t4 (+1).
  float ds[2][4][4];
  const int64_t state0 = (int64_t(n) * p.H + hv) * p.K;
  // f(element, state row a, value column y) over this thread's dS' fragment elements.
  auto each_ds = [&](auto&& f) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(ds[mt][nt][e], 32 * warp + 16 * mt + g8 + 8 * (e >> 1), v0 + 8 * nt + 2 * t4 + (e & 1));
  };
  each_ds([&](float& x, int a, int y) { x = p.dht && a < p.K && y < p.V ? p.dht[(state0 + a) * p.V + y] : 0.f; });
  auto chunk_rows = [&](int c, int* t0) {
    *t0 = p.seq_begin[n] + (c - first) * kC;
    return min(kC, p.seq_end[n] - *t0);
  };
  if (count > 0) {
    int t0;
    const int rows = chunk_rows(first + count - 1, &t0);
    load_stage(p, w, stage_at(smem + ((count - 1) & 1) * kStageBytes), first + count - 1, b, t0, rows, hv, v0);
  }
  for (int ci = count - 1; ci >= 0; --ci) {
    const int slot = first + ci;
    const Stage s = stage_at(smem + (ci & 1) * kStageBytes);
    int t0;
    const int rows = chunk_rows(slot, &t0);
    if (ci > 0) {  // the chunk before, in flight during this one
      int pt0;
      const int prows = chunk_rows(slot - 1, &pt0);
      load_stage(p, w, stage_at(smem + ((ci - 1) & 1) * kStageBytes), slot - 1, b, pt0, prows, hv, v0);
    }
    // dO (any float dtype) into shared bf16 while the tiles land.
    {
      constexpr int kPer = kC * kVs / 2 / kScanThreads;  // value pairs a thread
      float o[kPer][2];
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int x = threadIdx.x + u * kScanThreads, i = x / (kVs / 2), y = v0 + 2 * (x % (kVs / 2));
        o[u][0] = load_or0(p.d_o, b, t0 + i, hv, y, i < rows && y < p.V);
        o[u][1] = load_or0(p.d_o, b, t0 + i, hv, y + 1, i < rows && y + 1 < p.V);
      }
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int x = threadIdx.x + u * kScanThreads, i = x / (kVs / 2), y = 2 * (x % (kVs / 2));
        store_pair(do_s + i * kLdS + y, o[u][0], o[u][1]);
      }
    }
    // dS' of this chunk: bf16 to shared (the next products' operand) and to dsp.
    __nv_bfloat16* dsp = w.dsp + ((int64_t(slot) * p.H + hv) * kD) * kD;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int a = 32 * warp + 16 * mt + g8 + 8 * h, y = 8 * nt + 2 * t4;
          store_pair(ds_s + a * kLdS + y, ds[mt][nt][2 * h], ds[mt][nt][2 * h + 1]);
          store_pair(dsp + int64_t(a) * kD + v0 + y, ds[mt][nt][2 * h], ds[mt][nt][2 * h + 1]);
        }
    if (ci > 0) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncthreads();
    // dVnew = dvl + Kg dS': warp w rows 16 w.., 4 n-tiles, k over the 128 state rows.
    {
      float dv[4][4];
      const int m0 = 16 * warp, mi = lane >> 3, r = lane & 7;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          dv[nt][e] = __bfloat162float(s.dvl[(m0 + g8 + 8 * (e >> 1)) * kLdS + 8 * nt + 2 * t4 + (e & 1)]);
#pragma unroll
      for (int ks = 0; ks < kD / 16; ++ks) {
        uint32_t af[4];
        ldmatrix_x4(af, s.kg + (m0 + r + 8 * (mi & 1)) * kLd + 16 * ks + 8 * (mi >> 1));
#pragma unroll
        for (int j = 0; j < 4; j += 2) {
          uint32_t bf[4];
          ldmatrix_x4_trans(bf, ds_s + (16 * ks + 8 * (mi & 1) + r) * kLdS + 8 * j + 8 * (mi >> 1));
          const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
          mma_bf16(dv[j], af, b0);
          mma_bf16(dv[j + 1], af, b1);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = m0 + g8 + 8 * h, y = 8 * nt + 2 * t4;
          store_pair(dvn_s + i * kLdS + y, dv[nt][2 * h], dv[nt][2 * h + 1]);
          if (i < rows) store_pair(w.dvn + tok(p, b, t0 + i, hv) * kD + v0 + y, dv[nt][2 * h], dv[nt][2 * h + 1]);
        }
    }
    __syncthreads();
    // dS = 2^gC . dS' + Qg^T dO + (-W)^T dVnew: warp w state rows 32 w.., k over the chunk's 64 rows.
    {
      const int mi = lane >> 3, r = lane & 7;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float e = s.egc[32 * warp + 16 * mt + g8 + 8 * h];
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) ds[mt][nt][2 * h] *= e, ds[mt][nt][2 * h + 1] *= e;
        }
#pragma unroll
      for (int term = 0; term < 2; ++term) {
        const __nv_bfloat16* at = term == 0 ? s.qg : s.wn;
        const __nv_bfloat16* bt = term == 0 ? do_s : dvn_s;
#pragma unroll
        for (int ks = 0; ks < kC / 16; ++ks) {
          uint32_t af[2][4];
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
            ldmatrix_x4_trans(af[mt], at + (16 * ks + 8 * (mi >> 1) + r) * kLd + 32 * warp + 16 * mt + 8 * (mi & 1));
#pragma unroll
          for (int j = 0; j < 4; j += 2) {
            uint32_t bf[4];
            ldmatrix_x4_trans(bf, bt + (16 * ks + 8 * (mi & 1) + r) * kLdS + 8 * j + 8 * (mi >> 1));
            const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
              mma_bf16(ds[mt][j], af[mt], b0);
              mma_bf16(ds[mt][j + 1], af[mt], b1);
            }
          }
        }
      }
    }
    __syncthreads();  // the stage and dS', dVnew, dO tiles are free for the next chunk
  }
  if (p.dh0)
    each_ds([&](float& x, int a, int y) {
      if (a < p.K && y < p.V) p.dh0[(state0 + a) * p.V + y] = x;
    });
}

}  // namespace
}  // namespace kda2

Kda2Layout kda2_layout(int64_t tokens, int64_t chunks, int64_t HV) {
  Kda2Layout l;
  size_t o = 0;
  auto take = [&](size_t bytes) {
    const size_t at = o;
    o += (bytes + 255) / 256 * 256;
    return at;
  };
  const size_t row = size_t(tokens) * HV * kKda2D * 2;  // one bf16 [tokens][HV][128] tensor
  l.qg = take(row), l.kg = take(row), l.wn = take(row), l.dvl = take(row), l.dvn = take(row), l.dw = take(row);
  l.daqk = take(row / 2), l.da = take(row / 2);  // [tokens][HV][64]
  l.dqi = take(2 * row), l.dki = take(2 * row);  // fp32
  l.egc = take(size_t(chunks) * HV * kKda2D * 4), l.sd = take(size_t(chunks) * HV * kKda2D * 4);
  l.gp = take(size_t(chunks) * HV * 2 * kKda2D * 4);
  l.dsp = take(size_t(chunks) * HV * kKda2D * kKda2D * 2);
  l.bytes = o;
  return l;
}

Status launch_kda2_prep_scan(const KdaBwdCudaProblem& p, const Kda2Layout& l, void* workspace, int chunks, Stream stream) {
  using namespace kda2;
  if (p.K > kKda2D || p.V > kKda2D)
    return Status::unsupported("kda backward (second design): K and V up to " + std::to_string(kKda2D) + ", got " + std::to_string(p.K) +
                               ", " + std::to_string(p.V));
  if (!p.G || !p.Akk || !p.Aqk) return Status::invalid("residuals: the second backward reads the forward's G, Aqk and Akk");
  const Ptrs w = ptrs_of(l, workspace);
  auto s = static_cast<cudaStream_t>(stream);
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem("kda2_prep_kernel", kda2_prep_kernel, kPrepSmem));
  ENCORE_RETURN_IF_ERROR(set_dynamic_smem("kda2_scan_kernel", kda2_scan_kernel, kScanSmem));
  if (chunks > 0)
    ENCORE_RETURN_IF_ERROR(launch("kda2_prep_kernel", [&] { kda2_prep_kernel<<<dim3(chunks, p.H), kPrepThreads, kPrepSmem, s>>>(p, w); }));
  const int slices = (p.V + kVs - 1) / kVs;
  ENCORE_RETURN_IF_ERROR(launch("kda2_scan_kernel", [&] { kda2_scan_kernel<<<p.N * p.H * slices, kScanThreads, kScanSmem, s>>>(p, w, slices); }));
  return Status::ok();
}

Status launch_kda2_backward(const KdaBwdCudaProblem& p, const Kda2Layout& l, void* workspace, int chunks, Stream stream) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(p.device));
  ENCORE_RETURN_IF_ERROR(launch_kda2_prep_scan(p, l, workspace, chunks, stream));
  ENCORE_RETURN_IF_ERROR(launch_kda2_state_grads(p, l, workspace, chunks, stream));
  return launch_kda2_wy(p, l, workspace, chunks, stream);
}

}  // namespace encore::cuda
