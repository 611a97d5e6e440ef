// CUDA GEMM-epilogue kernels (CUTLASS Sm90) against the CPU backend: row_scale and scalar_scale,
// bf16 and fp16, M tails (1, 77, 300), N and K not multiples of the tile, padded row strides,
// poisoned outputs.
#include <gtest/gtest.h>

#include <cstring>

#include "encore/gemm_epilogue.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {
namespace {

class GemmEpilogueGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

void run_gemm_case(Epilogue e, DType t, int64_t M, int64_t N, int64_t K, int64_t pad) {
  SCOPED_TRACE(std::string(epilogue_name(e)) + " " + dtype_name(t) + " M" + std::to_string(M) + " N" + std::to_string(N) + " K" +
               std::to_string(K) + " pad" + std::to_string(pad));
  auto rng = make_rng(uint64_t(M * 31 + N + K));
  HostTensor a(t, M, K, K + pad), w(t, N, K, K + pad), d(t, M, N, N + pad);
  a.fill_normal(rng);
  w.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(K)));
  d.poison();
  std::vector<float> r(static_cast<size_t>(M)), alpha = {-1.25f};
  for (auto& x : r) x = 0.25f + float(rng() % 1000) / 500.0f;
  DeviceBuffer da(a.storage_bytes()), dw(w.storage_bytes()), dd(d.storage_bytes()), dr(r.size() * 4), dal(4);
  ASSERT_TRUE(da.ptr && dw.ptr && dd.ptr && dr.ptr && dal.ptr);
  ENCORE_ASSERT_CUDA(cudaMemcpy(dr.ptr, r.data(), r.size() * 4, cudaMemcpyHostToDevice));
  ENCORE_ASSERT_CUDA(cudaMemcpy(dal.ptr, alpha.data(), 4, cudaMemcpyHostToDevice));
  const Device gpu{DeviceType::kCUDA, 0};
  GemmEpilogueArgs g;
  g.a = to_device(a, da);
  g.w = to_device(w, dw);
  g.d = to_device(d, dd);  // poisoned on the device too
  GemmEpilogueArgs c;
  c.a = a.view();
  c.w = w.view();
  HostTensor d_cpu = d;
  c.d = d_cpu.view();
  if (e == Epilogue::kRowScale) {
    g.row_scale = TensorView::contiguous(dr.ptr, DType::kFP32, {M}, gpu);
    c.row_scale = TensorView::contiguous(r.data(), DType::kFP32, {M});
  } else {
    g.alpha = TensorView::contiguous(dal.ptr, DType::kFP32, {1}, gpu);
    c.alpha = TensorView::contiguous(alpha.data(), DType::kFP32, {1});
  }
  Status st = run(g, GemmEpilogueOptions{e});
  ASSERT_TRUE(st) << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  ASSERT_TRUE(run(c, GemmEpilogueOptions{e}));
  HostTensor d_gpu = d;
  from_device(d_gpu, dd);
  ENCORE_EXPECT_CLOSE(d_gpu, d_cpu, t, "d");
}

TEST_F(GemmEpilogueGpu, RowScaleAndScalarScale) {
  for (Epilogue e : {Epilogue::kRowScale, Epilogue::kScalarScale}) {
    for (DType t : {DType::kBF16, DType::kFP16}) {
      run_gemm_case(e, t, 1, 8, 8, 0);
      run_gemm_case(e, t, 77, 136, 72, 8);
      run_gemm_case(e, t, 300, 520, 1000, 0);
      run_gemm_case(e, t, 512, 256, 256, 16);
    }
  }
}

TEST_F(GemmEpilogueGpu, RefusesUnalignedShapes) {
  HostTensor a(DType::kBF16, 4, 12), w(DType::kBF16, 8, 12), d(DType::kBF16, 4, 8);
  DeviceBuffer da(a.storage_bytes()), dw(w.storage_bytes()), dd(d.storage_bytes()), dr(16);
  const Device gpu{DeviceType::kCUDA, 0};
  GemmEpilogueArgs g;
  g.a = a.view(da.ptr, gpu);
  g.w = w.view(dw.ptr, gpu);
  g.d = d.view(dd.ptr, gpu);
  g.row_scale = TensorView::contiguous(dr.ptr, DType::kFP32, {4}, gpu);
  Status st = run(g, GemmEpilogueOptions{Epilogue::kRowScale});
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("K = 12 must be a multiple of 8"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace encore::test
