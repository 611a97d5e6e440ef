// KDA serving on CUDA tensors: the scenario of test_kda_serving_scenario_cpu.cpp with the pool, the inputs
// and the outputs in device memory (bf16 inputs and o, int32 / int64 device indices): one KDA layer (K = V
// = 128, HV = 2H, softplus gate with dt_bias, L2 norm) serving requests: chunked prefills of 1 to 130
// tokens on the pool (the CUDA forward reading and writing the slots in place, a padding sequence with
// NaN inputs in each), 64 decode steps of a fixed batch of 6 with continuous batching (the decode
// kernel; padding rows, requests joining and leaving, slots reused) and two speculative steps of 4
// tokens accepting 1-3. After every call every untouched slot keeps its bits; at the end every request's
// outputs and state are compared with the CPU forward (fp64) over its whole sequence, fp32 and bf16 pools.
#include <cuda_runtime.h>
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
#include "tests/common/device_buffer.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/kda/kda_serving_case.hpp"
#include "tests/kda/kda_serving_device.hpp"

namespace encore::test {
namespace {

const KdaRecurrentOptions kRecOpts{0.0, true, true};  // L2 norm, softplus gate with dt_bias
const KdaOptions kFwdOpts{0.0, true, true, true};
const DType kIn = DType::kBF16;  // q, k, v, g, beta and o on the device

struct Request {
  std::vector<Token> seq;  // prompt + decoded tokens (bf16 values)
  int64_t prompt = 0, pos = 0, slot = -1;
  std::vector<double> o;   // served output rows [pos, HV, V]
  bool done = false;
  std::vector<int64_t> spec_row;  // the 4 slots of the speculative steps
  int64_t accepted = 0;
};

class Server {
 public:
  static constexpr int64_t kBatch = 6, kSpec = 4;
  Server(DType pool_dtype, uint64_t seed)
      : rng_(seed), gp_(d_, rng_), pool_(d_, kBatch * kSpec, pool_dtype, rng_), dpool_(pool_.bytes.size()) {
    for (int64_t s = pool_.P - 1; s >= 0; --s) free_.push_back(s);
    cudaMemcpy(dpool_.ptr, pool_.bytes.data(), pool_.bytes.size(), cudaMemcpyHostToDevice);
  }
  ServingDims d_{2, 4, 128, 128};
  std::mt19937_64 rng_;
  GateParams gp_;
  Pool pool_;           // the host image of the device pool (refreshed after every call)
  DeviceBuffer dpool_;  // the pool [P, HV, K, V] on the device
  std::vector<int64_t> free_;
  std::vector<Request> reqs_;
  int64_t slot_reuses_ = 0, padding_rows_ = 0;
  std::set<int64_t> ever_used_;

