// fla's state_v_first on CUDA (the GPU side of test_kda_state_v_first_cpu.cpp): states [.., HV, V, K] through
// the CUDA kernels, which index the transposed layout at their state loads and stores only. Each run with
// state_v_first is compared on the same rounded inputs against the same kernels in the default layout (o,
// gradients and residuals bit-identical, states exact transposes) and against the CPU reference (fp64,
// default layout; relative RMS 5e-3, 1e-2 for the gradients): the chunked forward with initial and final
// state (K = V = 128 and K 48 / V 40 on tensor cores, K 160 / V 64 on the token-recurrent path; bf16 and
// fp32); the backward's dh0 given d_final_state through every CUDA backward (fp32 saved-h: the first
// backward; bf16 saved-h: the second; bf16 with h rematerialized; K 160: the token-recurrent one); the
// recurrent decode on a pool ([N] slots with padding, [N, S] slots with num_accepted_tokens; fp32 and bf16
// pools; K = V = 128, where the default layout may take the compile-time kernels and state_v_first the
// general one, so 5e-3 there, and K 37 / V 50) and the prefill on a pool. Outputs poisoned (NaN) first;
// untouched pool slots bit-identical; states in the [K, V] layout refused naming the argument.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "encore/kda.hpp"
#include "encore/kda_serving.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/kda/kda_case.hpp"
#include "tests/kda/kda_device_vec.hpp"
#include "tests/kda/kda_serving_case.hpp"
#include "tests/kda/kda_serving_device.hpp"

namespace encore::test {
namespace {

// transpose_states (kda_case.hpp) for a pool's bytes in `dt` (each element's bytes moved, no rounding).
std::vector<unsigned char> transpose_state_bytes(const std::vector<unsigned char>& s, DType dt, int64_t rows, int64_t HV, int64_t K,
                                                 int64_t V) {
  const size_t e = dtype_size(dt);
  std::vector<unsigned char> t(s.size());
  for (int64_t r = 0; r < rows * HV; ++r)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t v = 0; v < V; ++v) std::memcpy(&t[size_t((r * V + v) * K + k) * e], &s[size_t((r * K + k) * V + v) * e], e);
  return t;
}

// Bit-identical, NaN matching NaN (a residual's unused entries, if any stay poisoned, on both sides).
bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
  return true;
}

void expect_refused(const Status& st, const std::string& what) {
  EXPECT_FALSE(st);
  EXPECT_NE(st.message().find(what), std::string::npos) << st.message();
}

class KdaStateVFirstGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
};

struct Case {
  KdaCase c;
  const char* label;
};

// Varlen with an empty sequence and grouped value heads at K = V = 128; fixed length at K 48 / V 40; the
// token-recurrent path at K 160 / V 64 (varlen). Initial state, L2 norm, in-kernel gates.
std::vector<Case> cases() {
  std::vector<Case> cs = {
      {KdaCase{1, 300, 2, 128, 128, {0, 0, 130, 300}, Gate::kSoftplusBias, true, true}, "varlen 0/130/170 K128 V128 HV4"},
      {KdaCase{2, 150, 2, 48, 40, {}, Gate::kSoftplus, true, true}, "fixed B2 T150 K48 V40"},
      {KdaCase{1, 100, 2, 160, 64, {0, 37, 100}, Gate::kLowerBound, true, true}, "varlen 37/63 K160 V64 (token-recurrent)"},
  };
  cs[0].c.HV = 4;
  return cs;
}

DType residual_dtype(DType dt) { return dt == DType::kFP32 ? DType::kFP32 : DType::kBF16; }

