// CUDA QK-norm + RoPE backward against the CPU reference (run on the CPU backend with the same
// inputs, itself checked against finite differences in test_qk_norm_rope_bwd_cpu.cpp): bf16 / fp16 /
// fp32, fp32 or qkv-dtype weights, M 1, 45, 77, 301, 1000, head_dim 64 / 128 / 256 / 40, padded row
// strides, outputs poisoned; in place; a second run gives the same bits; M = 0 zeroes the weight grads.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "encore/gemm.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {
namespace {

class QkNormRopeBwdGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

struct Case {
  int64_t M;
  int q_heads, kv_heads, head_dim;
  int64_t pad;
  DType t, wt;
};

double rel_rms(const HostTensor& a, const HostTensor& b) {
  double e = 0, s = 0;
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t j = 0; j < a.cols; ++j) {
      const double d = a.get(i, j) - b.get(i, j);
      e += std::isfinite(d) ? d * d : INFINITY;
      s += b.get(i, j) * b.get(i, j);
    }
  return std::sqrt(e / std::max(s, 1e-300));
}

void run_case(const Case& c, bool in_place) {
  SCOPED_TRACE(std::string(dtype_name(c.t)) + " M " + std::to_string(c.M) + " heads " + std::to_string(c.q_heads) + "/" +
               std::to_string(c.kv_heads) + " D " + std::to_string(c.head_dim) + (in_place ? " in place" : ""));
  auto rng = make_rng(uint64_t(c.M * 13 + c.head_dim));
  const int heads = c.q_heads + 2 * c.kv_heads;
  const int64_t D = c.head_dim, N = int64_t(heads) * D, ld = N + c.pad;
  HostTensor x(c.t, c.M, N, ld), dy(c.t, c.M, N, ld), dx(c.t, c.M, N, ld), part(DType::kFP32, c.M, heads);
  HostTensor wq = HostTensor::vector(c.wt, D), wk = HostTensor::vector(c.wt, D);
  HostTensor dwq = HostTensor::vector(DType::kFP32, D), dwk = HostTensor::vector(DType::kFP32, D);
  HostTensor pos = HostTensor::vector(DType::kInt32, c.M), freq = HostTensor::vector(DType::kFP32, N);
  x.fill_normal(rng, 0.0, 2.0);
  dy.fill_normal(rng);
  wq.fill_normal(rng, 1.0, 0.3);
  wk.fill_normal(rng, 1.0, 0.3);
  for (int64_t m = 0; m < c.M; ++m) pos.set(0, m, double((m * 977) % 32768));
  // Every head with a frequency (V included: the forward and backward leave V unrotated whatever freq holds).
  ASSERT_TRUE(rope_freq_turns(heads, heads, c.head_dim, 1e6, freq.view()));
  for (int64_t m = 0; m < c.M; ++m)
    for (int h = 0; h < heads; ++h) {
      double s = 0;
      for (int64_t e = 0; e < D; ++e) s += x.get(m, h * D + e) * x.get(m, h * D + e);
      part.set(m, h, s);
    }
  const QkNormRopeOptions o{c.q_heads, c.kv_heads, c.head_dim, 1e-6f};
  // CPU reference.
  HostTensor rdx = dx, rdq = dwq, rdk = dwk;
  ASSERT_TRUE(run(QkNormRopeBwdArgs{dy.view(), x.view(), part.view(), wq.view(), wk.view(), pos.view(), freq.view(), rdx.view(), rdq.view(),
                                    rdk.view()},
                  o));
  dx.poison();
  dwq.poison();
  dwk.poison();
  DeviceBuffer bx(x.storage_bytes()), bdy(dy.storage_bytes()), bdx(dx.storage_bytes()), bp(part.storage_bytes()), bwq(wq.storage_bytes()),
      bwk(wk.storage_bytes()), bdq(dwq.storage_bytes()), bdk(dwk.storage_bytes()), bpos(pos.storage_bytes()), bf(freq.storage_bytes());
  QkNormRopeBwdArgs a{to_device(dy, bdy), to_device(x, bx), to_device(part, bp), to_device(wq, bwq), to_device(wk, bwk), to_device(pos, bpos),
                      to_device(freq, bf),  to_device(dx, bdx), to_device(dwq, bdq), to_device(dwk, bdk)};
  if (in_place) a.dx = a.dy;
  DeviceBuffer ws(std::max<size_t>(workspace_bytes(a, o), 1));
  ASSERT_TRUE(run(a, o, ws.ptr));
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  HostTensor got = dx, gq = dwq, gk = dwk;
  from_device(got, in_place ? bdy : bdx);
  from_device(gq, bdq);
  from_device(gk, bdk);
  ENCORE_EXPECT_CLOSE(got, rdx, c.t, "dx");
  // The weight gradients: fp32 sums of fp32 products of the same rounded inputs (the reference in fp64).
  EXPECT_LE(rel_rms(gq, rdq), 2e-5) << "dq_weight";
  EXPECT_LE(rel_rms(gk, rdk), 2e-5) << "dk_weight";
  if (!in_place) {  // deterministic: a second run gives the same bits
    ASSERT_TRUE(run(a, o, ws.ptr));
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    HostTensor g2 = dx, q2 = dwq;
    from_device(g2, bdx);
    from_device(q2, bdq);
    EXPECT_EQ(g2.bytes, got.bytes);
    EXPECT_EQ(q2.bytes, gq.bytes);
  }
}

