// The JIT QK-norm and FP8 group quantization on the GPU: the dispatcher's JIT path (launch counter)
// and the ahead-of-time kernels on the SAME inputs, each against the CPU reference and against each
// other bit for bit (same source, same math, only the index arithmetic constant); odd shapes,
// padded rows, poisoned outputs; graph capture refusing to compile, then `warm-up first` capturing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "encore/core/device_info.hpp"
#include "encore/norm.hpp"
#include "encore/quant.hpp"
#include "jit/jit.hpp"
#include "norm/jit.hpp"
#include "norm/problem.hpp"
#include "quant/jit.hpp"
#include "tests/common/compare.hpp"
#include "tests/jit/capture.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/common/scoped_env.hpp"

namespace encore::test {
namespace {

class JitFamiliesGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    if (!jit::nvrtc_info().available) GTEST_SKIP() << "NVRTC not available: " << jit::nvrtc_info().library;
  }
  void TearDown() override {
    norm::set_qk_norm_jit_policy(norm::JitPolicy::kEnv);
    quant::set_fp8_group_quant_jit_policy(quant::JitPolicy::kEnv);
  }
};

int sm_count() {
  const DeviceInfo* info = nullptr;
  return get_device_info(0, &info) ? info->sm_count : 132;
}

size_t bytes_differ(const HostTensor& a, const HostTensor& b) {
  size_t n = 0;
  for (size_t i = 0; i < std::min(a.bytes.size(), b.bytes.size()); ++i) n += a.bytes[i] != b.bytes[i];
  return n;
}

// ---- QK-norm ----
struct QkInputs {
  HostTensor qkv, wq, wk;
  QkNormOptions o;
};
QkInputs qk_inputs(DType t, int64_t tokens, int hq, int hkv, int d, int64_t pad, float offset, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t width = int64_t(hq + 2 * hkv) * d;
  QkInputs in{HostTensor(t, tokens, width, width + pad), HostTensor::vector(t, d), HostTensor::vector(t, d), {hq, hkv, d, 1e-6f, offset}};
  in.qkv.fill_normal(rng, 0.3, 2.0);
  in.wq.fill_normal(rng, 1.0, 0.4);
  in.wk.fill_normal(rng, 1.0, 0.4);
  return in;
}
// The qkv buffer after one dispatch with `policy` (in place: a fresh device copy of the inputs).
HostTensor qk_gpu(const QkInputs& in, norm::JitPolicy policy) {
  DeviceBuffer dq(in.qkv.storage_bytes()), dwq(in.wq.storage_bytes()), dwk(in.wk.storage_bytes());
  norm::set_qk_norm_jit_policy(policy);
  Status st = run(QkNormArgs{to_device(in.qkv, dq), to_device(in.wq, dwq), to_device(in.wk, dwk)}, in.o);
  EXPECT_TRUE(st) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  HostTensor out = in.qkv;
  from_device(out, dq);
  return out;
}
HostTensor qk_cpu(const QkInputs& in) {
  HostTensor out = in.qkv;
  Status st = run(QkNormArgs{out.view(), in.wq.view(), in.wk.view()}, in.o);
  EXPECT_TRUE(st) << st.to_string();
  return out;
}
// V heads and row padding bit-identical to the input.
void expect_v_untouched(const QkInputs& in, const HostTensor& out) {
  const size_t esz = dtype_size(in.qkv.dtype);
  const int64_t qk_end = int64_t(in.o.num_q_heads + in.o.num_kv_heads) * in.o.head_dim;
  for (int64_t tok = 0; tok < in.qkv.rows; ++tok) {
    const size_t v0 = size_t(tok * in.qkv.row_stride + qk_end) * esz;
    const size_t v1 = size_t(std::min(in.qkv.storage_elems(), (tok + 1) * in.qkv.row_stride)) * esz;
    ASSERT_EQ(0, std::memcmp(out.bytes.data() + v0, in.qkv.bytes.data() + v0, v1 - v0)) << "V/padding changed, token " << tok;
  }
}

