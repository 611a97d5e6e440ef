#include "bench/harness.hpp"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <vector>

#include "encore/core/device_info.hpp"

namespace encore::bench {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "encore bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(3);
  }
}

void check_status(const Status& st, const char* what) {
  if (!st) {
    std::fprintf(stderr, "encore bench: %s: %s\n", what, st.to_string().c_str());
    std::exit(3);
  }
}

namespace {

__device__ __forceinline__ float hash_uniform(unsigned long long i, unsigned long long seed) {
  unsigned long long z = i * 0x9E3779B97F4A7C15ull + seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return float(z >> 40) * (2.0f / 16777216.0f) - 1.0f;  // [-1, 1)
}

template <typename T>
__global__ void fill_kernel(T* p, size_t n, unsigned long long seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    p[i] = T(hash_uniform(i, seed));
  }
}

// dst = src, 16 bytes per access, 4 accesses in flight per thread, grid-stride.
__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

// In place: p[row, j] ^= key (key = 0 at run time, so the data stays; the XOR keeps the compiler
// from dropping a store of the value just loaded), 16 bytes per thread; no rows: nothing.
__global__ void touch_kernel(char* p, uint32_t packs_per_row, uint32_t total, int64_t stride, uint32_t key) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  uint4* q = reinterpret_cast<uint4*>(p + int64_t(i / packs_per_row) * stride) + i % packs_per_row;
  uint4 v = *q;
  v.x ^= key;
  *q = v;
}

}  // namespace

void launch_touch(void* base, int64_t rows, int64_t row_bytes, int64_t stride_bytes, cudaStream_t stream) {
  const uint32_t packs = uint32_t(row_bytes / 16), total = uint32_t(rows) * packs;
  const uint32_t blocks = total == 0 ? 1 : (total + 127) / 128;
  touch_kernel<<<blocks, 128, 0, stream>>>(static_cast<char*>(base), packs == 0 ? 1 : packs, total, stride_bytes, 0u);
  check_cuda(cudaGetLastError(), "touch_kernel launch");
}

void fill_random(void* p, size_t n, FillKind kind, unsigned long long seed, cudaStream_t stream) {
  const int threads = 256, blocks = 4096;
  switch (kind) {
    case FillKind::kBF16: fill_kernel<<<blocks, threads, 0, stream>>>(static_cast<__nv_bfloat16*>(p), n, seed); break;
    case FillKind::kFP16: fill_kernel<<<blocks, threads, 0, stream>>>(static_cast<__half*>(p), n, seed); break;
    case FillKind::kFP32: fill_kernel<<<blocks, threads, 0, stream>>>(static_cast<float*>(p), n, seed); break;
  }
  check_cuda(cudaGetLastError(), "fill_random");
}

Rotation make_rotation(size_t set_bytes, size_t l2_bytes, FillKind kind, bool flush) {
  Rotation r;
  r.set_bytes = (set_bytes + 255) / 256 * 256;
  r.sets = flush ? std::clamp<long long>((3 * (long long)l2_bytes + (long long)r.set_bytes - 1) / (long long)r.set_bytes, 1, 8192) : 1;
  check_cuda(cudaMalloc(&r.base, r.set_bytes * size_t(r.sets)), "cudaMalloc (rotation arena)");
  const size_t elem = kind == FillKind::kFP32 ? 4 : 2;
  fill_random(r.base, r.set_bytes * size_t(r.sets) / elem, kind, 12345, nullptr);
  check_cuda(cudaDeviceSynchronize(), "fill rotation arena");
  return r;
}

bool size_selected(int64_t size) {
  const char* env = std::getenv("ENCORE_BENCH_SIZES");
  if (!env || !*env) return true;
  for (const char* p = env; *p;) {
    char* end = nullptr;
    const long long v = std::strtoll(p, &end, 10);
    if (end == p) break;
    if (v == size) return true;
    p = *end ? end + 1 : end;
  }
  return false;
}

