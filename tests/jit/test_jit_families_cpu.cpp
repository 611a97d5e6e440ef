// Host-side tests of the JIT families beyond RMSNorm (QK-norm, FP8 group quant, MXFP8 / NVFP4), the shared
// dispatcher pieces (jit/family.hpp) and the warm-up config (jit/warmup.hpp): policies, variant
// lists, specs and keys; with NVRTC (else skipped) every kind of variant compiles for sm_90a.
#include <gtest/gtest.h>

#include <set>
#include <sstream>

#include "jit/family.hpp"
#include "jit/jit.hpp"
#include "jit/warmup.hpp"
#include "norm/jit.hpp"
#include "quant/jit.hpp"

namespace encore::jit {
namespace {

const Toolchain kTc{13, 0, 13000, "0.1.0"};

Status parse(const std::string& text, std::vector<WarmupLine>* out) {
  std::istringstream in(text);
  return parse_warmup_config(in, out);
}

TEST(JitFamily, PolicyResolutionAndHook) {
  Family f("toy");
  f.set_policy(JitPolicy::kOff);
  EXPECT_EQ(f.policy(), JitPolicy::kOff);
  EXPECT_FALSE(f.uses_jit(false));
  f.set_policy(JitPolicy::kAuto);
  EXPECT_EQ(f.uses_jit(false), nvrtc_info().available) << "auto: JIT outside the AOT list when NVRTC is there";
  EXPECT_FALSE(f.uses_jit(true)) << "auto: the AOT list stays ahead-of-time";
  f.set_policy(JitPolicy::kAlways);
  EXPECT_EQ(f.uses_jit(true), nvrtc_info().available);
  f.set_policy(JitPolicy::kEnv);
  EXPECT_NE(f.policy(), JitPolicy::kEnv) << "kEnv resolves from ENCORE_JIT";
}

TEST(JitFamily, FallbackIsSaidOnceAndSuccessIsHandled) {
  if (stream_capturing(nullptr)) GTEST_SKIP() << "the capture query fails without a device (treated as capturing)";
  Family f("toy");
  EXPECT_TRUE(f.handled(Status::ok(), nullptr));
  testing::internal::CaptureStderr();
  EXPECT_FALSE(f.handled(Status::internal("first"), nullptr)) << "a failure outside a capture falls back to AOT";
  EXPECT_FALSE(f.handled(Status::internal("second"), nullptr));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("toy JIT failed, using the ahead-of-time kernels"), std::string::npos) << err;
  EXPECT_NE(err.find("first"), std::string::npos) << err;
  EXPECT_EQ(err.find("second"), std::string::npos) << "the fallback message is printed once per family: " << err;
}

TEST(JitFamily, EmbeddedSpecHasTheShimsAndFlagsMissingHeaders) {
  const KernelSpec s = embedded_spec("x", "norm/cuda/qk_norm_kernel.cuh", {"norm/cuda/qk_norm_kernel.cuh", "no/such.cuh"}, "&k<1>");
  EXPECT_EQ(s.source, "#include \"norm/cuda/qk_norm_kernel.cuh\"\n");
  std::set<std::string> names;
  for (const auto& [n, text] : s.headers) names.insert(n);
  for (const char* n : {"cstdint", "cstddef", "cmath", "type_traits", "norm/cuda/qk_norm_kernel.cuh", "no/such.cuh"})
    EXPECT_TRUE(names.count(n)) << n;
  EXPECT_NE(s.headers.back().second.find("#error"), std::string::npos) << "a header missing from the build must fail loudly";
}

TEST(JitQkNorm, PolicyVariantsAndSpec) {
  EXPECT_TRUE(norm::qk_norm_heads_in_aot_list(128, 32, 8));
  EXPECT_FALSE(norm::qk_norm_heads_in_aot_list(128, 24, 4));
  EXPECT_FALSE(norm::qk_norm_heads_in_aot_list(64, 32, 8));
  const auto vs = norm::qk_norm_jit_variants(DType::kBF16, 128, 24, 4, false, 132);
  std::set<int> hpt;
  for (const auto& v : vs) hpt.insert(v.heads_per_thread);
  EXPECT_EQ(hpt, (std::set<int>{1, 2})) << "decode (1 head per lane group) and prefill (2) plans";
  const KernelSpec s = norm::qk_norm_jit_spec({DType::kBF16, 128, 24, 4, true, 2});
  EXPECT_EQ(s.name, "qk_norm-bf16-d128-q24-kv4-t2-off");
  EXPECT_EQ(s.name_expression, "&encore::cuda::qk_norm_kernel<__nv_bfloat16, 128, true, 2, 28, 24>");
  ASSERT_NE(embedded_source("norm/cuda/qk_norm_kernel.cuh"), nullptr);
  EXPECT_NE(std::string(embedded_source("norm/cuda/qk_norm_kernel.cuh")).find("kHeadsPerToken"), std::string::npos);
  // Every field is in the key: layouts that differ only in the split of the same total differ.
  EXPECT_NE(cache_key(norm::qk_norm_jit_spec({DType::kBF16, 128, 24, 4, false, 1}), "sm_90a", kTc),
            cache_key(norm::qk_norm_jit_spec({DType::kBF16, 128, 20, 8, false, 1}), "sm_90a", kTc));
  // The dispatcher's choice with the hook.
  norm::QkNormProblem p;
  p.num_q_heads = 24, p.num_kv_heads = 4, p.head_dim = 128;
  norm::set_qk_norm_jit_policy(JitPolicy::kOff);
  EXPECT_FALSE(norm::qk_norm_uses_jit(p));
  norm::set_qk_norm_jit_policy(JitPolicy::kAuto);
  EXPECT_EQ(norm::qk_norm_uses_jit(p), nvrtc_info().available);
  p.num_q_heads = 32, p.num_kv_heads = 8;
  EXPECT_FALSE(norm::qk_norm_uses_jit(p)) << "auto: a listed layout stays AOT";
  norm::set_qk_norm_jit_policy(JitPolicy::kAlways);
  EXPECT_EQ(norm::qk_norm_uses_jit(p), nvrtc_info().available);
  p.num_q_heads = norm::kQkNormJitMaxHeads;
  EXPECT_FALSE(norm::qk_norm_uses_jit(p)) << "more heads than the JIT specializes: AOT";
  norm::set_qk_norm_jit_policy(JitPolicy::kEnv);
}

TEST(JitFp8Quant, PolicyVariantsAndSpec) {
  EXPECT_TRUE(quant::fp8_group_quant_cols_in_aot_list(7168));
  EXPECT_FALSE(quant::fp8_group_quant_cols_in_aot_list(5248));
  const auto vs = quant::fp8_group_quant_jit_variants(DType::kBF16, 5248, 132);
  std::set<std::pair<int, bool>> kinds;
  for (const auto& v : vs) {
    EXPECT_EQ(v.cols, 5248);
    kinds.insert({v.packs_per_lane, v.tiled});
  }
  EXPECT_EQ(kinds.size(), 4u) << "one and two packs per lane, row order and row tiles";
  for (const auto& v : quant::fp8_group_quant_jit_variants(DType::kFP32, 384, 132)) EXPECT_EQ(v.packs_per_lane, 1) << "fp32: one pack";
  const KernelSpec s = quant::fp8_group_quant_jit_spec({DType::kFP16, 5248, 128, 1, 2, true});
  EXPECT_EQ(s.name, "fp8_group_quant-fp16-k5248-g128-t1-p2-tiled");
  EXPECT_EQ(s.name_expression, "&encore::cuda::fp8_group_quant_kernel<__half, 1, 2, true, 41>");
  ASSERT_NE(embedded_source("quant/cuda/fp8_group_quant_kernel.cuh"), nullptr);
  ASSERT_NE(embedded_source("encore/core/dtype.hpp"), nullptr) << "a header under include/ is embedded too";
  EXPECT_NE(cache_key(quant::fp8_group_quant_jit_spec({DType::kBF16, 5248, 128, 1, 1, false}), "sm_90a", kTc),
            cache_key(quant::fp8_group_quant_jit_spec({DType::kBF16, 5376, 128, 1, 1, false}), "sm_90a", kTc));
  quant::Fp8QuantProblem p;
  p.cols = 5248;
  quant::set_fp8_group_quant_jit_policy(JitPolicy::kAuto);
  EXPECT_EQ(quant::fp8_group_quant_uses_jit(p), nvrtc_info().available);
  p.cols = 7168;
  EXPECT_FALSE(quant::fp8_group_quant_uses_jit(p));
  quant::set_fp8_group_quant_jit_policy(JitPolicy::kAlways);
  EXPECT_EQ(quant::fp8_group_quant_uses_jit(p), nvrtc_info().available);
  p.cols = quant::kFp8QuantJitMaxCols + 128;
  EXPECT_FALSE(quant::fp8_group_quant_uses_jit(p)) << "K above the JIT's limit: AOT";
  quant::set_fp8_group_quant_jit_policy(JitPolicy::kEnv);
}

TEST(JitMxQuant, PolicyAndSpec) {
  const KernelSpec m = quant::mx_quant_jit_spec({quant::MxKind::kMxfp8, DType::kBF16, 5248});
  EXPECT_EQ(m.name, "mxfp8_quant-bf16-k5248");
  EXPECT_EQ(m.name_expression, "&encore::cuda::mxfp8_quant_kernel<__nv_bfloat16, 656>");
  const KernelSpec n = quant::mx_quant_jit_spec({quant::MxKind::kNvfp4, DType::kFP32, 784});
  EXPECT_EQ(n.name_expression, "&encore::cuda::nvfp4_quant_kernel<float, 98>");
  EXPECT_NE(cache_key(m, "sm_90a", kTc), cache_key(quant::mx_quant_jit_spec({quant::MxKind::kNvfp4, DType::kBF16, 5248}), "sm_90a", kTc));
  ASSERT_NE(embedded_source("quant/cuda/mx_quant_kernel.cuh"), nullptr);
  quant::MxProblem p;
  p.cols = 5248;
  quant::set_mx_quant_jit_policy(JitPolicy::kAuto);
  EXPECT_EQ(quant::mx_quant_uses_jit(p), nvrtc_info().available);
  p.cols = 7168;
  EXPECT_FALSE(quant::mx_quant_uses_jit(p)) << "auto: a listed K stays AOT";
  quant::set_mx_quant_jit_policy(JitPolicy::kAlways);
  EXPECT_EQ(quant::mx_quant_uses_jit(p), nvrtc_info().available);
  p.cols = quant::kMxQuantJitMaxCols + 32;
  EXPECT_FALSE(quant::mx_quant_uses_jit(p));
  quant::set_mx_quant_jit_policy(JitPolicy::kOff);
  p.cols = 5248;
  EXPECT_FALSE(quant::mx_quant_uses_jit(p));
  quant::set_mx_quant_jit_policy(JitPolicy::kEnv);
}

TEST(JitWarmupConfig, ParsesEveryForm) {
  std::vector<WarmupLine> lines;
  ASSERT_TRUE(parse("# comment\n\nrms_norm bf16 5184 add  # trailing\nqk_norm fp16 64 7 3 offset\nqk_norm bf16 128 24 4\n"
                    "fp8_group_quant fp32 384\nfp8_group_quant bf16 5248 128\nmxfp8_quant fp16 96\nnvfp4_quant fp32 16\n",
                    &lines));
  ASSERT_EQ(lines.size(), 7u);
  EXPECT_EQ(lines[5].kernel, "mxfp8_quant");
  EXPECT_EQ(lines[6].dims, (std::vector<int64_t>{16}));
  EXPECT_EQ(lines[0].kernel, "rms_norm");
  EXPECT_TRUE(lines[0].add);
  EXPECT_EQ(lines[0].line, 3);
  EXPECT_EQ(lines[1].dtype, DType::kFP16);
  EXPECT_EQ(lines[1].dims, (std::vector<int64_t>{64, 7, 3}));
  EXPECT_TRUE(lines[1].offset);
  EXPECT_FALSE(lines[2].offset);
  EXPECT_EQ(lines[3].dims, (std::vector<int64_t>{384, 128})) << "group size defaults to 128";
  EXPECT_EQ(lines[4].dims, (std::vector<int64_t>{5248, 128}));
  std::vector<WarmupLine> def;
  ASSERT_TRUE(parse(default_warmup_config(), &def));
  std::set<std::string> kernels;
  for (const auto& l : def) kernels.insert(l.kernel);
  EXPECT_EQ(kernels, (std::set<std::string>{"rms_norm", "qk_norm", "fp8_group_quant", "mxfp8_quant", "nvfp4_quant", "moe_routing",
                                            "moe_dispatch", "moe_combine"}))
      << "the default list covers every family";
}

TEST(JitWarmupConfig, BadLinesNameTheLineAndTheForm) {
  const std::pair<const char*, const char*> cases[] = {
      {"layer_norm bf16 4096", "unknown kernel"},
      {"rms_norm int8 4096", "bad dtype"},
      {"rms_norm bf16", "rms_norm <bf16|fp16|fp32> <hidden> [add]"},
      {"rms_norm bf16 0", "hidden must be > 0"},
      {"rms_norm bf16 4096 offset", "unexpected 'offset'"},
      {"qk_norm bf16 96 8 8", "head_dim must be 64, 128 or 256"},
      {"qk_norm fp32 128 8 8", "bf16 or fp16"},
      {"qk_norm bf16 128 8", "qk_norm <bf16|fp16> <head_dim"},
      {"qk_norm bf16 128 8 0", ">= 1"},
      {"qk_norm bf16 128 8 8 add", "unexpected 'add'"},
      {"fp8_group_quant bf16 5000", "multiple of 128"},
      {"fp8_group_quant bf16 5248 64", "group_size must be 128"},
      {"fp8_group_quant bf16 5248 128 128", "unexpected '128'"},
      {"mxfp8_quant bf16 48", "multiple of 32"},
      {"nvfp4_quant bf16 40", "multiple of 16"},
      {"nvfp4_quant bf16 32 swizzled", "unexpected 'swizzled'"},
      {"moe_routing bf16 160", "moe_routing <bf16|fp16|fp32> <experts> <top_k>"},
      {"moe_routing int8 160 6", "bad dtype"},
      {"moe_routing bf16 160 6 8", "given together"},
      {"moe_routing bf16 160 6 8 3 1", "unexpected '1'"},
      {"moe_routing bf16 600 6", "[1, 512]"},
      {"moe_routing bf16 160 6 7 1", "divide"},
      {"moe_routing bf16 4294967424 6", "[0, 2^31)"},
      {"moe_dispatch bf16 160 6", "moe_dispatch <experts> <top_k>"},
      {"moe_dispatch 160", "moe_dispatch <experts> <top_k>"},
      {"moe_dispatch 2000 6", "[1, 1024]"},
      {"moe_dispatch 8 9", "top_k"},
      {"moe_combine bf16 5120", "moe_combine <bf16|fp16|fp32> <hidden> <top_k>"},
      {"moe_combine bf16 5120 6 fp32 fp16", "unexpected 'fp16'"},
      {"moe_combine bf16 5120 0", "top_k"},
      {"moe_combine bf16 200000 6", "ahead-of-time"},
  };
  for (const auto& [text, expect] : cases) {
    std::vector<WarmupLine> lines;
    Status st = parse(std::string("# first\n") + text + "\n", &lines);
    EXPECT_FALSE(st) << text;
    EXPECT_NE(st.message().find("line 2: "), std::string::npos) << text << ": " << st.to_string();
    EXPECT_NE(st.message().find(expect), std::string::npos) << text << ": " << st.to_string();
  }
}

TEST(JitWarmupConfig, ItemsAreTheFamiliesVariants) {
  std::vector<WarmupLine> lines;
  ASSERT_TRUE(parse("qk_norm bf16 128 24 4\nfp8_group_quant bf16 5248\nrms_norm bf16 5184\n", &lines));
  const auto qk = warmup_items(lines[0], 132);
  ASSERT_EQ(qk.size(), norm::qk_norm_jit_variants(DType::kBF16, 128, 24, 4, false, 132).size());
  EXPECT_EQ(qk[0].name, "qk_norm-bf16-d128-q24-kv4-t1");
  EXPECT_EQ(warmup_items(lines[1], 132).size(), quant::fp8_group_quant_jit_variants(DType::kBF16, 5248, 132).size());
  EXPECT_EQ(warmup_items(lines[2], 132).size(), norm::rms_norm_jit_variants(DType::kBF16, 5184, false, 132).size());
}

// Every kind of template argument the QK-norm, FP8 and MX dispatchers can ask for compiles for sm_90a
// from the embedded headers (memory-only cache).
TEST(JitNvrtcFamilies, QkNormAndQuantVariantKindsCompile) {
  if (!nvrtc_info().available) GTEST_SKIP() << "NVRTC not available: " << nvrtc_info().library;
  Jit j("", JitMode::kAuto);
  std::vector<KernelSpec> specs = {
      norm::qk_norm_jit_spec({DType::kBF16, 128, 24, 4, false, 1}), norm::qk_norm_jit_spec({DType::kFP16, 64, 7, 3, true, 2}),
      norm::qk_norm_jit_spec({DType::kBF16, 256, 1, 1, false, 4}),
      quant::fp8_group_quant_jit_spec({DType::kBF16, 5248, 128, 1, 2, false}),
      quant::fp8_group_quant_jit_spec({DType::kFP16, 128, 128, 2, 1, true}),
      quant::fp8_group_quant_jit_spec({DType::kFP32, 384, 128, 8, 1, true}),
      quant::mx_quant_jit_spec({quant::MxKind::kMxfp8, DType::kFP16, 96}), quant::mx_quant_jit_spec({quant::MxKind::kNvfp4, DType::kBF16, 5248})};
  for (const KernelSpec& spec : specs) {
    std::shared_ptr<const Cubin> c;
    double ms = 0;
    Status st = j.get_cubin(spec, "sm_90a", &c, nullptr, &ms);
    ASSERT_TRUE(st) << spec.name << ": " << st.to_string();
    std::printf("  [jit] %s: %.1f ms, %zu-byte cubin\n", spec.name.c_str(), ms, c->image.size());
    EXPECT_FALSE(c->lowered_name.empty());
  }
}

}  // namespace
}  // namespace encore::jit
