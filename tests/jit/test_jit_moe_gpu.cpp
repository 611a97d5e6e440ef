// The JIT MoE routing, dispatch and combine on the GPU: the dispatcher's JIT path (launch counters)
// and the ahead-of-time kernels on the SAME inputs (generated once per case), each against the CPU
// reference, and against each other bit for bit (same source, same math: only E, k, D and the groups
// are constants); outputs poisoned before every run; shapes outside the AOT lists (E not a multiple
// of 32, odd k, odd D), both dispatch paths forced; moe_forward with the three JIT paths equal to
// the AOT layer; graph capture refusing to compile, then `warm-up first` capturing the JIT kernels.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "encore/core/device_info.hpp"
#include "encore/moe.hpp"
#include "jit/jit.hpp"
#include "moe/args.hpp"
#include "moe/jit.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/jit/capture.hpp"

namespace encore::test {
namespace {

class JitMoeGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    if (!jit::nvrtc_info().available) GTEST_SKIP() << "NVRTC not available: " << jit::nvrtc_info().library;
  }
  void TearDown() override {
    moe::set_routing_jit_policy(moe::JitPolicy::kEnv);
    moe::set_dispatch_jit_policy(moe::JitPolicy::kEnv);
    moe::set_combine_jit_policy(moe::JitPolicy::kEnv);
  }
};

void poison(HostTensor& h, unsigned char byte) { std::memset(h.bytes.data(), byte, h.bytes.size()); }
HostTensor poisoned(DType t, int64_t rows, int64_t cols, unsigned char byte) {
  HostTensor h(t, rows, cols);
  poison(h, byte);
  return h;
}
HostTensor poisoned_vec(int64_t n) {
  HostTensor h = HostTensor::vector(DType::kInt32, n);
  poison(h, 0x7f);
  return h;
}
size_t bytes_differ(const HostTensor& a, const HostTensor& b) {
  size_t n = a.bytes.size() == b.bytes.size() ? 0 : 1;
  for (size_t i = 0; i < std::min(a.bytes.size(), b.bytes.size()); ++i) n += a.bytes[i] != b.bytes[i];
  return n;
}
uint64_t fresh_seed() {
  const uint64_t s = (uint64_t(std::random_device{}()) << 32) | std::random_device{}();
  std::printf("  [seed] %llu\n", (unsigned long long)s);
  return s;
}
std::vector<int> range(int n) {
  std::vector<int> v(size_t(n), 0);
  for (int i = 0; i < n; ++i) v[size_t(i)] = i;
  return v;
}

// ---- routing ----
struct RoutingInputs {
  HostTensor logits, bias;
  MoeRoutingOptions o;
  bool use_bias = false;
};
struct RoutingOut {
  HostTensor ids, w;
};
RoutingOut routing_run(const RoutingInputs& in, bool gpu, moe::JitPolicy policy, Stream stream = nullptr) {
  const int64_t T = in.logits.rows;
  const int k = in.o.top_k;
  RoutingOut out{poisoned(DType::kInt32, T, k, 0x7f), poisoned(DType::kFP32, T, k, 0xff)};
  if (!gpu) {
    Status st = run(MoeRoutingArgs{in.logits.view(), in.use_bias ? in.bias.view() : TensorView{}, out.ids.view(), out.w.view()}, in.o);
    EXPECT_TRUE(st) << st.to_string();
    return out;
  }
  DeviceBuffer dl(in.logits.storage_bytes()), db(in.bias.storage_bytes()), di(out.ids.storage_bytes()), dw(out.w.storage_bytes());
  moe::set_routing_jit_policy(policy);
  Status st = run(MoeRoutingArgs{to_device(in.logits, dl), in.use_bias ? to_device(in.bias, db) : TensorView{}, to_device(out.ids, di),
                                 to_device(out.w, dw)},
                  in.o, nullptr, stream);
  EXPECT_TRUE(st) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  from_device(out.ids, di);
  from_device(out.w, dw);
  return out;
}
void expect_routing_close(const RoutingOut& g, const RoutingOut& c, const char* what) {
  EXPECT_EQ(bytes_differ(g.ids, c.ids), 0u) << what << ": ids differ";
  const float* gw = reinterpret_cast<const float*>(g.w.bytes.data());
  const float* cw = reinterpret_cast<const float*>(c.w.bytes.data());
  size_t bad = 0;
  for (int64_t i = 0; i < g.w.storage_elems(); ++i) bad += !(std::fabs(double(gw[i]) - cw[i]) <= 1e-6 * std::fabs(double(cw[i])) + 1e-30);
  EXPECT_EQ(bad, 0u) << what << ": weights beyond 1e-6 relative";
}

