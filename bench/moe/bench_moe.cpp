// Suite "moe": the whole moe_forward layer on CUDA (bf16; softmax top-8 routing, renormalized;
// dispatch padded to 16-row groups as bench/peers/moe_peers.py's torch path; grouped gate/up GEMM, SwiGLU,
// grouped down GEMM, combine) at the Qwen3-30B-A3B shape (D 2048, E 128, k 8, F 768) and the
// DeepSeek-V3-like shape (D 7168, E 256, k 8, F 2048), tokens 1, 2, 4, 8, 16, 64, 512, 4096, 16384
// (ENCORE_BENCH_SIZES selects), on each expert-compute path (record param "path": unfused, fused
// SwiGLU, and the decode GEMV where it applies). Device time per call from graph replays; metrics: time_us, the
// grouped GEMMs' useful TFLOP/s (2 * T * k * 3 * F * D / time), the experts touched and the weight-
// read floor (their w13 + w2 bytes at the copy ceiling measured in the same run). Then dispatch (with
// the x gather) and combine alone on the layer's buffers (the routing of the layer call), each against
// the bytes it must move at the copy ceiling (moe_peers.py's definition: dispatch 2 * T * k * D * 2 +
// T * k * 12, combine T * k * D * 2 + T * D * 2 + T * k * 8; the padding rows are not counted). From
// T = 512: the grouped GEMMs' dense equivalent on cuBLAS (moe_dense_cublas).
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"
#include "encore/moe.hpp"
#include "moe/problem.hpp"

namespace encore::bench {

namespace {

struct Shape {
  const char* name;
  int64_t D, F;
  int E, k;
};
const Shape kShapes[] = {{"qwen3_30b_a3b", 2048, 768, 128, 8}, {"deepseek_v3_like", 7168, 2048, 256, 8}};
const int64_t kTokens[] = {1, 2, 4, 8, 16, 64, 512, 4096, 16384};

// The grouped GEMMs' dense equivalent on cuBLAS (issue 31's comparison): every (token, expert) pair's
// row in one GEMM per projection, M = T k rows, gate/up [M, D] x [2F, D]^T and down [M, F] x [D, F]^T,
// bf16 with fp32 accumulation, back to back; what the expert compute would cost with no grouping and
// no padding (record "moe_dense_cublas": time_us and TFLOP/s).
void time_dense_cublas(const Shape& s, int64_t T, cudaStream_t stream, const TimeOptions& topts, Report& report) {
  const int64_t M = T * s.k;
  std::vector<void*> mem;
  auto alloc = [&](size_t elems, unsigned long long seed) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, elems * 2), "moe dense alloc");
    if (seed) fill_random(p, elems, FillKind::kBF16, seed, stream);
    mem.push_back(p);
    return p;
  };
  void *a = alloc(size_t(M * s.D), 5), *w13 = alloc(size_t(2 * s.F * s.D), 6), *h = alloc(size_t(M * 2 * s.F), 0);
  void *act = alloc(size_t(M * s.F), 7), *w2 = alloc(size_t(s.D * s.F), 8), *y = alloc(size_t(M * s.D), 0);
  cublasHandle_t handle = cublas_on(stream);
  const float one = 1.f, zero = 0.f;
  // Row-major C[M, N] = A[M, K] B[N, K]^T as column-major C^T = B A^T.
  auto gemm = [&](void* c, const void* aa, const void* bb, int64_t m, int64_t n, int64_t k) {
    const cublasStatus_t st = cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &one, bb, CUDA_R_16BF, int(k), aa,
                                           CUDA_R_16BF, int(k), &zero, c, CUDA_R_16BF, int(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "encore bench: cublasGemmEx failed (%d)\n", int(st));
      std::exit(3);
    }
  };
  const Timing t = time_launches(
      [&](long long) {
        gemm(h, a, w13, M, 2 * s.F, s.D);
        gemm(y, act, w2, M, s.D, s.F);
      },
      stream, topts, 1);
  cublasDestroy(handle);
  for (void* p : mem) cudaFree(p);
  const double flops = 2.0 * double(M) * 3.0 * double(s.F) * double(s.D);
  Record r;
  r.suite = "moe";
  r.name = "moe_dense_cublas";
  r.params = {{"shape", s.name}, {"tokens", std::to_string(T)}, {"D", std::to_string(s.D)}, {"F", std::to_string(s.F)},
              {"k", std::to_string(s.k)}, {"dtype", "bf16"}, {"version", "cublasGemmEx gate/up [T k, 2F] + down [T k, D]"}};
  r.metrics = {{"time_us", t.median_us}, {"gemm_tflops", flops / (t.median_us * 1e6)}};
  report.records.push_back(r);
  std::printf("  moe_dense_cublas %-12s T %6lld %10.1f us  %6.1f TFLOP/s (the grouped GEMMs' dense equivalent)\n", s.name, (long long)T,
              t.median_us, flops / (t.median_us * 1e6));
  std::fflush(stdout);
}

