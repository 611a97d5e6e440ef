// JIT tests that need no GPU (NVRTC compiles on the CPU; those tests skip without it): key
// stability, the file format, corrupt / truncated files, an unwritable directory, concurrent writers;
// the families' policies, variants and specs (RMSNorm, QK-norm, FP8 group quant), the shared
// dispatcher pieces (jit/family.hpp) and the warm-up config (jit/warmup.hpp).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "jit/cache.hpp"
#include "jit/jit.hpp"
#include "jit/family.hpp"
#include "jit/warmup.hpp"
#include "norm/jit.hpp"
#include "quant/jit.hpp"
#include "tests/common/scoped_env.hpp"

namespace encore::jit {
namespace {

namespace fs = std::filesystem;

std::string temp_dir(const std::string& tag) {
  fs::path p = fs::temp_directory_path() / ("encore-jit-test-" + tag + "-" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::vector<char> bytes(const std::string& s) { return std::vector<char>(s.begin(), s.end()); }

KernelSpec toy_spec() {
  KernelSpec s;
  s.name = "toy";
  s.source = "#include \"toy.cuh\"\n";
  s.headers = {{"toy.cuh", "template <int N> __global__ void toy(float* p) { p[threadIdx.x] = N; }\n"}};
  s.name_expression = "&toy<7>";
  s.options = {"-std=c++17"};
  return s;
}

TEST(JitCache, Fnv1aKnownValues) {
  EXPECT_EQ(fnv1a64("", 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a", 1), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(hex64(0x1234), "0000000000001234");
}

TEST(JitCache, KeyIsStableAndCoversEveryInput) {
  const Toolchain tc{13, 0, 13000, "0.1.0"};
  const KernelSpec s = toy_spec();
  const uint64_t k = cache_key(s, "sm_90a", tc);
  // A fixed value: a change here means every user's cache is invalidated (bump on purpose only).
  EXPECT_EQ(hex64(k), hex64(cache_key(toy_spec(), "sm_90a", Toolchain{13, 0, 13000, "0.1.0"})));
  EXPECT_EQ(hex64(k), "2ff7844aaa147660") << "key of the toy spec (update the golden value only on a deliberate key change)";
  auto differs = [&](auto mutate) {
    KernelSpec s2 = toy_spec();
    Toolchain t2 = tc;
    std::string arch = "sm_90a";
    mutate(s2, t2, arch);
    return cache_key(s2, arch, t2) != k;
  };
  EXPECT_TRUE(differs([](KernelSpec& s, Toolchain&, std::string&) { s.source += " "; }));
  EXPECT_TRUE(differs([](KernelSpec& s, Toolchain&, std::string&) { s.headers[0].second += " "; }));
  EXPECT_TRUE(differs([](KernelSpec& s, Toolchain&, std::string&) { s.headers[0].first = "toy2.cuh"; }));
  EXPECT_TRUE(differs([](KernelSpec& s, Toolchain&, std::string&) { s.name_expression = "&toy<8>"; }));
  EXPECT_TRUE(differs([](KernelSpec& s, Toolchain&, std::string&) { s.options.push_back("-DX=1"); }));
  EXPECT_TRUE(differs([](KernelSpec&, Toolchain&, std::string& a) { a = "sm_100a"; }));
  EXPECT_TRUE(differs([](KernelSpec&, Toolchain& t, std::string&) { t.nvrtc_minor = 1; }));
  EXPECT_TRUE(differs([](KernelSpec&, Toolchain& t, std::string&) { t.driver_version = 13010; }));
  EXPECT_TRUE(differs([](KernelSpec&, Toolchain& t, std::string&) { t.encore_version = "0.2.0"; }));
  // Field boundaries are hashed: moving a character between two options changes the key.
  KernelSpec a = toy_spec(), b = toy_spec();
  a.options = {"-DAB", "C"};
  b.options = {"-DA", "BC"};
  EXPECT_NE(cache_key(a, "sm_90a", tc), cache_key(b, "sm_90a", tc));
  // The readable name is not part of the identity.
  KernelSpec n = toy_spec();
  n.name = "other";
  EXPECT_EQ(cache_key(n, "sm_90a", tc), k);
}

TEST(JitCache, FileFormatDetectsCorruption) {
  const std::vector<char> payload = bytes("cubin bytes \x7f" "ELF...");
  const std::vector<char> f = encode_cache_file(42, payload);
  ASSERT_EQ(f.size(), kCacheHeaderBytes + payload.size());
  ASSERT_TRUE(decode_cache_file(42, f).has_value());
  EXPECT_EQ(*decode_cache_file(42, f), payload);
  EXPECT_FALSE(decode_cache_file(43, f).has_value()) << "another key's file";
  for (size_t cut : {size_t(0), size_t(7), kCacheHeaderBytes - 1, kCacheHeaderBytes, f.size() - 1}) {
    std::vector<char> t(f.begin(), f.begin() + cut);
    EXPECT_FALSE(decode_cache_file(42, t).has_value()) << "truncated to " << cut << " bytes";
  }
  for (size_t i = 0; i < f.size(); ++i) {
    std::vector<char> c = f;
    c[i] ^= 0x10;
    EXPECT_FALSE(decode_cache_file(42, c).has_value()) << "byte " << i << " flipped";
  }
  std::vector<char> padded = f;
  padded.push_back(0);
  EXPECT_FALSE(decode_cache_file(42, padded).has_value());
}

TEST(JitCache, StoreLoadAndCorruptFileIsDeleted) {
  const std::string dir = temp_dir("store");
  DiskCache c(dir);
  EXPECT_FALSE(c.load("k", 1).has_value());
  ASSERT_TRUE(c.store("k", 1, bytes("hello")));
  ASSERT_TRUE(c.load("k", 1).has_value());
  EXPECT_EQ(*c.load("k", 1), bytes("hello"));
  EXPECT_EQ(c.stats().files, 1);
  EXPECT_EQ(c.stats().bytes, int64_t(kCacheHeaderBytes + 5));
  const std::string path = c.path_for("k", 1);
  fs::resize_file(path, kCacheHeaderBytes + 2);  // truncated (a crash mid-copy, a full disk)
  EXPECT_FALSE(c.load("k", 1).has_value());
  EXPECT_FALSE(fs::exists(path)) << "a corrupt cache file is deleted";
  for (const auto& e : fs::directory_iterator(dir)) ADD_FAILURE() << "left behind: " << e.path();
  fs::remove_all(dir);
}

TEST(JitCache, UnwritableDirectoryFallsBackToMemoryAndSaysSoOnce) {
  const std::string base = temp_dir("unwritable");
  { std::ofstream(base + "/file") << "x"; }
  DiskCache c(base + "/file/jit");  // under a regular file: not creatable, even as root
  testing::internal::CaptureStderr();
  EXPECT_FALSE(c.store("k", 1, bytes("a")));
  EXPECT_FALSE(c.store("k", 2, bytes("b")));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("not writable"), std::string::npos) << err;
  EXPECT_EQ(err.find("not writable"), err.rfind("not writable")) << "said more than once: " << err;
  EXPECT_FALSE(c.writable());
  EXPECT_FALSE(c.load("k", 1).has_value());
  fs::remove_all(base);
}

TEST(JitCache, ConcurrentWritersThreadsAndProcesses) {
  const std::string dir = temp_dir("concurrent");
  std::vector<char> payload(1 << 20);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = char(i * 131 + 7);
  std::atomic<int> bad{0};
  auto hammer = [&](int rounds) {
    DiskCache c(dir);
    for (int r = 0; r < rounds; ++r) {
      if (!c.store("same", 99, payload)) bad++;
      auto got = c.load("same", 99);
      if (got && *got != payload) bad++;  // a reader sees a whole file or none
    }
  };
  std::vector<pid_t> kids;
  for (int p = 0; p < 3; ++p) {
    pid_t pid = fork();
    if (pid == 0) {
      bad = 0;
      hammer(20);
      _exit(bad == 0 ? 0 : 1);
    }
    ASSERT_GT(pid, 0);
    kids.push_back(pid);
  }
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) ts.emplace_back(hammer, 20);
  for (auto& t : ts) t.join();
  for (pid_t pid : kids) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "a writer process saw a partial file";
  }
  EXPECT_EQ(bad.load(), 0);
  DiskCache c(dir);
  ASSERT_TRUE(c.load("same", 99).has_value());
  EXPECT_EQ(*c.load("same", 99), payload);
  EXPECT_EQ(c.stats().files, 1);
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().rfind(".tmp", 0), std::string::npos) << "temporary left: " << e.path();
  fs::remove_all(dir);
}

// ENCORE_JIT: unset is the default (auto, with the capture fallback), 0 / off off, 1 / auto / on auto,
// 2 / always always, anything else off; and the capture refusal is recognized (what Family::handled
// falls back on), other statuses are not.
TEST(JitCache, ModeFromEnvironmentAndCaptureRefusal) {
  test::ScopedEnv env("ENCORE_JIT");
  unsetenv("ENCORE_JIT");
  EXPECT_EQ(mode_from_env(), JitMode::kDefault);
  const std::pair<const char*, JitMode> cases[] = {{"", JitMode::kDefault}, {"0", JitMode::kOff},    {"off", JitMode::kOff},
                                                   {"1", JitMode::kAuto},   {"auto", JitMode::kAuto}, {"on", JitMode::kAuto},
                                                   {"2", JitMode::kAlways}, {"always", JitMode::kAlways}, {"bogus", JitMode::kOff}};
  for (const auto& [value, mode] : cases) {
    setenv("ENCORE_JIT", value, 1);
    EXPECT_EQ(mode_from_env(), mode) << "ENCORE_JIT=" << value;
  }
  EXPECT_TRUE(is_capture_refusal(Status::unsupported(std::string("jit: kernel k") + kCaptureRefusal + "; warm up")));
  EXPECT_FALSE(is_capture_refusal(Status::unsupported("jit: NVRTC is not available")));
  EXPECT_FALSE(is_capture_refusal(Status::cuda_error(std::string("x") + kCaptureRefusal)));
  EXPECT_FALSE(is_capture_refusal(Status::ok()));
}

TEST(JitCache, RmsNormPolicyAndVariants) {
  EXPECT_TRUE(norm::rms_norm_hidden_in_aot_list(4096));
  EXPECT_FALSE(norm::rms_norm_hidden_in_aot_list(5184));
  EXPECT_FALSE(norm::rms_norm_hidden_in_aot_list(3000));
  const auto vs = norm::rms_norm_jit_variants(DType::kBF16, 5184, false, 132);
  ASSERT_FALSE(vs.empty());
  // 16-byte packs, and their 32-byte forms (sm_100+, widen_rms_norm_plan: half the cached packs).
  for (const auto& v : vs) EXPECT_TRUE(v.vec_elems == 8 || v.vec_elems == 16) << v.vec_elems;
  for (const auto& v : vs)
    if (v.vec_elems == 16)
      EXPECT_TRUE(std::any_of(vs.begin(), vs.end(), [&](const auto& n) { return n.vec_elems == 8 && n.cached == 2 * v.cached && n.warps_per_row == v.warps_per_row; }));
  EXPECT_TRUE(std::any_of(vs.begin(), vs.end(), [](const auto& v) { return v.vec_elems == 16; }));
  EXPECT_EQ(norm::rms_norm_jit_variants(DType::kBF16, 3001, true, 132)[0].vec_elems, 1);
  std::vector<std::string> names;
  for (const auto& v : vs) {  // the plan's team size is a template argument too (offsets as immediates)
    EXPECT_GT(v.warps_per_row, 0);
    const KernelSpec s = norm::rms_norm_jit_spec(v);
    EXPECT_NE(s.name_expression.find("5184, " + std::to_string(v.warps_per_row) + ">"), std::string::npos) << s.name_expression;
    EXPECT_NE(s.name.find("-w" + std::to_string(v.warps_per_row)), std::string::npos) << s.name;
    EXPECT_EQ(std::count(names.begin(), names.end(), s.name), 0) << "two variants share the name " << s.name;
    names.push_back(s.name);
  }
  ASSERT_NE(embedded_source("norm/cuda/rms_norm_kernel.cuh"), nullptr) << "the kernel header is not embedded";
  EXPECT_NE(std::string(embedded_source("norm/cuda/rms_norm_kernel.cuh")).find("rms_norm_kernel"), std::string::npos);
}

// NVRTC on the CPU: compile, then a second process-like instance (new Jit, same directory) loads
// from disk; a corrupted file is recompiled.
TEST(JitNvrtc, CompileDiskHitAndRecompileAfterCorruption) {
  if (!nvrtc_info().available) GTEST_SKIP() << "NVRTC not available: " << nvrtc_info().library;
  const std::string dir = temp_dir("nvrtc");
  const norm::RmsNormJitVariant v{DType::kBF16, 5184, 8, 8, false};
  const KernelSpec spec = norm::rms_norm_jit_spec(v);
  std::shared_ptr<const Cubin> c1, c2, c3;
  Origin o = Origin::kMemory;
  double ms = 0;
  {
    Jit j(dir, JitMode::kAuto);
    Status st = j.get_cubin(spec, "sm_90a", &c1, &o, &ms);
    ASSERT_TRUE(st) << st.to_string();
    EXPECT_EQ(o, Origin::kCompiled);
    std::printf("  [jit] cold NVRTC compile of %s: %.1f ms, %zu-byte cubin\n", spec.name.c_str(), ms, c1->image.size());
    ASSERT_GE(c1->image.size(), 4u);
    EXPECT_EQ(std::string(c1->image.data() + 1, 3), "ELF");
    EXPECT_FALSE(c1->lowered_name.empty());
    ASSERT_TRUE(j.get_cubin(spec, "sm_90a", &c2, &o, &ms));
    EXPECT_EQ(o, Origin::kMemory);
  }
  {
    Jit j(dir, JitMode::kAuto);
    ASSERT_TRUE(j.get_cubin(spec, "sm_90a", &c2, &o, &ms));
    EXPECT_EQ(o, Origin::kDisk);
    std::printf("  [jit] warm disk load: %.3f ms\n", ms);
    EXPECT_EQ(c2->image, c1->image);
    EXPECT_EQ(c2->lowered_name, c1->lowered_name);
  }
  const uint64_t key = cache_key(spec, "sm_90a", current_toolchain());
  const std::string path = DiskCache(dir).path_for(spec.name, key);
  ASSERT_TRUE(fs::exists(path)) << path;
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(kCacheHeaderBytes + 100));
    f.put('\x5a');
  }
  {
    Jit j(dir, JitMode::kAuto);
    ASSERT_TRUE(j.get_cubin(spec, "sm_90a", &c3, &o, &ms));
    EXPECT_EQ(o, Origin::kCompiled) << "a corrupt file must be recompiled, never loaded";
    EXPECT_EQ(c3->image.size(), c1->image.size());
  }
  EXPECT_TRUE(DiskCache(dir).load(spec.name, key).has_value()) << "the recompiled kernel was stored again";
  fs::remove_all(dir);
}

