// CPU backend of the moe family: routing against a direct fp64 computation (softmax, grouped sigmoid
// with bias, ties, E = 1, k = E), dispatch invariants (counts, aligned offsets, slot <-> row maps,
// gathered and zeroed rows), combine against a direct loop, moe_forward against an fp64 per-token
// loop, rerun bit-exactness, and the error messages of bad inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "encore/moe.hpp"
#include "tests/common/compare.hpp"

namespace encore::test {
namespace {

using I32 = std::vector<int32_t>;
using F32 = std::vector<float>;

TensorView mat(void* p, DType t, int64_t r, int64_t c) { return TensorView::contiguous(p, t, {r, c}); }
TensorView vec(void* p, DType t, int64_t n) { return TensorView::contiguous(p, t, {n}); }

// The routing math written directly: sort experts by (biased score desc, index asc), groups likewise.
void routing_fp64(const F32& logits, const F32* bias, int64_t T, int E, const MoeRoutingOptions& o, I32& ids, F32& w) {
  ids.assign(size_t(T * o.top_k), -1);
  w.assign(size_t(T * o.top_k), 0.f);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> s(static_cast<size_t>(E)), c(static_cast<size_t>(E));
    double mx = -INFINITY, sum = 0;
    for (int e = 0; e < E; ++e) mx = std::max(mx, double(logits[size_t(t * E + e)]));
    for (int e = 0; e < E; ++e) {
      const double l = logits[size_t(t * E + e)];
      s[size_t(e)] = o.scoring == MoeScoring::kSigmoid ? 1 / (1 + std::exp(-l)) : std::exp(l - mx);
      sum += s[size_t(e)];
    }
    for (int e = 0; e < E; ++e) {
      if (o.scoring == MoeScoring::kSoftmax) s[size_t(e)] /= sum;
      c[size_t(e)] = s[size_t(e)] + (bias ? double((*bias)[size_t(e)]) : 0.0);
    }
    const int gs = E / o.n_group;
    std::vector<int> groups(size_t(o.n_group));
    std::iota(groups.begin(), groups.end(), 0);
    std::vector<double> gscore(size_t(o.n_group));
    for (int g = 0; g < o.n_group; ++g) {
      std::vector<double> v(c.begin() + g * gs, c.begin() + (g + 1) * gs);
      std::sort(v.rbegin(), v.rend());
      gscore[size_t(g)] = bias && gs > 1 ? v[0] + v[1] : v[0];
    }
    std::stable_sort(groups.begin(), groups.end(), [&](int a, int b) { return gscore[size_t(a)] > gscore[size_t(b)]; });
    std::vector<int> order;
    for (int e = 0; e < E; ++e)
      if (o.n_group == 1 || std::find(groups.begin(), groups.begin() + o.topk_group, e / gs) != groups.begin() + o.topk_group) order.push_back(e);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return c[size_t(a)] > c[size_t(b)]; });
    double ws = 0;
    for (int j = 0; j < o.top_k; ++j) ws += s[size_t(order[size_t(j)])];
    for (int j = 0; j < o.top_k; ++j) {
      ids[size_t(t * o.top_k + j)] = order[size_t(j)];
      w[size_t(t * o.top_k + j)] = float(s[size_t(order[size_t(j)])] / (o.renormalize ? ws : 1.0) * o.routed_scaling_factor);
    }
  }
}

Status route(F32& logits, F32* bias, int64_t T, int E, const MoeRoutingOptions& o, I32& ids, F32& w) {
  ids.assign(size_t(T * o.top_k), -7);
  w.assign(size_t(T * o.top_k), NAN);
  MoeRoutingArgs a{mat(logits.data(), DType::kFP32, T, E), bias ? vec(bias->data(), DType::kFP32, E) : TensorView{},
                   mat(ids.data(), DType::kInt32, T, o.top_k), mat(w.data(), DType::kFP32, T, o.top_k)};
  return run(a, o);
}