// Device memory for one shape: weights, inputs, output and the layer's buffers for max_tokens.
struct MoeBenchCase {
  std::vector<void*> allocs;
  MoeOptions o;
  MoeBuffers b;
  void *x = nullptr, *logits = nullptr, *w13 = nullptr, *w2 = nullptr, *out = nullptr;

  void* alloc(size_t bytes, FillKind kind, cudaStream_t stream, unsigned long long seed) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, bytes), "moe bench alloc");
    allocs.push_back(p);
    if (seed) fill_random(p, bytes / (kind == FillKind::kFP32 ? 4 : 2), kind, seed, stream);
    return p;
  }
  MoeBenchCase(const Shape& s, int64_t max_tokens, cudaStream_t stream) {
    o.routing.top_k = s.k;
    o.align_m = 16;
    x = alloc(size_t(max_tokens * s.D) * 2, FillKind::kBF16, stream, 1);
    logits = alloc(size_t(max_tokens * s.E) * 4, FillKind::kFP32, stream, 2);
    w13 = alloc(size_t(s.E) * size_t(2 * s.F * s.D) * 2, FillKind::kBF16, stream, 3);
    w2 = alloc(size_t(s.E) * size_t(s.D * s.F) * 2, FillKind::kBF16, stream, 4);
    out = alloc(size_t(max_tokens * s.D) * 2, FillKind::kBF16, stream, 0);
    const MoeLayerShape ls{max_tokens, s.D, s.F, s.E, DType::kBF16};
    const size_t bytes = moe_buffers_bytes(ls, o);
    void* base = alloc(bytes, FillKind::kBF16, stream, 0);
    check_status(moe_buffers_carve(ls, o, base, bytes, Device{DeviceType::kCUDA, 0}, &b), "moe buffers");
    check_cuda(cudaStreamSynchronize(stream), "moe bench fill");
  }
  MoeBenchCase(const MoeBenchCase&) = delete;
  MoeBenchCase& operator=(const MoeBenchCase&) = delete;
  ~MoeBenchCase() {
    for (void* p : allocs) check_cuda(cudaFree(p), "free");
  }
  MoeForwardArgs args(const Shape& s, int64_t T) const {
    const Device dev{DeviceType::kCUDA, 0};
    return {TensorView::contiguous(x, DType::kBF16, {T, s.D}, dev), TensorView::contiguous(logits, DType::kFP32, {T, int64_t(s.E)}, dev), {},
            TensorView::contiguous(w13, DType::kBF16, {s.E, 2 * s.F, s.D}, dev), TensorView::contiguous(w2, DType::kBF16, {s.E, s.D, s.F}, dev), b,
            TensorView::contiguous(out, DType::kBF16, {T, s.D}, dev)};
  }
};

}  // namespace

