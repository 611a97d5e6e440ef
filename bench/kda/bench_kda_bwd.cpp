// Suite "kda_bwd": the CUDA KDA training step's kernels at the kda suite's configurations
// (kda_bench_case.hpp: bf16, H 16, K = V = 128, in-kernel softplus gate with dt_bias, q/k L2 norm;
// fla is timed on the same ones by bench/peers/kda_train_peers.py): the forward writing chunk_kda's
// residuals (G fp32; Aqk, Akk and, saved-h, the chunk states h in bf16), and the backward on both
// paths (saved h; rematerialize: residuals G, Aqk, Akk only), with dq, dk, dv, dg, dbeta, dA_log and
// ddt_bias written and d_o random in [-1, 1); and the saved-h backward with the A/B candidates
// (ENCORE_KDA_BWD_INTRA=factored, ENCORE_KDA_BWD_STAGED=1, both; both rematerializing). Device time per call from graph
// replays. The backward's launches are the ones to profile under ncu (scripts/ncu_hotspots.sh ... --
// bench kda_bwd).
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "bench/kda/kda_bench_case.hpp"

namespace encore::bench {
namespace {

using kdabench::Config;
using kdabench::kConfigs;
using kdabench::KdaBenchCase;
using kdabench::kH;
using kdabench::kK;
using kdabench::kV;

// One device allocation carved into the step's extra tensors (residuals, d_o, gradients, workspaces).
struct Arena {
  char* base = nullptr;
  size_t off = 0;
  size_t take(size_t bytes) {
    const size_t at = off;
    off = (off + bytes + 255) / 256 * 256;
    return at;
  }
};

struct KdaTrainCase {
  KdaForwardArgs fwd;      // with residuals (h included: the saved-h forward)
  KdaBackwardArgs saved;   // reads h
  KdaBackwardArgs remat;   // G, Aqk, Akk only
  KdaOptions opts;
  void* mem = nullptr;
  void *ws_fwd = nullptr, *ws_saved = nullptr, *ws_remat = nullptr;