TEST_F(JitMoeGpu, RoutingOutsideTheListMatchesCpuAndAheadOfTime) {
  struct Case {
    DType dtype;
    int E, k, n_group, topk_group;
    MoeScoring scoring;
    bool bias;
  };
  const Case cases[] = {{DType::kBF16, 160, 6, 1, 1, MoeScoring::kSoftmax, false}, {DType::kFP32, 160, 6, 8, 3, MoeScoring::kSigmoid, true},
                        {DType::kFP16, 33, 2, 1, 1, MoeScoring::kSoftmax, false},  {DType::kBF16, 512, 8, 8, 4, MoeScoring::kSigmoid, true},
                        {DType::kFP32, 1, 1, 1, 1, MoeScoring::kSoftmax, false},   {DType::kBF16, 96, 96, 1, 1, MoeScoring::kSoftmax, false}};
  std::mt19937_64 rng(fresh_seed());
  for (const Case& c : cases) {
    for (int64_t T : {int64_t(1), int64_t(7), int64_t(333)}) {
      SCOPED_TRACE(std::string(dtype_name(c.dtype)) + " E" + std::to_string(c.E) + " k" + std::to_string(c.k) + " g" +
                   std::to_string(c.n_group) + "/" + std::to_string(c.topk_group) + " T" + std::to_string(T));
      ASSERT_FALSE(moe::routing_shape_in_aot_list(c.E, c.k));
      RoutingInputs in{HostTensor(c.dtype, T, c.E), HostTensor::vector(DType::kFP32, c.E), {}, c.bias};
      in.logits.fill_normal(rng, 0.0, 2.0);
      in.bias.fill_normal(rng, 0.0, 0.2);
      in.o = MoeRoutingOptions{c.k, c.scoring, true, c.n_group, c.topk_group, 2.5f};
      const int64_t before = moe::routing_jit_launch_count();
      const RoutingOut j = routing_run(in, true, moe::JitPolicy::kAuto);
      ASSERT_EQ(moe::routing_jit_launch_count(), before + 1) << "the dispatcher did not take the JIT path (auto, shape outside the list)";
      const RoutingOut a = routing_run(in, true, moe::JitPolicy::kOff);
      ASSERT_EQ(moe::routing_jit_launch_count(), before + 1) << "policy off still launched a JIT kernel";
      const RoutingOut cpu = routing_run(in, false, moe::JitPolicy::kEnv);
      expect_routing_close(j, cpu, "JIT vs CPU reference");
      expect_routing_close(a, cpu, "AOT vs CPU reference");
      EXPECT_EQ(bytes_differ(j.ids, a.ids) + bytes_differ(j.w, a.w), 0u) << "JIT and AOT differ on the same inputs (expected bit-identical)";
    }
  }
}

TEST_F(JitMoeGpu, RoutingListedShapeStaysAheadOfTimeUnderAuto) {
  std::mt19937_64 rng(fresh_seed());
  RoutingInputs in{HostTensor(DType::kBF16, 9, 128), HostTensor::vector(DType::kFP32, 128), MoeRoutingOptions{8}, false};
  in.logits.fill_normal(rng, 0.0, 2.0);
  const int64_t before = moe::routing_jit_launch_count();
  const RoutingOut a = routing_run(in, true, moe::JitPolicy::kAuto);
  EXPECT_EQ(moe::routing_jit_launch_count(), before) << "auto must keep (E 128, k 8) on the AOT kernel";
  const RoutingOut j = routing_run(in, true, moe::JitPolicy::kAlways);
  EXPECT_EQ(moe::routing_jit_launch_count(), before + 1) << "always: every shape";
  EXPECT_EQ(bytes_differ(j.ids, a.ids) + bytes_differ(j.w, a.w), 0u);
}

