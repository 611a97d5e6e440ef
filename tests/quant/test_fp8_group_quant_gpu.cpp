// CUDA FP8 group quantization against the CPU backend, bit for bit: every dtype and kernel
// variant (1-8 groups per thread, 1 or 2 packs per lane, row order or 16-row tiles, small and large
// grids), row- and column-major scales,
// power-of-two scales, strided rows, all-zero and extreme groups. Outputs are poisoned first.
#include <gtest/gtest.h>

#include <cstring>

#include "quant/testing.hpp"
#include "encore/quant.hpp"
#include "tests/common/aot_kernels.hpp"
#include "tests/common/compare.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {
namespace {

void run_quant_case(DType t, int64_t rows, int64_t cols, int64_t pad, bool column_major, bool pow2,
                    const quant::Fp8QuantLaunchPlan* plan = nullptr) {
  SCOPED_TRACE(std::string(dtype_name(t)) + " " + std::to_string(rows) + "x" + std::to_string(cols) + " pad " +
               std::to_string(pad) + (column_major ? " colmajor" : " rowmajor") + (pow2 ? " pow2" : "") +
               (plan ? " threads " + std::to_string(plan->threads) + " g" + std::to_string(plan->groups_per_thread) + " grid " +
                          std::to_string(plan->grid) + " packs " + std::to_string(plan->packs_per_lane) +
                          " tile rows " + std::to_string(plan->tile_rows)
                    : ""));
  auto rng = make_rng(uint64_t(rows * 13 + cols));
  const int64_t groups = cols / 128;
  HostTensor x(t, rows, cols, cols + pad), q(DType::kFP8E4M3, rows, cols, cols + 16);
  x.fill_normal(rng, 0.0, 4.0);
  for (int64_t k = 0; k < 128; ++k) x.set(0, k, 0.0);                         // all-zero group
  if (rows > 1) for (int64_t k = 0; k < 128; ++k) x.set(1, k, k % 2 ? 3e4 : -1e-3);  // wide range
  // Non-finite inputs follow the reference bit for bit: a NaN is skipped by amax (as fmaxf skips it)
  // and stays NaN; an infinity makes the scale infinite and the group's values 0 (NaN for itself).
  if (rows > 3) {
    x.set(2, 5, NAN);
    x.set(3, cols - 1, INFINITY);
  }
  std::memset(q.bytes.data(), 0x7f, q.bytes.size());  // NaN poison
  const size_t s_elems = size_t(rows * groups);
  std::vector<float> s_cpu(s_elems, NAN), s_gpu(s_elems, NAN);
  auto scale_view = [&](void* p, Device d) {
    return column_major ? TensorView::strided(p, DType::kFP32, {rows, groups}, {1, rows}, d)
                        : TensorView::contiguous(p, DType::kFP32, {rows, groups}, d);
  };
  Fp8GroupQuantOptions o;
  o.power_of_two_scales = pow2;

  DeviceBuffer dx(x.storage_bytes()), dq(q.storage_bytes()), ds(s_elems * 4);
  ASSERT_TRUE(dx.ptr && dq.ptr && ds.ptr);
  const Device dev{DeviceType::kCUDA, 0};
  ENCORE_ASSERT_CUDA(cudaMemcpy(ds.ptr, s_gpu.data(), s_elems * 4, cudaMemcpyHostToDevice));
  Fp8GroupQuantArgs a{to_device(x, dx), to_device(q, dq), scale_view(ds.ptr, dev)};
  Status st;
  if (plan) {
    quant::Fp8QuantProblem p;
    p.x = a.x.data;
    p.x_stride = x.row_stride;
    p.q = static_cast<uint8_t*>(a.q.data);
    p.q_stride = q.row_stride;
    p.scales = static_cast<float*>(a.scales.data);
    p.scale_stride_m = a.scales.strides[0];
    p.scale_stride_g = a.scales.strides[1];
    p.rows = rows;
    p.cols = cols;
    p.dtype = t;
    p.power_of_two = pow2;
    st = cuda::launch_fp8_group_quant(p, *plan, nullptr);
  } else {
    st = run(a, o);
  }
  ASSERT_TRUE(st) << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  HostTensor q_gpu = q, q_cpu = q;
  from_device(q_gpu, dq);
  ENCORE_ASSERT_CUDA(cudaMemcpy(s_gpu.data(), ds.ptr, s_elems * 4, cudaMemcpyDeviceToHost));
  ASSERT_TRUE(run(Fp8GroupQuantArgs{x.view(), q_cpu.view(), scale_view(s_cpu.data(), Device{})}, o));

  int64_t bad = 0;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t k = 0; k < cols; ++k) {
      const uint8_t a8 = q_gpu.bytes[size_t(m * q.row_stride + k)], b8 = q_cpu.bytes[size_t(m * q.row_stride + k)];
      if (a8 != b8 && bad++ < 5) ADD_FAILURE() << "q(" << m << ", " << k << ") gpu " << int(a8) << " cpu " << int(b8);
    }
  EXPECT_EQ(bad, 0);
  for (size_t i = 0; i < s_elems; ++i) {
    ASSERT_FALSE(std::isnan(s_gpu[i])) << "scale " << i << " not written";
    ASSERT_EQ(s_gpu[i], s_cpu[i]) << "scale " << i;
  }
}

class QuantGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    pin_aot_kernels(true);
  }
  void TearDown() override { pin_aot_kernels(false); }
};

TEST_F(QuantGpu, HostPlanLayoutsAndDtypes) {
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (bool cm : {false, true}) {
      for (bool pow2 : {false, true}) {
        run_quant_case(t, 1, 128, 0, cm, pow2);
        run_quant_case(t, 37, 896, 8, cm, pow2);
        run_quant_case(t, 1024, 7168, 0, cm, pow2);
      }
    }
  }
}

TEST_F(QuantGpu, EveryKernelVariant) {
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (int g : {1, 2, 4, 8}) {
      for (int packs : {1, 2})
        for (long long grid : {1LL, 2LL, 5000LL}) {
          for (int threads : {128, 512})
            for (int tile_rows : {1, 16}) {  // row order; tiles of 16 rows (333 and 77 end mid-tile)
              quant::Fp8QuantLaunchPlan plan;
              plan.threads = threads;
              plan.groups_per_thread = g;
              plan.grid = grid;
              plan.packs_per_lane = packs;
              plan.tile_rows = tile_rows;
              run_quant_case(t, 333, 1280, 0, true, false, &plan);
              run_quant_case(t, 77, 128, 24, false, true, &plan);
            }
        }
    }
  }
}

}  // namespace
}  // namespace encore::test