void run_moe_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  for (const Shape& s : kShapes) {
    const MoeBenchCase mc(s, kTokens[sizeof(kTokens) / sizeof(kTokens[0]) - 1], stream);
    for (int64_t T : kTokens) {
      if (!size_selected(T)) continue;
      const MoeForwardArgs a = mc.args(s, T);
      check_status(run(a, mc.o, nullptr, stream), "moe_forward");
      std::vector<int32_t> counts(size_t(s.E));
      check_cuda(cudaMemcpyAsync(counts.data(), mc.b.expert_counts.data, counts.size() * 4, cudaMemcpyDeviceToHost, stream), "counts");
      check_cuda(cudaStreamSynchronize(stream), "sync");
      int touched = 0;
      for (int32_t c : counts) touched += c > 0;
      const double flops = 2.0 * double(T) * s.k * 3.0 * double(s.F) * double(s.D);
      const double weight_bytes = double(touched) * 3.0 * double(s.F) * double(s.D) * 2.0;
      const double floor_us = report.ceilings.copy_gbps > 0 ? weight_bytes / (report.ceilings.copy_gbps * 1e3) : 0.0;
      // The expert-compute paths (environment read at every call): the grouped GEMMs with the SwiGLU in a
      // row kernel or in the up GEMM's epilogue, each also with the cooperative GEMMs on 128x256 tiles
      // (the default from T 2), and the decode GEMV where it applies (T <= 16).
      struct Path {
        const char *name, *fused, *decode, *tile, *version;
      };
      const Path paths[] = {
          {"unfused", "0", "0", "128x128", "ptr-array grouped GEMMs 128x128: gate/up (coop) + SwiGLU row kernel, down (coop)"},
          {"fused", "1", "0", "128x128", "ptr-array grouped GEMMs 128x128: gate (coop) + up with the SwiGLU epilogue (ping-pong), down (coop)"},
          {"unfused_wide", "0", "0", "128x256", "ptr-array grouped GEMMs: gate/up (coop 128x256) + SwiGLU row kernel, down (coop 128x256)"},
          {"fused_wide", "1", "0", "128x256",
           "ptr-array grouped GEMMs: gate (coop 128x256) + up with the SwiGLU epilogue (ping-pong 128x128), down (coop 128x256)"},
          {"decode", "0", "1", "128x128", "decode GEMV: weight-streaming kernels over the active experts' staged rows"},
      };
      for (const Path& path : paths) {
        setenv("ENCORE_MOE_FUSED_SWIGLU", path.fused, 1);
        setenv("ENCORE_MOE_DECODE", path.decode, 1);
        setenv("ENCORE_MOE_GEMM_TILE", path.tile, 1);
        if (std::string(path.name) == "decode" && !moe::moe_decode_gemv(T, s.D, s.F)) continue;  // T > 16, or its rows do not fit
        Timing t = time_launches([&](long long) { check_status(run(a, mc.o, nullptr, stream), "moe_forward"); }, stream, topts, 1);
        Record r;
        r.suite = "moe";
        r.name = "moe_forward";
        r.params = {{"shape", s.name}, {"tokens", std::to_string(T)}, {"D", std::to_string(s.D)}, {"F", std::to_string(s.F)},
                    {"E", std::to_string(s.E)}, {"k", std::to_string(s.k)}, {"align_m", "16"}, {"dtype", "bf16"},
                    {"path", path.name}, {"version", path.version}};
        r.metrics = {{"time_us", t.median_us}, {"gemm_tflops", flops / (t.median_us * 1e6)}, {"experts_touched", double(touched)},
                     {"weight_floor_us", floor_us}};
        report.records.push_back(r);
        std::printf("  moe_forward %-17s T %6lld %-12s %10.1f us  %6.1f TFLOP/s  experts %3d  weight floor %8.1f us\n", s.name, (long long)T,
                    path.name, t.median_us, flops / (t.median_us * 1e6), touched, floor_us);
        std::fflush(stdout);
      }
      unsetenv("ENCORE_MOE_FUSED_SWIGLU");
      unsetenv("ENCORE_MOE_GEMM_TILE");
      unsetenv("ENCORE_MOE_DECODE");
      // Dispatch and combine alone, on the buffers as moe_forward uses them (row_slots / x_permuted of
      // the buffers' R rows).
      const Device dev{DeviceType::kCUDA, 0};
      const MoeBuffers& b = mc.b;
      const TensorView ids = TensorView::contiguous(b.topk_ids.data, DType::kInt32, {T, int64_t(s.k)}, dev);
      const TensorView slots = TensorView::contiguous(b.slot_rows.data, DType::kInt32, {T, int64_t(s.k)}, dev);
      const TensorView weights = TensorView::contiguous(b.topk_weights.data, DType::kFP32, {T, int64_t(s.k)}, dev);
      const MoeDispatchArgs da{ids, a.x, b.expert_counts, b.expert_offsets, slots, b.row_slots, b.x_permuted};
      const MoeDispatchOptions dopt{s.E, mc.o.align_m};
      const MoeCombineArgs ca{b.expert_out, slots, weights, a.out};
      const double tk = double(T) * s.k, D = double(s.D);
      const struct {
        const char *name, *version;
        double bytes;
        std::function<void()> launch;
      } steps[] = {{"moe_dispatch", "maps (1 block | count-scatter) + PDL gather, warp per 2 KB", 2 * tk * D * 2 + tk * 12,
                    [&] { check_status(run(da, dopt, b.dispatch_workspace.data, stream), "moe_dispatch"); }},
                   {"moe_combine", "thread per (token, 8 columns), 8 slot loads in flight", tk * D * 2 + double(T) * D * 2 + tk * 8,
                    [&] { check_status(run(ca, MoeCombineOptions{}, nullptr, stream), "moe_combine"); }}};
      if (T >= 512) time_dense_cublas(s, T, stream, topts, report);
      for (const auto& st : steps) {
        st.launch();
        check_cuda(cudaStreamSynchronize(stream), "sync");
        const Timing ts = time_launches([&](long long) { st.launch(); }, stream, topts, 1);
        const double copy_us = report.ceilings.copy_gbps > 0 ? st.bytes / (report.ceilings.copy_gbps * 1e3) : 0.0;
        Record rs;
        rs.suite = "moe";
        rs.name = st.name;
        rs.params = {{"shape", s.name}, {"tokens", std::to_string(T)}, {"D", std::to_string(s.D)}, {"E", std::to_string(s.E)},
                     {"k", std::to_string(s.k)}, {"align_m", "16"}, {"dtype", "bf16"},
                     {"version", st.version}};
        rs.metrics = {{"time_us", ts.median_us}, {"copy_floor_us", copy_us}, {"of_copy_bandwidth", copy_us > 0 ? copy_us / ts.median_us : 0.0}};
        report.records.push_back(rs);
        std::printf("  %-12s %-17s T %6lld %10.1f us  copy floor %8.1f us (%4.0f%%)\n", st.name, s.name, (long long)T, ts.median_us, copy_us,
                    copy_us > 0 ? 100.0 * copy_us / ts.median_us : 0.0);
        std::fflush(stdout);
      }
    }
  }
}

}  // namespace encore::bench