// ---- dispatch ----
enum class Path { kHostPlan, kDecode, kPrefill };
struct DispatchOut {
  HostTensor counts, offsets, slots, rows, xp;
};
// ids [T, k] with distinct experts per token (as routing gives).
HostTensor random_ids(std::mt19937_64& rng, int64_t T, int k, int E) {
  HostTensor ids(DType::kInt32, T, k);
  std::vector<int> p = range(E);
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      std::uniform_int_distribution<size_t> d(size_t(j), p.size() - 1);
      std::swap(p[size_t(j)], p[d(rng)]);
      reinterpret_cast<int32_t*>(ids.bytes.data())[t * k + j] = p[size_t(j)];
    }
  return ids;
}
DispatchOut dispatch_run(const HostTensor& ids, const HostTensor& x, int E, int align, Path path, bool gpu, moe::JitPolicy policy) {
  const int64_t T = ids.rows;
  const int k = int(ids.cols);
  const int64_t R = moe_permuted_rows(T, k, E, align) + 3;  // 3 rows past what is needed: must stay untouched
  DispatchOut out{poisoned_vec(E), poisoned_vec(E + 1), poisoned(DType::kInt32, T, k, 0x7f), poisoned_vec(R), poisoned(x.dtype, R, x.cols, 0xff)};
  const MoeDispatchOptions o{E, align};
  if (!gpu) {
    MoeDispatchArgs a{ids.view(), x.view(), out.counts.view(), out.offsets.view(), out.slots.view(), out.rows.view(), out.xp.view()};
    std::vector<int32_t> ws(workspace_bytes(a, o) / 4 + 4);
    Status st = run(a, o, ws.data());
    EXPECT_TRUE(st) << st.to_string();
    return out;
  }
  DeviceBuffer di(ids.storage_bytes()), dx(x.storage_bytes()), dc(out.counts.storage_bytes()), doff(out.offsets.storage_bytes()),
      ds(out.slots.storage_bytes()), dr(out.rows.storage_bytes()), dxp(out.xp.storage_bytes());
  MoeDispatchArgs a{to_device(ids, di),       to_device(x, dx),        to_device(out.counts, dc), to_device(out.offsets, doff),
                    to_device(out.slots, ds), to_device(out.rows, dr), to_device(out.xp, dxp)};
  const size_t ws_bytes = workspace_bytes(a, o);
  DeviceBuffer dws(ws_bytes);
  EXPECT_EQ(cudaMemset(dws.ptr, 0x7f, ws_bytes), cudaSuccess);  // the kernels may not rely on a clean workspace
  moe::set_dispatch_jit_policy(policy);
  Status st;
  if (path == Path::kHostPlan) {
    st = run(a, o, dws.ptr);
  } else {
    st = validate(a, o);
    const moe::DispatchPlan plan =
        moe::plan_moe_dispatch(T, k, E, 132, path == Path::kDecode ? moe::DispatchPath::kSingleBlock : moe::DispatchPath::kCountThenScatter);
    if (st) st = moe::cuda_dispatch(moe::make_dispatch_problem(a, o, dws.ptr), plan, 0, nullptr);
  }
  EXPECT_TRUE(st) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  from_device(out.counts, dc);
  from_device(out.offsets, doff);
  from_device(out.slots, ds);
  from_device(out.rows, dr);
  from_device(out.xp, dxp);
  return out;
}
void expect_same(const DispatchOut& g, const DispatchOut& c, const char* what) {
  EXPECT_EQ(bytes_differ(g.counts, c.counts), 0u) << what << ": expert_counts";
  EXPECT_EQ(bytes_differ(g.offsets, c.offsets), 0u) << what << ": expert_offsets";
  EXPECT_EQ(bytes_differ(g.slots, c.slots), 0u) << what << ": slot_rows";
  EXPECT_EQ(bytes_differ(g.rows, c.rows), 0u) << what << ": row_slots";
  EXPECT_EQ(bytes_differ(g.xp, c.xp), 0u) << what << ": x_permuted";
}

