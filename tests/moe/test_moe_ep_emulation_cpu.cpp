// EP intranode dispatch / combine emulated on CPU threads (src/moe/reference/ep_emulation.hpp):
// world 2, 4, 8; the EP layer (per-rank routing -> dispatch -> the reference expert MLP on the
// received rows -> combine) equals the single-process moe_forward on the concatenated tokens bit for
// bit; received rows bit-equal to their source, in (source rank, token) order, counts equal to the
// reference histogram; rounds repeat bit-identically and with new shapes on the same buffers; a
// silent peer makes the others time out with a diagnostic; a bad shape on one rank fails every rank.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "encore/moe.hpp"
#include "encore/quant.hpp"
#include "moe/reference/ep_emulation.hpp"
#include "moe/reference/moe_ref.hpp"

namespace encore::test {
namespace {

using namespace encore::moe::ep;
using Bytes = std::vector<uint8_t>;

Bytes random_rows(DType dt, int64_t n, double sd, std::mt19937_64& rng) {
  Bytes b(size_t(n) * dtype_size(dt));
  std::normal_distribution<double> nd(0.0, sd);
  for (int64_t i = 0; i < n; ++i) store_from_double(b.data(), dt, i, nd(rng));
  return b;
}
TensorView mat(const void* p, DType t, int64_t r, int64_t c) { return TensorView::contiguous(const_cast<void*>(p), t, {r, c}); }

void run_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> th;
  for (int r = 0; r < world; ++r) th.emplace_back(fn, r);
  for (auto& t : th) t.join();
}

struct Case {
  int world, E, k;
  int64_t H, F, max_tokens;
  DType dtype;
  int64_t scale_bytes;
  std::vector<int64_t> m;  // tokens per rank
  std::vector<int> dead;   // experts no token selects (a logit of -30 on every rank)
  bool fp8 = false;        // rows dispatched as e4m3 with their 1x128 fp32 scales (scale_bytes H / 32), experts in dtype
  bool split = false;      // the layer through dispatch_send / dispatch_recv / combine_send / combine_recv, other work between
  DType row_dtype() const { return fp8 ? DType::kFP8E4M3 : dtype; }
  int64_t row_scale_bytes() const { return fp8 ? H / 128 * 4 : scale_bytes; }
  EpConfig config(std::chrono::milliseconds timeout = std::chrono::milliseconds(10000)) const {
    EpConfig e{world, E, k, H, max_tokens, row_dtype(), row_scale_bytes(), timeout};
    if (fp8) e.combine_dtype = dtype;
    return e;
  }
};

// x [n, H] in dtype quantized to e4m3 rows (q) with fp32 group scales (as bytes), and the dequantized rows.
void fp8_rows(const Bytes& x, DType dt, int64_t n, int64_t H, Bytes* q, Bytes* scales, Bytes* deq) {
  q->assign(size_t(n * H), 0), scales->assign(size_t(n * H / 128) * 4, 0), deq->assign(size_t(n * H) * dtype_size(dt), 0);
  if (n == 0) return;
  const Fp8GroupQuantOptions o;
  const Status s = run(Fp8GroupQuantArgs{mat(x.data(), dt, n, H), mat(q->data(), DType::kFP8E4M3, n, H), mat(scales->data(), DType::kFP32, n, H / 128)}, o);
  EXPECT_TRUE(s) << s.to_string();
  const Status d = run(Fp8GroupDequantArgs{mat(q->data(), DType::kFP8E4M3, n, H), mat(scales->data(), DType::kFP32, n, H / 128), mat(deq->data(), dt, n, H)}, o);
  EXPECT_TRUE(d) << d.to_string();
}

// One round's inputs for every rank and the single-process reference on their concatenation.
struct Round {
  const Case& c;
  std::vector<Bytes> x, logits, scales, w;  // per rank; w: routing weights [m, k] fp32
  std::vector<std::vector<int32_t>> ids;    // per rank [m, k]
  Bytes out_ref;                            // [sum m, H]
  std::vector<int32_t> counts_ref;          // [E]