// The 32-byte-lane specializations (the sm_100+ plan; ENCORE_NORM_PACK_BYTES=32 takes it here) against
// the CPU reference, JIT and widening both counted.
TEST_F(JitFamiliesGpu, QkNormThirtyTwoBytePacksMatchCpu) {
  const ScopedEnv packs("ENCORE_NORM_PACK_BYTES", "32");
  for (DType t : {DType::kBF16, DType::kFP16})
    for (int d : {64, 128, 256})
      for (int64_t tokens : {int64_t(1), int64_t(333)}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " d" + std::to_string(d) + " tokens " + std::to_string(tokens));
        const QkInputs in = qk_inputs(t, tokens, 24, 4, d, 0, 0.f, uint64_t(std::random_device{}()) | 1);
        const int64_t jit0 = norm::qk_norm_jit_launch_count(), wide0 = norm::qk_norm_wide_plan_count();
        const HostTensor j = qk_gpu(in, norm::JitPolicy::kAuto);
        EXPECT_EQ(norm::qk_norm_jit_launch_count(), jit0 + 1);
        EXPECT_EQ(norm::qk_norm_wide_plan_count(), wide0 + 1);
        ENCORE_EXPECT_CLOSE(j, qk_cpu(in), t, "qkv (32-byte JIT vs CPU reference)");
        expect_v_untouched(in, j);
      }
}

TEST_F(JitFamiliesGpu, QkNormOutsideTheListMatchesCpuAndAheadOfTime) {
  const std::pair<int, int> layouts[] = {{24, 4}, {7, 3}, {1, 1}};
  for (DType t : {DType::kBF16, DType::kFP16}) {
    for (int d : {64, 128, 256}) {
      for (auto [hq, hkv] : layouts) {
        for (float offset : {0.f, 1.f}) {
          for (int64_t tokens : {int64_t(1), int64_t(7), int64_t(333), int64_t(4099)}) {
            SCOPED_TRACE(std::string(dtype_name(t)) + " d" + std::to_string(d) + " q" + std::to_string(hq) + " kv" +
                         std::to_string(hkv) + " off" + std::to_string(offset) + " tokens " + std::to_string(tokens));
            ASSERT_FALSE(norm::qk_norm_heads_in_aot_list(d, hq, hkv));
            const QkInputs in = qk_inputs(t, tokens, hq, hkv, d, tokens % 2 ? 8 : 0, offset, uint64_t(std::random_device{}()) | 1);
            const int64_t before = norm::qk_norm_jit_launch_count();
            const HostTensor j = qk_gpu(in, norm::JitPolicy::kAuto);
            ASSERT_EQ(norm::qk_norm_jit_launch_count(), before + 1) << "the dispatcher did not take the JIT path (auto, layout outside the list)";
            const HostTensor a = qk_gpu(in, norm::JitPolicy::kOff);
            ASSERT_EQ(norm::qk_norm_jit_launch_count(), before + 1) << "policy off still launched a JIT kernel";
            const HostTensor c = qk_cpu(in);
            ENCORE_EXPECT_CLOSE(j, c, t, "qkv (JIT vs CPU reference)");
            ENCORE_EXPECT_CLOSE(a, c, t, "qkv (AOT vs CPU reference)");
            expect_v_untouched(in, j);
            EXPECT_EQ(bytes_differ(j, a), 0u) << "JIT and AOT differ on the same inputs (same math: expected bit-identical)";
          }
        }
      }
    }
  }
}

TEST_F(JitFamiliesGpu, QkNormListedLayoutStaysAheadOfTimeUnderAuto) {
  const QkInputs in = qk_inputs(DType::kBF16, 5, 32, 8, 128, 0, 0.f, 11);
  const int64_t before = norm::qk_norm_jit_launch_count();
  const HostTensor a = qk_gpu(in, norm::JitPolicy::kAuto);
  EXPECT_EQ(norm::qk_norm_jit_launch_count(), before) << "auto must keep a listed layout on the AOT kernel";
  ENCORE_EXPECT_CLOSE(a, qk_cpu(in), DType::kBF16, "qkv");
  const HostTensor j = qk_gpu(in, norm::JitPolicy::kAlways);
  EXPECT_EQ(norm::qk_norm_jit_launch_count(), before + 1) << "always: every layout";
  EXPECT_EQ(bytes_differ(j, a), 0u);
}

