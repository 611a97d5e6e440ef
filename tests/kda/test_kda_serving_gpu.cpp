// KDA serving on CUDA (encore/kda_serving.hpp; the decode kernels src/kda/cuda/kda_decode.cu) against the
// CPU reference (fp64) on the same inputs rounded to the device dtypes: every state mode (no indices with
// and without initial / final state and in place; [N] slots with padding; [N, S] per-token slots with
// num_accepted_tokens; varlen with an empty sequence), every gate and option (softplus with dt_bias,
// lower bound, precomputed; L2 norm; beta sigmoid and 2 sigmoid; scale), grouped value heads, K = V =
// 128 (the compile-time kernels), odd K 37 / V 50 and K 200 / V 256, bf16 / fp16 / fp32 inputs, fp32
// and bf16 pools, int32 and int64 indices. Outputs poisoned (NaN) before each run; o and the touched
// slots within 5e-3 relative RMS of the reference (NaN never passes), untouched slots bit-identical.
// Also: CUDA-graph capture and replay with new index values, and the device index contract (out of
// range: NaN rows, nothing written; host-memory indices refused). The prefill on the pool:
// test_kda_pool_prefill_gpu.cpp; the serving scenario on CUDA: test_kda_serving_scenario_gpu.cpp.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "encore/kda_serving.hpp"
#include "kda/testing.hpp"  // run on an explicit single-token kernel
#include "tests/common/device_buffer.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/kda/kda_serving_case.hpp"
#include "tests/kda/kda_serving_device.hpp"

namespace encore::test {
namespace {

struct Opts {
  const char* name;
  KdaRecurrentOptions o;
  bool A_log = true, dt_bias = true;
};
const Opts kKimi{"softplus+dt_bias l2", {0.0, true, true}};
const std::vector<Opts> kAllOpts = {
    kKimi,
    {"lower bound l2 beta-sigmoid", {0.0, true, true, true, -4.0, true}, true, false},
    {"lower bound no A_log", {0.0, true, true, true, -5.0}, false, true},
    {"precomputed 2sigmoid scale 0.3", {0.3, false, false, false, -5.0, true, true}, false, false},
    {"softplus no l2", {0.0, false, true}, true, false},
};

// One problem: B sequences of T tokens (or varlen cu), dims d, inputs in `in`, states in `sdt`.
struct Problem {
  ServingDims d;
  Opts opts = kKimi;
  std::mt19937_64 rng{7};
  Batch b;
  std::unique_ptr<GateParams> gp;
  Problem(ServingDims dims, const Opts& o, uint64_t seed, bool varlen, const std::vector<int64_t>& lens) : d(dims), opts(o), rng(seed), b{dims} {
    b.varlen = varlen;
    gp = std::make_unique<GateParams>(d, rng);
    for (int64_t len : lens) {
      std::vector<Token> seg;
      for (int64_t t = 0; t < len; ++t) seg.push_back(token());
      b.add(seg);
    }
  }
  Token token() {
    Token t = random_token(d, rng);
    const double ksd = opts.o.use_qk_l2norm ? 1.0 : 0.7 / std::sqrt(double(d.K));  // contractive without the norm
    for (double& x : t.k) x *= ksd;
    if (!opts.o.use_gate_in_kernel)
      for (double& x : t.g) x = -std::log1p(std::exp(x)) * 0.3;  // a log decay
    if (opts.o.use_beta_sigmoid)
      for (double& x : t.beta) x = 2.0 * x - 1.0;
    return t;
  }
  KdaRecurrentArgs host() {
    KdaRecurrentArgs a = b.recurrent(gp.get());
    if (!opts.A_log) a.A_log = TensorView{};
    if (!opts.dt_bias) a.dt_bias = TensorView{};
    if (!opts.o.use_gate_in_kernel) a.A_log = a.dt_bias = TensorView{};
    return a;
  }
};

double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double e : x) m = std::max(m, std::fabs(e));
  return m;
}

