// KDA chunked prefill on a state pool on CUDA (encore/kda_serving.hpp's KdaPoolForwardArgs: the CUDA
// forward whose state kernel reads sequence n's initial state from pool slot state_indices[n] and writes
// its final state back there; K or V > 128: the decode kernel) against the CPU reference (fp64) on the
// same inputs rounded to the device dtypes: varlen with empty sequences and padding sequences (NaN
// inputs, index -1), fixed length, more than 64 sequences (the full launch table), grouped value heads,
// K = V = 128, odd K 37 / V 50, K 200 / V 256, bf16 and fp32 inputs, fp32 and bf16 pools, int32 and int64
// indices, a pool view with a slot stride above HV * K * V (the gaps must keep their bits), the gate
// options. Outputs poisoned (NaN) before each run; o and the written slots within 5e-3 relative RMS of
// the reference (NaN never passes), padding rows exactly 0, untouched slots bit-identical. Also the
// device index contract (an index >= P: NaN rows, nothing written), host-memory indices refused, the
// workspace by query, and a CUDA-graph capture replayed with new inputs and indices.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "encore/kda_serving.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/kda/kda_serving_case.hpp"
#include "tests/kda/kda_serving_device.hpp"

namespace encore::test {
namespace {

struct Opts {
  const char* name;
  KdaOptions o;
  bool A_log = true, dt_bias = true;
};
const Opts kKimi{"softplus+dt_bias l2", {0.0, false, true, true}};
const std::vector<Opts> kOtherOpts = {
    {"lower bound l2", {0.0, false, true, true, true, -4.0}, true, false},
    {"precomputed scale 0.3", {0.3, false, false, false}, false, false},
    {"softplus no l2", {0.0, false, false, true}, true, false},
};

const ServingDims kDims128{2, 4, 128, 128}, kOdd{1, 2, 37, 50}, kWide{2, 4, 200, 256};

// One prefill call: sequences of `lens` tokens (varlen, or fixed length when !varlen) on slots `slots`
// (-1: padding, NaN inputs) of a pool of P slots with garbage states, the host call ready for the reference.
struct Prefill {
  ServingDims d;
  Opts opts;
  std::mt19937_64 rng;
  Batch b;
  GateParams gp;
  Pool pool;
  std::vector<int64_t> slots;
  std::vector<int32_t> i32;
  KdaPoolForwardArgs h;
  Prefill(const ServingDims& dims, const Opts& o, uint64_t seed, bool varlen, const std::vector<int64_t>& lens, const std::vector<int64_t>& s,
          int64_t P, DType pdt, DType it)
      : d(dims), opts(o), rng(seed), b{dims}, gp(dims, rng), pool(dims, P, pdt, rng), slots(s), i32(s.begin(), s.end()) {
    b.varlen = varlen;
    for (size_t n = 0; n < lens.size(); ++n) {
      std::vector<Token> seg;
      for (int64_t t = 0; t < lens[n]; ++t) seg.push_back(token(slots[n] < 0));
      b.add(seg);
    }
    h.fwd = b.forward(&gp);
    if (!opts.A_log || !opts.o.use_gate_in_kernel) h.fwd.A_log = TensorView{};
    if (!opts.dt_bias || !opts.o.use_gate_in_kernel) h.fwd.dt_bias = TensorView{};
    h.pool = pool.view();
    const int64_t N = int64_t(slots.size());
    h.state_indices = it == DType::kInt32 ? TensorView::contiguous(i32.data(), it, {N}) : TensorView::contiguous(slots.data(), it, {N});
  }
  Token token(bool nan) {
    Token t = random_token(d, rng, nan);
    if (nan) return t;
    const double ksd = opts.o.use_qk_l2norm ? 1.0 : 0.7 / std::sqrt(double(d.K));  // contractive without the norm
    for (double& x : t.k) x *= ksd;
    if (!opts.o.use_gate_in_kernel)
      for (double& x : t.g) x = -std::log1p(std::exp(x)) * 0.3;  // a log decay
    return t;
  }
  std::set<int64_t> written() const {
    std::set<int64_t> w;
    for (size_t n = 0; n < slots.size(); ++n)
      if (slots[n] >= 0 && b.cu[n + 1] > b.cu[n]) w.insert(slots[n]);
    return w;
  }
};

// The pool's slots against the reference's (host bytes after the CPU run): untouched ones bit-identical.
double compare_pool(const TensorView& dev, const std::vector<unsigned char>& before, const Pool& ref, const std::set<int64_t>& written) {
  const std::vector<unsigned char> after = fetch_bytes(dev);
  const std::vector<double> vals = fetch(dev);
  const int64_t P = dev.shape[0], se = ref.slot_elems();
  const size_t sb = ref.slot_bytes();
  double es = 0;
  for (int64_t s = 0; s < P; ++s) {
    if (!written.count(s)) {
      EXPECT_EQ(std::memcmp(after.data() + s * sb, before.data() + s * sb, sb), 0) << "untouched slot " << s << " changed";
      continue;
    }
    const std::vector<double> a(vals.begin() + s * se, vals.begin() + (s + 1) * se);
    es = std::max(es, rel_err(a, ref.slot(s)));
  }
  return es;
}

// Runs the device and the reference on the same rounded inputs; o, the written slots, the others.
void check(const std::string& label, Prefill& pr, DType in) {
  SCOPED_TRACE(label + " in " + dtype_name(in));
  DeviceArena ar;
  const DType gdt = pr.opts.o.use_gate_in_kernel ? in : DType::kFP32;
  KdaPoolForwardArgs d = to_device(pr.h, in, gdt, ar);  // rounds h's inputs
  const size_t ws = workspace_bytes(d, pr.opts.o);
  if (pr.d.K <= 128 && pr.d.V <= 128 && pr.b.rows > 0) EXPECT_GT(ws, 0u) << "the chunked forward's records";
  if (pr.d.K > 128 || pr.d.V > 128) EXPECT_EQ(ws, 0u) << "the decode kernel needs none";
  const std::vector<unsigned char> before = fetch_bytes(d.pool);
  Status st = run(d, pr.opts.o, ar.bytes(ws));
  ASSERT_TRUE(st) << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  st = run(pr.h, pr.opts.o);
  ASSERT_TRUE(st) << "cpu: " << st.to_string();
  const std::vector<double> o_dev = fetch(d.fwd.o), &o_ref = pr.b.o;
  const double eo = rel_err(o_dev, o_ref);
  EXPECT_LE(eo, 5e-3) << "o";
  const int64_t row = pr.d.HV * pr.d.V;
  for (size_t n = 0; n < pr.slots.size(); ++n)
    for (int64_t i = pr.b.cu[n] * row; i < pr.b.cu[n + 1] * row; ++i) {
      if (pr.slots[n] < 0) {
        ASSERT_EQ(o_dev[size_t(i)], 0.0) << "padding sequence " << n << " o element " << i;
      } else {
        ASSERT_TRUE(std::isfinite(o_dev[size_t(i)])) << "sequence " << n << " o element " << i;
      }
    }
  const double es = compare_pool(d.pool, before, pr.pool, pr.written());
  EXPECT_LE(es, 5e-3) << "states";
  std::printf("  kda pool prefill %-52s %-4s o %.2e  states %.2e\n", label.c_str(), dtype_name(in), eo, es);
}

std::string dims_name(const ServingDims& d) { return "K" + std::to_string(d.K) + " V" + std::to_string(d.V); }

class KdaPoolPrefillGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

// Varlen: 130, 0 (on slot 3: untouched), 37 (padding), 64, 1, 200 tokens.
TEST_F(KdaPoolPrefillGpu, VarlenWithEmptyAndPaddingSequences) {
  const std::vector<int64_t> lens = {130, 0, 37, 64, 1, 200}, slots = {6, 3, -1, 1, 4, 0};
  for (const ServingDims& dm : {kDims128, kOdd})
    for (DType in : {DType::kBF16, DType::kFP32})
      for (DType pdt : {DType::kFP32, DType::kBF16})
        for (DType it : {DType::kInt32, DType::kInt64}) {
          Prefill pr(dm, kKimi, 11 + uint64_t(dm.K), true, lens, slots, 8, pdt, it);
          check("varlen " + dims_name(dm) + " pool " + dtype_name(pdt) + " idx " + dtype_name(it), pr, in);
        }
}

TEST_F(KdaPoolPrefillGpu, FixedLengthAndGateOptions) {
  for (const ServingDims& dm : {kDims128, kOdd})
    for (DType pdt : {DType::kFP32, DType::kBF16}) {
      Prefill pr(dm, kKimi, 21, false, {70, 70, 70}, {2, -1, 5}, 6, pdt, DType::kInt64);
      check("B3 T70 " + dims_name(dm) + " pool " + dtype_name(pdt), pr, DType::kBF16);
    }
  for (const Opts& op : kOtherOpts)
    for (const ServingDims& dm : {kDims128, kOdd}) {
      Prefill pr(dm, op, 23, true, {65, 3, 128}, {1, 0, -1}, 4, DType::kFP32, DType::kInt32);
      check(std::string(op.name) + " " + dims_name(dm), pr, DType::kBF16);
    }
}

// 70 sequences (above the 64-entry launch table): short prompts of 1 to 100 tokens, every 7th padding.
TEST_F(KdaPoolPrefillGpu, ManySequences) {
  std::vector<int64_t> lens, slots;
  std::mt19937_64 rng(5);
  std::vector<int64_t> perm(80);
  for (int i = 0; i < 80; ++i) perm[size_t(i)] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int n = 0; n < 70; ++n) {
    lens.push_back(1 + int64_t(rng() % 100));
    slots.push_back(n % 7 == 3 ? -1 : perm[size_t(n)]);
  }
  for (DType pdt : {DType::kFP32, DType::kBF16}) {
    Prefill pr(kDims128, kKimi, 31, true, lens, slots, 80, pdt, DType::kInt32);
    check(std::string("70 sequences pool ") + dtype_name(pdt), pr, DType::kBF16);
  }
}

// K 200 / V 256: the decode kernel over every token of each sequence (the same pool contract).
TEST_F(KdaPoolPrefillGpu, LargeHeadDimsOnTheDecodeKernel) {
  for (DType pdt : {DType::kFP32, DType::kBF16}) {
    Prefill pr(kWide, kKimi, 41, true, {70, 0, 5, 9}, {1, 2, -1, 0}, 3, pdt, DType::kInt64);
    check("wide varlen pool " + std::string(dtype_name(pdt)), pr, DType::kBF16);
  }
}

// A pool view with slot stride HV K V + 96 elements (a view into a larger cache): the gaps keep their bits.
TEST_F(KdaPoolPrefillGpu, StridedPoolView) {
  const ServingDims dm = kDims128;
  for (DType pdt : {DType::kFP32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(pdt));
    Prefill pr(dm, kKimi, 51, true, {100, 7, 64}, {3, -1, 0}, 4, pdt, DType::kInt32);
    const int64_t P = 4, se = pr.pool.slot_elems(), stride = se + 96, es = int64_t(dtype_size(pdt));
    std::vector<unsigned char> big(size_t(P * stride * es));
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<unsigned char>(pr.rng());
    for (int64_t s = 0; s < P; ++s) std::memcpy(big.data() + s * stride * es, pr.pool.bytes.data() + s * se * es, size_t(se * es));
    DeviceArena ar;
    KdaPoolForwardArgs d = to_device(pr.h, DType::kBF16, DType::kBF16, ar);
    DeviceBuffer dbig(big.size());
    ENCORE_ASSERT_CUDA(cudaMemcpy(dbig.ptr, big.data(), big.size(), cudaMemcpyHostToDevice));
    d.pool = TensorView::strided(dbig.ptr, pdt, {P, dm.HV, dm.K, dm.V}, {stride, dm.K * dm.V, dm.V, 1}, kCuda);
    ASSERT_TRUE(run(d, pr.opts.o, ar.bytes(workspace_bytes(d, pr.opts.o))));
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    ASSERT_TRUE(run(pr.h, pr.opts.o));
    std::vector<unsigned char> after(big.size());
    ENCORE_ASSERT_CUDA(cudaMemcpy(after.data(), dbig.ptr, after.size(), cudaMemcpyDeviceToHost));
    EXPECT_LE(rel_err(fetch(d.fwd.o), pr.b.o), 5e-3) << "o";
    for (int64_t s = 0; s < P; ++s) {
      const unsigned char* a = after.data() + s * stride * es;
      EXPECT_EQ(std::memcmp(a + se * es, big.data() + s * stride * es + se * es, size_t(96 * es)), 0) << "gap after slot " << s;
      if (s != 3 && s != 0) {
        EXPECT_EQ(std::memcmp(a, big.data() + s * stride * es, size_t(se * es)), 0) << "untouched slot " << s;
        continue;
      }
      std::vector<double> x(static_cast<size_t>(se));
      for (int64_t i = 0; i < se; ++i) x[size_t(i)] = load_as_double(a, pdt, i);
      EXPECT_LE(rel_err(x, pr.pool.slot(s)), 5e-3) << "slot " << s;
    }
  }
}

// An index >= P: that sequence's o rows NaN, nothing of the pool written; the others computed. Host-memory
// indices with CUDA tensors: refused naming the argument.
TEST_F(KdaPoolPrefillGpu, BadDeviceIndicesGiveNaNRowsAndWriteNothing) {
  for (const ServingDims& dm : {kDims128, kWide}) {
    SCOPED_TRACE(dims_name(dm));
    Prefill pr(dm, kKimi, 61, true, {70, 9, 3, 20}, {1, 0, -1, 3}, 4, DType::kFP32, DType::kInt64);
    pr.slots[1] = 9;  // out of [0, 4): refused by the CPU backend, NaN on the device
    pr.h.state_indices.data = pr.slots.data();
    EXPECT_FALSE(run(pr.h, pr.opts.o)) << "the CPU backend refuses the same indices";
    DeviceArena ar;
    KdaPoolForwardArgs d = to_device(pr.h, DType::kBF16, DType::kBF16, ar);
    const std::vector<unsigned char> before = fetch_bytes(d.pool);
    ASSERT_TRUE(run(d, pr.opts.o, ar.bytes(workspace_bytes(d, pr.opts.o))));
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<double> o = fetch(d.fwd.o);
    const std::vector<unsigned char> after = fetch_bytes(d.pool);
    const int64_t row = dm.HV * dm.V;
    for (size_t n = 0; n < 4; ++n)
      for (int64_t i = pr.b.cu[n] * row; i < pr.b.cu[n + 1] * row; ++i) {
        const double x = o[size_t(i)];
        if (n == 1) ASSERT_TRUE(std::isnan(x)) << "sequence 1 (index 9)";
        else if (n == 2) ASSERT_EQ(x, 0.0) << "sequence 2 (padding)";
        else ASSERT_TRUE(std::isfinite(x)) << "sequence " << n;
      }
    const size_t sb = pr.pool.slot_bytes();
    for (int64_t s = 0; s < 4; ++s) {
      const bool same = std::memcmp(after.data() + s * sb, before.data() + s * sb, sb) == 0;
      EXPECT_EQ(same, s != 1 && s != 3) << "slot " << s;
    }
    // Host-memory indices (in range: the host values are checked first, so an index out of range is refused for that).
    pr.slots[1] = 0;
    d.state_indices = pr.h.state_indices;
    const Status st = run(d, pr.opts.o, ar.bytes(workspace_bytes(d, pr.opts.o)));
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("state_indices: in host memory, but q is on cuda:0"), std::string::npos) << st.message();
  }
  // An fp64 pool on CUDA: refused by name.
  Prefill pr(kDims128, kKimi, 63, true, {5}, {0}, 2, DType::kFP64, DType::kInt64);
  DeviceArena ar;
  KdaPoolForwardArgs d = to_device(pr.h, DType::kBF16, DType::kBF16, ar);
  const Status st = run(d, pr.opts.o, ar.bytes(workspace_bytes(d, pr.opts.o)));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("pool: dtype must be one of {bf16, fp32}"), std::string::npos) << st.message();
}

