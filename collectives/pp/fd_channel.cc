#include "collectives/pp/fd_channel.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace unifab::collectives::pp {
namespace {

// The abstract address of `name`: a leading NUL, then the name (not NUL-terminated).
socklen_t addressOf(const std::string& name, sockaddr_un* address) {
  memset(address, 0, sizeof(*address));
  address->sun_family = AF_UNIX;
  memcpy(address->sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

}  // namespace

Result FdChannel::create(const std::string& name, std::unique_ptr<FdChannel>* out) {
  if (name.empty() || name.size() > kMaxName) {
    return UF_ERROR(unifabInternalError, kExt, "descriptor channel name '%s' is empty or longer than %zu bytes",
                    name.c_str(), kMaxName);
  }
  std::unique_ptr<FdChannel> channel(new FdChannel());
  channel->socket_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (channel->socket_ < 0) return UF_ERROR(unifabSystemError, kExt, "socket(AF_UNIX) failed: %s", strerror(errno));
  sockaddr_un address;
  const socklen_t length = addressOf(name, &address);
  if (bind(channel->socket_, reinterpret_cast<sockaddr*>(&address), length) != 0) {
    return UF_ERROR(unifabSystemError, kExt, "binding the descriptor channel '%s' failed: %s", name.c_str(), strerror(errno));
  }
  *out = std::move(channel);
  return unifabSuccess;
}

FdChannel::~FdChannel() {
  for (auto& waiting : waiting_) close(waiting.second);
  if (socket_ >= 0) close(socket_);
}

Result FdChannel::send(const std::string& peer, uint64_t key, int fd) {
  sockaddr_un address;
  const socklen_t length = addressOf(peer, &address);
  iovec payload{&key, sizeof(key)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr message{};
  message.msg_name = &address;
  message.msg_namelen = length;
  message.msg_iov = &payload;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  cmsghdr* rights = CMSG_FIRSTHDR(&message);
  rights->cmsg_level = SOL_SOCKET;
  rights->cmsg_type = SCM_RIGHTS;
  rights->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(rights), &fd, sizeof(int));
  // The socket is non-blocking: a full queue at the peer (it has not taken earlier descriptors)
  // is retried briefly rather than waited for without bound.
  for (int attempt = 0;; ++attempt) {
    if (sendmsg(socket_, &message, 0) == static_cast<ssize_t>(sizeof(key))) return unifabSuccess;
    if ((errno != EAGAIN && errno != EWOULDBLOCK) || attempt == 1000) {
      return UF_ERROR(unifabSystemError, kExt, "sending a buffer's handle to channel '%s' failed: %s", peer.c_str(),
                      strerror(errno));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Result FdChannel::take(uint64_t key, std::chrono::steady_clock::time_point deadline, int* fd) {
  for (;;) {
    auto found = waiting_.find(key);
    if (found != waiting_.end()) {
      *fd = found->second;
      waiting_.erase(found);
      return unifabSuccess;
    }
    uint64_t receivedKey = 0;
    iovec payload{&receivedKey, sizeof(receivedKey)};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr message{};
    message.msg_iov = &payload;
    message.msg_iovlen = 1;
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    const ssize_t got = recvmsg(socket_, &message, MSG_CMSG_CLOEXEC);
    if (got < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return UF_ERROR(unifabSystemError, kExt, "receiving a peer buffer's handle failed: %s", strerror(errno));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return UF_ERROR(unifabTimeout, kExt, "a peer's buffer handle (key %llx) did not arrive within "
                        "UNIFAB_PP_TIMEOUT_MS", static_cast<unsigned long long>(key));
      }
      std::this_thread::yield();
      continue;
    }
    const cmsghdr* rights = CMSG_FIRSTHDR(&message);
    if (got != static_cast<ssize_t>(sizeof(receivedKey)) || rights == nullptr || rights->cmsg_type != SCM_RIGHTS ||
        (message.msg_flags & MSG_CTRUNC) != 0) {
      if (rights != nullptr && rights->cmsg_type == SCM_RIGHTS) {
        int stray = -1;
        memcpy(&stray, CMSG_DATA(rights), sizeof(int));
        close(stray);
      }
      continue;  // not one of ours: dropped
    }
    int received = -1;
    memcpy(&received, CMSG_DATA(rights), sizeof(int));
    auto previous = waiting_.find(receivedKey);
    if (previous != waiting_.end()) close(previous->second);  // a newer send of the same key wins
    waiting_[receivedKey] = received;
  }
}

}  // namespace unifab::collectives::pp
