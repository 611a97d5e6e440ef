// Suite "moe_jit" (run_moe_jit_suite): the JIT MoE routing,
// dispatch (map kernels; the gather is AOT in both) and combine (docs/jit.md) against the
// ahead-of-time kernels on the same buffers, bf16: DeepSeek-V2's E 160, k 6, D 5120 (outside the
// AOT lists) and DeepSeek-V3's E 256, k 8, D 7168 (inside: the JIT must be no slower), tokens
// 1 .. 16384. Not L2-flushed (the routing and dispatch inputs are small). The JIT kernels are
// compiled before timing. Bytes: routing logits read; dispatch x rows read and written; combine
// the k slot rows read and the output written.
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"
#include "encore/moe.hpp"
#include "moe/jit.hpp"

namespace encore::bench {
namespace {

struct Shape {
  int E, k;
  int64_t D;
};

void* dev_alloc(size_t bytes, std::vector<void*>& owned) {
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, bytes < 16 ? 16 : bytes), "moe_jit alloc");
  owned.push_back(p);
  return p;
}

// Times `launch` with the family's JIT off and always; one record each, speedup_vs_aot on the JIT one.
void time_both(Report& report, const TimeOptions& topts, cudaStream_t stream, const char* op, void (*set_policy)(moe::JitPolicy),
               bool in_list, const Shape& s, int64_t T, double bytes, const std::function<void(long long)>& launch) {
  double us[2] = {0, 0};
  for (int jit_on = 0; jit_on < 2; ++jit_on) {
    set_policy(jit_on ? moe::JitPolicy::kAlways : moe::JitPolicy::kOff);
    launch(0);  // compile / load outside the timing (and outside the harness's graph capture)
    check_cuda(cudaStreamSynchronize(stream), "moe_jit warm-up");
    const Timing t = time_launches(launch, stream, topts);
    us[jit_on] = t.median_us;
    const double gbps = bytes / (t.median_us * 1e-6) / 1e9;
    Record r;
    r.suite = "moe_jit";
    r.name = std::string(op) + (jit_on ? "_jit" : "_aot");
    r.params = {{"dtype", "bf16"}, {"tokens", std::to_string(T)}, {"experts", std::to_string(s.E)}, {"top_k", std::to_string(s.k)},
                {"hidden", std::to_string(s.D)}, {"in_aot_list", in_list ? "yes" : "no"}};
    r.metrics = {{"time_us", t.median_us}, {"min_us", t.min_us}, {"max_us", t.max_us}, {"gbps", gbps}, {"frac_copy_bw", gbps / report.ceilings.copy_gbps}};
    if (jit_on) r.metrics.push_back({"speedup_vs_aot", us[0] / us[1]});
    report.records.push_back(r);
  }
  set_policy(moe::JitPolicy::kEnv);
  std::printf("  moe %-8s E %3d k %d D %5lld T %6lld: aot %9.2f us  jit %9.2f us  jit speedup %.2fx\n", op, s.E, s.k, (long long)s.D,
              (long long)T, us[0], us[1], us[0] / us[1]);
  std::fflush(stdout);
}

}  // namespace