TEST_F(JitFamiliesGpu, QkNormGraphCaptureNeverCompilesThenWarmupFirst) {
  const int hq = 5, hkv = 3, d = 128;  // a layout no other test compiles in this process
  const QkInputs in = qk_inputs(DType::kBF16, 4, hq, hkv, d, 0, 0.f, 5);
  TestStream ts;
  DeviceBuffer dq(in.qkv.storage_bytes()), dwq(in.wq.storage_bytes()), dwk(in.wk.storage_bytes());
  const QkNormArgs args{to_device(in.qkv, dq), to_device(in.wq, dwq), to_device(in.wk, dwk)};
  auto op = [&](cudaStream_t s) { return run(args, in.o, nullptr, s); };
  norm::set_qk_norm_jit_policy(norm::JitPolicy::kAlways);
  Status st = run_captured(ts.s, op);
  EXPECT_FALSE(st) << "a compile was allowed inside a graph capture";
  EXPECT_NE(st.message().find("encore jit warmup"), std::string::npos) << st.to_string();
  // Warm up (what `encore jit warmup` does on a GPU), then the capture records the JIT kernel.
  for (const auto& v : norm::qk_norm_jit_variants(DType::kBF16, d, hq, hkv, false, sm_count())) {
    Status w = norm::qk_norm_jit_warmup(v, 0, "", nullptr, nullptr);
    ASSERT_TRUE(w) << w.to_string();
  }
  const int64_t before = norm::qk_norm_jit_launch_count();
  cudaGraph_t g = nullptr;
  st = run_captured(ts.s, op, &g);
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_EQ(norm::qk_norm_jit_launch_count(), before + 1) << "the capture recorded the AOT kernel, not the JIT one";
  Status r = replay(g, ts.s);  // the capture ran nothing: qkv still holds the inputs
  ASSERT_TRUE(r) << r.to_string();
  HostTensor out = in.qkv;
  from_device(out, dq);
  ENCORE_EXPECT_CLOSE(out, qk_cpu(in), DType::kBF16, "qkv from the graph replay");
}

