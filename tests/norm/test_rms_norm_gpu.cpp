// CUDA norm kernels against the CPU backend: fresh random inputs, poisoned outputs, odd shapes,
// strided rows, element-aligned (not 16-byte aligned) pointers, aliasing, every kernel variant.
#include <gtest/gtest.h>

#include <set>
#include <tuple>

#include "encore/core/device_info.hpp"
#include "encore/norm.hpp"
#include "norm/jit.hpp"
#include "norm/testing.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/common/scoped_env.hpp"

namespace encore::test {
namespace {

struct GpuCase {
  DType dtype;
  int64_t rows, hidden, stride;
  bool add;
  int elem_offset;  // shifts every pointer by this many elements (breaks 16-byte alignment)
  bool alias_h_residual;
};

std::string case_name(const GpuCase& c) {
  return std::string(dtype_name(c.dtype)) + "_" + std::to_string(c.rows) + "x" + std::to_string(c.hidden) +
         (c.stride ? "_s" + std::to_string(c.stride) : "") + (c.add ? "_add" : "") +
         (c.elem_offset ? "_off" + std::to_string(c.elem_offset) : "") + (c.alias_h_residual ? "_alias" : "");
}

// Runs one case on both backends and compares; records the kernel variant the plan chose.
void run_case(const GpuCase& c, std::set<std::tuple<int, int, int>>* variants) {
  SCOPED_TRACE(case_name(c));
  auto rng = make_rng(uint64_t(c.rows * 7919 + c.hidden));
  const size_t esz = dtype_size(c.dtype), off = size_t(c.elem_offset) * esz;
  HostTensor x(c.dtype, c.rows, c.hidden, c.stride), res(c.dtype, c.rows, c.hidden, c.stride),
      w = HostTensor::vector(c.dtype, c.hidden), y(c.dtype, c.rows, c.hidden, c.stride), h(c.dtype, c.rows, c.hidden);
  x.fill_normal(rng, 0.5, 2.0);
  res.fill_normal(rng);
  w.fill_normal(rng, 1.0, 0.5);
  y.poison();
  h.poison();
  const RmsNormOptions opts{1e-6f, c.add ? 1.0f : 0.0f};

  DeviceBuffer dx(x.storage_bytes() + 64), dr(res.storage_bytes() + 64), dw(w.storage_bytes() + 64),
      dy(y.storage_bytes() + 64), dh(h.storage_bytes() + 64);
  ASSERT_TRUE(dx.ptr && dr.ptr && dw.ptr && dy.ptr && dh.ptr) << "cudaMalloc failed";
  TensorView vx = to_device(x, dx, off), vr = to_device(res, dr, off), vw = to_device(w, dw, off),
             vy = to_device(y, dy, off), vh = to_device(h, dh, off);  // y and h poisoned on the device too
  if (c.alias_h_residual) vh = vr;

  const DeviceInfo* info = nullptr;
  ASSERT_TRUE(get_device_info(0, &info));
  Status st;
  if (c.add) {
    AddRmsNormArgs a{vx, vr, vw, vy, vh};
    st = run(a, opts);
  } else {
    st = run(RmsNormArgs{vx, vw, vy}, opts);
  }
  ASSERT_TRUE(st) << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());

  HostTensor y_gpu = y, h_gpu = h;
  from_device(y_gpu, dy, off);
  HostTensor y_cpu = y, h_cpu = h, r_cpu = res;
  if (c.add) {
    ASSERT_TRUE(run(AddRmsNormArgs{x.view(), r_cpu.view(), w.view(), y_cpu.view(), h_cpu.view()}, opts));
    if (c.alias_h_residual) {
      h_gpu = res;
      from_device(h_gpu, dr, off);
    } else {
      from_device(h_gpu, dh, off);
    }
    ENCORE_EXPECT_CLOSE(h_gpu, h_cpu, c.dtype, "h");
  } else {
    ASSERT_TRUE(run(RmsNormArgs{x.view(), w.view(), y_cpu.view()}, opts));
  }
  ENCORE_EXPECT_CLOSE(y_gpu, y_cpu, c.dtype, "y");

  if (variants) {
    const bool vec = c.elem_offset == 0 && c.hidden % int64_t(16 / esz) == 0 && (c.stride == 0 || c.stride % int64_t(16 / esz) == 0);
    norm::RmsNormLaunchPlan plan = norm::plan_rms_norm(c.rows, c.hidden, c.dtype, vec, c.add, info->sm_count);
    variants->insert({int(c.dtype) * 2 + int(c.add), plan.vec_elems, plan.vecs_per_thread});
  }
}

class NormGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    norm::set_rms_norm_jit_policy(norm::JitPolicy::kOff);  // these cover the ahead-of-time kernels; tests/jit the JIT
  }
  void TearDown() override { norm::set_rms_norm_jit_policy(norm::JitPolicy::kEnv); }
};

