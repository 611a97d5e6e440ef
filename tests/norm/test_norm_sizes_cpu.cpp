// Issue 48: sizes past the CUDA kernels' 32-bit limits are refused by validate (CUDA views only;
// nothing is allocated or read) with a message naming the argument.
#include <gtest/gtest.h>

#include <string>

#include "encore/norm.hpp"
#include "tests/common/huge_view.hpp"

namespace encore::test {
namespace {

TEST(NormSizes, RmsNormRefusesRowsPast2p31OnCuda) {
  const RmsNormArgs a{huge_cuda_view(0, DType::kBF16, {k2p31, 8}), huge_cuda_view(1, DType::kBF16, {8}),
                      huge_cuda_view(2, DType::kBF16, {k2p31, 8})};
  expect_refused(validate(a, {}), "x: 2147483648 rows; the CUDA kernels take fewer than 2^31");
  expect_refused(run(a, {}), "x: 2147483648 rows");
  const AddRmsNormArgs b{huge_cuda_view(0, DType::kBF16, {k2p31, 8}), huge_cuda_view(3, DType::kBF16, {k2p31, 8}),
                         huge_cuda_view(1, DType::kBF16, {8}), huge_cuda_view(2, DType::kBF16, {k2p31, 8}),
                         huge_cuda_view(4, DType::kBF16, {k2p31, 8})};
  expect_refused(validate(b, {}), "x: 2147483648 rows; the CUDA kernels take fewer than 2^31");
  // One row fewer passes validation (more than 2^31 elements: the row offsets are 64-bit).
  const RmsNormArgs c{huge_cuda_view(0, DType::kBF16, {k2p31 - 1, 8}), huge_cuda_view(1, DType::kBF16, {8}),
                      huge_cuda_view(2, DType::kBF16, {k2p31 - 1, 8})};
  EXPECT_TRUE(validate(c, {}).is_ok()) << validate(c, {}).message();
}

TEST(NormSizes, QkNormRefusesRowsOf2p31ElementsOnCuda) {
  QkNormOptions o;
  o.num_q_heads = (1 << 24) - 2;
  o.num_kv_heads = 1;
  o.head_dim = 128;  // (Hq + 2 Hkv) * D = 2^31 columns
  const QkNormArgs a{huge_cuda_view(0, DType::kBF16, {1, k2p31}), huge_cuda_view(1, DType::kBF16, {128}),
                     huge_cuda_view(2, DType::kBF16, {128})};
  expect_refused(validate(a, o), "qkv: 2147483648 columns; the CUDA kernels take rows of fewer than 2^31 elements");
  expect_refused(run(a, o), "qkv: 2147483648 columns");
}

}  // namespace
}  // namespace encore::test
