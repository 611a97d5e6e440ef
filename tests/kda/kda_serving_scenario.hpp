// Test helper for KDA serving: the serving scenario, one driver for every backend. One KDA layer serving
// a mix of requests: chunked prefills of different lengths on the pool (a padding sequence with NaN
// inputs and index -1 in each), 64 decode steps of a fixed batch of 6 with continuous batching (requests
// joining and leaving, slots reused, padding rows) and two speculative steps of 4 tokens accepting 1-3.
// After every call every untouched slot keeps its bits; at the end every request's outputs and state are
// compared with the CPU forward (fp64) over its whole sequence.
//
// Every call is built on the host (fp64 views of a Batch, host indices, the host pool); a backend policy
// B makes it (test_kda_serving_scenario_cpu.cpp: directly on the host;
// test_kda_serving_scenario_gpu.cpp: mirrored to the device):
//   static ServingDims dims();                                  the layer's sizes
//   static constexpr bool kStopOnFatalFailure;                  return after a join with a fatal failure
//   static constexpr bool kCheckFinite;                         assert every served output is finite
//   static constexpr const char* kLabel;                        after "[ fp32 pool" in the printed line
//   static void check_errors(DType pool, double o_err, double s_err);  the bounds
//   explicit B(const Pool& pool);                               (a copy of the pool's initial bytes)
//   Token input(Token t);                                       t in the backend's input dtype
//   bool zero(Pool& pool, int64_t s);                           slot s set to zero (false: failed, reported)
//   std::vector<unsigned char> pool_bytes(const Pool& pool);    the bytes of the pool the calls see
//   bool refresh(Pool& pool);                                   after a call: pool.bytes those bytes (false: failed, reported)
//   void call(Batch& b, const KdaPoolForwardArgs& a, const KdaOptions& opts, const CheckedCall& checked);
//   void call(Batch& b, const KdaRecurrentArgs& a, const KdaRecurrentOptions& opts, const CheckedCall& checked);
//     make the call a (a.pool / a.initial_state: the host pool) through checked, b.o then its outputs.
// Needs no CUDA itself.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

inline const KdaRecurrentOptions kRecOpts{0.0, true, true};  // L2 norm, softplus gate with dt_bias
inline const KdaOptions kFwdOpts{0.0, true, true, true};

// Runs a backend's call (a Status-returning function) with the untouched-slot checks around it.
using CheckedCall = std::function<void(const std::function<Status()>&)>;

struct Request {
  std::vector<Token> seq;  // prompt + decoded tokens (in the backend's input dtype)
  int64_t prompt = 0, pos = 0, slot = -1;
  std::vector<double> o;   // served output rows [pos, HV, V]
  bool done = false;
  std::vector<int64_t> spec_row;  // the 4 slots of the speculative steps
  int64_t accepted = 0;
};

template <class B>
class Server {
 public:
  static constexpr int64_t kBatch = 6, kSpec = 4;
  Server(DType pool_dtype, uint64_t seed) : rng_(seed), gp_(d_, rng_), pool_(d_, kBatch * kSpec, pool_dtype, rng_), backend_(pool_) {
    for (int64_t s = pool_.P - 1; s >= 0; --s) free_.push_back(s);
  }
  ServingDims d_ = B::dims();
  std::mt19937_64 rng_;
  GateParams gp_;
  Pool pool_;  // the pool (on the host) or its host image (refreshed after every call)
  B backend_;
  std::vector<int64_t> free_;
  std::vector<Request> reqs_;
  int64_t slot_reuses_ = 0, padding_rows_ = 0;
  std::set<int64_t> ever_used_;