  TensorView pool_view() { return TensorView::contiguous(dpool_.ptr, pool_.dtype, {pool_.P, d_.HV, d_.K, d_.V}, kCuda); }
  // A token in the device's input dtype (the reference then sees the device's values).
  Token token(bool nan = false) {
    Token t = random_token(d_, rng_, nan);
    unsigned char b[2];
    for (auto* x : {&t.q, &t.k, &t.v, &t.g, &t.beta})
      for (double& e : *x) store_from_double(b, kIn, 0, e), e = load_as_double(b, kIn, 0);
    return t;
  }
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
  // A device call that may write `touched` only: every other slot keeps its bytes.
  void call(const std::set<int64_t>& touched, const std::function<Status()>& f) {
    const std::vector<unsigned char> before = fetch_bytes(pool_view());
    const Status st = f();
    ASSERT_TRUE(st) << st.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    pool_.bytes = fetch_bytes(pool_view());
    for (int64_t s = 0; s < pool_.P; ++s)
      if (!touched.count(s)) ASSERT_TRUE(pool_.slot_equals(before, s)) << "slot " << s << " changed";
  }
  // The device inputs of a host batch (o poisoned) in `ar`.
  KdaForwardArgs device_inputs(KdaForwardArgs h, DeviceArena& ar) {
    KdaForwardArgs d;
    d.q = ar.mirror(h.q, kIn), d.k = ar.mirror(h.k, kIn), d.v = ar.mirror(h.v, kIn), d.g = ar.mirror(h.g, kIn), d.beta = ar.mirror(h.beta, kIn);
    d.A_log = ar.mirror(h.A_log, DType::kFP32), d.dt_bias = ar.mirror(h.dt_bias, DType::kFP32);
    d.cu_seqlens = h.cu_seqlens;
    d.o = ar.mirror(h.o, kIn, /*poison=*/true);
    return d;
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
      // A new request starts from the zero state (the engine zeroes its slot).
      ENCORE_ASSERT_CUDA(cudaMemset(dpool_.at(size_t(r.slot) * pool_.slot_bytes()), 0, pool_.slot_bytes()));
      pool_.zero(r.slot);
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
    DeviceArena ar;
    KdaPoolForwardArgs a;
    a.fwd = device_inputs(b.forward(&gp_), ar);
    a.pool = pool_view();
    a.state_indices = ar.mirror(TensorView::contiguous(idx.data(), DType::kInt64, {int64_t(idx.size())}), DType::kInt64);
    void* ws = ar.bytes(workspace_bytes(a, kFwdOpts));
    call(touched, [&] { return run(a, kFwdOpts, ws); });
    b.o = fetch(a.fwd.o);
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
        if (r.spec_row.empty()) r.spec_row = {r.slot};
        for (int64_t s : r.spec_row) free_.insert(free_.begin(), s);  // reused last-freed-last: every slot gets used
        r.spec_row.clear();
        r.slot = -1;
      }
  }
  KdaRecurrentArgs device_step(Batch& b, DeviceArena& ar) {
    const KdaForwardArgs f = device_inputs(b.forward(&gp_), ar);
    KdaRecurrentArgs a;
    a.q = f.q, a.k = f.k, a.v = f.v, a.g = f.g, a.beta = f.beta, a.A_log = f.A_log, a.dt_bias = f.dt_bias, a.cu_seqlens = f.cu_seqlens;
    a.o = f.o;
    a.initial_state = pool_view();
    return a;
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
    DeviceArena ar;
    KdaRecurrentArgs a = device_step(b, ar);
    a.state_indices = ar.mirror(TensorView::contiguous(idx.data(), DType::kInt32, {kBatch}), DType::kInt32);
    call(touched, [&] { return run(a, kRecOpts); });
    b.o = fetch(a.o);
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
    DeviceArena ar;
    KdaRecurrentArgs a = device_step(b, ar);
    const int64_t N = int64_t(act.size());
    a.state_indices = ar.mirror(TensorView::contiguous(idx.data(), DType::kInt64, {N, kSpec}), DType::kInt64);
    if (!first) a.num_accepted_tokens = ar.mirror(TensorView::contiguous(nat.data(), DType::kInt64, {N}), DType::kInt64);
    call(touched, [&] { return run(a, kRecOpts); });
    b.o = fetch(a.o);
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

class KdaServingScenarioGpu : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(KdaServingScenarioGpu, EqualsTheForwardOverEachWholeSequence) {
  Server sv(GetParam(), 2026);
  sv.join({37, 64, 1});
  if (HasFatalFailure()) return;
  const std::vector<std::vector<int64_t>> joins = {{65, 5}, {100}, {17, 2}, {130}, {63, 9}, {4}};
  for (int step = 0; step < 64; ++step) {
    sv.leave();
    if (step % 9 == 4 && step / 9 < int(joins.size()) && step != 22) sv.join(joins[size_t(step / 9)]);
    if (HasFatalFailure()) return;
    if (step == 20) sv.spec(true);
    else if (step == 21) sv.spec(false);
    else sv.decode();
    if (HasFatalFailure()) return;
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
    for (double x : r.o) ASSERT_TRUE(std::isfinite(x));
    o_err = std::max(o_err, rel_err(r.o, b.o));
    if (!r.done) s_err = std::max(s_err, rel_err(sv.pool_.slot(r.slot), fin));
    served += r.pos;
    finished += r.done;
  }
  EXPECT_LE(o_err, 5e-3);
  EXPECT_LE(s_err, 5e-3);
  EXPECT_GE(sv.reqs_.size(), 10u);
  EXPECT_GT(finished, 3);
  EXPECT_GT(sv.slot_reuses_, 3);
  EXPECT_GT(sv.padding_rows_, 10);
  RecordProperty("o_rel_rms", std::to_string(o_err));
  RecordProperty("state_rel_rms", std::to_string(s_err));
  std::printf("[ %s pool, CUDA ] %zu requests, %lld tokens served, %lld finished, %lld slot reuses: o %.2e, state %.2e relative RMS\n",
              dtype_name(GetParam()), sv.reqs_.size(), (long long)served, (long long)finished, (long long)sv.slot_reuses_, o_err, s_err);
}

INSTANTIATE_TEST_SUITE_P(Pools, KdaServingScenarioGpu, ::testing::Values(DType::kFP32, DType::kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace encore::test
