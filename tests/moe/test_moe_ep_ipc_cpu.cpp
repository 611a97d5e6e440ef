// The EP peer-memory descriptor exchange (src/moe/ep_ipc.cpp, ep_exchange_fds) between real processes:
// three forked ranks each share a memfd holding its rank's bytes and read every peer's through the
// descriptor it received; a rank whose peer never shows up times out with a message naming both; a peer
// built with another config is refused on both sides.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "moe/ep_device.hpp"

namespace encore::test {
namespace {

using moe::ep::ep_exchange_fds;

// 0 when rank `rank` of `world` received every peer's memfd with the right contents.
int exchange_and_check(const std::string& name, int rank, int world, uint64_t tag = 7) {
  const int fd = memfd_create(("encore-ep-test-" + std::to_string(rank)).c_str(), MFD_CLOEXEC);
  if (fd < 0) return 2;
  const std::string mine = "rank " + std::to_string(rank) + " memory";
  if (write(fd, mine.data(), mine.size()) != ssize_t(mine.size())) return 3;
  std::vector<int> fds;
  const Status s = ep_exchange_fds(name, rank, world, fd, tag, std::chrono::milliseconds(5000), &fds);
  if (!s) return s.to_string().find("has another EP config") != std::string::npos ? 5 : 4;
  for (int r = 0; r < world; ++r) {
    const std::string want = "rank " + std::to_string(r) + " memory";
    std::string got(want.size(), '\0');
    if (pread(fds[size_t(r)], got.data(), got.size(), 0) != ssize_t(got.size()) || got != want) return 10 + r;
    if (r != rank) close(fds[size_t(r)]);
  }
  close(fd);
  return 0;
}

TEST(MoeEpIpc, ThreeProcessesExchangeDescriptors) {
  const std::string name = "test-" + std::to_string(getpid());
  const int world = 3;
  std::vector<pid_t> kids;
  for (int r = 1; r < world; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) _exit(exchange_and_check(name, r, world));
    kids.push_back(pid);
  }
  EXPECT_EQ(exchange_and_check(name, 0, world), 0);
  for (pid_t pid : kids) {
    int st = 0;
    ASSERT_EQ(waitpid(pid, &st, 0), pid);
    EXPECT_TRUE(WIFEXITED(st));
    EXPECT_EQ(WEXITSTATUS(st), 0) << "child rank failed";
  }
}

TEST(MoeEpIpc, MissingPeerTimesOut) {
  const int fd = memfd_create("encore-ep-test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  std::vector<int> fds;
  const auto t0 = std::chrono::steady_clock::now();
  const Status s = ep_exchange_fds("lonely-" + std::to_string(getpid()), 0, 2, fd, 7, std::chrono::milliseconds(150), &fds);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(s);
  EXPECT_NE(s.to_string().find("rank 0 timed out after 150 ms connecting to rank 1"), std::string::npos) << s.to_string();
  EXPECT_LT(ms, 2000.0);
  const Status bad = ep_exchange_fds("x", 2, 2, fd, 7, std::chrono::milliseconds(10), &fds);
  EXPECT_NE(bad.to_string().find("rank: must be in [0, world = 2)"), std::string::npos) << bad.to_string();
  const Status longname = ep_exchange_fds(std::string(81, 'n'), 0, 2, fd, 7, std::chrono::milliseconds(10), &fds);
  EXPECT_NE(longname.to_string().find("name: 1 to 80 characters"), std::string::npos) << longname.to_string();
  close(fd);
}

TEST(MoeEpIpc, PeerWithAnotherConfigIsRefused) {
  const std::string name = "tag-" + std::to_string(getpid());
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) _exit(exchange_and_check(name, 1, 2, 8));  // rank 1 built with another config
  EXPECT_EQ(exchange_and_check(name, 0, 2, 7), 5);           // refused, naming the config
  int st = 0;
  ASSERT_EQ(waitpid(pid, &st, 0), pid);
  EXPECT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 5);
}

// The group's host-side refusals, before any device work (so on every build).
TEST(MoeEpIpc, GroupArgumentsRefused) {
  using moe::ep::EpConfig;
  using moe::ep::EpDeviceGroup;
  EpConfig c;
  c.world = 2, c.num_experts = 4, c.top_k = 2, c.hidden = 64, c.max_tokens = 8, c.dtype = DType::kBF16;
  std::unique_ptr<EpDeviceGroup> g;
  auto refused = [&](const Status& s, const char* needle) { EXPECT_NE(s.to_string().find(needle), std::string::npos) << s.to_string(); };
  refused(EpDeviceGroup::create_ipc(c, 2, 0, "n", &g), "rank: must be in [0, world = 2), got 2");
  refused(EpDeviceGroup::create_ipc(c, 0, 0, "", &g), "name: required");
  EpConfig odd = c;
  odd.hidden = 7;  // 14 bytes a row
  refused(EpDeviceGroup::create_ipc(odd, 0, 0, "n", &g), "hidden: H * dtype bytes must be a multiple of 16");
  EpConfig big = c;
  big.world = 16, big.num_experts = 16;
  refused(EpDeviceGroup::create_ipc(big, 0, 0, "n", &g), "world: at most 8 ranks, got 16");
  refused(EpDeviceGroup::create_on_one_device(big, 0, &g), "world: at most 8 ranks, got 16");
  std::unique_ptr<moe::ep::EpDeviceAllToAll> a;
  refused(moe::ep::EpDeviceAllToAll::create(nullptr, 0, &a), "group: required");
  EXPECT_EQ(g, nullptr);
}

}  // namespace
}  // namespace encore::test
