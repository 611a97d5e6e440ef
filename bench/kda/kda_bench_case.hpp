// The KDA suites' shared setup (bench_kda.cpp, bench_kda_bwd.cpp): the configurations bench/peers/kda_peers.py
// and kda_train_peers.py time fla on (bf16, H 16, K = V = 128, in-kernel softplus gate with dt_bias, q/k L2
// norm; varlen seq_lens 1800, 1500, 2000, 1200, 800 and fixed B 1 / B 4, T 8192), their device buffers
// and the forward's arguments.
#pragma once
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"
#include "encore/kda.hpp"

namespace encore::bench::kdabench {

struct Config {
  const char* name;
  int64_t B, T;
  std::vector<int64_t> cu;
  bool randn_gate = false;  // A_log, dt_bias ~ N(0, 1) as bench/peers/kda_peers.py draws them (else 0)
};
// randn_gate: strong decays (e^A_log up to ~20) make some diagonal blocks' decay span exceed what one
// reference allows, so the chunk kernel takes its two-reference or halving paths there: the inputs
// fla is timed on.
inline const Config kConfigs[] = {{"varlen_std", 1, 7300, {0, 1800, 3300, 5300, 6500, 7300}},
                           {"fixed_B1_T8192", 1, 8192, {}},
                           {"fixed_B4_T8192", 4, 8192, {}},
                           {"varlen_std_randn_gate", 1, 7300, {0, 1800, 3300, 5300, 6500, 7300}, true}};
inline constexpr int64_t kH = 16, kK = 128, kV = 128;

// One configuration's device buffers (random bf16 q, k, v, g; beta 0.5; A_log, dt_bias 0 or N(0, 1)), its args,
// options and workspace.
struct KdaBenchCase {
  Rotation rot;
  std::vector<int64_t> cu;
  KdaForwardArgs a;
  KdaOptions opts;
  void* ws = nullptr;

  KdaBenchCase(const Config& c, const DeviceInfo& info) : cu(c.cu) {
    const Device dev{DeviceType::kCUDA, 0};
    const int64_t B = c.B, T = c.T, H = kH, K = kK, V = kV, N = c.cu.empty() ? B : int64_t(c.cu.size()) - 1;
    const size_t nk = size_t(B * T * H * K) * 2, nv = size_t(B * T * H * V) * 2, nb = size_t(B * T * H) * 2;
    size_t off = 0;
    auto take = [&](size_t bytes) { size_t at = off; off = (off + bytes + 255) / 256 * 256; return at; };
    const size_t q = take(nk), k = take(nk), v = take(nv), g = take(nk), beta = take(nb), o = take(nv), alog = take(size_t(H) * 4),
                 dtb = take(size_t(H * K) * 4), fin = take(size_t(N * H * K * V) * 4);
    rot = make_rotation(off, info.l2_bytes, FillKind::kBF16, /*flush=*/false);
    // beta in (0, 1) and finite fp32 A_log / dt_bias: overwrite the random bits.
    std::vector<uint16_t> hb(size_t(B * T * H), 0x3f00);  // bf16 0.5
    std::vector<float> ha(size_t(H), 0.0f), hd(size_t(H * K), 0.0f);
    if (c.randn_gate) {
      std::mt19937 rng(1234);
      std::normal_distribution<float> nd(0.f, 1.f);
      for (float& x : ha) x = nd(rng);
      for (float& x : hd) x = nd(rng);
    }
    check_cuda(cudaMemcpy(rot.set(0) + beta, hb.data(), nb, cudaMemcpyHostToDevice), "beta");
    check_cuda(cudaMemcpy(rot.set(0) + alog, ha.data(), ha.size() * 4, cudaMemcpyHostToDevice), "A_log");
    check_cuda(cudaMemcpy(rot.set(0) + dtb, hd.data(), hd.size() * 4, cudaMemcpyHostToDevice), "dt_bias");
    char* b = rot.set(0);
    a.q = TensorView::contiguous(b + q, DType::kBF16, {B, T, H, K}, dev);
    a.k = TensorView::contiguous(b + k, DType::kBF16, {B, T, H, K}, dev);
    a.v = TensorView::contiguous(b + v, DType::kBF16, {B, T, H, V}, dev);
    a.g = TensorView::contiguous(b + g, DType::kBF16, {B, T, H, K}, dev);
    a.beta = TensorView::contiguous(b + beta, DType::kBF16, {B, T, H}, dev);
    a.o = TensorView::contiguous(b + o, DType::kBF16, {B, T, H, V}, dev);
    a.A_log = TensorView::contiguous(b + alog, DType::kFP32, {H}, dev);
    a.dt_bias = TensorView::contiguous(b + dtb, DType::kFP32, {H * K}, dev);
    a.final_state = TensorView::contiguous(b + fin, DType::kFP32, {N, H, K, V}, dev);
    if (!cu.empty()) a.cu_seqlens = TensorView::contiguous(cu.data(), DType::kInt64, {int64_t(cu.size())});
    opts.use_gate_in_kernel = true;
    opts.use_qk_l2norm = true;
    opts.output_final_state = true;
    check_cuda(cudaMalloc(&ws, workspace_bytes(a, opts)), "kda workspace");
  }
  KdaBenchCase(const KdaBenchCase&) = delete;  // owns device memory
  KdaBenchCase& operator=(const KdaBenchCase&) = delete;
  ~KdaBenchCase() {
    check_cuda(cudaFree(ws), "free");
    free_rotation(rot);
  }
  void run_once(cudaStream_t stream) const {
    Status st = run(a, opts, ws, stream);
    check_status(st, "kda");
  }
};

inline Record kda_record(const char* name, const Config& c) {
  Record r;
  r.suite = "kda";
  r.name = name;
  r.params = {{"config", c.name}, {"dtype", "bf16"}, {"H", "16"}, {"K", "128"}, {"V", "128"}, {"gate", "softplus+dt_bias in kernel"},
              {"l2norm", "1"}, {"version", "chunk kernel (mma.sync bf16) + state kernel with o (wgmma bf16)"}};
  return r;
}

}  // namespace encore::bench::kdabench
