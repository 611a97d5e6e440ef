// KDA serving on the CPU backend: one KDA layer serving a mix of requests (chunked prefills of different
// lengths on the pool, 64 decode steps with continuous batching: requests joining and leaving, slots
// reused, padding rows; a speculative step of 4 tokens accepting 1-3, twice), every request's outputs and
// state equal to the forward over its whole sequence, fp32 and bf16 pools; and the refusals of bad input,
// with nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "encore/kda.hpp"
#include "encore/kda_serving.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/kda/kda_serving_case.hpp"

namespace encore::test {
namespace {

const KdaRecurrentOptions kRecOpts{0.0, true, true};  // L2 norm, softplus gate with dt_bias
const KdaOptions kFwdOpts{0.0, true, true, true};

struct Request {
  std::vector<Token> seq;  // prompt + decoded tokens
  int64_t prompt = 0, pos = 0, slot = -1;
  std::vector<double> o;   // served output rows [pos, HV, V]
  bool done = false;
  std::vector<int64_t> spec_row;  // the 4 slots of the speculative steps
  int64_t accepted = 0;
};

class Server {
 public:
  static constexpr int64_t kBatch = 6, kSpec = 4;
  Server(DType pool_dtype, uint64_t seed) : rng_(seed), gp_(d_, rng_), pool_(d_, kBatch * kSpec, pool_dtype, rng_) {
    for (int64_t s = pool_.P - 1; s >= 0; --s) free_.push_back(s);
  }
  ServingDims d_;
  std::mt19937_64 rng_;
  GateParams gp_;
  Pool pool_;
  std::vector<int64_t> free_;
  std::vector<Request> reqs_;
  int64_t slot_reuses_ = 0, padding_rows_ = 0;
  std::set<int64_t> ever_used_;

