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

namespace encore::bench {

void run_kda_decode_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  constexpr int64_t H = 32, HV = 32, K = 128, V = 128;
  const Device dev{DeviceType::kCUDA, 0};
  for (DType pdt : {DType::kFP32, DType::kBF16}) {
    for (int64_t N : {1, 8, 64, 256, 1024}) {
      const double es = double(dtype_size(pdt)), slot_bytes = double(HV * K * V) * es;
      const int64_t sets = std::max<int64_t>(1, int64_t(std::ceil(3.0 * double(info->l2_bytes) / (double(N) * slot_bytes))));
      const int64_t P = N * sets;
      // The inputs of one call, the pool and the index sets, in one allocation (sized with a null base first).
      KdaRecurrentArgs a;
      void *mem = nullptr, *pool = nullptr, *idx = nullptr;
      auto layout = [&](char* base) {
        Carve c{base, 0, dev};
        a.q = c.take(DType::kBF16, {N, 1, H, K});
        a.k = c.take(DType::kBF16, {N, 1, H, K});
        a.v = c.take(DType::kBF16, {N, 1, HV, V});
        a.g = c.take(DType::kBF16, {N, 1, HV, K});
        a.beta = c.take(DType::kBF16, {N, 1, HV});
        a.o = c.take(DType::kBF16, {N, 1, HV, V});
        a.A_log = c.take(DType::kFP32, {HV});
        a.dt_bias = c.take(DType::kFP32, {HV * K});
        idx = c.bytes(size_t(P) * 4);
        pool = c.bytes(size_t(double(P) * slot_bytes));
        return c.off;
      };
      check_cuda(cudaMalloc(&mem, layout(nullptr)), "kda_decode buffers");
      layout(static_cast<char*>(mem));
      for (const TensorView* t : {&a.q, &a.k, &a.v, &a.g, &a.beta})
        fill_random(t->data, size_t(t->numel()), FillKind::kBF16, uint64_t(t->numel()) + 11, stream);
      fill_random(pool, size_t(P * HV * K * V), pdt == DType::kFP32 ? FillKind::kFP32 : FillKind::kBF16, 5, stream);
      check_cuda(cudaMemsetAsync(a.A_log.data, 0, size_t(HV) * 4, stream), "A_log");
      check_cuda(cudaMemsetAsync(a.dt_bias.data, 0, size_t(HV * K) * 4, stream), "dt_bias");
      std::vector<int32_t> perm(static_cast<size_t>(P));
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), std::mt19937(1234));  // each set: N distinct slots anywhere in the pool
      check_cuda(cudaMemcpy(idx, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice), "indices");
      a.initial_state = TensorView::contiguous(pool, pdt, {P, HV, K, V}, dev);
      a.state_indices = TensorView::contiguous(idx, DType::kInt32, {N}, dev);
      KdaRecurrentOptions opts;
      opts.use_qk_l2norm = true;
      opts.use_gate_in_kernel = true;
      opts.use_beta_sigmoid = true;
      check_status(run(a, opts, nullptr, stream), "kda_decode");
      check_cuda(cudaStreamSynchronize(stream), "sync");
      const Timing t = time_launches(
          [&](long long i) {
            KdaRecurrentArgs c = a;
            c.state_indices.data = static_cast<int32_t*>(idx) + (i % sets) * N;
            check_status(run(c, opts, nullptr, stream), "kda_decode");
          },
          stream, topts, sets);
      const double state_bytes = 2.0 * double(N) * slot_bytes;
      const double io_bytes = double(N) * (2.0 * double(H * K) + 2.0 * double(HV * V) + double(HV * K) + double(HV)) * 2.0 + double(N) * 4.0;
      const double bytes = state_bytes + io_bytes;
      const double floor_us = report.ceilings.copy_gbps > 0 ? bytes / (report.ceilings.copy_gbps * 1e3) : 0.0;
      Record r;
      r.suite = "kda_decode";
      r.name = "kda_decode";
      r.params = {{"batch", std::to_string(N)}, {"tokens", "1"}, {"H", std::to_string(H)}, {"HV", std::to_string(HV)}, {"K", "128"},
                  {"V", "128"}, {"dtype", "bf16"}, {"pool", dtype_name(pdt)}, {"index_sets", std::to_string(sets)},
                  {"options", "softplus gate + dt_bias, q/k L2 norm, beta sigmoid, int32 indices [N]"},
                  {"version", "kda_decode_kernel<8, 128, bf16, St, single token>: block per (sequence, head, 32 or 64 columns: 64 once the grid covers every SM twice), the state slice packed in registers"}};
      r.metrics = {{"time_us", t.median_us}, {"min_us", t.min_us}, {"bytes", bytes}, {"floor_us", floor_us},
                   {"ratio_to_floor", floor_us > 0 ? t.median_us / floor_us : 0.0}, {"gbps", bytes / (t.median_us * 1e3)}};
      report.records.push_back(r);
      std::printf("  kda_decode pool %-4s batch %5lld  %9.2f us  floor %9.2f us  ratio %.2f  (%lld index sets)\n", dtype_name(pdt),
                  (long long)N, t.median_us, floor_us, floor_us > 0 ? t.median_us / floor_us : 0.0, (long long)sets);
      std::fflush(stdout);
      check_cuda(cudaFree(mem), "free");
    }
  }
}

}  // namespace encore::bench
