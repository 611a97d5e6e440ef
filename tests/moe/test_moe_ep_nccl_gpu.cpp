// moe_forward_ep over NCCL on one GPU (world 1: every all-to-all is to itself) against moe_forward on
// the same tokens on CUDA, bit for bit (the grouped GEMMs on 128x128 tiles on both sides, the decode
// GEMV off: each expert row then comes from the same kernel and K order); the output poisoned first.
// Skipped without a GPU or without libnccl. More ranks need more GPUs (not lent yet).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "encore/moe_ep.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/common/scoped_env.hpp"

namespace encore::test {
namespace {

TEST(MoeEpNcclGpu, WorldOneEqualsMoeForward) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!moe_ep_have_nccl()) GTEST_SKIP() << "no libnccl.so.2 in this process";
  const ScopedEnv tile("ENCORE_MOE_GEMM_TILE", "128x128"), decode("ENCORE_MOE_DECODE", "0");
  char id[128];
  ASSERT_TRUE(moe_ep_nccl_unique_id(id));
  std::unique_ptr<MoeEpComm> comm;
  Status st = moe_ep_nccl_comm_from_unique_id(id, 1, 0, 0, &comm);
  ASSERT_TRUE(st) << st.to_string();
  for (const int64_t T : {int64_t(1), int64_t(37), int64_t(1000)}) {
    SCOPED_TRACE("T " + std::to_string(T));
    const int64_t D = 128, F = 64;
    const int E = 16, k = 4;
    auto rng = make_rng(uint64_t(T) * 3 + 1);
    HostTensor x(DType::kBF16, T, D), logits(DType::kFP32, T, E), w13(DType::kBF16, int64_t(E) * 2 * F, D), w2(DType::kBF16, int64_t(E) * D, F),
        out(DType::kBF16, T, D), ref(DType::kBF16, T, D);
    x.fill_normal(rng);
    logits.fill_normal(rng, 0, 2);
    w13.fill_normal(rng, 0, 1 / std::sqrt(double(D)));
    w2.fill_normal(rng, 0, 1 / std::sqrt(double(F)));
    out.poison();
    ref.poison();
    const Device dev{DeviceType::kCUDA, 0};
    DeviceBuffer dx(x.storage_bytes()), dl(logits.storage_bytes()), d13(w13.storage_bytes()), d2(w2.storage_bytes()), dout(out.storage_bytes()),
        dref(ref.storage_bytes());
    const TensorView vx = to_device(x, dx), vl = to_device(logits, dl), vo = to_device(out, dout), vr = to_device(ref, dref);
    to_device(w13, d13);
    to_device(w2, d2);
    const TensorView v13 = TensorView::contiguous(d13.ptr, DType::kBF16, {E, 2 * F, D}, dev), v2 = TensorView::contiguous(d2.ptr, DType::kBF16, {E, D, F}, dev);
    MoeOptions mo;
    mo.routing.top_k = k;
    mo.align_m = 16;
    const MoeLayerShape ls{T, D, F, E, DType::kBF16};
    DeviceBuffer buf(moe_buffers_bytes(ls, mo));
    MoeBuffers b;
    ASSERT_TRUE(moe_buffers_carve(ls, mo, buf.ptr, buf.bytes, dev, &b));
    st = run(MoeForwardArgs{vx, vl, TensorView{}, v13, v2, b, vr}, mo);
    ASSERT_TRUE(st) << st.to_string();
    MoeEpOptions eo;
    eo.moe = mo;
    const MoeEpShape es{T, D, F, E, 1, DType::kBF16};
    DeviceBuffer ws(moe_ep_workspace_bytes(es, eo));
    st = moe_forward_ep(MoeEpArgs{vx, vl, TensorView{}, v13, v2, vo}, es, eo, *comm, ws.ptr, ws.bytes, nullptr);
    ASSERT_TRUE(st) << st.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    from_device(out, dout);
    from_device(ref, dref);
    EXPECT_EQ(out.bytes, ref.bytes) << "moe_forward_ep (world 1) differs from moe_forward";
  }
}

}  // namespace
}  // namespace encore::test