// Runs host (CPU reference) and device on the same rounded inputs and compares o, the written states
// (`written` pool slots, or final_state) and the untouched slots (bit-identical). plan: the device run's
// decode plan (null: the rule's).
void compare(const std::string& label, Problem& pr, DType in, KdaRecurrentArgs h, std::vector<unsigned char>* pool_bytes,
             const std::set<int64_t>& written, std::vector<double>* fin_host = nullptr, const cuda::KdaDecodePlan* plan = nullptr,
             std::optional<DType> odt = std::nullopt) {
  SCOPED_TRACE(label + " " + dtype_name(in));
  DeviceArena ar;
  const DType gdt = pr.opts.o.use_gate_in_kernel ? in : DType::kFP32;
  KdaRecurrentArgs d = to_device(h, in, gdt, ar, odt);  // rounds h's inputs
  const std::vector<unsigned char> before = pool_bytes ? *pool_bytes : std::vector<unsigned char>{};
  Status st = plan ? kda::run(d, pr.opts.o, *plan) : run(d, pr.opts.o);
  ASSERT_TRUE(st) << st.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  st = run(h, pr.opts.o);
  ASSERT_TRUE(st) << "cpu: " << st.to_string();
  const std::vector<double> o_dev = fetch(d.o), o_ref = pr.b.o;
  const double eo = rel_err(o_dev, o_ref);
  EXPECT_LE(eo, 5e-3) << "o";
  for (size_t i = 0; i < o_ref.size(); ++i)
    if (o_ref[i] == 0.0) {
      ASSERT_EQ(o_dev[i], 0.0) << "o[" << i << "] (a padding row)";
    }
  double es = 0;
  if (pool_bytes) {
    const TensorView& pd = d.initial_state;
    const std::vector<unsigned char> after = fetch_bytes(pd);
    const int64_t P = pd.shape[0];
    const size_t slot = after.size() / size_t(P);
    const std::vector<double> dev = fetch(pd);
    const int64_t se = int64_t(slot / dtype_size(pd.dtype));
    for (int64_t s = 0; s < P; ++s) {
      if (!written.count(s)) {
        EXPECT_EQ(std::memcmp(after.data() + s * slot, before.data() + s * slot, slot), 0) << "untouched slot " << s << " changed";
        continue;
      }
      const std::vector<double> a(dev.begin() + s * se, dev.begin() + (s + 1) * se);
      std::vector<double> r(static_cast<size_t>(se));
      for (int64_t i = 0; i < se; ++i) r[size_t(i)] = load_as_double(pool_bytes->data(), pd.dtype, s * se + i);
      es = std::max(es, rel_err(a, r));
    }
  } else if (fin_host) {
    es = rel_err(fetch(d.final_state), *fin_host);
  }
  EXPECT_LE(es, 5e-3) << "states";
  std::printf("  kda decode %-44s %-4s o %.2e  states %.2e  (|o| %.2f)\n", label.c_str(), dtype_name(in), eo, es, max_abs(o_ref));
}

// The device index contract: runs h (the pool in initial_state, its indices; its inputs rounded in place)
// on the device with bf16 inputs and checks o's rows of the sequences in `bad` NaN, of those in `pad` 0,
// of every other one finite, and the pool's slots in `written` changed, every other slot bit-identical.
void check_index_contract(KdaRecurrentArgs& h, int64_t N, const std::set<int64_t>& bad, const std::set<int64_t>& pad,
                          const std::set<int64_t>& written, const cuda::KdaDecodePlan* plan = nullptr) {
  DeviceArena ar;
  KdaRecurrentArgs d = to_device(h, DType::kBF16, DType::kBF16, ar);
  const std::vector<unsigned char> before = fetch_bytes(d.initial_state);
  ASSERT_TRUE(plan ? kda::run(d, kKimi.o, *plan) : run(d, kKimi.o));
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<double> o = fetch(d.o);
  const std::vector<unsigned char> after = fetch_bytes(d.initial_state);
  const int64_t P = d.initial_state.shape[0];
  const size_t slot = after.size() / size_t(P), rows = o.size() / size_t(N);
  for (int64_t n = 0; n < N; ++n)
    for (size_t i = 0; i < rows; ++i) {
      const double x = o[size_t(n) * rows + i];
      if (bad.count(n)) {
        ASSERT_TRUE(std::isnan(x)) << "sequence " << n;
      } else if (pad.count(n)) {
        ASSERT_EQ(x, 0.0) << "sequence " << n << " (padding)";
      } else {
        ASSERT_TRUE(std::isfinite(x)) << "sequence " << n;
      }
    }
  for (int64_t s = 0; s < P; ++s) {
    const bool same = std::memcmp(after.data() + s * slot, before.data() + s * slot, slot) == 0;
    EXPECT_EQ(same, !written.count(s)) << "slot " << s;
  }
}

class KdaServingGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

const ServingDims kDims128{2, 4, 128, 128}, kOdd{1, 2, 37, 50}, kWide{2, 4, 200, 256};

