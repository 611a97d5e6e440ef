// KDA serving on the CPU backend (encore/kda_serving.hpp): the recurrent step equals the forward (the
// token recurrence), on a pool with padding and per-token (speculative) slots, the chunked prefill on
// the pool; every other slot bit-identical. The serving scenario and the refusals:
// test_kda_serving_scenario_cpu.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "encore/kda.hpp"
#include "encore/kda_serving.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/kda/kda_serving_case.hpp"

namespace encore::test {
namespace {

const KdaRecurrentOptions kRecOpts{0.0, true, true};  // L2 norm, softplus gate (Kimi-Linear's)
const KdaOptions kFwdOpts{0.0, true, true, true};     // the same, with the final state

KdaRecurrentArgs recurrent_of(const KdaForwardArgs& f) {
  KdaRecurrentArgs a;
  a.q = f.q, a.k = f.k, a.v = f.v, a.g = f.g, a.beta = f.beta, a.A_log = f.A_log, a.dt_bias = f.dt_bias, a.cu_seqlens = f.cu_seqlens;
  a.initial_state = f.initial_state;
  return a;
}

KdaRecurrentOptions recurrent_options(const KdaOptions& o) {
  return {o.scale, o.use_qk_l2norm, o.use_gate_in_kernel, o.use_lower_bound, o.lower_bound};
}

// o and the final state of one sequence `tokens` from h0 (empty: zeros) by the forward (fp64).
void forward_one(const ServingDims& d, GateParams& gp, const std::vector<Token>& tokens, std::vector<double> h0, std::vector<double>* o,
                 std::vector<double>* fin) {
  Batch b{d};
  b.add(tokens);
  KdaForwardArgs f = b.forward(&gp);
  fin->assign(size_t(d.HV * d.K * d.V), NAN);
  if (!h0.empty()) f.initial_state = TensorView::contiguous(h0.data(), DType::kFP64, {1, d.HV, d.K, d.V});
  f.final_state = TensorView::contiguous(fin->data(), DType::kFP64, {1, d.HV, d.K, d.V});
  const Status st = run(f, kFwdOpts);
  ASSERT_TRUE(st) << st.to_string();
  *o = b.o;
}

// Without a pool the recurrent step is the forward (the same fp64 recurrence: the same bits), with the
// initial state, in place, and through an empty sequence (its final state = its initial state).
TEST(KdaRecurrentCpu, EqualsTheForward) {
  for (Gate gate : {Gate::kSoftplusBias, Gate::kLowerBound, Gate::kPrecomputed}) {
    KdaCase kc{1, 12, 2, 8, 6, {0, 3, 4, 4, 12}, gate, true, true};
    kc.HV = 4;
    kc.fill(7);
    KdaForwardArgs f = kc.args();
    ASSERT_TRUE(run(f, kc.opts));
    const std::vector<double> o_ref = kc.o, fin_ref = kc.fin;
    std::vector<double> o(kc.o.size(), NAN), fin(kc.fin.size(), NAN);
    KdaRecurrentArgs a = recurrent_of(f);
    a.o = f.o, a.o.data = o.data();
    a.final_state = f.final_state, a.final_state.data = fin.data();
    EXPECT_EQ(workspace_bytes(a, recurrent_options(kc.opts)), 0u);
    const Status st = run(a, recurrent_options(kc.opts));
    ASSERT_TRUE(st) << st.to_string();
    EXPECT_EQ(o, o_ref);
    EXPECT_EQ(fin, fin_ref);
    // In place: final_state is initial_state (fla's inplace_final_state).
    std::vector<double> state = kc.init;
    a.initial_state.data = a.final_state.data = state.data();
    ASSERT_TRUE(run(a, recurrent_options(kc.opts)));
    EXPECT_EQ(state, fin_ref);
    EXPECT_EQ(o, o_ref);
  }
}

// use_beta_sigmoid: beta = sigmoid(raw) (2 sigmoid(raw) with allow_neg_eigval), as the forward on the activated beta.
TEST(KdaRecurrentCpu, BetaSigmoidInKernel) {
  for (bool neg : {false, true}) {
    KdaCase kc{2, 5, 2, 8, 8, {}, Gate::kSoftplus, true, true};
    kc.fill(3);
    std::mt19937_64 rng(4);
    std::normal_distribution<double> nd;
    std::vector<double> raw(kc.beta.size());
    for (size_t i = 0; i < raw.size(); ++i) {
      raw[i] = 2.0 * nd(rng);
      kc.beta[i] = (neg ? 2.0 : 1.0) / (1.0 + std::exp(-raw[i]));
    }
    KdaForwardArgs f = kc.args();
    ASSERT_TRUE(run(f, kc.opts));
    std::vector<double> o(kc.o.size(), NAN), fin(kc.fin.size(), NAN);
    KdaRecurrentArgs a = recurrent_of(f);
    a.beta.data = raw.data();
    a.o = f.o, a.o.data = o.data();
    a.final_state = f.final_state, a.final_state.data = fin.data();
    KdaRecurrentOptions ro = recurrent_options(kc.opts);
    ro.use_beta_sigmoid = true;
    ro.allow_neg_eigval = neg;
    ASSERT_TRUE(run(a, ro));
    EXPECT_LT(rel_err(o, kc.o), 1e-14);
    EXPECT_LT(rel_err(fin, kc.fin), 1e-14);
  }
}

// Decode on a pool: sequence n from slot state_indices[n] back into it; padding (-1) rows zero even with NaN
// inputs; every other slot bit-identical. The expected states: the forward from the slot's values, rounded
// to the pool's dtype (the same fp64 arithmetic: the same bits).
TEST(KdaRecurrentCpu, DecodeOnThePool) {
  const ServingDims d;
  for (DType dt : {DType::kFP32, DType::kBF16}) {
    for (DType it : {DType::kInt32, DType::kInt64}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " pool, " + dtype_name(it) + " indices");
      std::mt19937_64 rng(11);
      GateParams gp(d, rng);
      Pool pool(d, 8, dt, rng);
      const std::vector<int64_t> slots = {5, -1, 2, 7, -1};
      std::vector<std::vector<Token>> toks;
      Batch b{d};
      b.varlen = false;  // B = 5 sequences of one token
      for (int64_t s : slots) {
        toks.push_back({random_token(d, rng, s < 0)});
        b.add(toks.back());
      }
      const std::vector<unsigned char> before = pool.bytes;
      std::vector<int32_t> i32(slots.begin(), slots.end());
      std::vector<int64_t> i64 = slots;
      KdaRecurrentArgs a = b.recurrent(&gp);
      a.initial_state = pool.view();
      a.state_indices = it == DType::kInt32 ? TensorView::contiguous(i32.data(), it, {5}) : TensorView::contiguous(i64.data(), it, {5});
      const Status st = run(a, kRecOpts);
      ASSERT_TRUE(st) << st.to_string();
      for (int64_t s = 0; s < pool.P; ++s)
        if (s != 5 && s != 2 && s != 7) EXPECT_TRUE(pool.slot_equals(before, s)) << "slot " << s;
      Pool old = pool;
      old.bytes = before;
      for (size_t n = 0; n < slots.size(); ++n) {
        const std::vector<double> o_n = b.o_rows(int64_t(n));
        if (slots[n] < 0) {
          for (double x : o_n) EXPECT_EQ(x, 0.0);
          continue;
        }
        std::vector<double> o_ref, fin_ref;
        forward_one(d, gp, toks[n], old.slot(slots[n]), &o_ref, &fin_ref);
        EXPECT_EQ(o_n, o_ref) << n;
        EXPECT_EQ(pool.slot(slots[n]), pool.rounded(fin_ref)) << n;
      }
    }
  }
}

// Speculative decoding, state_indices [N, S]: sequence n starts from column num_accepted_tokens[n] - 1 and
// writes the state after its token t to column t (not where < 0); a sequence whose start entry is < 0 is
// padding (its other entries unused); several tokens on a 1-D index leave the final state.
TEST(KdaRecurrentCpu, SpeculativeSlotsPerToken) {
  const ServingDims d;
  std::mt19937_64 rng(21);
  GateParams gp(d, rng);
  Pool pool(d, 12, DType::kFP32, rng);
  const std::vector<int64_t> idx = {0, 1, 2, 3,  4, 5, -1, 6,  -1, 8, 9, 10};
  const std::vector<int64_t> nat = {2, 1, 1};
  std::vector<std::vector<Token>> toks(3);
  Batch b{d};
  b.varlen = false;  // 3 sequences of 4 tokens
  for (auto& t : toks) {
    for (int i = 0; i < 4; ++i) t.push_back(random_token(d, rng));
    b.add(t);
  }
  const std::vector<unsigned char> before = pool.bytes;
  Pool old = pool;
  KdaRecurrentArgs a = b.recurrent(&gp);
  std::vector<int64_t> idx_c = idx, nat_c = nat;
  a.initial_state = pool.view();
  a.state_indices = TensorView::contiguous(idx_c.data(), DType::kInt64, {3, 4});
  a.num_accepted_tokens = TensorView::contiguous(nat_c.data(), DType::kInt64, {3});
  ASSERT_TRUE(run(a, kRecOpts));
  const std::vector<int64_t> start = {1, 4, -1};
  for (int64_t n = 0; n < 3; ++n) {
    SCOPED_TRACE("sequence " + std::to_string(n));
    if (start[size_t(n)] < 0) {
      for (double x : b.o_rows(n)) EXPECT_EQ(x, 0.0);
      continue;
    }
    std::vector<double> o_ref, fin_ref;
    forward_one(d, gp, toks[size_t(n)], old.slot(start[size_t(n)]), &o_ref, &fin_ref);
    EXPECT_EQ(b.o_rows(n), o_ref);
    for (int t = 0; t < 4; ++t) {
      const int64_t s = idx[size_t(n * 4 + t)];
      if (s < 0) continue;
      std::vector<Token> prefix(toks[size_t(n)].begin(), toks[size_t(n)].begin() + t + 1);
      std::vector<double> o_p, fin_p;
      forward_one(d, gp, prefix, old.slot(start[size_t(n)]), &o_p, &fin_p);
      EXPECT_EQ(pool.slot(s), pool.rounded(fin_p)) << "token " << t;
    }
  }
  for (int64_t s : {7, 8, 9, 10, 11}) EXPECT_TRUE(pool.slot_equals(before, s)) << "slot " << s;

  // A 1-D index with several tokens per sequence (varlen, one empty): the final state, written once.
  Pool p2(d, 4, DType::kFP64, rng);
  const std::vector<unsigned char> before2 = p2.bytes;
  Batch c{d};
  c.add(toks[0]);
  c.add({});
  c.add({toks[1][0], toks[1][1]});
  std::vector<int64_t> idx1 = {3, 0, 1};
  KdaRecurrentArgs a1 = c.recurrent(&gp);
  a1.initial_state = p2.view();
  a1.state_indices = TensorView::contiguous(idx1.data(), DType::kInt64, {3});
  ASSERT_TRUE(run(a1, kRecOpts));
  Pool old2 = p2;
  old2.bytes = before2;
  std::vector<double> o_ref, fin_ref;
  forward_one(d, gp, toks[0], old2.slot(3), &o_ref, &fin_ref);
  EXPECT_EQ(c.o_rows(0), o_ref);
  EXPECT_EQ(p2.slot(3), fin_ref);
  forward_one(d, gp, {toks[1][0], toks[1][1]}, old2.slot(1), &o_ref, &fin_ref);
  EXPECT_EQ(c.o_rows(2), o_ref);
  EXPECT_EQ(p2.slot(1), fin_ref);
  EXPECT_TRUE(p2.slot_equals(before2, 0));  // the empty sequence's slot: nothing read or written
  EXPECT_TRUE(p2.slot_equals(before2, 2));
}

// The chunked prefill on the pool: varlen prompts from their slots, final states back in place; an empty
// prompt and a padding sequence leave their slots alone.
TEST(KdaPoolForwardCpu, PrefillEqualsTheForward) {
  const ServingDims d;
  for (DType dt : {DType::kFP32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    std::mt19937_64 rng(31);
    GateParams gp(d, rng);
    Pool pool(d, 6, dt, rng);
    const std::vector<int64_t> lens = {5, 0, 70, 3, 64};
    std::vector<int64_t> slots = {3, 1, -1, 0, 5};
    std::vector<std::vector<Token>> toks;
    Batch b{d};
    for (size_t n = 0; n < lens.size(); ++n) {
      toks.emplace_back();
      for (int64_t t = 0; t < lens[n]; ++t) toks.back().push_back(random_token(d, rng, slots[n] < 0));
      b.add(toks.back());
    }
    const std::vector<unsigned char> before = pool.bytes;
    Pool old = pool;
    KdaPoolForwardArgs a;
    a.fwd = b.forward(&gp);
    a.pool = pool.view();
    a.state_indices = TensorView::contiguous(slots.data(), DType::kInt64, {int64_t(slots.size())});
    EXPECT_EQ(workspace_bytes(a, kFwdOpts), 0u);
    const Status st = run(a, kFwdOpts);
    ASSERT_TRUE(st) << st.to_string();
    for (size_t n = 0; n < lens.size(); ++n) {
      if (slots[n] < 0) {
        for (double x : b.o_rows(int64_t(n))) EXPECT_EQ(x, 0.0);
        continue;
      }
      if (lens[n] == 0) continue;
      std::vector<double> o_ref, fin_ref;
      forward_one(d, gp, toks[n], old.slot(slots[n]), &o_ref, &fin_ref);
      EXPECT_EQ(b.o_rows(int64_t(n)), o_ref) << n;
      EXPECT_EQ(pool.slot(slots[n]), pool.rounded(fin_ref)) << n;
    }
    for (int64_t s : {1, 2, 4}) EXPECT_TRUE(pool.slot_equals(before, s)) << "slot " << s;
  }
}

// On CUDA tensors both operations validate; the recurrent step runs the CUDA decode kernel, the prefill on
// the pool the CUDA forward with the pool (a build without CUDA refuses both; here the views point at fp64
// host memory: refused before any launch; host-memory indices refused by name). The GPU behaviour:
// test_kda_serving_gpu.cpp, test_kda_pool_prefill_gpu.cpp.
TEST(KdaServingCpu, CudaTensorsOfThePrefillRefused) {
  const ServingDims d;
  std::mt19937_64 rng(41);
  GateParams gp(d, rng);
  Batch b{d};
  b.varlen = false;
  b.add({random_token(d, rng)});
  b.add({random_token(d, rng)});
  Pool pool(d, 4, DType::kFP32, rng);
  std::vector<int64_t> idx = {2, 0};
  auto on_cuda = [](TensorView& t) {
    if (t.defined()) t.device = Device{DeviceType::kCUDA, 0};
  };
  KdaRecurrentArgs a = b.recurrent(&gp);
  a.initial_state = pool.view();
  a.state_indices = TensorView::contiguous(idx.data(), DType::kInt64, {2});
  for (TensorView* t : {&a.q, &a.k, &a.v, &a.g, &a.beta, &a.A_log, &a.dt_bias, &a.initial_state, &a.state_indices, &a.o}) on_cuda(*t);
  EXPECT_TRUE(validate(a, kRecOpts));
  const std::vector<unsigned char> before = pool.bytes;
  Status st = run(a, kRecOpts);
#ifdef ENCORE_WITH_CUDA
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("q: dtype must be one of {bf16, fp16, fp32}"), std::string::npos) << st.message();
#else
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("kda_recurrent: on cuda:0 tensors, but encore was built without CUDA"), std::string::npos) << st.message();
#endif
  EXPECT_EQ(pool.bytes, before);

