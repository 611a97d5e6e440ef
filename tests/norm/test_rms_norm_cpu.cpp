// CPU backend of the norm family: results against an fp64 oracle, aliasing, and bad inputs.
#include <gtest/gtest.h>

#include "encore/norm.hpp"
#include "norm/problem.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/scoped_env.hpp"

namespace encore::test {
namespace {

// fp64 oracle of y (and h) for one problem, written independently of src/reference.
void oracle(const HostTensor& x, const HostTensor* res, const HostTensor& w, const RmsNormOptions& o,
            HostTensor& y_ref, HostTensor* h_ref) {
  for (int64_t r = 0; r < x.rows; ++r) {
    std::vector<double> h(static_cast<size_t>(x.cols));
    double ss = 0;
    for (int64_t c = 0; c < x.cols; ++c) {
      double v = x.get(r, c);
      if (res) {
        h_ref->set(r, c, double(float(v) + float(res->get(r, c))));  // rounds to the dtype
        v = h_ref->get(r, c);
      }
      h[size_t(c)] = v;
      ss += v * v;
    }
    double rstd = 1.0 / std::sqrt(ss / double(x.cols) + o.eps);
    for (int64_t c = 0; c < x.cols; ++c) y_ref.set(r, c, h[size_t(c)] * rstd * (w.get(0, c) + o.weight_offset));
  }
}

struct Case {
  DType dtype;
  int64_t rows, hidden, stride;
  bool add;
  float offset;
};

class NormCpu : public ::testing::TestWithParam<Case> {};

TEST_P(NormCpu, MatchesFp64Oracle) {
  const Case c = GetParam();
  auto rng = make_rng(uint64_t(c.rows * 131 + c.hidden));
  HostTensor x(c.dtype, c.rows, c.hidden, c.stride), res(c.dtype, c.rows, c.hidden), y(c.dtype, c.rows, c.hidden, c.stride),
      h(c.dtype, c.rows, c.hidden), w = HostTensor::vector(c.dtype, c.hidden);
  x.fill_normal(rng, 0.0, 2.0);
  res.fill_normal(rng);
  w.fill_normal(rng, 1.0, 0.5);
  y.poison();
  h.poison();
  RmsNormOptions o{1e-5f, c.offset};
  HostTensor y_ref(c.dtype, c.rows, c.hidden), h_ref(c.dtype, c.rows, c.hidden);
  if (c.add) {
    AddRmsNormArgs a{x.view(), res.view(), w.view(), y.view(), h.view()};
    ASSERT_TRUE(run(a, o)) << run(a, o).to_string();
    oracle(x, &res, w, o, y_ref, &h_ref);
    ENCORE_EXPECT_CLOSE(h, h_ref, c.dtype, "h");
  } else {
    RmsNormArgs a{x.view(), w.view(), y.view()};
    Status st = run(a, o);
    ASSERT_TRUE(st) << st.to_string();
    oracle(x, nullptr, w, o, y_ref, nullptr);
  }
  ENCORE_EXPECT_CLOSE(y, y_ref, c.dtype, "y");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, NormCpu,
    ::testing::Values(Case{DType::kFP32, 1, 1, 0, false, 0.f}, Case{DType::kFP32, 3, 7, 9, true, 0.f},
                      Case{DType::kBF16, 5, 4096, 0, true, 0.f}, Case{DType::kBF16, 17, 1000, 1003, false, 1.f},
                      Case{DType::kFP16, 9, 129, 0, true, 1.f}, Case{DType::kFP16, 2, 8192, 8200, false, 0.f}),
    [](const auto& info) {
      const Case& c = info.param;
      return std::string(dtype_name(c.dtype)) + "_" + std::to_string(c.rows) + "x" + std::to_string(c.hidden) +
             (c.stride ? "_s" + std::to_string(c.stride) : "") + (c.add ? "_add" : "") + (c.offset != 0 ? "_off" : "");
    });

TEST(NormCpu, UnitWeightRowsHaveUnitRms) {
  auto rng = make_rng(7);
  HostTensor x(DType::kFP32, 4, 333), y(DType::kFP32, 4, 333), w = HostTensor::vector(DType::kFP32, 333);
  x.fill_normal(rng, 3.0, 5.0);
  w.fill_uniform(rng, 1.0, 1.0);
  ASSERT_TRUE(run(RmsNormArgs{x.view(), w.view(), y.view()}, RmsNormOptions{0.f, 0.f}));
  for (int64_t r = 0; r < 4; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < 333; ++c) ss += y.get(r, c) * y.get(r, c);
    EXPECT_NEAR(std::sqrt(ss / 333), 1.0, 1e-5);
  }
}

TEST(NormCpu, HMayAliasResidualOrX) {
  auto rng = make_rng(11);
  const int64_t R = 6, H = 200;
  HostTensor x(DType::kBF16, R, H), res(DType::kBF16, R, H), w = HostTensor::vector(DType::kBF16, H);
  x.fill_normal(rng);
  res.fill_normal(rng);
  w.fill_normal(rng, 1.0, 0.3);
  HostTensor y0(DType::kBF16, R, H), h0(DType::kBF16, R, H);
  ASSERT_TRUE(run(AddRmsNormArgs{x.view(), res.view(), w.view(), y0.view(), h0.view()}, {}));
  for (int alias = 0; alias < 2; ++alias) {
    HostTensor xa = x, ra = res, y(DType::kBF16, R, H);
    HostTensor& target = alias == 0 ? ra : xa;
    ASSERT_TRUE(run(AddRmsNormArgs{xa.view(), ra.view(), w.view(), y.view(), target.view()}, {}));
    ENCORE_EXPECT_CLOSE(target, h0, DType::kBF16, "aliased h");
    ENCORE_EXPECT_CLOSE(y, y0, DType::kBF16, "y with aliased h");
  }
}

// ---- bad input -------------------------------------------------------------------------------

struct BadInput : ::testing::Test {
  HostTensor x{DType::kBF16, 4, 64}, res{DType::kBF16, 4, 64}, y{DType::kBF16, 4, 64}, h{DType::kBF16, 4, 64};
  HostTensor w = HostTensor::vector(DType::kBF16, 64);
  RmsNormArgs plain() { return {x.view(), w.view(), y.view()}; }
  AddRmsNormArgs add() { return {x.view(), res.view(), w.view(), y.view(), h.view()}; }
};

void expect_error(const Status& st, const std::string& needle) {
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find(needle), std::string::npos) << "message: " << st.message() << "\nexpected to contain: " << needle;
}

