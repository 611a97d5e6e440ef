// Suite "kda_decode": the KDA recurrent step on a state pool (encore/kda_serving.hpp; the decode kernel
// src/kda/cuda/kda_decode.cu) at Kimi-Linear's KDA layer: one token per sequence, batch 1, 8, 64, 256,
// 1024, H = HV = 32, K = V = 128, bf16 q, k, v, g, beta, o, fp32 A_log / dt_bias, the in-kernel softplus
// gate with dt_bias, q/k L2 norm, beta sigmoid (fla's serving call), int32 indices [N], fp32 and bf16
// pools. Device time per call from CUDA-graph replays; every call reads and writes other slots (index sets
// rotate over a pool of >= 3x L2, so the states come from HBM, as in a serving step whose pool dwarfs L2).
// The floor: the bytes a call must move (every touched state read and written once, the token inputs, o,
// the indices) at the copy bandwidth measured in the same run (report.ceilings.copy_gbps, as the other
// memory-bound suites); ratio = time / floor. bench/peers/kda_decode_peers.py times fla's
// fused_recurrent_kda_fwd on the same shapes.
// Suite "kda_decode_plans": the same calls on each single-token kernel (kda/cuda/kda_decode.hpp's
// KdaDecodeKernel: 32 or 64 columns a block, or whole heads staged in shared memory), each without and with
// programmatic dependent launch (PDL: graph replays of back-to-back calls, as a serving step's kernels
// follow each other) and (the column kernels) with PDL and the L2 prefetch one wave ahead, beside the
// rule's choice (kda/plan.hpp's kda_decode_plan).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/suites_internal.hpp"
#include "core/carve.hpp"
#include "encore/core/device_info.hpp"
#include "encore/kda_serving.hpp"
#include "kda/testing.hpp"  // run on an explicit decode kernel

namespace encore::bench {
namespace {

constexpr int64_t kH = 32, kHV = 32, kK = 128, kV = 128;

const char* kernel_name(cuda::KdaDecodeKernel k) {
  switch (k) {
    case cuda::KdaDecodeKernel::kColumns32: return "columns32";
    case cuda::KdaDecodeKernel::kColumns64: return "columns64";
    case cuda::KdaDecodeKernel::kHeads: return "heads";
  }
  return "?";
}

// One configuration's inputs, pool and index sets in one allocation, and its bytes and floor.
struct DecodeCase {
  KdaRecurrentArgs a;
  KdaRecurrentOptions opts;
  void *mem = nullptr, *idx = nullptr;
  int64_t N = 0, sets = 1;
  double bytes = 0, floor_us = 0;

  DecodeCase(DType pdt, int64_t n, const DeviceInfo& info, double copy_gbps, cudaStream_t stream) : N(n) {
    const Device dev{DeviceType::kCUDA, 0};
    const double es = double(dtype_size(pdt)), slot_bytes = double(kHV * kK * kV) * es;
    sets = std::max<int64_t>(1, int64_t(std::ceil(3.0 * double(info.l2_bytes) / (double(N) * slot_bytes))));
    const int64_t P = N * sets;
    void* pool = nullptr;
    auto layout = [&](char* base) {
      Carve c{base, 0, dev};
      a.q = c.take(DType::kBF16, {N, 1, kH, kK});
      a.k = c.take(DType::kBF16, {N, 1, kH, kK});
      a.v = c.take(DType::kBF16, {N, 1, kHV, kV});
      a.g = c.take(DType::kBF16, {N, 1, kHV, kK});
      a.beta = c.take(DType::kBF16, {N, 1, kHV});
      a.o = c.take(DType::kBF16, {N, 1, kHV, kV});
      a.A_log = c.take(DType::kFP32, {kHV});
      a.dt_bias = c.take(DType::kFP32, {kHV * kK});
      idx = c.bytes(size_t(P) * 4);
      pool = c.bytes(size_t(double(P) * slot_bytes));
      return c.off;
    };
    check_cuda(cudaMalloc(&mem, layout(nullptr)), "kda_decode buffers");
    layout(static_cast<char*>(mem));
    for (const TensorView* t : {&a.q, &a.k, &a.v, &a.g, &a.beta})
      fill_random(t->data, size_t(t->numel()), FillKind::kBF16, uint64_t(t->numel()) + 11, stream);
    fill_random(pool, size_t(P * kHV * kK * kV), pdt == DType::kFP32 ? FillKind::kFP32 : FillKind::kBF16, 5, stream);
    check_cuda(cudaMemsetAsync(a.A_log.data, 0, size_t(kHV) * 4, stream), "A_log");
    check_cuda(cudaMemsetAsync(a.dt_bias.data, 0, size_t(kHV * kK) * 4, stream), "dt_bias");
    std::vector<int32_t> perm(static_cast<size_t>(P));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(1234));  // each set: N distinct slots anywhere in the pool
    check_cuda(cudaMemcpy(idx, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice), "indices");
    a.initial_state = TensorView::contiguous(pool, pdt, {P, kHV, kK, kV}, dev);
    a.state_indices = TensorView::contiguous(idx, DType::kInt32, {N}, dev);
    opts.use_qk_l2norm = true;
    opts.use_gate_in_kernel = true;
    opts.use_beta_sigmoid = true;
    const double state_bytes = 2.0 * double(N) * slot_bytes;
    const double io_bytes = double(N) * (2.0 * double(kH * kK) + 2.0 * double(kHV * kV) + double(kHV * kK) + double(kHV)) * 2.0 + double(N) * 4.0;
    bytes = state_bytes + io_bytes;
    floor_us = copy_gbps > 0 ? bytes / (copy_gbps * 1e3) : 0.0;
  }
  ~DecodeCase() { cudaFree(mem); }
  DecodeCase(const DecodeCase&) = delete;
  DecodeCase& operator=(const DecodeCase&) = delete;