TEST_F(JitMoeGpu, DispatchOutsideTheListMatchesCpuAndAheadOfTime) {
  struct Case {
    int64_t T;
    int k, E, align;
    DType dtype;
    int64_t D;
  };
  const Case cases[] = {{1, 6, 160, 128, DType::kBF16, 5120}, {7, 6, 160, 8, DType::kBF16, 5120}, {333, 6, 160, 1, DType::kFP16, 72},
                        {4099, 6, 160, 128, DType::kBF16, 256}, {37, 3, 1000, 8, DType::kFP32, 3},   {5, 1, 1, 16, DType::kBF16, 64},
                        {129, 16, 1024, 1, DType::kBF16, 128}};
  std::mt19937_64 rng(fresh_seed());
  for (const Case& c : cases) {
    const HostTensor ids = random_ids(rng, c.T, c.k, c.E);
    HostTensor x(c.dtype, c.T, c.D);
    x.fill_normal(rng);
    const DispatchOut cpu = dispatch_run(ids, x, c.E, c.align, Path::kHostPlan, false, moe::JitPolicy::kEnv);
    for (Path path : {Path::kHostPlan, Path::kDecode, Path::kPrefill}) {
      SCOPED_TRACE("T" + std::to_string(c.T) + " k" + std::to_string(c.k) + " E" + std::to_string(c.E) + " align" + std::to_string(c.align) +
                   (path == Path::kHostPlan ? " host plan" : path == Path::kDecode ? " decode" : " prefill"));
      ASSERT_FALSE(moe::dispatch_shape_in_aot_list(c.E, c.k));
      const int64_t before = moe::dispatch_jit_launch_count();
      const DispatchOut j = dispatch_run(ids, x, c.E, c.align, path, true, moe::JitPolicy::kAuto);
      ASSERT_GT(moe::dispatch_jit_launch_count(), before) << "the dispatcher did not take the JIT path (auto, shape outside the list)";
      const int64_t after = moe::dispatch_jit_launch_count();
      const DispatchOut a = dispatch_run(ids, x, c.E, c.align, path, true, moe::JitPolicy::kOff);
      ASSERT_EQ(moe::dispatch_jit_launch_count(), after) << "policy off still launched a JIT kernel";
      expect_same(j, cpu, "JIT vs CPU reference");
      expect_same(a, cpu, "AOT vs CPU reference");
    }
  }
}

// ---- combine ----
struct CombineInputs {
  HostTensor y, slots, w;
  DType out;
};
HostTensor combine_run(const CombineInputs& in, bool gpu, moe::JitPolicy policy, Stream stream = nullptr) {
  HostTensor out = poisoned(in.out, in.slots.rows, in.y.cols, 0xff);
  if (!gpu) {
    Status st = run(MoeCombineArgs{in.y.view(), in.slots.view(), in.w.view(), out.view()}, MoeCombineOptions{});
    EXPECT_TRUE(st) << st.to_string();
    return out;
  }
  DeviceBuffer dy(in.y.storage_bytes()), ds(in.slots.storage_bytes()), dw(in.w.storage_bytes()), dout(out.storage_bytes());
  moe::set_combine_jit_policy(policy);
  Status st = run(MoeCombineArgs{to_device(in.y, dy), to_device(in.slots, ds), to_device(in.w, dw), to_device(out, dout)}, MoeCombineOptions{},
                  nullptr, stream);
  EXPECT_TRUE(st) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  from_device(out, dout);
  return out;
}
CombineInputs combine_inputs(std::mt19937_64& rng, DType in, DType out, int64_t T, int k, int64_t D) {
  const int64_t R = T * k + 5;
  CombineInputs c{HostTensor(in, R, D), HostTensor(DType::kInt32, T, k), HostTensor(DType::kFP32, T, k), out};
  c.y.fill_normal(rng, 0.0, 1.0);
  c.w.fill_normal(rng, 0.1, 0.5);
  std::uniform_int_distribution<int32_t> row(0, int32_t(R - 1));
  for (int64_t i = 0; i < T * k; ++i) reinterpret_cast<int32_t*>(c.slots.bytes.data())[i] = row(rng);
  return c;
}