// Every kind of template argument the dispatcher can ask for compiles (dtype, element access,
// streaming kCached = 0, add), for sm_90a.
TEST(JitNvrtc, RmsNormVariantKindsCompile) {
  if (!nvrtc_info().available) GTEST_SKIP() << "NVRTC not available: " << nvrtc_info().library;
  Jit j("", JitMode::kAuto);  // memory only
  for (const norm::RmsNormJitVariant& v : {norm::RmsNormJitVariant{DType::kFP32, 3000, 4, 0, true},
                                           norm::RmsNormJitVariant{DType::kFP16, 777, 1, 2, true},
                                           norm::RmsNormJitVariant{DType::kBF16, 140000, 8, 0, false}}) {
    const KernelSpec spec = norm::rms_norm_jit_spec(v);
    std::shared_ptr<const Cubin> c;
    double ms = 0;
    Status st = j.get_cubin(spec, "sm_90a", &c, nullptr, &ms);
    ASSERT_TRUE(st) << spec.name << ": " << st.to_string();
    std::printf("  [jit] %s: %.1f ms\n", spec.name.c_str(), ms);
    EXPECT_FALSE(c->lowered_name.empty());
  }
}

TEST(JitNvrtc, UnwritableDirectoryStillCompilesIntoMemory) {
  if (!nvrtc_info().available) GTEST_SKIP() << "NVRTC not available: " << nvrtc_info().library;
  const std::string base = temp_dir("nvrtc-ro");
  { std::ofstream(base + "/file") << "x"; }
  Jit j(base + "/file/jit", JitMode::kAuto);
  std::shared_ptr<const Cubin> c;
  Origin o{};
  testing::internal::CaptureStderr();
  Status st = j.get_cubin(toy_spec(), "sm_90a", &c, &o);
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_EQ(o, Origin::kCompiled);
  EXPECT_NE(err.find("memory only"), std::string::npos) << err;
  ASSERT_TRUE(j.get_cubin(toy_spec(), "sm_90a", &c, &o));
  EXPECT_EQ(o, Origin::kMemory);
  fs::remove_all(base);
}

