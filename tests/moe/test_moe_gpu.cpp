// CUDA moe ops against the CPU backend on fresh random inputs, outputs poisoned before every run:
// routing ids exactly equal and weights within 1e-6 relative (softmax, grouped sigmoid + bias, ties,
// E = 1, k = E, T = 1, odd T, Qwen3- and DeepSeek-V3-sized batches, E up to the CUDA limit); dispatch
// counts, offsets, slot_rows, row_slots and x_permuted bit-equal (align_m 1 / 8 / 128, an expert with
// no token, all tokens to one expert, maps only, both CUDA paths forced and the host plan); combine
// bit-equal in every dtype pair; routing -> dispatch -> combine chained on the device; reruns
// bit-exact; bad inputs on CUDA by message.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "encore/moe.hpp"
#include "moe/args.hpp"
#include "moe/cuda/launch.hpp"
#include "moe/problem.hpp"
#include "tests/common/aot_kernels.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {
namespace {

const Device kGpu{DeviceType::kCUDA, 0};

class MoeGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    pin_aot_kernels(true);
  }
  void TearDown() override { pin_aot_kernels(false); }
};

void poison(HostTensor& h, unsigned char byte) { std::memset(h.bytes.data(), byte, h.bytes.size()); }

HostTensor ints(int64_t rows, int64_t cols) {
  HostTensor h(DType::kInt32, rows, cols);
  poison(h, 0x7f);
  return h;
}
HostTensor int_vec(int64_t n) {
  HostTensor h = HostTensor::vector(DType::kInt32, n);
  poison(h, 0x7f);
  return h;
}
int32_t* i32(HostTensor& h) { return reinterpret_cast<int32_t*>(h.bytes.data()); }
const int32_t* i32(const HostTensor& h) { return reinterpret_cast<const int32_t*>(h.bytes.data()); }
const float* f32(const HostTensor& h) { return reinterpret_cast<const float*>(h.bytes.data()); }

bool same_bytes(const HostTensor& a, const HostTensor& b) {
  return a.storage_bytes() == b.storage_bytes() && std::memcmp(a.bytes.data(), b.bytes.data(), a.storage_bytes()) == 0;
}

// First differing int32 element, for messages.
std::string first_diff_i32(const HostTensor& g, const HostTensor& c) {
  const int64_t n = g.storage_elems();
  for (int64_t i = 0; i < n; ++i)
    if (i32(g)[i] != i32(c)[i])
      return "element " + std::to_string(i) + " (row " + std::to_string(i / g.row_stride) + "): gpu " + std::to_string(i32(g)[i]) +
             " cpu " + std::to_string(i32(c)[i]);
  return "none";
}

std::string first_diff_bytes(const HostTensor& g, const HostTensor& c) {
  const size_t esz = dtype_size(g.dtype);
  for (size_t i = 0; i < g.storage_bytes(); ++i)
    if (g.bytes[i] != c.bytes[i]) {
      const int64_t el = int64_t(i / esz);
      return "byte " + std::to_string(i) + " (row " + std::to_string(el / g.row_stride) + ", col " + std::to_string(el % g.row_stride) +
             "): gpu " + std::to_string(g.get(el / g.row_stride, el % g.row_stride)) + " cpu " +
             std::to_string(c.get(el / c.row_stride, el % c.row_stride));
    }
  return "none";
}

// ---- routing ----------------------------------------------------------------------------------------

struct RoutingCase {
  const char* name;
  DType dtype;
  int64_t T;
  int E, k;
  MoeScoring scoring;
  bool renorm, bias;
  int n_group, topk_group;
  float scale;
  int tie_levels;  // 0: normal logits; else logits from tie_levels values (many exact ties)
};

