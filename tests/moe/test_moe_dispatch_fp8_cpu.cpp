// The MoE dispatch with the FP8 1x128 quantization fused into the gather (MoeDispatchArgs::x_scales),
// CPU backend: bit for bit the plain dispatch followed by fp8_group_quant over the rows in use
// (padding rows quantize a zero row; rows past offsets[E] untouched), the same maps, power-of-two
// scales too, a NaN element, rerun identity; and the errors of bad arguments.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "encore/quant.hpp"
#include "tests/moe/fp8_dispatch_case.hpp"

namespace encore::test {
namespace {

TensorView mat(void* p, DType t, int64_t r, int64_t c) { return TensorView::contiguous(p, t, {r, c}); }

class MoeDispatchFp8Cpu : public ::testing::TestWithParam<Fp8DispatchCase> {};

TEST_P(MoeDispatchFp8Cpu, EqualsDispatchThenGroupQuant) {
  const Fp8DispatchCase c = GetParam();
  Fp8DispatchHost h(c, uint64_t(c.T * 7 + c.D));
  const MoeDispatchOptions o = h.options();
  MoeDispatchArgs a = h.args();
  h.ws.assign(workspace_bytes(a, o) / 4 + 4, 0);
  ASSERT_TRUE(run(a, o, h.ws.data())) << run(a, o, h.ws.data()).to_string();

  // The plain dispatch of the same values (fp32), then fp8_group_quant over the rows in use.
  Fp8DispatchHost ref(c, uint64_t(c.T * 7 + c.D));
  std::vector<float> xp(size_t(ref.R * c.D), NAN);
  MoeDispatchArgs pa = ref.args();
  pa.x = mat(ref.xf.data(), DType::kFP32, c.T, c.D);
  pa.x_permuted = mat(xp.data(), DType::kFP32, ref.R, c.D);
  pa.x_scales = TensorView{};
  ASSERT_TRUE(run(pa, o, h.ws.data()));
  EXPECT_EQ(h.counts, ref.counts);
  EXPECT_EQ(h.offsets, ref.offsets);
  EXPECT_EQ(h.slot_rows, ref.slot_rows);
  EXPECT_EQ(h.row_slots, ref.row_slots);
  const int64_t used = ref.offsets[size_t(c.E)], G = c.D / 128;
  std::vector<uint8_t> q(size_t(ref.R * c.D), 0xab);
  std::vector<float> s(size_t(ref.R * G), NAN);
  if (used > 0) {
    Fp8GroupQuantOptions qo;
    qo.power_of_two_scales = c.power_of_two;
    const Fp8GroupQuantArgs qa{mat(xp.data(), DType::kFP32, used, c.D), mat(q.data(), DType::kFP8E4M3, used, c.D),
                               mat(s.data(), DType::kFP32, used, G)};
    ASSERT_TRUE(run(qa, qo));
  }
  EXPECT_EQ(0, std::memcmp(h.q.data(), q.data(), q.size())) << "x_permuted (rows past offsets[E] keep their 0xab)";
  EXPECT_EQ(0, std::memcmp(h.scales.data(), s.data(), s.size() * 4)) << "x_scales (rows past offsets[E] keep their NaN)";
  int padding = 0;
  for (int64_t r = 0; r < used; ++r) padding += h.row_slots[size_t(r)] < 0;
  if (c.align > 1) EXPECT_GT(padding, 0) << "the case has padding rows";

  Fp8DispatchHost again(c, uint64_t(c.T * 7 + c.D));
  MoeDispatchArgs a2 = again.args();
  ASSERT_TRUE(run(a2, o, h.ws.data()));
  EXPECT_EQ(0, std::memcmp(again.q.data(), h.q.data(), h.q.size()));
  EXPECT_EQ(0, std::memcmp(again.scales.data(), h.scales.data(), h.scales.size() * 4));
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeDispatchFp8Cpu, ::testing::ValuesIn(fp8_dispatch_cases()),
                         [](const auto& info) { return std::string(info.param.name); });

void expect_error(const Status& st, const std::string& needle) {
  EXPECT_FALSE(st);
  EXPECT_NE(st.to_string().find(needle), std::string::npos) << st.to_string();
}

TEST(MoeDispatchFp8CpuBadInput, ClearErrors) {
  Fp8DispatchHost h({"bad", 5, 2, 4, 8, 256, DType::kBF16, false}, 1);
  const MoeDispatchOptions o = h.options();
  {
    MoeDispatchArgs a = h.args();
    a.x = a.x_permuted = TensorView{};
    expect_error(validate(a, o), "x_scales: given without x and x_permuted");
  }
  {
    std::vector<uint16_t> xp(size_t(h.R * 256));
    MoeDispatchArgs a = h.args();
    a.x_permuted = mat(xp.data(), DType::kBF16, h.R, 256);
    expect_error(validate(a, o), "x_permuted: dtype");
  }
  {
    MoeDispatchArgs a = h.args();
    a.x_scales = mat(h.scales.data(), DType::kFP32, h.R, 1);
    expect_error(validate(a, o), "x_scales");
  }
  {
    MoeDispatchArgs a = h.args();
    a.x_scales = mat(h.scales.data(), DType::kFP32, h.R - 1, 2);
    expect_error(validate(a, o), "x_scales");
  }
  {
    MoeDispatchOptions bad = o;
    bad.fp8_eps = 0.f;
    expect_error(validate(h.args(), bad), "fp8_eps: must be finite and > 0");
  }
  {
    Fp8DispatchHost odd({"odd", 5, 2, 4, 8, 200, DType::kBF16, false}, 2);
    MoeDispatchArgs a = odd.args();
    a.x_scales = mat(odd.scales.data(), DType::kFP32, odd.R, 1);
    expect_error(validate(a, odd.options()), "D must be a multiple of 128, got D = 200");
  }
}

}  // namespace
}  // namespace encore::test