TEST_F(BadInput, WrongDtype) {
  auto a = plain();
  a.x.dtype = DType::kInt32;
  expect_error(validate(a, {}), "x: dtype must be one of");
  auto b = plain();
  b.weight.dtype = DType::kFP32;
  expect_error(run(b, {}), "weight: dtype fp32 must match x's dtype bf16");
  auto c = add();
  c.residual.dtype = DType::kFP16;
  expect_error(run(c, {}), "residual: dtype");
}

TEST_F(BadInput, MismatchedShapes) {
  auto a = plain();
  a.weight.shape[0] = 63;
  expect_error(run(a, {}), "weight: dimension 0 is 63 but must equal x's hidden size (64)");
  auto b = add();
  b.y.shape[0] = 3;
  expect_error(run(b, {}), "y: dimension 0 is 3 but must equal x's rows (4)");
  auto c = add();
  c.h.shape[1] = 65;
  expect_error(run(c, {}), "h: dimension 1");
  auto d = plain();
  d.x = TensorView::contiguous(x.bytes.data(), DType::kBF16, {2, 2, 64});
  expect_error(run(d, {}), "x: expected 2 dimensions [rows, hidden]");
}

TEST_F(BadInput, NonContiguousLastDim) {
  auto a = plain();
  a.x.strides = {128, 2};
  a.x.shape = {4, 32};
  a.weight.shape[0] = 32;
  a.y.shape = {4, 32};
  expect_error(run(a, {}), "x: last dimension must be contiguous");
  auto b = plain();
  b.y.strides[0] = 10;  // rows overlap
  expect_error(run(b, {}), "y: row stride 10 is smaller than the row length 64");
}

TEST_F(BadInput, NullAndMisalignedData) {
  auto a = plain();
  a.x.data = nullptr;
  expect_error(run(a, {}), "x: data pointer is null");
  auto b = add();
  b.residual.data = static_cast<char*>(b.residual.data) + 1;
  expect_error(run(b, {}), "residual: data pointer is not aligned to its element size");
  auto c = plain();
  c.weight.data = nullptr;
  expect_error(run(c, {}), "weight: data pointer is null");
}

