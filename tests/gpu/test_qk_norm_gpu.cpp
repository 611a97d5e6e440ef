// CUDA QK-norm against the CPU backend: every head_dim, dtype, offset and heads-per-thread kernel,
// odd token counts, strided rows; V heads and row padding must stay bit-identical.
#include <gtest/gtest.h>

#include <set>
#include <tuple>

#include "encore/core/device_info.hpp"
#include "encore/norm.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {
namespace {

void run_qk_case(DType t, int64_t tokens, int hq, int hkv, int d, int64_t pad, float offset,
                 std::set<std::tuple<int, int, int>>* seen) {
  SCOPED_TRACE(std::string(dtype_name(t)) + " T" + std::to_string(tokens) + " q" + std::to_string(hq) + " kv" +
               std::to_string(hkv) + " d" + std::to_string(d) + " pad" + std::to_string(pad) + " off" + std::to_string(offset));
  auto rng = make_rng(uint64_t(tokens * 31 + d));
  const int64_t width = int64_t(hq + 2 * hkv) * d;
  HostTensor qkv(t, tokens, width, width + pad), wq = HostTensor::vector(t, d), wk = HostTensor::vector(t, d);
  qkv.fill_normal(rng, 0.3, 2.0);
  wq.fill_normal(rng, 1.0, 0.4);
  wk.fill_normal(rng, 1.0, 0.4);
  DeviceBuffer dq(qkv.storage_bytes()), dwq(wq.storage_bytes()), dwk(wk.storage_bytes());
  ASSERT_TRUE(dq.ptr && dwq.ptr && dwk.ptr);
  const QkNormOptions o{hq, hkv, d, 1e-6f, offset};
  Status st = run(QkNormArgs{to_device(qkv, dq), to_device(wq, dwq), to_device(wk, dwk)}, o);
  ASSERT_TRUE(st) << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  HostTensor gpu = qkv, cpu = qkv;
  from_device(gpu, dq);
  ASSERT_TRUE(run(QkNormArgs{cpu.view(), wq.view(), wk.view()}, o));
  ENCORE_EXPECT_CLOSE(gpu, cpu, t, "qkv");
  // Outside the Q and K heads nothing may change: V heads and padding are compared bit for bit.
  const size_t esz = dtype_size(t);
  for (int64_t tok = 0; tok < tokens; ++tok) {
    const size_t v0 = size_t(tok * qkv.row_stride + int64_t(hq + hkv) * d) * esz;
    const size_t v1 = size_t(std::min(qkv.storage_elems(), (tok + 1) * qkv.row_stride)) * esz;
    ASSERT_EQ(0, std::memcmp(gpu.bytes.data() + v0, qkv.bytes.data() + v0, v1 - v0)) << "V/padding changed, token " << tok;
  }
  if (seen) {
    const DeviceInfo* info = nullptr;
    ASSERT_TRUE(get_device_info(0, &info));
    QkNormLaunchPlan plan = plan_qk_norm(tokens, hq + hkv, d, t, info->sm_count);
    seen->insert({d, int(offset != 0), plan.heads_per_thread});
  }
}

class QkNormGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(QkNormGpu, MatchesCpuOnEveryVariant) {
  std::set<std::tuple<int, int, int>> seen;
  for (DType t : {DType::kBF16, DType::kFP16}) {
    for (int d : {64, 128, 256}) {
      for (int64_t tokens : {1, 3, 17, 333, 4097, 20000}) {
        run_qk_case(t, tokens, 32, 8, d, 0, 0.f, &seen);
        run_qk_case(t, tokens, 3, 5, d, 24, 1.f, &seen);
      }
    }
  }
  for (int d : {64, 128, 256})
    for (int off = 0; off < 2; ++off)
      for (int hpt : {1, 2, 4}) EXPECT_TRUE(seen.count({d, off, hpt})) << "not covered: d " << d << " offset " << off << " heads/thread " << hpt;
}

TEST_F(QkNormGpu, Qwen3Shapes) {
  for (int64_t tokens : {1, 64, 8192}) {
    run_qk_case(DType::kBF16, tokens, 32, 8, 128, 0, 0.f, nullptr);
    run_qk_case(DType::kBF16, tokens, 64, 4, 128, 0, 0.f, nullptr);
  }
}

}  // namespace
}  // namespace encore::test
