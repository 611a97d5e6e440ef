// Benchmark harness: CUDA-event timing of back-to-back launch batches (median of samples after a
// warm-up), input rotation so the working set exceeds L2, the copy-bandwidth and cuBLAS-GEMM
// ceilings measured in the same run, and the environment (GPU, clocks, commit) for the JSON.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <string>

#include "encore/core/status.hpp"

namespace encore::bench {

struct TimeOptions {
  int warmup = 10;
  int samples = 25;          // events-timed graph replays; the median is reported
  double min_batch_us = 300; // each batch runs at least this long
  int max_batch = 10000;
  bool use_graph = true;     // false: time direct launches (a memcpy in a graph may run on a copy engine)
};

struct Timing {
  double median_us = 0, min_us = 0, max_us = 0;
  int batch = 0, samples = 0;
};

// A cuBLAS handle bound to `stream` (exits with a message if cuBLAS cannot start); cublasDestroy it.
cublasHandle_t cublas_on(cudaStream_t stream);

// Times `launch(i)` (i = 0, 1, 2, ... for rotating inputs) on `stream` (not the legacy default
// stream): a batch of consecutive launches is captured in a CUDA graph so host overhead and launch
// gaps stay out of device time; per-launch time = replay time / batch. The batch holds at least
// `min_launches` launches (pass the rotation's set count so every replay cycles through all sets).
Timing time_launches(const std::function<void(long long)>& launch, cudaStream_t stream, const TimeOptions& opts,
                     long long min_launches = 1);

struct Ceilings {
  double copy_gbps = 0;         // the better of the two copies below, bytes read + written
  double memcpy_gbps = 0;       // cudaMemcpyAsync device-to-device
  double copy_kernel_gbps = 0;  // a 16-byte-per-thread copy kernel
  double copy_bytes = 0;
  double gemm_tflops = 0;  // cuBLAS bf16 GEMM (fp32 accumulate) on random data
  int gemm_m = 0, gemm_n = 0, gemm_k = 0;
};
Ceilings measure_ceilings(cudaStream_t stream, const TimeOptions& opts);

struct Environment {
  std::string gpu, driver, commit, cuda_runtime;
  int sm_count = 0;
  double l2_mb = 0;
  std::string sm_clock_mhz, mem_clock_mhz, max_sm_clock_mhz;  // from nvidia-smi, "" when unavailable
  std::string timestamp;
};
Environment read_environment();

// Fills n elements at p with pseudo-random values in [-1, 1).
enum class FillKind { kBF16, kFP16, kFP32 };
void fill_random(void* p, size_t n, FillKind kind, unsigned long long seed, cudaStream_t stream);

// Device arena split into `sets` copies of a `set_bytes` working set, with sets * set_bytes >= 3 x L2
// (at most 8192 sets), filled with random values of `kind`.
struct Rotation {
  void* base = nullptr;
  size_t set_bytes = 0;
  long long sets = 1;
  char* set(long long i) const { return static_cast<char*>(base) + size_t(i % sets) * set_bytes; }
};
// flush = false: one set (repeated launches find their inputs in L2: 'warm' numbers).
Rotation make_rotation(size_t set_bytes, size_t l2_bytes, FillKind kind, bool flush = true);
void free_rotation(Rotation& r);

// ENCORE_BENCH_SIZES="1,64": the size loops of the qk_norm (tokens) and quant (rows) suites run only
// those sizes (to profile one size under ncu); unset or empty: every size.
bool size_selected(int64_t size);

// Floors for small memory-bound kernels, launched like any kernel under time_launches:
// launch_touch reads and writes back (in place, unchanged) the first `row_bytes` of each of `rows`
// rows (row stride `stride_bytes`, both multiples of 16), 16 bytes per thread in 128-thread blocks:
// the memory traffic of a kernel with that access pattern and nothing else; rows = 0 launches one
// empty block (the launch floor).
void launch_touch(void* base, int64_t rows, int64_t row_bytes, int64_t stride_bytes, cudaStream_t stream);

// Abort with a message on a CUDA error or a failed Status (benchmarks are not library code).
void check_cuda(cudaError_t e, const char* what);
void check_status(const Status& st, const char* what);

}  // namespace encore::bench
