// Issue 48: sizes past the CUDA kernels' 32-bit limits are refused by validate (CUDA views only;
// nothing is allocated or read) with a message naming the argument.
#include <gtest/gtest.h>

#include <string>

#include "encore/moe.hpp"
#include "tests/common/huge_view.hpp"

namespace encore::test {
namespace {

constexpr int64_t k2p31 = int64_t(1) << 31;

void expect_refused(const Status& st, const std::string& what) {
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find(what), std::string::npos) << st.message();
}

TEST(MoeSizes, RoutingRefusesTokensPast2p31OnCuda) {
  MoeRoutingOptions o;
  o.top_k = 2;
  MoeRoutingArgs a;
  a.logits = huge_cuda_view(0, DType::kBF16, {k2p31, 8});
  a.topk_ids = huge_cuda_view(1, DType::kInt32, {k2p31, 2});
  a.topk_weights = huge_cuda_view(2, DType::kFP32, {k2p31, 2});
  expect_refused(validate(a, o), "logits: T = 2147483648 tokens; the CUDA kernels take fewer than 2^31");
  expect_refused(run(a, o), "logits: T = 2147483648 tokens");
}

TEST(MoeSizes, DispatchRefusesRowsOf2p31BytesOnCuda) {
  MoeDispatchOptions o;
  o.num_experts = 1;
  MoeDispatchArgs a;
  a.topk_ids = huge_cuda_view(0, DType::kInt32, {1, 1});
  a.x = huge_cuda_view(1, DType::kBF16, {1, int64_t(1) << 30});  // 2^31 bytes a row
  a.expert_counts = huge_cuda_view(2, DType::kInt32, {1});
  a.expert_offsets = huge_cuda_view(3, DType::kInt32, {2});
  a.slot_rows = huge_cuda_view(4, DType::kInt32, {1, 1});
  a.row_slots = huge_cuda_view(5, DType::kInt32, {1024});
  a.x_permuted = huge_cuda_view(6, DType::kBF16, {1024, int64_t(1) << 30});
  expect_refused(validate(a, o), "x: rows of 2147483648 bytes; the CUDA kernels take rows of fewer than 2^31 bytes");
  expect_refused(run(a, o, nullptr), "x: rows of 2147483648 bytes");
}

}  // namespace
}  // namespace encore::test