void free_rotation(Rotation& r) {
  if (r.base) cudaFree(r.base);
  r.base = nullptr;
}

cublasHandle_t cublas_on(cudaStream_t stream) {
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "encore bench: cublasCreate failed\n");
    std::exit(3);
  }
  cublasSetStream(h, stream);
  return h;
}

Timing time_launches(const std::function<void(long long)>& launch, cudaStream_t stream, const TimeOptions& o,
                     long long min_launches) {
  long long it = 0;
  for (int i = 0; i < o.warmup; ++i) launch(it++);
  check_cuda(cudaStreamSynchronize(stream), "warm-up");
  check_cuda(cudaGetLastError(), "warm-up launch");

  cudaEvent_t e0, e1;
  check_cuda(cudaEventCreate(&e0), "cudaEventCreate");
  check_cuda(cudaEventCreate(&e1), "cudaEventCreate");
  auto elapsed_us = [&]() {
    check_cuda(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    return double(ms) * 1000.0;
  };
  // Rough per-launch time from a short direct batch sizes the captured batch.
  const int probe = 8;
  check_cuda(cudaEventRecord(e0, stream), "cudaEventRecord");
  for (int i = 0; i < probe; ++i) launch(it++);
  check_cuda(cudaEventRecord(e1, stream), "cudaEventRecord");
  const double rough = std::max(0.5, elapsed_us() / probe);
  long long batch = (long long)(o.min_batch_us / rough) + 1;
  batch = std::clamp<long long>(std::max(batch, min_launches), 1, o.max_batch);

  std::vector<double> per_launch;
  if (!o.use_graph) {
    for (int s = 0; s < o.samples; ++s) {
      check_cuda(cudaEventRecord(e0, stream), "cudaEventRecord");
      for (long long i = 0; i < batch; ++i) launch(it++);
      check_cuda(cudaEventRecord(e1, stream), "cudaEventRecord");
      per_launch.push_back(elapsed_us() / double(batch));
    }
  } else {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  for (long long i = 0; i < batch; ++i) launch(it++);
  check_cuda(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");  // warm replay
  check_cuda(cudaStreamSynchronize(stream), "graph warm-up");

  for (int s = 0; s < o.samples; ++s) {
    check_cuda(cudaEventRecord(e0, stream), "cudaEventRecord");
    check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    check_cuda(cudaEventRecord(e1, stream), "cudaEventRecord");
    per_launch.push_back(elapsed_us() / double(batch));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  }
  check_cuda(cudaGetLastError(), "timed launches");
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(per_launch.begin(), per_launch.end());
  Timing t;
  t.samples = int(per_launch.size());
  t.batch = int(batch);
  t.min_us = per_launch.front();
  t.max_us = per_launch.back();
  t.median_us = per_launch[per_launch.size() / 2];
  return t;
}

Ceilings measure_ceilings(cudaStream_t stream, const TimeOptions& o) {
  Ceilings c;
  // Copy bandwidth: 2 GiB device-to-device, two buffers alternating direction.
  const size_t bytes = size_t(1) << 31;
  void *a = nullptr, *b = nullptr;
  check_cuda(cudaMalloc(&a, bytes), "cudaMalloc (copy)");
  check_cuda(cudaMalloc(&b, bytes), "cudaMalloc (copy)");
  fill_random(a, bytes / 4, FillKind::kFP32, 1, stream);
  TimeOptions co = o;
  co.min_batch_us = 0;
  co.warmup = 3;
  co.samples = std::min(o.samples, 10);
  co.use_graph = false;
  Timing tc = time_launches([&](long long i) {
    check_cuda(cudaMemcpyAsync(i % 2 ? a : b, i % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice, stream), "memcpy");
  }, stream, co);
  c.copy_bytes = 2.0 * double(bytes);
  c.memcpy_gbps = c.copy_bytes / (tc.median_us * 1e-6) / 1e9;
  const DeviceInfo* info = nullptr;
  const int sms = get_device_info(0, &info) ? info->sm_count : 132;
  Timing tk = time_launches([&](long long i) {
    copy_kernel<<<sms * 4, 512, 0, stream>>>(static_cast<const uint4*>(i % 2 ? b : a), static_cast<uint4*>(i % 2 ? a : b),
                                            bytes / 16);
  }, stream, co);
  c.copy_kernel_gbps = c.copy_bytes / (tk.median_us * 1e-6) / 1e9;
  c.copy_gbps = std::max(c.memcpy_gbps, c.copy_kernel_gbps);
  cudaFree(a);
  cudaFree(b);

  // cuBLAS bf16 GEMM, 8192^3, fp32 accumulate, random inputs.
  const int M = 8192, N = 8192, K = 8192;
  void *A, *B, *C;
  check_cuda(cudaMalloc(&A, size_t(M) * K * 2), "cudaMalloc (gemm)");
  check_cuda(cudaMalloc(&B, size_t(N) * K * 2), "cudaMalloc (gemm)");
  check_cuda(cudaMalloc(&C, size_t(M) * N * 2), "cudaMalloc (gemm)");
  fill_random(A, size_t(M) * K, FillKind::kBF16, 2, stream);
  fill_random(B, size_t(N) * K, FillKind::kBF16, 3, stream);
  cublasHandle_t h = cublas_on(stream);
  const float alpha = 1.f, beta = 0.f;
  Timing tg = time_launches([&](long long) {
    // Column-major C[N,M] = B^T[N,K] * A[K,M]  <=>  row-major C[M,N] = A[M,K] * B[N,K]^T.
    cublasStatus_t s = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, B, CUDA_R_16BF, K, A, CUDA_R_16BF, K,
                                    &beta, C, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "encore bench: cublasGemmEx failed (%d)\n", int(s));
      std::exit(3);
    }
  }, stream, co);
  c.gemm_m = M;
  c.gemm_n = N;
  c.gemm_k = K;
  c.gemm_tflops = 2.0 * M * N * double(K) / (tg.median_us * 1e-6) / 1e12;
  cublasDestroy(h);
  cudaFree(A);
  cudaFree(B);
  cudaFree(C);
  return c;
}

namespace {
std::string shell_line(const char* cmd) {
  std::array<char, 512> buf{};
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd, "r"), pclose);
  if (!pipe || !fgets(buf.data(), int(buf.size()), pipe.get())) return "";
  std::string s(buf.data());
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}
}  // namespace

Environment read_environment() {
  Environment env;
  const DeviceInfo* info = nullptr;
  if (get_device_info(0, &info)) {
    env.gpu = info->name;
    env.sm_count = info->sm_count;
    env.l2_mb = info->l2_bytes / 1e6;
  }
  const char* c = std::getenv("ENCORE_COMMIT");
  env.commit = c && *c ? c : ENCORE_GIT_COMMIT;
  int rt = 0;
  cudaRuntimeGetVersion(&rt);
  env.cuda_runtime = std::to_string(rt / 1000) + "." + std::to_string((rt % 1000) / 10);
  env.driver = shell_line("nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null");
  env.sm_clock_mhz = shell_line("nvidia-smi --query-gpu=clocks.sm --format=csv,noheader,nounits 2>/dev/null");
  env.mem_clock_mhz = shell_line("nvidia-smi --query-gpu=clocks.mem --format=csv,noheader,nounits 2>/dev/null");
  env.max_sm_clock_mhz = shell_line("nvidia-smi --query-gpu=clocks.max.sm --format=csv,noheader,nounits 2>/dev/null");
  std::time_t now = std::time(nullptr);
  char ts[32];
  std::strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  env.timestamp = ts;
  return env;
}

}  // namespace encore::bench
