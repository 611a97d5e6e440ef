// Issue 48: sizes past the GEMM finishers' 32-bit CUDA limits are refused by run before any device
// access (CUDA views only; nothing is allocated or read) with a message naming the argument.
#include <gtest/gtest.h>

#include <string>

#include "encore/gemm.hpp"
#include "tests/common/huge_view.hpp"

namespace encore::test {
namespace {

TEST(FinisherSizes, RmsFinalReduceRefusesRowsPast2p31OnCuda) {
  const RmsFinalReduceArgs a{huge_cuda_view(0, DType::kFP32, {k2p31, 4}), huge_cuda_view(1, DType::kFP32, {k2p31})};
  expect_refused(run(a, 4096, 1e-6f), "partials: [2147483648, 4]; the CUDA kernels take dimensions of fewer than 2^31");
}

TEST(FinisherSizes, LseFinishRefusesRowsPast2p31OnCuda) {
  LseFinishArgs a;
  a.partials = huge_cuda_view(0, DType::kFP32, {k2p31, 4});
  a.lse = huge_cuda_view(1, DType::kFP32, {k2p31});
  expect_refused(run(a), "partials: [2147483648, 4]; the CUDA kernels take dimensions of fewer than 2^31");
}

TEST(FinisherSizes, QkNormRopeRefusesQkColumnsOf2p31OnCuda) {
  QkNormRopeOptions o;
  o.num_q_heads = (1 << 24) - 1;
  o.num_kv_heads = 1;
  o.head_dim = 128;  // Q and K: 2^24 heads x 128 = 2^31 columns
  const int64_t heads = int64_t(o.num_q_heads) + 2 * o.num_kv_heads, N = heads * o.head_dim;
  QkNormRopeArgs a;
  a.qkv = huge_cuda_view(0, DType::kBF16, {1, N});
  a.partials = huge_cuda_view(1, DType::kFP32, {1, heads});
  a.q_weight = huge_cuda_view(2, DType::kBF16, {128});
  a.k_weight = huge_cuda_view(3, DType::kBF16, {128});
  a.pos = huge_cuda_view(4, DType::kInt32, {1});
  a.freq = huge_cuda_view(5, DType::kFP32, {N});
  expect_refused(run(a, o), "qkv: (num_q_heads + num_kv_heads) * head_dim = 2147483648 columns; the CUDA kernels take fewer than 2^31");
}

TEST(FinisherSizes, QkNormRopeBwdRefusesRowWidthOf2p31OnCuda) {
  QkNormRopeOptions o;
  o.num_q_heads = 1;
  o.num_kv_heads = 1 << 23;
  o.head_dim = 128;  // Q and K: (2^23 + 1) x 128 = 2^30 + 128 columns; with V: (2^24 + 1) x 128 = 2^31 + 128
  const int64_t heads = int64_t(o.num_q_heads) + 2 * int64_t(o.num_kv_heads), N = heads * o.head_dim;
  QkNormRopeBwdArgs a;
  a.dy = huge_cuda_view(0, DType::kBF16, {1, N});
  a.x = huge_cuda_view(1, DType::kBF16, {1, N});
  a.dx = huge_cuda_view(2, DType::kBF16, {1, N});
  a.partials = huge_cuda_view(3, DType::kFP32, {1, heads});
  a.q_weight = huge_cuda_view(4, DType::kBF16, {128});
  a.k_weight = huge_cuda_view(5, DType::kBF16, {128});
  a.pos = huge_cuda_view(6, DType::kInt32, {1});
  a.freq = huge_cuda_view(7, DType::kFP32, {N});
  a.dq_weight = huge_cuda_view(8, DType::kFP32, {128});
  a.dk_weight = huge_cuda_view(9, DType::kFP32, {128});
  alignas(16) static unsigned char ws[16];
  expect_refused(run(a, o, ws), "dy: N = (num_q_heads + 2 * num_kv_heads) * head_dim = " + std::to_string(N) +
                                    " columns; the CUDA kernel takes fewer than 2^31");
}

}  // namespace
}  // namespace encore::test
