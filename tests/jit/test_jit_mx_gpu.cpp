// The JIT MXFP8 / NVFP4 quantization on the GPU: the dispatcher's JIT path (launch counter) and the
// ahead-of-time kernels on the SAME inputs and identically poisoned outputs, each bit for bit against
// the CPU reference and each other (q, scales with their padding, the NVFP4 global scale); both scale
// layouts, both MXFP8 rules, computed and given NVFP4 globals, odd shapes; graph capture refusal.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "encore/core/device_info.hpp"
#include "encore/quant.hpp"
#include "jit/jit.hpp"
#include "quant/jit.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/jit/capture.hpp"

namespace encore::test {
namespace {

const Device kDev{DeviceType::kCUDA, 0};

class JitMxGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    if (!jit::nvrtc_info().available) GTEST_SKIP() << "NVRTC not available: " << jit::nvrtc_info().library;
  }
  void TearDown() override { quant::set_mx_quant_jit_policy(quant::JitPolicy::kEnv); }
};

struct MxCase {
  bool nvfp4;
  int64_t rows, cols;
  MxQuantOptions opts;
};
struct MxOut {
  std::vector<uint8_t> q, s;
  float g = NAN;
};

int64_t scale_cols(const MxCase& c) { return c.cols / (c.nvfp4 ? 16 : 32); }
int64_t scale_bytes(const MxCase& c) {
  const int64_t sc = scale_cols(c);
  if (c.opts.scale_layout == MxScaleLayout::kSwizzled) return (c.rows + 127) / 128 * 128 * ((sc + 3) / 4 * 4);
  return (c.rows - 1) * (sc + 3) + sc;  // a padded row stride
}
TensorView scale_view(const MxCase& c, void* p, Device d) {
  const int64_t sc = scale_cols(c);
  const DType t = c.nvfp4 ? DType::kFP8E4M3 : DType::kUInt8;
  if (c.opts.scale_layout == MxScaleLayout::kSwizzled)
    return TensorView::contiguous(p, t, {(c.rows + 127) / 128 * 128, (sc + 3) / 4 * 4}, d);
  return TensorView::strided(p, t, {c.rows, sc}, {sc + 3, 1}, d);
}

HostTensor mx_input(DType t, const MxCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostTensor x(t, c.rows, c.cols, c.cols + (c.rows % 2 ? 8 : 0));
  x.fill_normal(rng, 0.0, 3.0);
  for (int64_t k = 0; k < std::min<int64_t>(32, c.cols); ++k) x.set(0, k, 0.0);  // a zero block
  if (c.rows > 1) {
    x.set(1, 3 % c.cols, NAN);
    x.set(1, c.cols - 1, INFINITY);
  }
  return x;
}

