// moe_forward on CUDA (routing -> dispatch -> grouped gate/up GEMM -> SwiGLU -> grouped down GEMM ->
// combine) against the CPU backend on the same bf16 inputs, every device buffer and the output
// poisoned (NaN / 0xff) before each run:
//   - routing ids, counts, offsets, slot_rows, row_slots and x_permuted bit-equal to the CPU's;
//   - the grouped GEMMs alone, from the device's own inputs: gate_up (fp32) against an fp64
//     x_permuted . w13[e]^T, activation against bf16(silu(g) * u) of the device's gate_up, expert_out
//     against an fp64 act . w2[e]^T of the device's activation; padding rows of act and y exactly zero;
//   - out within bf16 rounding of the CPU layer (which accumulates in fp64);
//   - a rerun bit-identical.
// Each case runs on both SwiGLU paths (ENCORE_MOE_FUSED_SWIGLU=0: gate_up [R, 2F] fp32 and a row
// kernel; =1: the SwiGLU in the up GEMM's epilogue, only gate_up's gate half written, so the
// activation is checked against bf16(silu(g) * u) with u in fp64), and FusedSwigluMatchesUnfused
// requires act, expert_out, out and the gate half bit-identical between the two. DecodeGemvMatchesCpu
// runs the decode GEMV (ENCORE_MOE_DECODE=1, T <= 16) through the same checks, g and u then in fp64.
// Cases: an expert with no token, all tokens to one expert, top-k ties, 1 token, 37 and 1000 tokens,
// E = 1, top-k = E, align_m 1 / 8 / 16 / 128, the Qwen3-30B-A3B shape (D 2048, E 128, k 8, F 768) at
// small T; T = 1 / 7 / 333 / 4099 with F 64 / 768 for the two paths. Failures name the case, the
// path, the expert and the row.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "encore/moe.hpp"
#include "tests/common/aot_kernels.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/common/scoped_env.hpp"

namespace encore::test {
namespace {

const Device kGpu{DeviceType::kCUDA, 0};

class MoeForwardGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    pin_aot_kernels(true);
  }
  void TearDown() override { pin_aot_kernels(false); }
};

enum class Logits { kRandom, kTies, kAllToExpert0, kExpertLastEmpty };

struct ForwardCase {
  const char* name;
  int64_t T, D, F;
  int E, k, align;
  Logits logits;
};

float bf16_round(double v) {
  HostTensor h(DType::kBF16, 1, 1);
  h.set(0, 0, v);
  return float(h.get(0, 0));
}

// A host copy of one device buffer view (contiguous, as carved).
std::vector<unsigned char> download(const TensorView& v) {
  int64_t n = 1;
  for (int i = 0; i < v.ndim; ++i) n *= v.shape[i];
  std::vector<unsigned char> h(size_t(n) * dtype_size(v.dtype));
  cudaMemcpy(h.data(), v.data, h.size(), cudaMemcpyDeviceToHost);
  return h;
}
double at(const std::vector<unsigned char>& h, DType t, int64_t i) { return load_as_double(h.data(), t, i); }
const int32_t* ints(const std::vector<unsigned char>& h) { return reinterpret_cast<const int32_t*>(h.data()); }

// "" when equal, else where the first int32 (or byte) differs.
std::string diff(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b) {
  if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  for (size_t i = 0; i + 4 <= a.size(); i += 4)
    if (std::memcmp(&a[i], &b[i], 4) != 0) {
      int32_t x, y;
      std::memcpy(&x, &a[i], 4);
      std::memcpy(&y, &b[i], 4);
      return "first difference at element " + std::to_string(i / 4) + ": device " + std::to_string(x) + ", CPU " + std::to_string(y);
    }
  return std::memcmp(a.data(), b.data(), a.size()) == 0 ? "" : "tail bytes differ";
}

// Which expert owns row r (offsets ascending); -1 past offsets[E].
int expert_of_row(const int32_t* offsets, int E, int64_t r) {
  for (int e = 0; e < E; ++e)
    if (r >= offsets[e] && r < offsets[e + 1]) return e;
  return -1;
}

