// CUDA MXFP8 / NVFP4 quantization and dequantization against the CPU backend, bit for bit: every
// input dtype, both scale layouts (row-major with a padded row stride; swizzled, padding included),
// both MXFP8 scale rules, computed and given NVFP4 global scales, odd row counts, strided rows, and
// specials (NaN, +-inf, zero and subnormal blocks, huge values, -0, exact rounding ties). Outputs are
// poisoned before every run; a failure prints the first mismatching index, its input and both outputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>
#include <vector>

#include "encore/quant.hpp"
#include "tests/common/aot_kernels.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {
namespace {

const Device kDev{DeviceType::kCUDA, 0};

struct Case {
  bool nvfp4;
  DType dtype;
  int64_t rows, cols, x_pad;
  MxQuantOptions opts;
  std::string name() const {
    std::ostringstream s;
    s << (nvfp4 ? "nvfp4 " : "mxfp8 ") << dtype_name(dtype) << " " << rows << "x" << cols << " pad " << x_pad
      << (opts.scale_layout == MxScaleLayout::kSwizzled ? " swizzled" : " rowmajor")
      << (nvfp4 ? (opts.global_scale > 0 ? " given global " + std::to_string(opts.global_scale) : " computed global")
                : (opts.rounding == MxScaleRounding::kRceil ? " rceil" : " floor"));
    return s.str();
  }
};

double finite_max(DType t) { return t == DType::kFP16 ? 65504.0 : 3.3e38; }
double subnormal(DType t) { return t == DType::kFP16 ? 3e-6 : t == DType::kBF16 ? 5e-39 : 7e-41; }

// Random blocks of random magnitude (2^-20 .. 2^20 times N(0, 1); fp16 2^-14 .. 2^10), then specials in the first rows.
HostTensor make_input(const Case& c) {
  auto rng = make_rng(uint64_t(c.rows * 7919 + c.cols * 31 + int(c.dtype) * 3 + c.nvfp4));
  HostTensor x(c.dtype, c.rows, c.cols, c.cols + c.x_pad);
  x.fill_normal(rng, 0.0, 1.0);
  std::uniform_int_distribution<int> ex(c.dtype == DType::kFP16 ? -14 : -20, c.dtype == DType::kFP16 ? 10 : 20);
  for (int64_t m = 0; m < c.rows; ++m)
    for (int64_t b = 0; b < c.cols / 16; ++b) {
      const double f = std::ldexp(1.0, ex(rng));
      for (int64_t k = b * 16; k < b * 16 + 16; ++k) x.set(m, k, x.get(m, k) * f);
    }
  const int64_t K = c.cols;
  auto put = [&](int64_t m, int64_t k, double v) {
    if (m < c.rows && k < K) x.set(m, k, v);
  };
  for (int64_t k = 0; k < 32; ++k) put(0, k, 0.0);              // zero block
  for (int64_t k = 32; k < 64; ++k) put(0, k, k % 3 ? -0.0 : 0.0);
  put(1, 3, NAN);
  put(1, 40, INFINITY);
  put(1, 70, -INFINITY);
  for (int64_t k = 96; k < 128; ++k) put(1, k, (k % 2 ? -1 : 1) * subnormal(c.dtype) * double(1 + k % 5));  // subnormal block
  for (int64_t k = 0; k < 32; ++k) put(2, k, (k % 2 ? -1 : 1) * finite_max(c.dtype) / double(1 + k));       // huge
  // Exact ties: e2m1 midpoints with d = 1 (block amax 6, global 1) and e4m3 midpoints with 2^e = 1
  // (block amax 448, floor rule).
  static const double e2m1_ties[16] = {6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5};
  for (int64_t k = 0; k < 16; ++k) put(3, k, e2m1_ties[k]);
  for (int64_t k = 32; k < 64; ++k) put(3, k, k == 32 ? 448.0 : (1.0 + (2 * (k % 8) + 1) / 16.0) * std::ldexp(1.0, int(k % 5) - 2));
  for (int64_t k = 64; k < 96; ++k) put(3, k, k == 64 ? 500.0 : 460.0 - double(k));  // saturation at 448
  return x;
}

std::string block_values(const HostTensor& x, int64_t m, int64_t k, int block) {
  std::ostringstream s;
  s.precision(9);
  const int64_t k0 = k / block * block;
  for (int64_t i = k0; i < k0 + block; ++i) s << (i == k ? "[" : "") << x.get(m, i) << (i == k ? "] " : " ");
  return s.str();
}

int64_t scale_buffer_bytes(const Case& c, int64_t* stride) {
  const int64_t sc = c.cols / (c.nvfp4 ? 16 : 32);
  if (c.opts.scale_layout == MxScaleLayout::kSwizzled) {
    *stride = 0;
    return (c.rows + 127) / 128 * 128 * ((sc + 3) / 4 * 4);
  }
  *stride = sc + 3;  // padded row stride
  return (c.rows - 1) * *stride + sc;
}

TensorView scale_view(const Case& c, void* p, int64_t stride, Device d) {
  const int64_t sc = c.cols / (c.nvfp4 ? 16 : 32);
  const DType t = c.nvfp4 ? DType::kFP8E4M3 : DType::kUInt8;
  if (c.opts.scale_layout == MxScaleLayout::kSwizzled)
    return TensorView::contiguous(p, t, {(c.rows + 127) / 128 * 128, (sc + 3) / 4 * 4}, d);
  return TensorView::strided(p, t, {c.rows, sc}, {stride, 1}, d);
}

bool same_bits_or_both_nan(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b && std::signbit(a) == std::signbit(b);
}

void run_case(const Case& c) {
  SCOPED_TRACE(c.name());
  const int block = c.nvfp4 ? 16 : 32;
  const HostTensor x = make_input(c);
  // NVFP4 with an odd row count: q rows only 4-byte aligned (every other row's codes in two 4-byte stores).
  const int64_t qcols = c.nvfp4 ? c.cols / 2 : c.cols, qstride = qcols + (c.nvfp4 && c.rows % 2 ? 4 : 16);
  const DType qt = c.nvfp4 ? DType::kUInt8 : DType::kFP8E4M3;
  HostTensor q_cpu(qt, c.rows, qcols, qstride), q_gpu(qt, c.rows, qcols, qstride);
  std::memset(q_cpu.bytes.data(), 0x5a, q_cpu.bytes.size());
  std::memset(q_gpu.bytes.data(), 0xa5, q_gpu.bytes.size());  // poison
  int64_t sstride = 0;
  const int64_t sbytes = scale_buffer_bytes(c, &sstride);
  std::vector<uint8_t> s_cpu(size_t(sbytes), 0x5a), s_gpu(size_t(sbytes), 0xa5);
  float g_cpu = NAN, g_gpu = NAN;

  DeviceBuffer dx(x.storage_bytes()), dq(q_gpu.storage_bytes()), ds{size_t(sbytes)}, dg(4);
  ASSERT_TRUE(dx.ptr && dq.ptr && ds.ptr && dg.ptr);
  const TensorView xd = to_device(x, dx), qd = to_device(q_gpu, dq);
  ENCORE_ASSERT_CUDA(cudaMemcpy(ds.ptr, s_gpu.data(), size_t(sbytes), cudaMemcpyHostToDevice));
  ENCORE_ASSERT_CUDA(cudaMemcpy(dg.ptr, &g_gpu, 4, cudaMemcpyHostToDevice));
  const TensorView sd = scale_view(c, ds.ptr, sstride, kDev), sh = scale_view(c, s_cpu.data(), sstride, Device{});
  const TensorView gd = TensorView::contiguous(dg.ptr, DType::kFP32, {1}, kDev), gh = TensorView::contiguous(&g_cpu, DType::kFP32, {1});

  Status st_cpu, st_gpu;
  if (c.nvfp4) {
    st_cpu = run(Nvfp4QuantArgs{x.view(), q_cpu.view(), sh, gh}, c.opts);
    st_gpu = run(Nvfp4QuantArgs{xd, qd, sd, gd}, c.opts);
  } else {
    st_cpu = run(Mxfp8QuantArgs{x.view(), q_cpu.view(), sh}, c.opts);
    st_gpu = run(Mxfp8QuantArgs{xd, qd, sd}, c.opts);
  }
  ASSERT_TRUE(st_cpu) << st_cpu.to_string();
  ASSERT_TRUE(st_gpu) << st_gpu.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  from_device(q_gpu, dq);
  ENCORE_ASSERT_CUDA(cudaMemcpy(s_gpu.data(), ds.ptr, size_t(sbytes), cudaMemcpyDeviceToHost));
  ENCORE_ASSERT_CUDA(cudaMemcpy(&g_gpu, dg.ptr, 4, cudaMemcpyDeviceToHost));

  if (c.nvfp4) {
    uint32_t a, b;
    std::memcpy(&a, &g_gpu, 4);
    std::memcpy(&b, &g_cpu, 4);
    EXPECT_EQ(a, b) << "global scale: gpu " << g_gpu << " cpu " << g_cpu;
  }
  int64_t bad = 0;
  for (int64_t m = 0; m < c.rows; ++m)
    for (int64_t k = 0; k < qcols; ++k) {
      const uint8_t a = q_gpu.bytes[size_t(m * qstride + k)], b = q_cpu.bytes[size_t(m * qstride + k)];
      if (a != b && bad++ < 3) {
        const int64_t e = c.nvfp4 ? 2 * k : k;
        ADD_FAILURE() << "q(" << m << ", " << k << "): gpu 0x" << std::hex << int(a) << " cpu 0x" << int(b) << std::dec
                      << "; x block (element " << e << " bracketed): " << block_values(x, m, e, block);
      }
    }
  EXPECT_EQ(bad, 0) << "q mismatches";
  bad = 0;
  const int64_t sc = c.cols / block;
  for (int64_t i = 0; i < sbytes; ++i) {
    if (c.opts.scale_layout == MxScaleLayout::kRowMajor && i % sstride >= sc) continue;  // row padding: not written
    if (s_gpu[size_t(i)] != s_cpu[size_t(i)] && bad++ < 3) {
      std::ostringstream where;
      if (c.opts.scale_layout == MxScaleLayout::kRowMajor) {
        where << "scale (" << i / sstride << ", " << i % sstride << "); x block: " << block_values(x, i / sstride, (i % sstride) * block, block);
      } else {
        where << "swizzled scale byte " << i;
        for (int64_t r = 0; r < c.rows; ++r)
          for (int64_t col = 0; col < sc; ++col)
            if (mx_swizzled_scale_offset(r, col, sc) == i) where << " = scale (" << r << ", " << col << "); x block: " << block_values(x, r, col * block, block);
      }
      ADD_FAILURE() << where.str() << ": gpu 0x" << std::hex << int(s_gpu[size_t(i)]) << " cpu 0x" << int(s_cpu[size_t(i)]);
    }
  }
  EXPECT_EQ(bad, 0) << "scale mismatches (a swizzled padding byte unmatched means it was not zeroed)";

  // Dequantization of the CPU's codes, both output dtypes.
  for (DType ot : {DType::kFP32, DType::kBF16}) {
    SCOPED_TRACE(std::string("dequant to ") + dtype_name(ot));
    HostTensor o_cpu(ot, c.rows, c.cols, c.cols + 8), o_gpu(ot, c.rows, c.cols, c.cols + 8);
    o_cpu.poison();
    std::memset(o_gpu.bytes.data(), 0x11, o_gpu.bytes.size());
    DeviceBuffer dout(o_gpu.storage_bytes());
    ASSERT_TRUE(dout.ptr);
    const TensorView od = to_device(o_gpu, dout);
    // The CPU's codes and scales on the device.
    const TensorView qd2 = to_device(q_cpu, dq);
    ENCORE_ASSERT_CUDA(cudaMemcpy(ds.ptr, s_cpu.data(), size_t(sbytes), cudaMemcpyHostToDevice));
    ENCORE_ASSERT_CUDA(cudaMemcpy(dg.ptr, &g_cpu, 4, cudaMemcpyHostToDevice));
    Status a, b;
    if (c.nvfp4) {
      a = run(Nvfp4DequantArgs{q_cpu.view(), sh, gh, o_cpu.view()}, c.opts);
      b = run(Nvfp4DequantArgs{qd2, sd, gd, od}, c.opts);
    } else {
      a = run(Mxfp8DequantArgs{q_cpu.view(), sh, o_cpu.view()}, c.opts);
      b = run(Mxfp8DequantArgs{qd2, sd, od}, c.opts);
    }
    ASSERT_TRUE(a) << a.to_string();
    ASSERT_TRUE(b) << b.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    from_device(o_gpu, dout);
    int64_t wrong = 0;
    for (int64_t m = 0; m < c.rows; ++m)
      for (int64_t k = 0; k < c.cols; ++k)
        if (!same_bits_or_both_nan(o_gpu.get(m, k), o_cpu.get(m, k)) && wrong++ < 3)
          ADD_FAILURE() << "dequant x(" << m << ", " << k << "): gpu " << o_gpu.get(m, k) << " cpu " << o_cpu.get(m, k)
                        << " (code byte 0x" << std::hex << int(q_cpu.bytes[size_t(m * qstride + (c.nvfp4 ? k / 2 : k))]) << ")";
    EXPECT_EQ(wrong, 0) << "dequant mismatches";
  }
}

class MxQuantGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    pin_aot_kernels(true);
  }
  void TearDown() override { pin_aot_kernels(false); }
};

