// LLaMA shifted-block forward on the CPU backend: the fused schedule (deferred row scales, aux
// outputs, partials) in fp32 equals the textbook unfused block computed in double (the algebra is
// exact; only fp32 rounding remains), and bad inputs name the step and argument.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "encore/blocks/llama.hpp"
#include "tests/blocks/llama_block_case.hpp"

namespace encore::test {
namespace {

LlamaBlockArgs host_args(const BlockCase& c, BlockTensors& o) {
  LlamaBlockArgs a;
  a.y0 = c.y0.view();
  a.x0 = c.x0.view();
  a.w0 = c.w0.view();
  a.w1 = c.w1.view();
  a.w2 = c.w2.view();
  a.w3 = c.w3.view();
  a.gamma0 = c.g0.view();
  a.gamma1 = c.g1.view();
  a.pos = c.pos.view();
  a.freq = c.freq.view();
  a.x1 = o.x1.view();
  a.x2 = o.x2.view();
  a.z1 = o.z1.view();
  a.qkv = o.qkv.view();
  a.r1 = o.r1.view();
  a.r2 = o.r2.view();
  return a;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

TEST(LlamaBlockCpu, FusedScheduleEqualsTextbookBlock) {
  auto rng = make_rng(41);
  for (auto [M, d, F] : {std::tuple<int64_t, int64_t, int64_t>{37, 64, 96}, {5, 264, 136}}) {
    SCOPED_TRACE("M" + std::to_string(M) + " d" + std::to_string(d) + " F" + std::to_string(F));
    BlockCase c(M, d, F, 8, 6, 16, DType::kFP32, rng);
    BlockTensors out(c);
    LlamaBlockArgs a = host_args(c, out);
    LlamaBlockOptions o;
    ASSERT_TRUE(validate(a, o));
    std::vector<unsigned char> ws(workspace_bytes(a, o) + 256);
    void* w = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 255) / 256 * 256);
    Status st = run(a, o, w);
    ASSERT_TRUE(st) << st.to_string();
    const BlockOutputs ref = unfused_block(c, std::nullopt, o.eps);
    const std::pair<const char*, std::pair<const HostTensor*, const std::vector<double>*>> outs[] = {
        {"x1", {&out.x1, &ref.x1}}, {"x2", {&out.x2, &ref.x2}}, {"z1", {&out.z1, &ref.z1}},
        {"qkv", {&out.qkv, &ref.qkv}}, {"r1", {&out.r1, &ref.r1}}, {"r2", {&out.r2, &ref.r2}}};
    for (const auto& [name, pr] : outs) {
      const double err = max_abs_diff(*pr.first, *pr.second), scale = max_abs(*pr.second);
      EXPECT_LE(err, 2e-5 * scale + 1e-6) << name << ": max error " << err << " (max |ref| " << scale << ")";
    }
  }
}

// run_step 0..3 in order is run(): the same outputs bit for bit (CPU backend, outputs poisoned
// before each pass, none left NaN); a step outside 0..3 is refused by name.
TEST(LlamaBlockCpu, StepsOneByOneEqualRun) {
  auto rng = make_rng(47);
  BlockCase c(37, 64, 96, 8, 6, 16, DType::kFP32, rng);
  BlockTensors whole(c), stepwise(c);  // outputs poisoned (NaN)
  LlamaBlockArgs a = host_args(c, whole), b = host_args(c, stepwise);
  LlamaBlockOptions o;
  std::vector<unsigned char> ws(workspace_bytes(a, o) + 256);
  void* w = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 255) / 256 * 256);
  Status st = run(a, o, w);
  ASSERT_TRUE(st) << st.to_string();
  for (int step = 0; step < 4; ++step) {
    st = run_step(b, o, w, step);
    ASSERT_TRUE(st) << "step " << step << ": " << st.to_string();
  }
  const std::pair<const char*, std::pair<const HostTensor*, const HostTensor*>> outs[] = {
      {"x1", {&whole.x1, &stepwise.x1}}, {"x2", {&whole.x2, &stepwise.x2}}, {"z1", {&whole.z1, &stepwise.z1}},
      {"qkv", {&whole.qkv, &stepwise.qkv}}, {"r1", {&whole.r1, &stepwise.r1}}, {"r2", {&whole.r2, &stepwise.r2}}};
  for (const auto& [name, pr] : outs) {
    ASSERT_EQ(pr.first->storage_bytes(), pr.second->storage_bytes()) << name;
    EXPECT_EQ(0, std::memcmp(pr.first->bytes.data(), pr.second->bytes.data(), pr.first->storage_bytes())) << name;
    for (int64_t i = 0; i < pr.first->storage_elems(); ++i)
      ASSERT_TRUE(std::isfinite(load_as_double(pr.first->bytes.data(), pr.first->dtype, i))) << name << " element " << i;
  }
  for (int bad : {-1, 4}) {
    st = run_step(b, o, w, bad);
    EXPECT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find("step: must be 0, 1, 2 or 3"), std::string::npos) << st.message();
  }
}

TEST(LlamaBlockCpu, BadInputNamesTheStep) {
  auto rng = make_rng(43);
  BlockCase c(4, 64, 96, 8, 6, 16, DType::kFP32, rng);
  BlockTensors out(c);
  LlamaBlockArgs a = host_args(c, out);
  HostTensor w1_bad(DType::kFP32, 190, 64);
  a.w1 = w1_bad.view();
  Status st = validate(a, LlamaBlockOptions{});
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("llama_block step 2 (gate/up + SwiGLU): "), std::string::npos) << st.message();
  a = host_args(c, out);
  a.x2 = a.x1;
  st = validate(a, LlamaBlockOptions{});
  EXPECT_NE(st.message().find("x2"), std::string::npos) << st.message();
  a = host_args(c, out);
  EXPECT_FALSE(run(a, LlamaBlockOptions{}, nullptr).is_ok());
  LlamaBlockOptions bad;
  bad.eps = -1.0f;
  EXPECT_NE(validate(a, bad).message().find("eps"), std::string::npos);
}

}  // namespace
}  // namespace encore::test