// The expert-compute paths: unfused SwiGLU (ENCORE_MOE_FUSED_SWIGLU=0), fused (=1), the decode GEMV
// (ENCORE_MOE_DECODE=1: gate_up never written, act from fp32 dots in registers).
enum class Path { kUnfused, kFused, kDecode };
const char* path_name(Path p) { return p == Path::kFused ? " (fused SwiGLU)" : p == Path::kDecode ? " (decode GEMV)" : " (unfused SwiGLU)"; }

// What a device run leaves, for comparing the two SwiGLU paths.
struct ForwardRun {
  std::vector<unsigned char> gate_up, act, y, out;
  int64_t used = 0;
};

// seed: 0 draws fresh inputs (make_rng); a nonzero seed gives the same inputs to every run that passes it.
void run_forward_case(const ForwardCase& c, Path path, ForwardRun* keep = nullptr, uint64_t seed = 0) {
  SCOPED_TRACE(std::string(c.name) + path_name(path));
  const bool fused = path == Path::kFused, decode = path == Path::kDecode;
  const ScopedEnv env("ENCORE_MOE_FUSED_SWIGLU", fused ? "1" : "0"), denv("ENCORE_MOE_DECODE", decode ? "1" : "0");
  const int64_t T = c.T, D = c.D, F = c.F;
  const int E = c.E, k = c.k;
  auto rng = seed != 0 ? std::mt19937_64(seed) : make_rng(uint64_t(T * 131 + E * 7 + k));
  HostTensor x(DType::kBF16, T, D), logits(DType::kFP32, T, E), w13(DType::kBF16, int64_t(E) * 2 * F, D), w2(DType::kBF16, int64_t(E) * D, F);
  x.fill_normal(rng);
  logits.fill_normal(rng, 0.0, 2.0);
  w13.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(D)));
  w2.fill_normal(rng, 0.0, 1.0 / std::sqrt(double(F)));
  for (int64_t t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) {
      if (c.logits == Logits::kTies) logits.set(t, e, double((t + e / 3) % 3));  // triples of equal logits
      if (c.logits == Logits::kAllToExpert0 && e == 0) logits.set(t, e, 30.0);
      if (c.logits == Logits::kExpertLastEmpty && e == E - 1) logits.set(t, e, -30.0);
    }
  MoeOptions o;
  o.routing.top_k = k;
  o.align_m = c.align;
  const MoeLayerShape s{T, D, F, E, DType::kBF16};
  const size_t bytes = moe_buffers_bytes(s, o);
  ASSERT_GT(bytes, 0u);

  // CPU layer.
  std::vector<unsigned char> hstore(bytes + 256, 0xAB);
  void* hbase = hstore.data() + (256 - reinterpret_cast<uintptr_t>(hstore.data()) % 256) % 256;
  MoeBuffers hb;
  ASSERT_TRUE(moe_buffers_carve(s, o, hbase, bytes, Device{}, &hb));
  HostTensor cpu_out(DType::kBF16, T, D);
  cpu_out.poison();
  auto w13v = [&](void* p, Device d) { return TensorView::contiguous(p, DType::kBF16, {E, 2 * F, D}, d); };
  auto w2v = [&](void* p, Device d) { return TensorView::contiguous(p, DType::kBF16, {E, D, F}, d); };
  Status st = run(MoeForwardArgs{x.view(), logits.view(), {}, w13v(w13.bytes.data(), Device{}), w2v(w2.bytes.data(), Device{}), hb, cpu_out.view()}, o);
  ASSERT_TRUE(st) << st.to_string();

  // CUDA layer.
  DeviceBuffer dx(x.storage_bytes()), dl(logits.storage_bytes()), dw13(w13.storage_bytes()), dw2(w2.storage_bytes()), dout(cpu_out.storage_bytes()),
      dbase(bytes);
  ASSERT_NE(dbase.ptr, nullptr);
  MoeBuffers db;
  ASSERT_TRUE(moe_buffers_carve(s, o, dbase.ptr, bytes, kGpu, &db));
  const MoeForwardArgs da{to_device(x, dx), to_device(logits, dl), {}, w13v(dw13.ptr, kGpu), w2v(dw2.ptr, kGpu), db, TensorView::contiguous(dout.ptr, DType::kBF16, {T, D}, kGpu)};
  cudaMemcpy(dw13.ptr, w13.bytes.data(), w13.storage_bytes(), cudaMemcpyHostToDevice);
  cudaMemcpy(dw2.ptr, w2.bytes.data(), w2.storage_bytes(), cudaMemcpyHostToDevice);
  auto device_run = [&](std::vector<unsigned char>& out) {
    ENCORE_ASSERT_CUDA(cudaMemset(dbase.ptr, 0xff, bytes));  // every buffer poisoned (bf16 / fp32 NaN, int -1)
    ENCORE_ASSERT_CUDA(cudaMemset(dout.ptr, 0xff, cpu_out.storage_bytes()));
    const Status rs = run(da, o);
    ASSERT_TRUE(rs) << rs.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    out = download(da.out);
  };
  std::vector<unsigned char> gout, gout2;
  device_run(gout);
  if (::testing::Test::HasFatalFailure()) return;

  // Maps bit-equal to the CPU's.
  auto host_bytes = [](const TensorView& v) {
    int64_t n = 1;
    for (int i = 0; i < v.ndim; ++i) n *= v.shape[i];
    const auto* p = static_cast<const unsigned char*>(v.data);
    return std::vector<unsigned char>(p, p + size_t(n) * dtype_size(v.dtype));
  };
  const std::vector<unsigned char> g_ids = download(db.topk_ids), g_off = download(db.expert_offsets), g_cnt = download(db.expert_counts),
                                   g_slots = download(db.slot_rows);
  ASSERT_EQ(diff(g_ids, host_bytes(hb.topk_ids)), "") << "topk_ids differ from the CPU routing";
  ASSERT_EQ(diff(g_cnt, host_bytes(hb.expert_counts)), "") << "expert_counts";
  ASSERT_EQ(diff(g_off, host_bytes(hb.expert_offsets)), "") << "expert_offsets";
  ASSERT_EQ(diff(g_slots, host_bytes(hb.slot_rows)), "") << "slot_rows";
  const int32_t* off = ints(g_off);
  const int32_t* cnt = ints(g_cnt);
  const int64_t used = off[E];
  const std::vector<unsigned char> g_xp = download(db.x_permuted), g_h = download(db.gate_up), g_act = download(db.activation),
                                   g_y = download(db.expert_out);
  {
    const std::vector<unsigned char> c_xp = host_bytes(hb.x_permuted);
    ASSERT_EQ(0, std::memcmp(g_xp.data(), c_xp.data(), size_t(used * D) * 2)) << "x_permuted differs from the CPU dispatch";
  }

  // The grouped GEMMs alone, row by row from the device's own inputs.
  int bad_h = 0, bad_act = 0, bad_y = 0;
  std::ostringstream msg;
  std::vector<double> xr(static_cast<size_t>(D)), ar(static_cast<size_t>(F)), hr(static_cast<size_t>(2 * F)), hs(static_cast<size_t>(2 * F));
  for (int64_t r = 0; r < used; ++r) {
    const int e = expert_of_row(off, E, r);
    if (r >= off[e] + cnt[e]) {  // a padding row: activation and expert_out exactly zero
      for (int64_t f = 0; f < F; ++f)
        if (at(g_act, DType::kBF16, r * F + f) != 0 && bad_act++ < 5) msg << "activation padding row " << r << " (expert " << e << ") col " << f << " not zero\n";
      for (int64_t d = 0; d < D; ++d)
        if (at(g_y, DType::kBF16, r * D + d) != 0 && bad_y++ < 5) msg << "expert_out padding row " << r << " (expert " << e << ") col " << d << " not zero\n";
      continue;
    }
    for (int64_t d = 0; d < D; ++d) xr[size_t(d)] = at(g_xp, DType::kBF16, r * D + d);
    // fp64 x_permuted . w13[e]^T of all 2F columns; the device's gate_up holds both halves on the
    // unfused path, the gate half only on the fused one (its up values stay in the accumulator).
    for (int64_t n = 0; n < 2 * F; ++n) {
      double ref = 0, scale = 0;
      for (int64_t d = 0; d < D; ++d) {
        const double w = w13.get(int64_t(e) * 2 * F + n, d);
        ref += xr[size_t(d)] * w;
        scale += std::fabs(xr[size_t(d)] * w);
      }
      hr[size_t(n)] = ref;
      hs[size_t(n)] = scale;
      if ((fused && n >= F) || decode) continue;
      const double got = at(g_h, DType::kFP32, r * 2 * F + n);
      if (!(std::fabs(got - ref) <= 1e-4 * scale + 1e-30) && bad_h++ < 5)
        msg << "gate_up expert " << e << " row " << r << " col " << n << ": " << got << " vs fp64 " << ref << "\n";
    }
    for (int64_t f = 0; f < F; ++f) {
      const double g = decode ? hr[size_t(f)] : at(g_h, DType::kFP32, r * 2 * F + f),
                   u = fused || decode ? hr[size_t(F + f)] : at(g_h, DType::kFP32, r * 2 * F + F + f);
      const double s = g / (1 + std::exp(-g));
      const double ref = bf16_round(s * u), got = at(g_act, DType::kBF16, r * F + f);
      // Fused: u in fp64, so also the fp32 accumulation error of u (as for gate_up above); decode: g's
      // too (d silu(g) / dg <= 1.1).
      const double tol = std::fabs(ref) * (1.0 / 128) + (fused || decode ? std::fabs(s) * 1e-4 * hs[size_t(F + f)] : 0.0) +
                         (decode ? 1.1 * std::fabs(u) * 1e-4 * hs[size_t(f)] : 0.0) + 1e-30;
      ar[size_t(f)] = got;
      if (!(std::fabs(got - ref) <= tol) && bad_act++ < 5)
        msg << "activation expert " << e << " row " << r << " col " << f << ": " << got << " vs " << ref << "\n";
    }
    for (int64_t d = 0; d < D; ++d) {
      double ref = 0, scale = 0;
      for (int64_t f = 0; f < F; ++f) {
        const double w = w2.get(int64_t(e) * D + d, f);
        ref += ar[size_t(f)] * w;
        scale += std::fabs(ar[size_t(f)] * w);
      }
      const double got = at(g_y, DType::kBF16, r * D + d);
      if (!(std::fabs(got - ref) <= std::fabs(ref) * (1.0 / 128) + 1e-4 * scale + 1e-30) && bad_y++ < 5)
        msg << "expert_out expert " << e << " row " << r << " col " << d << ": " << got << " vs " << ref << "\n";
    }
  }
  EXPECT_EQ(bad_h + bad_act + bad_y, 0) << bad_h << " gate_up, " << bad_act << " activation, " << bad_y << " expert_out mismatches\n" << msg.str();

  // The output against the CPU layer (fp64 accumulation, bf16 rounding of act and y on both sides).
  double max_ref = 0;
  for (int64_t i = 0; i < T * D; ++i) max_ref = std::max(max_ref, std::fabs(cpu_out.get(i / D, i % D)));
  int bad = 0;
  std::ostringstream omsg;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      const double ref = cpu_out.get(t, d), got = at(gout, DType::kBF16, t * D + d);
      if (!(std::fabs(got - ref) <= 0.02 * std::fabs(ref) + 0.01 * max_ref) && bad++ < 5)
        omsg << "out[" << t << ", " << d << "] = " << got << " vs CPU " << ref << " (max |ref| " << max_ref << ")\n";
    }
  EXPECT_EQ(bad, 0) << bad << " output mismatches\n" << omsg.str();

  // Rerun bit-identical (output and expert outputs).
  device_run(gout2);
  EXPECT_EQ(diff(gout, gout2), "") << "rerun output differs";
  EXPECT_EQ(diff(g_y, download(db.expert_out)), "") << "rerun expert_out differs";
  if (keep != nullptr) *keep = ForwardRun{g_h, g_act, g_y, gout, used};
}

