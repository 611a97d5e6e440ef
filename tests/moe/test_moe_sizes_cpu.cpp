// Issue 48: sizes past the CUDA kernels' 32-bit limits are refused by validate (CUDA views only;
// nothing is allocated or read) with a message naming the argument.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "encore/moe.hpp"
#include "encore/moe_ep.hpp"
#include "moe/ep_device.hpp"
#include "tests/common/huge_view.hpp"

namespace encore::test {
namespace {

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


// The CUDA all-to-all (ep_kernels.cu) keeps its received rows in int32 (row table, offsets, source slots)
// and loops over experts in int: the config is refused before any allocation or peer exchange.
moe::ep::EpConfig ep_config(int world, int experts, int k, int64_t max_tokens) {
  moe::ep::EpConfig c;
  c.world = world;
  c.num_experts = experts;
  c.top_k = k;
  c.hidden = 8;  // 16-byte bf16 rows
  c.max_tokens = max_tokens;
  return c;
}

TEST(MoeSizes, EpDeviceRefusesReceivedRowsOf2p31) {
  const moe::ep::EpConfig c = ep_config(8, 128, 16, int64_t(1) << 24);  // 8 x 2^24 x min(16, 16) = 2^31 rows
  const std::string want = "max_tokens: world * max_tokens * min(top_k, E_l) = 2147483648 received rows at most; the CUDA all-to-all takes fewer than 2^31";
  std::unique_ptr<moe::ep::EpDeviceGroup> g;
  expect_refused(moe::ep::EpDeviceGroup::create_on_one_device(c, 0, &g), want);
  expect_refused(moe::ep::EpDeviceGroup::create_ipc(c, 0, 0, "encore-test-sizes", &g), want);
  EXPECT_EQ(g, nullptr);
  // min(top_k, E_l) counts: k 32 over E_l 16 is still 2^31 rows.
  expect_refused(moe::ep::EpDeviceGroup::create_on_one_device(ep_config(8, 128, 32, int64_t(1) << 24), 0, &g), "= 2147483648 received rows");
}

TEST(MoeSizes, EpDeviceRefusesExperts2p30) {
  std::unique_ptr<moe::ep::EpDeviceGroup> g;
  expect_refused(moe::ep::EpDeviceGroup::create_on_one_device(ep_config(1, 1 << 30, 1, 1), 0, &g),
                 "num_experts: 1073741824 experts; the CUDA all-to-all takes fewer than 2^30");
}

// moe_forward_ep: the meta record's int32 D and F, the received rows (the local dispatch's int32 rows)
// and the layout's byte counts; refused before the communicator is used.
TEST(MoeSizes, ForwardEpRefusesHugeShapes) {
  auto comms = moe_ep_host_group(1);
  MoeEpOptions o;
  o.moe.routing.top_k = 2;
  auto shape = [](int64_t T, int64_t D, int64_t F) { return MoeEpShape{T, D, F, 8, 1, DType::kBF16}; };
  auto refused = [&](const MoeEpShape& s, const std::string& what) {
    EXPECT_EQ(moe_ep_workspace_bytes(s, o), 0u);
    expect_refused(moe_forward_ep(MoeEpArgs{}, s, o, *comms[0], nullptr, 0, nullptr), what);
  };
  refused(shape(16, k2p31, 64), "shape.hidden: 2147483648; moe_forward_ep takes fewer than 2^31");
  refused(shape(16, 64, k2p31), "shape.intermediate: 2147483648; moe_forward_ep takes fewer than 2^31");
  refused(shape(int64_t(1) << 30, 64, 64), "shape.max_tokens: world * max_tokens * min(top_k, E_l) = 2147483648 received rows at most");
  refused(shape(int64_t(1) << 29, int64_t(1) << 30, 64), "would take 2^60 bytes or more");  // 2^30 rows x 2^30 x 2 bytes
  EXPECT_GT(moe_ep_workspace_bytes(shape((int64_t(1) << 30) - 1, 64, 64), o), 0u);  // 2^31 - 2 rows: sized
}

}  // namespace
}  // namespace encore::test