TEST_F(BadInput, EmptyTensor) {
  auto a = plain();
  a.x.shape[0] = 0;
  expect_error(run(a, {}), "x: empty tensor [0, 64]");
  auto b = plain();
  b.x.shape[1] = 0;
  expect_error(run(b, {}), "x: empty tensor [4, 0]");
  auto c = plain();
  c.y = TensorView{};
  expect_error(run(c, {}), "y: tensor is missing");
}

TEST_F(BadInput, Overlap) {
  auto a = plain();
  a.y.data = static_cast<char*>(a.x.data) + 2 * 64;  // y starts at x's second row
  expect_error(run(a, {}), "y: memory overlaps x");
  auto b = add();
  b.y = b.h;
  expect_error(run(b, {}), "y: memory overlaps h");
}

TEST_F(BadInput, BadOptions) {
  expect_error(run(plain(), RmsNormOptions{-1.f, 0.f}), "eps: must be finite and >= 0");
  expect_error(run(plain(), RmsNormOptions{NAN, 0.f}), "eps: must be finite and >= 0");
  expect_error(run(plain(), RmsNormOptions{1e-6f, INFINITY}), "weight_offset: must be finite");
}

TEST_F(BadInput, MixedDevices) {
  auto a = plain();
  a.weight.device = Device{DeviceType::kCUDA, 0};
  expect_error(run(a, {}), "weight: on cuda:0 but x is on cpu");
}

}  // namespace
}  // namespace encore::test

namespace encore::test {
namespace {

// The split-row paths' constraints are checked in validate (no device memory is touched).
TEST(NormSplitRowValidate, RowsAlignmentAndWorkspace) {
  const Device gpu{DeviceType::kCUDA, 0};
  alignas(16) static uint16_t buf[128 * 4096];
  auto view = [&](int64_t rows, int64_t hidden, int64_t off = 0) {
    return TensorView::contiguous(buf + off, DType::kBF16, {rows, hidden}, gpu);
  };
  const TensorView w = TensorView::contiguous(buf + 100 * 4096, DType::kBF16, {4096}, gpu);
  RmsNormOptions o{1e-6f, 0.f, RmsNormPath::kSplitRowBarrier};
  RmsNormArgs a{view(17, 4096), w, view(17, 4096, 40 * 4096)};
  Status st = validate(a, o);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("x: the split-row paths take at most 16 rows, got 17"), std::string::npos) << st.message();
  RmsNormArgs b{TensorView::contiguous(buf + 1, DType::kBF16, {2, 4096}, gpu), w, view(2, 4096, 60 * 4096)};
  st = validate(b, o);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("16-byte aligned"), std::string::npos) << st.message();
  RmsNormArgs c{view(4, 4096), w, view(4, 4096, 70 * 4096)};
  EXPECT_EQ(workspace_bytes(c, o), size_t(16 + 4 * 8 * 4));  // 4096 bf16 = 512 packs = 8 slices of 64
  EXPECT_EQ(workspace_bytes(c, RmsNormOptions{}), size_t(0));
}

// add-RMSNorm rows of 513-1024 16-byte packs: 8 warps x 4 cached packs (the norm_plans sweep), unless the
// batch is too small to fill the GPU (then 16 warps x 2); 16 x 1 up to 512 packs.
TEST(NormPlan, AddPlanTakesEightWarpsForTwoPackRows) {
  auto plan = [](int64_t rows, int64_t hidden) { return norm::plan_rms_norm(rows, hidden, DType::kBF16, true, true, 132); };
  for (int64_t hidden : {int64_t(5120), int64_t(5184), int64_t(7168), int64_t(8192)}) {
    EXPECT_EQ(plan(65536, hidden).warps_per_row, 8) << hidden;
    EXPECT_EQ(plan(65536, hidden).vecs_per_thread, 4) << hidden;
    EXPECT_EQ(plan(16, hidden).warps_per_row, 16) << hidden;
    EXPECT_EQ(plan(16, hidden).vecs_per_thread, 2) << hidden;
  }
  EXPECT_EQ(plan(65536, 4096).warps_per_row, 16);
  EXPECT_EQ(plan(65536, 4096).vecs_per_thread, 1);
  EXPECT_EQ(plan(65536, 16384).warps_per_row, 16);  // 2048 packs: 4 each on 16 warps
  EXPECT_EQ(plan(65536, 16384).vecs_per_thread, 4);
  EXPECT_EQ(norm::plan_rms_norm(65536, 5184, DType::kBF16, true, false, 132).warps_per_row, 4);  // plain RMSNorm: unchanged
  // fp32 rows (4 elements per pack: 640 and 1024 packs) keep the 16-warp plan.
  EXPECT_EQ(norm::plan_rms_norm(65536, 2560, DType::kFP32, true, true, 132).warps_per_row, 16);
  EXPECT_EQ(norm::plan_rms_norm(65536, 4096, DType::kFP32, true, true, 132).warps_per_row, 16);
}