// The forward: o, the residuals and the final state (transposed) against the default layout's on the same
// kernels, and against the CPU recurrence; a [K, V] initial state refused with state_v_first.
void forward_case(Case cs, DType dt) {
  KdaCase& c = cs.c;
  SCOPED_TRACE(std::string(cs.label) + " " + dtype_name(dt));
  c.fill(uint64_t(c.T * 3 + c.K));
  const int64_t N = c.N(), H = c.Hv(), K = c.K, V = c.V;
  KdaDeviceForward kv(c, dt, residual_dtype(dt), /*remat=*/false);  // rounds c's inputs in place
  ASSERT_TRUE(kv.counted);
  {
    const Status st = kv.run(c);
    ASSERT_TRUE(st) << "default layout: " << st.to_string();
  }
  KdaDeviceForward vk(c, dt, residual_dtype(dt), false);
  std::vector<double> init_t = transpose_states(c.init, N, H, K, V);
  auto h0t = dev(init_t, DType::kFP32, {N, H, V, K});
  auto fint = poisoned(c.fin.size(), DType::kFP32, {N, H, V, K});
  vk.a.initial_state = h0t->view, vk.a.final_state = fint->view;
  KdaCase cv = c;
  cv.opts.state_v_first = true;
  {
    const Status st = vk.run(cv);
    ASSERT_TRUE(st) << "state_v_first: " << st.to_string();
  }
  const std::vector<double> o = vk.o->fetch(), fin_t = fint->fetch(), fin = transpose_states(fin_t, N, H, V, K);
  EXPECT_EQ(o, kv.o->fetch()) << "o differs from the default layout's";
  EXPECT_EQ(fin, kv.fin->fetch()) << "final_state is not the default layout's transposed";
  EXPECT_TRUE(same_bits(vk.rG->fetch(), kv.rG->fetch())) << "G";
  EXPECT_TRUE(same_bits(vk.rAqk->fetch(), kv.rAqk->fetch())) << "Aqk";
  EXPECT_TRUE(same_bits(vk.rAkk->fetch(), kv.rAkk->fetch())) << "Akk";
  EXPECT_TRUE(same_bits(vk.rh->fetch(), kv.rh->fetch())) << "h (stays [NT, HV, K, V])";
  ASSERT_TRUE(run(c.args(), c.opts));  // the CPU recurrence, default layout
  const double eo = rel_err(o, c.o), es = rel_err(fin, c.fin);
  EXPECT_LE(eo, 5e-3) << "o against the CPU reference";
  EXPECT_LE(es, 5e-3) << "final_state against the CPU reference";
  std::printf("  kda state_v_first fwd %-40s %-4s o %.2e  final state %.2e\n", cs.label, dtype_name(dt), eo, es);
  if (K != V) {
    KdaForwardArgs bad = vk.a;
    bad.initial_state = kv.a.initial_state;  // [N, HV, K, V]
    expect_refused(validate(bad, cv.opts), "initial_state: expected shape [N, HV, V, K] (state_v_first)");
    bad = vk.a;
    bad.final_state = kv.a.final_state;
    expect_refused(validate(bad, cv.opts), "final_state");
  }
}

TEST_F(KdaStateVFirstGpu, ForwardTransposesStates) {
  for (const Case& cs : cases())
    for (DType dt : {DType::kBF16, DType::kFP32}) forward_case(cs, dt);
}

