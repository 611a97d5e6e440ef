// KDA chunked backward on CUDA (docs/math/kda.md §6; docs/kda.md), five launches connected by the
// per-(chunk, head) fp32 workspace record of kda_bwd_launch.hpp, every product on tensor cores:
//   1 recompute (kda_bwd_recompute_tc.cu): Qg, Kg, W, U from the residuals G and Akk, chunk-parallel;
//     then Vnew = U - W S per chunk from the saved h, or the rematerialized state pass;
//   2 dAv (kda_bwd_dav.cu): dAqk, dVnew(intra), chunk-parallel;
//   3a dh (kda_bwd_reverse.cu): the serial reverse state-cotangent pass per (sequence, head, 64 columns);
//   3b-1 inter (kda_bwd_inter.cu): the GEMM-shaped inter-chunk and dVnew products;
//   3b grads (kda_bwd_grads_tc.cu): WY, intra-chunk, reverse cumsum, gate and L2-norm tails, chunk-parallel;
//   4 the gate reduction below: dA_log[h] and ddt_bias[h, k] summed over the chunks' partials in a
//     fixed order (deterministic, no atomics);
//   5 with grouped value heads only: dq, dk summed over each q/k head's value heads (fixed order).
#include "common/cuda/device_guard.hpp"
#include "kda/cuda/kda_bwd_device.cuh"

namespace encore::cuda {

static_assert(sizeof(KdaBwdCudaProblem) <= 32764, "the problem travels as one kernel parameter");

KdaBwdLayout kda_bwd_layout(int64_t K, int64_t V, bool remat) {
  KdaBwdLayout l;
  int64_t o = 0;
  auto take = [&](int64_t n) {
    const int64_t at = o;
    o += (n + 3) / 4 * 4;  // 16-byte parts
    return at;
  };
  l.qg = take(64 * K);
  l.kg = take(64 * K);
  l.w = take(64 * K);
  l.vn = take(64 * V);
  l.dvn = take(64 * V);
  l.daqk = take(64 * 64);
  l.dh = take(K * V);
  l.hs = remat ? take(K * V) : 0;
  l.gc = take(K);
  l.pdt = take(K);
  l.pda = take(K);
  l.acc = take(64 * K);
  l.dw = take(64 * K);
  l.da = take(64 * 64);
  l.dbv = take(64);
  l.sd = take(K);
  l.rec = o;
  return l;
}

size_t kda_backward_workspace_bytes(int64_t chunks, int64_t H, int64_t K, int64_t V, bool remat, int64_t tokens, int64_t group) {
  const int64_t partials = group > 1 ? 2 * tokens * H * K : 0;
  return size_t(chunks * H * kda_bwd_layout(K, V, remat).rec + partials) * sizeof(float);
}

namespace kdabwd {
namespace {

// dA_log[h] = sum over chunks and channels of pdA; ddt_bias[h, k] = sum over chunks of pdt. One block
// per head and one thread per channel: thread a sums its channel's pdt and pdA over the chunks in slot
// order (independent loads, no serial chain over K); dA_log[h] = the channels' pdA sums added in
// channel order by thread 0. Deterministic.
// The partials of (chunk slot c, head h) sit at parts + (c H + h) rec, pdt and pda floats on (the
// first backward's records; the second backward's gp rows).
__global__ void __launch_bounds__(kMaxD) kda_bwd_gate_reduce_fast_kernel(const __grid_constant__ KdaBwdCudaProblem p, const float* parts,
                                                                          int64_t rec, int64_t pdt, int64_t pda, int slots) {
  __shared__ float part[kMaxD];
  const int h = blockIdx.x, a = threadIdx.x;
  float sdt = 0.f, sda = 0.f;
  if (a < p.K) {
    const float* r = parts + int64_t(h) * rec + a;
    const int64_t step = int64_t(p.H) * rec;
#pragma unroll 4
    for (int c = 0; c < slots; ++c) {
      sdt += r[c * step + pdt];
      sda += r[c * step + pda];
    }
    if (p.ddt_bias) p.ddt_bias[h * p.K + a] = sdt;
  }
  part[a] = sda;
  __syncthreads();
  if (a == 0 && p.dA_log) {
    float s = 0.f;
    for (int x = 0; x < p.K; ++x) s += part[x];
    p.dA_log[h] = s;
  }
}

// Grouped value heads: dq[b, t, hq, a] = sum over j < group (in order) of the partial at value head
// hq * group + j; one thread per (b, t, hq, a). `dq`, `dk`: the caller's outputs; the partials are
// the problem's (fp32, contiguous [B, T, H, K]).
__global__ void kda_bwd_group_reduce_kernel(const __grid_constant__ KdaBwdCudaProblem p, KdaOutTensor dq, KdaOutTensor dk) {
  const int Hq = p.H / p.group;
  const int64_t n = int64_t(p.B) * p.T * Hq * p.K;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n) return;
  const int a = int(idx % p.K);
  int64_t r = idx / p.K;
  const int hq = int(r % Hq);
  r /= Hq;
  const int t = int(r % p.T), b = int(r / p.T);
  const float* pq = static_cast<const float*>(p.dq.data);
  const float* pk = static_cast<const float*>(p.dk.data);
  float sq = 0.f, sk = 0.f;
  for (int j = 0; j < p.group; ++j) {
    const int64_t off = ((int64_t(b) * p.T + t) * p.H + hq * p.group + j) * p.K + a;
    sq += pq[off];
    sk += pk[off];
  }
  store_out(dq, b, t, hq, a, sq);
  store_out(dk, b, t, hq, a, sk);
}

}  // namespace

Status launch_group_reduce(const KdaBwdCudaProblem& p, const KdaOutTensor& dq, const KdaOutTensor& dk, cudaStream_t s) {
  const int64_t n = int64_t(p.B) * p.T * (p.H / p.group) * p.K;
  if (n == 0) return Status::ok();
  return launch("kda backward: group reduction (kda_bwd_group_reduce_kernel)",
                [&] { kda_bwd_group_reduce_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(p, dq, dk); });
}

Status launch_gate_reduce_parts(const KdaBwdCudaProblem& p, const float* parts, int64_t rec, int64_t pdt, int64_t pda, int slots,
                                cudaStream_t s) {
  if (p.H <= 0) return Status::ok();
  return launch("kda backward: gate reduction (kda_bwd_gate_reduce_fast_kernel)",
                [&] { kda_bwd_gate_reduce_fast_kernel<<<p.H, kMaxD, 0, s>>>(p, parts, rec, pdt, pda, slots); });
}

}  // namespace kdabwd

