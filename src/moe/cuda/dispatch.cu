// MoE dispatch on CUDA: the ahead-of-time instantiations of the map and gather kernels
// (dispatch_kernel.cuh, also the JIT's source of the map kernels) and their launches.
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "common/cuda/device_guard.hpp"
#include "common/cuda/launch_check.hpp"
#include "moe/cuda/dispatch_fp8_gather.cuh"
#include "moe/cuda/dispatch_kernel.cuh"
#include "moe/cuda/launch.hpp"

namespace encore::cuda {
namespace {

DispatchParams make_params(const moe::DispatchProblem& p, const moe::DispatchPlan& plan) {
  const int64_t pairs = p.tokens * p.top_k;
  const long long chunks = (pairs + moe::kDispatchChunkPairs - 1) / moe::kDispatchChunkPairs;
  DispatchParams k{};
  k.ids = p.topk_ids;
  k.ids_stride = p.ids_stride;
  k.pairs = pairs;
  k.k = p.top_k;
  k.E = p.num_experts;
  k.align_m = p.align_m;
  k.counts = p.counts;
  k.offsets = p.offsets;
  k.slot_rows = p.slot_rows;
  k.slot_stride = p.slot_stride;
  k.row_slots = p.row_slots;
  k.rows = p.rows;
  if (p.x) {
    const int64_t esz = int64_t(dtype_size(p.dtype));
    k.x = static_cast<const unsigned char*>(p.x);
    k.x_stride_bytes = p.x_stride * esz;
    k.xp = static_cast<unsigned char*>(p.x_permuted);
    k.xp_stride_bytes = p.xp_stride * esz;
    k.row_bytes = p.hidden * esz;
    k.vec16 = k.row_bytes % 16 == 0 && k.x_stride_bytes % 16 == 0 && k.xp_stride_bytes % 16 == 0 &&
              reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && reinterpret_cast<uintptr_t>(p.x_permuted) % 16 == 0;
  }
  // Decode: row_slots[offsets[E], R) is the gather kernel's, even without x (only the gather reads it).
  k.fill_tail = plan.path == moe::DispatchPath::kSingleBlock || pairs == 0;
  k.hist = p.cursors;
  k.chunks = chunks < 1 ? 1 : chunks;
  return k;
}

void* aot_map_kernel(DispatchMapKernel kind) {
  switch (kind) {
    case DispatchMapKernel::kSingleBlock: return reinterpret_cast<void*>(dispatch_single_block_kernel<0, 0>);
    case DispatchMapKernel::kHistogram: return reinterpret_cast<void*>(dispatch_histogram_kernel<0, 0>);
    case DispatchMapKernel::kScan: return reinterpret_cast<void*>(dispatch_scan_kernel<0, 0>);
    case DispatchMapKernel::kScatter: return reinterpret_cast<void*>(dispatch_scatter_kernel<0, 0>);
  }
  return nullptr;
}

// The fused FP8 gather's arguments and kernel for x's dtype (items: rows x chunks of 4 groups per lane team).
constexpr int kFp8Unroll = 4;
DispatchFp8Params fp8_params(const moe::DispatchProblem& p, const DispatchParams& k) {
  DispatchFp8Params f{};
  f.d = k;
  f.x = p.x;
  f.x_stride = p.x_stride;
  f.q = static_cast<uint8_t*>(p.x_permuted);
  f.q_stride = p.xp_stride;
  f.scales = p.x_scales;
  f.scales_stride = p.scales_stride;
  f.groups_per_row = int(p.hidden / 128);
  f.power_of_two = p.fp8_power_of_two;
  f.eps = p.fp8_eps;
  return f;
}
void* fp8_gather_kernel(DType dt) {
  switch (dt) {
    case DType::kBF16: return reinterpret_cast<void*>(dispatch_gather_fp8_kernel<__nv_bfloat16, kFp8Unroll>);
    case DType::kFP16: return reinterpret_cast<void*>(dispatch_gather_fp8_kernel<__half, kFp8Unroll>);
    case DType::kFP32: return reinterpret_cast<void*>(dispatch_gather_fp8_kernel<float, kFp8Unroll>);
    default: return nullptr;
  }
}

const char* map_kernel_what(DispatchMapKernel kind) {
  switch (kind) {
    case DispatchMapKernel::kSingleBlock: return "single-block";
    case DispatchMapKernel::kHistogram: return "histogram";
    case DispatchMapKernel::kScan: return "scan";
    case DispatchMapKernel::kScatter: return "scatter";
  }
  return "map";
}

}  // namespace

Status moe_dispatch_check(const moe::DispatchProblem& p, const moe::DispatchPlan& plan) {
  if (p.num_experts < 1 || p.num_experts > moe::kCudaDispatchMaxExperts)
    return Status::unsupported("moe dispatch: E = " + std::to_string(p.num_experts) + " experts; the CUDA kernels take at most " +
                               std::to_string(moe::kCudaDispatchMaxExperts));
  const int64_t pairs = p.tokens * p.top_k;
  const long long chunks = (pairs + moe::kDispatchChunkPairs - 1) / moe::kDispatchChunkPairs;
  if (plan.path == moe::DispatchPath::kCountThenScatter &&
      plan.workspace_bytes < size_t(p.num_experts) * size_t(chunks < 1 ? 1 : chunks) * sizeof(int32_t))
    return Status::internal("moe dispatch: the plan's workspace does not hold the histograms");
  return Status::ok();
}

int moe_dispatch_map_launches(const moe::DispatchProblem& p, const moe::DispatchPlan& plan, DispatchMapLaunch out[3], void* params) {
  static_assert(sizeof(DispatchParams) <= kMoeDispatchParamsMaxBytes);
  const DispatchParams k = make_params(p, plan);
  std::memcpy(params, &k, sizeof(k));
  const size_t smem_scan = (size_t(2) * size_t(p.num_experts) + 1 + 32) * sizeof(int);
  if (k.fill_tail) {
    const size_t smem_rank =
        parallel_rank(k.pairs, p.num_experts) ? (size_t(kStagedIds) + size_t(kDispatchWarps) * size_t(p.num_experts)) * sizeof(int) : 0;
    out[0] = {DispatchMapKernel::kSingleBlock, 1, unsigned(kDispatchThreads), smem_scan + kStagedIds * sizeof(int) + smem_rank};
    return 1;
  }
  const unsigned nchunks = unsigned(k.chunks);
  const size_t smem_e = size_t(p.num_experts) * sizeof(int);
  out[0] = {DispatchMapKernel::kHistogram, nchunks, unsigned(kDispatchThreads), smem_e};
  out[1] = {DispatchMapKernel::kScan, 1, 1024, smem_scan};
  out[2] = {DispatchMapKernel::kScatter, nchunks, 32, smem_e + moe::kDispatchChunkPairs * sizeof(int)};
  return 3;
}

// The gather (and, for decode, the row_slots tail) as a programmatic dependent of the map kernel
// just launched on the stream. Its grid: enough warps for the rows that can be in use, at most
// plan.grid blocks. Nothing to do for a prefill without x.
Status launch_moe_dispatch_gather(const moe::DispatchProblem& p, const moe::DispatchPlan& plan, const void* params, int device_index,
                                  Stream stream) {
  DispatchParams k;
  std::memcpy(&k, params, sizeof(k));
  if (!k.fill_tail && !k.x) return Status::ok();
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  const int64_t pairs = k.pairs;
  int64_t rows_bound = pairs + (pairs < p.num_experts ? pairs : int64_t(p.num_experts)) * (p.align_m - 1);
  if (rows_bound > k.rows) rows_bound = k.rows;
  const bool fp8 = k.x && p.x_scales;
  // Bytes of x per item, as the kernels: 32 lanes x 4 vectors; fp8: 32 lanes x 4 packs of 16 bytes too.
  const int64_t chunk = fp8 || k.vec16 ? 32 * 16 * 4 : 32 * 2 * 4;
  const int64_t warps_per_block = kDispatchThreads / 32;
  long long blocks = 1;
  if (k.x) blocks = (long long)((rows_bound * ((k.row_bytes + chunk - 1) / chunk) + warps_per_block - 1) / warps_per_block);
  if (k.fill_tail) {
    const long long tail = (long long)((k.rows + kDispatchThreads - 1) / kDispatchThreads);
    if (tail > blocks) blocks = tail;
  }
  const long long cap = plan.grid < 1 ? 1 : plan.grid;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = pdl_config(dim3(unsigned(blocks)), dim3(kDispatchThreads), 0, static_cast<cudaStream_t>(stream), true, attr);
  if (fp8) {
    DispatchFp8Params f = fp8_params(p, k);
    void* kernel = fp8_gather_kernel(p.dtype);
    if (!kernel) return Status::unsupported(std::string("moe dispatch: the fused FP8 gather takes bf16, fp16 or fp32 x, got ") + dtype_name(p.dtype));
    void* args[] = {&f};
    return launch_api("moe dispatch fp8 gather", [&] { return cudaLaunchKernelExC(&cfg, kernel, args); });
  }
  return launch_api("moe dispatch gather", [&] {
    return k.vec16 ? cudaLaunchKernelEx(&cfg, dispatch_gather_kernel<16, 4>, k) : cudaLaunchKernelEx(&cfg, dispatch_gather_kernel<2, 4>, k);
  });
}

Status launch_moe_dispatch(const moe::DispatchProblem& p, const moe::DispatchPlan& plan, int device_index, Stream stream) {
  ENCORE_RETURN_IF_ERROR(moe_dispatch_check(p, plan));
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(device_index));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  alignas(16) unsigned char params[kMoeDispatchParamsMaxBytes];
  DispatchMapLaunch launches[3];
  const int n = moe_dispatch_map_launches(p, plan, launches, params);
  for (int i = 0; i < n; ++i) {
    const DispatchMapLaunch& l = launches[i];
    void* args[] = {params};
    const std::string what = std::string("moe dispatch ") + map_kernel_what(l.kernel);
    ENCORE_RETURN_IF_ERROR(
        launch_api(what.c_str(), [&] { return cudaLaunchKernel(aot_map_kernel(l.kernel), dim3(l.grid), dim3(l.block), args, l.smem, s); }));
  }
  return launch_moe_dispatch_gather(p, plan, params, device_index, stream);
}

}  // namespace encore::cuda
