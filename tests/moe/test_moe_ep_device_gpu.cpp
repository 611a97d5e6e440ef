// The CUDA EP all-to-all (src/moe/ep_device.hpp, cuda/ep_kernels.cu) on one GPU, every rank's memory
// on it and every rank's kernels on their own stream, against the CPU emulation of the same protocol
// (reference/ep_emulation.hpp) run on the same inputs: world 2 and 4, bf16, fp32 with 12 scale bytes and
// fp16 with 4 (combined into fp32, bf16 and fp16),
// ranks with 0 tokens and at max_tokens, experts nobody picks. Identity experts (expert_out = the
// received rows), so the combine sums each token's own row with its weights: received counts, offsets,
// origins, rows and scales, and the combined output, all bit-equal to the emulation's; three rounds on
// the same buffers (the second repeating the first bit for bit, the third with other token counts). A
// rank that never dispatches makes its peer time out with a diagnostic (no hang); a bad expert id on one
// rank fails every rank, naming it. Then two processes on the GPU through the IPC group (peer memory
// exported as file descriptors), each checking its rank against the emulation.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "encore/quant.hpp"
#include "moe/ep_device.hpp"
#include "moe/reference/ep_emulation.hpp"
#include "testing/host_tensor.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {
namespace {

using namespace encore::moe::ep;
using Bytes = std::vector<uint8_t>;

TensorView mat(const void* p, DType t, int64_t r, int64_t c, Device d = {}) {
  return TensorView::contiguous(const_cast<void*>(p), t, {r, c}, d);
}
const Device kGpu{DeviceType::kCUDA, 0};

template <class T>
std::vector<T> fetch(const T* dev, size_t n) {
  std::vector<T> h(n);
  if (n) EXPECT_EQ(cudaMemcpy(h.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

struct RankInput {
  Bytes x, scales, w;          // [m, H] dtype, [m, sb], [m, k] fp32
  std::vector<int32_t> ids;    // [m, k], distinct per token
};

RankInput make_input(const EpConfig& c, int64_t m, const std::vector<int>& dead, std::mt19937_64& rng) {
  RankInput in;
  in.x.resize(size_t(m * c.hidden) * dtype_size(c.dtype));
  std::normal_distribution<double> nd(0.0, 1.0);
  for (int64_t i = 0; i < m * c.hidden; ++i)
    if (c.dtype == DType::kFP8E4M3) in.x[size_t(i)] = float_to_e4m3(float(nd(rng)));
    else store_from_double(in.x.data(), c.dtype, i, nd(rng));
  in.scales.resize(size_t(m * c.scale_bytes));
  for (auto& b : in.scales) b = uint8_t(rng());
  in.w.resize(size_t(m * c.top_k) * 4);
  std::vector<int> live;
  for (int e = 0; e < c.num_experts; ++e)
    if (std::find(dead.begin(), dead.end(), e) == dead.end()) live.push_back(e);
  for (int64_t t = 0; t < m; ++t) {
    std::shuffle(live.begin(), live.end(), rng);
    for (int j = 0; j < c.top_k; ++j) {
      in.ids.push_back(live[size_t(j)]);
      const float wt = float(0.1 + 0.9 * std::uniform_real_distribution<double>(0, 1)(rng));
      std::memcpy(in.w.data() + size_t(t * c.top_k + j) * 4, &wt, 4);
    }
  }
  return in;
}

// The identity experts' outputs: the received rows in the combine's dtype (fp8 rows: their e4m3 values,
// scales not applied).
Bytes expert_rows(const EpConfig& c, const Bytes& x, int64_t rows) {
  const DType cd = combine_dtype_of(c);
  if (cd == c.dtype) return x;
  Bytes y(size_t(rows * c.hidden) * dtype_size(cd));
  for (int64_t i = 0; i < rows * c.hidden; ++i) store_from_double(y.data(), cd, i, double(e4m3_to_float(x[size_t(i)])));
  return y;
}

// What one rank ends a round with (the emulation's or the device's).
struct RankResult {
  std::vector<int32_t> counts, offsets, src_rank, src_slot;
  Bytes x, scales, out;
};

void run_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> th;
  for (int r = 0; r < world; ++r) th.emplace_back(fn, r);
  for (auto& t : th) t.join();
}

// The emulation: dispatch, identity experts, combine into fp32 out.
std::vector<RankResult> emulate(EpGroup& g, std::vector<std::unique_ptr<EpAllToAll>>& ends, const std::vector<RankInput>& in,
                                DType out_dt = DType::kFP32) {
  const EpConfig& c = g.config();
  std::vector<RankResult> res(size_t(c.world));
  run_ranks(c.world, [&](int r) {
    const RankInput& ri = in[size_t(r)];
    const int64_t m = int64_t(ri.ids.size()) / c.top_k;
    EpReceived recv;
    Status s = ends[size_t(r)]->dispatch(mat(ri.x.data(), c.dtype, m, c.hidden), mat(ri.ids.data(), DType::kInt32, m, c.top_k),
                                         c.scale_bytes ? mat(ri.scales.data(), DType::kUInt8, m, c.scale_bytes) : TensorView{}, &recv);
    EXPECT_TRUE(s) << s.to_string();
    RankResult& o = res[size_t(r)];
    o.counts = recv.counts;
    o.offsets = recv.offsets;
    o.src_rank = recv.src_rank;
    for (int64_t i = 0; i < recv.rows(); ++i) o.src_slot.push_back(recv.src_token[size_t(i)] * c.top_k + recv.src_k[size_t(i)]);
    o.x = recv.x;
    o.scales = recv.scales;
    o.out.resize(size_t(m * c.hidden) * dtype_size(out_dt));
    const Bytes y = expert_rows(c, recv.x, recv.rows());
    s = ends[size_t(r)]->combine(mat(y.data(), combine_dtype_of(c), recv.rows(), c.hidden), mat(ri.w.data(), DType::kFP32, m, c.top_k),
                                 mat(o.out.data(), out_dt, m, c.hidden));
    EXPECT_TRUE(s) << s.to_string();
  });
  return res;
}

// The device: every rank's dispatch enqueued, then every rank's combine (received rows as expert_out).
// The emulated group of c and every rank's end of it.
struct Emulation {
  std::unique_ptr<EpGroup> g;
  std::vector<std::unique_ptr<EpAllToAll>> ends;
  explicit Emulation(const EpConfig& c) {
    EXPECT_TRUE(EpGroup::create(c, &g));
    for (int r = 0; g && r < c.world; ++r) {
      std::unique_ptr<EpAllToAll> a;
      EXPECT_TRUE(EpAllToAll::create(g.get(), r, &a));
      ends.push_back(std::move(a));
    }
  }
};

// Every rank of a one-GPU group (only_rank < 0), or this process's rank of an IPC group (ends of the
// other ranks null: they run in other processes).
struct DeviceRanks {
  std::unique_ptr<EpDeviceGroup> g;
  std::vector<std::unique_ptr<EpDeviceAllToAll>> ends;
  std::vector<cudaStream_t> streams;
  explicit DeviceRanks(const EpConfig& c, int only_rank = -1, const std::string& ipc_name = "", int device = 0) {
    const Status s = only_rank < 0 ? EpDeviceGroup::create_on_one_device(c, device, &g)
                                   : EpDeviceGroup::create_ipc(c, only_rank, device, ipc_name, &g);
    EXPECT_TRUE(s) << s.to_string();
    if (!s) return;
    for (int r = 0; r < c.world; ++r) {
      std::unique_ptr<EpDeviceAllToAll> a;
      if (only_rank >= 0 && r != only_rank) {
        ends.push_back(nullptr);
        streams.push_back(nullptr);
        continue;
      }
      const Status sa = EpDeviceAllToAll::create(g.get(), r, &a);
      EXPECT_TRUE(sa) << sa.to_string();
      ends.push_back(std::move(a));
      cudaStream_t st;
      EXPECT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
      streams.push_back(st);
    }
  }
  ~DeviceRanks() {
    for (cudaStream_t s : streams)
      if (s) cudaStreamDestroy(s);
  }
  void sync() {
    for (cudaStream_t s : streams)
      if (s) EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  }
};

// What a rank's device buffers hold after a round (synchronized): m tokens' out rows of out_dt.
RankResult device_result(const EpDeviceAllToAll& a, const EpConfig& c, const void* out, int64_t m, DType out_dt) {
  const EpDeviceReceived& rv = a.received();
  RankResult o;
  o.counts = fetch(rv.counts, size_t(c.num_experts / c.world));
  o.offsets = fetch(rv.offsets, size_t(c.num_experts / c.world + 1));
  const size_t rows = size_t(o.offsets.back());
  o.src_rank = fetch(rv.src_rank, rows);
  o.src_slot = fetch(rv.src_slot, rows);
  o.x = fetch(rv.x, rows * size_t(c.hidden) * dtype_size(c.dtype));
  o.scales = fetch(rv.scales, rows * size_t(c.scale_bytes));
  o.out = fetch(static_cast<const uint8_t*>(out), size_t(m * c.hidden) * dtype_size(out_dt));
  return o;
}

// split: through dispatch_send / dispatch_recv / combine_send / combine_recv, every rank's send enqueued
// before any rank's receive.
std::vector<RankResult> on_device(DeviceRanks& d, const std::vector<RankInput>& in, DType out_dt = DType::kFP32, bool split = false) {
  const EpConfig& c = d.g->config();
  const int W = c.world, El = c.num_experts / W;
  const Device gd{DeviceType::kCUDA, d.g->device()};
  std::deque<DeviceBuffer> x, ids, sc, w, out;  // deque: DeviceBuffer does not move
  for (int r = 0; r < W; ++r) {
    const RankInput& ri = in[size_t(r)];
    x.emplace_back(ri.x.size() + 16), ids.emplace_back(ri.ids.size() * 4 + 16), sc.emplace_back(ri.scales.size() + 16), w.emplace_back(ri.w.size() + 16);
    const int64_t m = int64_t(ri.ids.size()) / c.top_k;
    out.emplace_back(size_t(m * c.hidden) * dtype_size(out_dt) + 16);
    cudaMemcpy(x.back().ptr, ri.x.data(), ri.x.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(ids.back().ptr, ri.ids.data(), ri.ids.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(sc.back().ptr, ri.scales.data(), ri.scales.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(w.back().ptr, ri.w.data(), ri.w.size(), cudaMemcpyHostToDevice);
    cudaMemset(out.back().ptr, 0xff, size_t(m * c.hidden) * dtype_size(out_dt));  // poisoned: NaN
  }
  cudaDeviceSynchronize();  // the inputs in place before the ranks' non-blocking streams run
  for (int r = 0; r < W; ++r) {
    if (!d.ends[size_t(r)]) continue;
    const int64_t m = int64_t(in[size_t(r)].ids.size()) / c.top_k;
    const TensorView xv = mat(x[size_t(r)].ptr, c.dtype, m, c.hidden, gd), iv = mat(ids[size_t(r)].ptr, DType::kInt32, m, c.top_k, gd);
    const TensorView sv = c.scale_bytes ? mat(sc[size_t(r)].ptr, DType::kUInt8, m, c.scale_bytes, gd) : TensorView{};
    const Status s = split ? d.ends[size_t(r)]->dispatch_send(xv, iv, sv, d.streams[size_t(r)]) : d.ends[size_t(r)]->dispatch(xv, iv, sv, d.streams[size_t(r)]);
    EXPECT_TRUE(s) << s.to_string();
  }
  for (int r = 0; split && r < W; ++r)
    if (d.ends[size_t(r)]) {
      const Status s = d.ends[size_t(r)]->dispatch_recv(d.streams[size_t(r)]);
      EXPECT_TRUE(s) << s.to_string();
    }
  // Expert outputs in another dtype than the rows (fp8 dispatch): converted on the host once every
  // dispatch is done (a dispatch completes without any combine).
  std::deque<DeviceBuffer> y;
  const DType cd = combine_dtype_of(c);
  for (int r = 0; cd != c.dtype && r < W; ++r) {
    if (r == 0) d.sync();
    if (!d.ends[size_t(r)]) {
      y.emplace_back(16);
      continue;
    }
    const EpDeviceReceived& rv = d.ends[size_t(r)]->received();
    const int64_t rows = fetch(rv.offsets, size_t(El + 1)).back();
    const Bytes yr = expert_rows(c, fetch(rv.x, size_t(rows * c.hidden) * dtype_size(c.dtype)), rows);
    y.emplace_back(size_t(rv.max_rows * c.hidden) * dtype_size(cd) + 16);
    if (!yr.empty()) cudaMemcpy(y.back().ptr, yr.data(), yr.size(), cudaMemcpyHostToDevice);
  }
  for (int r = 0; r < W; ++r) {
    if (!d.ends[size_t(r)]) continue;
    const int64_t m = int64_t(in[size_t(r)].ids.size()) / c.top_k;
    const EpDeviceReceived& rv = d.ends[size_t(r)]->received();
    const void* ey = cd != c.dtype ? y[size_t(r)].ptr : static_cast<const void*>(rv.x);
    const TensorView yv = mat(ey, cd, rv.max_rows, c.hidden, gd), wv = mat(w[size_t(r)].ptr, DType::kFP32, m, c.top_k, gd);
    const TensorView ov = mat(out[size_t(r)].ptr, out_dt, m, c.hidden, gd);
    const Status s = split ? d.ends[size_t(r)]->combine_send(yv, d.streams[size_t(r)]) : d.ends[size_t(r)]->combine(yv, wv, ov, d.streams[size_t(r)]);
    EXPECT_TRUE(s) << s.to_string();
  }
  for (int r = 0; split && r < W; ++r)
    if (d.ends[size_t(r)]) {
      const int64_t m = int64_t(in[size_t(r)].ids.size()) / c.top_k;
      const Status s = d.ends[size_t(r)]->combine_recv(mat(w[size_t(r)].ptr, DType::kFP32, m, c.top_k, gd), mat(out[size_t(r)].ptr, out_dt, m, c.hidden, gd),
                                                       d.streams[size_t(r)]);
      EXPECT_TRUE(s) << s.to_string();
    }
  d.sync();
  std::vector<RankResult> res(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) {
    if (!d.ends[size_t(r)]) continue;
    const Status st = d.ends[size_t(r)]->status();
    EXPECT_TRUE(st) << st.to_string();
    res[size_t(r)] = device_result(*d.ends[size_t(r)], c, out[size_t(r)].ptr, int64_t(in[size_t(r)].ids.size()) / c.top_k, out_dt);
  }
  return res;
}

void expect_equal(const std::vector<RankResult>& dev, const std::vector<RankResult>& emu, const std::string& what, int only_rank = -1) {
  for (size_t r = 0; r < emu.size(); ++r) {
    if (only_rank >= 0 && int(r) != only_rank) continue;
    SCOPED_TRACE(what + ", rank " + std::to_string(r));
    EXPECT_EQ(dev[r].counts, emu[r].counts);
    EXPECT_EQ(dev[r].offsets, emu[r].offsets);
    EXPECT_EQ(dev[r].src_rank, emu[r].src_rank);
    EXPECT_EQ(dev[r].src_slot, emu[r].src_slot);
    EXPECT_TRUE(dev[r].x == emu[r].x) << "received rows differ";
    EXPECT_TRUE(dev[r].scales == emu[r].scales) << "received scales differ";
    EXPECT_TRUE(dev[r].out == emu[r].out) << "combined output differs";
  }
}

class MoeEpDeviceGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(MoeEpDeviceGpu, MatchesTheEmulationBitForBit) {
  struct Case {
    EpConfig c;
    std::vector<std::vector<int64_t>> m;  // per round, per rank
    std::vector<int> dead;
    DType out = DType::kFP32;  // the combine's output dtype
  };
  const auto cfg = [](int world, int E, int k, int64_t H, int64_t T, DType dt, int64_t sb) {
    EpConfig c;
    c.world = world, c.num_experts = E, c.top_k = k, c.hidden = H, c.max_tokens = T, c.dtype = dt, c.scale_bytes = sb;
    c.timeout = std::chrono::milliseconds(5000);
    return c;
  };
  const auto fp8 = [](EpConfig c) {
    c.combine_dtype = DType::kBF16;
    return c;
  };
  const Case cases[] = {
      {cfg(2, 8, 2, 64, 37, DType::kBF16, 0), {{37, 0}, {37, 0}, {5, 29}}, {7}},
      {cfg(4, 16, 4, 128, 300, DType::kBF16, 0), {{300, 1, 0, 123}, {300, 1, 0, 123}, {17, 300, 64, 2}}, {0, 9}, DType::kBF16},
      {cfg(4, 8, 3, 36, 50, DType::kFP32, 12), {{50, 49, 3, 0}, {50, 49, 3, 0}, {1, 1, 50, 7}}, {}},
      {cfg(2, 8, 2, 64, 20, DType::kFP16, 4), {{20, 20}, {20, 20}, {3, 0}}, {}, DType::kFP16},
      // FP8 dispatch (e4m3 rows with 1x128 fp32 scales), bf16 combine: the DeepSeek-V3 deployment's split
      {fp8(cfg(4, 16, 4, 256, 40, DType::kFP8E4M3, 8)), {{40, 0, 17, 40}, {40, 0, 17, 40}, {3, 40, 1, 0}}, {2}, DType::kBF16},
  };
  for (const Case& cs : cases) {
    const EpConfig& c = cs.c;
    SCOPED_TRACE("world " + std::to_string(c.world) + " E " + std::to_string(c.num_experts) + " k " + std::to_string(c.top_k) + " H " +
                 std::to_string(c.hidden) + " " + dtype_name(c.dtype));
    Emulation emu_group(c);
    ASSERT_EQ(int(emu_group.ends.size()), c.world);
    DeviceRanks dev(c);
    ASSERT_TRUE(dev.g != nullptr);
    auto rng = make_rng(uint64_t(c.world * 31 + c.num_experts));
    std::vector<RankInput> in;
    for (size_t round = 0; round < cs.m.size(); ++round) {
      if (round != 1) {  // round 2 repeats round 1's inputs
        in.clear();
        for (int r = 0; r < c.world; ++r) in.push_back(make_input(c, cs.m[round][size_t(r)], cs.dead, rng));
      }
      const auto emu = emulate(*emu_group.g, emu_group.ends, in, cs.out);
      const auto got = on_device(dev, in, cs.out, round == 2);  // round 3 through the split halves
      expect_equal(got, emu, "round " + std::to_string(round + 1));
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// One CUDA graph captured with x [40, H] and a device token count (world 1: the rank sends to itself),
// replayed with counts 17, 40, 0, 5: each replay its own round (the round counter is on the device), its
// received rows and outputs equal to the emulation's on the first `count` tokens, the rows past the count
// untouched; then a count of 41 fails the group with a message naming it.
TEST_F(MoeEpDeviceGpu, DeviceTokenCountInOneCudaGraph) {
  EpConfig c;
  c.world = 1, c.num_experts = 4, c.top_k = 2, c.hidden = 64, c.max_tokens = 40, c.dtype = DType::kBF16;
  c.timeout = std::chrono::milliseconds(5000);
  auto rng = make_rng(9);
  const RankInput full = make_input(c, 40, {}, rng);
  Emulation emu(c);
  DeviceRanks d(c);
  ASSERT_TRUE(d.g != nullptr);
  EpDeviceAllToAll& a = *d.ends[0];
  const EpDeviceReceived& rv = a.received();
  const size_t out_bytes = size_t(40 * c.hidden) * 4;
  {  // a host pointer as the count: refused before anything is enqueued
    const int32_t host_count = 3;
    DeviceBuffer x0(64), i0(64);
    const Status h = a.dispatch(mat(x0.ptr, c.dtype, 0, c.hidden, kGpu), mat(i0.ptr, DType::kInt32, 0, c.top_k, kGpu), {}, d.streams[0], &host_count);
    EXPECT_NE(h.to_string().find("token_count: must point to device memory of CUDA device 0"), std::string::npos) << h.to_string();
  }
  DeviceBuffer x(full.x.size()), ids(full.ids.size() * 4), w(full.w.size()), out(out_bytes), count(16);
  cudaMemcpy(x.ptr, full.x.data(), full.x.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(ids.ptr, full.ids.data(), full.ids.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(w.ptr, full.w.data(), full.w.size(), cudaMemcpyHostToDevice);
  cudaStream_t s = d.streams[0];
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status sd = a.dispatch(mat(x.ptr, c.dtype, 40, c.hidden, kGpu), mat(ids.ptr, DType::kInt32, 40, c.top_k, kGpu), {}, s,
                               static_cast<const int32_t*>(count.ptr));
  const Status sc = a.combine(mat(rv.x, c.dtype, rv.max_rows, c.hidden, kGpu), mat(w.ptr, DType::kFP32, 40, c.top_k, kGpu),
                              mat(out.ptr, DType::kFP32, 40, c.hidden, kGpu), s);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_TRUE(sd) << sd.to_string();
  ASSERT_TRUE(sc) << sc.to_string();
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int n : {17, 40, 0, 5}) {
    SCOPED_TRACE("device token count " + std::to_string(n));
    cudaMemcpyAsync(count.ptr, &n, 4, cudaMemcpyHostToDevice, s);  // on s: ordered before the replay
    cudaMemsetAsync(out.ptr, 0xff, out_bytes, s);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    const Status st = a.status();
    ASSERT_TRUE(st) << st.to_string();
    RankInput part = full;  // the first n tokens
    part.x.resize(size_t(n * c.hidden) * dtype_size(c.dtype)), part.ids.resize(size_t(n * c.top_k)), part.w.resize(size_t(n * c.top_k) * 4);
    const auto want = emulate(*emu.g, emu.ends, {part});
    expect_equal({device_result(a, c, out.ptr, n, DType::kFP32)}, want, "replay");
    const Bytes rest = fetch(static_cast<const uint8_t*>(out.ptr) + size_t(n * c.hidden) * 4, size_t((40 - n) * c.hidden) * 4);
    EXPECT_TRUE(std::all_of(rest.begin(), rest.end(), [](uint8_t b) { return b == 0xff; })) << "rows past the count were written";
  }
  const int bad = 41;
  cudaMemcpyAsync(count.ptr, &bad, 4, cudaMemcpyHostToDevice, s);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  const Status st = a.status();
  EXPECT_FALSE(st);
  // round 5 (four replays before it): the round counter advanced on the device with every replay
  EXPECT_NE(st.to_string().find("ep rank 0: dispatch round 5: token_count: the device count is 41, outside [0, m = 40]"), std::string::npos)
      << st.to_string();
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// The split halves out of order: refused on the host, nothing enqueued, the group still usable.
TEST_F(MoeEpDeviceGpu, SplitHalvesOutOfOrderRefused) {
  EpConfig c;
  c.world = 1, c.num_experts = 2, c.top_k = 1, c.hidden = 64, c.max_tokens = 4, c.dtype = DType::kBF16;
  DeviceRanks d(c);
  ASSERT_TRUE(d.g != nullptr);
  EpDeviceAllToAll& a = *d.ends[0];
  DeviceBuffer y(size_t(a.received().max_rows * c.hidden) * 2 + 16), w(16), o(16);
  const auto has = [](const Status& s, const char* what) { return s.to_string().find(what) != std::string::npos; };
  EXPECT_TRUE(has(a.dispatch_recv(d.streams[0]), "dispatch_recv called without a dispatch_send"));
  EXPECT_TRUE(has(a.combine_send(mat(y.ptr, c.dtype, a.received().max_rows, c.hidden, kGpu), d.streams[0]), "combine called without a dispatch"));
  EXPECT_TRUE(has(a.combine_recv(mat(w.ptr, DType::kFP32, 0, 1, kGpu), mat(o.ptr, c.dtype, 0, c.hidden, kGpu), d.streams[0]),
                  "combine_recv called without a combine_send"));
  d.sync();
  EXPECT_TRUE(a.status());
  EXPECT_EQ(a.epoch(), 0u);
}

TEST_F(MoeEpDeviceGpu, SilentPeerTimesOutAndBadIdsFailEveryRank) {
  EpConfig c;
  c.world = 2, c.num_experts = 4, c.top_k = 2, c.hidden = 64, c.max_tokens = 8, c.dtype = DType::kBF16;
  c.timeout = std::chrono::milliseconds(100);
  auto rng = make_rng(5);
  {  // rank 1 never dispatches: rank 0's receive gives up within the timeout, naming rank 1's count
    DeviceRanks d(c);
    ASSERT_TRUE(d.g != nullptr);
    const RankInput in = make_input(c, 8, {}, rng);
    DeviceBuffer x(in.x.size()), ids(in.ids.size() * 4);
    cudaMemcpy(x.ptr, in.x.data(), in.x.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(ids.ptr, in.ids.data(), in.ids.size() * 4, cudaMemcpyHostToDevice);
    ASSERT_TRUE(d.ends[0]->dispatch(mat(x.ptr, c.dtype, 8, c.hidden, kGpu), mat(ids.ptr, DType::kInt32, 8, c.top_k, kGpu), {}, d.streams[0]));
    d.sync();
    const Status s0 = d.ends[0]->status(), s1 = d.ends[1]->status();
    EXPECT_FALSE(s0);
    EXPECT_NE(s0.to_string().find("ep rank 0: dispatch (receive) round 1: timed out after 100 ms waiting for rank 1's count of expert"),
              std::string::npos)
        << s0.to_string();
    EXPECT_NE(s1.to_string().find("ep rank 1: aborted (round 1) because rank 0 failed"), std::string::npos) << s1.to_string();
  }
  {  // an expert id out of range on rank 1: both ranks fail, naming the entry
    DeviceRanks d(c);
    ASSERT_TRUE(d.g != nullptr);
    std::vector<RankInput> in = {make_input(c, 3, {}, rng), make_input(c, 3, {}, rng)};
    in[1].ids[3] = 9;
    std::deque<DeviceBuffer> x, ids;
    for (int r = 0; r < 2; ++r) {
      x.emplace_back(in[size_t(r)].x.size()), ids.emplace_back(in[size_t(r)].ids.size() * 4);
      cudaMemcpy(x.back().ptr, in[size_t(r)].x.data(), in[size_t(r)].x.size(), cudaMemcpyHostToDevice);
      cudaMemcpy(ids.back().ptr, in[size_t(r)].ids.data(), in[size_t(r)].ids.size() * 4, cudaMemcpyHostToDevice);
    }
    for (int r = 0; r < 2; ++r)
      ASSERT_TRUE(d.ends[size_t(r)]->dispatch(mat(x[size_t(r)].ptr, c.dtype, 3, c.hidden, kGpu), mat(ids[size_t(r)].ptr, DType::kInt32, 3, c.top_k, kGpu), {},
                                              d.streams[size_t(r)]));
    d.sync();
    for (int r = 0; r < 2; ++r) {
      const Status s = d.ends[size_t(r)]->status();
      EXPECT_NE(s.to_string().find("rank 1: dispatch round 1: topk_ids: entry [1, 1] = 9 is outside [0, num_experts = 4)"), std::string::npos)
          << s.to_string();
    }
  }
  {  // host-side refusals name the argument
    DeviceRanks d(c);
    ASSERT_TRUE(d.g != nullptr);
    DeviceBuffer x(9 * 64 * 2), ids(9 * 2 * 4);
    const Status s = d.ends[0]->dispatch(mat(x.ptr, c.dtype, 9, c.hidden, kGpu), mat(ids.ptr, DType::kInt32, 9, c.top_k, kGpu), {}, d.streams[0]);
    EXPECT_NE(s.to_string().find("x: m = 9 tokens exceeds max_tokens = 8"), std::string::npos) << s.to_string();
    const Status h = d.ends[0]->dispatch(mat(x.ptr, c.dtype, 2, c.hidden), mat(ids.ptr, DType::kInt32, 2, c.top_k, kGpu), {}, d.streams[0]);
    EXPECT_NE(h.to_string().find("x: must be on CUDA device 0"), std::string::npos) << h.to_string();
    const Status cb = d.ends[0]->combine({}, {}, {}, d.streams[0]);
    EXPECT_NE(cb.to_string().find("combine called without a dispatch (send and receive) before it"), std::string::npos) << cb.to_string();
  }
}

// Across processes: the IPC group (peer memory exported as file descriptors, ep_vmm.cu / ep_ipc.cpp),
// two processes (on one GPU, or on GPUs 0 and 1 where there are two), each a child run of this binary with ENCORE_EP_IPC_CHILD set; each
// child builds every rank's inputs from the same seed, runs the emulation of the whole group for the
// expected results and its own rank on the device, three rounds.
EpConfig ipc_config() {
  EpConfig c;
  c.world = 2, c.num_experts = 8, c.top_k = 3, c.hidden = 128, c.max_tokens = 40, c.dtype = DType::kBF16;
  c.timeout = std::chrono::milliseconds(20000);  // two contexts share the GPU by time slices
  return c;
}

std::string ipc_marker(const std::string& name, int rank) { return "/tmp/encore-" + name + "-rank" + std::to_string(rank) + ".done"; }

TEST_F(MoeEpDeviceGpu, IpcChild) {
  const char* env = std::getenv("ENCORE_EP_IPC_CHILD");
  if (!env) GTEST_SKIP() << "run by IpcTwoProcessesOnOneGpu";
  char name[128] = {};
  int rank = -1;
  ASSERT_EQ(std::sscanf(env, "%127s %d", name, &rank), 2);
  const EpConfig c = ipc_config();
  Emulation emu_group(c);
  ASSERT_EQ(int(emu_group.ends.size()), c.world);
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  const int device = rank % devices;  // one GPU each where there are two
  ASSERT_EQ(cudaSetDevice(device), cudaSuccess);
  DeviceRanks dev(c, rank, name, device);
  ASSERT_TRUE(dev.g != nullptr);
  std::mt19937_64 rng(std::hash<std::string>{}(name));  // the same inputs in both processes
  const std::vector<std::vector<int64_t>> m = {{40, 7}, {0, 40}, {13, 21}};
  for (size_t round = 0; round < m.size(); ++round) {
    std::vector<RankInput> in;
    for (int r = 0; r < c.world; ++r) in.push_back(make_input(c, m[round][size_t(r)], {}, rng));
    const auto emu = emulate(*emu_group.g, emu_group.ends, in);
    const auto got = on_device(dev, in);
    expect_equal(got, emu, "ipc round " + std::to_string(round + 1), rank);
    if (::testing::Test::HasFailure()) return;
  }
  // Proof for the parent that this child ran every round (a child that selected no test also exits 0).
  std::FILE* f = std::fopen(ipc_marker(name, rank).c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
}

TEST_F(MoeEpDeviceGpu, IpcTwoProcessesOnOneGpu) {
  if (std::getenv("ENCORE_EP_IPC_CHILD")) GTEST_SKIP() << "a child";
  char exe[4096] = {};
  ASSERT_GT(readlink("/proc/self/exe", exe, sizeof(exe) - 1), 0);
  const std::string name = "gpu-test-" + std::to_string(getpid());
  std::vector<pid_t> kids;
  for (int r = 0; r < 2; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {  // exec at once: no CUDA call between fork and exec
      const std::string v = name + " " + std::to_string(r);
      setenv("ENCORE_EP_IPC_CHILD", v.c_str(), 1);
      unsetenv("GTEST_TOTAL_SHARDS");  // a sharded parent's shard would filter the child's one test out
      unsetenv("GTEST_SHARD_INDEX");
      execl(exe, exe, "--gtest_filter=MoeEpDeviceGpu.IpcChild", static_cast<char*>(nullptr));
      _exit(127);
    }
    kids.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (size_t r = 0; r < kids.size(); ++r) {
    int st = 0;
    pid_t got = 0;
    while ((got = waitpid(kids[r], &st, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (got == 0) {  // hung past every timeout the kernels have: kill, and fail
      for (pid_t k : kids) kill(k, SIGKILL);
      waitpid(kids[r], &st, 0);
      ADD_FAILURE() << "rank " << r << " process still running after 120 s: killed";
      continue;
    }
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "rank " << r << " process failed (exit status " << st << "; its output is above)";
    EXPECT_EQ(std::remove(ipc_marker(name, int(r)).c_str()), 0) << "rank " << r << " process did not finish its rounds";
  }
}

}  // namespace
}  // namespace encore::test