// [N] slots: a fixed batch with padding rows (NaN inputs), fp32 / bf16 pools, int32 / int64 indices.
void decode_on_pool(const ServingDims& dm, const Opts& op, DType in, DType pdt, DType it, int64_t T) {
  const std::vector<int64_t> slots = {5, -1, 2, 7, -1, 0};
  Problem pr(dm, op, 100 + uint64_t(dm.K) + uint64_t(T), false, std::vector<int64_t>(slots.size(), T));
  for (size_t n = 0; n < slots.size(); ++n)  // padding rows get NaN inputs: never read into the pool
    if (slots[n] < 0)
      for (int64_t t = 0; t < T; ++t) {
        const size_t r = n * size_t(T) + size_t(t);
        for (int64_t c = 0; c < dm.HV * dm.V; ++c) pr.b.v[r * size_t(dm.HV * dm.V) + size_t(c)] = NAN;
      }
  Pool pool(dm, 9, pdt, pr.rng);
  std::vector<int32_t> i32(slots.begin(), slots.end());
  std::vector<int64_t> i64 = slots;
  KdaRecurrentArgs h = pr.host();
  h.initial_state = pool.view();
  const int64_t N = int64_t(slots.size());
  h.state_indices = it == DType::kInt32 ? TensorView::contiguous(i32.data(), it, {N}) : TensorView::contiguous(i64.data(), it, {N});
  compare(std::string("[N] T") + std::to_string(T) + " " + op.name + " K" + std::to_string(dm.K) + " V" + std::to_string(dm.V) + " pool " +
              dtype_name(pdt) + " idx " + dtype_name(it),
          pr, in, h, &pool.bytes, {5, 2, 7, 0});
}

TEST_F(KdaServingGpu, DecodeOnThePool) {
  for (DType in : {DType::kBF16, DType::kFP32})
    for (DType pdt : {DType::kFP32, DType::kBF16}) {
      decode_on_pool(kDims128, kKimi, in, pdt, DType::kInt32, 1);
      decode_on_pool(kOdd, kKimi, in, pdt, DType::kInt64, 1);
      decode_on_pool(kDims128, kKimi, in, pdt, DType::kInt64, 3);
    }
  decode_on_pool(kDims128, kKimi, DType::kFP16, DType::kFP32, DType::kInt32, 1);
  decode_on_pool(kWide, kKimi, DType::kBF16, DType::kFP32, DType::kInt32, 2);
  for (const Opts& op : kAllOpts)
    for (const ServingDims& dm : {kDims128, kOdd}) decode_on_pool(dm, op, DType::kBF16, DType::kFP32, DType::kInt32, 2);
}

// Single-token launches on the rule's plan (kda_decode_plan) at N = 8, 72, 300 and at N = 8, 72 on each
// plan named: 32 columns without PDL, 64 with it, each width with the L2 prefetch one wave ahead, the
// whole-head kernel without and with PDL (at N =
// 72 with HV 4 the 32-column grid of 1152 blocks has blocks a wave ahead to prefetch): [N] slots with
// padding and [N, 2] slots with num_accepted_tokens (a padding row, an unwritten entry; the prefetch skips
// that mode), bf16 / fp32 inputs, fp32 / bf16 pools, against the reference.
TEST_F(KdaServingGpu, SingleTokenBatches) {
  using cuda::KdaDecodeKernel;
  const cuda::KdaDecodePlan kernels[] = {{KdaDecodeKernel::kColumns32, false, false},
                                         {KdaDecodeKernel::kColumns64, true, false},
                                         {KdaDecodeKernel::kColumns32, true, true},
                                         {KdaDecodeKernel::kColumns64, false, true},
                                         {KdaDecodeKernel::kHeads, false, false},
                                         {KdaDecodeKernel::kHeads, true, false}};
  constexpr int kPlans = int(sizeof(kernels) / sizeof(kernels[0]));
  for (int64_t N : {int64_t(8), int64_t(72), int64_t(300)})
    for (int ki = -1; ki < (N == 300 ? 0 : kPlans); ++ki)
    for (DType in : {DType::kBF16, DType::kFP32})
      for (DType pdt : {DType::kFP32, DType::kBF16}) {
        const cuda::KdaDecodePlan* kernel = ki < 0 ? nullptr : &kernels[ki];
        const std::string kname = ki < 0 ? " rule" : " kernel " + std::to_string(ki);
        const int64_t P = 2 * N + 5;
        {
          Problem pr(kDims128, kKimi, 300 + uint64_t(N), false, std::vector<int64_t>(size_t(N), 1));
          Pool pool(kDims128, P, pdt, pr.rng);
          std::vector<int32_t> idx(static_cast<size_t>(N));
          std::set<int64_t> written;
          for (int64_t n = 0; n < N; ++n) {
            idx[size_t(n)] = n % 7 == 3 ? -1 : int32_t((n * 37 + 11) % P);  // 37 coprime to P: distinct slots
            if (idx[size_t(n)] >= 0) written.insert(idx[size_t(n)]);
          }
          KdaRecurrentArgs h = pr.host();
          h.initial_state = pool.view();
          h.state_indices = TensorView::contiguous(idx.data(), DType::kInt32, {N});
          compare("[N] N" + std::to_string(N) + " T1 pool " + dtype_name(pdt) + kname, pr, in, h, &pool.bytes, written, nullptr, kernel);
        }
        {
          Problem pr(kDims128, kKimi, 400 + uint64_t(N), false, std::vector<int64_t>(size_t(N), 1));
          Pool pool(kDims128, P, pdt, pr.rng);
          std::vector<int64_t> idx(static_cast<size_t>(2 * N)), nat(static_cast<size_t>(N));
          std::set<int64_t> written;
          for (int64_t n = 0; n < N; ++n) {
            idx[size_t(2 * n)] = 2 * n, idx[size_t(2 * n + 1)] = 2 * n + 1;
            nat[size_t(n)] = 1 + n % 2;  // start column 0 or 1; the one token's state goes to column 0
            if (n == 5) idx[size_t(2 * n + nat[size_t(n)] - 1)] = -1;  // padding
            if (n == 7) idx[size_t(2 * n)] = -1;                       // its token's state not written
            if (idx[size_t(2 * n + nat[size_t(n)] - 1)] >= 0 && idx[size_t(2 * n)] >= 0) written.insert(idx[size_t(2 * n)]);
          }
          KdaRecurrentArgs h = pr.host();
          h.initial_state = pool.view();
          h.state_indices = TensorView::contiguous(idx.data(), DType::kInt64, {N, 2});
          h.num_accepted_tokens = TensorView::contiguous(nat.data(), DType::kInt64, {N});
          compare("[N, 2] N" + std::to_string(N) + " T1 pool " + dtype_name(pdt) + kname, pr, in, h, &pool.bytes, written, nullptr, kernel);
        }
      }
}

