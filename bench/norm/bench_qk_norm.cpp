// Suites "qk_norm" and "qk_norm_plans" (bf16, head_dim 128).
// qk_norm: encore's QK-norm in place on a fused QKV buffer against encore's generic per-row RMSNorm
//   over the same heads (two launches on contiguous [T*Hq, 128] and [T*Hkv, 128] buffers), at
//   Qwen3-8B heads (32 q + 8 kv) and 64 q + 4 kv, tokens 1 .. 65536; L2-flushed and warm.
//   Bytes = Q and K heads read once and written once. Floors in the same run: the launch floor (an
//   empty kernel, once) and, per shape, the in-place touch of the same Q and K bytes with the same
//   16-byte-per-thread mapping (launch_touch): what moving those bytes costs without the math.
// qk_norm_plans: the QK-norm kernel under every (threads per block, heads per thread) plan.
#include <algorithm>
#include <cstdio>
#include <string>

#include "bench/suites_internal.hpp"
#include "norm/testing.hpp"
#include "encore/core/device_info.hpp"
#include "encore/norm.hpp"

namespace encore::bench {
namespace {

constexpr int kHeadDim = 128;
const int kHeadConfigs[][2] = {{32, 8}, {64, 4}};
const int64_t kTokens[] = {1, 16, 64, 256, 4096, 8192, 16384, 65536};


struct QkShape {
  int64_t tokens;
  int hq, hkv;
  int64_t width() const { return int64_t(hq + 2 * hkv) * kHeadDim; }
  double bytes() const { return 2.0 * 2.0 * double(tokens) * (hq + hkv) * kHeadDim; }
};

// Median device time of QK-norm (specialized) on the fused buffer.
Timing time_specialized(const QkShape& s, const void* wq, const void* wk, bool flush, const DeviceInfo& info,
                        const TimeOptions& topts, cudaStream_t stream) {
  const Device dev{DeviceType::kCUDA, 0};
  Rotation rot = make_rotation(size_t(s.tokens * s.width()) * 2, info.l2_bytes, FillKind::kBF16, flush);
  const QkNormOptions o{s.hq, s.hkv, kHeadDim, 1e-6f, 0.f};
  const TensorView vq = TensorView::contiguous(const_cast<void*>(wq), DType::kBF16, {kHeadDim}, dev);
  const TensorView vk = TensorView::contiguous(const_cast<void*>(wk), DType::kBF16, {kHeadDim}, dev);
  Timing t = time_launches([&](long long i) {
    Status st = run(QkNormArgs{TensorView::contiguous(rot.set(i), DType::kBF16, {s.tokens, s.width()}, dev), vq, vk}, o, nullptr, stream);
    check_status(st, "qk_norm");
  }, stream, topts, rot.sets);
  free_rotation(rot);
  return t;
}

// The touch floor: the Q and K heads of every token read and written back by launch_touch (rows =
// tokens; rows = 0: the empty-kernel launch floor).
Timing time_touch(const QkShape& s, bool flush, const DeviceInfo& info, const TimeOptions& topts, cudaStream_t stream) {
  Rotation rot = make_rotation(size_t(std::max<int64_t>(s.tokens, 1) * s.width()) * 2, info.l2_bytes, FillKind::kBF16, flush);
  Timing t = time_launches([&](long long i) {
    launch_touch(rot.set(i), s.tokens, int64_t(s.hq + s.hkv) * kHeadDim * 2, s.width() * 2, stream);
  }, stream, topts, rot.sets);
  free_rotation(rot);
  return t;
}

// Generic path: encore's per-row RMSNorm, in place, over contiguous Q heads then K heads.
Timing time_generic(const QkShape& s, const void* wq, const void* wk, bool flush, const DeviceInfo& info,
                    const TimeOptions& topts, cudaStream_t stream) {
  const Device dev{DeviceType::kCUDA, 0};
  const size_t q_bytes = size_t(s.tokens * s.hq * kHeadDim) * 2, k_bytes = size_t(s.tokens * s.hkv * kHeadDim) * 2;
  const size_t k_off = (q_bytes + 255) / 256 * 256;
  Rotation rot = make_rotation(k_off + k_bytes, info.l2_bytes, FillKind::kBF16, flush);
  const TensorView vq = TensorView::contiguous(const_cast<void*>(wq), DType::kBF16, {kHeadDim}, dev);
  const TensorView vk = TensorView::contiguous(const_cast<void*>(wk), DType::kBF16, {kHeadDim}, dev);
  Timing t = time_launches([&](long long i) {
    TensorView q = TensorView::contiguous(rot.set(i), DType::kBF16, {s.tokens * s.hq, kHeadDim}, dev);
    TensorView k = TensorView::contiguous(rot.set(i) + k_off, DType::kBF16, {s.tokens * s.hkv, kHeadDim}, dev);
    Status st = run(RmsNormArgs{q, vq, q}, RmsNormOptions{1e-6f, 0.f}, nullptr, stream);
    if (st) st = run(RmsNormArgs{k, vk, k}, RmsNormOptions{1e-6f, 0.f}, nullptr, stream);
    check_status(st, "qk_norm");
  }, stream, topts, rot.sets);
  free_rotation(rot);
  return t;
}

}  // namespace

void run_qk_norm_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  void* w = nullptr;
  check_cuda(cudaMalloc(&w, 2 * kHeadDim * 2), "cudaMalloc (weights)");
  fill_random(w, 2 * kHeadDim, FillKind::kBF16, 9, stream);
  const void* wq = w;
  const void* wk = static_cast<char*>(w) + kHeadDim * 2;
  {
    const Timing tf = time_touch(QkShape{0, 32, 8}, false, *info, topts, stream);
    Record r;
    r.suite = "qk_norm";
    r.name = "launch_floor";
    r.params = {{"kernel", "empty, 1 block of 128 threads"}};
    r.metrics = {{"time_us", tf.median_us}};
    report.records.push_back(r);
    std::printf("  launch floor (empty kernel): %8.2f us\n", tf.median_us);
  }
  for (const auto& hc : kHeadConfigs) {
    for (int64_t tokens : kTokens) {
      if (!size_selected(tokens)) continue;
      const QkShape s{tokens, hc[0], hc[1]};
      for (bool flush : {true, false}) {
        Timing ts = time_specialized(s, wq, wk, flush, *info, topts, stream);
        Timing tg = time_generic(s, wq, wk, flush, *info, topts, stream);
        Timing tt = time_touch(s, flush, *info, topts, stream);
        const double gbps = s.bytes() / (ts.median_us * 1e-6) / 1e9;
        const norm::QkNormLaunchPlan plan = norm::plan_qk_norm(tokens, s.hq + s.hkv, kHeadDim, DType::kBF16, info->sm_count);
        Record r;
        r.suite = "qk_norm";
        r.name = "qk_norm";
        r.params = {{"dtype", "bf16"}, {"tokens", std::to_string(tokens)}, {"q_heads", std::to_string(s.hq)},
                    {"kv_heads", std::to_string(s.hkv)}, {"head_dim", std::to_string(kHeadDim)},
                    {"l2", flush ? "flushed" : "warm"},
                    {"plan", "t" + std::to_string(plan.threads) + "_h" + std::to_string(plan.heads_per_thread)}};
        r.metrics = {{"time_us", ts.median_us}, {"generic_rms_norm_us", tg.median_us},
                     {"speedup_vs_generic", tg.median_us / ts.median_us}, {"touch_floor_us", tt.median_us},
                     {"bytes", s.bytes()}, {"gbps", gbps},
                     {"frac_copy_bw", gbps / report.ceilings.copy_gbps}};
        report.records.push_back(r);
        std::printf("  qk_norm %2dq+%dkv T %6lld %-7s: %8.2f us (generic %8.2f us, %4.2fx; touch floor %8.2f us)  %6.0f GB/s %5.1f%%\n",
                    s.hq, s.hkv, (long long)tokens, flush ? "flushed" : "warm", ts.median_us, tg.median_us,
                    tg.median_us / ts.median_us, tt.median_us, gbps, 100.0 * gbps / report.ceilings.copy_gbps);
        std::fflush(stdout);
      }
    }
  }
  cudaFree(w);
}

