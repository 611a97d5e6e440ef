// LLaMA shifted-block backward on CUDA (llama_block_backward, qkv_norm_backward; encore/blocks/llama.hpp)
// in bf16 at small and odd M (200, 1000), d 256 / 512, F 688: the saved tensors from the CPU forward,
// random incoming gradients, outputs NaN-poisoned on the device first. Every gradient against the
// fp64 staged reference (src/blocks/reference/llama_block_bwd.hpp): its max error at most 2x that of
// the same schedule on the CPU backend in bf16 (fp64 accumulation, every stored intermediate rounded
// to bf16) + 1e-6, and a relative RMS error <= 8e-3 (the project's bf16 bound). Deterministic: a
// second run gives the same bits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "encore/blocks/llama.hpp"
#include "tests/blocks/llama_block_bwd_case.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {
namespace {

struct OnDevice {
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  std::vector<TensorView> views;
  TensorView add(const HostTensor& h) {
    bufs.push_back(std::make_unique<DeviceBuffer>(h.storage_bytes()));
    views.push_back(to_device(h, *bufs.back()));
    return views.back();
  }
};

void compare_2x(const char* name, const HostTensor& gpu, const HostTensor& cpu_lo, const std::vector<double>& ref) {
  const double err = max_abs_diff(gpu, ref), base = max_abs_diff(cpu_lo, ref), rms = rel_rms_err(gpu, ref);
  EXPECT_LE(err, 2.0 * base + 1e-6) << name << ": GPU max err " << err << " vs the CPU bf16 schedule's " << base;
  EXPECT_LE(rms, 8e-3) << name;
  std::printf("  %-8s GPU max err %.3e, CPU bf16 max err %.3e (ratio %.2f), GPU rel rms %.2e\n", name, err, base, base > 0 ? err / base : 0.0,
              rms);
}

TEST(LlamaBlockBwdGpu, Bf16AgainstFp64Reference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  struct S {
    int64_t M, d, heads, rotary;
  };
  uint64_t seed = 41;
  for (const S s : {S{200, 256, 6, 5}, S{1000, 256, 6, 5}, S{200, 512, 12, 10}, S{1000, 512, 12, 10}}) {
    SCOPED_TRACE("M " + std::to_string(s.M) + " d " + std::to_string(s.d));
    std::printf("M %lld d %lld F 688 Nqkv %lld\n", (long long)s.M, (long long)s.d, (long long)(s.heads * 64));
    auto rng = make_rng(seed++);
    BlockBwdCase k(s.M, s.d, 688, s.heads, s.rotary, 64, DType::kBF16, rng);
    OnDevice dev;
    std::vector<TensorView> v;
    for (const HostTensor* h : k.inputs()) v.push_back(dev.add(*h));
    for (HostTensor* h : k.outputs()) v.push_back(dev.add(*h));  // poisoned
    const LlamaBlockBwdArgs a = BlockBwdCase::args(v);
    const size_t bytes = workspace_bytes(a);
    ASSERT_GT(bytes, 0u) << validate(a).to_string();
    DeviceBuffer ws(bytes);
    Status st = run(a, ws.ptr);
    ASSERT_TRUE(st) << st.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    const size_t n_in = k.inputs().size();
    std::vector<HostTensor> gpu;
    for (size_t i = 0; i < k.outputs().size(); ++i) {
      gpu.push_back(*k.outputs()[i]);
      from_device(gpu.back(), *dev.bufs[n_in + i]);
    }
    // a second run: the same bits (no atomics; partials summed in order)
    st = run(a, ws.ptr);
    ASSERT_TRUE(st) << st.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    for (size_t i = 0; i < gpu.size(); ++i) {
      HostTensor again = gpu[i];
      from_device(again, *dev.bufs[n_in + i]);
      EXPECT_EQ(std::memcmp(again.bytes.data(), gpu[i].bytes.data(), gpu[i].storage_bytes()), 0) << BlockBwdCase::output_names()[i];
    }
    // ref_lo: the same schedule on the CPU backend in bf16; ref_hi: the fp64 staged reference
    std::vector<unsigned char> hws(workspace_bytes(k.host_args()) + 256);
    st = run(k.host_args(), align_up_256(hws));
    ASSERT_TRUE(st) << st.to_string();
    const auto ref = k.reference();
    for (size_t i = 0; i < gpu.size(); ++i) compare_2x(BlockBwdCase::output_names()[i], gpu[i], *k.outputs()[i], *ref->outs[i]);
  }
}

// The first layer (stage (a) alone) with the residual gradient accumulated.
TEST(LlamaBlockBwdGpu, QkvNormBackwardBf16) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto rng = make_rng(43);
  BlockBwdCase k(333, 256, 8, 6, 5, 64, DType::kBF16, rng);
  const int64_t M = k.c.M, d = k.c.d, N = k.c.nqkv();
  HostTensor dx(DType::kBF16, M, d), dw3(DType::kBF16, N, d), dg(HostTensor::vector(DType::kFP32, d));
  for (HostTensor* h : {&dx, &dw3, &dg}) h->poison();
  OnDevice dev;
  const HostTensor* ins[] = {&k.fwd.x2, &k.c.g1, &k.c.w3, &k.c.pos, &k.c.freq, &k.fwd.r2, &k.fwd.qkv, &k.d_qkv, &k.d_x2, &dx, &dw3, &dg};
  for (const HostTensor* h : ins) dev.add(*h);
  const std::vector<TensorView>& v = dev.views;
  QkvNormBwdArgs a{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11]};
  DeviceBuffer ws(workspace_bytes(a));
  const Status st = run(a, ws.ptr);
  ASSERT_TRUE(st) << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  HostTensor gdx = dx, gdw3 = dw3, gdg = dg;
  from_device(gdx, *dev.bufs[9]);
  from_device(gdw3, *dev.bufs[10]);
  from_device(gdg, *dev.bufs[11]);
  QkvNormBwdArgs h{k.fwd.x2.view(), k.c.g1.view(), k.c.w3.view(), k.c.pos.view(), k.c.freq.view(), k.fwd.r2.view(), k.fwd.qkv.view(),
                   k.d_qkv.view(), k.d_x2.view(), dx.view(), dw3.view(), dg.view()};
  std::vector<unsigned char> hws(workspace_bytes(h) + 256);
  ASSERT_TRUE(run(h, align_up_256(hws)));
  const reference::LlamaBlockBwdInputs in = reference::load_block_bwd_inputs(k.fa);
  std::vector<double> dq(static_cast<size_t>(M * N)), dxp(static_cast<size_t>(M * d));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) dq[size_t(m * N + n)] = k.d_qkv.get(m, n);
    for (int64_t n = 0; n < d; ++n) dxp[size_t(m * d + n)] = k.d_x2.get(m, n);
  }
  const auto r = reference::qkv_norm_backward(in.x2, in.r2, in.gamma1, in.w3, in.qkv, dq, in.pos, in.freq, dxp, M, d, N, 128);
  compare_2x("dx", gdx, dx, r.norm.dx);
  compare_2x("dw3", gdw3, dw3, r.dw3);
  compare_2x("dgamma", gdg, dg, r.norm.dgamma);
}

// CUDA limits give a Status error, not a crash: Nqkv and F not multiples of 8 (16-byte TMA rows).
TEST(LlamaBlockBwdGpu, RefusesUnalignedWidths) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto rng = make_rng(47);
  BlockBwdCase k(64, 64, 20, 3, 2, 6, DType::kBF16, rng);  // F = 20, Nqkv = 18: not multiples of 8
  OnDevice dev;
  std::vector<TensorView> v;
  for (const HostTensor* h : k.inputs()) v.push_back(dev.add(*h));
  for (HostTensor* h : k.outputs()) v.push_back(dev.add(*h));
  const LlamaBlockBwdArgs a = BlockBwdCase::args(v);
  DeviceBuffer ws(workspace_bytes(a));
  const Status st = run(a, ws.ptr);
  EXPECT_FALSE(st);
  std::printf("  %s\n", st.to_string().c_str());
}

}  // namespace
}  // namespace encore::test
