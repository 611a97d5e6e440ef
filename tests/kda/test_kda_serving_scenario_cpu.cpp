// KDA serving on the CPU backend: the serving scenario of kda_serving_scenario.hpp (one KDA layer serving
// a mix of requests: chunked prefills of different lengths on the pool, 64 decode steps with continuous
// batching: requests joining and leaving, slots reused, padding rows; a speculative step of 4 tokens
// accepting 1-3, twice) made directly on the host, every request's outputs and state equal to the forward
// over its whole sequence, fp32 and bf16 pools; and the refusals of bad input, with nothing written.
#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "encore/kda.hpp"
#include "encore/kda_serving.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/kda/kda_serving_case.hpp"
#include "tests/kda/kda_serving_scenario.hpp"

namespace encore::test {
namespace {

// The host backend: every call made directly on the host (fp64 inputs and o, the pool in place).
struct CpuServing {
  static ServingDims dims() { return {}; }
  static constexpr bool kStopOnFatalFailure = false, kCheckFinite = false;
  static constexpr const char* kLabel = "";
  static void check_errors(DType pool, double o_err, double s_err) {
    const double bound = pool == DType::kFP32 ? 1e-5 : 5e-3;
    EXPECT_LT(o_err, bound);
    EXPECT_LT(s_err, bound);
  }
  explicit CpuServing(const Pool&) {}
  Token input(Token t) { return t; }
  bool zero(Pool& pool, int64_t s) {
    pool.zero(s);
    return true;
  }
  std::vector<unsigned char> pool_bytes(const Pool& pool) { return pool.bytes; }
  bool refresh(Pool&) { return true; }
  void call(Batch&, const KdaPoolForwardArgs& a, const KdaOptions& opts, const CheckedCall& checked) {
    checked([&] { return run(a, opts); });
  }
  void call(Batch&, const KdaRecurrentArgs& a, const KdaRecurrentOptions& opts, const CheckedCall& checked) {
    checked([&] { return run(a, opts); });
  }
};

class KdaServingScenario : public ::testing::TestWithParam<DType> {};

TEST_P(KdaServingScenario, EqualsTheForwardOverEachWholeSequence) { serve_and_compare<CpuServing>(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Pools, KdaServingScenario, ::testing::Values(DType::kFP32, DType::kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// Bad input: a clear error naming the argument, nothing written (pool and o keep their bytes).
TEST(KdaServingCpu, BadInputRefusedWithNothingWritten) {
  const ServingDims d;
  std::mt19937_64 rng(51);
  GateParams gp(d, rng);
  Pool pool(d, 8, DType::kFP32, rng);
  Batch b{d};
  b.varlen = false;  // 2 sequences of 4 tokens
  for (int n = 0; n < 2; ++n) b.add({random_token(d, rng), random_token(d, rng), random_token(d, rng), random_token(d, rng)});
  std::vector<int64_t> idx = {5, 2}, idx2 = {0, 1, 2, 3, 4, 5, 6, 7}, nat = {1, 4};
  std::vector<int16_t> idx16 = {5, 2};
  std::vector<double> other_state(size_t(2 * d.HV * d.K * d.V));
  std::vector<uint16_t> half_pool(size_t(8 * d.HV * d.K * d.V));
  auto base = [&] {
    KdaRecurrentArgs a = b.recurrent(&gp);
    a.initial_state = pool.view();
    a.state_indices = TensorView::contiguous(idx.data(), DType::kInt64, {2});
    return a;
  };
  ASSERT_TRUE(validate(base(), kRecOpts));
  const int64_t P = 8, H = d.HV, K = d.K, V = d.V;
  struct Case {
    const char* needle;
    std::function<void(KdaRecurrentArgs&, KdaRecurrentOptions&)> edit;
  };
  const std::vector<Case> cases = {
      {"state_indices: entry [1] = 8 is out of the pool's range [0, 8)", [&](auto& a, auto&) { idx = {5, 8}; }},
      {"state_indices: slot 2 is used twice in one call (entries [0] and [1])", [&](auto& a, auto&) { idx = {2, 2}; }},
      {"state_indices: dtype must be one of {int32, int64}",
       [&](auto& a, auto&) { a.state_indices = TensorView::contiguous(idx16.data(), DType::kFP16, {2}); }},
      {"state_indices: expected [N] or [N, S] with N = 2 sequences, got [1]", [&](auto& a, auto&) { a.state_indices.shape[0] = 1; }},
      {"state_indices: [N, S] holds S = 2 slots per sequence (one per token), but sequence 0 has 4 tokens",
       [&](auto& a, auto&) { a.state_indices = TensorView::contiguous(idx2.data(), DType::kInt64, {2, 2}); }},
      {"state_indices: slot 1 is used twice in one call (entries [0, 1] and [1, 1])",
       [&](auto& a, auto&) { idx2 = {0, 1, 2, 3, 4, 1, 6, 7}, a.state_indices = TensorView::contiguous(idx2.data(), DType::kInt64, {2, 4}); }},
      {"num_accepted_tokens: entry [1] = 5 must lie in [1, S = 4]", [&](auto& a, auto&) {
         idx2 = {0, 1, 2, 3, 4, 5, 6, 7}, nat = {1, 5};
         a.state_indices = TensorView::contiguous(idx2.data(), DType::kInt64, {2, 4});
         a.num_accepted_tokens = TensorView::contiguous(nat.data(), DType::kInt64, {2});
       }},
      {"num_accepted_tokens: entry [0] = 0 must lie in [1, S = 4]", [&](auto& a, auto&) {
         nat = {0, 1};
         a.state_indices = TensorView::contiguous(idx2.data(), DType::kInt64, {2, 4});
         a.num_accepted_tokens = TensorView::contiguous(nat.data(), DType::kInt64, {2});
       }},
      {"num_accepted_tokens: needs state_indices [N, S]",
       [&](auto& a, auto&) { a.num_accepted_tokens = TensorView::contiguous(nat.data(), DType::kInt64, {2}); }},
      {"num_accepted_tokens: expected [N] = [2], got [1]", [&](auto& a, auto&) {
         a.state_indices = TensorView::contiguous(idx2.data(), DType::kInt64, {2, 4});
         a.num_accepted_tokens = TensorView::contiguous(nat.data(), DType::kInt64, {1});
       }},
      {"initial_state: dtype must be one of {bf16, fp32, fp64}, got fp16",
       [&](auto& a, auto&) { a.initial_state = TensorView::contiguous(half_pool.data(), DType::kFP16, {P, H, K, V}); }},
      {"initial_state: expected [P, HV, K, V] = [P, 4, 16, 8], got [8, 2, 16, 8]", [&](auto& a, auto&) { a.initial_state.shape[1] = 2; }},
      {"initial_state: each slot's [HV, K, V] must be contiguous and the slot stride at least HV * K * V = 512",
       [&](auto& a, auto&) { a.initial_state = TensorView::strided(pool.bytes.data(), DType::kFP32, {4, H, K, V}, {128, K * V, V, 1}); }},
      {"initial_state: the pool [P, HV, K, V] is required with state_indices", [&](auto& a, auto&) { a.initial_state = TensorView{}; }},
      {"final_state: must be absent with state_indices", [&](auto& a, auto&) {
         a.final_state = TensorView::contiguous(other_state.data(), DType::kFP64, {2, H, K, V});
       }},
      {"initial_state: expected [N, HV, K, V] = [2, 4, 16, 8], got [8, 4, 16, 8]", [&](auto& a, auto&) { a.state_indices = TensorView{}; }},
      {"final_state: memory overlaps initial_state; the output must not alias that input (only exactly, as the same array", [&](auto& a, auto&) {
         a.state_indices = TensorView{};
         a.initial_state = TensorView::contiguous(pool.bytes.data(), DType::kFP32, {2, H, K, V});
         a.final_state = TensorView::contiguous(pool.bytes.data() + 4 * K * V, DType::kFP32, {2, H, K, V});
       }},
      {"o: shape [2, 4, 4, 4] must equal v's [2, 4, 4, 8]", [&](auto& a, auto&) { a.o.shape[3] = 4; }},
      {"o: dtype must be one of", [&](auto& a, auto&) { a.o.dtype = DType::kInt64; }},
      {"o: memory overlaps initial_state", [&](auto& a, auto&) {
         a.o = TensorView::contiguous(pool.bytes.data(), DType::kFP32, {2, 4, H, V});
       }},
      {"allow_neg_eigval: needs use_beta_sigmoid", [&](auto&, auto& o) { o.allow_neg_eigval = true; }},
      {"g: expected shape [B, T, HV, K]", [&](auto& a, auto&) { a.g.shape[3] = 8; }},
      {"A_log: required by the softplus in-kernel gate", [&](auto& a, auto&) { a.A_log = TensorView{}; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.needle);
    idx = {5, 2}, idx2 = {0, 1, 2, 3, 4, 5, 6, 7}, nat = {1, 4};
    KdaRecurrentArgs a = base();
    KdaRecurrentOptions o = kRecOpts;
    c.edit(a, o);
    const std::vector<unsigned char> before = pool.bytes;
    b.o.assign(b.o.size(), 7.0);
    const Status st = run(a, o);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find(c.needle), std::string::npos) << st.message();
    EXPECT_EQ(pool.bytes, before);
    for (double x : b.o) ASSERT_EQ(x, 7.0);
  }

  // The prefill on the pool.
  Batch pb{d};
  pb.add({random_token(d, rng), random_token(d, rng)});
  pb.add({random_token(d, rng)});
  std::vector<int64_t> pidx = {1, 6};
  std::vector<double> h0(size_t(2 * H * K * V));
  auto pbase = [&] {
    KdaPoolForwardArgs a;
    a.fwd = pb.forward(&gp);
    a.pool = pool.view();
    a.state_indices = TensorView::contiguous(pidx.data(), DType::kInt64, {2});
    return a;
  };
  ASSERT_TRUE(validate(pbase(), kFwdOpts));
  const std::vector<std::pair<const char*, std::function<void(KdaPoolForwardArgs&)>>> pcases = {
      {"fwd.initial_state: must be absent", [&](auto& a) { a.fwd.initial_state = TensorView::contiguous(h0.data(), DType::kFP64, {2, H, K, V}); }},
      {"fwd.final_state: must be absent", [&](auto& a) { a.fwd.final_state = TensorView::contiguous(h0.data(), DType::kFP64, {2, H, K, V}); }},
      {"state_indices: expected [N] with N = 2 sequences, got [1, 2]",
       [&](auto& a) { a.state_indices = TensorView::contiguous(pidx.data(), DType::kInt64, {1, 2}); }},
      {"state_indices: entry [0] = 9 is out of the pool's range [0, 8)", [&](auto&) { pidx = {9, 6}; }},
      {"state_indices: slot 6 is used twice in one call (entries [0] and [1])", [&](auto&) { pidx = {6, 6}; }},
      {"pool: expected [P, HV, K, V] = [P, 4, 16, 8], got [8, 4, 16, 4]", [&](auto& a) { a.pool.shape[3] = 4; }},
      {"pool: memory overlaps fwd.o", [&](auto& a) { a.fwd.o.data = pool.bytes.data(), a.fwd.o.dtype = DType::kFP32; }},
  };
  for (const auto& [needle, edit] : pcases) {
    SCOPED_TRACE(needle);
    pidx = {1, 6};
    KdaPoolForwardArgs a = pbase();
    edit(a);
    const std::vector<unsigned char> before = pool.bytes;
    const Status st = run(a, kFwdOpts);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
    EXPECT_EQ(pool.bytes, before);
  }
}

}  // namespace
}  // namespace encore::test