TEST_F(QkNormRopeBwdGpu, MatchesCpuReference) {
  const Case cases[] = {{1, 4, 2, 128, 0, DType::kBF16, DType::kBF16},   {77, 4, 2, 128, 8, DType::kBF16, DType::kFP32},
                        {1000, 8, 2, 64, 0, DType::kFP16, DType::kFP16}, {301, 2, 1, 256, 0, DType::kBF16, DType::kBF16},
                        {45, 3, 1, 40, 4, DType::kFP32, DType::kFP32},   {1000, 32, 8, 128, 0, DType::kBF16, DType::kBF16}};
  for (const Case& c : cases)
    for (bool in_place : {false, true}) run_case(c, in_place);
}

// An empty batch is refused like every empty tensor in encore (checks::present), naming dy; a CUDA
// run without its workspace is refused too.
TEST_F(QkNormRopeBwdGpu, EmptyBatchAndMissingWorkspaceRefused) {
  const int64_t D = 64, N = 4 * D;
  DeviceBuffer b(8192), dq(D * 4), dk(D * 4), wq(D * 2), fr(N * 4);
  const Device dev{DeviceType::kCUDA, 0};
  for (DeviceBuffer* x : {&b, &dq, &dk, &wq, &fr}) ENCORE_ASSERT_CUDA(cudaMemset(x->ptr, 0, x->bytes));
  auto args = [&](int64_t M) {
    QkNormRopeBwdArgs a;
    a.dy = TensorView::contiguous(b.ptr, DType::kBF16, {M, N}, dev);
    a.x = TensorView::contiguous(b.at(1024), DType::kBF16, {M, N}, dev);
    a.dx = TensorView::contiguous(b.at(2048), DType::kBF16, {M, N}, dev);
    a.partials = TensorView::contiguous(b.at(3072), DType::kFP32, {M, 4}, dev);
    a.q_weight = a.k_weight = TensorView::contiguous(wq.ptr, DType::kBF16, {D}, dev);
    a.pos = TensorView::contiguous(b.at(3584), DType::kInt32, {M}, dev);
    a.freq = TensorView::contiguous(fr.ptr, DType::kFP32, {N}, dev);
    a.dq_weight = TensorView::contiguous(dq.ptr, DType::kFP32, {D}, dev);
    a.dk_weight = TensorView::contiguous(dk.ptr, DType::kFP32, {D}, dev);
    return a;
  };
  const QkNormRopeOptions o{2, 1, int(D), 1e-6f};
  DeviceBuffer ws(workspace_bytes(args(1), o));
  Status st = run(args(0), o, ws.ptr);
  EXPECT_FALSE(st);
  EXPECT_NE(st.message().find("dy: empty tensor"), std::string::npos) << st.to_string();
  st = run(args(1), o, nullptr);
  EXPECT_FALSE(st) << "a CUDA run without workspace must be refused";
  EXPECT_NE(st.message().find("workspace"), std::string::npos) << st.to_string();
  ASSERT_TRUE(run(args(1), o, ws.ptr));
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace encore::test
