#include "collectives/pp/fd_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace unifab::collectives::pp {
namespace {

// The abstract address of `name`: a leading NUL, then the name (not NUL-terminated).
socklen_t addressOf(const std::string& name, sockaddr_un* address) {
  memset(address, 0, sizeof(*address));
  address->sun_family = AF_UNIX;
  memcpy(address->sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

// Milliseconds left until `deadline` for poll, rounded up (0 once it passed), at most a second.
int millisecondsUntil(FdChannel::Deadline deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - std::chrono::steady_clock::now());
  if (left.count() <= 0) return 0;
  return static_cast<int>(std::min<int64_t>((left.count() + 999) / 1000, 1000));
}

// Every descriptor a received message carries, closed (a message that is not one of ours).
void closeCarried(msghdr* message) {
  for (cmsghdr* c = CMSG_FIRSTHDR(message); c != nullptr; c = CMSG_NXTHDR(message, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd = -1;
      memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (fd >= 0) close(fd);
    }
  }
}

}  // namespace

Result FdChannel::create(const std::string& name, std::unique_ptr<FdChannel>* out) {
  if (name.empty() || name.size() > kMaxName) {
    return UF_ERROR(unifabInternalError, kExt, "descriptor channel name '%s' is empty or longer than %zu bytes",
                    name.c_str(), kMaxName);
  }
  std::unique_ptr<FdChannel> channel(new FdChannel());
  channel->name_ = name;
  channel->socket_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (channel->socket_ < 0) {
    return UF_ERROR(unifabSystemError, kExt, "descriptor channel '%s': socket(AF_UNIX, SOCK_DGRAM) failed: %s",
                    name.c_str(), strerror(errno));
  }
  sockaddr_un address;
  const socklen_t length = addressOf(name, &address);
  if (bind(channel->socket_, reinterpret_cast<sockaddr*>(&address), length) != 0) {
    return UF_ERROR(unifabSystemError, kExt, "descriptor channel '%s': bind failed: %s", name.c_str(), strerror(errno));
  }
  *out = std::move(channel);
  return unifabSuccess;
}

FdChannel::~FdChannel() {
  for (auto& waiting : waiting_) close(waiting.second);
  if (socket_ >= 0) close(socket_);
}

Result FdChannel::send(const std::string& peer, uint64_t key, int fd, Deadline deadline) {
  if (peer.empty() || peer.size() > kMaxName) {
    return UF_ERROR(unifabInternalError, kExt, "descriptor channel '%s': peer channel name '%s' is empty or longer "
                    "than %zu bytes", name_.c_str(), peer.c_str(), kMaxName);
  }
  sockaddr_un address;
  const socklen_t length = addressOf(peer, &address);
  iovec payload{&key, sizeof(key)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr message{};
  message.msg_name = &address;
  message.msg_namelen = length;
  message.msg_iov = &payload;
  message.msg_iovlen = 1;
  if (fd >= 0) {
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    cmsghdr* rights = CMSG_FIRSTHDR(&message);
    rights->cmsg_level = SOL_SOCKET;
    rights->cmsg_type = SCM_RIGHTS;
    rights->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(rights), &fd, sizeof(int));
  }
  for (;;) {
    if (sendmsg(socket_, &message, 0) == static_cast<ssize_t>(sizeof(key))) return unifabSuccess;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return UF_ERROR(unifabSystemError, kExt, "descriptor channel '%s': sending to channel '%s' failed: %s",
                      name_.c_str(), peer.c_str(), strerror(errno));
    }
    // The peer's queue is full: it has not taken the descriptors sent earlier yet.
    pollfd writable{socket_, POLLOUT, 0};
    const int wait = millisecondsUntil(deadline);
    if (wait == 0) {
      return UF_ERROR(unifabTimeout, kExt, "descriptor channel '%s': channel '%s' kept its queue full until "
                      "UNIFAB_PP_TIMEOUT_MS (it does not take the handles sent to it)", name_.c_str(), peer.c_str());
    }
    (void)poll(&writable, 1, std::min(wait, 10));
  }
}

Result FdChannel::receiveOne(bool* received) {
  *received = false;
  uint64_t key = 0;
  iovec payload{&key, sizeof(key)};
  alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))] = {};  // room to see (and close) extra descriptors
  msghdr message{};
  message.msg_iov = &payload;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  const ssize_t got = recvmsg(socket_, &message, MSG_CMSG_CLOEXEC);
  if (got < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return unifabSuccess;
    return UF_ERROR(unifabSystemError, kExt, "descriptor channel '%s': receiving failed: %s", name_.c_str(),
                    strerror(errno));
  }
  const cmsghdr* rights = CMSG_FIRSTHDR(&message);
  const bool ours = got == static_cast<ssize_t>(sizeof(key)) && (message.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) == 0 &&
                    rights != nullptr && rights->cmsg_level == SOL_SOCKET && rights->cmsg_type == SCM_RIGHTS &&
                    rights->cmsg_len == CMSG_LEN(sizeof(int)) && CMSG_NXTHDR(&message, const_cast<cmsghdr*>(rights)) == nullptr;
  if (!ours) {
    closeCarried(&message);  // a probe, or not one of ours: dropped
    return unifabSuccess;
  }
  int fd = -1;
  memcpy(&fd, CMSG_DATA(rights), sizeof(int));
  auto previous = waiting_.find(key);
  if (previous != waiting_.end()) close(previous->second);  // a newer send of the same key wins
  waiting_[key] = fd;
  *received = true;
  return unifabSuccess;
}

Result FdChannel::take(uint64_t key, Deadline deadline, int* fd) {
  for (;;) {
    auto found = waiting_.find(key);
    if (found != waiting_.end()) {
      *fd = found->second;
      waiting_.erase(found);
      return unifabSuccess;
    }
    bool received = false;
    UF_CHECK(receiveOne(&received));
    if (received) continue;
    // Nothing usable was queued: wait for the next datagram (or the deadline) without spinning.
    pollfd readable{socket_, POLLIN, 0};
    const int wait = millisecondsUntil(deadline);
    if (wait == 0) {
      return UF_ERROR(unifabTimeout, kExt, "descriptor channel '%s': the peer's buffer handle (key %llx) did not "
                      "arrive within UNIFAB_PP_TIMEOUT_MS", name_.c_str(), static_cast<unsigned long long>(key));
    }
    (void)poll(&readable, 1, wait);
  }
}

}  // namespace unifab::collectives::pp
