// Test helper: a mix of small ops (RMSNorm, add + RMSNorm, QK-norm, FP8 group quantization, MoE
// routing, the KDA decode step on a state pool) as jobs for the concurrency tests (tests/core/test_concurrency_*.cpp). A job owns its
// random host inputs; its run appends copies of them and its (unwritten) outputs to the caller's
// vector, places each with the backend (a host view, or a device copy on the backend's stream) and
// runs the op once. The caller then reads every tensor back (inputs too: they must be unchanged), so
// calls made from many threads compare bit for bit with the same calls made serially. Shapes include
// hidden sizes outside the ahead-of-time lists (the JIT path on CUDA, first use racing).
#pragma once
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "encore/kda_serving.hpp"
#include "encore/moe.hpp"
#include "encore/norm.hpp"
#include "encore/quant.hpp"
#include "testing/host_tensor.hpp"

namespace encore::test {

// What a backend gives a job: a view of a tensor on the backend's device, and the stream.
struct JobIo {
  std::function<TensorView(HostTensor&)> place;
  Stream stream = nullptr;
};

// run(io, ts): appends its tensors to ts (reserved by the caller for kMaxTensors: views stay valid).
struct Job {
  static constexpr size_t kMaxTensors = 8;
  std::string name;
  std::function<Status(JobIo&, std::vector<HostTensor>&)> run;
};

// The mix; `seed` fixes every input.
inline std::vector<Job> mixed_jobs(uint64_t seed) {
  std::vector<Job> jobs;
  auto norm = [&](int64_t rows, int64_t hidden, DType t, bool add) {
    std::mt19937_64 rng(seed + uint64_t(rows * 131 + hidden * 7 + int(add)));
    auto x = std::make_shared<HostTensor>(t, rows, hidden), r = std::make_shared<HostTensor>(t, rows, hidden);
    auto w = std::make_shared<HostTensor>(HostTensor::vector(t, hidden));
    x->fill_normal(rng), r->fill_normal(rng), w->fill_normal(rng, 1.0, 0.1);
    const std::string name = std::string(add ? "add_rms_norm " : "rms_norm ") + std::to_string(rows) + "x" + std::to_string(hidden);
    jobs.push_back({name, [=](JobIo& io, std::vector<HostTensor>& ts) {
                      ts.push_back(*x), ts.push_back(*r), ts.push_back(*w), ts.emplace_back(t, rows, hidden), ts.emplace_back(t, rows, hidden);
                      const TensorView xv = io.place(ts[0]), rv = io.place(ts[1]), wv = io.place(ts[2]), y = io.place(ts[3]),
                                       h = io.place(ts[4]);
                      if (!add) return run(RmsNormArgs{xv, wv, y}, {}, nullptr, io.stream);
                      return run(AddRmsNormArgs{xv, rv, wv, y, h}, {}, nullptr, io.stream);
                    }});
  };
  norm(7, 4096, DType::kBF16, false);
  norm(33, 4104, DType::kBF16, false);  // outside the ahead-of-time hidden sizes: JIT on CUDA
  norm(5, 5184, DType::kFP16, true);    // likewise, with the residual add
  norm(64, 2048, DType::kFP32, true);
  {
    std::mt19937_64 rng(seed + 1);
    auto qkv = std::make_shared<HostTensor>(DType::kBF16, 9, (8 + 2 * 2) * 128);
    auto qw = std::make_shared<HostTensor>(HostTensor::vector(DType::kBF16, 128)), kw = std::make_shared<HostTensor>(*qw);
    qkv->fill_normal(rng), qw->fill_normal(rng, 1.0, 0.1), kw->fill_normal(rng, 1.0, 0.1);
    jobs.push_back({"qk_norm 9 tokens", [=](JobIo& io, std::vector<HostTensor>& ts) {
                      ts.push_back(*qkv), ts.push_back(*qw), ts.push_back(*kw);  // qkv normalized in place
                      QkNormOptions o;
                      o.num_q_heads = 8, o.num_kv_heads = 2;
                      const TensorView a = io.place(ts[0]), b = io.place(ts[1]), c = io.place(ts[2]);
                      return run(QkNormArgs{a, b, c}, o, nullptr, io.stream);
                    }});
  }
  {
    std::mt19937_64 rng(seed + 2);
    auto x = std::make_shared<HostTensor>(DType::kBF16, 17, 7168);
    x->fill_normal(rng);
    jobs.push_back({"fp8_group_quant 17x7168", [=](JobIo& io, std::vector<HostTensor>& ts) {
                      ts.push_back(*x), ts.emplace_back(DType::kFP8E4M3, 17, 7168), ts.emplace_back(DType::kFP32, 17, 7168 / 128);
                      const TensorView xv = io.place(ts[0]), q = io.place(ts[1]), sc = io.place(ts[2]);
                      return run(Fp8GroupQuantArgs{xv, q, sc}, {}, nullptr, io.stream);
                    }});
  }
  {
    std::mt19937_64 rng(seed + 3);
    auto logits = std::make_shared<HostTensor>(DType::kFP32, 50, 128);
    logits->fill_normal(rng);
    jobs.push_back({"moe_routing 50x128 top 8", [=](JobIo& io, std::vector<HostTensor>& ts) {
                      ts.push_back(*logits), ts.emplace_back(DType::kInt32, 50, 8), ts.emplace_back(DType::kFP32, 50, 8);
                      MoeRoutingArgs a;
                      a.logits = io.place(ts[0]), a.topk_ids = io.place(ts[1]), a.topk_weights = io.place(ts[2]);
                      return run(a, MoeRoutingOptions{}, nullptr, io.stream);
                    }});
  }
  {  // the KDA decode step on a state pool: 6 sequences (one padding) of one token, the fp32 pool written in place
    constexpr int64_t N = 6, H = 2, HV = 4, K = 64, V = 32, P = 9;
    std::mt19937_64 rng(seed + 4);
    auto q = std::make_shared<HostTensor>(DType::kBF16, N, H * K), k = std::make_shared<HostTensor>(DType::kBF16, N, H * K);
    auto v = std::make_shared<HostTensor>(DType::kBF16, N, HV * V), g = std::make_shared<HostTensor>(DType::kBF16, N, HV * K);
    auto beta = std::make_shared<HostTensor>(DType::kBF16, N, HV), pool = std::make_shared<HostTensor>(DType::kFP32, P, HV * K * V);
    auto idx = std::make_shared<HostTensor>(HostTensor::vector(DType::kInt32, N));
    q->fill_normal(rng), k->fill_normal(rng), v->fill_normal(rng), g->fill_normal(rng), beta->fill_uniform(rng, 0.1, 0.9);
    pool->fill_normal(rng, 0.0, 0.3);
    const int slots[N] = {7, 0, -1, 3, 8, 5};
    for (int64_t i = 0; i < N; ++i) idx->set(0, i, slots[i]);
    jobs.push_back({"kda decode 6 sequences on a pool", [=](JobIo& io, std::vector<HostTensor>& ts) {
                      ts.push_back(*q), ts.push_back(*k), ts.push_back(*v), ts.push_back(*g), ts.push_back(*beta), ts.push_back(*pool);
                      ts.push_back(*idx), ts.emplace_back(DType::kBF16, N, HV * V);
                      auto as = [&](HostTensor& t, std::initializer_list<int64_t> shape) {
                        const TensorView p = io.place(t);
                        return TensorView::contiguous(p.data, p.dtype, shape, p.device);
                      };
                      KdaRecurrentArgs a;
                      a.q = as(ts[0], {N, 1, H, K}), a.k = as(ts[1], {N, 1, H, K}), a.v = as(ts[2], {N, 1, HV, V});
                      a.g = as(ts[3], {N, 1, HV, K}), a.beta = as(ts[4], {N, 1, HV}), a.initial_state = as(ts[5], {P, HV, K, V});
                      a.state_indices = as(ts[6], {N}), a.o = as(ts[7], {N, 1, HV, V});
                      KdaRecurrentOptions o;
                      o.use_qk_l2norm = true, o.use_gate_in_kernel = true, o.use_lower_bound = true, o.lower_bound = -2.0;
                      return run(a, o, nullptr, io.stream);
                    }});
  }
  return jobs;
}

}  // namespace encore::test
