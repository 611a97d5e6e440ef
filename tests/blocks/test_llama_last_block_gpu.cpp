// The last layer + loss on CUDA (encore/blocks/llama_last.hpp) in bf16 at M 200 / 1000, d 256, F 688,
// V odd (1001) and a multiple of 8 (1024), ignored rows among the targets: the forward on the device
// against the fp64 textbook, then the backward from the CPU forward's saved tensors; outputs NaN-poisoned
// on the device first. Each output's max error against fp64 at most 2x that of the same schedule on the
// CPU backend in bf16 + 1e-6, and a relative RMS error <= 8e-3 (the loss: relative error <= 1e-3).
// Deterministic: a second backward gives the same bits. An all-ignored batch: loss 0, zero gradients.
// The workspaces start as NaN (0xff bytes): a step reading what no step wrote (e.g. dℓ's padding columns
// [V, round_up(V, 8))) shows as NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "tests/blocks/llama_last_case.hpp"
#include "tests/common/device_buffer.hpp"

namespace encore::test {
namespace {

struct OnDevice {
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  TensorView add(const HostTensor& h) {
    bufs.push_back(std::make_unique<DeviceBuffer>(h.storage_bytes()));
    return to_device(h, *bufs.back());
  }
};

void compare_2x(const char* name, const HostTensor& gpu, const HostTensor& cpu_lo, const Vec& ref) {
  const double err = max_abs_diff(gpu, ref), base = max_abs_diff(cpu_lo, ref), rms = rel_rms_err(gpu, ref);
  EXPECT_LE(err, 2.0 * base + 1e-6) << name << ": GPU max err " << err << " vs the CPU bf16 schedule's " << base;
  EXPECT_LE(rms, 8e-3) << name;
  std::printf("  %-13s GPU max err %.3e, CPU bf16 max err %.3e (ratio %.2f), GPU rel rms %.2e\n", name, err, base,
              base > 0 ? err / base : 0.0, rms);
}

// The case's tensors on the device, the outputs poisoned; args over them.
struct DeviceCase {
  OnDevice dev;
  LlamaLastBlockArgs f;
  LlamaLastBlockBwdArgs b;
  std::vector<std::pair<HostTensor*, DeviceBuffer*>> fwd_out, grads;
  explicit DeviceCase(LastCase& k) {
    f = k.fwd_args();
    b = k.bwd_args();
    auto put = [&](TensorView& v, const HostTensor& h) { v = dev.add(h); };
    put(f.y0, k.y0), put(f.x0, k.x0), put(f.w0, k.w0), put(f.w1, k.w1), put(f.w2, k.w2), put(f.gamma0, k.g0), put(f.gamma_final, k.gf);
    put(f.w_lm, k.wlm), put(f.target, k.target);
    std::vector<TensorView*> fo = {&f.x1, &f.x2, &f.z1, &f.h2, &f.r1, &f.r2, &f.lse, &f.loss};
    for (size_t i = 0; i < fo.size(); ++i) {
      HostTensor poisoned = *k.forward_outputs()[i];
      poisoned.poison();
      put(*fo[i], poisoned);
      fwd_out.push_back({k.forward_outputs()[i], dev.bufs.back().get()});
    }
    b.y0 = f.y0, b.w0 = f.w0, b.w1 = f.w1, b.w2 = f.w2, b.gamma0 = f.gamma0, b.gamma_final = f.gamma_final, b.w_lm = f.w_lm, b.target = f.target;
    put(b.x1, k.x1), put(b.x2, k.x2), put(b.z1, k.z1), put(b.h2, k.h2), put(b.r1, k.r1), put(b.r2, k.r2), put(b.lse, k.lse);
    put(b.d_loss, k.d_loss);
    std::vector<TensorView*> go = {&b.d_y0, &b.d_x0, &b.dw0, &b.dw1, &b.dw2, &b.dw_lm, &b.dgamma0, &b.dgamma_final};
    for (size_t i = 0; i < go.size(); ++i) {
      HostTensor poisoned = *k.grads()[i];
      poisoned.poison();
      put(*go[i], poisoned);
      grads.push_back({k.grads()[i], dev.bufs.back().get()});
    }
  }
  static std::vector<HostTensor> fetch(const std::vector<std::pair<HostTensor*, DeviceBuffer*>>& outs) {
    std::vector<HostTensor> got;
    for (auto [h, buf] : outs) {
      got.push_back(*h);
      from_device(got.back(), *buf);
    }
    return got;
  }
};

void run_case(int64_t M, int64_t V, int ignore_every, uint64_t seed) {
  const int64_t d = 256, F = 688;
  std::printf("M %lld d %lld F %lld V %lld\n", (long long)M, (long long)d, (long long)F, (long long)V);
  auto rng = make_rng(seed);
  LastCase k(M, d, F, V, DType::kBF16, rng, ignore_every);
  // the CPU forward in bf16 (ref_lo of the forward; its saved tensors feed both backwards)
  ASSERT_TRUE(run_last_forward(k)) << run_last_forward(k).to_string();
  DeviceCase g(k);  // the CPU forward's saved tensors on the device, every output poisoned there
  {
    const size_t bytes = workspace_bytes(g.f, {});
    ASSERT_GT(bytes, 0u) << validate(g.f, {}).to_string();
    DeviceBuffer ws(bytes);
    ENCORE_ASSERT_CUDA(cudaMemset(ws.ptr, 0xff, bytes));  // NaN everywhere: nothing may read what no step wrote
    const Status st = run(g.f, {}, ws.ptr);
    ASSERT_TRUE(st) << st.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  }
  const std::vector<HostTensor> gf = DeviceCase::fetch(g.fwd_out);
  const LastParams p = k.params();
  const LastForward f = textbook(p, 1e-5);
  const std::vector<const Vec*> fref = {&f.x1, &f.x2, &f.z1, &f.h2, &f.r1, &f.r2, &f.lse};
  const char* fnames[] = {"x1", "x2", "z1", "h2", "r1", "r2", "lse"};
  for (size_t i = 0; i < fref.size(); ++i) compare_2x(fnames[i], gf[i], *k.forward_outputs()[i], *fref[i]);
  const double loss = gf[7].get(0, 0);
  EXPECT_LE(std::fabs(loss - f.loss), 1e-3 * std::max(1.0, std::fabs(f.loss))) << "loss " << loss << " vs fp64 " << f.loss;
  std::printf("  loss GPU %.6f CPU bf16 %.6f fp64 %.6f\n", loss, k.loss.get(0, 0), f.loss);
  // the backward on the device (from the CPU forward's saved tensors), twice: the same bits
  const size_t bytes = workspace_bytes(g.b);
  ASSERT_GT(bytes, 0u) << validate(g.b).to_string();
  DeviceBuffer ws(bytes);
  ENCORE_ASSERT_CUDA(cudaMemset(ws.ptr, 0xff, bytes));  // NaN, dℓ's padding columns included
  Status st = run(g.b, {}, ws.ptr);
  ASSERT_TRUE(st) << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<HostTensor> gg = DeviceCase::fetch(g.grads);
  st = run(g.b, {}, ws.ptr);
  ASSERT_TRUE(st) << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<HostTensor> again = DeviceCase::fetch(g.grads);
  for (size_t i = 0; i < gg.size(); ++i)
    EXPECT_EQ(std::memcmp(again[i].bytes.data(), gg[i].bytes.data(), gg[i].storage_bytes()), 0) << LastCase::grad_names()[i];
  // ref_lo: the same schedule on the CPU backend in bf16; ref_hi: fp64
  ASSERT_TRUE(run_last_backward(k)) << run_last_backward(k).to_string();
  if (ignore_every == 1) {
    EXPECT_EQ(loss, 0.0f);
    for (size_t i = 0; i < gg.size(); ++i)
      for (int64_t r = 0; r < gg[i].rows; ++r)
        for (int64_t c = 0; c < gg[i].cols; ++c) ASSERT_EQ(gg[i].get(r, c), 0.0) << LastCase::grad_names()[i];
    return;
  }
  const std::vector<Vec> ref = reference_grads(p, f, k.d_loss.get(0, 0));
  for (size_t i = 0; i < gg.size(); ++i) compare_2x(LastCase::grad_names()[i], gg[i], *k.grads()[i], ref[i]);
}

TEST(LlamaLastBlockGpu, Bf16OddVocabulary) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  run_case(200, 1001, 5, 91);
  run_case(1000, 1001, 5, 92);
}

TEST(LlamaLastBlockGpu, Bf16VocabularyMultipleOf8) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  run_case(200, 1024, 5, 93);
  run_case(1000, 1024, 7, 94);
}

TEST(LlamaLastBlockGpu, AllIgnored) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  run_case(200, 1001, 1, 95);
}

}  // namespace
}  // namespace encore::test