TEST(JitNvrtc, CompileErrorIsReportedWithTheLog) {
  if (!nvrtc_info().available) GTEST_SKIP() << "NVRTC not available: " << nvrtc_info().library;
  const std::string dir = temp_dir("nvrtc-err");
  Jit j(dir, JitMode::kAuto);
  KernelSpec s = toy_spec();
  s.headers[0].second = "this is not C++\n";
  std::shared_ptr<const Cubin> c;
  Status st = j.get_cubin(s, "sm_90a", &c);
  EXPECT_FALSE(st);
  EXPECT_NE(st.message().find("toy.cuh"), std::string::npos) << st.to_string();
  EXPECT_EQ(DiskCache(dir).stats().files, 0);
  fs::remove_all(dir);
}

// NVRTC missing: run in a child process with ENCORE_JIT_NO_NVRTC=1 (NVRTC loads once per process).
TEST(JitNoNvrtc, Child) {
  const char* v = std::getenv("ENCORE_JIT_NO_NVRTC");
  if (!v || std::string(v) != "1") GTEST_SKIP() << "runs in the child of JitNoNvrtc.MissingNvrtcMeansAheadOfTime";
  EXPECT_FALSE(nvrtc_info().available);
  EXPECT_FALSE(norm::rms_norm_uses_jit(5184)) << "without NVRTC the dispatcher must take the AOT kernels";
  norm::set_qk_norm_jit_policy(JitPolicy::kAlways);
  norm::QkNormProblem qp;
  qp.num_q_heads = 24, qp.num_kv_heads = 4, qp.head_dim = 128;
  EXPECT_FALSE(norm::qk_norm_uses_jit(qp)) << "QK-norm: without NVRTC, even with policy always";
  quant::set_fp8_group_quant_jit_policy(JitPolicy::kAlways);
  quant::Fp8QuantProblem fp;
  fp.cols = 5248;
  EXPECT_FALSE(quant::fp8_group_quant_uses_jit(fp)) << "FP8 quant: without NVRTC, even with policy always";
  quant::set_mx_quant_jit_policy(JitPolicy::kAlways);
  quant::MxProblem mp;
  mp.cols = 5248;
  EXPECT_FALSE(quant::mx_quant_uses_jit(mp)) << "MX quant: without NVRTC, even with policy always";
  std::shared_ptr<const Cubin> c;
  Status st = Jit("", JitMode::kAuto).get_cubin(toy_spec(), "sm_90a", &c);
  EXPECT_FALSE(st);
  EXPECT_NE(st.message().find("NVRTC is not available"), std::string::npos) << st.to_string();
  std::printf("JIT_NO_NVRTC_CHILD_RAN\n");
}

TEST(JitNoNvrtc, MissingNvrtcMeansAheadOfTime) {
  char exe[4096] = {0};
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  ASSERT_GT(n, 0);
  const std::string cmd = std::string("ENCORE_JIT_NO_NVRTC=1 '") + exe + "' --gtest_filter=JitNoNvrtc.Child 2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof(buf), f)) out += buf;
  const int rc = pclose(f);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("JIT_NO_NVRTC_CHILD_RAN"), std::string::npos) << out;
}

}  // namespace
}  // namespace encore::jit