// Capture one prefill call in a CUDA graph (sequence lengths fixed by the capture); replay it after
// writing new inputs and indices into the captured buffers: each replay equals the CPU reference.
TEST_F(KdaPoolPrefillGpu, CudaGraphCaptureAndReplay) {
  const ServingDims dm = kDims128;
  for (DType pdt : {DType::kFP32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(pdt));
    Prefill pr(dm, kKimi, 71, true, {40, 90, 1}, {0, 1, 2}, 8, pdt, DType::kInt32);
    DeviceArena ar;
    KdaPoolForwardArgs d = to_device(pr.h, DType::kBF16, DType::kBF16, ar);
    void* ws = ar.bytes(workspace_bytes(d, pr.opts.o));
    cudaStream_t s;
    ENCORE_ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    ASSERT_TRUE(run(d, pr.opts.o, ws, s));  // an eager call first (as an engine warms up)
    ENCORE_ASSERT_CUDA(cudaStreamSynchronize(s));
    cudaGraph_t graph;
    ENCORE_ASSERT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    const Status st = run(d, pr.opts.o, ws, s);
    ENCORE_ASSERT_CUDA(cudaStreamEndCapture(s, &graph));
    ASSERT_TRUE(st) << st.to_string();
    cudaGraphExec_t exec;
    ENCORE_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) {
      std::vector<int32_t> perm(8);
      for (int i = 0; i < 8; ++i) perm[size_t(i)] = i;
      std::shuffle(perm.begin(), perm.end(), pr.rng);
      for (size_t n = 0; n < 3; ++n) pr.i32[n] = perm[n];
      pr.i32[size_t(replay)] = -1;
      for (size_t n = 0; n < 3; ++n) pr.slots[n] = pr.i32[n];
      std::vector<unsigned char> qb(pr.b.q.size() * 2), vb(pr.b.v.size() * 2);
      for (size_t i = 0; i < pr.b.q.size(); ++i) {
        store_from_double(qb.data(), DType::kBF16, int64_t(i), std::normal_distribution<double>()(pr.rng));
        pr.b.q[i] = load_as_double(qb.data(), DType::kBF16, int64_t(i));
      }
      for (size_t i = 0; i < pr.b.v.size(); ++i) {
        store_from_double(vb.data(), DType::kBF16, int64_t(i), std::normal_distribution<double>()(pr.rng));
        pr.b.v[i] = load_as_double(vb.data(), DType::kBF16, int64_t(i));
      }
      ENCORE_ASSERT_CUDA(cudaMemcpy(d.fwd.q.data, qb.data(), qb.size(), cudaMemcpyHostToDevice));
      ENCORE_ASSERT_CUDA(cudaMemcpy(d.fwd.v.data, vb.data(), vb.size(), cudaMemcpyHostToDevice));
      ENCORE_ASSERT_CUDA(cudaMemcpy(d.state_indices.data, pr.i32.data(), 3 * 4, cudaMemcpyHostToDevice));
      const std::vector<unsigned char> before = fetch_bytes(d.pool);
      pr.pool.bytes = before;  // the reference starts from the device pool
      ENCORE_ASSERT_CUDA(cudaGraphLaunch(exec, s));
      ENCORE_ASSERT_CUDA(cudaStreamSynchronize(s));
      pr.b.o.assign(pr.b.o.size(), NAN);
      ASSERT_TRUE(run(pr.h, pr.opts.o));
      EXPECT_LE(rel_err(fetch(d.fwd.o), pr.b.o), 5e-3) << "replay " << replay;
      EXPECT_LE(compare_pool(d.pool, before, pr.pool, pr.written()), 5e-3) << "replay " << replay;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}

}  // namespace
}  // namespace encore::test