  // Device time per call (CUDA-graph replays), each call on the next index set; plan: null = the rule's.
  Timing time(const cuda::KdaDecodePlan* plan, const TimeOptions& topts, cudaStream_t stream) {
    auto once = [&](long long i) {
      KdaRecurrentArgs c = a;
      c.state_indices.data = static_cast<int32_t*>(idx) + (i % sets) * N;
      check_status(plan ? kda::run(c, opts, *plan, stream) : run(c, opts, nullptr, stream), "kda_decode");
    };
    once(0);
    check_cuda(cudaStreamSynchronize(stream), "sync");
    return time_launches(once, stream, topts, sets);
  }

  // The record of one timing on `plan` (the kernel, PDL and prefetch among its parameters).
  Record record(const char* suite, DType pdt, const cuda::KdaDecodePlan& plan, const Timing& t) const {
    Record r;
    r.suite = suite;
    r.name = "kda_decode";
    r.params = {{"batch", std::to_string(N)}, {"tokens", "1"}, {"H", std::to_string(kH)}, {"HV", std::to_string(kHV)}, {"K", "128"},
                {"V", "128"}, {"dtype", "bf16"}, {"pool", dtype_name(pdt)}, {"index_sets", std::to_string(sets)},
                {"options", "softplus gate + dt_bias, q/k L2 norm, beta sigmoid, int32 indices [N]"},
                {"kernel", kernel_name(plan.kernel)}, {"pdl", plan.pdl ? "1" : "0"}, {"prefetch", plan.prefetch ? "1" : "0"}};
    r.metrics = {{"time_us", t.median_us}, {"min_us", t.min_us}, {"bytes", bytes}, {"floor_us", floor_us},
                 {"ratio_to_floor", floor_us > 0 ? t.median_us / floor_us : 0.0}, {"gbps", bytes / (t.median_us * 1e3)}};
    return r;
  }
};

constexpr int64_t kBatches[] = {1, 8, 64, 256, 1024};

}  // namespace

void run_kda_decode_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  for (DType pdt : {DType::kFP32, DType::kBF16}) {
    for (int64_t N : kBatches) {
      DecodeCase c(pdt, N, *info, report.ceilings.copy_gbps, stream);
      const Timing t = c.time(nullptr, topts, stream);
      const cuda::KdaDecodePlan plan = kda::kda_decode_plan(N, kHV, pdt, true, info->sm_count);  // what run took
      report.records.push_back(c.record("kda_decode", pdt, plan, t));
      std::printf("  kda_decode pool %-4s batch %5lld  %9.2f us  floor %9.2f us  ratio %.2f  (%s, %lld index sets)\n", dtype_name(pdt),
                  (long long)N, t.median_us, c.floor_us, c.floor_us > 0 ? t.median_us / c.floor_us : 0.0, kernel_name(plan.kernel), (long long)c.sets);
      std::fflush(stdout);
    }
  }
}

void run_kda_decode_plans_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  for (DType pdt : {DType::kFP32, DType::kBF16}) {
    for (int64_t N : kBatches) {
      DecodeCase c(pdt, N, *info, report.ceilings.copy_gbps, stream);
      const cuda::KdaDecodePlan rule = kda::kda_decode_plan(N, kHV, pdt, true, info->sm_count);
      for (cuda::KdaDecodeKernel k : {cuda::KdaDecodeKernel::kColumns32, cuda::KdaDecodeKernel::kColumns64, cuda::KdaDecodeKernel::kHeads})
        for (int v = 0; v < (k == cuda::KdaDecodeKernel::kHeads ? 2 : 3); ++v) {  // no PDL, PDL, PDL + L2 prefetch (not whole heads)
          const bool pdl = v > 0, prefetch = v == 2;
          const cuda::KdaDecodePlan plan{k, pdl, prefetch};
          const bool is_rule = k == rule.kernel && pdl == rule.pdl && prefetch == rule.prefetch;
          const Timing t = c.time(&plan, topts, stream);
          Record r = c.record("kda_decode_plans", pdt, plan, t);
          r.params.push_back({"rule", is_rule ? "yes" : "no"});
          report.records.push_back(r);
          std::printf("  kda_decode_plans pool %-4s batch %5lld  %-9s pdl %d prefetch %d %9.2f us  ratio %.3f%s\n", dtype_name(pdt),
                      (long long)N, kernel_name(k), int(pdl), int(prefetch), t.median_us, c.floor_us > 0 ? t.median_us / c.floor_us : 0.0, is_rule ? "  (rule)" : "");
          std::fflush(stdout);
        }
    }
  }
}

}  // namespace encore::bench