void run_routing_case(const RoutingCase& c) {
  SCOPED_TRACE(c.name);
  auto rng = make_rng(uint64_t(c.T * 131 + c.E * 7 + c.k));
  HostTensor logits(c.dtype, c.T, c.E);
  if (c.tie_levels > 0) {
    std::uniform_int_distribution<int> lv(0, c.tie_levels - 1);
    for (int64_t t = 0; t < c.T; ++t)
      for (int e = 0; e < c.E; ++e) logits.set(t, e, 0.5 * lv(rng));
  } else {
    logits.fill_normal(rng, 0.0, 2.0);
  }
  HostTensor bias = HostTensor::vector(DType::kFP32, c.E);
  bias.fill_normal(rng, 0.0, 0.2);
  const MoeRoutingOptions o{c.k, c.scoring, c.renorm, c.n_group, c.topk_group, c.scale};

  HostTensor cpu_ids = ints(c.T, c.k), cpu_w(DType::kFP32, c.T, c.k);
  poison(cpu_w, 0xff);
  ASSERT_TRUE(run(MoeRoutingArgs{logits.view(), c.bias ? bias.view() : TensorView{}, cpu_ids.view(), cpu_w.view()}, o));

  DeviceBuffer dl(logits.storage_bytes()), db(bias.storage_bytes()), di(cpu_ids.storage_bytes()), dw(cpu_w.storage_bytes());
  ASSERT_TRUE(dl.ptr && db.ptr && di.ptr && dw.ptr);
  const TensorView lv = to_device(logits, dl), bv = c.bias ? to_device(bias, db) : TensorView{};
  HostTensor first_ids, first_w;
  for (int rep = 0; rep < 2; ++rep) {
    HostTensor gpu_ids = ints(c.T, c.k), gpu_w(DType::kFP32, c.T, c.k);
    poison(gpu_w, 0xff);
    const MoeRoutingArgs a{lv, bv, to_device(gpu_ids, di), to_device(gpu_w, dw)};
    const Status st = run(a, o);
    ASSERT_TRUE(st) << st.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    from_device(gpu_ids, di);
    from_device(gpu_w, dw);
    ASSERT_TRUE(same_bytes(gpu_ids, cpu_ids)) << "ids differ at " << first_diff_i32(gpu_ids, cpu_ids);
    int64_t bad = 0;
    std::string first;
    for (int64_t i = 0; i < c.T * c.k; ++i) {
      const double g = f32(gpu_w)[i], r = f32(cpu_w)[i];
      if (!(std::fabs(g - r) <= 1e-6 * std::fabs(r) + 1e-30)) {
        if (bad++ == 0) first = "slot " + std::to_string(i) + ": gpu " + std::to_string(g) + " cpu " + std::to_string(r);
      }
    }
    EXPECT_EQ(bad, 0) << "weights beyond 1e-6 relative, first " << first;
    if (rep == 0) {
      first_ids = gpu_ids;
      first_w = gpu_w;
    } else {
      EXPECT_TRUE(same_bytes(gpu_ids, first_ids) && same_bytes(gpu_w, first_w)) << "rerun is not bit-exact";
    }
  }
}

TEST_F(MoeGpu, RoutingMatchesCpu) {
  const DType f = DType::kFP32, b = DType::kBF16, h = DType::kFP16;
  const MoeScoring sm = MoeScoring::kSoftmax, sg = MoeScoring::kSigmoid;
  const RoutingCase cases[] = {
      {"Softmax_T37_E8_k2_renorm", f, 37, 8, 2, sm, true, false, 1, 1, 1.f, 0},
      {"Softmax_T1_E64_k8_raw", f, 1, 64, 8, sm, false, false, 1, 1, 1.f, 0},
      {"Softmax_T13_E1_k1", f, 13, 1, 1, sm, true, false, 1, 1, 1.f, 0},
      {"Sigmoid_T7_E1_k1_bias", b, 7, 1, 1, sg, true, true, 1, 1, 1.f, 0},
      {"Softmax_T5_E6_kE", f, 5, 6, 6, sm, false, false, 1, 1, 1.f, 0},
      {"Softmax_T3_E40_kE_bf16", b, 3, 40, 40, sm, true, false, 1, 1, 1.f, 0},
      {"SoftmaxGrouped_T29_E16_k4_g4_tg2", f, 29, 16, 4, sm, true, false, 4, 2, 1.f, 0},
      {"SigmoidBiasGrouped_T41_E32_k8_g8_tg4", f, 41, 32, 8, sg, true, true, 8, 4, 2.5f, 0},
      {"SigmoidBias_T3_E7_k3", f, 3, 7, 3, sg, false, true, 1, 1, 1.f, 0},
      {"SigmoidGroupsOfOne_T9_E8_k3", f, 9, 8, 3, sg, true, true, 8, 3, 1.f, 0},
      {"Ties_Softmax_T301_E64_k8", f, 301, 64, 8, sm, true, false, 1, 1, 1.f, 3},
      {"Ties_SigmoidGrouped_T257_E64_k6_g8_tg3", f, 257, 64, 6, sg, true, false, 8, 3, 1.f, 2},
      {"Ties_SigmoidGroupedBias0_T99_E32_k4_g4_tg2_bf16", b, 99, 32, 4, sg, true, false, 4, 2, 1.f, 2},
      {"Softmax_fp16_T333_E96_k6", h, 333, 96, 6, sm, true, false, 1, 1, 1.f, 0},
      {"Qwen3_T4096_E128_k8", b, 4096, 128, 8, sm, true, false, 1, 1, 1.f, 0},
      {"DeepSeekV3_T16384_E256_k8_g8_tg4", f, 16384, 256, 8, sg, true, true, 8, 4, 2.5f, 0},
      {"DeepSeekV3_bf16_T1_E256_k8_g8_tg4", b, 1, 256, 8, sg, true, true, 8, 4, 2.5f, 0},
      {"Max_T65_E512_k8_g16_tg4", f, 65, 512, 8, sg, true, true, 16, 4, 1.f, 0},
      {"Max_T17_E512_k512", f, 17, 512, 512, sm, true, false, 1, 1, 1.f, 0},
  };
  for (const RoutingCase& c : cases) run_routing_case(c);
}