  // A token in the backend's input dtype (the reference then sees the backend's values).
  Token token(bool nan = false) { return backend_.input(random_token(d_, rng_, nan)); }
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
  void checked(const std::set<int64_t>& touched, const std::function<Status()>& f) {
    const std::vector<unsigned char> before = backend_.pool_bytes(pool_);
    const Status st = f();
    ASSERT_TRUE(st) << st.to_string();
    if (!backend_.refresh(pool_)) return;
    for (int64_t s = 0; s < pool_.P; ++s)
      if (!touched.count(s)) ASSERT_TRUE(pool_.slot_equals(before, s)) << "slot " << s << " changed";
  }
  template <class Args, class Opts>
  void call(const std::set<int64_t>& touched, Batch& b, const Args& a, const Opts& opts) {
    backend_.call(b, a, opts, [&](const std::function<Status()>& f) { checked(touched, f); });
  }
  void join(const std::vector<int64_t>& prompts) {
    std::vector<size_t> ids;
    for (int64_t len : prompts) {
      if (int64_t(active().size()) >= kBatch) break;
      Request r;
      r.prompt = len;
      const int64_t total = len + 10 + int64_t(rng_() % 40);
      for (int64_t t = 0; t < total; ++t) r.seq.push_back(token());
      r.slot = take();
      if (!backend_.zero(pool_, r.slot)) return;  // a new request starts from the zero state
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
        b.add({token(true), token(true), token(true)});
        idx.push_back(-1);
        ++padding_rows_;
      }
    }
    KdaPoolForwardArgs a;
    a.fwd = b.forward(&gp_);
    a.pool = pool_.view();
    a.state_indices = TensorView::contiguous(idx.data(), DType::kInt64, {int64_t(idx.size())});
    call(touched, b, a, kFwdOpts);
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
        b.add({token(true)});
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
    call(touched, b, a, kRecOpts);
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
      while (toks.size() < size_t(kSpec)) toks.push_back(token());  // drafts to be rejected
      b.add(toks);
      idx.insert(idx.end(), q.spec_row.begin(), q.spec_row.end());
      touched.insert(q.spec_row.begin(), q.spec_row.end());
      nat.push_back(first ? 1 : q.accepted);
      acc.push_back(a);
    }
    const int64_t N = int64_t(act.size());
    KdaRecurrentArgs a = b.recurrent(&gp_);
    a.initial_state = pool_.view();
    a.state_indices = TensorView::contiguous(idx.data(), DType::kInt64, {N, kSpec});
    if (!first) a.num_accepted_tokens = TensorView::contiguous(nat.data(), DType::kInt64, {N});
    call(touched, b, a, kRecOpts);
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

// The scenario on a pool of `pool_dtype`, then every request's outputs and state against the forward.
template <class B>
void serve_and_compare(DType pool_dtype) {
  using ::testing::Test;
  Server<B> sv(pool_dtype, 2026);
  sv.join({37, 64, 1});
  if (B::kStopOnFatalFailure && Test::HasFatalFailure()) return;
  const std::vector<std::vector<int64_t>> joins = {{65, 5}, {100}, {17, 2}, {130}, {63, 9}, {4}};
  for (int step = 0; step < 64; ++step) {
    sv.leave();
    if (step % 9 == 4 && step / 9 < int(joins.size()) && step != 22) sv.join(joins[size_t(step / 9)]);
    if (B::kStopOnFatalFailure && Test::HasFatalFailure()) return;
    if (step == 20) sv.spec(true);
    else if (step == 21) sv.spec(false);
    else sv.decode();
    if (Test::HasFatalFailure()) return;
  }
  // Every request's outputs so far and its state against the CPU forward (fp64) over its served tokens
  // from zero.
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
    if (B::kCheckFinite)
      for (double x : r.o) ASSERT_TRUE(std::isfinite(x));
    o_err = std::max(o_err, rel_err(r.o, b.o));
    if (!r.done) s_err = std::max(s_err, rel_err(sv.pool_.slot(r.slot), fin));
    served += r.pos;
    finished += r.done;
  }
  B::check_errors(pool_dtype, o_err, s_err);
  EXPECT_GE(sv.reqs_.size(), 10u);
  EXPECT_GT(finished, 3);
  EXPECT_GT(sv.slot_reuses_, 3);
  EXPECT_GT(sv.padding_rows_, 10);
  Test::RecordProperty("o_rel_rms", std::to_string(o_err));
  Test::RecordProperty("state_rel_rms", std::to_string(s_err));
  std::printf("[ %s pool%s ] %zu requests, %lld tokens served, %lld finished, %lld slot reuses: o %.2e, state %.2e relative RMS\n",
              dtype_name(pool_dtype), B::kLabel, sv.reqs_.size(), (long long)served, (long long)finished, (long long)sv.slot_reuses_,
              o_err, s_err);
}

}  // namespace encore::test
