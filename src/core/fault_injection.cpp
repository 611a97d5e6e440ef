// The launch-path failure message and the test seam (core/fault_injection.hpp); the seam's arming
// (testing/fault_injection.hpp) is defined here too, next to the state it sets.
#include "core/fault_injection.hpp"

#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "testing/fault_injection.hpp"

namespace encore::fault {
namespace {

struct Armed {
  int id;
  Step step;
  std::string match;
  int skip, times, hits;
};

std::atomic<uint32_t> g_mask{0};  // bit s: some scope arms step s
std::mutex g_mu;
std::vector<Armed> g_armed;
int g_next_id = 1;

uint32_t bit(Step s) { return uint32_t(1) << unsigned(s); }

void recompute_mask_locked() {
  uint32_t m = 0;
  for (const Armed& a : g_armed)
    if (a.times != 0) m |= bit(a.step);
  g_mask.store(m, std::memory_order_relaxed);
}

}  // namespace

const char* step_name(Step s) {
  switch (s) {
    case Step::kPointerCheck: return "pointer check";
    case Step::kCutlassCanImplement: return "CUTLASS can_implement";
    case Step::kCutlassParams: return "CUTLASS params";
    case Step::kCutlassLaunch: return "CUTLASS launch";
    case Step::kKernelLaunch: return "kernel launch";
    case Step::kNvrtcCompile: return "NVRTC compile";
    case Step::kModuleLoad: return "module load";
    case Step::kNccl: return "NCCL";
  }
  return "unknown step";
}

bool inject(Step step, const char* what) {
  if ((g_mask.load(std::memory_order_relaxed) & bit(step)) == 0) return false;
  std::lock_guard<std::mutex> lock(g_mu);
  for (Armed& a : g_armed) {
    if (a.step != step || a.times == 0) continue;
    if (!a.match.empty() && (what == nullptr || std::strstr(what, a.match.c_str()) == nullptr)) continue;
    if (a.skip > 0) {
      --a.skip;
      continue;
    }
    if (a.times > 0) --a.times;
    ++a.hits;
    recompute_mask_locked();
    return true;
  }
  return false;
}

Status injected(Step step, const char* what) {
  std::string msg = std::string(what ? what : "?") + ": " + step_name(step) + " failed: injected fault (test seam)";
  switch (step) {
    case Step::kPointerCheck: return Status::invalid(std::move(msg));
    case Step::kCutlassCanImplement: return Status::unsupported(std::move(msg));
    case Step::kNvrtcCompile:
    case Step::kNccl: return Status::internal(std::move(msg));
    default: return Status::cuda_error(std::move(msg));
  }
}

std::string failure_message(const char* what, const char* step, const char* code_name, long long code, const char* description) {
  std::string s = std::string(what ? what : "?") + ": " + (step ? step : "call") + " failed: ";
  s += code_name && *code_name ? code_name : "error";
  s += " (" + std::to_string(code) + ")";
  if (description && *description) s += std::string(": ") + description;
  return s;
}

}  // namespace encore::fault

namespace encore::testing {

ScopedFault::ScopedFault(fault::Step step, std::string match, int skip, int times) {
  std::lock_guard<std::mutex> lock(fault::g_mu);
  id_ = fault::g_next_id++;
  fault::g_armed.push_back({id_, step, std::move(match), skip < 0 ? 0 : skip, times, 0});
  fault::recompute_mask_locked();
}

ScopedFault::~ScopedFault() {
  std::lock_guard<std::mutex> lock(fault::g_mu);
  for (size_t i = 0; i < fault::g_armed.size(); ++i)
    if (fault::g_armed[i].id == id_) {
      fault::g_armed.erase(fault::g_armed.begin() + long(i));
      break;
    }
  fault::recompute_mask_locked();
}

int ScopedFault::hits() const {
  std::lock_guard<std::mutex> lock(fault::g_mu);
  for (const fault::Armed& a : fault::g_armed)
    if (a.id == id_) return a.hits;
  return 0;
}

}  // namespace encore::testing
