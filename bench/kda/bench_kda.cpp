// Suite "kda": the CUDA KDA forward (bf16, H 16, K = V = 128, in-kernel softplus gate with dt_bias,
// q/k L2 norm, as bench/peers/kda_peers.py runs fla) at the standard varlen configuration
// (seq_lens 1800, 1500, 2000, 1200, 800) and fixed B 1 / B 4, T 8192. Device time per call from
// graph replays; fla's chunk_kda is measured by bench/peers/kda_peers.py in the same job.
// Suite "kda_phases": the chunk kernel's per-phase cycles at the same configurations.
// Suite "kda_plans": the forward with the state kernel on 64-, 32- and 16-column blocks (launch plans
// through kda/testing.hpp's run overload).
#include <cstdio>
#include <string>

#include "bench/kda/kda_bench_case.hpp"
#include "kda/testing.hpp"

namespace encore::bench {

using kdabench::Config;
using kdabench::kConfigs;
using kdabench::kda_record;
using kdabench::KdaBenchCase;

void run_kda_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  for (const Config& c : kConfigs) {
    const KdaBenchCase kc(c, *info);
    Timing t = time_launches([&](long long) { kc.run_once(stream); }, stream, topts, 1);
    Record r = kda_record("kda_forward", c);
    r.metrics = {{"time_us", t.median_us}};
    report.records.push_back(r);
    std::printf("  kda_forward %-16s %9.1f us\n", c.name, t.median_us);
    std::fflush(stdout);
  }
}

// Suite "kda_phases": cycles per block of each barrier-separated phase of the chunk kernel (thread
// 0's clock64(), one profiled call after a warm-up call; see kda/testing.hpp for the phases).
void run_kda_phases_suite(Report& report, const TimeOptions&, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  for (const Config& c : kConfigs) {
    const KdaBenchCase kc(c, *info);
    kc.run_once(stream);
    unsigned long long cycles[cuda::kKdaChunkPhases] = {}, blocks = 0;
    check_cuda(cudaStreamSynchronize(stream), "sync");
    check_status(cuda::kda_chunk_profile_read(cycles, &blocks), "kda_phases");  // clears the counters
    check_status(cuda::kda_chunk_profile_enable(true), "kda_phases");
    kc.run_once(stream);
    check_cuda(cudaStreamSynchronize(stream), "sync");
    check_status(cuda::kda_chunk_profile_enable(false), "kda_phases");
    check_status(cuda::kda_chunk_profile_read(cycles, &blocks), "kda_phases");
    Record r = kda_record("kda_chunk_phases", c);
    std::printf("  kda_chunk_phases %-16s blocks %llu, cycles per block:", c.name, blocks);
    double per_block[cuda::kKdaChunkPhases], total = 0;
    for (int ph = 0; ph < cuda::kKdaChunkPhases; ++ph) {
      per_block[ph] = blocks ? double(cycles[ph]) / double(blocks) : 0.0;
      total += per_block[ph];
      r.metrics.push_back({"phase" + std::to_string(ph) + "_cycles", per_block[ph]});
    }
    for (int ph : cuda::kKdaChunkPhaseOrder) std::printf(" %s %.0f", cuda::kKdaChunkPhaseNames[ph], per_block[ph]);  // as they run
    std::printf(" (total %.0f)\n", total);
    std::fflush(stdout);
    report.records.push_back(r);
  }
}

// Suite "kda_plans": the whole forward with the state kernel on 64-, 32- and 16-column blocks (the
// chunk kernel on the rule's grid).
void run_kda_plans_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  for (const Config& c : kConfigs) {
    const KdaBenchCase kc(c, *info);
    for (int columns : {64, 32, 16}) {
      kda::KdaLaunchPlan plan;
      plan.state_columns = columns;
      auto once = [&](long long) { check_status(kda::run(kc.a, kc.opts, plan, kc.ws, stream), "kda_plans"); };
      Timing t = time_launches(once, stream, topts, 1);
      Record r = kda_record("kda_forward_plan", c);
      r.suite = "kda_plans";
      r.params.push_back({"state_columns", std::to_string(columns)});
      r.metrics = {{"time_us", t.median_us}};
      report.records.push_back(r);
      std::printf("  kda_forward %-16s state columns %2d %9.1f us\n", c.name, columns, t.median_us);
      std::fflush(stdout);
    }
  }
}

}  // namespace encore::bench