TEST_F(NormGpu, MatchesCpuOnEveryVariant) {
  const ScopedEnv packs("ENCORE_NORM_PACK_BYTES", "16");  // the plans recorded below are the 16-byte ones (also on sm_100+)
  std::set<std::tuple<int, int, int>> variants;
  const int64_t hiddens[] = {1, 7, 64, 100, 300, 1000, 1500, 4096, 4104, 8192, 12288, 20000, 40000, 140000};
  const int64_t rows_list[] = {1, 3, 64, 1000};
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (int64_t hid : hiddens) {
      for (bool add : {false, true}) {
        for (int64_t rows : rows_list) {
          if (rows * hid <= int64_t(8) << 20) run_case({t, rows, hid, 0, add, 0, false}, &variants);  // CPU side quick
        }
        run_case({t, 5, hid, hid + 8, add, 0, false}, &variants);   // strided rows
        run_case({t, 33, hid, hid + 3, add, 1, false}, &variants);  // element-aligned only
      }
    }
  }
  // Every instantiated kernel (dtype x {16-byte, element} x cached {0,1,2,4,8} x {plain, add}) ran.
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (int add = 0; add < 2; ++add) {
      for (int vec : {1, int(16 / dtype_size(t))}) {
        for (int cached : {0, 1, 2, 4, 8}) {
          EXPECT_TRUE(variants.count({int(t) * 2 + add, vec, cached}))
              << "variant not covered: " << dtype_name(t) << (add ? " add" : " plain") << " vec " << vec << " cached " << cached;
        }
      }
    }
  }
}

// The 32-byte-pack kernels (the sm_100+ plan, ENCORE_NORM_PACK_BYTES=32 runs them here as two
// 128-bit accesses): hidden sizes of whole 32-byte packs at every cached count the widening gives
// (4, 2, 1; add reaches 4 at hidden 20480), strided rows, and pointers only 16-byte aligned (then the
// 16-byte plan) against the CPU; every widened call counted (rms_norm_wide_plan_count), every
// 16-byte-aligned one not, and each (dtype, add, cached) of the 32-byte kernels run.
TEST_F(NormGpu, ThirtyTwoBytePacksMatchCpu) {
  const ScopedEnv env("ENCORE_NORM_PACK_BYTES", "32");
  const DeviceInfo* info = nullptr;
  ASSERT_TRUE(get_device_info(0, &info));
  std::set<std::tuple<int, int, int>> wide;  // (dtype, add, cached) of the 32-byte kernels that ran
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    const int64_t pack32 = 32 / int64_t(dtype_size(t));
    for (int64_t hid : {int64_t(64), int64_t(1024), int64_t(4096), int64_t(5184), int64_t(8192), int64_t(12288), int64_t(20480)})
      for (bool add : {false, true}) {
        auto expect_wide = [&](int64_t rows, int64_t stride, int off, bool aligned32) {
          const int64_t before = norm::rms_norm_wide_plan_count();
          run_case({t, rows, hid, stride, add, off, false}, nullptr);
          const norm::RmsNormLaunchPlan p = norm::plan_rms_norm(rows, hid, t, true, add, info->sm_count);
          const bool widens = aligned32 && p.vecs_per_thread >= 2;
          EXPECT_EQ(norm::rms_norm_wide_plan_count(), before + (widens ? 1 : 0)) << "rows " << rows << " widened?";
          if (widens) wide.insert({int(t), int(add), p.vecs_per_thread / 2});
        };
        for (int64_t rows : {int64_t(1), int64_t(3), int64_t(64), int64_t(1000)}) expect_wide(rows, 0, 0, true);
        expect_wide(5, hid + pack32, 0, true);                 // strided rows, whole 32-byte packs
        expect_wide(7, hid + pack32, int(pack32 / 2), false);  // 16-byte aligned only: the 16-byte plan
      }
  }
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32})
    for (int add = 0; add < 2; ++add)
      for (int cached : {1, 2, 4})
        EXPECT_TRUE(wide.count({int(t), add, cached})) << "32-byte kernel not covered: " << dtype_name(t) << (add ? " add" : "") << " cached " << cached;
}

TEST_F(NormGpu, HAliasesResidual) {
  for (DType t : {DType::kBF16, DType::kFP32}) {
    run_case({t, 300, 4096, 0, true, 0, true}, nullptr);
    run_case({t, 7, 140000, 0, true, 0, true}, nullptr);  // streaming path
  }
}

TEST_F(NormGpu, LargeBatchSizes) {
  for (int64_t hid : {2048, 4096, 8192}) run_case({DType::kBF16, 8192, hid, 0, true, 0, false}, nullptr);
}

TEST_F(NormGpu, ShortRowsManyPerBlock) {
  // Rows of <= 32 packs with many rows: 8 rows per block, row count not a multiple of 8.
  for (bool add : {false, true}) {
    run_case({DType::kBF16, 8193, 128, 0, add, 0, false}, nullptr);
    run_case({DType::kFP32, 5001, 100, 0, add, 0, false}, nullptr);
    run_case({DType::kFP16, 2000, 64, 72, add, 0, false}, nullptr);
  }
}