struct RoutingCase {
  const char* name;
  int64_t T;
  int E, k;
  MoeScoring scoring;
  bool renorm, bias;
  int n_group, topk_group;
  float scale;
};

class MoeRoutingCpu : public ::testing::TestWithParam<RoutingCase> {};

TEST_P(MoeRoutingCpu, MatchesFp64) {
  const RoutingCase c = GetParam();
  auto rng = make_rng(uint64_t(c.T * 131 + c.E));
  std::normal_distribution<float> nd(0.f, 2.f);
  F32 logits(size_t(c.T * c.E)), bias(size_t(c.E));
  for (float& v : logits) v = nd(rng);
  for (float& v : bias) v = 0.1f * nd(rng);
  MoeRoutingOptions o{c.k, c.scoring, c.renorm, c.n_group, c.topk_group, c.scale};
  I32 ids, ref_ids;
  F32 w, ref_w;
  ASSERT_TRUE(route(logits, c.bias ? &bias : nullptr, c.T, c.E, o, ids, w));
  routing_fp64(logits, c.bias ? &bias : nullptr, c.T, c.E, o, ref_ids, ref_w);
  EXPECT_EQ(ids, ref_ids);
  for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(w[i], ref_w[i], 1e-6 * std::max(1.0f, std::fabs(ref_w[i]))) << i;
  I32 ids2;
  F32 w2;
  ASSERT_TRUE(route(logits, c.bias ? &bias : nullptr, c.T, c.E, o, ids2, w2));
  EXPECT_EQ(ids, ids2);
  EXPECT_EQ(0, std::memcmp(w.data(), w2.data(), w.size() * 4)) << "rerun is bit-exact";
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MoeRoutingCpu,
    ::testing::Values(RoutingCase{"Softmax_T37_E8_k2_renorm", 37, 8, 2, MoeScoring::kSoftmax, true, false, 1, 1, 1.f},
                      RoutingCase{"Softmax_T1_E64_k8_raw", 1, 64, 8, MoeScoring::kSoftmax, false, false, 1, 1, 1.f},
                      RoutingCase{"Softmax_T13_E1_k1", 13, 1, 1, MoeScoring::kSoftmax, true, false, 1, 1, 1.f},
                      RoutingCase{"Softmax_T5_E6_kE", 5, 6, 6, MoeScoring::kSoftmax, false, false, 1, 1, 1.f},
                      RoutingCase{"SoftmaxGrouped_T29_E16_k4_g4_tg2", 29, 16, 4, MoeScoring::kSoftmax, true, false, 4, 2, 1.f},
                      RoutingCase{"SigmoidBiasGrouped_T41_E32_k8_g8_tg4", 41, 32, 8, MoeScoring::kSigmoid, true, true, 8, 4, 2.5f},
                      RoutingCase{"SigmoidBias_T3_E7_k3", 3, 7, 3, MoeScoring::kSigmoid, false, true, 1, 1, 1.f},
                      RoutingCase{"SigmoidGroupsOfOne_T9_E8_k3", 9, 8, 3, MoeScoring::kSigmoid, true, true, 8, 3, 1.f}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(MoeRoutingCpuTies, EqualLogitsGoToTheLowerIndex) {
  F32 logits(3 * 10, 0.5f), bias(10, 0.f);
  logits[size_t(1 * 10 + 7)] = 2.f;  // token 1: expert 7 first, then the ties 0, 1
  I32 ids;
  F32 w;
  MoeRoutingOptions o{3, MoeScoring::kSoftmax, true, 1, 1, 1.f};
  ASSERT_TRUE(route(logits, nullptr, 3, 10, o, ids, w));
  EXPECT_EQ(ids, (I32{0, 1, 2, 7, 0, 1, 0, 1, 2}));
  EXPECT_FLOAT_EQ(w[0], 1.f / 3);
  o.scoring = MoeScoring::kSigmoid;
  o.n_group = 5;
  o.topk_group = 2;  // tied groups: 0 and 1 kept (token 1: group 3, with expert 7, and group 0)
  ASSERT_TRUE(route(logits, &bias, 3, 10, o, ids, w));
  EXPECT_EQ(ids, (I32{0, 1, 2, 7, 0, 1, 0, 1, 2}));
}

// ---- dispatch -------------------------------------------------------------------------------------

struct Dispatched {
  I32 counts, offsets, slot_rows, row_slots, ws;
  std::vector<float> xp;
  int64_t R = 0;
};

Status dispatch(I32& ids, int64_t T, int k, int E, int align, F32* x, int64_t D, Dispatched& d) {
  d.R = moe_permuted_rows(T, k, E, align);
  d.counts.assign(size_t(E), -1);
  d.offsets.assign(size_t(E + 1), -1);
  d.slot_rows.assign(size_t(T * k), -1);
  d.row_slots.assign(size_t(d.R), 12345);
  d.xp.assign(size_t(d.R * D), NAN);
  MoeDispatchArgs a{mat(ids.data(), DType::kInt32, T, k), x ? mat(x->data(), DType::kFP32, T, D) : TensorView{},
                    vec(d.counts.data(), DType::kInt32, E), vec(d.offsets.data(), DType::kInt32, E + 1),
                    mat(d.slot_rows.data(), DType::kInt32, T, k), vec(d.row_slots.data(), DType::kInt32, d.R),
                    x ? mat(d.xp.data(), DType::kFP32, d.R, D) : TensorView{}};
  MoeDispatchOptions o{E, align};
  d.ws.assign(workspace_bytes(a, o) / 4, 0);
  return run(a, o, d.ws.data());
}

void expect_dispatch_invariants(const I32& ids, int64_t T, int k, int E, int align, const F32& x, int64_t D, const Dispatched& d) {
  I32 hist(size_t(E), 0);
  for (int32_t e : ids) ++hist[size_t(e)];
  EXPECT_EQ(d.counts, hist);
  EXPECT_EQ(std::accumulate(d.counts.begin(), d.counts.end(), int64_t(0)), T * k);
  EXPECT_EQ(d.offsets[0], 0);
  for (int e = 0; e < E; ++e) {
    EXPECT_EQ(d.offsets[size_t(e)] % align, 0) << "expert " << e;
    EXPECT_EQ(d.offsets[size_t(e + 1)] - d.offsets[size_t(e)], (hist[size_t(e)] + align - 1) / align * align) << "expert " << e;
  }
  EXPECT_LE(d.offsets[size_t(E)], d.R);
  std::vector<int> seen(size_t(d.R), 0);
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const int32_t r = d.slot_rows[size_t(t * k + j)], e = ids[size_t(t * k + j)];
      ASSERT_GE(r, d.offsets[size_t(e)]);
      ASSERT_LT(r, d.offsets[size_t(e)] + d.counts[size_t(e)]) << "(t, j) lands in its expert's filled rows";
      EXPECT_EQ(++seen[size_t(r)], 1) << "row " << r << " taken twice";
      EXPECT_EQ(d.row_slots[size_t(r)], t * k + j) << "the inverse map";
      if (!x.empty()) EXPECT_EQ(0, std::memcmp(&d.xp[size_t(r * D)], &x[size_t(t * D)], size_t(D) * 4)) << "row " << r;
    }
  for (int e = 0; e < E; ++e) {
    for (int32_t r = d.offsets[size_t(e)] + 1; r < d.offsets[size_t(e)] + d.counts[size_t(e)]; ++r)
      EXPECT_LT(d.row_slots[size_t(r - 1)], d.row_slots[size_t(r)]) << "stable (t, j) order inside expert " << e;
    for (int32_t r = d.offsets[size_t(e)] + d.counts[size_t(e)]; r < d.offsets[size_t(e + 1)]; ++r) {
      EXPECT_EQ(d.row_slots[size_t(r)], -1) << "padding row " << r;
      for (int64_t c = 0; c < D && !x.empty(); ++c) EXPECT_EQ(d.xp[size_t(r * D + c)], 0.f) << "padding row " << r << " zeroed";
    }
  }
  for (int64_t r = d.offsets[size_t(E)]; r < d.R; ++r) EXPECT_EQ(d.row_slots[size_t(r)], -1) << "tail row " << r;
}

struct DispatchCase {
  const char* name;
  int64_t T;
  int k, E, align;
  int pattern;  // 0 random distinct, 1 expert E/2 gets nothing, 2 all to expert 1 (k = 1)
};

class MoeDispatchCpu : public ::testing::TestWithParam<DispatchCase> {};

TEST_P(MoeDispatchCpu, Invariants) {
  const DispatchCase c = GetParam();
  auto rng = make_rng(uint64_t(c.T * 7 + c.align));
  const int64_t D = 24;
  I32 ids(size_t(c.T * c.k));
  for (int64_t t = 0; t < c.T; ++t) {
    I32 perm(size_t(c.E));
    std::iota(perm.begin(), perm.end(), 0);
    if (c.pattern == 1) perm.erase(perm.begin() + c.E / 2);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int j = 0; j < c.k; ++j) ids[size_t(t * c.k + j)] = c.pattern == 2 ? 1 : perm[size_t(j)];
  }
  F32 x(size_t(c.T * D));
  std::normal_distribution<float> nd;
  for (float& v : x) v = nd(rng);
  Dispatched d, again, maps;
  ASSERT_TRUE(dispatch(ids, c.T, c.k, c.E, c.align, &x, D, d));
  expect_dispatch_invariants(ids, c.T, c.k, c.E, c.align, x, D, d);
  if (c.pattern == 1) EXPECT_EQ(d.counts[size_t(c.E / 2)], 0);
  ASSERT_TRUE(dispatch(ids, c.T, c.k, c.E, c.align, &x, D, again));
  EXPECT_EQ(d.slot_rows, again.slot_rows);
  EXPECT_EQ(d.row_slots, again.row_slots);
  ASSERT_TRUE(dispatch(ids, c.T, c.k, c.E, c.align, nullptr, D, maps));
  EXPECT_EQ(d.slot_rows, maps.slot_rows) << "maps-only mode builds the same maps";
  EXPECT_EQ(d.offsets, maps.offsets);
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeDispatchCpu,
                         ::testing::Values(DispatchCase{"T37_k3_E8_a1", 37, 3, 8, 1, 0}, DispatchCase{"T37_k3_E8_a8", 37, 3, 8, 8, 0},
                                           DispatchCase{"T101_k2_E16_a64_empty", 101, 2, 16, 64, 1},
                                           DispatchCase{"T1_k4_E9_a128", 1, 4, 9, 128, 0}, DispatchCase{"T23_k1_E5_a8_allOne", 23, 1, 5, 8, 2},
                                           DispatchCase{"T7_k1_E1_a16", 7, 1, 1, 16, 0}, DispatchCase{"T3_k6_E6_a2_kE", 3, 6, 6, 2, 0}),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- combine --------------------------------------------------------------------------------------

TEST(MoeCombineCpu, FixedOrderFmaSumEqualsADirectLoop) {
  auto rng = make_rng(5);
  const int64_t T = 19, D = 33, R = 70;
  const int k = 3;
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> rows(0, int(R) - 1);
  HostTensor y(DType::kBF16, R, D), out(DType::kBF16, T, D), out2(DType::kBF16, T, D);
  y.fill_normal(rng);
  out.poison();
  I32 slots(size_t(T * k));
  F32 w(size_t(T * k));
  for (auto& s : slots) s = rows(rng);
  for (auto& v : w) v = nd(rng);
  MoeCombineArgs a{y.view(), mat(slots.data(), DType::kInt32, T, k), mat(w.data(), DType::kFP32, T, k), out.view()};
  ASSERT_TRUE(run(a, MoeCombineOptions{}));
  double worst = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.f;
      double exact = 0;
      for (int j = 0; j < k; ++j) {
        acc = std::fma(w[size_t(t * k + j)], float(y.get(slots[size_t(t * k + j)], d)), acc);
        exact += double(w[size_t(t * k + j)]) * y.get(slots[size_t(t * k + j)], d);
      }
      EXPECT_EQ(out.get(t, d), double(bf16_to_float(float_to_bf16(acc)))) << t << ", " << d;
      worst = std::max(worst, std::fabs(out.get(t, d) - exact) / std::max(1.0, std::fabs(exact)));
    }
  EXPECT_LT(worst, 1.0 / 128) << "within a bf16 step of the fp64 sum";
  a.out = out2.view();
  ASSERT_TRUE(run(a, MoeCombineOptions{}));
  EXPECT_EQ(out.bytes, out2.bytes) << "rerun is bit-exact";
}

