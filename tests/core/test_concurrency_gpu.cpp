// Concurrency on CUDA: 8 host threads on 4 streams run a mix of ops (tests/common/mixed_jobs.hpp:
// hidden sizes the JIT compiles, so the first uses race) in different orders, repeatedly, for a
// bounded number of rounds; every tensor afterwards (outputs, and the inputs, which must be
// unchanged) is bit-identical to the same job run serially on the default stream. Each call's
// tensors are device copies made on its stream; its results are read back on that stream.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>

#include "tests/common/device_buffer.hpp"
#include "tests/common/mixed_jobs.hpp"

namespace encore::test {
namespace {

// Runs `job` with device copies of its tensors on `stream`; the bytes of all its tensors afterwards.
std::vector<unsigned char> run_on_device(const Job& job, cudaStream_t stream, Status* st) {
  std::vector<HostTensor> ts;
  ts.reserve(Job::kMaxTensors);
  std::vector<std::pair<HostTensor*, std::unique_ptr<DeviceBuffer>>> placed;
  JobIo io;
  io.stream = stream;
  io.place = [&](HostTensor& h) {
    auto buf = std::make_unique<DeviceBuffer>(h.storage_bytes());
    cudaMemcpyAsync(buf->ptr, h.bytes.data(), h.storage_bytes(), cudaMemcpyHostToDevice, stream);
    const TensorView v = h.view(buf->ptr, Device{DeviceType::kCUDA, 0});
    placed.emplace_back(&h, std::move(buf));
    return v;
  };
  *st = job.run(io, ts);
  for (auto& [h, buf] : placed) cudaMemcpyAsync(h->bytes.data(), buf->ptr, h->storage_bytes(), cudaMemcpyDeviceToHost, stream);
  if (cudaStreamSynchronize(stream) != cudaSuccess && *st) *st = Status::cuda_error(cudaGetErrorString(cudaGetLastError()));
  std::vector<unsigned char> bytes;
  for (const HostTensor& t : ts) bytes.insert(bytes.end(), t.bytes.begin(), t.bytes.end());
  return bytes;
}

TEST(ConcurrencyGpu, MixedOpsFromEightThreadsOnFourStreamsEqualSerial) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<Job> jobs = mixed_jobs(20261206);
  constexpr int kThreads = 8, kStreams = 4, kRounds = 4;
  cudaStream_t streams[kStreams];
  for (auto& s : streams) ENCORE_ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // The concurrent calls first, so the JIT's first compiles of these shapes race between threads.
  std::vector<std::vector<std::vector<unsigned char>>> got(kThreads);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<size_t> order(jobs.size());
      for (size_t j = 0; j < order.size(); ++j) order[j] = (j * 5 + size_t(t)) % order.size();
      got[t].resize(jobs.size() * kRounds);
      for (int r = 0; r < kRounds; ++r) {
        for (size_t j : order) {
          Status st;
          got[t][r * jobs.size() + j] = run_on_device(jobs[j], streams[t % kStreams], &st);
          if (!st) failures.fetch_add(1);
        }
        std::rotate(order.begin(), order.begin() + 1, order.end());
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(failures.load(), 0);
  int mismatches = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    Status st;
    const std::vector<unsigned char> serial = run_on_device(jobs[j], nullptr, &st);
    ASSERT_TRUE(st) << jobs[j].name << ": " << st.to_string();
    for (int t = 0; t < kThreads; ++t)
      for (int r = 0; r < kRounds; ++r) {
        const bool same = got[t][r * jobs.size() + j] == serial;
        mismatches += !same;
        EXPECT_TRUE(same) << jobs[j].name << ": thread " << t << ", round " << r << " differs from the serial call";
      }
  }
  EXPECT_EQ(mismatches, 0);
  for (auto& s : streams) cudaStreamDestroy(s);
}

}  // namespace
}  // namespace encore::test