// o in a dtype of its own (the inputs bf16, o fp16 or fp32) on every single-token kernel: each stores o
// in o's dtype (the whole-head kernel once wrote bf16 bits into any 16-bit o).
TEST_F(KdaServingGpu, SingleTokenOutputDtypes) {
  using cuda::KdaDecodeKernel;
  for (const KdaDecodeKernel kernel : {KdaDecodeKernel::kColumns32, KdaDecodeKernel::kColumns64, KdaDecodeKernel::kHeads})
    for (DType odt : {DType::kFP16, DType::kFP32})
      for (DType pdt : {DType::kFP32, DType::kBF16}) {
        const int64_t N = 8, P = 2 * N + 5;
        Problem pr(kDims128, kKimi, 700 + uint64_t(odt) * 7 + uint64_t(pdt), false, std::vector<int64_t>(size_t(N), 1));
        Pool pool(kDims128, P, pdt, pr.rng);
        std::vector<int32_t> idx(static_cast<size_t>(N));
        std::set<int64_t> written;
        for (int64_t n = 0; n < N; ++n) {
          idx[size_t(n)] = n == 3 ? -1 : int32_t((n * 37 + 11) % P);
          if (idx[size_t(n)] >= 0) written.insert(idx[size_t(n)]);
        }
        KdaRecurrentArgs h = pr.host();
        h.initial_state = pool.view();
        h.state_indices = TensorView::contiguous(idx.data(), DType::kInt32, {N});
        const cuda::KdaDecodePlan plan{kernel, true, false};
        compare(std::string("o ") + dtype_name(odt) + " pool " + dtype_name(pdt) + " kernel " + std::to_string(int(kernel)), pr,
                DType::kBF16, h, &pool.bytes, written, nullptr, &plan, odt);
      }
}

