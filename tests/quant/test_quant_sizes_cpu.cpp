// Issue 48: sizes past the CUDA kernels' 32-bit limits are refused before any device access (CUDA
// views only; nothing is allocated or read) with a message naming the argument.
#include <gtest/gtest.h>

#include <string>

#include "encore/quant.hpp"
#include "tests/common/huge_view.hpp"

namespace encore::test {
namespace {

TEST(QuantSizes, Fp8GroupQuantRefusesKOf2p31OnCuda) {
  const Fp8GroupQuantArgs a{huge_cuda_view(0, DType::kBF16, {1, k2p31}), huge_cuda_view(1, DType::kFP8E4M3, {1, k2p31}),
                            huge_cuda_view(2, DType::kFP32, {1, k2p31 / 128})};
  expect_refused(validate(a, {}), "x: K = 2147483648 columns; the CUDA kernels take fewer than 2^31");
  expect_refused(run(a, {}), "x: K = 2147483648 columns");
}

TEST(QuantSizes, MxQuantRefusesKOf2p31OnCuda) {
  const Mxfp8QuantArgs a{huge_cuda_view(0, DType::kBF16, {1, k2p31}), huge_cuda_view(1, DType::kFP8E4M3, {1, k2p31}),
                         huge_cuda_view(2, DType::kUInt8, {1, k2p31 / 32})};
  expect_refused(run(a, {}), "x: K = 2147483648 columns; the CUDA kernels take fewer than 2^31");
}

}  // namespace
}  // namespace encore::test
