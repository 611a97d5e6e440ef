// Suite "gemm_epilogue": the CUTLASS Sm90 row-scale GEMM (D = r[m] · A·Wᵀ, bf16) against cuBLAS's
// plain GEMM of the same shape in the same run (the speed of light of a fused epilogue), at the
// LLaMA-3 8B/1B block shapes of anchors.md. Inputs rotate so the working set exceeds L2.
#include <cublas_v2.h>

#include <cstdio>
#include <string>
#include <vector>

#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"
#include "encore/gemm_epilogue.hpp"

namespace encore::bench {

void run_gemm_epilogue_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  const Device dev{DeviceType::kCUDA, 0};
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return;
  cublasSetStream(handle, stream);
  const int shapes[][3] = {{8192, 4096, 4096}, {8192, 28672, 4096}, {8192, 4096, 14336}, {8192, 2048, 2048}, {8192, 16384, 2048}};
  for (const auto& s : shapes) {
    const int M = s[0], N = s[1], K = s[2];
    const size_t a_bytes = size_t(M) * K * 2, w_bytes = size_t(N) * K * 2, d_bytes = size_t(M) * N * 2;
    const size_t w_off = (a_bytes + 255) / 256 * 256, d_off = w_off + (w_bytes + 255) / 256 * 256, r_off = d_off + (d_bytes + 255) / 256 * 256;
    Rotation rot = make_rotation(r_off + size_t(M) * 4, info->l2_bytes, FillKind::kBF16);
    // r must be finite fp32: overwrite each set's r slot with ones.
    std::vector<float> ones(size_t(M), 1.0f);
    for (long long i = 0; i < rot.sets; ++i) check_cuda(cudaMemcpy(rot.set(i) + r_off, ones.data(), size_t(M) * 4, cudaMemcpyHostToDevice), "r");
    Timing te = time_launches([&](long long i) {
      char* b = rot.set(i);
      GemmEpilogueArgs g;
      g.a = TensorView::contiguous(b, DType::kBF16, {M, K}, dev);
      g.w = TensorView::contiguous(b + w_off, DType::kBF16, {N, K}, dev);
      g.d = TensorView::contiguous(b + d_off, DType::kBF16, {M, N}, dev);
      g.row_scale = TensorView::contiguous(b + r_off, DType::kFP32, {M}, dev);
      Status st = run(g, GemmEpilogueOptions{Epilogue::kRowScale}, nullptr, stream);
      if (!st) {
        std::fprintf(stderr, "encore bench: gemm_epilogue: %s\n", st.to_string().c_str());
        std::exit(3);
      }
    }, stream, topts, rot.sets);
    const float alpha = 1.f, beta = 0.f;
    Timing tc = time_launches([&](long long i) {
      char* b = rot.set(i);
      cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, b + w_off, CUDA_R_16BF, K, b, CUDA_R_16BF, K, &beta, b + d_off,
                   CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }, stream, topts, rot.sets);
    free_rotation(rot);
    const double flops = 2.0 * M * N * double(K);
    Record r;
    r.suite = "gemm_epilogue";
    r.name = "gemm_row_scale";
    r.params = {{"dtype", "bf16"}, {"M", std::to_string(M)}, {"N", std::to_string(N)}, {"K", std::to_string(K)},
                {"tile", "128x256x64_c2x1_cooperative"}};
    r.metrics = {{"time_us", te.median_us}, {"cublas_gemm_us", tc.median_us}, {"ratio_vs_cublas", te.median_us / tc.median_us},
                 {"tflops", flops / (te.median_us * 1e-6) / 1e12}};
    report.records.push_back(r);
    std::printf("  gemm_row_scale %5d x %5d x %5d: %8.1f us (cuBLAS GEMM %8.1f us, %.3fx)  %.0f TFLOP/s\n", M, N, K, te.median_us,
                tc.median_us, te.median_us / tc.median_us, flops / (te.median_us * 1e-6) / 1e12);
    std::fflush(stdout);
  }
  cublasDestroy(handle);
}

}  // namespace encore::bench