// A flat softplus gate keeps its small decay: dt_bias -8 to -20 with e^A_log = 1000 (gate -ea softplus(x)
// from -0.34 to -2e-6) and beta 0 (the step is the decay alone), fp32 inputs and pool, single-token
// kernels (32, 64 columns, whole heads): the state's decrement S - S_new against the fp64 reference to 1e-3 relative,
// per dt_bias down to -13 (decrements from 0.29 to 2e-3 of the state) to 1e-2 (a log(1 + e^x) that rounds
// 1 + e^x loses percents there, and the whole decay below x ~ -16.6). Each single-token kernel.
TEST_F(KdaServingGpu, FlatGatesKeepTheirDecay) {
  for (int64_t N : {int64_t(2), int64_t(72)}) {
    Problem pr(kDims128, kKimi, 500 + uint64_t(N), false, std::vector<int64_t>(size_t(N), 1));
    for (double& a : pr.gp->A_log) a = std::log(1000.0);
    for (size_t i = 0; i < pr.gp->dt_bias.size(); ++i) pr.gp->dt_bias[i] = -8.0 - double(i % 13);
    for (double& x : pr.b.g) x = 0.01 * x;
    for (double& x : pr.b.beta) x = 0.0;
    Pool pool(kDims128, N, DType::kFP32, pr.rng);
    const std::vector<unsigned char> before = pool.bytes;
    std::vector<int32_t> idx(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) idx[size_t(n)] = int32_t(n);
    KdaRecurrentArgs h = pr.host();
    h.initial_state = pool.view();
    h.state_indices = TensorView::contiguous(idx.data(), DType::kInt32, {N});
    DeviceArena ar;
    const cuda::KdaDecodeKernel kinds[] = {cuda::KdaDecodeKernel::kColumns32, cuda::KdaDecodeKernel::kColumns64, cuda::KdaDecodeKernel::kHeads};
    std::vector<KdaRecurrentArgs> devs;
    for (size_t k = 0; k < 3; ++k) devs.push_back(to_device(h, DType::kFP32, DType::kFP32, ar));  // before the host run
    for (size_t k = 0; k < 3; ++k) ASSERT_TRUE(kda::run(devs[k], pr.opts.o, cuda::KdaDecodePlan{kinds[k], false, false}));
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    ASSERT_TRUE(run(h, pr.opts.o));
    for (size_t k = 0; k < 3; ++k) {
    const std::vector<double> dev = fetch(devs[k].initial_state);
    std::vector<double> num(13, 0.0), den(13, 0.0);  // per dt_bias value -8 - j
    const int64_t rows = kDims128.HV * kDims128.K;
    for (size_t i = 0; i < dev.size(); ++i) {
      const double s0 = load_as_double(before.data(), DType::kFP32, int64_t(i));
      const double ref = s0 - load_as_double(pool.bytes.data(), DType::kFP32, int64_t(i)), got = s0 - dev[i];
      const size_t j = size_t((int64_t(i) / kDims128.V) % rows) % 13;
      num[j] += (got - ref) * (got - ref), den[j] += ref * ref;
    }
    double all_num = 0, all_den = 0;
    for (size_t j = 0; j < 13; ++j) {
      all_num += num[j], all_den += den[j];
      // decrements >= ~2e-3 of the state (dt_bias >= -13): each within 1%; flatter ones are below the
      // fp32 resolution of exp2 near 1 (2^-22) and enter the whole-state bound only
      if (j <= 5) EXPECT_LE(std::sqrt(num[j] / den[j]), 1e-2) << "N " << N << " kernel " << k << " dt_bias " << -8.0 - double(j);
    }
    const double err = std::sqrt(all_num / all_den);
    EXPECT_LE(err, 1e-3) << "N " << N << " kernel " << k;
    std::printf("  kda decode flat gates N%-3lld kernel %zu decrement rel err %.2e (dt_bias -13: %.2e)\n", (long long)N, k, err,
                std::sqrt(num[5] / den[5]));
    }
  }
}

// [N, S] per-token slots with num_accepted_tokens: sequence 2 is padding (start entry -1), entry [1, 2] is
// -1 (that token's state not written).
TEST_F(KdaServingGpu, SpeculativeSlotsPerToken) {
  for (const ServingDims& dm : {kDims128, kOdd})
    for (DType pdt : {DType::kFP32, DType::kBF16})
      for (bool with_nat : {true, false}) {
        Problem pr(dm, kKimi, 31, false, {4, 4, 4});
        Pool pool(dm, 12, pdt, pr.rng);
        std::vector<int64_t> idx = {0, 1, 2, 3, 4, 5, -1, 6, -1, 8, 9, 10}, nat = {2, 1, 1};
        KdaRecurrentArgs h = pr.host();
        h.initial_state = pool.view();
        h.state_indices = TensorView::contiguous(idx.data(), DType::kInt64, {3, 4});
        if (with_nat) h.num_accepted_tokens = TensorView::contiguous(nat.data(), DType::kInt64, {3});
        compare(std::string("[N, S] ") + (with_nat ? "accepted 2/1/1" : "column 0") + " K" + std::to_string(dm.K) + " pool " + dtype_name(pdt), pr,
                DType::kBF16, h, &pool.bytes, {0, 1, 2, 3, 4, 5, 6});
      }
}