// ---- the layer ------------------------------------------------------------------------------------

struct Layer {
  int64_t T, D, F;
  int E;
  DType dtype;
  MoeOptions o;
  HostTensor x, logits, w13, w2, out;
  F32 bias;
  std::vector<unsigned char> storage;
  MoeBuffers b;

  Layer(int64_t t, int64_t d, int64_t f, int e, DType dt, MoeOptions opts, std::mt19937_64& rng, int64_t max_tokens = 0)
      : T(t), D(d), F(f), E(e), dtype(dt), o(opts), x(dt, t, d), logits(DType::kFP32, t, e), w13(dt, e * 2 * f, d), w2(dt, e * d, f),
        out(dt, t, d), bias(size_t(e)) {
    x.fill_normal(rng);
    logits.fill_normal(rng, 0, 2);
    w13.fill_normal(rng, 0, 1 / std::sqrt(double(d)));
    w2.fill_normal(rng, 0, 1 / std::sqrt(double(f)));
    std::normal_distribution<float> nd(0.f, 0.1f);
    for (float& v : bias) v = nd(rng);
    out.poison();
    const MoeLayerShape s{max_tokens ? max_tokens : t, d, f, e, dt};
    storage.assign(moe_buffers_bytes(s, o) + 256, 0xAB);
    void* base = storage.data() + (256 - reinterpret_cast<uintptr_t>(storage.data()) % 256) % 256;
    EXPECT_TRUE(moe_buffers_carve(s, o, base, storage.size() - 256, Device{}, &b));
  }
  MoeForwardArgs args(bool with_bias) {
    return {x.view(), logits.view(), with_bias ? vec(bias.data(), DType::kFP32, E) : TensorView{},
            TensorView::contiguous(w13.bytes.data(), dtype, {E, 2 * F, D}), TensorView::contiguous(w2.bytes.data(), dtype, {E, D, F}), b,
            out.view()};
  }
};

