// Suite "kda": the CUDA KDA forward (bf16, H 16, K = V = 128, in-kernel softplus gate with dt_bias,
// q/k L2 norm, as in ../shared/docs/bench_peers.py) at the standard varlen configuration
// (seq_lens 1800, 1500, 2000, 1200, 800) and fixed B 1 / B 4, T 8192. Device time per call from
// graph replays; fla's chunk_kda is measured by bench/peers/kda_peers.py in the same job.
#include <cstdio>
#include <string>
#include <vector>

#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"
#include "encore/kda.hpp"

namespace encore::bench {

void run_kda_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  const Device dev{DeviceType::kCUDA, 0};
  struct Config { const char* name; int64_t B, T; std::vector<int64_t> cu; };
  const Config configs[] = {{"varlen_std", 1, 7300, {0, 1800, 3300, 5300, 6500, 7300}}, {"fixed_B1_T8192", 1, 8192, {}},
                            {"fixed_B4_T8192", 4, 8192, {}}};
  const int64_t H = 16, K = 128, V = 128;
  for (const Config& c : configs) {
    const int64_t B = c.B, T = c.T, N = c.cu.empty() ? B : int64_t(c.cu.size()) - 1;
    const size_t nk = size_t(B * T * H * K) * 2, nv = size_t(B * T * H * V) * 2, nb = size_t(B * T * H) * 2;
    size_t off = 0;
    auto take = [&](size_t bytes) { size_t at = off; off = (off + bytes + 255) / 256 * 256; return at; };
    const size_t q = take(nk), k = take(nk), v = take(nv), g = take(nk), beta = take(nb), o = take(nv), alog = take(size_t(H) * 4),
                 dtb = take(size_t(H * K) * 4), fin = take(size_t(N * H * K * V) * 4);
    Rotation rot = make_rotation(off, info->l2_bytes, FillKind::kBF16, /*flush=*/false);
    // beta in (0, 1) and finite fp32 A_log / dt_bias: overwrite the random bits.
    std::vector<uint16_t> hb(size_t(B * T * H), 0x3f00);  // bf16 0.5
    std::vector<float> ha(size_t(H), 0.0f), hd(size_t(H * K), 0.0f);
    check_cuda(cudaMemcpy(rot.set(0) + beta, hb.data(), nb, cudaMemcpyHostToDevice), "beta");
    check_cuda(cudaMemcpy(rot.set(0) + alog, ha.data(), ha.size() * 4, cudaMemcpyHostToDevice), "A_log");
    check_cuda(cudaMemcpy(rot.set(0) + dtb, hd.data(), hd.size() * 4, cudaMemcpyHostToDevice), "dt_bias");
    char* b = rot.set(0);
    KdaForwardArgs a;
    a.q = TensorView::contiguous(b + q, DType::kBF16, {B, T, H, K}, dev);
    a.k = TensorView::contiguous(b + k, DType::kBF16, {B, T, H, K}, dev);
    a.v = TensorView::contiguous(b + v, DType::kBF16, {B, T, H, V}, dev);
    a.g = TensorView::contiguous(b + g, DType::kBF16, {B, T, H, K}, dev);
    a.beta = TensorView::contiguous(b + beta, DType::kBF16, {B, T, H}, dev);
    a.o = TensorView::contiguous(b + o, DType::kBF16, {B, T, H, V}, dev);
    a.A_log = TensorView::contiguous(b + alog, DType::kFP32, {H}, dev);
    a.dt_bias = TensorView::contiguous(b + dtb, DType::kFP32, {H * K}, dev);
    a.final_state = TensorView::contiguous(b + fin, DType::kFP32, {N, H, K, V}, dev);
    std::vector<int64_t> cu = c.cu;
    if (!cu.empty()) a.cu_seqlens = TensorView::contiguous(cu.data(), DType::kInt64, {int64_t(cu.size())});
    KdaOptions opts;
    opts.use_gate_in_kernel = true;
    opts.use_qk_l2norm = true;
    opts.output_final_state = true;
    void* ws = nullptr;
    check_cuda(cudaMalloc(&ws, workspace_bytes(a, opts)), "kda workspace");
    Timing t = time_launches([&](long long) {
      Status st = run(a, opts, ws, stream);
      if (!st) {
        std::fprintf(stderr, "encore bench: kda: %s\n", st.to_string().c_str());
        std::exit(3);
      }
    }, stream, topts, 1);
    check_cuda(cudaFree(ws), "free");
    free_rotation(rot);
    Record r;
    r.suite = "kda";
    r.name = "kda_forward";
    r.params = {{"config", c.name}, {"dtype", "bf16"}, {"H", "16"}, {"K", "128"}, {"V", "128"}, {"gate", "softplus+dt_bias in kernel"},
                {"l2norm", "1"}, {"version", "mma.sync bf16, chunk + state kernels"}};
    r.metrics = {{"time_us", t.median_us}};
    report.records.push_back(r);
    std::printf("  kda_forward %-16s %9.1f us\n", c.name, t.median_us);
    std::fflush(stdout);
  }
}

}  // namespace encore::bench