  KdaPoolForwardArgs pf;
  pf.fwd = b.forward(&gp);
  pf.pool = pool.view();
  pf.state_indices = TensorView::contiguous(idx.data(), DType::kInt64, {2});
  for (TensorView* t : {&pf.fwd.q, &pf.fwd.k, &pf.fwd.v, &pf.fwd.g, &pf.fwd.beta, &pf.fwd.A_log, &pf.fwd.dt_bias, &pf.fwd.o, &pf.pool})
    on_cuda(*t);
  EXPECT_TRUE(validate(pf, kFwdOpts));
  st = run(pf, kFwdOpts);
#ifdef ENCORE_WITH_CUDA
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("state_indices: in host memory, but q is on cuda:0"), std::string::npos) << st.message();
  on_cuda(pf.state_indices);
  st = run(pf, kFwdOpts);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("q: dtype must be one of {bf16, fp16, fp32}"), std::string::npos) << st.message();
#else
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("kda_forward_pool: on cuda:0 tensors, but encore was built without CUDA"), std::string::npos) << st.message();
#endif
  EXPECT_EQ(pool.bytes, before);
  // An index tensor on another device is named.
  a.state_indices.device = Device{DeviceType::kCUDA, 1};
  st = validate(a, kRecOpts);
  EXPECT_NE(st.message().find("state_indices: on cuda:1"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace encore::test