// The layer as a per-token loop in fp64 (routing from routing_fp64; no intermediate rounding).
std::vector<double> forward_fp64(Layer& L, bool with_bias) {
  F32 lg(size_t(L.T * L.E));
  for (int64_t i = 0; i < L.T * L.E; ++i) lg[size_t(i)] = float(L.logits.get(i / L.E, i % L.E));
  I32 ids;
  F32 w;
  routing_fp64(lg, with_bias ? &L.bias : nullptr, L.T, L.E, L.o.routing, ids, w);
  const int k = L.o.routing.top_k;
  std::vector<double> out(static_cast<size_t>(L.T * L.D), 0.0), h(static_cast<size_t>(L.F));
  for (int64_t t = 0; t < L.T; ++t)
    for (int j = 0; j < k; ++j) {
      const int e = ids[size_t(t * k + j)];
      for (int64_t f = 0; f < L.F; ++f) {
        double g = 0, u = 0;
        for (int64_t d = 0; d < L.D; ++d) {
          g += L.x.get(t, d) * L.w13.get(e * 2 * L.F + f, d);
          u += L.x.get(t, d) * L.w13.get(e * 2 * L.F + L.F + f, d);
        }
        h[size_t(f)] = g / (1 + std::exp(-g)) * u;
      }
      for (int64_t d = 0; d < L.D; ++d) {
        double y = 0;
        for (int64_t f = 0; f < L.F; ++f) y += h[size_t(f)] * L.w2.get(e * L.D + d, f);
        out[size_t(t * L.D + d)] += w[size_t(t * k + j)] * y;
      }
    }
  return out;
}