// The 32-byte-pack plans (sm_100+): RMSNorm's the same elements per thread in half as many packs,
// only from 16-byte plans with >= 2 cached packs; QK-norm's half the lanes a head; and the switch
// (ENCORE_NORM_PACK_BYTES, else the arch).
TEST(NormPlan, WidenedPlansAndTheirSwitch) {
  for (DType t : {DType::kBF16, DType::kFP32})
    for (int64_t hidden : {int64_t(1024), int64_t(4096), int64_t(5184), int64_t(16384), int64_t(140000)})
      for (int64_t rows : {int64_t(1), int64_t(64), int64_t(65536)})
        for (bool add : {false, true}) {
          const norm::RmsNormLaunchPlan p = norm::plan_rms_norm(rows, hidden, t, true, add, 132), w = norm::widen_rms_norm_plan(p, t);
          SCOPED_TRACE(std::to_string(hidden) + " x " + std::to_string(rows) + (add ? " add" : ""));
          EXPECT_EQ(w.warps_per_row, p.warps_per_row);
          EXPECT_EQ(w.rows_per_block, p.rows_per_block);
          EXPECT_EQ(w.grid, p.grid);
          if (p.vecs_per_thread >= 2) {
            EXPECT_EQ(w.vec_elems, 2 * p.vec_elems);
            EXPECT_EQ(w.vecs_per_thread * w.vec_elems, p.vecs_per_thread * p.vec_elems);
          } else {
            EXPECT_EQ(w.vec_elems, p.vec_elems);  // one cached pack or the streaming path: unchanged
            EXPECT_EQ(w.vecs_per_thread, p.vecs_per_thread);
          }
        }
  // QK-norm: 32-byte lane accesses halve the lanes a head, so a block holds twice the heads.
  for (int d : {64, 128, 256})
    for (int64_t tokens : {int64_t(1), int64_t(4097)}) {
      const norm::QkNormLaunchPlan q = norm::plan_qk_norm(tokens, 40, d, DType::kBF16, 132),
                                   w = norm::widen_qk_norm_plan(q, tokens, 40, d, DType::kBF16);
      EXPECT_EQ(q.pack_bytes, 16);
      EXPECT_EQ(w.pack_bytes, 32);
      EXPECT_EQ(w.threads, q.threads);
      EXPECT_EQ(w.heads_per_thread, q.heads_per_thread);
      const int64_t per_block = int64_t(w.threads / (d * 2 / 32)) * w.heads_per_thread;
      EXPECT_EQ(w.grid, (tokens * 40 + per_block - 1) / per_block) << d;
    }
  const norm::RmsNormLaunchPlan scalar = norm::plan_rms_norm(64, 1001, DType::kBF16, false, false, 132);
  EXPECT_EQ(norm::widen_rms_norm_plan(scalar, DType::kBF16).vec_elems, 1);
  ScopedEnv env("ENCORE_NORM_PACK_BYTES");
  unsetenv("ENCORE_NORM_PACK_BYTES");
  EXPECT_FALSE(norm::norm_wide_packs(9));
  EXPECT_TRUE(norm::norm_wide_packs(10));
  setenv("ENCORE_NORM_PACK_BYTES", "16", 1);
  EXPECT_FALSE(norm::norm_wide_packs(10));
  setenv("ENCORE_NORM_PACK_BYTES", "32", 1);
  EXPECT_TRUE(norm::norm_wide_packs(9));
}

}  // namespace
}  // namespace encore::test