TEST_F(MoeGpu, RoutingExplicitTies) {
  // The CPU test's tie case on the device: equal logits go to the lower expert (and group) index.
  HostTensor logits(DType::kFP32, 3, 10), bias = HostTensor::vector(DType::kFP32, 10);
  for (int t = 0; t < 3; ++t)
    for (int e = 0; e < 10; ++e) logits.set(t, e, 0.5);
  logits.set(1, 7, 2.0);
  for (int e = 0; e < 10; ++e) bias.set(0, e, 0.0);
  DeviceBuffer dl(logits.storage_bytes()), db(bias.storage_bytes()), di(64), dw(64);
  HostTensor ids = ints(3, 3), w(DType::kFP32, 3, 3);
  MoeRoutingOptions o{3, MoeScoring::kSoftmax, true, 1, 1, 1.f};
  for (int pass = 0; pass < 2; ++pass) {
    poison(ids, 0x7f);
    poison(w, 0xff);
    const MoeRoutingArgs a{to_device(logits, dl), pass ? to_device(bias, db) : TensorView{}, to_device(ids, di), to_device(w, dw)};
    const Status st = run(a, o);
    ASSERT_TRUE(st) << st.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    from_device(ids, di);
    from_device(w, dw);
    EXPECT_EQ(std::vector<int32_t>(i32(ids), i32(ids) + 9), (std::vector<int32_t>{0, 1, 2, 7, 0, 1, 0, 1, 2})) << "pass " << pass;
    if (pass == 0) EXPECT_FLOAT_EQ(f32(w)[0], 1.f / 3);
    o.scoring = MoeScoring::kSigmoid;  // pass 1: tied groups, 0 and 1 kept (token 1: group 3, with expert 7, and group 0)
    o.n_group = 5;
    o.topk_group = 2;
  }
}

// ---- dispatch ---------------------------------------------------------------------------------------

enum class Mode { kHostPlan, kDecode, kPrefill };

