// `encore check` rows for QK-norm and FP8 group quantization. With a GPU: the CUDA result against
// the CPU backend (QK-norm within the dtype tolerance, FP8 bit for bit). Without one: properties
// of the CPU result (unit-weight heads have RMS 1 and V heads are untouched; dequantized values
// lie within half an e4m3 step of the input).
#include <cmath>
#include <cstring>

#include "check.hpp"
#include "device_copy.hpp"
#include "encore/norm.hpp"
#include "encore/quant.hpp"
#include "testing/compare.hpp"

namespace encore::app {
namespace {

using test::HostTensor;

const Device kGpu{DeviceType::kCUDA, 0};

CheckRow qk_norm_row(bool gpu, DType t, int64_t tokens, int hq, int hkv, int d, std::mt19937_64& rng) {
  CheckRow row{"qk_norm", std::to_string(tokens) + "x" + std::to_string(hq) + "+" + std::to_string(hkv) + "x" + std::to_string(d),
               dtype_name(t), gpu ? "gpu vs cpu" : "cpu"};
  const int64_t width = int64_t(hq + 2 * hkv) * d;
  HostTensor qkv(t, tokens, width, width + 8), wq = HostTensor::vector(t, d), wk = HostTensor::vector(t, d);
  qkv.fill_normal(rng, 0.3, 2.0);
  wq.fill_normal(rng, 1.0, 0.3);
  wk.fill_normal(rng, 1.0, 0.3);
  if (!gpu) {
    wq.fill_uniform(rng, 1.0, 1.0);
    wk.fill_uniform(rng, 1.0, 1.0);
  }
  const QkNormOptions o{hq, hkv, d, 0.f, 0.f};
  HostTensor cpu = qkv;
  Status st = run(QkNormArgs{cpu.view(), wq.view(), wk.view()}, o);
  if (st && gpu) {
    DeviceCopy dq(qkv.bytes.data(), qkv.storage_bytes()), dwq(wq.bytes.data(), wq.storage_bytes()), dwk(wk.bytes.data(), wk.storage_bytes());
    HostTensor out = qkv;
    st = run(QkNormArgs{qkv.view(dq.get(), kGpu), wq.view(dwq.get(), kGpu), wk.view(dwk.get(), kGpu)}, o);
    if (st) st = dq.download(out.bytes.data());
    if (st) {
      const auto tol = test::tolerance_for(t);
      const auto c = test::compare(out, cpu, tol);
      row.error = c.rel_rms;
      row.pass = test::compare_ok(c, tol);
      // V heads and padding must be untouched.
      const size_t esz = dtype_size(t);
      for (int64_t tok = 0; tok < tokens && row.pass; ++tok) {
        const size_t v0 = size_t(tok * qkv.row_stride + int64_t(hq + hkv) * d) * esz;
        const size_t v1 = size_t(std::min(qkv.storage_elems(), (tok + 1) * qkv.row_stride)) * esz;
        row.pass = std::memcmp(out.bytes.data() + v0, qkv.bytes.data() + v0, v1 - v0) == 0;
        if (!row.pass) row.note = "V heads or padding changed";
      }
      if (!c.first_bad.empty()) row.note = c.first_bad;
    }
  } else if (st) {
    double worst = 0;
    for (int64_t tok = 0; tok < tokens; ++tok)
      for (int j = 0; j < hq + hkv; ++j) {
        double ss = 0;
        for (int e = 0; e < d; ++e) ss += cpu.get(tok, j * d + e) * cpu.get(tok, j * d + e);
        const double rms = std::sqrt(ss / d);
        worst = std::isfinite(rms) ? std::max(worst, std::fabs(rms - 1.0)) : INFINITY;
      }
    const bool v_same = std::memcmp(cpu.bytes.data() + size_t((hq + hkv) * d) * dtype_size(t),
                                    qkv.bytes.data() + size_t((hq + hkv) * d) * dtype_size(t), size_t(hkv * d) * dtype_size(t)) == 0;
    row.error = worst;
    row.pass = v_same && worst <= test::tolerance_for(t).rel_rms;
    row.note = v_same ? "head RMS vs 1" : "V heads changed";
  }
  if (!st) row.note = st.to_string();
  return row;
}

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

}  // namespace

std::vector<CheckRow> check_qk_norm(bool gpu, std::mt19937_64& rng) {
  std::vector<CheckRow> rows;
  for (DType t : {DType::kBF16, DType::kFP16}) {
    rows.push_back(qk_norm_row(gpu, t, 1, 32, 8, 128, rng));
    rows.push_back(qk_norm_row(gpu, t, 77, 4, 2, 64, rng));
    rows.push_back(qk_norm_row(gpu, t, 300, 3, 1, 256, rng));
  }
  return rows;
}

std::vector<CheckRow> check_fp8_group_quant(bool gpu, std::mt19937_64& rng) {
  std::vector<CheckRow> rows;
  for (DType t : {DType::kBF16, DType::kFP32}) {
    rows.push_back(fp8_row(gpu, t, 1, 128, false, rng));
    rows.push_back(fp8_row(gpu, t, 65, 896, true, rng));
  }
  return rows;
}

}  // namespace encore::app