  int64_t take() {
    const int64_t s = free_.back();
    free_.pop_back();
    if (!ever_used_.insert(s).second) ++slot_reuses_;
    return s;
  }
  std::vector<size_t> active() const {
    std::vector<size_t> a;
    for (size_t r = 0; r < reqs_.size(); ++r)
      if (!reqs_[r].done) a.push_back(r);
    return a;
  }
  // A call that may write `touched` only: every other slot keeps its bytes.
  void call(const std::set<int64_t>& touched, const std::function<Status()>& f) {
    const std::vector<unsigned char> before = pool_.bytes;
    const Status st = f();
    ASSERT_TRUE(st) << st.to_string();
    for (int64_t s = 0; s < pool_.P; ++s)
      if (!touched.count(s)) ASSERT_TRUE(pool_.slot_equals(before, s)) << "slot " << s << " changed";
  }
  void join(const std::vector<int64_t>& prompts) {
    std::vector<size_t> ids;
    for (int64_t len : prompts) {
      if (int64_t(active().size()) >= kBatch) break;
      Request r;
      r.prompt = len;
      const int64_t total = len + 10 + int64_t(rng_() % 40);
      for (int64_t t = 0; t < total; ++t) r.seq.push_back(random_token(d_, rng_));
      r.slot = take();
      pool_.zero(r.slot);  // a new request starts from the zero state
      reqs_.push_back(r);
      ids.push_back(reqs_.size() - 1);
    }
    if (ids.empty()) return;
    // One prefill call for the joiners, with a padding sequence (NaN inputs, index -1) among them.
    Batch b{d_};
    std::vector<int64_t> idx;
    std::set<int64_t> touched;
    for (size_t i = 0; i < ids.size(); ++i) {
      Request& r = reqs_[ids[i]];
      b.add({r.seq.begin(), r.seq.begin() + r.prompt});
      idx.push_back(r.slot);
      touched.insert(r.slot);
      if (i == 0) {
        b.add({random_token(d_, rng_, true), random_token(d_, rng_, true), random_token(d_, rng_, true)});
        idx.push_back(-1);
        ++padding_rows_;
      }
    }
    KdaPoolForwardArgs a;
    a.fwd = b.forward(&gp_);
    a.pool = pool_.view();
    a.state_indices = TensorView::contiguous(idx.data(), DType::kInt64, {int64_t(idx.size())});
    call(touched, [&] { return run(a, kFwdOpts); });
    for (size_t i = 0, n = 0; i < ids.size(); ++i, ++n) {
      Request& r = reqs_[ids[i]];
      const std::vector<double> rows = b.o_rows(int64_t(n));
      r.o.insert(r.o.end(), rows.begin(), rows.end());
      r.pos = r.prompt;
      if (i == 0) {
        for (double x : b.o_rows(int64_t(++n))) ASSERT_EQ(x, 0.0);  // the padding sequence's rows
      }
    }
  }
  void leave() {
    for (Request& r : reqs_)
      if (!r.done && r.pos == int64_t(r.seq.size())) {
        r.done = true;
        if (r.spec_row.empty()) r.spec_row = {r.slot};  // (a request that finished inside the speculative steps frees all 4)
        for (int64_t s : r.spec_row) free_.insert(free_.begin(), s);  // reused last-freed-last: every slot gets used
        r.spec_row.clear();
        r.slot = -1;
      }
  }
  // One decode step: a fixed batch of kBatch rows (a CUDA-graph shape), the active requests at shuffled
  // rows, the others padding (index -1, NaN inputs).
  void decode() {
    std::vector<size_t> act = active();
    std::vector<int64_t> row_of(size_t(kBatch), -1);
    std::vector<size_t> rows(static_cast<size_t>(kBatch));
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = i;
    std::shuffle(rows.begin(), rows.end(), rng_);
    for (size_t i = 0; i < act.size(); ++i) row_of[rows[i]] = int64_t(act[i]);
    Batch b{d_};
    b.varlen = false;
    std::vector<int32_t> idx;  // int32, as engines pass them
    std::set<int64_t> touched;
    for (int64_t row = 0; row < kBatch; ++row) {
      const int64_t r = row_of[size_t(row)];
      if (r < 0) {
        b.add({random_token(d_, rng_, true)});
        idx.push_back(-1);
        ++padding_rows_;
      } else {
        b.add({reqs_[size_t(r)].seq[size_t(reqs_[size_t(r)].pos)]});
        idx.push_back(int32_t(reqs_[size_t(r)].slot));
        touched.insert(reqs_[size_t(r)].slot);
      }
    }
    KdaRecurrentArgs a = b.recurrent(&gp_);
    a.initial_state = pool_.view();
    a.state_indices = TensorView::contiguous(idx.data(), DType::kInt32, {kBatch});
    call(touched, [&] { return run(a, kRecOpts); });
    for (int64_t row = 0; row < kBatch; ++row) {
      const std::vector<double> o = b.o_rows(row);
      const int64_t r = row_of[size_t(row)];
      if (r < 0) {
        for (double x : o) ASSERT_EQ(x, 0.0);
        continue;
      }
      reqs_[size_t(r)].o.insert(reqs_[size_t(r)].o.end(), o.begin(), o.end());
      ++reqs_[size_t(r)].pos;
    }
  }
  // A speculative step: every active request runs 4 tokens (its next accepted ones, 1-3, then rejected
  // drafts) over its 4 slots [N, 4]; the first step starts from column 0 (the request's slot), the second
  // from column num_accepted_tokens - 1 of the first. After the second the accepted column is its slot.
  void spec(bool first) {
    const std::vector<size_t> act = active();
    Batch b{d_};
    b.varlen = false;
    std::vector<int64_t> idx, nat;
    std::set<int64_t> touched;
    std::vector<int64_t> acc;
    for (size_t r : act) {
      Request& q = reqs_[r];
      if (first) q.spec_row = {q.slot, take(), take(), take()};
      const int64_t left = int64_t(q.seq.size()) - q.pos;
      const int64_t a = std::min<int64_t>(1 + int64_t(rng_() % 3), left);
      std::vector<Token> toks(q.seq.begin() + q.pos, q.seq.begin() + q.pos + a);
      while (toks.size() < size_t(kSpec)) toks.push_back(random_token(d_, rng_));  // drafts to be rejected
      b.add(toks);
      idx.insert(idx.end(), q.spec_row.begin(), q.spec_row.end());
      touched.insert(q.spec_row.begin(), q.spec_row.end());
      nat.push_back(first ? 1 : q.accepted);
      acc.push_back(a);
    }
    KdaRecurrentArgs a = b.recurrent(&gp_);
    a.initial_state = pool_.view();
    a.state_indices = TensorView::contiguous(idx.data(), DType::kInt64, {int64_t(act.size()), kSpec});
    if (!first) a.num_accepted_tokens = TensorView::contiguous(nat.data(), DType::kInt64, {int64_t(act.size())});
    call(touched, [&] { return run(a, kRecOpts); });
    for (size_t i = 0; i < act.size(); ++i) {
      Request& q = reqs_[act[i]];
      const std::vector<double> o = b.o_rows(int64_t(i));
      q.o.insert(q.o.end(), o.begin(), o.begin() + acc[i] * d_.HV * d_.V);
      q.pos += acc[i];
      q.accepted = acc[i];
      if (!first) {  // the state after the last accepted token is the request's slot; the other three are freed
        q.slot = q.spec_row[size_t(q.accepted - 1)];
        for (int64_t s : q.spec_row)
          if (s != q.slot) free_.push_back(s);
        q.spec_row.clear();
      }
    }
  }
};

class KdaServingScenario : public ::testing::TestWithParam<DType> {};

TEST_P(KdaServingScenario, EqualsTheForwardOverEachWholeSequence) {
  Server sv(GetParam(), 2026);
  sv.join({37, 64, 1});
  const std::vector<std::vector<int64_t>> joins = {{65, 5}, {100}, {17, 2}, {130}, {63, 9}, {4}};
  for (int step = 0; step < 64; ++step) {
    sv.leave();
    if (step % 9 == 4 && step / 9 < int(joins.size()) && step != 22) sv.join(joins[size_t(step / 9)]);
    if (step == 20) sv.spec(true);
    else if (step == 21) sv.spec(false);
    else sv.decode();
    if (HasFatalFailure()) return;
  }
  // Every request's outputs so far and its state against the forward over its served tokens from zero.
  double o_err = 0, s_err = 0;
  int64_t served = 0, finished = 0;
  for (Request& r : sv.reqs_) {
    std::vector<Token> toks(r.seq.begin(), r.seq.begin() + r.pos);
    Batch b{sv.d_};
    b.add(toks);
    KdaForwardArgs f = b.forward(&sv.gp_);
    std::vector<double> fin(size_t(sv.d_.HV * sv.d_.K * sv.d_.V));
    f.final_state = TensorView::contiguous(fin.data(), DType::kFP64, {1, sv.d_.HV, sv.d_.K, sv.d_.V});
    ASSERT_TRUE(run(f, kFwdOpts));
    ASSERT_EQ(r.o.size(), b.o.size());
    o_err = std::max(o_err, rel_err(r.o, b.o));
    if (!r.done) s_err = std::max(s_err, rel_err(sv.pool_.slot(r.slot), fin));
    served += r.pos;
    finished += r.done;
  }
  const double bound = GetParam() == DType::kFP32 ? 1e-5 : 5e-3;
  EXPECT_LT(o_err, bound);
  EXPECT_LT(s_err, bound);
  EXPECT_GE(sv.reqs_.size(), 10u);
  EXPECT_GT(finished, 3);
  EXPECT_GT(sv.slot_reuses_, 3);
  EXPECT_GT(sv.padding_rows_, 10);
  RecordProperty("o_rel_rms", std::to_string(o_err));
  RecordProperty("state_rel_rms", std::to_string(s_err));
  std::printf("[ %s pool ] %zu requests, %lld tokens served, %lld finished, %lld slot reuses: o %.2e, state %.2e relative RMS\n",
              dtype_name(GetParam()), sv.reqs_.size(), (long long)served, (long long)finished, (long long)sv.slot_reuses_, o_err, s_err);
}

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