void run_dispatch_case(const std::string& name, const HostTensor& ids, int E, int align, DType dt, int64_t D) {
  const int64_t T = ids.rows;
  const int k = int(ids.cols);
  SCOPED_TRACE(name + " T" + std::to_string(T) + " k" + std::to_string(k) + " E" + std::to_string(E) + " align" + std::to_string(align) +
               " D" + std::to_string(D) + " " + dtype_name(dt));
  auto rng = make_rng(uint64_t(T * 17 + E + D));
  const int64_t R = moe_permuted_rows(T, k, E, align) + 3;  // 3 rows past what is needed: must stay untouched
  HostTensor x(dt, T, D > 0 ? D : 1), xp0(dt, R, D > 0 ? D : 1);
  x.fill_normal(rng);
  poison(xp0, 0xff);
  const MoeDispatchOptions o{E, align};
  // CPU reference.
  HostTensor counts = int_vec(E), offsets = int_vec(E + 1), slots = ints(T, k), rows = int_vec(R), xp = xp0;
  MoeDispatchArgs ca{ids.view(), D > 0 ? x.view() : TensorView{}, counts.view(), offsets.view(), slots.view(), rows.view(),
                     D > 0 ? xp.view() : TensorView{}};
  const size_t ws_bytes = workspace_bytes(ca, o);
  std::vector<int32_t> ws(ws_bytes / 4 + 4);
  ASSERT_TRUE(run(ca, o, ws.data()));
  // Device.
  DeviceBuffer d_ids(ids.storage_bytes()), d_x(x.storage_bytes()), d_counts(counts.storage_bytes()), d_offsets(offsets.storage_bytes()),
      d_slots(slots.storage_bytes()), d_rows(rows.storage_bytes()), d_xp(xp0.storage_bytes()), d_ws(ws_bytes);
  ASSERT_TRUE(d_ids.ptr && d_x.ptr && d_counts.ptr && d_offsets.ptr && d_slots.ptr && d_rows.ptr && d_xp.ptr && d_ws.ptr);
  const TensorView ids_v = to_device(ids, d_ids), x_v = to_device(x, d_x);
  for (Mode mode : {Mode::kHostPlan, Mode::kDecode, Mode::kPrefill, Mode::kHostPlan}) {
    SCOPED_TRACE(mode == Mode::kHostPlan ? "host plan" : mode == Mode::kDecode ? "decode path" : "prefill path");
    HostTensor g_counts = int_vec(E), g_offsets = int_vec(E + 1), g_slots = ints(T, k), g_rows = int_vec(R), g_xp = xp0;
    ENCORE_ASSERT_CUDA(cudaMemset(d_ws.ptr, 0x7f, ws_bytes));  // the kernels may not rely on a clean workspace
    MoeDispatchArgs a{ids_v, D > 0 ? x_v : TensorView{}, to_device(g_counts, d_counts), to_device(g_offsets, d_offsets),
                      to_device(g_slots, d_slots), to_device(g_rows, d_rows), D > 0 ? to_device(g_xp, d_xp) : TensorView{}};
    Status st;
    if (mode == Mode::kHostPlan) {
      st = run(a, o, d_ws.ptr);
    } else {
      st = validate(a, o);
      const moe::DispatchPlan plan = moe::plan_moe_dispatch(
          T, k, E, 132, mode == Mode::kDecode ? moe::DispatchPath::kSingleBlock : moe::DispatchPath::kCountThenScatter);
      ASSERT_LE(plan.workspace_bytes, ws_bytes);
      if (st) st = cuda::launch_moe_dispatch(moe::make_dispatch_problem(a, o, d_ws.ptr), plan, 0, nullptr);
    }
    ASSERT_TRUE(st) << st.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    from_device(g_counts, d_counts);
    from_device(g_offsets, d_offsets);
    from_device(g_slots, d_slots);
    from_device(g_rows, d_rows);
    EXPECT_TRUE(same_bytes(g_counts, counts)) << "expert_counts: " << first_diff_i32(g_counts, counts);
    EXPECT_TRUE(same_bytes(g_offsets, offsets)) << "expert_offsets: " << first_diff_i32(g_offsets, offsets);
    EXPECT_TRUE(same_bytes(g_slots, slots)) << "slot_rows: " << first_diff_i32(g_slots, slots);
    EXPECT_TRUE(same_bytes(g_rows, rows)) << "row_slots: " << first_diff_i32(g_rows, rows);
    if (D > 0) {
      from_device(g_xp, d_xp);
      EXPECT_TRUE(same_bytes(g_xp, xp)) << "x_permuted: " << first_diff_bytes(g_xp, xp);
    }
  }
}

// ids [T, k]: each token's k experts distinct (as routing gives), uniformly drawn from `pool`.
HostTensor random_ids(int64_t T, int k, const std::vector<int>& pool, uint64_t salt) {
  auto rng = make_rng(salt);
  HostTensor ids(DType::kInt32, T, k);
  std::vector<int> p = pool;
  for (int64_t t = 0; t < T; ++t) {
    for (int j = 0; j < k; ++j) {
      std::uniform_int_distribution<size_t> d(size_t(j), p.size() - 1);
      std::swap(p[size_t(j)], p[d(rng)]);
      i32(ids)[t * k + j] = p[size_t(j)];
    }
  }
  return ids;
}