Status launch_kda_backward(const KdaBwdCudaProblem& given, void* workspace, Stream stream) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(given.device));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  float* ws = static_cast<float*>(workspace);
  const int slots = given.chunk_start[given.N];
  // Grouped value heads: the kernels write dq, dk per value head into fp32 partials after the
  // records (a copy of the problem points there; ~12 KB on the stack), summed per q/k head last.
  KdaBwdCudaProblem grouped;
  const bool groups = given.group > 1;
  if (groups) {
    grouped = given;
    float* part = ws + int64_t(slots) * given.H * given.ws.rec;
    const int64_t st = int64_t(given.H) * given.K, sb = int64_t(given.T) * st, n = int64_t(given.B) * sb;
    grouped.dq = KdaOutTensor{part, DType::kFP32, sb, st, given.K};
    grouped.dk = KdaOutTensor{part + n, DType::kFP32, sb, st, given.K};
  }
  const KdaBwdCudaProblem& p = groups ? grouped : given;
  if (slots > 0) {
    ENCORE_RETURN_IF_ERROR(kdabwd::launch_prep_tc(p, ws, slots, s));
    ENCORE_RETURN_IF_ERROR(kdabwd::launch_states_tc(p, ws, slots, s));
    ENCORE_RETURN_IF_ERROR(kdabwd::launch_dav(p, ws, slots, s));
  }
  if (p.N > 0) ENCORE_RETURN_IF_ERROR(kdabwd::launch_dh(p, ws, s));
  if (slots > 0) {
    ENCORE_RETURN_IF_ERROR(kdabwd::launch_inter(p, ws, slots, s));
    ENCORE_RETURN_IF_ERROR(kdabwd::launch_grads_tc(p, ws, slots, s));
  }
  if (p.dA_log || p.ddt_bias) ENCORE_RETURN_IF_ERROR(kdabwd::launch_gate_reduce_parts(p, ws, p.ws.rec, p.ws.pdt, p.ws.pda, slots, s));
  if (groups) ENCORE_RETURN_IF_ERROR(kdabwd::launch_group_reduce(p, given.dq, given.dk, s));
  return Status::ok();
}

}  // namespace encore::cuda
