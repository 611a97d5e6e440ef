// The KDA family's launch rules that need no device (src/kda/plan.cpp): the decode step's plan
// (kda_decode_plan: which single-token kernel, PDL, the L2 prefetch) at the thresholds it is built on, and
// the forward's one-launch rule (one_launch_fits, resolve_plan).
#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>

#include "kda/cuda/kda_decode.hpp"
#include "kda/cuda/launch.hpp"
#include "kda/plan.hpp"

namespace encore::test {
namespace {

using cuda::KdaDecodeKernel;
using cuda::KdaDecodePlan;

constexpr int kSms = 132;  // an H100's

KdaDecodePlan plan(int64_t n_heads, DType states, bool aligned = true) { return kda::kda_decode_plan(n_heads, 1, states, aligned, kSms); }

// The whole-head kernel from two waves of its grid: N x H >= 2 x resident blocks an SM x SMs.
TEST(KdaPlanCpu, DecodeWholeHeadsFromTwoWaves) {
  const int64_t bf16_at = 2 * cuda::kKdaDecodeResidentHeadsBf16 * kSms, fp32_at = 2 * cuda::kKdaDecodeResidentHeadsFp32 * kSms;
  EXPECT_EQ(plan(bf16_at, DType::kBF16).kernel, KdaDecodeKernel::kHeads);
  EXPECT_NE(plan(bf16_at - 1, DType::kBF16).kernel, KdaDecodeKernel::kHeads);
  EXPECT_EQ(plan(fp32_at, DType::kFP32).kernel, KdaDecodeKernel::kHeads);
  EXPECT_NE(plan(fp32_at - 1, DType::kFP32).kernel, KdaDecodeKernel::kHeads);
  // H and N enter as their product
  EXPECT_EQ(kda::kda_decode_plan(fp32_at / 4, 4, DType::kFP32, true, kSms).kernel, KdaDecodeKernel::kHeads);
  // the whole-head kernel takes no prefetch; every plan is a PDL launch
  EXPECT_FALSE(plan(bf16_at, DType::kBF16).prefetch);
  EXPECT_TRUE(plan(bf16_at, DType::kBF16).pdl);
  EXPECT_TRUE(plan(1, DType::kFP32).pdl);
}

// Under two waves of whole heads: fp32 states 32 columns with the prefetch; bf16 states 32 columns, 64
// once the 32-column grid (4 blocks a head) takes two waves of 8 blocks an SM.
TEST(KdaPlanCpu, DecodeColumnKernelsUnderThem) {
  const KdaDecodePlan f = plan(256, DType::kFP32);
  EXPECT_EQ(f.kernel, KdaDecodeKernel::kColumns32);
  EXPECT_TRUE(f.prefetch);
  const int64_t wide_at = 2 * cuda::kKdaDecodeResident32Bf16 * kSms / 4;
  ASSERT_LT(wide_at, 2 * cuda::kKdaDecodeResidentHeadsBf16 * kSms);
  EXPECT_EQ(plan(wide_at - 1, DType::kBF16).kernel, KdaDecodeKernel::kColumns32);
  EXPECT_EQ(plan(wide_at, DType::kBF16).kernel, KdaDecodeKernel::kColumns64);
  EXPECT_FALSE(plan(wide_at, DType::kBF16).prefetch);
}

// States whose 8-column accesses are not 16-byte aligned (or no state at all, as the serving code passes
// it): 32 columns without the prefetch at every size.
TEST(KdaPlanCpu, DecodeUnalignedStatesTakeColumns32) {
  for (int64_t nh : {int64_t(1), int64_t(1000), int64_t(100000)})
    for (DType st : {DType::kFP32, DType::kBF16}) {
      const KdaDecodePlan p = plan(nh, st, /*aligned=*/false);
      EXPECT_EQ(p.kernel, KdaDecodeKernel::kColumns32) << nh;
      EXPECT_FALSE(p.prefetch) << nh;
    }
}

// A forward problem of `lens` tokens per sequence, H value heads, V value columns.
kda::KdaProblem forward_problem(std::initializer_list<int64_t> lens, int64_t H, int64_t V = 128) {
  kda::KdaProblem p;
  p.H = H, p.K = 128, p.V = V, p.B = 1;
  int64_t t = 0;
  for (int64_t len : lens) p.seqs.push_back({0, t, t + len}), t += len;
  p.T = t;
  return p;
}

// One launch exactly where the chunk items (chunks x H) and the state blocks (N x H x column blocks) each fit
// one block an SM and the sequences fit the small launch table; the rule takes it there, else two kernels.
TEST(KdaPlanCpu, ForwardOneLaunchWithinOneWave) {
  DeviceInfo dev;
  dev.sm_count = kSms;
  EXPECT_TRUE(kda::one_launch_fits(forward_problem({64}, 2), 16, dev));
  EXPECT_TRUE(kda::one_launch_fits(forward_problem({64 * 66}, 2), 32, dev));    // 132 chunk items
  EXPECT_FALSE(kda::one_launch_fits(forward_problem({64 * 66 + 1}, 2), 32, dev));  // 134
  EXPECT_FALSE(kda::one_launch_fits(forward_problem({64}, 2), 64, dev));  // 64 columns: two kernels
  EXPECT_TRUE(kda::one_launch_fits(forward_problem({1, 1, 1}, 11), 32, dev));    // 3 x 11 x 4 = 132 state blocks
  EXPECT_FALSE(kda::one_launch_fits(forward_problem({1, 1, 1}, 11), 16, dev));   // 264
  kda::KdaProblem wide = forward_problem({}, 1, 16);
  for (int64_t i = 0; i <= cuda::kKdaFewSeqs; ++i) wide.seqs.push_back({0, i, i + 1});
  DeviceInfo big;
  big.sm_count = 100000;
  EXPECT_FALSE(kda::one_launch_fits(wide, 16, big));  // past kKdaFewSeqs sequences
  EXPECT_EQ(kda::kda_plan(forward_problem({64}, 2), dev).launches, 1);
  EXPECT_EQ(kda::kda_plan(forward_problem({8192}, 16), dev).launches, 2);
  kda::KdaLaunchPlan out;
  ASSERT_TRUE(kda::resolve_plan(kda::KdaLaunchPlan{0, 0, 2}, forward_problem({64}, 2), dev, &out));
  EXPECT_EQ(out.launches, 2);
  const Status st = kda::resolve_plan(kda::KdaLaunchPlan{0, 0, 1}, forward_problem({8192}, 16), dev, &out);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("plan.launches: 1 needs"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace encore::test