struct LayerCase {
  const char* name;
  int64_t T, D, F;
  int E, k, align;
  DType dtype;
  bool sigmoid_grouped;
  double tol;  // relative RMS
};

class MoeForwardCpu : public ::testing::TestWithParam<LayerCase> {};

TEST_P(MoeForwardCpu, MatchesAnFp64PerTokenLoop) {
  const LayerCase c = GetParam();
  auto rng = make_rng(uint64_t(c.T * 3 + c.E));
  MoeOptions o;
  o.routing.top_k = c.k;
  o.align_m = c.align;
  if (c.sigmoid_grouped) o.routing = {c.k, MoeScoring::kSigmoid, true, 4, 2, 2.5f};
  Layer L(c.T, c.D, c.F, c.E, c.dtype, o, rng, c.T + 5);  // buffers sized for more tokens than this call
  ASSERT_TRUE(run(L.args(c.sigmoid_grouped), o));
  const std::vector<double> ref = forward_fp64(L, c.sigmoid_grouped);
  double num = 0, den = 0;
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t d = 0; d < c.D; ++d) {
      const double v = L.out.get(t, d), r = ref[size_t(t * c.D + d)];
      ASSERT_TRUE(std::isfinite(v)) << t << ", " << d;
      num += (v - r) * (v - r);
      den += r * r;
    }
  EXPECT_LT(std::sqrt(num / den), c.tol);
  const HostTensor first = L.out;
  const std::vector<unsigned char> buffers = L.storage;
  L.out.poison();
  ASSERT_TRUE(run(L.args(c.sigmoid_grouped), o));
  EXPECT_EQ(first.bytes, L.out.bytes) << "rerun is bit-exact";
  EXPECT_EQ(buffers, L.storage) << "the buffers hold the same state after a rerun";
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeForwardCpu,
                         ::testing::Values(LayerCase{"Fp32_T29_E8_k2_a1", 29, 40, 24, 8, 2, 1, DType::kFP32, false, 2e-6},
                                           LayerCase{"Fp32_T1_E4_k4_a64", 1, 16, 8, 4, 4, 64, DType::kFP32, false, 2e-6},
                                           LayerCase{"Bf16_T37_E16_k4_a8_sigmoidGrouped", 37, 32, 20, 16, 4, 8, DType::kBF16, true, 1.5e-2},
                                           LayerCase{"Fp16_T11_E1_k1_a8", 11, 24, 12, 1, 1, 8, DType::kFP16, false, 2e-3}),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- bad inputs -----------------------------------------------------------------------------------

