// `encore check` rows for the moe family: CPU properties (the CUDA kernels of routing, dispatch and
// combine are compared with the CPU backend by the MoeGpu tests): routing weights sum to 1, dispatch counts sum to
// T * k with aligned offsets and a bijective slot map, combine of identity experts returns the token,
// and moe_forward reruns bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "check.hpp"
#include "encore/moe.hpp"
#include "testing/host_tensor.hpp"

namespace encore::app {
namespace {

using test::HostTensor;
constexpr int64_t kT = 37, kD = 48, kF = 32;
constexpr int kE = 16, kK = 4, kAlign = 8;

TensorView mat(void* p, DType t, int64_t r, int64_t c) { return TensorView::contiguous(p, t, {r, c}); }

CheckRow row(const char* op, const char* note) {
  return {op, std::to_string(kT) + "x" + std::to_string(kE) + " k" + std::to_string(kK), "fp32", "cpu", 0, false, note};
}

struct Routed {
  HostTensor logits{DType::kFP32, kT, kE};
  std::vector<int32_t> ids = std::vector<int32_t>(kT * kK);
  std::vector<float> w = std::vector<float>(kT * kK);
};

Status route(Routed& r, std::mt19937_64& rng) {
  r.logits.fill_normal(rng, 0, 2);
  MoeRoutingOptions o;
  o.top_k = kK;
  return run(MoeRoutingArgs{r.logits.view(), {}, mat(r.ids.data(), DType::kInt32, kT, kK), mat(r.w.data(), DType::kFP32, kT, kK)}, o);
}

struct Dispatched {
  int64_t R = moe_permuted_rows(kT, kK, kE, kAlign);
  std::vector<int32_t> counts = std::vector<int32_t>(kE), offsets = std::vector<int32_t>(kE + 1), slots = std::vector<int32_t>(kT * kK),
                       row_slots = std::vector<int32_t>(size_t(R)), ws = std::vector<int32_t>(256);
  HostTensor xp{DType::kFP32, R, kD};
};

Status dispatch(Routed& r, HostTensor& x, Dispatched& d) {
  MoeDispatchArgs a{mat(r.ids.data(), DType::kInt32, kT, kK), x.view(), TensorView::contiguous(d.counts.data(), DType::kInt32, {kE}),
                    TensorView::contiguous(d.offsets.data(), DType::kInt32, {kE + 1}), mat(d.slots.data(), DType::kInt32, kT, kK),
                    TensorView::contiguous(d.row_slots.data(), DType::kInt32, {d.R}), d.xp.view()};
  MoeDispatchOptions o{kE, kAlign};
  if (workspace_bytes(a, o) > d.ws.size() * 4) return Status::internal("check_moe: dispatch workspace too small");
  return run(a, o, d.ws.data());
}

}  // namespace

std::vector<CheckRow> check_moe(bool gpu, std::mt19937_64& rng) {
  const char* note = gpu ? "CPU properties (CUDA: MoeGpu tests)" : "";
  std::vector<CheckRow> rows;
  Routed r;
  Status st = route(r, rng);
  CheckRow routing = row("moe_routing", note);
  if (st) {
    for (int64_t t = 0; t < kT; ++t) {
      double sum = 0;
      for (int j = 0; j < kK; ++j) sum += r.w[size_t(t * kK + j)];
      routing.error = std::max(routing.error, std::fabs(sum - 1.0));
      for (int j = 1; j < kK; ++j)  // descending logits (softmax is monotone), distinct experts
        if (r.logits.get(t, r.ids[size_t(t * kK + j)]) > r.logits.get(t, r.ids[size_t(t * kK + j - 1)]) ||
            r.ids[size_t(t * kK + j)] == r.ids[size_t(t * kK + j - 1)])
          routing.error = 1;
    }
    routing.pass = routing.error < 1e-6;
  }
  if (!st) routing.note = st.to_string();
  rows.push_back(routing);

  HostTensor x(DType::kFP32, kT, kD);
  x.fill_normal(rng);
  Dispatched d;
  CheckRow disp = row("moe_dispatch", note);
  if (st) st = dispatch(r, x, d);
  if (st) {
    int64_t bad = 0, total = 0;
    std::vector<int> seen(size_t(d.R), 0);
    for (int e = 0; e < kE; ++e) total += d.counts[size_t(e)], bad += d.offsets[size_t(e)] % kAlign != 0;
    bad += total != kT * kK;
    for (int64_t i = 0; i < kT * kK; ++i) {
      const int32_t s = d.slots[size_t(i)];
      bad += s < 0 || s >= d.R || seen[size_t(s)]++ > 0 || d.row_slots[size_t(s)] != i ||
             std::memcmp(&d.xp.bytes[size_t(s * kD * 4)], &x.bytes[size_t(i / kK * kD * 4)], kD * 4) != 0;
    }
    disp.error = double(bad);
    disp.pass = bad == 0;
    disp.note = gpu ? note : "counts sum to T*k, aligned offsets, bijective slots";
  }
  if (!st) disp.note = st.to_string();
  rows.push_back(disp);

  // Identity experts (expert_out = x_permuted): combine returns sum_j w[t, j] * x[t] = x[t].
  CheckRow comb = row("moe_combine", gpu ? note : "identity experts return the token");
  HostTensor out(DType::kFP32, kT, kD);
  if (st) st = run(MoeCombineArgs{d.xp.view(), mat(d.slots.data(), DType::kInt32, kT, kK), mat(r.w.data(), DType::kFP32, kT, kK), out.view()},
                   MoeCombineOptions{});
  if (st) {
    for (int64_t t = 0; t < kT; ++t)
      for (int64_t c = 0; c < kD; ++c) comb.error = std::max(comb.error, std::fabs(out.get(t, c) - x.get(t, c)) / std::max(1.0, std::fabs(x.get(t, c))));
    comb.pass = comb.error < 1e-6;
  }
  if (!st) comb.note = st.to_string();
  rows.push_back(comb);

  CheckRow fwd = row("moe_forward", gpu ? note : "finite, rerun bit-exact");
  MoeOptions o;
  o.routing.top_k = kK;
  o.align_m = kAlign;
  const MoeLayerShape shape{kT, kD, kF, kE, DType::kFP32};
  std::vector<unsigned char> storage(moe_buffers_bytes(shape, o) + 256);
  void* base = storage.data() + (256 - reinterpret_cast<uintptr_t>(storage.data()) % 256) % 256;
  MoeBuffers b;
  HostTensor w13(DType::kFP32, kE * 2 * kF, kD), w2(DType::kFP32, kE * kD, kF), o1(DType::kFP32, kT, kD), o2(DType::kFP32, kT, kD);
  w13.fill_normal(rng, 0, 1 / std::sqrt(double(kD)));
  w2.fill_normal(rng, 0, 1 / std::sqrt(double(kF)));
  if (st) st = moe_buffers_carve(shape, o, base, storage.size() - 256, Device{}, &b);
  auto args = [&](HostTensor& y) {
    return MoeForwardArgs{x.view(), r.logits.view(), {}, TensorView::contiguous(w13.bytes.data(), DType::kFP32, {kE, 2 * kF, kD}),
                          TensorView::contiguous(w2.bytes.data(), DType::kFP32, {kE, kD, kF}), b, y.view()};
  };
  if (st) st = run(args(o1), o);
  if (st) st = run(args(o2), o);
  if (st) {
    bool finite = true;
    for (int64_t t = 0; t < kT; ++t)
      for (int64_t c = 0; c < kD; ++c) finite = finite && std::isfinite(o1.get(t, c));
    fwd.error = o1.bytes == o2.bytes ? 0.0 : 1.0;
    fwd.pass = finite && fwd.error == 0;
  }
  if (!st) fwd.note = st.to_string();
  rows.push_back(fwd);
  return rows;
}

}  // namespace encore::app