// One quantization; gpu: through the dispatcher with `policy`, else the CPU reference. Every
// output starts as the same poison, so whole buffers compare (padding included).
MxOut mx_run(const HostTensor& x, const MxCase& c, bool gpu, quant::JitPolicy policy, Stream stream = nullptr) {
  const int64_t qcols = c.nvfp4 ? c.cols / 2 : c.cols;
  HostTensor q(c.nvfp4 ? DType::kUInt8 : DType::kFP8E4M3, c.rows, qcols, qcols + 16);
  std::memset(q.bytes.data(), 0xa5, q.bytes.size());
  MxOut out{{}, std::vector<uint8_t>(size_t(scale_bytes(c)), 0xa5), NAN};
  Status st;
  if (!gpu) {
    const TensorView g = TensorView::contiguous(&out.g, DType::kFP32, {1});
    st = c.nvfp4 ? run(Nvfp4QuantArgs{x.view(), q.view(), scale_view(c, out.s.data(), Device{}), g}, c.opts)
                 : run(Mxfp8QuantArgs{x.view(), q.view(), scale_view(c, out.s.data(), Device{})}, c.opts);
    EXPECT_TRUE(st) << st.to_string();
    out.q.assign(q.bytes.begin(), q.bytes.end());
    return out;
  }
  DeviceBuffer dx(x.storage_bytes()), dq(q.storage_bytes()), ds(out.s.size()), dg(4);
  EXPECT_EQ(cudaMemcpy(ds.ptr, out.s.data(), out.s.size(), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(dg.ptr, &out.g, 4, cudaMemcpyHostToDevice), cudaSuccess);
  const TensorView xd = to_device(x, dx), qd = to_device(q, dq), sd = scale_view(c, ds.ptr, kDev);
  quant::set_mx_quant_jit_policy(policy);
  st = c.nvfp4 ? run(Nvfp4QuantArgs{xd, qd, sd, TensorView::contiguous(dg.ptr, DType::kFP32, {1}, kDev)}, c.opts, nullptr, stream)
               : run(Mxfp8QuantArgs{xd, qd, sd}, c.opts, nullptr, stream);
  EXPECT_TRUE(st) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  from_device(q, dq);
  out.q.assign(q.bytes.begin(), q.bytes.end());
  EXPECT_EQ(cudaMemcpy(out.s.data(), ds.ptr, out.s.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(&out.g, dg.ptr, 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

void expect_same(const MxOut& a, const MxOut& b, bool nvfp4, const char* what) {
  size_t q_bad = 0, s_bad = 0;
  for (size_t i = 0; i < std::min(a.q.size(), b.q.size()); ++i) q_bad += a.q[i] != b.q[i];
  for (size_t i = 0; i < std::min(a.s.size(), b.s.size()); ++i) s_bad += a.s[i] != b.s[i];
  EXPECT_EQ(q_bad, 0u) << what << ": q bytes differ";
  EXPECT_EQ(s_bad, 0u) << what << ": scale bytes differ";
  if (nvfp4) EXPECT_EQ(std::memcmp(&a.g, &b.g, 4), 0) << what << ": global scale " << a.g << " vs " << b.g;
}

TEST_F(JitMxGpu, OutsideTheListMatchesCpuAndAheadOfTime) {
  for (bool nvfp4 : {false, true}) {
    for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32}) {
      for (int64_t cols : nvfp4 ? std::vector<int64_t>{5248, 784, 16} : std::vector<int64_t>{5248, 96}) {
        for (int64_t rows : {int64_t(1), int64_t(7), int64_t(130)}) {
          for (bool swizzled : {false, true}) {
            MxCase c{nvfp4, rows, cols, {}};
            c.opts.scale_layout = swizzled ? MxScaleLayout::kSwizzled : MxScaleLayout::kRowMajor;
            if (nvfp4) c.opts.global_scale = rows == 7 ? 0.5f : 0.0f;
            else c.opts.rounding = rows == 7 ? MxScaleRounding::kRceil : MxScaleRounding::kFloor;
            SCOPED_TRACE(std::string(nvfp4 ? "nvfp4 " : "mxfp8 ") + dtype_name(t) + " " + std::to_string(rows) + "x" +
                         std::to_string(cols) + (swizzled ? " swizzled" : " rowmajor") + (rows == 7 ? " rceil / given global" : ""));
            ASSERT_FALSE(quant::mx_quant_cols_in_aot_list(cols));
            const HostTensor x = mx_input(t, c, uint64_t(std::random_device{}()) | 1);
            const int64_t before = quant::mx_quant_jit_launch_count();
            const MxOut j = mx_run(x, c, true, quant::JitPolicy::kAuto);
            ASSERT_EQ(quant::mx_quant_jit_launch_count(), before + 1) << "the dispatcher did not take the JIT path (auto, K outside the list)";
            const MxOut a = mx_run(x, c, true, quant::JitPolicy::kOff);
            ASSERT_EQ(quant::mx_quant_jit_launch_count(), before + 1) << "policy off still launched a JIT kernel";
            const MxOut r = mx_run(x, c, false, quant::JitPolicy::kEnv);
            expect_same(j, r, nvfp4, "JIT vs CPU reference");
            expect_same(a, r, nvfp4, "AOT vs CPU reference");
            expect_same(j, a, nvfp4, "JIT vs AOT");
          }
        }
      }
    }
  }
}

// NVFP4 with a computed global: the AOT prologue (amax passes) must be recorded only once the JIT
// kernel is loaded, so a refused capture records nothing and a warmed-up one replays correctly.
TEST_F(JitMxGpu, GraphCaptureNeverCompilesThenWarmupFirst) {
  const MxCase c{true, 5, 4816, {}};  // K no other test compiles in this process
  const HostTensor x = mx_input(DType::kBF16, c, 3);
  quant::set_mx_quant_jit_policy(quant::JitPolicy::kAlways);
  HostTensor q(DType::kUInt8, c.rows, c.cols / 2, c.cols / 2 + 16);
  std::memset(q.bytes.data(), 0xa5, q.bytes.size());
  std::vector<uint8_t> s(size_t(scale_bytes(c)), 0xa5);
  DeviceBuffer dx(x.storage_bytes()), dq(q.storage_bytes()), ds(s.size()), dg(4);
  ASSERT_EQ(cudaMemcpy(ds.ptr, s.data(), s.size(), cudaMemcpyHostToDevice), cudaSuccess);
  const Nvfp4QuantArgs args{to_device(x, dx), to_device(q, dq), scale_view(c, ds.ptr, kDev), TensorView::contiguous(dg.ptr, DType::kFP32, {1}, kDev)};
  TestStream ts;
  auto op = [&](cudaStream_t s) { return run(args, c.opts, nullptr, s); };
  Status st = run_captured(ts.s, op);
  EXPECT_FALSE(st) << "a compile was allowed inside a graph capture";
  EXPECT_NE(st.message().find("encore jit warmup"), std::string::npos) << st.to_string();
  Status w = quant::mx_quant_jit_warmup({quant::MxKind::kNvfp4, DType::kBF16, c.cols}, 0, "", nullptr, nullptr);
  ASSERT_TRUE(w) << w.to_string();
  const int64_t before = quant::mx_quant_jit_launch_count();
  cudaGraph_t g = nullptr;
  st = run_captured(ts.s, op, &g);
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_EQ(quant::mx_quant_jit_launch_count(), before + 1) << "the capture recorded the AOT kernel, not the JIT one";
  Status r = replay(g, ts.s);
  ASSERT_TRUE(r) << r.to_string();
  MxOut got{{}, s, NAN};
  from_device(q, dq);
  got.q.assign(q.bytes.begin(), q.bytes.end());
  ASSERT_EQ(cudaMemcpy(got.s.data(), ds.ptr, got.s.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&got.g, dg.ptr, 4, cudaMemcpyDeviceToHost), cudaSuccess);
  expect_same(got, mx_run(x, c, false, quant::JitPolicy::kEnv), true, "graph replay vs CPU reference");
}

}  // namespace
}  // namespace encore::test
