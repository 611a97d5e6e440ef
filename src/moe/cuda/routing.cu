// MoE routing on CUDA: one warp per token, four tokens per 128-thread block. Lane l holds the scores
// of experts l, l + 32, ... (kPerLane = ceil(E / 32) in registers). The scores are computed in fp64,
// as the CPU reference does, so the selection sees the reference's values up to the last bits of
// exp (and of the softmax sum's order): ids equal the reference's, weights agree to ~1e-15 before the
// final rounding to fp32. Selection: k rounds of a warp argmax over (value desc, expert asc), the
// reference's tie rule; grouped selection: a lane per group scores it from shared memory with the
// moe::group_score (problem.hpp, shared with the reference), then topk_group rounds of the same argmax over groups.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <string>

#include "common/cuda/device_guard.hpp"
#include "moe/cuda/launch.hpp"

namespace encore::cuda {
namespace {

constexpr int kWarps = 4;  // tokens per block

struct RoutingParams {
  const void* logits;
  int64_t logits_stride;
  const void* bias;  // nullptr: none
  bool bias_bf16;
  int64_t bias_stride;
  int32_t* ids;
  int64_t ids_stride;
  float* weights;
  int64_t weights_stride;
  int64_t tokens;
  int E, k;
  bool sigmoid, renormalize;
  int n_group, topk_group;
  float scale;
};

template <typename T>
__device__ __forceinline__ double load_d(const T* p);
template <> __device__ __forceinline__ double load_d<float>(const float* p) { return double(*p); }
template <> __device__ __forceinline__ double load_d<__half>(const __half* p) { return double(__half2float(*p)); }
template <> __device__ __forceinline__ double load_d<__nv_bfloat16>(const __nv_bfloat16* p) { return double(__bfloat162float(*p)); }

// (v, i) beats (w, j): larger value, lower index on ties (the reference's best_allowed).
__device__ __forceinline__ bool beats(double v, int i, double w, int j) { return v > w || (v == w && i < j); }

// Warp argmax of (v, i) carrying a payload; every lane gets the winner.
__device__ __forceinline__ void warp_argmax(double& v, int& i, double& payload) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const double ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off);
    const double op = __shfl_xor_sync(0xffffffffu, payload, off);
    if (beats(ov, oi, v, i)) {
      v = ov;
      i = oi;
      payload = op;
    }
  }
}

__device__ __forceinline__ double warp_max(double v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}


// Shared memory per warp: E doubles (the biased scores, then the selected weights) + E ints (the
// kept-group flags, then the selected ids).
template <int kPerLane, typename TL>
__global__ void __launch_bounds__(kWarps * 32) moe_routing_kernel(RoutingParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int64_t t = int64_t(blockIdx.x) * kWarps + warp;
  if (t >= p.tokens) return;  // whole warps leave together; no block-wide barrier below
  const int E = p.E;
  double* dbuf = reinterpret_cast<double*>(smem_raw) + size_t(warp) * size_t(E);
  int* ibuf = reinterpret_cast<int*>(reinterpret_cast<double*>(smem_raw) + size_t(kWarps) * size_t(E)) + size_t(warp) * size_t(E);

  const TL* row = static_cast<const TL*>(p.logits) + t * p.logits_stride;
  double s[kPerLane], c[kPerLane];
  bool allowed[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    allowed[i] = e < E;
    s[i] = allowed[i] ? load_d<TL>(row + e) : -INFINITY;
  }
  if (p.sigmoid) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) s[i] = allowed[i] ? 1.0 / (1.0 + exp(-s[i])) : 0.0;
  } else {
    double m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) m = fmax(m, s[i]);
    m = warp_max(m);
    double sum = 0.0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      s[i] = allowed[i] ? exp(s[i] - m) : 0.0;
      sum += s[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) s[i] /= sum;
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    double b = 0.0;
    if (p.bias && allowed[i]) {
      b = p.bias_bf16 ? double(__bfloat162float(static_cast<const __nv_bfloat16*>(p.bias)[int64_t(e) * p.bias_stride]))
                      : double(static_cast<const float*>(p.bias)[int64_t(e) * p.bias_stride]);
    }
    c[i] = s[i] + b;
  }

  if (p.n_group > 1) {
    const int size = E / p.n_group;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (allowed[i]) dbuf[lane + 32 * i] = c[i];
    for (int g = lane; g < p.n_group; g += 32) ibuf[g] = 0;
    __syncwarp();
    double gs[kPerLane];  // n_group <= E: at most kPerLane groups per lane
    bool gfree[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int g = lane + 32 * i;
      gfree[i] = g < p.n_group;
      gs[i] = gfree[i] ? moe::group_score(dbuf + size_t(g) * size_t(size), size, p.bias != nullptr) : -INFINITY;
    }
    for (int r = 0; r < p.topk_group; ++r) {
      double v = -INFINITY, pay = 0.0;
      int gi = INT_MAX;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (gfree[i] && beats(gs[i], lane + 32 * i, v, gi)) {
          v = gs[i];
          gi = lane + 32 * i;
        }
      warp_argmax(v, gi, pay);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (lane + 32 * i == gi) gfree[i] = false;
      if (lane == 0 && gi < p.n_group) ibuf[gi] = 1;
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (allowed[i]) allowed[i] = ibuf[(lane + 32 * i) / size] != 0;
    __syncwarp();  // dbuf / ibuf are reused for the selection below
  }

  double wsum = 0.0;
  for (int j = 0; j < p.k; ++j) {
    double v = -INFINITY, sel = 0.0;
    int ei = INT_MAX;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (allowed[i] && beats(c[i], lane + 32 * i, v, ei)) {
        v = c[i];
        ei = lane + 32 * i;
        sel = s[i];
      }
    warp_argmax(v, ei, sel);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (lane + 32 * i == ei) allowed[i] = false;
    if (lane == 0) {
      dbuf[j] = sel;
      ibuf[j] = ei;
    }
    wsum += sel;  // every lane holds the same winner: the reference's sequential sum over j
  }
  __syncwarp();
  const double norm = p.renormalize && wsum > 0 ? wsum : 1.0;
  for (int j = lane; j < p.k; j += 32) {
    p.ids[t * p.ids_stride + j] = ibuf[j];
    p.weights[t * p.weights_stride + j] = float(dbuf[j] / norm * double(p.scale));
  }
}