// The backward from the default layout's forward residuals (h dropped: rematerialized), with initial_state,
// d_final_state and dh0 transposed: every gradient equal to the default layout's, dh0 its transpose, and
// within 1e-2 of the fp64 token-level backward.
void backward_case(Case cs, DType dt, bool remat) {
  KdaCase& c = cs.c;
  const std::string path = c.K > 128 || c.V > 128 ? "token-recurrent"
                           : remat                 ? "rematerialize"
                           : dt == DType::kFP32    ? "first (saved h)"
                                                   : "second (saved h)";
  SCOPED_TRACE(std::string(cs.label) + " " + dtype_name(dt) + " " + path);
  c.fill(uint64_t(c.T * 7 + c.V));
  const int64_t B = c.B, T = c.T, N = c.N(), H = c.Hv(), Hq = c.H, K = c.K, V = c.V;
  KdaDeviceForward f(c, dt, residual_dtype(dt), remat);
  ASSERT_TRUE(f.counted);
  {
    const Status st = f.run(c);
    ASSERT_TRUE(st) << "forward: " << st.to_string();
  }
  auto [d_o, d_fin] = cotangents(c, uint64_t(T * 5 + K));
  std::vector<double> d_fin_t = transpose_states(d_fin, N, H, K, V), init_t = transpose_states(c.init, N, H, K, V);
  auto ddo = dev(d_o, dt, {B, T, H, V});
  auto ddfin = dev(d_fin, DType::kFP32, {N, H, K, V}), ddfin_t = dev(d_fin_t, DType::kFP32, {N, H, V, K});
  auto h0t = dev(init_t, DType::kFP32, {N, H, V, K});

  // The 8 gradients (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias) of one layout, from poisoned outputs.
  auto grads = [&](bool vf, std::vector<std::vector<double>>& out) {
    KdaBackwardArgs b;
    b.fwd = f.a;
    b.fwd.final_state = TensorView{};
    if (vf) b.fwd.initial_state = h0t->view;
    b.d_o = ddo->view;
    b.d_final_state = vf ? ddfin_t->view : ddfin->view;
    const size_t nQ = size_t(B * T * Hq * K), nG = size_t(B * T * H * K);
    auto dq = poisoned(nQ, dt, {B, T, Hq, K}), dk = poisoned(nQ, dt, {B, T, Hq, K}), dv = poisoned(c.v.size(), dt, {B, T, H, V}),
         dg = poisoned(nG, dt, {B, T, H, K}), dbeta = poisoned(c.beta.size(), dt, {B, T, H});
    auto dh0 = vf ? poisoned(c.init.size(), DType::kFP32, {N, H, V, K}) : poisoned(c.init.size(), DType::kFP32, {N, H, K, V});
    auto dA = poisoned(size_t(H), DType::kFP32, {H}), ddt = poisoned(size_t(H * K), DType::kFP32, {H * K});
    b.dq = dq->view, b.dk = dk->view, b.dv = dv->view, b.dg = dg->view, b.dbeta = dbeta->view, b.dh0 = dh0->view;
    if (!c.A_log.empty()) b.dA_log = dA->view;
    if (!c.dt_bias.empty()) b.ddt_bias = ddt->view;
    KdaOptions o = c.opts;
    o.state_v_first = vf;
    o.output_final_state = false;
    DeviceBuffer ws(std::max<size_t>(workspace_bytes(b, o), 16));
    ENCORE_ASSERT_CUDA(cudaMemset(ws.ptr, 0xff, ws.bytes));  // NaN: a read of an unwritten record shows
    const Status st = run(b, o, ws.ptr);
    ASSERT_TRUE(st) << (vf ? "state_v_first: " : "default layout: ") << st.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    const DevVec* g[8] = {dq.get(), dk.get(), dv.get(), dg.get(), dbeta.get(), dh0.get(), dA.get(), ddt.get()};
    out.assign(8, {});
    for (int i = 0; i < 8; ++i)
      if ((i != 6 || !c.A_log.empty()) && (i != 7 || !c.dt_bias.empty())) out[size_t(i)] = g[i]->fetch();
    if (vf && K != V) {  // a [K, V] d_final_state is refused
      b.d_final_state = ddfin->view;
      expect_refused(validate(b, o), "d_final_state");
    }
  };
  std::vector<std::vector<double>> kv, vk;
  grads(false, kv);
  grads(true, vk);
  ASSERT_EQ(kv.size(), size_t(8));
  ASSERT_EQ(vk.size(), size_t(8));
  const char* names[8] = {"dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"};
  for (int i = 0; i < 8; ++i) {
    if (i != 5) {
      EXPECT_EQ(vk[size_t(i)], kv[size_t(i)]) << names[i] << " differs from the default layout's";
    }
  }
  const std::vector<double> dh0 = transpose_states(vk[5], N, H, V, K);
  EXPECT_EQ(dh0, kv[5]) << "dh0 is not the default layout's transposed";
  // The fp64 token-level backward on the rounded inputs (default layout): dh0 and dv.
  KdaBackwardArgs r;
  r.fwd = c.args();
  r.fwd.o = r.fwd.final_state = TensorView{};
  std::vector<double> dq(c.q.size()), dk(c.k.size()), dv(c.v.size()), dg(c.g.size()), db(c.beta.size()), dh(c.init.size());
  r.d_o = TensorView::contiguous(d_o.data(), DType::kFP64, {B, T, H, V});
  r.d_final_state = TensorView::contiguous(d_fin.data(), DType::kFP64, {N, H, K, V});
  r.dq = TensorView::contiguous(dq.data(), DType::kFP64, {B, T, Hq, K});
  r.dk = TensorView::contiguous(dk.data(), DType::kFP64, {B, T, Hq, K});
  r.dv = TensorView::contiguous(dv.data(), DType::kFP64, {B, T, H, V});
  r.dg = TensorView::contiguous(dg.data(), DType::kFP64, {B, T, H, K});
  r.dbeta = TensorView::contiguous(db.data(), DType::kFP64, {B, T, H});
  r.dh0 = TensorView::contiguous(dh.data(), DType::kFP64, {N, H, K, V});
  KdaOptions ro = c.opts;
  ro.output_final_state = false;
  {
    const Status st = run(r, ro);
    ASSERT_TRUE(st) << "cpu backward: " << st.to_string();
  }
  const double eh = rel_err(dh0, dh), ev = rel_err(vk[2], dv);
  EXPECT_LE(eh, 1e-2) << "dh0 against the fp64 backward";
  EXPECT_LE(ev, 1e-2) << "dv against the fp64 backward";
  std::printf("  kda state_v_first bwd %-40s %-4s %-16s dh0 %.2e  dv %.2e\n", cs.label, dtype_name(dt), path.c_str(), eh, ev);
}

