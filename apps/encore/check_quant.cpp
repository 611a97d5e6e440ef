// `encore check` rows for the quant family (FP8 group quantization; MXFP8 / NVFP4). With a GPU: the
// CUDA result against the CPU backend, bit for bit (values and scales). Without one: the FP8 CPU
// result dequantized lies within half an e4m3 step of the input (MXFP8 / NVFP4: GPU rows only).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "check.hpp"
#include "device_copy.hpp"
#include "encore/quant.hpp"
#include "testing/compare.hpp"

namespace encore::app {
namespace {

using test::HostTensor;

CheckRow fp8_row(bool gpu, DType t, int64_t rows, int64_t cols, bool column_major, std::mt19937_64& rng) {
  CheckRow row{"fp8_group_quant", std::to_string(rows) + "x" + std::to_string(cols), dtype_name(t),
               gpu ? "gpu vs cpu" : "cpu"};
  const int64_t groups = cols / 128;
  HostTensor x(t, rows, cols), q(DType::kFP8E4M3, rows, cols), back(DType::kFP32, rows, cols);
  x.fill_normal(rng, 0.0, 3.0);
  std::vector<float> s(size_t(rows * groups), NAN);
  auto sview = [&](void* p, Device dev) {
    return column_major ? TensorView::strided(p, DType::kFP32, {rows, groups}, {1, rows}, dev)
                        : TensorView::contiguous(p, DType::kFP32, {rows, groups}, dev);
  };
  Status st = run(Fp8GroupQuantArgs{x.view(), q.view(), sview(s.data(), Device{})}, Fp8GroupQuantOptions{});
  if (st && gpu) {
    HostTensor qg = q;
    std::vector<float> sg(s.size(), NAN);
    DeviceCopy dx(x.bytes.data(), x.storage_bytes()), dq(qg.bytes.data(), qg.storage_bytes()), ds(sg.data(), sg.size() * 4);
    st = run(Fp8GroupQuantArgs{x.view(dx.get(), kGpu), qg.view(dq.get(), kGpu), sview(ds.get(), kGpu)}, Fp8GroupQuantOptions{});
    if (st) st = dq.download(qg.bytes.data());
    if (st) st = ds.download(sg.data());
    if (st) {
      int64_t mismatches = 0;
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t k = 0; k < cols; ++k) mismatches += qg.bytes[size_t(i * cols + k)] != q.bytes[size_t(i * cols + k)];
      for (size_t i = 0; i < s.size(); ++i) mismatches += !(sg[i] == s[i]);
      row.error = double(mismatches) / double(rows * cols + int64_t(s.size()));
      row.pass = mismatches == 0;
      row.note = "bit-exact";
    }
  } else if (st) {
    st = run(Fp8GroupDequantArgs{q.view(), sview(s.data(), Device{}), back.view()}, Fp8GroupQuantOptions{});
    double worst = 0;
    for (int64_t i = 0; i < rows && st; ++i)
      for (int64_t k = 0; k < cols; ++k) {
        const double v = x.get(i, k), scale = s[size_t(column_major ? (k / 128) * rows + i : i * groups + k / 128)];
        const double bound = std::max(std::fabs(v) / 16.0, std::ldexp(scale, -10));
        worst = std::max(worst, std::fabs(v - back.get(i, k)) / bound);
      }
    row.error = worst;
    row.pass = st.is_ok() && worst <= 1.0;
    row.note = "dequant error / e4m3 half-step";
  }
  if (!st) row.note = st.to_string();
  return row;
}

// MXFP8 (nvfp4 = false, swizzled scales, RCEIL) or NVFP4 (computed global, swizzled): the CUDA
// codes, scales and global scale against the CPU backend's, bit for bit.
CheckRow mx_row(bool nvfp4, DType t, int64_t rows, int64_t cols, std::mt19937_64& rng) {
  CheckRow row{nvfp4 ? "nvfp4_quant" : "mxfp8_quant", std::to_string(rows) + "x" + std::to_string(cols), dtype_name(t), "gpu vs cpu"};
  const int64_t sc = cols / (nvfp4 ? 16 : 32), qcols = nvfp4 ? cols / 2 : cols;
  HostTensor x(t, rows, cols), q(nvfp4 ? DType::kUInt8 : DType::kFP8E4M3, rows, qcols);
  x.fill_normal(rng, 0.0, 3.0);
  const size_t sbytes = size_t((rows + 127) / 128 * 128 * ((sc + 3) / 4 * 4));
  std::vector<uint8_t> s(sbytes), sg(sbytes);
  float g = 0, gg = 0;
  MxQuantOptions o;
  o.scale_layout = MxScaleLayout::kSwizzled;
  o.rounding = MxScaleRounding::kRceil;
  const DType st_t = nvfp4 ? DType::kFP8E4M3 : DType::kUInt8;
  auto sview = [&](void* p, Device d) { return TensorView::contiguous(p, st_t, {(rows + 127) / 128 * 128, (sc + 3) / 4 * 4}, d); };
  auto gview = [&](void* p, Device d) { return TensorView::contiguous(p, DType::kFP32, {1}, d); };
  Status st = nvfp4 ? run(Nvfp4QuantArgs{x.view(), q.view(), sview(s.data(), Device{}), gview(&g, Device{})}, o)
                    : run(Mxfp8QuantArgs{x.view(), q.view(), sview(s.data(), Device{})}, o);
  HostTensor qg = q;
  DeviceCopy dx(x.bytes.data(), x.storage_bytes()), dq(nullptr, qg.storage_bytes()), ds(nullptr, sbytes), dg(nullptr, 4);
  if (st) st = nvfp4 ? run(Nvfp4QuantArgs{x.view(dx.get(), kGpu), qg.view(dq.get(), kGpu), sview(ds.get(), kGpu), gview(dg.get(), kGpu)}, o)
                     : run(Mxfp8QuantArgs{x.view(dx.get(), kGpu), qg.view(dq.get(), kGpu), sview(ds.get(), kGpu)}, o);
  if (st) st = dq.download(qg.bytes.data());
  if (st) st = ds.download(sg.data());
  if (st && nvfp4) st = dg.download(&gg);
  if (st) {
    int64_t mismatches = 0;
    for (int64_t i = 0; i < rows * qcols; ++i) mismatches += qg.bytes[size_t(i)] != q.bytes[size_t(i)];
    for (size_t i = 0; i < sbytes; ++i) mismatches += sg[i] != s[i];
    mismatches += nvfp4 && std::memcmp(&g, &gg, 4) != 0;
    row.error = double(mismatches) / double(rows * qcols + int64_t(sbytes));
    row.pass = mismatches == 0;
    row.note = "bit-exact";
  } else {
    row.note = st.to_string();
  }
  return row;
}

}  // namespace

std::vector<CheckRow> check_quant(bool gpu, std::mt19937_64& rng) {
  std::vector<CheckRow> rows;
  for (DType t : {DType::kBF16, DType::kFP32}) {
    rows.push_back(fp8_row(gpu, t, 1, 128, false, rng));
    rows.push_back(fp8_row(gpu, t, 65, 896, true, rng));
  }
  if (gpu)
    for (DType t : {DType::kBF16, DType::kFP32}) {
      rows.push_back(mx_row(false, t, 65, 896, rng));
      rows.push_back(mx_row(true, t, 65, 896, rng));
    }
  return rows;
}

}  // namespace encore::app
