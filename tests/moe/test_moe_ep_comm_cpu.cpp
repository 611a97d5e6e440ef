// moe_forward_ep (encore/moe_ep.hpp) on the CPU backend over moe_ep_host_group: ranks as threads, each
// with its own tokens (0 included), its share of the experts and its own workspace (poisoned). Every
// rank's out must equal moe_forward on all ranks' tokens in one call, bit for bit (each expert row is
// computed on its own and the combine order is the same). Also: bad input on one rank fails every rank
// naming it, another shape on one rank is refused by every other, a rank that never calls makes the
// others time out, and the workspace / shape checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "encore/moe_ep.hpp"
#include "tests/common/compare.hpp"

namespace encore::test {
namespace {

struct Aligned {
  std::vector<unsigned char> bytes;
  void* at = nullptr;
  explicit Aligned(size_t n) : bytes(n + 256, 0xAB) { at = bytes.data() + (256 - reinterpret_cast<uintptr_t>(bytes.data()) % 256) % 256; }
};

struct EpCase {
  int E, k, world, align;
  int64_t D, F;
  DType dtype;
  std::vector<int64_t> tokens;  // per rank
};

// All ranks' tokens, logits and weights; the one-process layer's output over them.
struct Problem {
  EpCase c;
  int64_t total = 0;
  HostTensor x, logits, w13, w2, ref;
  Problem(const EpCase& cs, std::mt19937_64& rng)
      : c(cs), total([&] { int64_t t = 0; for (int64_t v : cs.tokens) t += v; return t; }()), x(cs.dtype, std::max<int64_t>(total, 1), cs.D),
        logits(DType::kFP32, std::max<int64_t>(total, 1), cs.E), w13(cs.dtype, int64_t(cs.E) * 2 * cs.F, cs.D), w2(cs.dtype, int64_t(cs.E) * cs.D, cs.F),
        ref(cs.dtype, std::max<int64_t>(total, 1), cs.D) {
    x.fill_normal(rng);
    logits.fill_normal(rng, 0, 2);
    w13.fill_normal(rng, 0, 1 / std::sqrt(double(cs.D)));
    w2.fill_normal(rng, 0, 1 / std::sqrt(double(cs.F)));
    MoeOptions o;
    o.routing.top_k = cs.k;
    o.align_m = cs.align;
    const MoeLayerShape s{std::max<int64_t>(total, 1), cs.D, cs.F, cs.E, cs.dtype};
    Aligned buf(moe_buffers_bytes(s, o));
    MoeBuffers b;
    EXPECT_TRUE(moe_buffers_carve(s, o, buf.at, buf.bytes.size() - 256, Device{}, &b));
    const MoeForwardArgs a{view(x, 0, total), view(logits, 0, total), TensorView{}, weights13(0, cs.E), weights2(0, cs.E), b, view(ref, 0, total)};
    const Status st = run(a, o);
    EXPECT_TRUE(st) << st.to_string();
  }
  TensorView view(HostTensor& h, int64_t row0, int64_t rows) {
    return TensorView::contiguous(h.bytes.data() + size_t(row0 * h.cols) * dtype_size(h.dtype), h.dtype, {rows, h.cols});
  }
  TensorView weights13(int e0, int n) {
    return TensorView::contiguous(w13.bytes.data() + size_t(int64_t(e0) * 2 * c.F * c.D) * dtype_size(c.dtype), c.dtype, {n, 2 * c.F, c.D});
  }
  TensorView weights2(int e0, int n) {
    return TensorView::contiguous(w2.bytes.data() + size_t(int64_t(e0) * c.D * c.F) * dtype_size(c.dtype), c.dtype, {n, c.D, c.F});
  }
  MoeEpShape shape() const {
    int64_t mx = 0;
    for (int64_t t : c.tokens) mx = std::max(mx, t);
    return {mx, c.D, c.F, c.E, c.world, c.dtype};
  }
  MoeEpOptions options() const {
    MoeEpOptions o;
    o.moe.routing.top_k = c.k;
    o.moe.align_m = c.align;
    o.timeout = std::chrono::milliseconds(20000);
    return o;
  }
};

// Runs every rank on its own thread; `edit` may change a rank's arguments, shape or options first;
// `absent` ranks never call. Returns each rank's status; outs[r] its output.
std::vector<Status> run_ranks(Problem& p, std::vector<HostTensor>& outs, const std::function<void(int, MoeEpArgs&, MoeEpShape&, MoeEpOptions&)>& edit = {},
                              int absent = -1) {
  const int W = p.c.world, El = p.c.E / W;
  auto comms = moe_ep_host_group(W);
  std::vector<Status> st(static_cast<size_t>(W));
  std::vector<std::thread> th;
  outs.clear();
  for (int r = 0; r < W; ++r) outs.emplace_back(p.c.dtype, std::max<int64_t>(p.c.tokens[size_t(r)], 1), p.c.D);
  int64_t row0 = 0;
  for (int r = 0; r < W; ++r) {
    const int64_t T = p.c.tokens[size_t(r)];
    outs[size_t(r)].poison();
    MoeEpArgs a{p.view(p.x, row0, T), p.view(p.logits, row0, T), TensorView{}, p.weights13(r * El, El), p.weights2(r * El, El),
                TensorView::contiguous(outs[size_t(r)].bytes.data(), p.c.dtype, {T, p.c.D})};
    row0 += T;
    if (r == absent) continue;
    th.emplace_back([&, r, a]() mutable {
      MoeEpShape s = p.shape();
      MoeEpOptions o = p.options();
      if (edit) edit(r, a, s, o);
      const size_t bytes = moe_ep_workspace_bytes(s, o);
      Aligned ws(bytes);
      st[size_t(r)] = moe_forward_ep(a, s, o, *comms[size_t(r)], ws.at, bytes, nullptr);
    });
  }
  for (std::thread& t : th) t.join();
  return st;
}

void expect_equal_to_one_process(Problem& p, const std::vector<HostTensor>& outs) {
  int64_t row0 = 0;
  const size_t rb = size_t(p.c.D) * dtype_size(p.c.dtype);
  for (int r = 0; r < p.c.world; ++r) {
    const int64_t T = p.c.tokens[size_t(r)];
    for (int64_t t = 0; t < T; ++t)
      ASSERT_EQ(std::memcmp(outs[size_t(r)].bytes.data() + size_t(t) * rb, p.ref.bytes.data() + size_t(row0 + t) * rb, rb), 0)
          << "rank " << r << " token " << t << ": out differs from the one-process layer";
    row0 += T;
  }
}

TEST(MoeEpComm, EveryRankEqualsTheOneProcessLayer) {
  const EpCase cases[] = {
      {8, 2, 1, 1, 16, 8, DType::kFP32, {9}},
      {8, 2, 2, 1, 16, 8, DType::kFP32, {5, 7}},
      {8, 3, 4, 8, 16, 8, DType::kFP32, {5, 0, 7, 3}},  // a rank without tokens; local blocks padded to 8
      {8, 4, 4, 1, 24, 16, DType::kBF16, {6, 6, 1, 2}},
      {16, 8, 2, 16, 8, 8, DType::kBF16, {4, 11}},  // k = E_l: every token to every local expert of a rank
  };
  for (const EpCase& c : cases) {
    SCOPED_TRACE("E " + std::to_string(c.E) + " k " + std::to_string(c.k) + " world " + std::to_string(c.world) + " " + dtype_name(c.dtype));
    auto rng = make_rng(uint64_t(c.E * 131 + c.world * 7 + c.k));
    Problem p(c, rng);
    std::vector<HostTensor> outs;
    const std::vector<Status> st = run_ranks(p, outs);
    for (int r = 0; r < c.world; ++r) ASSERT_TRUE(st[size_t(r)]) << "rank " << r << ": " << st[size_t(r)].to_string();
    expect_equal_to_one_process(p, outs);
    const std::vector<HostTensor> first = outs;
    run_ranks(p, outs);  // a rerun is identical
    for (int r = 0; r < c.world; ++r) EXPECT_EQ(outs[size_t(r)].bytes, first[size_t(r)].bytes) << "rank " << r;
  }
}

TEST(MoeEpComm, BadInputOnOneRankFailsEveryRank) {
  auto rng = make_rng(21);
  Problem p({8, 2, 4, 1, 16, 8, DType::kFP32, {3, 4, 5, 6}}, rng);
  std::vector<HostTensor> outs;
  std::vector<Status> st = run_ranks(p, outs, [&](int r, MoeEpArgs& a, MoeEpShape&, MoeEpOptions&) {
    if (r == 1) a.w13.shape[1] = 2 * p.c.F + 2;  // not [E_l, 2F, D]
  });
  EXPECT_NE(st[1].message().find("w13: must be [E_l, 2F, D]"), std::string::npos) << st[1].to_string();
  for (int r : {0, 2, 3}) EXPECT_NE(st[size_t(r)].message().find("rank 1 refused its input"), std::string::npos) << r << ": " << st[size_t(r)].to_string();
  // Another shape on rank 2 (its own arguments consistent with it): every other rank refuses.
  st = run_ranks(p, outs, [&](int r, MoeEpArgs& a, MoeEpShape& s, MoeEpOptions&) {
    if (r == 2) {
      s.intermediate = p.c.F / 2;
      a.w13.shape[1] = p.c.F;
      a.w2.shape[2] = p.c.F / 2;
    }
  });
  for (int r : {0, 1, 3}) EXPECT_NE(st[size_t(r)].message().find("rank 2 called with another shape"), std::string::npos) << r << ": " << st[size_t(r)].to_string();
}

TEST(MoeEpComm, AbsentRankTimesOut) {
  auto rng = make_rng(23);
  Problem p({8, 2, 2, 1, 16, 8, DType::kFP32, {3, 4}}, rng);
  std::vector<HostTensor> outs;
  const std::vector<Status> st = run_ranks(p, outs, [](int, MoeEpArgs&, MoeEpShape&, MoeEpOptions& o) { o.timeout = std::chrono::milliseconds(200); }, 1);
  EXPECT_NE(st[0].message().find("rank 0 timed out after 200 ms"), std::string::npos) << st[0].to_string();
}

TEST(MoeEpComm, ShapeAndWorkspaceChecks) {
  MoeEpOptions o;
  o.moe.routing.top_k = 2;
  EXPECT_EQ(moe_ep_workspace_bytes({4, 16, 8, 9, 2, DType::kFP32}, o), 0u) << "E not a multiple of world";
  MoeEpOptions k9 = o;
  k9.moe.routing.top_k = 9;
  EXPECT_EQ(moe_ep_workspace_bytes({4, 16, 8, 8, 2, DType::kFP32}, k9), 0u) << "top_k > E";
  EXPECT_GT(moe_ep_workspace_bytes({4, 16, 8, 8, 2, DType::kFP32}, o), 0u);
  auto comms = moe_ep_host_group(2);
  const MoeEpShape s{4, 16, 8, 8, 2, DType::kFP32};
  MoeEpArgs a;
  Status st = moe_forward_ep(a, s, o, *comms[0], nullptr, 0);
  EXPECT_NE(st.message().find("workspace: needs"), std::string::npos) << st.to_string();
  auto one = moe_ep_host_group(1);
  Aligned ws(moe_ep_workspace_bytes(s, o));
  st = moe_forward_ep(a, s, o, *one[0], ws.at, moe_ep_workspace_bytes(s, o));
  EXPECT_NE(st.message().find("shape.world: 2, the communicator has 1 ranks"), std::string::npos) << st.to_string();
  std::unique_ptr<MoeEpComm> nc;
  st = moe_ep_nccl_comm(nullptr, &nc);  // CPU builds: unsupported; CUDA builds: a null communicator
  EXPECT_FALSE(st.is_ok());
  EXPECT_EQ(nc, nullptr);
}

}  // namespace
}  // namespace encore::test