std::vector<int> range(int n) {
  std::vector<int> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

TEST_F(MoeGpu, DispatchMatchesCpu) {
  const DType b = DType::kBF16, h = DType::kFP16, f = DType::kFP32;
  run_dispatch_case("single", random_ids(1, 1, range(1), 1), 1, 1, b, 64);
  run_dispatch_case("decode_T1", random_ids(1, 8, range(128), 2), 128, 128, b, 2048);
  for (int align : {1, 8, 128}) {
    run_dispatch_case("small", random_ids(37, 2, range(8), 3), 8, align, b, 64);
    run_dispatch_case("odd_D_fp16", random_ids(5, 3, range(16), 4), 16, align, h, 33);
    run_dispatch_case("fp32_D3", random_ids(23, 4, range(12), 5), 12, align, f, 3);
    run_dispatch_case("mid", random_ids(129, 8, range(64), 6), 64, align, b, 256);  // 1032 pairs: host plan = prefill
    run_dispatch_case("qwen3", random_ids(4096, 8, range(128), 7), 128, align, b, 512);
  }
  // An expert with no token (3 and 9 never drawn), and all tokens to one expert.
  std::vector<int> pool = range(16);
  pool.erase(std::remove_if(pool.begin(), pool.end(), [](int e) { return e == 3 || e == 9; }), pool.end());
  run_dispatch_case("empty_experts", random_ids(301, 4, pool, 8), 16, 8, b, 128);
  run_dispatch_case("all_to_one", random_ids(300, 1, {5}, 9), 16, 8, b, 128);
  run_dispatch_case("all_to_one_prefill", random_ids(3000, 1, {11}, 10), 16, 128, b, 64);
  HostTensor same = random_ids(700, 4, range(16), 11);  // repeated ids within a token: allowed by dispatch
  for (int64_t i = 0; i < same.storage_elems(); ++i) i32(same)[i] = 2;
  run_dispatch_case("all_pairs_one_expert", same, 4, 1, b, 32);
  // Maps only, the DeepSeek-V3 batch, the CUDA maximum of experts.
  run_dispatch_case("maps_only", random_ids(999, 6, range(60), 12), 60, 8, b, 0);
  run_dispatch_case("deepseek", random_ids(16384, 8, range(256), 13), 256, 128, b, 256);
  run_dispatch_case("e1024", random_ids(200, 8, range(1024), 14), 1024, 8, b, 64);
}

// The decode / prefill flip of the host plan (pairs < 1024: T = 127 decode, T = 128 prefill at k = 8),
// decode sizes whose gather spans many blocks, rows of a partial 2 KB gather chunk (D = 8 * 257: 16-byte
// vectors, not a multiple of 64), the 2-byte gather with several chunks per row, DeepSeek-V3 rows.
TEST_F(MoeGpu, DispatchGatherShapes) {
  const DType b = DType::kBF16, f = DType::kFP32;
  for (int64_t T : {int64_t(1), int64_t(64), int64_t(65), int64_t(127), int64_t(128), int64_t(1000)})
    run_dispatch_case("qwen3_D2056", random_ids(T, 8, range(128), uint64_t(40 + T)), 128, 16, b, 2056);
  run_dispatch_case("deepseek_T1", random_ids(1, 8, range(256), 41), 256, 16, b, 7168);
  run_dispatch_case("deepseek_T64", random_ids(64, 8, range(256), 42), 256, 8, b, 7168);
  run_dispatch_case("scalar_chunks_T65", random_ids(65, 8, range(128), 43), 128, 8, b, 300);   // 600-byte rows
  run_dispatch_case("scalar_chunks_T200", random_ids(200, 6, range(64), 44), 64, 1, f, 131);   // 524-byte rows, prefill
  run_dispatch_case("maps_only_T64", random_ids(64, 8, range(128), 45), 128, 16, b, 0);
}

// ---- combine ----------------------------------------------------------------------------------------

void run_combine_case(int64_t T, int k, int64_t D, DType in, DType out) {
  SCOPED_TRACE("T" + std::to_string(T) + " k" + std::to_string(k) + " D" + std::to_string(D) + " " + dtype_name(in) + "->" + dtype_name(out));
  auto rng = make_rng(uint64_t(T * 5 + k + D));
  const int64_t R = T * k + 7;
  HostTensor y(in, R, D), w(DType::kFP32, T, k), slots(DType::kInt32, T, k), o0(out, T, D);
  y.fill_normal(rng, 0.0, 3.0);
  w.fill_uniform(rng, -0.5, 1.5);
  std::uniform_int_distribution<int32_t> rr(0, int32_t(R - 1));
  for (int64_t i = 0; i < T * k; ++i) i32(slots)[i] = rr(rng);
  poison(o0, 0xff);
  HostTensor cpu = o0;
  ASSERT_TRUE(run(MoeCombineArgs{y.view(), slots.view(), w.view(), cpu.view()}, MoeCombineOptions{}));
  DeviceBuffer dy(y.storage_bytes()), dw(w.storage_bytes()), ds(slots.storage_bytes()), dout(o0.storage_bytes());
  ASSERT_TRUE(dy.ptr && dw.ptr && ds.ptr && dout.ptr);
  const TensorView yv = to_device(y, dy), wv = to_device(w, dw), sv = to_device(slots, ds);
  for (int rep = 0; rep < 2; ++rep) {
    HostTensor g = o0;
    const Status st = run(MoeCombineArgs{yv, sv, wv, to_device(g, dout)}, MoeCombineOptions{});
    ASSERT_TRUE(st) << st.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    from_device(g, dout);
    EXPECT_TRUE(same_bytes(g, cpu)) << "rep " << rep << ": " << first_diff_bytes(g, cpu);
  }
}

TEST_F(MoeGpu, CombineBitEqualToCpu) {
  const DType b = DType::kBF16, h = DType::kFP16, f = DType::kFP32;
  for (DType in : {b, h, f})
    for (DType out : {b, h, f}) {
      run_combine_case(37, 2, 64, in, out);  // vector path
      run_combine_case(5, 3, 33, in, out);   // scalar path
    }
  run_combine_case(1, 1, 8, b, b);
  run_combine_case(1, 8, 7168, b, b);
  run_combine_case(4096, 8, 2048, b, b);
  run_combine_case(333, 6, 1000, f, b);
  run_combine_case(64, 64, 256, b, f);
  // Decode sizes (one thread per 8 columns of a token: many blocks for one token), k not a multiple of
  // the 8 slots loaded together, D = 8 * 257.
  run_combine_case(1, 8, 2048, b, b);
  run_combine_case(64, 8, 7168, b, b);
  run_combine_case(65, 8, 2056, b, b);
  run_combine_case(1000, 8, 2056, b, f);
  run_combine_case(65, 10, 264, b, b);
  run_combine_case(7, 9, 33, h, f);
}

// ---- routing -> dispatch -> combine on the device -------------------------------------------------

TEST_F(MoeGpu, PipelineMatchesCpu) {
  // Expert "MLP" = identity (expert_out = x_permuted): out = sum_j w_j x[t], through every device op.
  for (int64_t T : {int64_t(1), int64_t(77), int64_t(4096)}) {
    SCOPED_TRACE("T" + std::to_string(T));
    const int E = 256, k = 8, align = 128;
    const int64_t D = 256;
    auto rng = make_rng(uint64_t(T));
    HostTensor logits(DType::kBF16, T, E), bias = HostTensor::vector(DType::kFP32, E), x(DType::kBF16, T, D);
    logits.fill_normal(rng, 0.0, 2.0);
    bias.fill_normal(rng, 0.0, 0.2);
    x.fill_normal(rng);
    const MoeRoutingOptions ro{k, MoeScoring::kSigmoid, true, 8, 4, 2.5f};
    const int64_t R = moe_permuted_rows(T, k, E, align);
    const MoeDispatchOptions dopt{E, align};
    auto pipeline = [&](bool gpu, HostTensor& out) -> Status {
      HostTensor ids = ints(T, k), w(DType::kFP32, T, k), counts = int_vec(E), offsets = int_vec(E + 1), slots = ints(T, k), rows = int_vec(R),
                 xp(DType::kBF16, R, D);
      poison(w, 0xff);
      poison(xp, 0xff);
      if (!gpu) {
        ENCORE_RETURN_IF_ERROR(run(MoeRoutingArgs{logits.view(), bias.view(), ids.view(), w.view()}, ro));
        MoeDispatchArgs da{ids.view(), x.view(), counts.view(), offsets.view(), slots.view(), rows.view(), xp.view()};
        std::vector<int32_t> ws(workspace_bytes(da, dopt) / 4 + 4);
        ENCORE_RETURN_IF_ERROR(run(da, dopt, ws.data()));
        return run(MoeCombineArgs{xp.view(), slots.view(), w.view(), out.view()}, MoeCombineOptions{});
      }
      DeviceBuffer dl(logits.storage_bytes()), db(bias.storage_bytes()), dx(x.storage_bytes()), di(ids.storage_bytes()), dw(w.storage_bytes()),
          dc(counts.storage_bytes()), dof(offsets.storage_bytes()), ds(slots.storage_bytes()), dr(rows.storage_bytes()), dxp(xp.storage_bytes()),
          dout(out.storage_bytes());
      const TensorView idv = to_device(ids, di), wv = to_device(w, dw), sv = to_device(slots, ds), xpv = to_device(xp, dxp);
      ENCORE_RETURN_IF_ERROR(run(MoeRoutingArgs{to_device(logits, dl), to_device(bias, db), idv, wv}, ro));
      MoeDispatchArgs da{idv, to_device(x, dx), to_device(counts, dc), to_device(offsets, dof), sv, to_device(rows, dr), xpv};
      DeviceBuffer dws(workspace_bytes(da, dopt));
      ENCORE_RETURN_IF_ERROR(run(da, dopt, dws.ptr));
      ENCORE_RETURN_IF_ERROR(run(MoeCombineArgs{xpv, sv, wv, to_device(out, dout)}, MoeCombineOptions{}));
      if (cudaDeviceSynchronize() != cudaSuccess) return Status::cuda_error("sync");
      from_device(out, dout);
      return Status::ok();
    };
    HostTensor cpu(DType::kBF16, T, D), gpu(DType::kBF16, T, D);
    poison(cpu, 0xff);
    poison(gpu, 0xff);
    Status st = pipeline(false, cpu);
    ASSERT_TRUE(st) << st.to_string();
    st = pipeline(true, gpu);
    ASSERT_TRUE(st) << st.to_string();
    // Routing weights may differ in the last fp32 bit, so the output is compared with the bf16 tolerance.
    ENCORE_EXPECT_CLOSE(gpu, cpu, DType::kBF16, "out");
  }
}

// ---- small shapes of every kernel and path (the sanitize filter's moe test) --------------------------

TEST_F(MoeGpu, SmallShapesEveryKernel) {
  const MoeScoring sm = MoeScoring::kSoftmax, sg = MoeScoring::kSigmoid;
  const RoutingCase routing[] = {
      {"small_softmax", DType::kBF16, 9, 24, 3, sm, true, false, 1, 1, 1.f, 0},
      {"small_grouped", DType::kFP32, 5, 64, 6, sg, true, true, 8, 4, 2.5f, 0},
      {"small_e512", DType::kFP16, 3, 512, 8, sg, true, true, 16, 4, 1.f, 0},
  };
  for (const RoutingCase& c : routing) run_routing_case(c);
  run_dispatch_case("small", random_ids(37, 2, range(8), 21), 8, 8, DType::kBF16, 64);
  run_dispatch_case("small_odd", random_ids(300, 4, range(40), 22), 40, 16, DType::kFP16, 33);  // 1200 pairs: 3 chunks
  run_dispatch_case("small_maps", random_ids(11, 3, range(1024), 23), 1024, 1, DType::kBF16, 0);
  run_combine_case(9, 3, 64, DType::kBF16, DType::kBF16);
  run_combine_case(4, 2, 13, DType::kFP32, DType::kFP16);
}

// ---- bad inputs on CUDA -----------------------------------------------------------------------------

void expect_error(const Status& st, const std::string& needle, StatusCode code) {
  EXPECT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), code) << st.to_string();
  EXPECT_NE(st.message().find(needle), std::string::npos) << "message: " << st.message() << "\nexpected to contain: " << needle;
}