// No indices: initial / final state rows (fp32 or bf16, either absent), in place; varlen with an empty
// sequence (its final state = its initial state; zeros without one). K = V = 128 also with 300 sequences
// of one token (one empty): the single-token kernels of a large batch, rows without indices.
TEST_F(KdaServingGpu, StatesWithoutIndices) {
  std::vector<int64_t> one_token(300, 1);
  one_token[17] = 0;
  for (const ServingDims& dm : {kDims128, kOdd})
    for (const std::vector<int64_t>& lens : {std::vector<int64_t>{3, 0, 1, 5}, one_token})
      for (DType sdt : {DType::kFP32, DType::kBF16})
        for (int variant = 0; variant < 4; ++variant)  // 0: h0 -> fin, 1: in place, 2: no h0, 3: h0 without fin
        for (int pi = 0; pi < 2; ++pi) {  // the rule's plan; at N = 300 also 32 columns with the L2 prefetch (rows n)
          if (lens.size() > 4 && dm.K != 128) continue;
          if (pi == 1 && lens.size() <= 4) continue;
          const cuda::KdaDecodePlan columns{cuda::KdaDecodeKernel::kColumns32, true, true};
          const cuda::KdaDecodePlan* plan = pi == 1 ? &columns : nullptr;
          Problem pr(dm, kKimi, 53, true, lens);
          const int64_t N = int64_t(lens.size()), n = N * dm.HV * dm.K * dm.V;
          Pool h0(dm, N, sdt, pr.rng), fin(dm, N, sdt, pr.rng);
          KdaRecurrentArgs h = pr.host();
          if (variant != 2) h.initial_state = h0.view();
          if (variant == 1) h.final_state = h.initial_state;
          else if (variant != 3) h.final_state = fin.view();
          if (variant == 1) {
            std::set<int64_t> rows;
            for (int64_t r = 0; r < N; ++r) rows.insert(r);
            compare(std::string("in place N") + std::to_string(N) + " K" + std::to_string(dm.K) + " " + dtype_name(sdt) + (plan ? " columns" : ""),
                    pr, DType::kBF16, h, &h0.bytes, rows, nullptr, plan);
            continue;
          }
          KdaRecurrentArgs hc = h;  // the reference's final state in its own bytes
          std::vector<unsigned char> fin_bytes = fin.bytes;
          if (h.final_state.defined()) hc.final_state.data = fin_bytes.data();
          {
            DeviceArena ar;
            const DType in = DType::kBF16;
            KdaRecurrentArgs d = to_device(hc, in, in, ar);
            ASSERT_TRUE(plan ? kda::run(d, pr.opts.o, *plan) : run(d, pr.opts.o));
            ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
            ASSERT_TRUE(run(hc, pr.opts.o));
            const double eo = rel_err(fetch(d.o), pr.b.o);
            EXPECT_LE(eo, 5e-3) << "o";
            double es = 0;
            if (hc.final_state.defined()) {
              std::vector<double> r(static_cast<size_t>(n));
              for (int64_t i = 0; i < n; ++i) r[size_t(i)] = load_as_double(fin_bytes.data(), sdt, i);
              es = rel_err(fetch(d.final_state), r);
            }
            EXPECT_LE(es, 5e-3) << "final state";
            std::printf("  kda decode states variant %d N%-3lld K%-3lld %-4s %-7s o %.2e  final state %.2e\n", variant, (long long)N,
                        (long long)dm.K, dtype_name(sdt), plan ? "columns" : "rule", eo, es);
          }
        }
}

// Varlen prefill-like calls on the pool ([N] indices, any length: the recurrent step), with an empty
// sequence and a padding one.
TEST_F(KdaServingGpu, VarlenOnThePool) {
  for (DType pdt : {DType::kFP32, DType::kBF16}) {
    Problem pr(kDims128, kKimi, 77, true, {37, 0, 5, 1, 64});
    Pool pool(kDims128, 8, pdt, pr.rng);
    std::vector<int32_t> idx = {6, 3, -1, 1, 4};
    KdaRecurrentArgs h = pr.host();
    h.initial_state = pool.view();
    h.state_indices = TensorView::contiguous(idx.data(), DType::kInt32, {5});
    compare(std::string("varlen 37/0/5(pad)/1/64 pool ") + dtype_name(pdt), pr, DType::kBF16, h, &pool.bytes, {6, 1, 4});
  }
}

// The device index contract: an index >= P, a per-token index >= P or num_accepted_tokens outside [1, S]
// makes that sequence's o rows NaN and writes nothing; the other sequences are computed; host-memory
// indices on CUDA tensors are refused naming the argument.
TEST_F(KdaServingGpu, BadDeviceIndicesGiveNaNRowsAndWriteNothing) {
  const ServingDims dm = kDims128;
  struct Bad {
    const char* what;
    std::vector<int64_t> idx, nat;
    int64_t S;
    std::set<int64_t> bad_seqs, written;
  };
  const std::vector<Bad> cases = {
      {"[N] index >= P", {3, 9, -1, 5}, {}, 1, {1}, {3, 5}},
      {"[N, S] per-token index >= P", {0, 1, 2, 20, 4, 6}, {}, 2, {1}, {0, 1, 4, 6}},
      {"num_accepted_tokens 0 and 3 > S", {0, 1, 2, 3, 4, 6}, {0, 1, 3}, 2, {0, 2}, {2, 3}},
  };
  for (const Bad& c : cases) {
    SCOPED_TRACE(c.what);
    const int64_t N = c.S == 1 ? 4 : 3;
    Problem pr(dm, kKimi, 91, false, std::vector<int64_t>(size_t(N), c.S == 1 ? 1 : 2));
    Pool pool(dm, 8, DType::kFP32, pr.rng);
    std::vector<int64_t> idx = c.idx, nat = c.nat;
    KdaRecurrentArgs h = pr.host();
    h.initial_state = pool.view();
    h.state_indices = c.S == 1 ? TensorView::contiguous(idx.data(), DType::kInt64, {N}) : TensorView::contiguous(idx.data(), DType::kInt64, {N, c.S});
    if (!nat.empty()) h.num_accepted_tokens = TensorView::contiguous(nat.data(), DType::kInt64, {N});
    EXPECT_FALSE(run(h, kKimi.o)) << "the CPU backend refuses the same indices";
    check_index_contract(h, N, c.bad_seqs, {}, c.written);
  }
  // Host-memory indices with CUDA tensors: refused, nothing launched.
  Problem pr(dm, kKimi, 93, false, {1, 1});
  Pool pool(dm, 4, DType::kFP32, pr.rng);
  std::vector<int64_t> idx = {0, 1};
  KdaRecurrentArgs h = pr.host();
  h.initial_state = pool.view();
  h.state_indices = TensorView::contiguous(idx.data(), DType::kInt64, {2});
  DeviceArena ar;
  KdaRecurrentArgs d = to_device(h, DType::kBF16, DType::kBF16, ar);
  d.state_indices = h.state_indices;  // host memory
  const Status st = run(d, kKimi.o);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("state_indices: in host memory, but q is on cuda:0"), std::string::npos) << st.message();
}