// ---- FP8 group quantization ----
struct QuantOut {
  HostTensor q;
  std::vector<float> scales;
};
HostTensor quant_input(DType t, int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostTensor x(t, rows, cols, cols + (rows % 2 ? 8 : 0));
  x.fill_normal(rng, 0.0, 4.0);
  for (int64_t k = 0; k < 128; ++k) x.set(0, k, 0.0);  // an all-zero group
  if (rows > 1)
    for (int64_t k = 0; k < 128; ++k) x.set(1, k, k % 2 ? 3e4 : -1e-3);  // a wide range
  if (rows > 3) {
    x.set(2, 5, NAN);
    x.set(3, cols - 1, INFINITY);
  }
  return x;
}
TensorView scale_view(void* p, int64_t rows, int64_t groups, bool column_major, Device d) {
  return column_major ? TensorView::strided(p, DType::kFP32, {rows, groups}, {1, rows}, d)
                      : TensorView::contiguous(p, DType::kFP32, {rows, groups}, d);
}
// Poisoned outputs (q NaN bytes, also its row padding; scales NaN), one dispatch with `policy`
// (policy kEnv with `cpu`: the CPU reference).
QuantOut quant_run(const HostTensor& x, bool column_major, bool pow2, quant::JitPolicy policy, bool cpu, Stream stream = nullptr) {
  const int64_t rows = x.rows, cols = x.cols, groups = cols / 128;
  QuantOut out{HostTensor(DType::kFP8E4M3, rows, cols, cols + 16), std::vector<float>(size_t(rows * groups), NAN)};
  std::memset(out.q.bytes.data(), 0x7f, out.q.bytes.size());
  Fp8GroupQuantOptions o;
  o.power_of_two_scales = pow2;
  if (cpu) {
    Status st = run(Fp8GroupQuantArgs{x.view(), out.q.view(), scale_view(out.scales.data(), rows, groups, column_major, Device{})}, o);
    EXPECT_TRUE(st) << st.to_string();
    return out;
  }
  DeviceBuffer dx(x.storage_bytes()), dq(out.q.storage_bytes()), ds(out.scales.size() * 4);
  EXPECT_EQ(cudaMemcpy(ds.ptr, out.scales.data(), out.scales.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  quant::set_fp8_group_quant_jit_policy(policy);
  Status st = run(Fp8GroupQuantArgs{to_device(x, dx), to_device(out.q, dq), scale_view(ds.ptr, rows, groups, column_major, Device{DeviceType::kCUDA, 0})},
                  o, nullptr, stream);
  EXPECT_TRUE(st) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  from_device(out.q, dq);
  EXPECT_EQ(cudaMemcpy(out.scales.data(), ds.ptr, out.scales.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}
// Bit for bit: q bytes (row padding included: still the poison) and scales (NaN compared as bits).
void expect_same(const QuantOut& a, const QuantOut& b, const char* what) {
  EXPECT_EQ(bytes_differ(a.q, b.q), 0u) << what << ": q bytes differ";
  ASSERT_EQ(a.scales.size(), b.scales.size());
  size_t bad = 0;
  for (size_t i = 0; i < a.scales.size(); ++i) bad += std::memcmp(&a.scales[i], &b.scales[i], 4) != 0;
  EXPECT_EQ(bad, 0u) << what << ": scales differ";
}

TEST_F(JitFamiliesGpu, Fp8QuantOutsideTheListMatchesCpuAndAheadOfTime) {
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (int64_t cols : {int64_t(5248), int64_t(384), int64_t(128)}) {
      for (int64_t rows : {int64_t(1), int64_t(7), int64_t(37), int64_t(2048)}) {
        for (bool column_major : {false, true}) {
          const bool pow2 = rows == 37;
          SCOPED_TRACE(std::string(dtype_name(t)) + " " + std::to_string(rows) + "x" + std::to_string(cols) +
                       (column_major ? " colmajor" : " rowmajor") + (pow2 ? " pow2" : ""));
          ASSERT_FALSE(quant::fp8_group_quant_cols_in_aot_list(cols));
          const HostTensor x = quant_input(t, rows, cols, uint64_t(std::random_device{}()) | 1);
          const int64_t before = quant::fp8_group_quant_jit_launch_count();
          const QuantOut j = quant_run(x, column_major, pow2, quant::JitPolicy::kAuto, false);
          ASSERT_EQ(quant::fp8_group_quant_jit_launch_count(), before + 1) << "the dispatcher did not take the JIT path (auto, K outside the list)";
          const QuantOut a = quant_run(x, column_major, pow2, quant::JitPolicy::kOff, false);
          ASSERT_EQ(quant::fp8_group_quant_jit_launch_count(), before + 1) << "policy off still launched a JIT kernel";
          const QuantOut c = quant_run(x, column_major, pow2, quant::JitPolicy::kEnv, true);
          expect_same(j, c, "JIT vs CPU reference");
          expect_same(a, c, "AOT vs CPU reference");
          expect_same(j, a, "JIT vs AOT");
        }
      }
    }
  }
}

TEST_F(JitFamiliesGpu, Fp8QuantGraphCaptureNeverCompilesThenWarmupFirst) {
  const int64_t rows = 4, cols = 3200;  // K no other test compiles in this process
  const HostTensor x = quant_input(DType::kBF16, rows, cols, 9);
  const int64_t groups = cols / 128;
  HostTensor q(DType::kFP8E4M3, rows, cols, cols + 16);
  std::memset(q.bytes.data(), 0x7f, q.bytes.size());
  DeviceBuffer dx(x.storage_bytes()), dq(q.storage_bytes()), ds(size_t(rows * groups) * 4);
  const Fp8GroupQuantArgs args{to_device(x, dx), to_device(q, dq), scale_view(ds.ptr, rows, groups, false, Device{DeviceType::kCUDA, 0})};
  TestStream ts;
  auto op = [&](cudaStream_t s) { return run(args, Fp8GroupQuantOptions{}, nullptr, s); };
  quant::set_fp8_group_quant_jit_policy(quant::JitPolicy::kAlways);
  Status st = run_captured(ts.s, op);
  EXPECT_FALSE(st) << "a compile was allowed inside a graph capture";
  EXPECT_NE(st.message().find("encore jit warmup"), std::string::npos) << st.to_string();
  for (const auto& v : quant::fp8_group_quant_jit_variants(DType::kBF16, cols, sm_count())) {
    Status w = quant::fp8_group_quant_jit_warmup(v, 0, "", nullptr, nullptr);
    ASSERT_TRUE(w) << w.to_string();
  }
  const int64_t before = quant::fp8_group_quant_jit_launch_count();
  cudaGraph_t g = nullptr;
  st = run_captured(ts.s, op, &g);
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_EQ(quant::fp8_group_quant_jit_launch_count(), before + 1) << "the capture recorded the AOT kernel, not the JIT one";
  Status r = replay(g, ts.s);
  ASSERT_TRUE(r) << r.to_string();
  QuantOut got{q, std::vector<float>(size_t(rows * groups))};
  from_device(got.q, dq);
  ASSERT_EQ(cudaMemcpy(got.scales.data(), ds.ptr, got.scales.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  expect_same(got, quant_run(x, false, false, quant::JitPolicy::kEnv, true), "graph replay vs CPU reference");
}

}  // namespace
}  // namespace encore::test
