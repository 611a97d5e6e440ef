// Concurrency on the CPU backend: 8 host threads run a mix of ops (tests/common/mixed_jobs.hpp) in
// different orders, repeatedly; every tensor afterwards (outputs and the inputs, which must be
// unchanged) is bit-identical to the same job run serially.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "tests/common/mixed_jobs.hpp"

namespace encore::test {
namespace {

// Runs `job` on host views; the bytes of all its tensors afterwards (outputs poisoned first).
std::vector<unsigned char> run_on_host(const Job& job, Status* st) {
  std::vector<HostTensor> ts;
  ts.reserve(Job::kMaxTensors);
  JobIo io;
  io.place = [](HostTensor& h) { return h.view(); };
  *st = job.run(io, ts);
  std::vector<unsigned char> bytes;
  for (const HostTensor& t : ts) bytes.insert(bytes.end(), t.bytes.begin(), t.bytes.end());
  return bytes;
}

TEST(ConcurrencyCpu, MixedOpsFromEightThreadsEqualSerial) {
  const std::vector<Job> jobs = mixed_jobs(20261206);
  std::vector<std::vector<unsigned char>> serial(jobs.size());
  for (size_t j = 0; j < jobs.size(); ++j) {
    Status st;
    serial[j] = run_on_host(jobs[j], &st);
    ASSERT_TRUE(st) << jobs[j].name << ": " << st.to_string();
  }
  constexpr int kThreads = 8, kRounds = 3;
  std::atomic<int> mismatches{0}, failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<size_t> order(jobs.size());
      for (size_t j = 0; j < order.size(); ++j) order[j] = (j * 5 + size_t(t)) % order.size();  // a different order per thread
      for (int r = 0; r < kRounds; ++r) {
        for (size_t j : order) {
          Status st;
          const std::vector<unsigned char> got = run_on_host(jobs[j], &st);
          if (!st) failures.fetch_add(1);
          else if (got != serial[j]) mismatches.fetch_add(1);
        }
        std::rotate(order.begin(), order.begin() + 1, order.end());
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(mismatches.load(), 0) << "results of concurrent calls differ from the serial ones";
}

}  // namespace
}  // namespace encore::test