template <typename TL>
void* pick(int per_lane) {
  switch (per_lane) {
    case 1: return reinterpret_cast<void*>(moe_routing_kernel<1, TL>);
    case 2: return reinterpret_cast<void*>(moe_routing_kernel<2, TL>);
    case 4: return reinterpret_cast<void*>(moe_routing_kernel<4, TL>);
    case 8: return reinterpret_cast<void*>(moe_routing_kernel<8, TL>);
    case 16: return reinterpret_cast<void*>(moe_routing_kernel<16, TL>);
    default: return nullptr;
  }
}

}  // namespace

Status launch_moe_routing(const moe::RoutingProblem& p, int device_index, Stream stream) {
  if (p.tokens == 0) return Status::ok();
  if (p.num_experts < 1 || p.num_experts > moe::kCudaRoutingMaxExperts)
    return Status::unsupported("moe routing: E = " + std::to_string(p.num_experts) + " experts; the CUDA kernel takes at most " +
                               std::to_string(moe::kCudaRoutingMaxExperts));
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  RoutingParams k{};
  k.logits = p.logits;
  k.logits_stride = p.logits_stride;
  k.bias = p.bias;
  k.bias_bf16 = p.bias_dtype == DType::kBF16;
  k.bias_stride = p.bias_stride;
  k.ids = p.topk_ids;
  k.ids_stride = p.ids_stride;
  k.weights = p.topk_weights;
  k.weights_stride = p.weights_stride;
  k.tokens = p.tokens;
  k.E = p.num_experts;
  k.k = p.top_k;
  k.sigmoid = p.sigmoid;
  k.renormalize = p.renormalize;
  k.n_group = p.n_group;
  k.topk_group = p.topk_group;
  k.scale = p.routed_scaling_factor;
  int per_lane = 1;
  while (per_lane * 32 < p.num_experts) per_lane *= 2;
  void* fn = nullptr;
  switch (p.logits_dtype) {
    case DType::kFP32: fn = pick<float>(per_lane); break;
    case DType::kBF16: fn = pick<__nv_bfloat16>(per_lane); break;
    case DType::kFP16: fn = pick<__half>(per_lane); break;
    default: break;
  }
  if (!fn) return Status::internal(std::string("moe routing: no CUDA kernel for logits dtype ") + dtype_name(p.logits_dtype));
  const size_t smem = size_t(kWarps) * size_t(p.num_experts) * (sizeof(double) + sizeof(int));
  const unsigned grid = unsigned((p.tokens + kWarps - 1) / kWarps);
  void* args[] = {&k};
  cudaError_t e = cudaLaunchKernel(fn, dim3(grid), dim3(kWarps * 32), args, smem, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return Status::cuda_error(std::string("moe routing launch: ") + cudaGetErrorString(e));
  return Status::ok();
}

}  // namespace encore::cuda