// Every case on the unfused and the fused SwiGLU path, stopping at the first fatal failure.
template <size_t N>
void run_on_both_swiglu_paths(const ForwardCase (&cases)[N]) {
  for (const ForwardCase& c : cases)
    for (Path path : {Path::kUnfused, Path::kFused}) {
      run_forward_case(c, path);
      if (::testing::Test::HasFatalFailure()) return;
    }
}

// MatchesCpu's cases (WideTileMatchesCpu runs them again on the other tile).
const ForwardCase kCpuCases[] = {
    {"empty_expert", 64, 128, 64, 8, 2, 8, Logits::kExpertLastEmpty},
    {"all_to_expert0", 50, 64, 32, 8, 2, 16, Logits::kAllToExpert0},
    {"ties", 40, 64, 48, 12, 3, 8, Logits::kTies},
    {"one_token", 1, 128, 64, 16, 4, 128, Logits::kRandom},
    {"t37", 37, 96, 40, 16, 4, 1, Logits::kRandom},
    {"t1000", 1000, 64, 32, 32, 4, 16, Logits::kRandom},
    {"e1", 33, 64, 56, 1, 1, 8, Logits::kRandom},
    {"k_equals_e", 20, 64, 32, 4, 4, 128, Logits::kRandom},
    {"align1_many_experts", 300, 64, 64, 128, 8, 1, Logits::kRandom},
    {"qwen3_t4", 4, 2048, 768, 128, 8, 16, Logits::kRandom},
};