void expect_error(const Status& st, const std::string& needle) {
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find(needle), std::string::npos) << "got: " << st.to_string() << "\nwanted: " << needle;
}

TEST(MoeBadInputs, RoutingNamesTheArgument) {
  F32 logits(4 * 8, 0.f), bias(8, 0.f);
  I32 ids(4 * 9);
  F32 w(4 * 9);
  auto args = [&](int k) {
    return MoeRoutingArgs{mat(logits.data(), DType::kFP32, 4, 8), {}, mat(ids.data(), DType::kInt32, 4, k), mat(w.data(), DType::kFP32, 4, k)};
  };
  expect_error(validate(args(9), {9}), "top_k: must be in [1, E = 8]");
  expect_error(validate(args(0), {0}), "top_k: must be in [1, E = 8]");
  expect_error(validate(args(2), {2, MoeScoring::kSigmoid, true, 3, 1}), "n_group: 3 must be >= 1 and divide the number of experts E = 8");
  expect_error(validate(args(2), {2, MoeScoring::kSigmoid, true, 4, 5}), "topk_group: must be in [1, n_group = 4]");
  expect_error(validate(args(5), {5, MoeScoring::kSigmoid, true, 4, 2}), "top_k: 5 exceeds the experts of the kept groups");
  expect_error(validate(args(2), {2, MoeScoring::kSoftmax, true, 1, 1, 0.f}), "routed_scaling_factor");
  MoeRoutingArgs a = args(2);
  a.topk_ids.dtype = DType::kInt64;
  expect_error(validate(a, {2}), "topk_ids: dtype");
  a = args(2);
  a.topk_weights.shape[1] = 3;
  expect_error(validate(a, {2}), "topk_weights");
  a = args(2);
  a.correction_bias = vec(bias.data(), DType::kFP32, 7);
  expect_error(validate(a, {2}), "correction_bias");
  a = args(2);
  a.topk_weights = mat(logits.data(), DType::kFP32, 4, 2);
  expect_error(validate(a, {2}), "logits");  // output overlapping the input
  a = args(2);
  a.logits.device = Device{DeviceType::kCUDA, 0};
  a.topk_ids.device = a.topk_weights.device = a.logits.device;
  const Status st = validate(a, {2});
#ifdef ENCORE_WITH_CUDA
  EXPECT_TRUE(st) << st.to_string();  // CUDA routing exists (tests/moe/test_moe_gpu.cpp runs it); validate reads no device data
#else
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  expect_error(st, "built without CUDA");
#endif
}

