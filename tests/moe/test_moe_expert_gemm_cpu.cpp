// The CUDA expert GEMMs' host-side index math (src/moe/problem.hpp), checked without a GPU: the
// per-group operand offsets of the fused path (gate, up + SwiGLU, down) and of the unfused one, the
// workspace bound, and the path choice (ENCORE_MOE_FUSED_SWIGLU read at every call; unfused unless set).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "moe/problem.hpp"
#include "tests/common/scoped_env.hpp"

namespace encore::test {
namespace {

using moe::ExpertGemmProblem;
using moe::GroupedOperands;

// A layer with padded strides (every stride differs, so a swapped one shows).
ExpertGemmProblem make_problem(int E, int64_t D, int64_t F) {
  ExpertGemmProblem p;
  moe::ExpertMlpProblem& m = p.mlp;
  m.num_experts = E;
  m.hidden = D;
  m.intermediate = F;
  m.xp_stride = D + 8;
  m.act_stride = F + 16;
  m.y_stride = D + 24;
  m.w13_stride_n = D + 32;
  m.w13_stride_e = 2 * F * m.w13_stride_n + 40;
  m.w2_stride_n = F + 48;
  m.w2_stride_e = D * m.w2_stride_n + 56;
  p.gate_up_stride = 2 * F + 64;
  return p;
}

TEST(MoeExpertGemmSpecs, FusedPathOffsetsPerGroup) {
  const int E = 4;
  const int64_t D = 128, F = 64;
  const ExpertGemmProblem p = make_problem(E, D, F);
  const moe::ExpertMlpProblem& m = p.mlp;
  const std::vector<int32_t> offsets = {0, 16, 16, 48, 49};  // expert 1 empty, expert 3 one row
  const moe::ExpertGemmSpecs s = moe::expert_gemm_specs(p);
  EXPECT_EQ(s.gate.n, F);
  EXPECT_EQ(s.gate.k, D);
  EXPECT_EQ(s.up.n, F);
  EXPECT_EQ(s.up.k, D);
  EXPECT_EQ(s.down.n, D);
  EXPECT_EQ(s.down.k, F);
  for (int e = 0; e < E; ++e) {
    SCOPED_TRACE("expert " + std::to_string(e));
    const int64_t r0 = offsets[size_t(e)];
    const int32_t rows = offsets[size_t(e) + 1] - offsets[size_t(e)];
    const GroupedOperands g = moe::grouped_operands(s.gate, offsets.data(), e);
    EXPECT_EQ(g.m, rows);
    EXPECT_EQ(g.a, r0 * m.xp_stride);                        // x_permuted row offsets[e]
    EXPECT_EQ(g.b, e * m.w13_stride_e);                      // gate rows [0, F) of w13[e]
    EXPECT_EQ(g.d, r0 * p.gate_up_stride);                   // gate_up's first F columns
    const GroupedOperands u = moe::grouped_operands(s.up, offsets.data(), e);
    EXPECT_EQ(u.m, rows);
    EXPECT_EQ(u.a, g.a);
    EXPECT_EQ(u.b, e * m.w13_stride_e + F * m.w13_stride_n);  // up rows [F, 2F) of w13[e]
    EXPECT_EQ(u.c, g.d);                                      // C = the gate this group's gate GEMM wrote
    EXPECT_EQ(u.d, r0 * m.act_stride);                        // act row offsets[e]
    EXPECT_EQ(s.up.ldc, s.gate.ldd);
    const GroupedOperands d = moe::grouped_operands(s.down, offsets.data(), e);
    EXPECT_EQ(d.m, rows);
    EXPECT_EQ(d.a, u.d);  // A = act
    EXPECT_EQ(s.down.lda, s.up.ldd);
    EXPECT_EQ(d.b, e * m.w2_stride_e);
    EXPECT_EQ(d.d, r0 * m.y_stride);
  }
}

// The pair mapping of the fused path against the unfused layout: element (r, f) of the up GEMM of
// group e is the dot product of x_permuted row offsets[e] + r with w13 row e * 2F + F + f, which is
// column F + f of the unfused gate/up GEMM's row; its C element is the gate at column f of the
// same gate_up row.
TEST(MoeExpertGemmSpecs, FusedPairsMatchTheUnfusedColumns) {
  const int E = 3;
  const int64_t D = 64, F = 40;
  const ExpertGemmProblem p = make_problem(E, D, F);
  const moe::ExpertMlpProblem& m = p.mlp;
  const std::vector<int32_t> offsets = {0, 8, 24, 24};
  const moe::ExpertGemmSpecs s = moe::expert_gemm_specs(p);
  moe::GroupedGemmSpec unfused = s.gate;
  unfused.n = int(2 * F);
  for (int e = 0; e < E; ++e)
    for (int32_t r = 0; r < offsets[size_t(e) + 1] - offsets[size_t(e)]; ++r)
      for (int64_t f = 0; f < F; f += 13) {
        const GroupedOperands u = moe::grouped_operands(s.up, offsets.data(), e), h = moe::grouped_operands(unfused, offsets.data(), e);
        // Weight row of up element (r, f) and of unfused column F + f.
        EXPECT_EQ(u.b + f * s.up.ldb, h.b + (F + f) * unfused.ldb);
        // The gate element read as C (r, f) = the unfused gate_up element (r, f).
        EXPECT_EQ(u.c + r * s.up.ldc + f, h.d + r * unfused.ldd + f);
        // act (r, f) = row offsets[e] + r of act.
        EXPECT_EQ(u.d + r * s.up.ldd + f, (offsets[size_t(e)] + r) * m.act_stride + f);
      }
}

TEST(MoeExpertGemmSpecs, WorkspaceHoldsThreeGemms) {
  for (int E : {1, 8, 128, 512}) {
    const size_t bytes = moe::grouped_gemm_workspace_bytes(E);
    EXPECT_GE(bytes, size_t(moe::kGroupedGemmCount) * moe::kGroupedGemmCutlassBytes + size_t(E) * moe::kGroupedGemmCount * 9 * 16) << E;
    EXPECT_EQ(bytes % moe::kBufferAlign, 0u) << E;
  }
}

TEST(MoeExpertGemmSpecs, FusedSwigluSwitchIsReadPerCall) {
  ScopedEnv guard("ENCORE_MOE_FUSED_SWIGLU");
  // Unset, empty, "auto" and "0": the unfused path (the faster one on the H200 at every size).
  for (const char* v : {static_cast<const char*>(nullptr), "", "auto", "0"}) {
    if (v == nullptr) unsetenv("ENCORE_MOE_FUSED_SWIGLU");
    else setenv("ENCORE_MOE_FUSED_SWIGLU", v, 1);
    EXPECT_FALSE(moe::moe_fused_swiglu()) << (v ? v : "unset");
  }
  setenv("ENCORE_MOE_FUSED_SWIGLU", "1", 1);
  EXPECT_TRUE(moe::moe_fused_swiglu());
}

TEST(MoeExpertGemmSpecs, GemmTileSwitchIsReadPerCall) {
  ScopedEnv guard("ENCORE_MOE_GEMM_TILE");
  // Unset or any other value: 128x256 from kWideTileMinTokens tokens, 128x128 below.
  for (const char* v : {static_cast<const char*>(nullptr), "", "auto", "256x128"}) {
    if (v == nullptr) unsetenv("ENCORE_MOE_GEMM_TILE");
    else setenv("ENCORE_MOE_GEMM_TILE", v, 1);
    EXPECT_FALSE(moe::moe_wide_tile(1)) << (v ? v : "unset");
    EXPECT_FALSE(moe::moe_wide_tile(moe::kWideTileMinTokens - 1)) << (v ? v : "unset");
    EXPECT_TRUE(moe::moe_wide_tile(moe::kWideTileMinTokens)) << (v ? v : "unset");
    EXPECT_TRUE(moe::moe_wide_tile(16384)) << (v ? v : "unset");
  }
  setenv("ENCORE_MOE_GEMM_TILE", "128x128", 1);
  EXPECT_FALSE(moe::moe_wide_tile(16384));
  setenv("ENCORE_MOE_GEMM_TILE", "128x256", 1);
  EXPECT_TRUE(moe::moe_wide_tile(1));
}

TEST(MoeExpertGemmSpecs, DecodeGemvSwitchIsReadPerCall) {
  ScopedEnv guard("ENCORE_MOE_DECODE");
  unsetenv("ENCORE_MOE_DECODE");  // the default: T <= 4
  EXPECT_TRUE(moe::moe_decode_gemv(1, 2048, 768));
  EXPECT_TRUE(moe::moe_decode_gemv(4, 2048, 768));
  EXPECT_FALSE(moe::moe_decode_gemv(5, 2048, 768));
  EXPECT_FALSE(moe::moe_decode_gemv(16, 2048, 768));
  EXPECT_FALSE(moe::moe_decode_gemv(0, 2048, 768));
  setenv("ENCORE_MOE_DECODE", "0", 1);
  EXPECT_FALSE(moe::moe_decode_gemv(1, 2048, 768));
  setenv("ENCORE_MOE_DECODE", "1", 1);  // wherever it applies
  EXPECT_TRUE(moe::moe_decode_gemv(1, 2048, 768));
  EXPECT_TRUE(moe::moe_decode_gemv(16, 2048, 768));    // 16 x 2048 bf16 rows staged: 64 KB
  EXPECT_FALSE(moe::moe_decode_gemv(17, 2048, 768));   // more rows than kDecodeMaxRows
  EXPECT_TRUE(moe::moe_decode_gemv(6, 7168, 2048));    // 84 KB
  EXPECT_FALSE(moe::moe_decode_gemv(7, 7168, 2048));   // 98 KB > kDecodeMaxSmem
  EXPECT_FALSE(moe::moe_decode_gemv(0, 2048, 768));
}

}  // namespace
}  // namespace encore::test
