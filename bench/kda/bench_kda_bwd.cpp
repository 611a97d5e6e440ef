// Suite "kda_bwd": the CUDA KDA training step's kernels at the kda suite's configurations
// (kda_bench_case.hpp: bf16, H 16, K = V = 128, in-kernel softplus gate with dt_bias, q/k L2 norm;
// fla is timed on the same ones by bench/peers/kda_train_peers.py): the forward writing chunk_kda's
// residuals (Aqk, Akk and, saved-h, the chunk states h in bf16; not G), and the second backward on both
// paths (saved h; rematerialize: Aqk, Akk only, the forward re-run first writing h and G into the
// workspace), the saved-h one recomputing G from g, and the saved-h backward once more reading a saved
// G (path saved_h_G: the difference is the G pass), with dq, dk, dv, dg, dbeta, dA_log and ddt_bias
// written and d_o random in [-1, 1). Device time per call from graph replays. The backward's launches
// are the ones to profile under ncu (scripts/ncu_hotspots.sh ... -- bench kda_bwd).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "bench/kda/kda_bench_case.hpp"
#include "core/carve.hpp"

namespace encore::bench {
namespace {

using kdabench::Config;
using kdabench::kConfigs;
using kdabench::KdaBenchCase;
using kdabench::kH;
using kdabench::kK;
using kdabench::kV;

struct KdaTrainCase {
  KdaForwardArgs fwd;      // with chunk_kda's residuals (h included: the saved-h forward; no G)
  KdaForwardArgs fwd_G;    // the same and G (run once, untimed)
  KdaBackwardArgs saved;   // reads h, recomputes G
  KdaBackwardArgs saved_G; // reads h and G
  KdaBackwardArgs remat;   // Aqk, Akk only
  KdaOptions opts;
  void* mem = nullptr;
  void *ws_fwd = nullptr, *ws_saved = nullptr, *ws_saved_G = nullptr, *ws_remat = nullptr;

  explicit KdaTrainCase(const KdaBenchCase& kc) : fwd(kc.a), opts(kc.opts) {
    const Device dev{DeviceType::kCUDA, 0};
    const int64_t B = kc.a.q.shape[0], T = kc.a.q.shape[1], H = kH, K = kK, V = kV;
    int64_t nt = 0;
    check_status(kda_chunk_count(kc.a, opts, &nt), "kda_chunk_count");
    // The step's extra tensors (residuals, d_o, gradients) carved out of one allocation: sized with a
    // null base first (core/carve.hpp), then laid out on it.
    TensorView G;  // the saved G of fwd_G and saved_G
    auto layout = [&](char* base) {
      Carve c{base, 0, dev};
      G = c.take(DType::kFP32, {B, T, H, K});
      fwd.residuals.Aqk = c.take(DType::kBF16, {B, T, H, 64});
      fwd.residuals.Akk = c.take(DType::kBF16, {B, T, H, 64});
      fwd.residuals.h = c.take(DType::kBF16, {nt, H, K, V});
      saved.d_o = c.take(DType::kBF16, {B, T, H, V});
      saved.dq = c.take(DType::kBF16, {B, T, H, K});
      saved.dk = c.take(DType::kBF16, {B, T, H, K});
      saved.dv = c.take(DType::kBF16, {B, T, H, V});
      saved.dg = c.take(DType::kBF16, {B, T, H, K});
      saved.dbeta = c.take(DType::kBF16, {B, T, H});
      saved.dA_log = c.take(DType::kFP32, {H});
      saved.ddt_bias = c.take(DType::kFP32, {H * K});
      return c.off;
    };
    check_cuda(cudaMalloc(&mem, layout(nullptr)), "kda_bwd buffers");
    layout(static_cast<char*>(mem));
    fill_random(saved.d_o.data, size_t(B * T * H * V), FillKind::kBF16, 77, nullptr);
    fwd_G = fwd;
    fwd_G.residuals.G = G;
    saved.fwd = fwd;
    saved_G = saved;
    saved_G.fwd = fwd_G;
    remat = saved;
    remat.fwd.residuals.h = TensorView{};
    check_cuda(cudaMalloc(&ws_fwd, std::max<size_t>(workspace_bytes(fwd_G, opts), 16)), "kda forward workspace");
    check_cuda(cudaMalloc(&ws_saved, std::max<size_t>(workspace_bytes(saved, opts), 16)), "kda backward workspace");
    check_cuda(cudaMalloc(&ws_saved_G, std::max<size_t>(workspace_bytes(saved_G, opts), 16)), "kda backward workspace");
    check_cuda(cudaMalloc(&ws_remat, std::max<size_t>(workspace_bytes(remat, opts), 16)), "kda backward workspace");
    check_cuda(cudaDeviceSynchronize(), "fill");
  }
  KdaTrainCase(const KdaTrainCase&) = delete;  // owns device memory
  KdaTrainCase& operator=(const KdaTrainCase&) = delete;
  ~KdaTrainCase() {
    for (void* p : {mem, ws_fwd, ws_saved, ws_saved_G, ws_remat}) check_cuda(cudaFree(p), "free");
  }
};

constexpr const char* kSecond = "second backward (K0 prep, K1 scan, K2a, K2b: single-pass bf16 mma.sync, bf16 intermediates)";
constexpr const char* kRemat = "the forward re-run (h, G into the workspace), then the second backward";

// backward: the backward's version, or null for the forward row (kda_record names the forward's).
Record record(const char* name, const Config& c, const char* path, const char* backward) {
  Record r = kdabench::kda_record(name, c);
  r.suite = "kda_bwd";
  r.params.push_back({"path", path});
  if (backward) r.params.push_back({"backward", backward});
  return r;
}

}  // namespace

void run_kda_bwd_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  // ENCORE_BENCH_FILTER: only the configurations whose name contains it (profiling one under ncu).
  const char* filter = std::getenv("ENCORE_BENCH_FILTER");
  for (const Config& c : kConfigs) {
    if (filter && *filter && std::string(c.name).find(filter) == std::string::npos) continue;
    const KdaBenchCase kc(c, *info);
    const KdaTrainCase tc(kc);
    const auto time = [&](const char* name, const char* path, const char* backward, auto&& call) {
      Timing t = time_launches([&](long long) { check_status(call(), name); }, stream, topts, 1);
      Record r = record(name, c, path, backward);
      r.metrics = {{"time_us", t.median_us}};
      report.records.push_back(r);
      std::printf("  %-22s %-22s %-8s %9.1f us\n", name, c.name, path, t.median_us);
      std::fflush(stdout);
    };
    time("kda_forward_residuals", "saved_h", nullptr, [&] { return run(tc.fwd, tc.opts, tc.ws_fwd, stream); });
    // The residuals now hold this forward's values (G too) for every backward path.
    check_status(run(tc.fwd_G, tc.opts, tc.ws_fwd, stream), "kda forward");
    check_cuda(cudaStreamSynchronize(stream), "sync");
    // run() picks the kernels (kda_backward_kernels): for bf16 the second backward on both paths.
    time("kda_backward", "saved_h", kSecond, [&] { return run(tc.saved, tc.opts, tc.ws_saved, stream); });
    time("kda_backward", "saved_h_G", kSecond, [&] { return run(tc.saved_G, tc.opts, tc.ws_saved_G, stream); });
    time("kda_backward", "remat", kRemat, [&] { return run(tc.remat, tc.opts, tc.ws_remat, stream); });
  }
}

}  // namespace encore::bench