void run_qk_norm_plans_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  void* w = nullptr;
  check_cuda(cudaMalloc(&w, 2 * kHeadDim * 2), "cudaMalloc (weights)");
  fill_random(w, 2 * kHeadDim, FillKind::kBF16, 9, stream);
  for (int64_t tokens : {int64_t(1), int64_t(64), int64_t(4096), int64_t(65536)}) {
    const QkShape s{tokens, 32, 8};
    Rotation rot = make_rotation(size_t(s.tokens * s.width()) * 2, info->l2_bytes, FillKind::kBF16);
    const norm::QkNormLaunchPlan chosen = norm::plan_qk_norm(tokens, s.hq + s.hkv, kHeadDim, DType::kBF16, info->sm_count);
    const int64_t heads = tokens * (s.hq + s.hkv);
    for (int threads : {64, 128, 256, 512}) {
      for (int hpt : {1, 2, 4}) {
        const int64_t groups = threads / 16;
        norm::QkNormLaunchPlan plan{threads, hpt, (heads + groups * hpt - 1) / (groups * hpt)};
        Timing t = time_launches([&](long long i) {
          norm::QkNormProblem p;
          p.qkv = rot.set(i);
          p.token_stride = s.width();
          p.q_weight = w;
          p.k_weight = static_cast<char*>(w) + kHeadDim * 2;
          p.tokens = tokens;
          p.num_q_heads = s.hq;
          p.num_kv_heads = s.hkv;
          p.head_dim = kHeadDim;
          p.dtype = DType::kBF16;
          Status st = cuda::launch_qk_norm(p, plan, stream);
          check_status(st, "qk_norm");
        }, stream, topts, rot.sets);
        const double gbps = s.bytes() / (t.median_us * 1e-6) / 1e9;
        const bool is_chosen = chosen.threads == threads && chosen.heads_per_thread == hpt;
        Record r;
        r.suite = "qk_norm_plans";
        r.name = "qk_norm";
        r.params = {{"tokens", std::to_string(tokens)}, {"plan", "t" + std::to_string(threads) + "_h" + std::to_string(hpt)},
                    {"chosen", is_chosen ? "yes" : "no"}};
        r.metrics = {{"time_us", t.median_us}, {"gbps", gbps}, {"frac_copy_bw", gbps / report.ceilings.copy_gbps}};
        report.records.push_back(r);
        std::printf("  qk_norm T %6lld threads %3d heads/thread %d: %8.2f us %6.0f GB/s %5.1f%%%s\n", (long long)tokens, threads,
                    hpt, t.median_us, gbps, 100.0 * gbps / report.ceilings.copy_gbps, is_chosen ? "  <- chosen" : "");
        std::fflush(stdout);
      }
    }
    free_rotation(rot);
  }
  cudaFree(w);
}

}  // namespace encore::bench