TEST_F(JitMoeGpu, CombineOutsideTheListMatchesCpuAndAheadOfTime) {
  struct Case {
    DType in, out;
    int k;
    int64_t D;
  };
  const Case cases[] = {{DType::kBF16, DType::kBF16, 6, 5120}, {DType::kFP16, DType::kFP32, 8, 4160}, {DType::kFP32, DType::kBF16, 3, 100},
                        {DType::kBF16, DType::kFP16, 1, 8},    {DType::kBF16, DType::kBF16, 13, 2056}, {DType::kFP32, DType::kFP32, 8, 7}};
  std::mt19937_64 rng(fresh_seed());
  for (const Case& c : cases) {
    for (int64_t T : {int64_t(1), int64_t(7), int64_t(513)}) {
      SCOPED_TRACE(std::string(dtype_name(c.in)) + "->" + dtype_name(c.out) + " k" + std::to_string(c.k) + " D" + std::to_string(c.D) +
                   " T" + std::to_string(T));
      ASSERT_FALSE(moe::combine_shape_in_aot_list(c.D, c.k));
      const CombineInputs in = combine_inputs(rng, c.in, c.out, T, c.k, c.D);
      const int64_t before = moe::combine_jit_launch_count();
      const HostTensor j = combine_run(in, true, moe::JitPolicy::kAuto);
      ASSERT_EQ(moe::combine_jit_launch_count(), before + 1) << "the dispatcher did not take the JIT path (auto, shape outside the list)";
      const HostTensor a = combine_run(in, true, moe::JitPolicy::kOff);
      ASSERT_EQ(moe::combine_jit_launch_count(), before + 1) << "policy off still launched a JIT kernel";
      const HostTensor cpu = combine_run(in, false, moe::JitPolicy::kEnv);
      EXPECT_EQ(bytes_differ(j, cpu), 0u) << "JIT vs CPU reference (the kernel's fma chain is the reference's: bit-equal)";
      EXPECT_EQ(bytes_differ(a, cpu), 0u) << "AOT vs CPU reference";
    }
  }
}

// ---- the layer: moe_forward's routing, dispatch and combine through the same dispatchers ----
TEST_F(JitMoeGpu, ForwardJitEqualsAheadOfTime) {
  struct Case {
    int64_t T, D, F;
    int E, k, align;
  };
  const Case cases[] = {{37, 200, 64, 40, 3, 8}, {1, 128, 64, 24, 5, 128}, {700, 64, 32, 160, 6, 1}};
  std::mt19937_64 rng(fresh_seed());
  const Device gpu{DeviceType::kCUDA, 0};
  for (const Case& c : cases) {
    SCOPED_TRACE("T" + std::to_string(c.T) + " D" + std::to_string(c.D) + " F" + std::to_string(c.F) + " E" + std::to_string(c.E) + " k" +
                 std::to_string(c.k));
    HostTensor x(DType::kBF16, c.T, c.D), logits(DType::kFP32, c.T, c.E), w13(DType::kBF16, int64_t(c.E) * 2 * c.F, c.D),
        w2(DType::kBF16, int64_t(c.E) * c.D, c.F);
    x.fill_normal(rng);
    logits.fill_normal(rng, 0.0, 2.0);
    w13.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(c.D)));
    w2.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(c.F)));
    MoeOptions o;
    o.routing.top_k = c.k;
    o.align_m = c.align;
    const MoeLayerShape shape{c.T, c.D, c.F, c.E, DType::kBF16};
    const size_t bytes = moe_buffers_bytes(shape, o);
    DeviceBuffer dx(x.storage_bytes()), dl(logits.storage_bytes()), dw13(w13.storage_bytes()), dw2(w2.storage_bytes()),
        dout(size_t(c.T * c.D) * 2), dbase(bytes);
    MoeBuffers b;
    ASSERT_TRUE(moe_buffers_carve(shape, o, dbase.ptr, bytes, gpu, &b));
    const MoeForwardArgs a{to_device(x, dx),
                           to_device(logits, dl),
                           {},
                           TensorView::contiguous(dw13.ptr, DType::kBF16, {c.E, 2 * c.F, c.D}, gpu),
                           TensorView::contiguous(dw2.ptr, DType::kBF16, {c.E, c.D, c.F}, gpu),
                           b,
                           TensorView::contiguous(dout.ptr, DType::kBF16, {c.T, c.D}, gpu)};
    ASSERT_EQ(cudaMemcpy(dw13.ptr, w13.bytes.data(), w13.storage_bytes(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dw2.ptr, w2.bytes.data(), w2.storage_bytes(), cudaMemcpyHostToDevice), cudaSuccess);
    auto forward = [&](moe::JitPolicy policy) {
      moe::set_routing_jit_policy(policy);
      moe::set_dispatch_jit_policy(policy);
      moe::set_combine_jit_policy(policy);
      EXPECT_EQ(cudaMemset(dbase.ptr, 0xff, bytes), cudaSuccess);  // every buffer poisoned
      EXPECT_EQ(cudaMemset(dout.ptr, 0xff, size_t(c.T * c.D) * 2), cudaSuccess);
      Status st = run(a, o);
      EXPECT_TRUE(st) << st.to_string();
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      HostTensor out(DType::kBF16, c.T, c.D);
      from_device(out, dout);
      return out;
    };
    const int64_t r0 = moe::routing_jit_launch_count(), d0 = moe::dispatch_jit_launch_count(), c0 = moe::combine_jit_launch_count();
    const HostTensor j = forward(moe::JitPolicy::kAlways);
    EXPECT_EQ(moe::routing_jit_launch_count(), r0 + 1);
    EXPECT_GT(moe::dispatch_jit_launch_count(), d0);
    EXPECT_EQ(moe::combine_jit_launch_count(), c0 + 1) << "the layer did not take the JIT paths";
    const HostTensor aot = forward(moe::JitPolicy::kOff);
    EXPECT_EQ(bytes_differ(j, aot), 0u) << "moe_forward: JIT and AOT outputs differ (same routing, maps and combine: expected bit-identical)";
  }
}

