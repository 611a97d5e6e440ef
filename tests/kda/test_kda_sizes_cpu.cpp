// Issue 48: KDA head counts past the CUDA kernels' int item counts (H * max(K, V), chunks * H,
// sequences * H * column tiles) are refused by run before any device access (CUDA views only;
// nothing is allocated or read) with a message naming the argument.
#include <gtest/gtest.h>

#include <string>

#include "encore/kda.hpp"
#include "tests/common/huge_view.hpp"

namespace encore::test {
namespace {

constexpr int64_t kH = int64_t(1) << 23, kD = 256;  // H * K = 2^31; q, v: 2^31 bf16 elements (4 GiB) each

void expect_heads_refused(const Status& st) {
  expect_refused(st, "v: H = 8388608 heads; the CUDA KDA kernels count H * max(K, V)");
  expect_refused(st, "here 2147483648 (must be < 2^31)");
}

KdaForwardArgs huge_forward() {
  KdaForwardArgs a;
  a.q = huge_cuda_view(0, DType::kBF16, {1, 1, kH, kD});
  a.k = huge_cuda_view(1, DType::kBF16, {1, 1, kH, kD});
  a.v = huge_cuda_view(2, DType::kBF16, {1, 1, kH, kD});
  a.g = huge_cuda_view(3, DType::kFP32, {1, 1, kH, kD});
  a.beta = huge_cuda_view(4, DType::kBF16, {1, 1, kH});
  a.o = huge_cuda_view(5, DType::kBF16, {1, 1, kH, kD});
  return a;
}

TEST(KdaSizes, ForwardRefusesHeadsTimesDimOf2p31OnCuda) {
  alignas(16) static unsigned char ws[16];
  expect_heads_refused(run(huge_forward(), KdaOptions{}, ws));
}

TEST(KdaSizes, BackwardRefusesHeadsTimesDimOf2p31OnCuda) {
  KdaBackwardArgs b;
  b.fwd = huge_forward();
  b.fwd.o = TensorView{};
  b.d_o = huge_cuda_view(6, DType::kBF16, {1, 1, kH, kD});
  b.dq = huge_cuda_view(7, DType::kBF16, {1, 1, kH, kD});
  b.dk = huge_cuda_view(8, DType::kBF16, {1, 1, kH, kD});
  b.dv = huge_cuda_view(9, DType::kBF16, {1, 1, kH, kD});
  b.dg = huge_cuda_view(10, DType::kBF16, {1, 1, kH, kD});
  b.dbeta = huge_cuda_view(11, DType::kBF16, {1, 1, kH});
  alignas(16) static unsigned char ws[16];
  expect_heads_refused(run(b, KdaOptions{}, ws));
}

}  // namespace
}  // namespace encore::test