TEST_F(KdaStateVFirstGpu, BackwardTransposesStateGradients) {
  for (const Case& cs : cases()) {
    backward_case(cs, DType::kFP32, false);
    backward_case(cs, DType::kBF16, false);
    if (cs.c.K <= 128 && cs.c.V <= 128) backward_case(cs, DType::kBF16, true);
  }
}

// --- serving: the decode on a pool and the prefill on a pool ------------------------------------------------

const ServingDims kDims128{2, 4, 128, 128}, kOdd{1, 2, 37, 50};
const KdaRecurrentOptions kKimi{0.0, true, true};  // softplus gate with dt_bias, L2 norm

// Sequences of `lens` tokens (varlen, or fixed length) with the serving tests' inputs.
struct Tokens {
  std::mt19937_64 rng;
  Batch b;
  GateParams gp;
  Tokens(const ServingDims& d, uint64_t seed, bool varlen, const std::vector<int64_t>& lens) : rng(seed), b{d}, gp(d, rng) {
    b.varlen = varlen;
    for (int64_t len : lens) {
      std::vector<Token> seg;
      for (int64_t t = 0; t < len; ++t) seg.push_back(random_token(d, rng));
      b.add(seg);
    }
  }
};

// The pool of a state_v_first run on the device (dev_vk, [P, HV, V, K]) against the reference pool (host,
// [P, HV, K, V]) and the default layout's device pool (dev_kv): untouched slots keep their bytes, written
// ones within 5e-3 of the reference and, where `exact`, the default layout's transposed.
void check_pool(const TensorView& dev_vk, const std::vector<unsigned char>& before_vk, const Pool& ref, const TensorView& dev_kv,
                const std::set<int64_t>& written, bool exact) {
  const ServingDims& d = ref.d;
  const int64_t P = ref.P, se = ref.slot_elems();
  const std::vector<unsigned char> after = fetch_bytes(dev_vk);
  const std::vector<double> got = transpose_states(fetch(dev_vk), P, d.HV, d.V, d.K), kv = fetch(dev_kv);
  const size_t sb = ref.slot_bytes();
  double es = 0;
  for (int64_t s = 0; s < P; ++s) {
    if (!written.count(s)) {
      EXPECT_EQ(std::memcmp(after.data() + s * sb, before_vk.data() + s * sb, sb), 0) << "untouched slot " << s << " changed";
      continue;
    }
    const std::vector<double> a(got.begin() + s * se, got.begin() + (s + 1) * se), k(kv.begin() + s * se, kv.begin() + (s + 1) * se);
    es = std::max(es, rel_err(a, ref.slot(s)));
    if (exact) {
      EXPECT_EQ(a, k) << "slot " << s << " is not the default layout's transposed";
    } else {
      EXPECT_LE(rel_err(a, k), 5e-3) << "slot " << s << " against the default layout's";
    }
  }
  EXPECT_LE(es, 5e-3) << "written slots against the CPU reference";
}