// ---- graph capture: never a compile, then warm-up first ----
TEST_F(JitMoeGpu, GraphCaptureNeverCompilesThenWarmupFirst) {
  std::mt19937_64 rng(fresh_seed());
  TestStream ts;
  // Routing: a shape no other test compiles in this process.
  RoutingInputs rin{HostTensor(DType::kBF16, 5, 72), HostTensor::vector(DType::kFP32, 72), MoeRoutingOptions{5}, false};
  rin.logits.fill_normal(rng, 0.0, 2.0);
  HostTensor ids = poisoned(DType::kInt32, 5, 5, 0x7f), w = poisoned(DType::kFP32, 5, 5, 0xff);
  DeviceBuffer dl(rin.logits.storage_bytes()), di(ids.storage_bytes()), dw(w.storage_bytes());
  const MoeRoutingArgs ra{to_device(rin.logits, dl), {}, to_device(ids, di), to_device(w, dw)};
  auto rop = [&](cudaStream_t s) { return run(ra, rin.o, nullptr, s); };
  moe::set_routing_jit_policy(moe::JitPolicy::kAlways);
  Status st = run_captured(ts.s, rop);
  EXPECT_FALSE(st) << "routing: a compile was allowed inside a graph capture";
  EXPECT_NE(st.message().find("encore jit warmup"), std::string::npos) << st.to_string();
  ASSERT_TRUE(moe::routing_jit_warmup({DType::kBF16, 72, 5, 1, 1}, 0, "", nullptr, nullptr));
  int64_t before = moe::routing_jit_launch_count();
  cudaGraph_t g = nullptr;
  st = run_captured(ts.s, rop, &g);
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_EQ(moe::routing_jit_launch_count(), before + 1) << "the capture recorded the AOT kernel, not the JIT one";
  ASSERT_TRUE(replay(g, ts.s));
  RoutingOut got{ids, w};
  from_device(got.ids, di);
  from_device(got.w, dw);
  expect_routing_close(got, routing_run(rin, false, moe::JitPolicy::kEnv), "routing graph replay vs CPU reference");

  // Dispatch (decode path through the host plan): E 44, k 3 (no other test compiles E 44: ForwardJitEqualsAheadOfTime has E 40).
  const HostTensor dids = random_ids(rng, 6, 3, 44);
  HostTensor x(DType::kBF16, 6, 64);
  x.fill_normal(rng);
  const int64_t R = moe_permuted_rows(6, 3, 44, 8);
  DispatchOut d{poisoned_vec(44), poisoned_vec(45), poisoned(DType::kInt32, 6, 3, 0x7f), poisoned_vec(R), poisoned(DType::kBF16, R, 64, 0xff)};
  DeviceBuffer b_ids(dids.storage_bytes()), b_x(x.storage_bytes()), b_c(d.counts.storage_bytes()), b_o(d.offsets.storage_bytes()),
      b_s(d.slots.storage_bytes()), b_r(d.rows.storage_bytes()), b_xp(d.xp.storage_bytes());
  const MoeDispatchArgs da{to_device(dids, b_ids), to_device(x, b_x), to_device(d.counts, b_c), to_device(d.offsets, b_o),
                           to_device(d.slots, b_s), to_device(d.rows, b_r), to_device(d.xp, b_xp)};
  const MoeDispatchOptions dopt{44, 8};
  DeviceBuffer b_ws(workspace_bytes(da, dopt));
  auto dop = [&](cudaStream_t s) { return run(da, dopt, b_ws.ptr, s); };
  moe::set_dispatch_jit_policy(moe::JitPolicy::kAlways);
  st = run_captured(ts.s, dop);
  EXPECT_FALSE(st) << "dispatch: a compile was allowed inside a graph capture";
  EXPECT_NE(st.message().find("encore jit warmup"), std::string::npos) << st.to_string();
  for (const auto& v : moe::dispatch_jit_variants(44, 3)) ASSERT_TRUE(moe::dispatch_jit_warmup(v, 0, "", nullptr, nullptr));
  before = moe::dispatch_jit_launch_count();
  st = run_captured(ts.s, dop, &g);
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_EQ(moe::dispatch_jit_launch_count(), before + 1) << "decode: one JIT map kernel recorded";
  ASSERT_TRUE(replay(g, ts.s));
  DispatchOut dg = d;
  from_device(dg.counts, b_c);
  from_device(dg.offsets, b_o);
  from_device(dg.slots, b_s);
  from_device(dg.rows, b_r);
  from_device(dg.xp, b_xp);
  DispatchOut dc = d;
  {
    MoeDispatchArgs ca{dids.view(), x.view(), dc.counts.view(), dc.offsets.view(), dc.slots.view(), dc.rows.view(), dc.xp.view()};
    std::vector<int32_t> ws(workspace_bytes(ca, dopt) / 4 + 4);
    ASSERT_TRUE(run(ca, dopt, ws.data()));
  }
  expect_same(dg, dc, "dispatch graph replay vs CPU reference");

  // Combine: D 200, k 7.
  const CombineInputs cin = combine_inputs(rng, DType::kBF16, DType::kBF16, 3, 7, 200);
  HostTensor out = poisoned(DType::kBF16, 3, 200, 0xff);
  DeviceBuffer c_y(cin.y.storage_bytes()), c_s(cin.slots.storage_bytes()), c_w(cin.w.storage_bytes()), c_out(out.storage_bytes());
  const MoeCombineArgs ca{to_device(cin.y, c_y), to_device(cin.slots, c_s), to_device(cin.w, c_w), to_device(out, c_out)};
  auto cop = [&](cudaStream_t s) { return run(ca, MoeCombineOptions{}, nullptr, s); };
  moe::set_combine_jit_policy(moe::JitPolicy::kAlways);
  st = run_captured(ts.s, cop);
  EXPECT_FALSE(st) << "combine: a compile was allowed inside a graph capture";
  EXPECT_NE(st.message().find("encore jit warmup"), std::string::npos) << st.to_string();
  ASSERT_TRUE(moe::combine_jit_warmup({DType::kBF16, DType::kBF16, 8, 7, 200}, 0, "", nullptr, nullptr));
  before = moe::combine_jit_launch_count();
  st = run_captured(ts.s, cop, &g);
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_EQ(moe::combine_jit_launch_count(), before + 1);
  ASSERT_TRUE(replay(g, ts.s));
  from_device(out, c_out);
  EXPECT_EQ(bytes_differ(out, combine_run(cin, false, moe::JitPolicy::kEnv)), 0u) << "combine graph replay vs CPU reference";
}

}  // namespace
}  // namespace encore::test