// The cooperative GEMMs on 128x128 tiles (ENCORE_MOE_GEMM_TILE=128x128; the default at 1 token).
TEST_F(MoeForwardGpu, MatchesCpu) {
  const ScopedEnv tile("ENCORE_MOE_GEMM_TILE", "128x128");
  run_on_both_swiglu_paths(kCpuCases);
}

// The cooperative GEMMs on 128x256 tiles (ENCORE_MOE_GEMM_TILE=128x256; the default from 2 tokens):
// the same checks on both SwiGLU paths, N below, at and above one 256-column tile (D 64 / 96 / 2048, F 768, 2F 1536).
TEST_F(MoeForwardGpu, WideTileMatchesCpu) {
  const ScopedEnv tile("ENCORE_MOE_GEMM_TILE", "128x256");
  run_on_both_swiglu_paths(kCpuCases);
  const ForwardCase f768[] = {{"t333_f768_align128_empty_expert", 333, 256, 768, 8, 4, 128, Logits::kExpertLastEmpty}};
  run_on_both_swiglu_paths(f768);
}

// The decode GEMV (decode_mlp.cu) at the sizes it takes (T <= 16): the same checks, padding rows zero,
// reruns bit-identical; Qwen3-30B-A3B's layer at T 1 and 4, a DeepSeek-V3-like hidden size (7168,
// F 2048) with fewer experts, E = 1, k = E, all tokens to one expert, ties, align_m 1 / 16 / 128.
TEST_F(MoeForwardGpu, DecodeGemvMatchesCpu) {
  const ForwardCase cases[] = {
      {"one_token", 1, 128, 64, 16, 4, 128, Logits::kRandom},
      {"qwen3_t1", 1, 2048, 768, 128, 8, 16, Logits::kRandom},
      {"qwen3_t4", 4, 2048, 768, 128, 8, 16, Logits::kRandom},
      {"deepseek_like_t2", 2, 7168, 2048, 16, 8, 1, Logits::kRandom},
      {"t16_f768_align1", 16, 256, 768, 8, 2, 1, Logits::kRandom},
      {"t7_all_to_expert0", 7, 64, 64, 8, 2, 16, Logits::kAllToExpert0},
      {"t12_ties", 12, 64, 48, 12, 3, 8, Logits::kTies},
      {"e1", 9, 64, 56, 1, 1, 8, Logits::kRandom},
      {"k_equals_e", 5, 64, 32, 4, 4, 128, Logits::kRandom},
  };
  for (const ForwardCase& c : cases) {
    run_forward_case(c, Path::kDecode);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// The two SwiGLU paths compute the same fp32 values (same K order, one accumulator per element),
// apply the same silu_mul and round once: act, expert_out and out must be bit-identical, and so
// must the gate half of gate_up (rows below offsets[E]; the up half is only written unfused). Both
// on 128x128 tiles (the fused up GEMM's own), so each element comes from the same HGMMA shape.
TEST_F(MoeForwardGpu, FusedSwigluMatchesUnfused) {
  const ScopedEnv tile("ENCORE_MOE_GEMM_TILE", "128x128");
  const ForwardCase cases[] = {
      {"t1_f64_align16", 1, 128, 64, 8, 2, 16, Logits::kRandom},
      {"t7_f768_align1", 7, 256, 768, 8, 2, 1, Logits::kRandom},
      {"t7_all_to_expert0_align1", 7, 64, 64, 8, 2, 1, Logits::kAllToExpert0},
      {"t333_f768_align128_empty_expert", 333, 256, 768, 8, 4, 128, Logits::kExpertLastEmpty},
      {"t333_f64_align16_ties", 333, 128, 64, 12, 3, 16, Logits::kTies},
      {"t4099_f64_align16", 4099, 128, 64, 16, 2, 16, Logits::kRandom},
      {"t4099_f768_align128_empty_expert", 4099, 128, 768, 32, 2, 128, Logits::kExpertLastEmpty},
  };
  for (const ForwardCase& c : cases) {
    const uint64_t seed = (uint64_t(std::random_device{}()) << 32 | std::random_device{}()) | 1;  // same inputs for both paths
    SCOPED_TRACE(std::string(c.name) + " seed " + std::to_string(seed));
    ForwardRun unfused, fused;
    run_forward_case(c, Path::kUnfused, &unfused, seed);
    if (::testing::Test::HasFatalFailure()) return;
    run_forward_case(c, Path::kFused, &fused, seed);
    if (::testing::Test::HasFatalFailure()) return;
    ASSERT_EQ(unfused.used, fused.used);
    const int64_t used = fused.used, F = c.F, D = c.D;
    auto rows = [&](const std::vector<unsigned char>& v, int64_t row_bytes) {
      return std::vector<unsigned char>(v.begin(), v.begin() + used * row_bytes);
    };
    EXPECT_EQ(diff(rows(unfused.act, F * 2), rows(fused.act, F * 2)), "") << "activation differs between the paths";
    EXPECT_EQ(diff(rows(unfused.y, D * 2), rows(fused.y, D * 2)), "") << "expert_out differs between the paths";
    EXPECT_EQ(diff(unfused.out, fused.out), "") << "out differs between the paths";
    std::vector<unsigned char> gu, gf;
    for (int64_t r = 0; r < used; ++r) {
      const auto* a = unfused.gate_up.data() + r * 2 * F * 4;
      const auto* b = fused.gate_up.data() + r * 2 * F * 4;
      gu.insert(gu.end(), a, a + F * 4);
      gf.insert(gf.end(), b, b + F * 4);
    }
    EXPECT_EQ(diff(gu, gf), "") << "gate half of gate_up differs between the paths";
  }
}

TEST_F(MoeForwardGpu, BadInputs) {
  MoeOptions o;
  o.routing.top_k = 2;
  auto check = [&](int64_t D, int64_t F, DType dt, const std::string& needle) {
    const int E = 4;
    const int64_t T = 4;
    const MoeLayerShape s{T, D, F, E, dt};
    DeviceBuffer base(moe_buffers_bytes(s, o)), a(1 << 20), b(1 << 20), c(1 << 20), d(1 << 20), f(1 << 20);
    MoeBuffers buf;
    ASSERT_TRUE(moe_buffers_carve(s, o, base.ptr, moe_buffers_bytes(s, o), kGpu, &buf));
    const MoeForwardArgs fa{TensorView::contiguous(a.ptr, dt, {T, D}, kGpu), TensorView::contiguous(b.ptr, DType::kFP32, {T, E}, kGpu), {},
                            TensorView::contiguous(c.ptr, dt, {E, 2 * F, D}, kGpu), TensorView::contiguous(d.ptr, dt, {E, D, F}, kGpu), buf,
                            TensorView::contiguous(f.ptr, dt, {T, D}, kGpu)};
    const Status st = validate(fa, o);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.to_string();
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message() << "\nexpected: " << needle;
    const Status rs = run(fa, o);
    EXPECT_FALSE(rs.is_ok());
  };
  check(64, 32, DType::kFP32, "takes bf16");
  check(64, 32, DType::kFP16, "takes bf16");
  check(12, 32, DType::kBF16, "multiples of 8");
  check(64, 20, DType::kBF16, "multiples of 8");
}

}  // namespace
}  // namespace encore::test