// o of a state_v_first run against the reference and the default layout's.
void check_o(const TensorView& o_vk, const TensorView& o_kv, const std::vector<double>& ref, bool exact) {
  const std::vector<double> o = fetch(o_vk), k = fetch(o_kv);
  EXPECT_LE(rel_err(o, ref), 5e-3) << "o against the CPU reference";
  if (exact) {
    EXPECT_EQ(o, k) << "o differs from the default layout's";
  } else {
    EXPECT_LE(rel_err(o, k), 5e-3) << "o against the default layout's";
  }
}

// The device call in both layouts (d with o, dv with ov = o and state_v_first), synchronized, then the CPU
// reference on the host pool (h with o).
template <class Args, class Opts, class Launch>
void run_layouts(Launch&& launch, const Args& d, const Opts& o, const Args& dv, const Opts& ov, const Args& h) {
  const Status st = launch(d, o);
  ASSERT_TRUE(st) << "default layout: " << st.to_string();
  const Status sv = launch(dv, ov);
  ASSERT_TRUE(sv) << "state_v_first: " << sv.to_string();
  ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
  const Status sc = run(h, o);
  ASSERT_TRUE(sc) << "cpu: " << sc.to_string();
}

// The recurrent step on a pool: [N] slots with padding (S = 0) or [N, S] token slots with num_accepted_tokens.
void decode_case(const ServingDims& dm, DType pdt, int64_t S) {
  const bool token_slots = S > 0;
  SCOPED_TRACE(std::string("decode K") + std::to_string(dm.K) + " V" + std::to_string(dm.V) + " pool " + dtype_name(pdt) +
               (token_slots ? " [N, S] slots" : " [N] slots"));
  const std::vector<int64_t> slots = {5, -1, 2, 7, -1, 0};
  std::vector<int64_t> tidx = {0, 1, 2, 3, 4, 5, -1, 6, -1, 8, 9, 10}, nat = {2, 1, 1};
  const int64_t N = token_slots ? 3 : int64_t(slots.size()), P = token_slots ? 12 : 9;
  Tokens tk(dm, uint64_t(dm.K * 11 + S), false, std::vector<int64_t>(size_t(N), token_slots ? S : 2));
  Pool pool(dm, P, pdt, tk.rng);
  std::vector<int64_t> idx = slots;
  KdaRecurrentArgs h = tk.b.recurrent(&tk.gp);
  h.initial_state = pool.view();
  h.state_indices = token_slots ? TensorView::contiguous(tidx.data(), DType::kInt64, {N, S}) : TensorView::contiguous(idx.data(), DType::kInt64, {N});
  if (token_slots) h.num_accepted_tokens = TensorView::contiguous(nat.data(), DType::kInt64, {N});
  const std::set<int64_t> written = token_slots ? std::set<int64_t>{0, 1, 2, 3, 4, 5, 6} : std::set<int64_t>{5, 2, 7, 0};
  std::vector<unsigned char> pool_t = transpose_state_bytes(pool.bytes, pdt, P, dm.HV, dm.K, dm.V);
  const TensorView pool_t_view = TensorView::contiguous(pool_t.data(), pdt, {P, dm.HV, dm.V, dm.K});

  DeviceArena ar;
  const DType in = DType::kBF16;
  KdaRecurrentArgs d = to_device(h, in, in, ar);  // the default layout (h's inputs rounded to bf16 in place)
  KdaRecurrentArgs dv = d;  // state_v_first: the transposed pool
  dv.initial_state = ar.mirror(pool_t_view, pdt);
  dv.o = ar.mirror(h.o, in, true);
  KdaRecurrentOptions ov = kKimi;
  ov.state_v_first = true;
  ASSERT_NO_FATAL_FAILURE(run_layouts([](const KdaRecurrentArgs& a, const KdaRecurrentOptions& op) { return run(a, op); }, d, kKimi, dv, ov, h));
  const bool exact = !(dm.K == 128 && dm.V == 128);  // the same (general) kernel on both layouts
  check_o(dv.o, d.o, tk.b.o, exact);
  check_pool(dv.initial_state, pool_t, pool, d.initial_state, written, exact);
  if (dm.K != dm.V) {  // the [K, V] pool refused with state_v_first
    KdaRecurrentArgs bad = dv;
    bad.initial_state = d.initial_state;
    expect_refused(validate(bad, ov), "initial_state: expected [P, HV, V, K] (state_v_first)");
  }
}