void run_moe_jit_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  if (!jit::nvrtc_info().available) {
    std::printf("  moe_jit: NVRTC not available (%s): skipped\n", jit::nvrtc_info().library.c_str());
    return;
  }
  const Device dev{DeviceType::kCUDA, 0};
  const Shape shapes[] = {{160, 6, 5120}, {256, 8, 7168}};
  std::mt19937_64 rng(7);
  for (const Shape& s : shapes) {
    for (int64_t T : {int64_t(1), int64_t(64), int64_t(4096), int64_t(16384)}) {
      if (!size_selected(T)) continue;
      std::vector<void*> owned;
      const int64_t R = moe_permuted_rows(T, s.k, s.E, 1);
      // Ids: k distinct experts per token (as routing gives); slot rows of the combine: the identity map.
      std::vector<int32_t> ids(size_t(T * s.k)), slots(size_t(T * s.k));
      std::vector<int> pool(size_t(s.E));
      for (int e = 0; e < s.E; ++e) pool[size_t(e)] = e;
      for (int64_t t = 0; t < T; ++t)
        for (int j = 0; j < s.k; ++j) {
          std::swap(pool[size_t(j)], pool[std::uniform_int_distribution<size_t>(size_t(j), pool.size() - 1)(rng)]);
          ids[size_t(t * s.k + j)] = pool[size_t(j)];
          slots[size_t(t * s.k + j)] = int32_t(t * s.k + j);
        }
      void* logits = dev_alloc(size_t(T * s.E) * 2, owned);
      void* d_ids = dev_alloc(ids.size() * 4, owned);
      void* d_w = dev_alloc(ids.size() * 4, owned);
      void* d_slots = dev_alloc(slots.size() * 4, owned);
      void* x = dev_alloc(size_t(T * s.D) * 2, owned);
      void* xp = dev_alloc(size_t(R * s.D) * 2, owned);
      void* out = dev_alloc(size_t(T * s.D) * 2, owned);
      void* maps = dev_alloc(size_t(2 * s.E + 1 + T * s.k + R) * 4, owned);
      fill_random(logits, size_t(T * s.E), FillKind::kBF16, 3, stream);
      fill_random(x, size_t(T * s.D), FillKind::kBF16, 4, stream);
      fill_random(xp, size_t(R * s.D), FillKind::kBF16, 5, stream);
      fill_random(d_w, ids.size(), FillKind::kFP32, 6, stream);
      check_cuda(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), "ids");
      check_cuda(cudaMemcpy(d_slots, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice), "slots");
      int32_t* m = static_cast<int32_t*>(maps);
      const TensorView ids_v = TensorView::contiguous(d_ids, DType::kInt32, {T, s.k}, dev);
      const TensorView w_v = TensorView::contiguous(d_w, DType::kFP32, {T, s.k}, dev);

      const MoeRoutingArgs ra{TensorView::contiguous(logits, DType::kBF16, {T, s.E}, dev), {}, ids_v, w_v};
      const MoeRoutingOptions ro{s.k};
      time_both(report, topts, stream, "routing", moe::set_routing_jit_policy, moe::routing_shape_in_aot_list(s.E, s.k), s, T,
                double(T * s.E) * 2, [&](long long) { check_status(run(ra, ro, nullptr, stream), "moe_jit routing"); });
      // Routing overwrote the ids with its own (valid) choice; dispatch reads whatever is there.
      check_cuda(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), "ids");

      const MoeDispatchArgs da{ids_v,
                               TensorView::contiguous(x, DType::kBF16, {T, s.D}, dev),
                               TensorView::contiguous(m, DType::kInt32, {s.E}, dev),
                               TensorView::contiguous(m + s.E, DType::kInt32, {s.E + 1}, dev),
                               TensorView::contiguous(m + 2 * s.E + 1, DType::kInt32, {T, s.k}, dev),
                               TensorView::contiguous(m + 2 * s.E + 1 + T * s.k, DType::kInt32, {R}, dev),
                               TensorView::contiguous(xp, DType::kBF16, {R, s.D}, dev)};
      const MoeDispatchOptions dopt{s.E, 1};
      void* ws = dev_alloc(workspace_bytes(da, dopt), owned);
      time_both(report, topts, stream, "dispatch", moe::set_dispatch_jit_policy, moe::dispatch_shape_in_aot_list(s.E, s.k), s, T,
                double(T * s.k) * double(s.D) * 2 * 2, [&](long long) { check_status(run(da, dopt, ws, stream), "moe_jit dispatch"); });

      const MoeCombineArgs ca{TensorView::contiguous(xp, DType::kBF16, {R, s.D}, dev),
                              TensorView::contiguous(d_slots, DType::kInt32, {T, s.k}, dev), w_v,
                              TensorView::contiguous(out, DType::kBF16, {T, s.D}, dev)};
      time_both(report, topts, stream, "combine", moe::set_combine_jit_policy, moe::combine_shape_in_aot_list(s.D, s.k), s, T,
                double(T) * double(s.D) * 2 * (s.k + 1), [&](long long) { check_status(run(ca, MoeCombineOptions{}, nullptr, stream), "moe_jit combine"); });
      for (void* p : owned) cudaFree(p);
    }
  }
}

}  // namespace encore::bench