TEST(MoeBadInputs, DispatchNamesTheArgument) {
  I32 ids{0, 1, 2, 3, 4, 9};
  Dispatched d;
  expect_error(dispatch(ids, 3, 2, 8, 1, nullptr, 4, d), "topk_ids: entry [2, 1] = 9 is outside [0, num_experts = 8)");
  ids[5] = -1;
  expect_error(dispatch(ids, 3, 2, 8, 1, nullptr, 4, d), "topk_ids: entry [2, 1] = -1");
  ids[5] = 5;
  expect_error(dispatch(ids, 3, 2, 8, 48, nullptr, 4, d), "align_m: must be a power of two");
  expect_error(dispatch(ids, 3, 2, 0, 1, nullptr, 4, d), "num_experts: must be in [1");
  expect_error(dispatch(ids, 3, 2, 1, 1, nullptr, 4, d), "topk_ids: k = 2 columns, but must be in [1, num_experts = 1]");
  ASSERT_TRUE(dispatch(ids, 3, 2, 8, 8, nullptr, 4, d));
  MoeDispatchArgs a{mat(ids.data(), DType::kInt32, 3, 2), {}, vec(d.counts.data(), DType::kInt32, 8), vec(d.offsets.data(), DType::kInt32, 9),
                    mat(d.slot_rows.data(), DType::kInt32, 3, 2), vec(d.row_slots.data(), DType::kInt32, d.R - 1), {}};
  expect_error(validate(a, {8, 8}), "row_slots: " + std::to_string(d.R - 1) + " elements, expected at least " + std::to_string(d.R));
  a.row_slots.shape[0] = d.R;
  a.expert_offsets.shape[0] = 8;
  expect_error(validate(a, {8, 8}), "expert_offsets: 8 elements, expected 9");
  a.expert_offsets.shape[0] = 9;
  F32 x(12);
  a.x = mat(x.data(), DType::kFP32, 3, 4);
  expect_error(validate(a, {8, 8}), "x_permuted: x and x_permuted are given together");
  EXPECT_TRUE(validate(MoeDispatchArgs{a.topk_ids, {}, a.expert_counts, a.expert_offsets, a.slot_rows, a.row_slots, {}}, {8, 8}));
  expect_error(run(MoeDispatchArgs{a.topk_ids, {}, a.expert_counts, a.expert_offsets, a.slot_rows, a.row_slots, {}}, {8, 8}, nullptr),
               "workspace: a 16-byte aligned buffer");
}