// The chunked prefill on a pool: varlen with an empty sequence and a padding one.
void prefill_case(const ServingDims& dm, DType pdt) {
  SCOPED_TRACE(std::string("prefill K") + std::to_string(dm.K) + " V" + std::to_string(dm.V) + " pool " + dtype_name(pdt));
  std::vector<int64_t> slots = {3, 1, -1, 0};
  const int64_t N = int64_t(slots.size()), P = 5;
  Tokens tk(dm, uint64_t(dm.V * 13), true, {37, 0, 70, 5});
  Pool pool(dm, P, pdt, tk.rng);
  KdaPoolForwardArgs h;
  h.fwd = tk.b.forward(&tk.gp);
  h.pool = pool.view();
  h.state_indices = TensorView::contiguous(slots.data(), DType::kInt64, {N});
  std::vector<unsigned char> pool_t = transpose_state_bytes(pool.bytes, pdt, P, dm.HV, dm.K, dm.V);
  const TensorView pool_t_view = TensorView::contiguous(pool_t.data(), pdt, {P, dm.HV, dm.V, dm.K});

  DeviceArena ar;
  const DType in = DType::kBF16;
  KdaPoolForwardArgs d = to_device(h, in, in, ar);
  KdaPoolForwardArgs dv = d;
  dv.pool = ar.mirror(pool_t_view, pdt);
  dv.fwd.o = ar.mirror(h.fwd.o, in, true);
  KdaOptions o;
  o.use_qk_l2norm = true, o.use_gate_in_kernel = true;
  KdaOptions ov = o;
  ov.state_v_first = true;
  auto launch = [&](const KdaPoolForwardArgs& a, const KdaOptions& op) {
    void* ws = ar.bytes(workspace_bytes(a, op));
    return run(a, op, ws);
  };
  ASSERT_NO_FATAL_FAILURE(run_layouts(launch, d, o, dv, ov, h));
  check_o(dv.fwd.o, d.fwd.o, tk.b.o, true);
  check_pool(dv.pool, pool_t, pool, d.pool, {3, 0}, true);
  if (dm.K != dm.V) {
    KdaPoolForwardArgs bad = dv;
    bad.pool = d.pool;
    expect_refused(validate(bad, ov), "pool: expected [P, HV, V, K] (state_v_first)");
  }
}

TEST_F(KdaStateVFirstGpu, ServingTransposesStates) {
  for (const ServingDims& dm : {kDims128, kOdd})
    for (DType pdt : {DType::kFP32, DType::kBF16}) {
      decode_case(dm, pdt, 0);
      decode_case(dm, pdt, 4);
      prefill_case(dm, pdt);
    }
}

}  // namespace
}  // namespace encore::test
