// Host-side tests of the MoE JIT families (moe/jit.hpp: routing, the dispatch's map kernels, combine):
// specs and names, keys, the policy with its hooks, the shapes each family refuses, the warm-up
// config's moe lines; with NVRTC (else skipped) every moe line of a config compiles through the
// warm-up path for sm_90a and sm_100a (no GPU needed).
#include <gtest/gtest.h>

#include <set>
#include <sstream>

#include "jit/family.hpp"
#include "jit/jit.hpp"
#include "jit/warmup.hpp"
#include "moe/jit.hpp"

namespace encore::jit {
namespace {

const Toolchain kTc{13, 0, 13000, "0.1.0"};

Status parse(const std::string& text, std::vector<WarmupLine>* out) {
  std::istringstream in(text);
  return parse_warmup_config(in, out);
}

TEST(JitMoeRouting, SpecPolicyAndLimits) {
  const KernelSpec s = moe::routing_jit_spec({DType::kBF16, 160, 6, 8, 3});
  EXPECT_EQ(s.name, "moe_routing-bf16-e160-k6-g8-tg3");
  EXPECT_EQ(s.name_expression, "&encore::cuda::moe_routing_kernel<8, __nv_bfloat16, 160, 6, 8, 3>") << "kPerLane 8: 160 experts over 32 lanes";
  EXPECT_EQ(moe::routing_jit_spec({DType::kFP32, 32, 1, 1, 1}).name_expression, "&encore::cuda::moe_routing_kernel<1, float, 32, 1, 1, 1>");
  EXPECT_EQ(moe::routing_jit_spec({DType::kFP16, 33, 2, 1, 1}).name, "moe_routing-fp16-e33-k2");
  ASSERT_NE(embedded_source("moe/cuda/routing_kernel.cuh"), nullptr);
  ASSERT_NE(embedded_source("moe/problem.hpp"), nullptr);
  EXPECT_NE(std::string(embedded_source("moe/cuda/routing_kernel.cuh")).find("kTopkGroup"), std::string::npos);
  // Every field is in the key.
  std::set<uint64_t> keys;
  for (const moe::RoutingJitVariant& v : {moe::RoutingJitVariant{DType::kBF16, 160, 6, 1, 1}, moe::RoutingJitVariant{DType::kFP16, 160, 6, 1, 1},
                                          moe::RoutingJitVariant{DType::kBF16, 192, 6, 1, 1}, moe::RoutingJitVariant{DType::kBF16, 160, 5, 1, 1},
                                          moe::RoutingJitVariant{DType::kBF16, 160, 6, 8, 3}, moe::RoutingJitVariant{DType::kBF16, 160, 6, 8, 4}})
    keys.insert(cache_key(moe::routing_jit_spec(v), "sm_90a", kTc));
  EXPECT_EQ(keys.size(), 6u);
  EXPECT_NE(cache_key(s, "sm_90a", kTc), cache_key(s, "sm_100a", kTc));
  // Limits: the CUDA kernel's E, validate's option rules.
  EXPECT_EQ(moe::routing_jit_check({DType::kBF16, 160, 6, 8, 3}), "");
  EXPECT_NE(moe::routing_jit_check({DType::kBF16, 513, 6, 1, 1}).find("[1, 512]"), std::string::npos);
  EXPECT_NE(moe::routing_jit_check({DType::kBF16, 160, 161, 1, 1}).find("top_k"), std::string::npos);
  EXPECT_NE(moe::routing_jit_check({DType::kBF16, 160, 6, 7, 1}).find("divide"), std::string::npos);
  EXPECT_NE(moe::routing_jit_check({DType::kBF16, 160, 6, 8, 9}).find("topk_group"), std::string::npos);
  EXPECT_NE(moe::routing_jit_check({DType::kBF16, 160, 60, 8, 2}).find("kept groups"), std::string::npos);
  EXPECT_NE(moe::routing_jit_check({DType::kInt32, 160, 6, 1, 1}).find("dtype"), std::string::npos);
  // Policy: (E, k) of the benchmarks stay AOT under auto.
  moe::RoutingProblem p;
  p.logits_dtype = DType::kBF16, p.num_experts = 160, p.top_k = 6;
  moe::set_routing_jit_policy(JitPolicy::kOff);
  EXPECT_FALSE(moe::routing_uses_jit(p));
  moe::set_routing_jit_policy(JitPolicy::kAuto);
  EXPECT_EQ(moe::routing_uses_jit(p), nvrtc_info().available);
  p.num_experts = 256, p.top_k = 8;
  EXPECT_TRUE(moe::routing_shape_in_aot_list(256, 8));
  EXPECT_FALSE(moe::routing_uses_jit(p)) << "auto: a benchmarked shape stays AOT";
  moe::set_routing_jit_policy(JitPolicy::kAlways);
  EXPECT_EQ(moe::routing_uses_jit(p), nvrtc_info().available);
  p.num_experts = 1024;
  EXPECT_FALSE(moe::routing_uses_jit(p)) << "beyond the kernel's E: never JIT";
  moe::set_routing_jit_policy(JitPolicy::kEnv);
}

TEST(JitMoeDispatch, SpecPolicyAndVariants) {
  const auto vs = moe::dispatch_jit_variants(160, 6);
  ASSERT_EQ(vs.size(), 4u) << "decode's single block and prefill's histogram, scan, scatter";
  std::set<std::string> names, exprs;
  std::set<uint64_t> keys;
  for (const auto& v : vs) {
    const KernelSpec s = moe::dispatch_jit_spec(v);
    names.insert(s.name);
    exprs.insert(s.name_expression);
    keys.insert(cache_key(s, "sm_90a", kTc));
  }
  EXPECT_TRUE(names.count("moe_dispatch_single_block-e160-k6"));
  EXPECT_TRUE(exprs.count("&encore::cuda::dispatch_scan_kernel<6, 160>")) << "template order: <kTopK, kExperts>";
  EXPECT_EQ(keys.size(), 4u);
  EXPECT_NE(cache_key(moe::dispatch_jit_spec({moe::DispatchMapKernel::kScatter, 160, 6}), "sm_90a", kTc),
            cache_key(moe::dispatch_jit_spec({moe::DispatchMapKernel::kScatter, 160, 7}), "sm_90a", kTc));
  ASSERT_NE(embedded_source("moe/cuda/dispatch_kernel.cuh"), nullptr);
  EXPECT_EQ(moe::dispatch_jit_check(1024, 16), "");
  EXPECT_NE(moe::dispatch_jit_check(1025, 16).find("[1, 1024]"), std::string::npos);
  EXPECT_NE(moe::dispatch_jit_check(8, 9).find("top_k"), std::string::npos);
  moe::DispatchProblem p;
  p.num_experts = 160, p.top_k = 6;
  moe::set_dispatch_jit_policy(JitPolicy::kAuto);
  EXPECT_EQ(moe::dispatch_uses_jit(p), nvrtc_info().available);
  p.num_experts = 128, p.top_k = 8;
  EXPECT_FALSE(moe::dispatch_uses_jit(p));
  moe::set_dispatch_jit_policy(JitPolicy::kAlways);
  EXPECT_EQ(moe::dispatch_uses_jit(p), nvrtc_info().available);
  p.num_experts = 2048;
  EXPECT_FALSE(moe::dispatch_uses_jit(p));
  moe::set_dispatch_jit_policy(JitPolicy::kEnv);
}

TEST(JitMoeCombine, SpecPolicyAndLimits) {
  const KernelSpec s = moe::combine_jit_spec({DType::kBF16, DType::kFP32, 8, 6, 5120});
  EXPECT_EQ(s.name, "moe_combine-bf16-fp32-h5120-k6-v8");
  EXPECT_EQ(s.name_expression, "&encore::cuda::moe_combine_kernel<__nv_bfloat16, float, 8, 6, 5120>");
  ASSERT_NE(embedded_source("moe/cuda/combine_kernel.cuh"), nullptr);
  std::set<uint64_t> keys;
  for (const moe::CombineJitVariant& v :
       {moe::CombineJitVariant{DType::kBF16, DType::kBF16, 8, 6, 5120}, moe::CombineJitVariant{DType::kFP16, DType::kBF16, 8, 6, 5120},
        moe::CombineJitVariant{DType::kBF16, DType::kFP16, 8, 6, 5120}, moe::CombineJitVariant{DType::kBF16, DType::kBF16, 1, 6, 5120},
        moe::CombineJitVariant{DType::kBF16, DType::kBF16, 8, 7, 5120}, moe::CombineJitVariant{DType::kBF16, DType::kBF16, 8, 6, 5128}})
    keys.insert(cache_key(moe::combine_jit_spec(v), "sm_90a", kTc));
  EXPECT_EQ(keys.size(), 6u);
  EXPECT_EQ(moe::combine_jit_check({DType::kFP32, DType::kBF16, 1, 3, 100}), "");
  EXPECT_NE(moe::combine_jit_check({DType::kBF16, DType::kBF16, 8, 3, 100}).find("multiple of 8"), std::string::npos);
  EXPECT_NE(moe::combine_jit_check({DType::kBF16, DType::kBF16, 8, 3, moe::kCombineJitMaxHidden + 8}).find("ahead-of-time"), std::string::npos);
  EXPECT_NE(moe::combine_jit_check({DType::kBF16, DType::kBF16, 8, 0, 128}).find("top_k"), std::string::npos);
  moe::CombineProblem p;
  p.eo_dtype = p.out_dtype = DType::kBF16, p.hidden = 5120, p.top_k = 6;
  moe::set_combine_jit_policy(JitPolicy::kAuto);
  EXPECT_EQ(moe::combine_uses_jit(p), nvrtc_info().available);
  p.hidden = 7168, p.top_k = 8;
  EXPECT_FALSE(moe::combine_uses_jit(p)) << "auto: DeepSeek-V3's D and k stay AOT";
  moe::set_combine_jit_policy(JitPolicy::kAlways);
  EXPECT_EQ(moe::combine_uses_jit(p), nvrtc_info().available);
  p.hidden = moe::kCombineJitMaxHidden * 2;
  EXPECT_FALSE(moe::combine_uses_jit(p));
  moe::set_combine_jit_policy(JitPolicy::kOff);
  p.hidden = 5120;
  EXPECT_FALSE(moe::combine_uses_jit(p));
  moe::set_combine_jit_policy(JitPolicy::kEnv);
}

TEST(JitWarmupConfig, MoeForms) {
  std::vector<WarmupLine> l;
  ASSERT_TRUE(parse("moe_routing bf16 160 6\nmoe_routing fp32 160 6 8 3  # grouped\nmoe_dispatch 160 6\n"
                    "moe_combine bf16 5120 6\nmoe_combine fp32 100 3 bf16\n",
                    &l));
  ASSERT_EQ(l.size(), 5u);
  EXPECT_EQ(l[0].dims, (std::vector<int64_t>{160, 6}));
  EXPECT_EQ(l[1].dims, (std::vector<int64_t>{160, 6, 8, 3}));
  EXPECT_EQ(l[1].dtype, DType::kFP32);
  EXPECT_EQ(l[2].kernel, "moe_dispatch");
  EXPECT_EQ(l[2].dims, (std::vector<int64_t>{160, 6}));
  EXPECT_EQ(l[3].out_dtype, DType::kBF16) << "out defaults to the input dtype";
  EXPECT_EQ(l[4].dtype, DType::kFP32);
  EXPECT_EQ(l[4].out_dtype, DType::kBF16);
  EXPECT_EQ(warmup_items(l[0], 132).size(), 1u);
  EXPECT_EQ(warmup_items(l[1], 132)[0].name, "moe_routing-fp32-e160-k6-g8-tg3");
  EXPECT_EQ(warmup_items(l[2], 132).size(), 4u) << "both dispatch paths' map kernels";
  EXPECT_EQ(warmup_items(l[3], 132)[0].name, "moe_combine-bf16-bf16-h5120-k6-v8");
  EXPECT_EQ(warmup_items(l[4], 132)[0].name, "moe_combine-fp32-bf16-h100-k3-v1") << "D % 8 != 0: the scalar kernel";
  std::vector<WarmupLine> def;
  ASSERT_TRUE(parse(default_warmup_config(), &def));
  std::set<std::string> kernels;
  for (const auto& d : def) kernels.insert(d.kernel);
  for (const char* k : {"moe_routing", "moe_dispatch", "moe_combine"}) EXPECT_TRUE(kernels.count(k)) << k << " missing from the default list";
  // Bad moe lines: JitWarmupConfig.BadLinesNameTheLineAndTheForm (test_jit_families_cpu.cpp).
}

// Every moe specialization kind compiles from the embedded headers through the warm-up path (what
// `encore jit warmup --arch` runs) for Hopper and Blackwell: E at 1, one below / above a lane
// boundary and at the kernels' limits, grouped and plain routing, every dtype; both dispatch paths;
// combine's vector and scalar kernels in mixed dtypes.
TEST(JitNvrtcMoe, EveryKindCompilesForSm90aAndSm100a) {
  if (!nvrtc_info().available) GTEST_SKIP() << "NVRTC not available: " << nvrtc_info().library;
  std::vector<WarmupLine> lines;
  ASSERT_TRUE(parse("moe_routing bf16 1 1\nmoe_routing fp16 33 2\nmoe_routing fp32 160 6 8 3\nmoe_routing bf16 512 8 8 4\n"
                    "moe_dispatch 1 1\nmoe_dispatch 160 6\nmoe_dispatch 1024 16\n"
                    "moe_combine bf16 5120 6\nmoe_combine fp32 100 3 bf16\nmoe_combine fp16 8 1 fp32\n",
                    &lines));
  for (const char* arch : {"sm_90a", "sm_100a"}) {
    for (const WarmupLine& l : lines) {
      for (const WarmupItem& item : warmup_items(l, 132)) {
        Origin origin = Origin::kMemory;
        double ms = 0;
        Status st = item.run(-1, arch, &origin, &ms);
        ASSERT_TRUE(st) << arch << " " << item.name << ": " << st.to_string();
        std::printf("  [jit] %s %s: %s, %.1f ms\n", arch, item.name.c_str(), origin_name(origin), ms);
      }
    }
  }
}

}  // namespace
}  // namespace encore::jit
