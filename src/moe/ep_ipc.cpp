// File descriptors between the processes of one node (ep_device.hpp, ep_exchange_fds): every rank
// listens on an abstract Unix socket named after the group, connects to every peer's (retrying until it
// listens, within the timeout) and sends its descriptor with SCM_RIGHTS and its rank; then accepts one
// connection per peer and receives theirs. Linux only.
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "moe/ep_device.hpp"

namespace encore::moe::ep {
namespace {

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

sockaddr_un address(const std::string& name, int rank, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::string path = "encore-ep/" + name + "/" + std::to_string(rank);  // abstract: sun_path[0] = 0
  const size_t n = std::min(path.size(), sizeof(a.sun_path) - 2);  // names of <= 80 characters always fit
  std::memcpy(a.sun_path + 1, path.data(), n);
  *len = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

Status errno_status(const std::string& what) { return Status::internal("ep fd exchange: " + what + ": " + std::strerror(errno)); }

struct Message {  // beside the descriptor
  int32_t rank;
  int32_t pad;
  uint64_t tag;
};

// A one-message header with room for one descriptor (SCM_RIGHTS), over `payload`.
struct FdMessage {
  Message payload{-1, 0, 0};
  iovec io{};
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))] = {};
  msghdr m{};
  FdMessage() {
    io = {&payload, sizeof(payload)};
    m.msg_iov = &io;
    m.msg_iovlen = 1;
    m.msg_control = ctrl;
    m.msg_controllen = sizeof(ctrl);
  }
  FdMessage(const FdMessage&) = delete;
};

// On failure: the descriptors received so far are closed (the caller owns them only on success).
Status failed(std::vector<int>* fds, int rank, Status s) {
  for (size_t r = 0; r < fds->size(); ++r)
    if (int(r) != rank && (*fds)[r] >= 0) close((*fds)[r]), (*fds)[r] = -1;
  return s;
}

}  // namespace

Status ep_exchange_fds(const std::string& name, int rank, int world, int my_fd, uint64_t tag, std::chrono::milliseconds timeout,
                       std::vector<int>* peer_fds) {
  if (!peer_fds) return Status::invalid("peer_fds: required");
  if (world < 1 || rank < 0 || rank >= world) return Status::invalid("rank: must be in [0, world = " + std::to_string(world) + ")");
  if (name.empty() || name.size() > 80) return Status::invalid("name: 1 to 80 characters, got " + std::to_string(name.size()));
  peer_fds->assign(size_t(world), -1);
  (*peer_fds)[size_t(rank)] = my_fd;
  if (world == 1) return Status::ok();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  Fd listener;
  listener.fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener.fd < 0) return errno_status("socket");
  socklen_t len = 0;
  sockaddr_un me = address(name, rank, &len);
  if (bind(listener.fd, reinterpret_cast<sockaddr*>(&me), len) != 0) return errno_status("bind (is another group named '" + name + "' running?)");
  if (listen(listener.fd, world) != 0) return errno_status("listen");
  // Send: to every peer, its socket retried until it listens.
  for (int s = 0; s < world; ++s) {
    if (s == rank) continue;
    Fd c;
    for (;;) {
      c.fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (c.fd < 0) return errno_status("socket");
      socklen_t pl = 0;
      sockaddr_un peer = address(name, s, &pl);
      if (connect(c.fd, reinterpret_cast<sockaddr*>(&peer), pl) == 0) break;
      close(c.fd);
      c.fd = -1;
      if (std::chrono::steady_clock::now() > deadline)
        return Status::internal("ep fd exchange: rank " + std::to_string(rank) + " timed out after " + std::to_string(timeout.count()) +
                                " ms connecting to rank " + std::to_string(s) + " (group '" + name + "')");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    FdMessage msg;
    msg.payload = {rank, 0, tag};
    cmsghdr* cm = CMSG_FIRSTHDR(&msg.m);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cm), &my_fd, sizeof(int));
    if (sendmsg(c.fd, &msg.m, 0) != ssize_t(sizeof(Message))) return errno_status("sendmsg to rank " + std::to_string(s));
  }
  // Receive: one connection per peer, each read within the time left.
  for (int got = 0; got < world - 1; ++got) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    pollfd pf{listener.fd, POLLIN, 0};
    if (left <= 0 || poll(&pf, 1, int(left)) <= 0)
      return failed(peer_fds, rank,
                    Status::internal("ep fd exchange: rank " + std::to_string(rank) + " timed out after " + std::to_string(timeout.count()) +
                                     " ms with " + std::to_string(got) + " of " + std::to_string(world - 1) + " peers' descriptors (group '" +
                                     name + "')"));
    Fd c;
    c.fd = accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (c.fd < 0) return failed(peer_fds, rank, errno_status("accept"));
    timeval tv{};
    tv.tv_sec = long(left / 1000);
    tv.tv_usec = long(left % 1000) * 1000;
    setsockopt(c.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    FdMessage msg;
    const ssize_t n = recvmsg(c.fd, &msg.m, MSG_CMSG_CLOEXEC);
    const Message& payload = msg.payload;
    cmsghdr* cm = n == ssize_t(sizeof(Message)) && !(msg.m.msg_flags & MSG_CTRUNC) ? CMSG_FIRSTHDR(&msg.m) : nullptr;
    int fd = -1;
    if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) std::memcpy(&fd, CMSG_DATA(cm), sizeof(int));
    const int s = payload.rank;
    if (fd < 0 || s < 0 || s >= world || s == rank || (*peer_fds)[size_t(s)] >= 0) {
      if (fd >= 0) close(fd);
      return failed(peer_fds, rank,
                    Status::internal("ep fd exchange: rank " + std::to_string(rank) + " got a malformed or late message (sender " +
                                     std::to_string(s) + ", " + std::to_string(n) + " bytes)"));
    }
    if (payload.tag != tag) {
      close(fd);
      return failed(peer_fds, rank,
                    Status::invalid("ep fd exchange: rank " + std::to_string(s) + " has another EP config than rank " + std::to_string(rank) +
                                    " (every rank must create the group with the same world, experts, top_k, hidden, max_tokens, dtype "
                                    "and scale bytes)"));
    }
    (*peer_fds)[size_t(s)] = fd;
  }
  return Status::ok();
}

}  // namespace encore::moe::ep