  Round(const Case& cs, const Bytes& w13, const Bytes& w2, std::mt19937_64& rng) : c(cs) {
    const int W = c.world;
    x.resize(size_t(W)), logits.resize(size_t(W)), scales.resize(size_t(W)), w.resize(size_t(W)), ids.resize(size_t(W));
    MoeOptions o;
    o.routing.top_k = c.k;
    int64_t T = 0;
    for (int r = 0; r < W; ++r) T += c.m[size_t(r)];
    Bytes xa, la;
    for (int r = 0; r < W; ++r) {
      const int64_t m = c.m[size_t(r)];
      x[size_t(r)] = random_rows(c.dtype, m * c.H, 1.0, rng);
      Bytes deq;  // fp8: the reference layer's input is what the receivers dequantize
      if (c.fp8) fp8_rows(Bytes(x[size_t(r)]), c.dtype, m, c.H, &x[size_t(r)], &scales[size_t(r)], &deq);
      logits[size_t(r)] = random_rows(DType::kFP32, m * c.E, 2.0, rng);
      for (int64_t t = 0; t < m; ++t)
        for (int e : c.dead) reinterpret_cast<float*>(logits[size_t(r)].data())[t * c.E + e] = -30.f;
      if (!c.fp8) {
        scales[size_t(r)].resize(size_t(m * c.scale_bytes));
        for (auto& b : scales[size_t(r)]) b = uint8_t(rng());
      }
      ids[size_t(r)].resize(size_t(m * c.k));
      w[size_t(r)].resize(size_t(m * c.k) * 4);
      MoeRoutingOptions ro;
      ro.top_k = c.k;
      const Status rs = m == 0 ? Status::ok()  // the routing op takes no empty batch
                               : run(MoeRoutingArgs{mat(logits[size_t(r)].data(), DType::kFP32, m, c.E), {},
                                                    mat(ids[size_t(r)].data(), DType::kInt32, m, c.k), mat(w[size_t(r)].data(), DType::kFP32, m, c.k)},
                                     ro);
      EXPECT_TRUE(rs) << rs.to_string();
      const Bytes& xin = c.fp8 ? deq : x[size_t(r)];
      xa.insert(xa.end(), xin.begin(), xin.end());
      la.insert(la.end(), logits[size_t(r)].begin(), logits[size_t(r)].end());
    }
    const MoeLayerShape s{std::max<int64_t>(T, 1), c.H, c.F, c.E, c.dtype};
    Bytes storage(moe_buffers_bytes(s, o) + 256);
    void* base = storage.data() + (256 - reinterpret_cast<uintptr_t>(storage.data()) % 256) % 256;
    MoeBuffers b;
    EXPECT_TRUE(moe_buffers_carve(s, o, base, storage.size() - 256, Device{}, &b));
    out_ref.resize(size_t(T * c.H) * dtype_size(c.dtype));
    const Status st = run(MoeForwardArgs{mat(xa.data(), c.dtype, T, c.H), mat(la.data(), DType::kFP32, T, c.E), {},
                                         TensorView::contiguous(const_cast<uint8_t*>(w13.data()), c.dtype, {c.E, 2 * c.F, c.H}),
                                         TensorView::contiguous(const_cast<uint8_t*>(w2.data()), c.dtype, {c.E, c.H, c.F}), b,
                                         mat(out_ref.data(), c.dtype, T, c.H)},
                          o);
    EXPECT_TRUE(st) << st.to_string();
    counts_ref.assign(static_cast<const int32_t*>(b.expert_counts.data), static_cast<const int32_t*>(b.expert_counts.data) + c.E);
  }
};

// One rank's layer step: dispatch, the reference SwiGLU MLP of its local experts, combine.
Status ep_layer(EpAllToAll& a, const Case& c, const Round& rd, const Bytes& w13, const Bytes& w2, EpReceived* recv, Bytes* out) {
  const int r = a.rank();
  const int64_t m = c.m[size_t(r)];
  const int64_t sb = c.row_scale_bytes();
  const TensorView xv = mat(rd.x[size_t(r)].data(), c.row_dtype(), m, c.H), iv = mat(rd.ids[size_t(r)].data(), DType::kInt32, m, c.k);
  const TensorView sv = sb ? mat(rd.scales[size_t(r)].data(), DType::kUInt8, m, sb) : TensorView{};
  const auto other_work = [r] { std::this_thread::sleep_for(std::chrono::microseconds(200 * (r + 1))); };  // ranks at other paces
  if (c.split) {
    ENCORE_RETURN_IF_ERROR(a.dispatch_send(xv, iv, sv));
    other_work();
    ENCORE_RETURN_IF_ERROR(a.dispatch_recv(recv));
  } else {
    ENCORE_RETURN_IF_ERROR(a.dispatch(xv, iv, sv, recv));
  }
  const int64_t rows = recv->rows();
  const size_t es = dtype_size(c.dtype);
  Bytes act(size_t(rows * c.F) * es), y(size_t(rows * c.H) * es), deq(size_t(rows * c.H) * es);
  if (c.fp8 && rows > 0) {  // the received e4m3 rows and scales back to the experts' dtype
    const Status d = run(Fp8GroupDequantArgs{mat(recv->x.data(), DType::kFP8E4M3, rows, c.H), mat(recv->scales.data(), DType::kFP32, rows, c.H / 128),
                                             mat(deq.data(), c.dtype, rows, c.H)},
                         Fp8GroupQuantOptions{});
    ENCORE_RETURN_IF_ERROR(d);
  }
  moe::ExpertMlpProblem p;
  p.x_permuted = c.fp8 ? deq.data() : recv->x.data();
  p.xp_stride = c.H;
  p.act = act.data();
  p.act_stride = c.F;
  p.y = y.data();
  p.y_stride = c.H;
  p.w13 = w13.data() + size_t(recv->first_expert) * size_t(2 * c.F * c.H) * es;
  p.w13_stride_e = 2 * c.F * c.H;
  p.w13_stride_n = c.H;
  p.w2 = w2.data() + size_t(recv->first_expert) * size_t(c.H * c.F) * es;
  p.w2_stride_e = c.H * c.F;
  p.w2_stride_n = c.F;
  p.counts = recv->counts.data();
  p.offsets = recv->offsets.data();
  p.num_experts = recv->local_experts;
  p.hidden = c.H;
  p.intermediate = c.F;
  p.dtype = c.dtype;
  reference::moe_expert_mlp(p);
  out->assign(size_t(m * c.H) * es, 0xCD);
  const TensorView yv = mat(y.data(), c.dtype, rows, c.H), wv = mat(rd.w[size_t(r)].data(), DType::kFP32, m, c.k), ov = mat(out->data(), c.dtype, m, c.H);
  if (!c.split) return a.combine(yv, wv, ov);
  ENCORE_RETURN_IF_ERROR(a.combine_send(yv));
  other_work();
  return a.combine_recv(wv, ov);
}

// Received rows against their sources: bytes, scales, expert, (rank, token) order, histograms.
void check_received(const Case& c, const Round& rd, const std::vector<EpReceived>& recv) {
  const size_t rb = size_t(c.H) * dtype_size(c.row_dtype());
  const int64_t sb = c.row_scale_bytes();
  const int E_l = c.E / c.world;
  for (int r = 0; r < c.world; ++r) {
    const EpReceived& v = recv[size_t(r)];
    ASSERT_EQ(v.first_expert, r * E_l);
    for (int le = 0; le < E_l; ++le) {
      EXPECT_EQ(v.counts[size_t(le)], rd.counts_ref[size_t(r * E_l + le)]) << "rank " << r << " expert " << r * E_l + le;
      for (int s = 0; s < c.world; ++s) {
        int hist = 0;
        for (int32_t e : rd.ids[size_t(s)]) hist += e == r * E_l + le;
        EXPECT_EQ(v.counts_from[size_t(s * E_l + le)], hist) << "rank " << r << " expert " << r * E_l + le << " from rank " << s;
      }
      for (int32_t i = v.offsets[size_t(le)]; i < v.offsets[size_t(le + 1)]; ++i) {
        const int s = v.src_rank[size_t(i)], t = v.src_token[size_t(i)], j = v.src_k[size_t(i)];
        ASSERT_TRUE(s >= 0 && s < c.world && t >= 0 && t < c.m[size_t(s)] && j >= 0 && j < c.k) << "row " << i;
        EXPECT_EQ(rd.ids[size_t(s)][size_t(t * c.k + j)], r * E_l + le) << "row " << i;
        EXPECT_EQ(0, std::memcmp(v.x.data() + size_t(i) * rb, rd.x[size_t(s)].data() + size_t(t) * rb, rb)) << "row " << i;
        if (sb) EXPECT_EQ(0, std::memcmp(v.scales.data() + size_t(i * sb), rd.scales[size_t(s)].data() + size_t(t * sb), size_t(sb)));
        if (i > v.offsets[size_t(le)]) {
          const int ps = v.src_rank[size_t(i - 1)], pt = v.src_token[size_t(i - 1)];
          EXPECT_TRUE(ps < s || (ps == s && pt < t)) << "rows " << i - 1 << ", " << i << " out of (rank, token) order";
        }
      }
    }
  }
}

void run_case(const Case& c) {
  std::mt19937_64 rng(uint64_t(c.world) * 977 + uint64_t(c.E));
  const Bytes w13 = random_rows(c.dtype, c.E * 2 * c.F * c.H, 1 / std::sqrt(double(c.H)), rng);
  const Bytes w2 = random_rows(c.dtype, c.E * c.H * c.F, 1 / std::sqrt(double(c.F)), rng);
  Case c2 = c;  // round 3: other token counts on the same buffers
  for (size_t r = 0; r < c.m.size(); ++r) c2.m[r] = c.m[(r + 1) % c.m.size()];
  const Round a(c, w13, w2, rng), b(c2, w13, w2, rng);
  const EpConfig cfg = c.config();
  std::unique_ptr<EpGroup> g;
  ASSERT_TRUE(EpGroup::create(cfg, &g));
  const int W = c.world;
  std::vector<std::unique_ptr<EpAllToAll>> ep(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) ASSERT_TRUE(EpAllToAll::create(g.get(), r, &ep[size_t(r)]));
  std::vector<std::vector<EpReceived>> recv(3, std::vector<EpReceived>(size_t(W)));
  std::vector<std::vector<Bytes>> out(3, std::vector<Bytes>(size_t(W)));
  std::vector<std::vector<Status>> st(3, std::vector<Status>(size_t(W)));
  run_ranks(W, [&](int r) {
    for (int i = 0; i < 3; ++i) {
      st[size_t(i)][size_t(r)] = ep_layer(*ep[size_t(r)], i < 2 ? c : c2, i < 2 ? a : b, w13, w2, &recv[size_t(i)][size_t(r)], &out[size_t(i)][size_t(r)]);
      if (!st[size_t(i)][size_t(r)]) return;
    }
  });
  for (int i = 0; i < 3; ++i) {
    const Case& ci = i < 2 ? c : c2;
    const Round& ri = i < 2 ? a : b;
    for (int r = 0; r < W; ++r) ASSERT_TRUE(st[size_t(i)][size_t(r)]) << "round " << i << ": " << st[size_t(i)][size_t(r)].to_string();
    check_received(ci, ri, recv[size_t(i)]);
    size_t off = 0;
    for (int r = 0; r < W; ++r) {
      const Bytes& o = out[size_t(i)][size_t(r)];
      ASSERT_LE(off + o.size(), ri.out_ref.size());
      EXPECT_EQ(0, std::memcmp(o.data(), ri.out_ref.data() + off, o.size())) << "round " << i << " rank " << r << ": not bit-equal to moe_forward";
      off += o.size();
      if (i == 1) EXPECT_EQ(o, out[0][size_t(r)]) << "rank " << r << ": round 2 differs from round 1";
    }
    for (int e : ci.dead) EXPECT_EQ(ri.counts_ref[size_t(e)], 0);
  }
  for (int r = 0; r < W; ++r) EXPECT_EQ(ep[size_t(r)]->epoch(), 3u);
}

TEST(MoeEpEmulation, World2) { run_case({2, 8, 2, 64, 32, 24, DType::kBF16, 0, {24, 0}, {7}}); }
// Rank 3's experts (12..15) are dead: rank 3 receives no token but still takes part in every round.
TEST(MoeEpEmulation, World4ScalesFp32) { run_case({4, 16, 3, 40, 24, 20, DType::kFP32, 10, {5, 20, 0, 13}, {12, 13, 14, 15}}); }
// FP8 dispatch, bf16 combine (the DeepSeek-V3 deployment): e4m3 rows with their 1x128 scales over the
// wire, dequantized by the receivers; equal bit for bit to moe_forward on the dequantized tokens.
TEST(MoeEpEmulation, World4Fp8RowsBf16Combine) {
  Case c{4, 16, 4, 256, 32, 24, DType::kBF16, 0, {24, 7, 0, 19}, {3}};
  c.fp8 = true;
  run_case(c);
}
// The split halves, each rank doing other work between a send and its receive: the same bits.
TEST(MoeEpEmulation, World4SplitPhases) {
  Case c{4, 16, 3, 48, 16, 20, DType::kBF16, 0, {20, 3, 0, 11}, {5}};
  c.split = true;
  run_case(c);
}
TEST(MoeEpEmulation, World8) { run_case({8, 16, 4, 72, 16, 16, DType::kBF16, 0, {16, 0, 3, 11, 1, 16, 7, 9}, {0, 9}}); }

TEST(MoeEpEmulation, ConfigAndOrderErrors) {
  std::unique_ptr<EpGroup> g;
  EXPECT_FALSE(EpGroup::create({3, 8, 2, 8, 4}, &g));  // E not a multiple of world
  EXPECT_NE(EpGroup::create({2, 8, 2, 8, 4, DType::kInt32}, &g).message().find("dtype"), std::string::npos);
  // fp8 rows need the combine's dtype; the combine's must be a float type of 16 bits or more
  EXPECT_NE(EpGroup::create({2, 8, 2, 16, 4, DType::kFP8E4M3, 4}, &g).message().find("need a combine_dtype"), std::string::npos);
  EpConfig bad{2, 8, 2, 16, 4, DType::kFP8E4M3, 4};
  bad.combine_dtype = DType::kFP8E4M3;
  EXPECT_NE(EpGroup::create(bad, &g).message().find("combine_dtype"), std::string::npos);
  ASSERT_TRUE(EpGroup::create({1, 4, 2, 8, 4, DType::kFP32}, &g));
  std::unique_ptr<EpAllToAll> a;
  EXPECT_FALSE(EpAllToAll::create(g.get(), 1, &a));
  ASSERT_TRUE(EpAllToAll::create(g.get(), 0, &a));
  float y = 0, w = 0, o = 0;
  const Status s = a->combine(mat(&y, DType::kFP32, 0, 8), mat(&w, DType::kFP32, 0, 2), mat(&o, DType::kFP32, 0, 8));
  EXPECT_NE(s.message().find("combine called without a dispatch"), std::string::npos) << s.to_string();
  // the split halves out of order, each on a fresh group (a refusal aborts the group)
  const auto fresh = [&] {
    a.reset();
    g.reset();
    EXPECT_TRUE(EpGroup::create({1, 4, 2, 8, 4, DType::kFP32}, &g));
    EXPECT_TRUE(EpAllToAll::create(g.get(), 0, &a));
  };
  fresh();
  EpReceived v;
  EXPECT_NE(a->dispatch_recv(&v).message().find("dispatch_recv called without a dispatch_send"), std::string::npos);
  fresh();
  EXPECT_NE(a->combine_recv(mat(&w, DType::kFP32, 0, 2), mat(&o, DType::kFP32, 0, 8)).message().find("combine_recv called without a combine_send"),
            std::string::npos);
  fresh();
  int32_t id[2] = {0, 1};
  float x[8] = {};
  ASSERT_TRUE(a->dispatch_send(mat(x, DType::kFP32, 1, 8), mat(id, DType::kInt32, 1, 2), {}));
  EXPECT_NE(a->combine_send(mat(&y, DType::kFP32, 0, 8)).message().find("combine called without a dispatch (send and receive)"), std::string::npos);
}

struct Fixture {
  Case c;
  Bytes w13, w2;
  std::unique_ptr<Round> rd;
  std::unique_ptr<EpGroup> g;
  std::vector<std::unique_ptr<EpAllToAll>> ep;
  explicit Fixture(std::chrono::milliseconds timeout) : c{4, 8, 2, 32, 16, 8, DType::kBF16, 0, {8, 3, 5, 8}, {}} {
    std::mt19937_64 rng(7);
    w13 = random_rows(c.dtype, c.E * 2 * c.F * c.H, 0.2, rng);
    w2 = random_rows(c.dtype, c.E * c.H * c.F, 0.2, rng);
    rd = std::make_unique<Round>(c, w13, w2, rng);
    const EpConfig cfg = c.config(timeout);
    EXPECT_TRUE(EpGroup::create(cfg, &g));
    ep.resize(size_t(c.world));
    for (int r = 0; r < c.world; ++r) EXPECT_TRUE(EpAllToAll::create(g.get(), r, &ep[size_t(r)]));
  }
};

bool has(const Status& s, const std::string& what) { return s.message().find(what) != std::string::npos; }

// Round 1 completes; in round 2 rank 2 never dispatches: the others give up within the limit and
// name rank 2's dispatch flag, the epoch they expected (2) and what they saw (round 1's flag).
TEST(MoeEpEmulation, SilentPeerTimesOut) {
  Fixture f(std::chrono::milliseconds(100));
  std::vector<Status> st(4);
  std::vector<double> secs(4);
  run_ranks(4, [&](int r) {
    EpReceived v;
    Bytes out;
    st[size_t(r)] = ep_layer(*f.ep[size_t(r)], f.c, *f.rd, f.w13, f.w2, &v, &out);
    if (!st[size_t(r)] || r == 2) return;
    const auto t0 = std::chrono::steady_clock::now();
    st[size_t(r)] = ep_layer(*f.ep[size_t(r)], f.c, *f.rd, f.w13, f.w2, &v, &out);
    secs[size_t(r)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
  ASSERT_TRUE(st[2]) << st[2].to_string();
  for (int r : {0, 1, 3}) {
    const Status& s = st[size_t(r)];
    EXPECT_FALSE(s);
    EXPECT_TRUE(has(s, "dispatch round 2")) << s.to_string();
    EXPECT_TRUE(has(s, "timed out after 100 ms waiting for rank 2's dispatch flag (expected {epoch 2, value 1}), saw {epoch 1, value 1}"))
        << s.to_string();
    EXPECT_LT(secs[size_t(r)], 3.0) << "rank " << r;
  }
  // The group stays aborted: a later call fails at once.
  EpReceived v;
  const Status later = f.ep[0]->dispatch(mat(f.rd->x[0].data(), f.c.dtype, 1, f.c.H), mat(f.rd->ids[0].data(), DType::kInt32, 1, f.c.k), {}, &v);
  EXPECT_TRUE(has(later, "aborted")) << later.to_string();
}

// Rank 1 dispatches but never combines: the others time out in combine on a token's counter (the
// value shows how many of its k outputs arrived) or on rank 1's combine flag.
TEST(MoeEpEmulation, PeerThatNeverCombinesTimesOut) {
  Fixture f(std::chrono::milliseconds(100));
  std::vector<Status> st(4);
  run_ranks(4, [&](int r) {
    EpReceived v;
    Bytes out;
    if (r == 1) {
      st[1] = f.ep[1]->dispatch(mat(f.rd->x[1].data(), f.c.dtype, f.c.m[1], f.c.H), mat(f.rd->ids[1].data(), DType::kInt32, f.c.m[1], f.c.k), {}, &v);
      return;
    }
    st[size_t(r)] = ep_layer(*f.ep[size_t(r)], f.c, *f.rd, f.w13, f.w2, &v, &out);
  });
  ASSERT_TRUE(st[1]) << st[1].to_string();
  for (int r : {0, 2, 3}) {
    const Status& s = st[size_t(r)];
    EXPECT_TRUE(has(s, "combine round 1")) << s.to_string();
    EXPECT_TRUE(has(s, "timed out after 100 ms waiting for token") || has(s, "waiting for rank 1's combine flag")) << s.to_string();
  }
}

// A bad shape on one rank (dispatch, or combine) fails every rank at once, naming the rank and the
// argument, long before the 5 s timeout.
TEST(MoeEpEmulation, BadShapeOnOneRankFailsEveryRank) {
  for (int phase = 0; phase < 2; ++phase) {
    Fixture f(std::chrono::milliseconds(5000));
    std::vector<Status> st(4);
    const auto t0 = std::chrono::steady_clock::now();
    run_ranks(4, [&](int r) {
      EpReceived v;
      Bytes out;
      if (r == 1 && phase == 0) {  // x with H + 1 columns
        Bytes x(size_t(f.c.m[1] * (f.c.H + 1)) * 2);
        st[1] = f.ep[1]->dispatch(mat(x.data(), f.c.dtype, f.c.m[1], f.c.H + 1), mat(f.rd->ids[1].data(), DType::kInt32, f.c.m[1], f.c.k), {}, &v);
        return;
      }
      if (r == 1) {  // combine with weights for k - 1 experts
        Case c = f.c;
        st[1] = f.ep[1]->dispatch(mat(f.rd->x[1].data(), c.dtype, c.m[1], c.H), mat(f.rd->ids[1].data(), DType::kInt32, c.m[1], c.k), {}, &v);
        if (!st[1]) return;
        Bytes y(size_t(v.rows() * c.H) * 2), o(size_t(c.m[1] * c.H) * 2);
        st[1] = f.ep[1]->combine(mat(y.data(), c.dtype, v.rows(), c.H), mat(f.rd->w[1].data(), DType::kFP32, c.m[1], c.k - 1),
                                 mat(o.data(), c.dtype, c.m[1], c.H));
        return;
      }
      st[size_t(r)] = ep_layer(*f.ep[size_t(r)], f.c, *f.rd, f.w13, f.w2, &v, &out);
    });
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(secs, 2.0);
    const std::string what = phase == 0 ? "x: shape must be [m, H] = [3, 32], got [3, 33]" : "topk_weights: shape must be [m, k] = [3, 2], got [3, 1]";
    EXPECT_TRUE(has(st[1], "ep rank 1: " + std::string(phase == 0 ? "dispatch" : "combine") + " round 1: " + what)) << st[1].to_string();
    for (int r : {0, 2, 3}) EXPECT_TRUE(has(st[size_t(r)], "because rank 1 failed") && has(st[size_t(r)], what)) << st[size_t(r)].to_string();
  }
}

}  // namespace
}  // namespace encore::test
