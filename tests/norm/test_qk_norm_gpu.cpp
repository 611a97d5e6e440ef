// CUDA QK-norm against the CPU backend: every head_dim, dtype, offset and heads-per-thread kernel,
// odd token counts, strided rows; V heads and row padding must stay bit-identical.
#include <gtest/gtest.h>


#include "encore/core/device_info.hpp"
#include "encore/norm.hpp"
#include "tests/common/aot_kernels.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/common/scoped_env.hpp"
#include "norm/testing.hpp"

namespace encore::test {
namespace {

// plan == nullptr: through the public API (the host plan); else that launch plan, directly.
void run_qk_case(DType t, int64_t tokens, int hq, int hkv, int d, int64_t pad, float offset,
                 const norm::QkNormLaunchPlan* plan = nullptr) {
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
  const QkNormArgs dev_args{to_device(qkv, dq), to_device(wq, dwq), to_device(wk, dwk)};
  Status st;
  if (plan) {
    norm::QkNormProblem p;
    p.qkv = dev_args.qkv.data;
    p.token_stride = qkv.row_stride;
    p.q_weight = dev_args.q_weight.data;
    p.k_weight = dev_args.k_weight.data;
    p.tokens = tokens;
    p.num_q_heads = hq;
    p.num_kv_heads = hkv;
    p.head_dim = d;
    p.dtype = t;
    p.weight_offset = offset;
    st = cuda::launch_qk_norm(p, *plan, nullptr);
  } else {
    st = run(dev_args, o);
  }
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
}

class QkNormGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    pin_aot_kernels(true);
  }
  void TearDown() override { pin_aot_kernels(false); }
};

TEST_F(QkNormGpu, EveryKernelVariant) {
  // Every instantiation (dtype x head_dim x offset x heads per thread x 16- / 32-byte lane accesses)
  // under small and large grids (grids smaller than the work exercise the grid-stride loop), odd token
  // counts, padded rows (whole 32-byte packs for the 32-byte kernels).
  for (DType t : {DType::kBF16, DType::kFP16}) {
    for (int d : {64, 128, 256}) {
      for (float offset : {0.f, 1.f}) {
        for (int hpt : {1, 2, 4}) {
          for (long long grid : {3LL, 1000LL})
            for (int pack_bytes : {16, 32}) {
              norm::QkNormLaunchPlan plan{128, hpt, grid, pack_bytes};
              run_qk_case(t, 333, 3, 5, d, pack_bytes == 32 ? 32 : 24, offset, &plan);
            }
        }
      }
    }
  }
}

TEST_F(QkNormGpu, HostPlanOddShapes) {
  for (DType t : {DType::kBF16, DType::kFP16}) {
    for (int d : {64, 128, 256}) {
      for (int64_t tokens : {1, 3, 17, 1001, 4097}) run_qk_case(t, tokens, 32, 8, d, 0, 0.f);
      run_qk_case(t, 777, 1, 1, d, 8, 1.f);
    }
  }
}

// The dispatcher's 32-byte plan (sm_100+; ENCORE_NORM_PACK_BYTES=32 takes it here, two 128-bit
// accesses a pack): aligned rows take it, rows padded by 16 bytes keep 16-byte accesses.
TEST_F(QkNormGpu, ThirtyTwoBytePacksHostPlan) {
  const ScopedEnv env("ENCORE_NORM_PACK_BYTES", "32");
  auto expect_wide = [](DType t, int64_t tokens, int hq, int hkv, int d, int64_t pad, float offset, bool widens) {
    const int64_t before = norm::qk_norm_wide_plan_count();
    run_qk_case(t, tokens, hq, hkv, d, pad, offset);
    EXPECT_EQ(norm::qk_norm_wide_plan_count(), before + (widens ? 1 : 0)) << "tokens " << tokens << " pad " << pad << " widened?";
  };
  for (DType t : {DType::kBF16, DType::kFP16})
    for (int d : {64, 128, 256}) {
      for (int64_t tokens : {1, 3, 17, 1001, 4097}) expect_wide(t, tokens, 32, 8, d, 0, 0.f, true);
      expect_wide(t, 777, 1, 1, d, 8, 1.f, false);  // rows padded by 16 bytes: the 16-byte plan
      expect_wide(t, 99, 24, 4, d, 16, 0.f, true);  // rows padded by 32 bytes
    }
}

TEST_F(QkNormGpu, Qwen3Shapes) {
  for (int64_t tokens : {1, 64, 8192}) {
    run_qk_case(DType::kBF16, tokens, 32, 8, 128, 0, 0.f);
    run_qk_case(DType::kBF16, tokens, 64, 4, 128, 0, 0.f);
  }
}

}  // namespace
}  // namespace encore::test