TensorView dmat(void* p, DType t, int64_t r, int64_t c) { return TensorView::contiguous(p, t, {r, c}, kGpu); }
TensorView dvec(void* p, DType t, int64_t n) { return TensorView::contiguous(p, t, {n}, kGpu); }

TEST_F(MoeGpu, BadInputsOnCuda) {
  DeviceBuffer a(1 << 20), b(1 << 20), c(1 << 20), d(1 << 20), e(1 << 20), f(1 << 20), g(1 << 20);
  // Routing: more experts than the warp kernel holds.
  expect_error(validate(MoeRoutingArgs{dmat(a.ptr, DType::kFP32, 4, 513), {}, dmat(b.ptr, DType::kInt32, 4, 8), dmat(c.ptr, DType::kFP32, 4, 8)},
                        MoeRoutingOptions{8}),
               "at most 512", StatusCode::kUnsupported);
  // Routing: an output on the host.
  std::vector<int32_t> host_ids(32);
  expect_error(validate(MoeRoutingArgs{dmat(a.ptr, DType::kFP32, 4, 64), {}, TensorView::contiguous(host_ids.data(), DType::kInt32, {4, 8}), dmat(c.ptr, DType::kFP32, 4, 8)},
                        MoeRoutingOptions{8}),
               "topk_ids: on cpu", StatusCode::kInvalidArgument);
  // Dispatch: too many experts; no workspace; a host output.
  const int64_t T = 4, k = 2;
  auto dargs = [&](int E) {
    const int64_t R = moe_permuted_rows(T, int(k), E, 1);
    return MoeDispatchArgs{dmat(a.ptr, DType::kInt32, T, k), {}, dvec(b.ptr, DType::kInt32, E), dvec(c.ptr, DType::kInt32, E + 1),
                           dmat(d.ptr, DType::kInt32, T, k), dvec(e.ptr, DType::kInt32, R), {}};
  };
  expect_error(validate(dargs(1025), MoeDispatchOptions{1025, 1}), "at most 1024", StatusCode::kUnsupported);
  expect_error(run(dargs(8), MoeDispatchOptions{8, 1}, nullptr), "workspace", StatusCode::kInvalidArgument);
  MoeDispatchArgs da = dargs(8);
  std::vector<int32_t> host_counts(8);
  da.expert_counts = TensorView::contiguous(host_counts.data(), DType::kInt32, {8});
  expect_error(validate(da, MoeDispatchOptions{8, 1}), "expert_counts: on cpu", StatusCode::kInvalidArgument);
  // Combine: an int32 output; mismatched k.
  expect_error(validate(MoeCombineArgs{dmat(a.ptr, DType::kBF16, 16, 64), dmat(b.ptr, DType::kInt32, 4, 2), dmat(c.ptr, DType::kFP32, 4, 2),
                                       dmat(d.ptr, DType::kInt32, 4, 64)},
                        MoeCombineOptions{}),
               "out", StatusCode::kInvalidArgument);
  expect_error(validate(MoeCombineArgs{dmat(a.ptr, DType::kBF16, 16, 64), dmat(b.ptr, DType::kInt32, 4, 2), dmat(c.ptr, DType::kFP32, 4, 3),
                                       dmat(d.ptr, DType::kBF16, 4, 64)},
                        MoeCombineOptions{}),
               "topk_weights", StatusCode::kInvalidArgument);
  // The layer on CUDA is bf16 only (its grouped GEMMs; tests/moe/test_moe_forward_gpu.cpp).
  MoeOptions o;
  o.routing.top_k = 2;
  const MoeLayerShape s{4, 8, 8, 4, DType::kFP32};
  DeviceBuffer base(moe_buffers_bytes(s, o) + 256);
  MoeBuffers buf;
  ASSERT_TRUE(moe_buffers_carve(s, o, base.ptr, moe_buffers_bytes(s, o), kGpu, &buf));
  const MoeForwardArgs fa{dmat(a.ptr, DType::kFP32, 4, 8), dmat(b.ptr, DType::kFP32, 4, 4), {},
                          TensorView::contiguous(c.ptr, DType::kFP32, {4, 16, 8}, kGpu), TensorView::contiguous(d.ptr, DType::kFP32, {4, 8, 8}, kGpu),
                          buf, dmat(f.ptr, DType::kFP32, 4, 8)};
  expect_error(validate(fa, o), "moe_forward on CUDA takes bf16", StatusCode::kUnsupported);
}

}  // namespace
}  // namespace encore::test