TEST_F(NormGpu, RunsOnRequestedStream) {
  cudaStream_t s;
  ENCORE_ASSERT_CUDA(cudaStreamCreate(&s));
  HostTensor x(DType::kBF16, 64, 512), w = HostTensor::vector(DType::kBF16, 512), y(DType::kBF16, 64, 512);
  auto rng = make_rng(3);
  x.fill_normal(rng);
  w.fill_normal(rng, 1.0, 0.1);
  y.poison();
  DeviceBuffer dx(x.storage_bytes()), dw(w.storage_bytes()), dy(y.storage_bytes());
  RmsNormArgs a{to_device(x, dx), to_device(w, dw), to_device(y, dy)};
  ASSERT_TRUE(run(a, {}, nullptr, s));
  ENCORE_ASSERT_CUDA(cudaStreamSynchronize(s));
  HostTensor y_gpu = y, y_cpu = y;
  from_device(y_gpu, dy);
  ASSERT_TRUE(run(RmsNormArgs{x.view(), w.view(), y_cpu.view()}, {}));
  ENCORE_EXPECT_CLOSE(y_gpu, y_cpu, DType::kBF16, "y");
  cudaStreamDestroy(s);
}

TEST_F(NormGpu, RejectsHostTensorMixedWithDevice) {
  HostTensor x(DType::kFP32, 2, 16), w = HostTensor::vector(DType::kFP32, 16);
  DeviceBuffer dy(x.storage_bytes());
  RmsNormArgs a{x.view(), w.view(), x.view(dy.ptr, Device{DeviceType::kCUDA, 0})};
  Status st = run(a, {});
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("y: on cuda:0 but x is on cpu"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace encore::test

namespace encore::test {
namespace {

// Split-row decode paths (two launches; one cooperative launch with a grid barrier) against the
// CPU backend; each case runs twice on one workspace (the barrier state must reset itself).
TEST_F(NormGpu, SplitRowPaths) {
  for (RmsNormPath path : {RmsNormPath::kSplitRowTwoLaunch, RmsNormPath::kSplitRowBarrier}) {
    for (DType t : {DType::kBF16, DType::kFP32}) {
      for (int64_t rows : {1, 3, 16}) {
        for (int64_t hidden : {64, 4096, 8192, 20000}) {
          for (bool add : {false, true}) {
            SCOPED_TRACE(std::string(path == RmsNormPath::kSplitRowBarrier ? "barrier " : "two-launch ") + dtype_name(t) +
                         " " + std::to_string(rows) + "x" + std::to_string(hidden) + (add ? " add" : ""));
            auto rng = make_rng(uint64_t(rows * 7 + hidden));
            HostTensor x(t, rows, hidden), r(t, rows, hidden), w = HostTensor::vector(t, hidden), y(t, rows, hidden), h(t, rows, hidden);
            x.fill_normal(rng, 0.5, 2.0);
            r.fill_normal(rng);
            w.fill_normal(rng, 1.0, 0.5);
            const RmsNormOptions o{1e-6f, 0.f, path};
            HostTensor y_cpu = y, h_cpu = h;
            if (add) ASSERT_TRUE(run(AddRmsNormArgs{x.view(), r.view(), w.view(), y_cpu.view(), h_cpu.view()}, o));
            else ASSERT_TRUE(run(RmsNormArgs{x.view(), w.view(), y_cpu.view()}, o));
            DeviceBuffer dx(x.storage_bytes()), dr(r.storage_bytes()), dw(w.storage_bytes()), dy(y.storage_bytes()), dh(h.storage_bytes());
            const AddRmsNormArgs aa{to_device(x, dx), to_device(r, dr), to_device(w, dw), y.view(dy.ptr, Device{DeviceType::kCUDA, 0}),
                                    h.view(dh.ptr, Device{DeviceType::kCUDA, 0})};
            const RmsNormArgs pa{aa.x, aa.weight, aa.y};
            const size_t ws = add ? workspace_bytes(aa, o) : workspace_bytes(pa, o);
            DeviceBuffer dws(ws);
            ASSERT_TRUE(add ? initialize_workspace(aa, o, dws.ptr) : initialize_workspace(pa, o, dws.ptr));
            for (int rep = 0; rep < 2; ++rep) {
              y.poison();
              h.poison();
              to_device(y, dy);
              to_device(h, dh);
              Status st = add ? run(aa, o, dws.ptr) : run(pa, o, dws.ptr);
              ASSERT_TRUE(st) << st.to_string();
              ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
              HostTensor y_gpu = y, h_gpu = h;
              from_device(y_gpu, dy);
              ENCORE_EXPECT_CLOSE(y_gpu, y_cpu, t, "y");
              if (add) {
                from_device(h_gpu, dh);
                ENCORE_EXPECT_CLOSE(h_gpu, h_cpu, t, "h");
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace encore::test