TEST(MoeBadInputs, CombineAndLayerNameTheArgument) {
  HostTensor y(DType::kFP32, 6, 4), out(DType::kFP32, 2, 4);
  I32 slots{0, 1, 2, 6};
  F32 w(4, 1.f);
  MoeCombineArgs a{y.view(), mat(slots.data(), DType::kInt32, 2, 2), mat(w.data(), DType::kFP32, 2, 2), out.view()};
  expect_error(validate(a, {}), "slot_rows: entry [1, 1] = 6 is outside expert_out's rows [0, 6)");
  slots[3] = 5;
  EXPECT_TRUE(validate(a, {}));
  a.out = TensorView::contiguous(out.bytes.data(), DType::kFP32, {2, 5});
  expect_error(validate(a, {}), "out: dimension 1 is 5");

  auto rng = make_rng(9);
  MoeOptions o;
  o.routing.top_k = 2;
  Layer L(5, 8, 6, 4, DType::kFP32, o, rng);
  EXPECT_TRUE(validate(L.args(false), o));
  MoeForwardArgs f = L.args(false);
  f.w2 = TensorView::contiguous(L.w2.bytes.data(), DType::kFP32, {4, 8, 5});
  expect_error(validate(f, o), "w2: dimension 2 is 5 but must equal w13's intermediate size F");
  f = L.args(false);
  f.w13 = TensorView::contiguous(L.w13.bytes.data(), DType::kFP32, {4, 11, 8});
  expect_error(validate(f, o), "w13: dimension 1 is 11 but must be even");
  Layer big(7, 8, 6, 4, DType::kFP32, o, rng);
  f = big.args(false);
  f.buffers = L.b;  // sized for 5 tokens
  expect_error(validate(f, o), "buffers.topk_ids: 5 rows, fewer than the call's T = 7 tokens");
  f = L.args(false);
  f.out = f.buffers.expert_out;
  f.out.shape[0] = 5;
  expect_error(validate(f, o), "expert_out");  // out aliasing a buffer
  MoeOptions bad = o;
  bad.align_m = 3;
  EXPECT_EQ(moe_buffers_bytes({5, 8, 6, 4, DType::kFP32}, bad), 0u);
  MoeBuffers b;
  expect_error(moe_buffers_carve({5, 8, 6, 4, DType::kFP32}, bad, L.storage.data(), 1 << 20, Device{}, &b), "align_m");
  expect_error(moe_buffers_carve({5, 8, 6, 4, DType::kFP32}, o, nullptr, 1 << 20, Device{}, &b), "base: must be non-null");
}

TEST(MoeBadInputs, LayerBuffersAndWeightDtypes) {
  auto rng = make_rng(11);
  MoeOptions o;
  o.routing.top_k = 2;
  o.align_m = 8;
  Layer L(5, 16, 8, 4, DType::kBF16, o, rng);
  // The CUDA grouped GEMMs' buffers are carved on every device (unused by the CPU backend).
  EXPECT_EQ(L.b.gate_up.dtype, DType::kFP32);
  EXPECT_EQ(L.b.gate_up.shape[0], moe_permuted_rows(5, 2, 4, 8));
  EXPECT_EQ(L.b.gate_up.shape[1], 16);
  EXPECT_EQ(L.b.gemm_workspace.dtype, DType::kUInt8);
  EXPECT_GT(L.b.gemm_workspace.shape[0], 0);
  EXPECT_TRUE(validate(L.args(false), o));
  MoeForwardArgs f = L.args(false);
  f.w2.dtype = DType::kFP16;
  expect_error(validate(f, o), "w2");
  f = L.args(false);
  f.w13.dtype = DType::kFP32;
  expect_error(validate(f, o), "w13");
  f = L.args(false);
  f.w13 = TensorView::contiguous(L.w13.bytes.data(), DType::kBF16, {3, 16, 16});
  expect_error(validate(f, o), "w13: dimension 0 is 3");
}

}  // namespace
}  // namespace encore::test
