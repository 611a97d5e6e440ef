// Launch-path failures on the CPU (tests/core): the one failure-message format, the test seam's arming
// (match, skip, times, nesting, disarm), the device-memory check's refusal messages and its range cache,
// and a dispatch's CUDA path returning an injected pointer-check failure with the output untouched
// (any build: the seam is consulted before the driver; without CUDA the check itself is a no-op).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/device_memory.hpp"
#include "core/fault_injection.hpp"
#include "encore/norm.hpp"
#include "testing/fault_injection.hpp"

namespace encore::test {
namespace {

using fault::Step;
using ScopedFault = encore::testing::ScopedFault;

bool has(const std::string& s, const char* needle) { return s.find(needle) != std::string::npos; }

TEST(LaunchErrors, FailureMessageNamesWhatStepAndCode) {
  EXPECT_EQ(fault::failure_message("rms_norm", "kernel launch", "cudaErrorInvalidConfiguration", 9, "invalid configuration argument"),
            "rms_norm: kernel launch failed: cudaErrorInvalidConfiguration (9): invalid configuration argument");
  EXPECT_EQ(fault::failure_message("jit: k", "module load (cuModuleLoadData)", nullptr, 201, nullptr),
            "jit: k: module load (cuModuleLoadData) failed: error (201)");
  EXPECT_EQ(fault::failure_message("moe_forward_ep", "ncclSend", "ncclResult", 3, ""), "moe_forward_ep: ncclSend failed: ncclResult (3)");
}

TEST(LaunchErrors, EveryStepHasANameAndTheRealFailuresCode) {
  for (int s = 0; s < fault::kStepCount; ++s) EXPECT_STRNE(fault::step_name(Step(s)), "unknown step") << s;
  EXPECT_EQ(fault::injected(Step::kPointerCheck, "x").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fault::injected(Step::kCutlassCanImplement, "g").code(), StatusCode::kUnsupported);
  EXPECT_EQ(fault::injected(Step::kCutlassParams, "g").code(), StatusCode::kCudaError);
  EXPECT_EQ(fault::injected(Step::kCutlassLaunch, "g").code(), StatusCode::kCudaError);
  EXPECT_EQ(fault::injected(Step::kKernelLaunch, "k").code(), StatusCode::kCudaError);
  EXPECT_EQ(fault::injected(Step::kNvrtcCompile, "j").code(), StatusCode::kInternal);
  EXPECT_EQ(fault::injected(Step::kModuleLoad, "j").code(), StatusCode::kCudaError);
  EXPECT_EQ(fault::injected(Step::kNccl, "n").code(), StatusCode::kInternal);
  EXPECT_EQ(fault::injected(Step::kKernelLaunch, "rms_norm").message(), "rms_norm: kernel launch failed: injected fault (test seam)");
}

TEST(LaunchErrors, SeamIsQuietUnlessArmed) {
  for (int s = 0; s < fault::kStepCount; ++s) EXPECT_FALSE(fault::inject(Step(s), "anything"));
}

TEST(LaunchErrors, SeamMatchSkipTimesAndScope) {
  {
    ScopedFault f(Step::kKernelLaunch, "rms_norm", /*skip=*/1, /*times=*/2);
    EXPECT_FALSE(fault::inject(Step::kModuleLoad, "rms_norm"));  // another step
    EXPECT_FALSE(fault::inject(Step::kKernelLaunch, "qk_norm"));  // no match
    EXPECT_FALSE(fault::inject(Step::kKernelLaunch, "rms_norm"));  // skipped
    EXPECT_TRUE(fault::inject(Step::kKernelLaunch, "rms_norm split-row partial"));  // a substring match
    EXPECT_TRUE(fault::inject(Step::kKernelLaunch, "rms_norm"));
    EXPECT_FALSE(fault::inject(Step::kKernelLaunch, "rms_norm"));  // times spent
    EXPECT_EQ(f.hits(), 2);
  }
  {
    ScopedFault outer(Step::kNccl, "", 0, -1);  // every call, until the scope ends
    {
      ScopedFault inner(Step::kNvrtcCompile, "probe");
      EXPECT_TRUE(fault::inject(Step::kNvrtcCompile, "jit probe"));
      EXPECT_FALSE(fault::inject(Step::kNvrtcCompile, "jit probe"));
    }
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(fault::inject(Step::kNccl, "ncclSend"));
    EXPECT_EQ(outer.hits(), 3);
  }
  EXPECT_FALSE(fault::inject(Step::kNccl, "ncclSend"));  // disarmed with its scope
}

TEST(LaunchErrors, NotDeviceMemoryMessages) {
  const Device gpu{DeviceType::kCUDA, 0};
  const void* p = reinterpret_cast<const void*>(uintptr_t(0x7f001000));
  const std::string host = checks::not_device_memory_message("x", p, gpu, checks::MemoryKind::kUnregisteredHost, -1);
  EXPECT_EQ(host,
            "x: memory at 0x7f001000 is not device memory of cuda:0: the CUDA driver does not know it (host memory labelled as a CUDA "
            "tensor?)");
  EXPECT_TRUE(has(checks::not_device_memory_message("w", p, gpu, checks::MemoryKind::kPinnedHost, 0), "w: memory at 0x7f001000 is pinned host memory"));
  const std::string peer = checks::not_device_memory_message("d", p, Device{DeviceType::kCUDA, 1}, checks::MemoryKind::kDevice, 0);
  EXPECT_TRUE(has(peer, "device memory of cuda:0, not of cuda:1")) << peer;
  EXPECT_TRUE(has(peer, "no peer access")) << peer;
}

TEST(LaunchErrors, VerifiedRangesLookups) {
  checks::VerifiedRanges r;
  EXPECT_FALSE(r.contains(0x1000, 0));
  r.add(0x1000, 0x2000, 0);
  EXPECT_TRUE(r.contains(0x1000, 0));
  EXPECT_TRUE(r.contains(0x1fff, 0));
  EXPECT_FALSE(r.contains(0x2000, 0));  // end excluded
  EXPECT_FALSE(r.contains(0x0fff, 0));
  EXPECT_FALSE(r.contains(0x1800, 1));  // verified for device 0 only
  r.add(0x9000, 0x9100, -1);            // managed: any device
  EXPECT_TRUE(r.contains(0x9010, 3));
  r.add(0x5000, 0x5000, 2);  // an empty range stands for its first byte
  EXPECT_TRUE(r.contains(0x5000, 2));
  EXPECT_FALSE(r.contains(0x5001, 2));
  // A new range replaces the ones it overlaps (an address reused by another allocation).
  r.add(0x1800, 0x2800, 1);
  EXPECT_FALSE(r.contains(0x1000, 0));
  EXPECT_TRUE(r.contains(0x1900, 1));
  EXPECT_TRUE(r.contains(0x27ff, 1));
  EXPECT_TRUE(r.contains(0x9010, 0)) << "a disjoint range stays";
  const size_t before = r.size();
  r.add(0x3000, 0x4000, 0);  // between others: kept sorted
  EXPECT_EQ(r.size(), before + 1);
  EXPECT_TRUE(r.contains(0x3fff, 0));
  EXPECT_FALSE(r.contains(0x2800, 1));
  // Many allocations (a model's weights) all stay found; a full cache starts over.
  r.clear();
  const size_t n = checks::VerifiedRanges::kCapacity;
  for (size_t i = 0; i < n; ++i) r.add(0x100000 + i * 0x1000, 0x100000 + i * 0x1000 + 0x800, 0);
  EXPECT_EQ(r.size(), n);
  for (size_t i = 0; i < n; i += 97) EXPECT_TRUE(r.contains(0x100000 + i * 0x1000 + 0x7ff, 0)) << i;
  EXPECT_FALSE(r.contains(0x100000 + 0x800, 0));  // the gap between two ranges
  r.add(0x10, 0x20, 0);
  EXPECT_EQ(r.size(), size_t(1));
  EXPECT_TRUE(r.contains(0x10, 0));
  r.clear();
  EXPECT_EQ(r.size(), size_t(0));
  EXPECT_FALSE(r.contains(0x10, 0));
}

TEST(LaunchErrors, DeviceMemoryCheckSkipsWhatNothingReads) {
  std::vector<float> host(16, 1.0f);
  const TensorView cpu = TensorView::contiguous(host.data(), DType::kFP32, {4, 4});
  TensorView empty = TensorView::contiguous(host.data(), DType::kFP32, {0, 4}, Device{DeviceType::kCUDA, 0});
  TensorView null = TensorView::contiguous(nullptr, DType::kFP32, {4, 4}, Device{DeviceType::kCUDA, 0});
  EXPECT_TRUE(checks::device_memory({{"cpu", &cpu}, {"empty", &empty}, {"null", &null}, {"none", nullptr}}));
  EXPECT_TRUE(checks::device_pointer("workspace", nullptr, Device{DeviceType::kCUDA, 0}));
  EXPECT_TRUE(checks::device_pointer("workspace", host.data(), Device{}));
  ScopedFault f(Step::kPointerCheck, "", 0, -1);
  EXPECT_TRUE(checks::device_memory({{"cpu", &cpu}, {"empty", &empty}, {"null", &null}}));  // not consulted for these
  EXPECT_EQ(f.hits(), 0);
}

// Host memory labelled cuda:0 through a dispatch: the seam's pointer-check failure comes back naming the
// argument and the step, before anything is launched (y keeps its bytes).
TEST(LaunchErrors, InjectedPointerCheckThroughRmsNorm) {
  const Device gpu{DeviceType::kCUDA, 0};
  std::vector<uint16_t> x(4 * 64, 0x3f80), w(64, 0x3f80), y(4 * 64, 0x7fc1);
  const std::vector<uint16_t> y0 = y;
  RmsNormArgs a{TensorView::contiguous(x.data(), DType::kBF16, {4, 64}, gpu), TensorView::contiguous(w.data(), DType::kBF16, {64}, gpu),
                TensorView::contiguous(y.data(), DType::kBF16, {4, 64}, gpu)};
  ScopedFault f(Step::kPointerCheck, "x");  // the first view checked
  const Status st = run(a, RmsNormOptions{});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_EQ(st.message(), "x: pointer check failed: injected fault (test seam)");
  EXPECT_EQ(f.hits(), 1);
  EXPECT_EQ(std::memcmp(y.data(), y0.data(), y.size() * sizeof(uint16_t)), 0);
#ifndef ENCORE_WITH_CUDA
  // Without the seam a build without CUDA checks nothing and refuses at the launch instead.
  const Status plain = run(a, RmsNormOptions{});
  EXPECT_EQ(plain.code(), StatusCode::kUnsupported) << plain.to_string();
  EXPECT_TRUE(has(plain.message(), "built without CUDA")) << plain.message();
#else
  // With CUDA the driver is asked: host memory is refused (or the check fails without a device).
  const Status plain = run(a, RmsNormOptions{});
  EXPECT_FALSE(plain.is_ok());
  EXPECT_TRUE(has(plain.message(), "x: ")) << plain.message();
#endif
  EXPECT_EQ(std::memcmp(y.data(), y0.data(), y.size() * sizeof(uint16_t)), 0);
}

}  // namespace
}  // namespace encore::test