// The device index contract in a large single-token batch (300 sequences, bf16 inputs, the rule's plan:
// on a 132-SM H100 the whole-head kernel for fp32 pools, 64 columns for bf16): an index >= P, a per-token index >= P ([N, 2]: idx[n, 0] with the
// start in column 1) or num_accepted_tokens 0 / 3 > S give NaN rows and write nothing; padding gives zero
// rows; every other sequence is computed and its slot written.
TEST_F(KdaServingGpu, BadIndicesInLargeBatches) {
  const ServingDims dm = kDims128;
  constexpr int64_t N = 300, P = N + 4;
  for (DType pdt : {DType::kBF16, DType::kFP32})
    for (int64_t S : {1, 2}) {
      SCOPED_TRACE(std::string(dtype_name(pdt)) + " S" + std::to_string(S));
      Problem pr(dm, kKimi, 95, false, std::vector<int64_t>(size_t(N), 1));
      Pool pool(dm, P, pdt, pr.rng);
      std::vector<int64_t> idx(size_t(N * S)), nat;
      std::set<int64_t> bad, pad = {20};
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < S; ++c) idx[size_t(n * S + c)] = n;
      idx[size_t(20 * S)] = -1;
      if (S == 1) {
        idx[10] = P + 3, bad = {10};
      } else {
        nat.assign(size_t(N), 1);
        for (int64_t n = 0; n < N; ++n) nat[size_t(n)] = 1 + n % 2;
        nat[20] = 1;                                  // padding: its start idx[20, 0] is -1
        nat[30] = 0, nat[31] = 3, nat[41] = 2;        // outside [1, 2]; 41 starts from column 1 = 41
        idx[size_t(41 * 2)] = P;                      // its token's slot >= P
        bad = {30, 31, 41};
      }
      KdaRecurrentArgs h = pr.host();
      h.initial_state = pool.view();
      h.state_indices = S == 1 ? TensorView::contiguous(idx.data(), DType::kInt64, {N}) : TensorView::contiguous(idx.data(), DType::kInt64, {N, S});
      if (!nat.empty()) h.num_accepted_tokens = TensorView::contiguous(nat.data(), DType::kInt64, {N});
      std::set<int64_t> written;  // slot s belongs to sequence s
      for (int64_t s = 0; s < N; ++s)
        if (!bad.count(s) && !pad.count(s)) written.insert(s);
      check_index_contract(h, N, bad, pad, written);
      // the same on the column kernels with the L2 prefetch (which skips padding and out-of-range slots)
      for (const cuda::KdaDecodeKernel k : {cuda::KdaDecodeKernel::kColumns32, cuda::KdaDecodeKernel::kColumns64}) {
        const cuda::KdaDecodePlan plan{k, true, true};
        check_index_contract(h, N, bad, pad, written, &plan);
      }
    }
}