  explicit KdaTrainCase(const KdaBenchCase& kc) : fwd(kc.a), opts(kc.opts) {
    const Device dev{DeviceType::kCUDA, 0};
    const int64_t B = kc.a.q.shape[0], T = kc.a.q.shape[1], H = kH, K = kK, V = kV;
    int64_t nt = 0;
    check_status(kda_chunk_count(kc.a, opts, &nt), "kda_chunk_count");
    // Sizes first (the layout with a null base), then one allocation.
    auto layout = [&](Arena& ar) {
      struct Off {
        size_t G, Aqk, Akk, h, d_o, dq, dk, dv, dg, dbeta, dA, ddt;
      } o{};
      o.G = ar.take(size_t(B * T * H * K) * 4);
      o.Aqk = ar.take(size_t(B * T * H * 64) * 2);
      o.Akk = ar.take(size_t(B * T * H * 64) * 2);
      o.h = ar.take(size_t(nt * H * K * V) * 2);
      o.d_o = ar.take(size_t(B * T * H * V) * 2);
      o.dq = ar.take(size_t(B * T * H * K) * 2);
      o.dk = ar.take(size_t(B * T * H * K) * 2);
      o.dv = ar.take(size_t(B * T * H * V) * 2);
      o.dg = ar.take(size_t(B * T * H * K) * 2);
      o.dbeta = ar.take(size_t(B * T * H) * 2);
      o.dA = ar.take(size_t(H) * 4);
      o.ddt = ar.take(size_t(H * K) * 4);
      return o;
    };
    Arena sizing;
    layout(sizing);
    check_cuda(cudaMalloc(&mem, sizing.off), "kda_bwd buffers");
    Arena ar{static_cast<char*>(mem), 0};
    const auto o = layout(ar);
    char* b = ar.base;
    fwd.residuals.G = TensorView::contiguous(b + o.G, DType::kFP32, {B, T, H, K}, dev);
    fwd.residuals.Aqk = TensorView::contiguous(b + o.Aqk, DType::kBF16, {B, T, H, 64}, dev);
    fwd.residuals.Akk = TensorView::contiguous(b + o.Akk, DType::kBF16, {B, T, H, 64}, dev);
    fwd.residuals.h = TensorView::contiguous(b + o.h, DType::kBF16, {nt, H, K, V}, dev);
    fill_random(b + o.d_o, size_t(B * T * H * V), FillKind::kBF16, 77, nullptr);
    saved.fwd = fwd;
    saved.d_o = TensorView::contiguous(b + o.d_o, DType::kBF16, {B, T, H, V}, dev);
    saved.dq = TensorView::contiguous(b + o.dq, DType::kBF16, {B, T, H, K}, dev);
    saved.dk = TensorView::contiguous(b + o.dk, DType::kBF16, {B, T, H, K}, dev);
    saved.dv = TensorView::contiguous(b + o.dv, DType::kBF16, {B, T, H, V}, dev);
    saved.dg = TensorView::contiguous(b + o.dg, DType::kBF16, {B, T, H, K}, dev);
    saved.dbeta = TensorView::contiguous(b + o.dbeta, DType::kBF16, {B, T, H}, dev);
    saved.dA_log = TensorView::contiguous(b + o.dA, DType::kFP32, {H}, dev);
    saved.ddt_bias = TensorView::contiguous(b + o.ddt, DType::kFP32, {H * K}, dev);
    remat = saved;
    remat.fwd.residuals.h = TensorView{};
    check_cuda(cudaMalloc(&ws_fwd, std::max<size_t>(workspace_bytes(fwd, opts), 16)), "kda forward workspace");
    check_cuda(cudaMalloc(&ws_saved, std::max<size_t>(workspace_bytes(saved, opts), 16)), "kda backward workspace");
    check_cuda(cudaMalloc(&ws_remat, std::max<size_t>(workspace_bytes(remat, opts), 16)), "kda backward workspace");
    check_cuda(cudaDeviceSynchronize(), "fill");
  }
  KdaTrainCase(const KdaTrainCase&) = delete;  // owns device memory
  KdaTrainCase& operator=(const KdaTrainCase&) = delete;
  ~KdaTrainCase() {
    for (void* p : {mem, ws_fwd, ws_saved, ws_remat}) check_cuda(cudaFree(p), "free");
  }
};

Record record(const char* name, const Config& c, const char* path) {
  Record r = kdabench::kda_record(name, c);
  r.suite = "kda_bwd";
  r.params.push_back({"path", path});
  r.params.push_back({"version", "tensor-core backward (mma.sync bf16, split hi + lo operands), fp32 chunk records"});
  return r;
}

}  // namespace

void run_kda_bwd_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  for (const Config& c : kConfigs) {
    const KdaBenchCase kc(c, *info);
    const KdaTrainCase tc(kc);
    const auto time = [&](const char* name, const char* path, auto&& call) {
      Timing t = time_launches([&](long long) { check_status(call(), name); }, stream, topts, 1);
      Record r = record(name, c, path);
      r.metrics = {{"time_us", t.median_us}};
      report.records.push_back(r);
      std::printf("  %-22s %-22s %-8s %9.1f us\n", name, c.name, path, t.median_us);
      std::fflush(stdout);
    };
    time("kda_forward_residuals", "saved_h", [&] { return run(tc.fwd, tc.opts, tc.ws_fwd, stream); });
    // The residuals now hold this forward's values for both backward paths.
    check_status(run(tc.fwd, tc.opts, tc.ws_fwd, stream), "kda forward");
    check_cuda(cudaStreamSynchronize(stream), "sync");
    time("kda_backward", "saved_h", [&] { return run(tc.saved, tc.opts, tc.ws_saved, stream); });
    time("kda_backward", "remat", [&] { return run(tc.remat, tc.opts, tc.ws_remat, stream); });
    // The A/B candidates (read at each call): kernel 3b's factored intra-chunk terms, the serial kernels'
    // staged record tiles, both; on the saved-h path and, for the staged states kernel, rematerializing.
    const auto candidate = [&](const char* path, const KdaBackwardArgs& args, void* ws, bool intra, bool staged) {
      if (intra) setenv("ENCORE_KDA_BWD_INTRA", "factored", 1);
      if (staged) setenv("ENCORE_KDA_BWD_STAGED", "1", 1);
      time("kda_backward", path, [&] { return run(args, tc.opts, ws, stream); });
      unsetenv("ENCORE_KDA_BWD_INTRA");
      unsetenv("ENCORE_KDA_BWD_STAGED");
    };
    candidate("saved_h_factored", tc.saved, tc.ws_saved, true, false);
    candidate("saved_h_staged", tc.saved, tc.ws_saved, false, true);
    candidate("saved_h_both", tc.saved, tc.ws_saved, true, true);
    candidate("remat_both", tc.remat, tc.ws_remat, true, true);
  }
}

}  // namespace encore::bench