const int64_t kShapes[][3] = {{1, 32, 0}, {4, 64, 8}, {37, 96, 0}, {129, 512, 16}, {300, 7168, 0}};

TEST_F(MxQuantGpu, Mxfp8EveryDtypeLayoutAndRule) {
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32})
    for (auto layout : {MxScaleLayout::kRowMajor, MxScaleLayout::kSwizzled})
      for (auto rounding : {MxScaleRounding::kFloor, MxScaleRounding::kRceil})
        for (const auto& s : kShapes) {
          MxQuantOptions o;
          o.scale_layout = layout;
          o.rounding = rounding;
          run_case({false, t, s[0], s[1], s[2], o});
        }
}

TEST_F(MxQuantGpu, Nvfp4EveryDtypeLayoutAndGlobal) {
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32})
    for (auto layout : {MxScaleLayout::kRowMajor, MxScaleLayout::kSwizzled})
      for (float global : {0.0f, 1.0f, 3.7e-3f, 1e-30f, 1e-33f, 1e30f}) {  // 1e-33: d < 2^-100 (fp64 bounds)
        for (const auto& s : kShapes) {
          MxQuantOptions o;
          o.scale_layout = layout;
          o.global_scale = global;
          run_case({true, t, s[0], s[1], s[2], o});
        }
        MxQuantOptions o;
        o.scale_layout = layout;
        o.global_scale = global;
        run_case({true, t, 3, 16, 0, o});  // K = 16: one block per row, 2 scale columns of padding
      }
}

// The random part at larger sizes, several seeds' worth of blocks (one row of 1M elements too).
TEST_F(MxQuantGpu, LargeShapes) {
  for (DType t : {DType::kBF16, DType::kFP32}) {
    run_case({false, t, 1000, 4096, 0, {}});
    run_case({true, t, 1000, 4096, 0, {}});
    run_case({true, t, 1, 1 << 20, 0, {MxScaleLayout::kSwizzled}});
  }
}

}  // namespace
}  // namespace encore::test
