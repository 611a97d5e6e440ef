// KDA serving on CUDA tensors: the serving scenario of kda_serving_scenario.hpp (the driver of
// test_kda_serving_scenario_cpu.cpp) with the pool, the inputs and the outputs in device memory (bf16
// inputs and o, int32 / int64 device indices): one KDA layer (K = V = 128, HV = 2H, softplus gate with
// dt_bias, L2 norm) serving requests: chunked prefills of 1 to 130 tokens on the pool (the CUDA forward
// reading and writing the slots in place, a padding sequence with NaN inputs in each), 64 decode steps of
// a fixed batch of 6 with continuous batching (the decode kernel; padding rows, requests joining and
// leaving, slots reused) and two speculative steps of 4 tokens accepting 1-3. After every call every
// untouched slot keeps its bits; at the end every request's outputs and state are compared with the CPU
// forward (fp64) over its whole sequence, fp32 and bf16 pools.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "encore/kda.hpp"
#include "encore/kda_serving.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/kda/kda_serving_case.hpp"
#include "tests/kda/kda_serving_device.hpp"
#include "tests/kda/kda_serving_scenario.hpp"

namespace encore::test {
namespace {

const DType kIn = DType::kBF16;  // q, k, v, g, beta and o on the device

// The CUDA backend: the pool on the device (the host pool its image), every call's inputs mirrored to the
// device (kIn; A_log, dt_bias fp32; the indices in their dtype), o fetched back.
class GpuServing {
 public:
  static ServingDims dims() { return {2, 4, 128, 128}; }
  static constexpr bool kStopOnFatalFailure = true, kCheckFinite = true;
  static constexpr const char* kLabel = ", CUDA";
  static void check_errors(DType, double o_err, double s_err) {
    EXPECT_LE(o_err, 5e-3);
    EXPECT_LE(s_err, 5e-3);
  }
  explicit GpuServing(const Pool& pool) : dpool_(pool.bytes.size()) {
    cudaMemcpy(dpool_.ptr, pool.bytes.data(), pool.bytes.size(), cudaMemcpyHostToDevice);
  }
  // A token in the device's input dtype (the reference then sees the device's values).
  Token input(Token t) {
    unsigned char b[2];
    for (auto* x : {&t.q, &t.k, &t.v, &t.g, &t.beta})
      for (double& e : *x) store_from_double(b, kIn, 0, e), e = load_as_double(b, kIn, 0);
    return t;
  }
  // A new request starts from the zero state (the engine zeroes its slot).
  bool zero(Pool& pool, int64_t s) {
    bool ok = false;
    [&] {
      ENCORE_ASSERT_CUDA(cudaMemset(dpool_.at(size_t(s) * pool.slot_bytes()), 0, pool.slot_bytes()));
      ok = true;
    }();
    if (ok) pool.zero(s);
    return ok;
  }
  std::vector<unsigned char> pool_bytes(const Pool& pool) { return fetch_bytes(pool_view(pool)); }
  bool refresh(Pool& pool) {
    bool ok = false;
    [&] {
      ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
      ok = true;
    }();
    if (ok) pool.bytes = fetch_bytes(pool_view(pool));
    return ok;
  }
  void call(Batch& b, const KdaPoolForwardArgs& h, const KdaOptions& opts, const CheckedCall& checked) {
    DeviceArena ar;
    KdaPoolForwardArgs a;
    a.fwd = device_inputs(h.fwd, ar);
    a.pool = device_pool(h.pool);
    a.state_indices = ar.mirror(h.state_indices, h.state_indices.dtype);
    void* ws = ar.bytes(workspace_bytes(a, opts));
    checked([&] { return run(a, opts, ws); });
    b.o = fetch(a.fwd.o);
  }
  void call(Batch& b, const KdaRecurrentArgs& h, const KdaRecurrentOptions& opts, const CheckedCall& checked) {
    DeviceArena ar;
    KdaRecurrentArgs a = device_inputs(h, ar);
    a.initial_state = device_pool(h.initial_state);
    a.state_indices = ar.mirror(h.state_indices, h.state_indices.dtype);
    a.num_accepted_tokens = ar.mirror(h.num_accepted_tokens, h.num_accepted_tokens.dtype);
    checked([&] { return run(a, opts); });
    b.o = fetch(a.o);
  }

 private:
  DeviceBuffer dpool_;  // the pool [P, HV, K, V] on the device

  TensorView pool_view(const Pool& pool) { return TensorView::contiguous(dpool_.ptr, pool.dtype, {pool.P, pool.d.HV, pool.d.K, pool.d.V}, kCuda); }
  // The device pool in place of a host call's pool view.
  TensorView device_pool(const TensorView& host_pool) {
    TensorView d = host_pool;
    d.data = dpool_.ptr, d.device = kCuda;
    return d;
  }
  // The device inputs of a host call (o poisoned) in `ar`; cu_seqlens stays on the host.
  template <class Args>
  static Args device_inputs(const Args& h, DeviceArena& ar) {
    Args d;
    d.q = ar.mirror(h.q, kIn), d.k = ar.mirror(h.k, kIn), d.v = ar.mirror(h.v, kIn), d.g = ar.mirror(h.g, kIn), d.beta = ar.mirror(h.beta, kIn);
    d.A_log = ar.mirror(h.A_log, DType::kFP32), d.dt_bias = ar.mirror(h.dt_bias, DType::kFP32);
    d.cu_seqlens = h.cu_seqlens;
    d.o = ar.mirror(h.o, kIn, /*poison=*/true);
    return d;
  }
};

class KdaServingScenarioGpu : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(KdaServingScenarioGpu, EqualsTheForwardOverEachWholeSequence) { serve_and_compare<GpuServing>(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Pools, KdaServingScenarioGpu, ::testing::Values(DType::kFP32, DType::kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace encore::test