// Capture one decode call in a CUDA graph; replay it after writing new inputs, indices and accepted
// counts into the captured buffers: each replay equals the CPU reference on those values.
TEST_F(KdaServingGpu, CudaGraphCaptureAndReplay) {
  const ServingDims dm = kDims128;
  for (DType pdt : {DType::kFP32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(pdt));
    Problem pr(dm, kKimi, 111, false, {2, 2, 2, 2});
    Pool pool(dm, 16, pdt, pr.rng);
    std::vector<int32_t> idx = {0, 1, 2, 3, 4, 5, -1, 7}, nat = {1, 2, 1, 1};
    KdaRecurrentArgs h = pr.host();
    h.initial_state = pool.view();
    h.state_indices = TensorView::contiguous(idx.data(), DType::kInt32, {4, 2});
    h.num_accepted_tokens = TensorView::contiguous(nat.data(), DType::kInt32, {4});
    DeviceArena ar;
    KdaRecurrentArgs d = to_device(h, DType::kBF16, DType::kBF16, ar);
    cudaStream_t s;
    ENCORE_ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    ASSERT_TRUE(run(d, kKimi.o, nullptr, s));  // an eager call first, as an engine warms up (the pool changes: each replay
    ENCORE_ASSERT_CUDA(cudaStreamSynchronize(s));  // below starts from the device's pool)
    cudaGraph_t graph;
    ENCORE_ASSERT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    const Status st = run(d, kKimi.o, nullptr, s);
    ENCORE_ASSERT_CUDA(cudaStreamEndCapture(s, &graph));
    ASSERT_TRUE(st) << st.to_string();
    cudaGraphExec_t exec;
    ENCORE_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) {
      // New values in the captured buffers: tokens, indices (a permutation of free slots), accepted counts.
      for (size_t i = 0; i < pr.b.q.size(); ++i) pr.b.q[i] = std::normal_distribution<double>()(pr.rng);
      for (size_t i = 0; i < pr.b.v.size(); ++i) pr.b.v[i] = std::normal_distribution<double>()(pr.rng);
      std::vector<int32_t> perm(16);
      for (int i = 0; i < 16; ++i) perm[size_t(i)] = i;
      std::shuffle(perm.begin(), perm.end(), pr.rng);
      for (size_t i = 0; i < idx.size(); ++i) idx[i] = perm[i];
      idx[size_t(2 * replay)] = -1;
      nat = {1 + replay % 2, 1, 2, 1};
      std::vector<unsigned char> qb(pr.b.q.size() * 2), vb(pr.b.v.size() * 2);
      for (size_t i = 0; i < pr.b.q.size(); ++i) store_from_double(qb.data(), DType::kBF16, int64_t(i), pr.b.q[i]), pr.b.q[i] = load_as_double(qb.data(), DType::kBF16, int64_t(i));
      for (size_t i = 0; i < pr.b.v.size(); ++i) store_from_double(vb.data(), DType::kBF16, int64_t(i), pr.b.v[i]), pr.b.v[i] = load_as_double(vb.data(), DType::kBF16, int64_t(i));
      ENCORE_ASSERT_CUDA(cudaMemcpy(d.q.data, qb.data(), qb.size(), cudaMemcpyHostToDevice));
      ENCORE_ASSERT_CUDA(cudaMemcpy(d.v.data, vb.data(), vb.size(), cudaMemcpyHostToDevice));
      ENCORE_ASSERT_CUDA(cudaMemcpy(d.state_indices.data, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
      ENCORE_ASSERT_CUDA(cudaMemcpy(d.num_accepted_tokens.data, nat.data(), nat.size() * 4, cudaMemcpyHostToDevice));
      const std::vector<unsigned char> before = fetch_bytes(d.initial_state);
      pool.bytes = before;  // the reference starts from the device pool
      ENCORE_ASSERT_CUDA(cudaGraphLaunch(exec, s));
      ENCORE_ASSERT_CUDA(cudaStreamSynchronize(s));
      pr.b.o.assign(pr.b.o.size(), NAN);
      ASSERT_TRUE(run(h, kKimi.o));
      EXPECT_LE(rel_err(fetch(d.o), pr.b.o), 5e-3) << "replay " << replay;
      const std::vector<unsigned char> after = fetch_bytes(d.initial_state);
      const std::vector<double> dev = fetch(d.initial_state);
      const size_t slot = after.size() / 16, se = slot / dtype_size(pdt);
      std::set<int64_t> written;
      for (int n = 0; n < 4; ++n)
        if (idx[size_t(2 * n + nat[size_t(n)] - 1)] >= 0)
          for (int t = 0; t < 2; ++t)
            if (idx[size_t(2 * n + t)] >= 0) written.insert(idx[size_t(2 * n + t)]);
      for (int64_t sl = 0; sl < 16; ++sl) {
        if (!written.count(sl)) {
          EXPECT_EQ(std::memcmp(after.data() + sl * slot, before.data() + sl * slot, slot), 0) << "slot " << sl;
          continue;
        }
        const std::vector<double> a(dev.begin() + sl * int64_t(se), dev.begin() + (sl + 1) * int64_t(se));
        std::vector<double> r(se);
        for (size_t i = 0; i < se; ++i) r[i] = load_as_double(pool.bytes.data(), pdt, sl * int64_t(se) + int64_t(i));
        EXPECT_LE(rel_err(a, r), 5e-3) << "slot " << sl << " replay " << replay;
      }
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}

}  // namespace
}  // namespace encore::test
