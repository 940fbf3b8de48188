#include "net/socket/socket_transport.h"

#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

namespace unifab::net::socket {
namespace {

constexpr int kMaxCommsPerDevice = 65536;
constexpr int kListenBacklog = 4096;

uint64_t randomId() {
  static std::mutex mutex;
  static std::mt19937_64 generator{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mutex);
  uint64_t id = 0;
  while (id == 0) id = generator();
  return id;
}

// Closes an fd on scope exit unless released.
class FdGuard {
 public:
  explicit FdGuard(int fd) : fd_(fd) {}
  ~FdGuard() {
    if (fd_ >= 0) close(fd_);
  }
  FdGuard(const FdGuard&) = delete;
  FdGuard& operator=(const FdGuard&) = delete;
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

// A peer host that dies without closing its sockets (power loss, a partition) sends no FIN or RST:
// with the kernel's defaults an idle stream never learns of it and a stream with data in flight
// retries for ~15 minutes, so the requests on it would stay pending. Keepalive probes over the
// first quarter of `timeoutS` and then every eighth, and a user timeout on unacknowledged data,
// turn that into a socket error within ~timeoutS, which fails the connection's requests.
Result configureStream(int fd, int64_t bufferBytes, int timeoutS) {
  int one = 1;
  UF_SYSCHECK(setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)), kNet, "setsockopt(TCP_NODELAY)");
  if (bufferBytes > 0) {
    int bytes = static_cast<int>(bufferBytes);
    UF_SYSCHECK(setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes)), kNet, "setsockopt(SO_SNDBUF)");
    UF_SYSCHECK(setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes)), kNet, "setsockopt(SO_RCVBUF)");
  }
  if (timeoutS > 0) {
    const int idle = std::max(1, timeoutS / 4), interval = std::max(1, timeoutS / 8);
    const int probes = std::max(1, (timeoutS - idle) / interval);
    const unsigned int userTimeoutMs = static_cast<unsigned int>(timeoutS) * 1000u;
    UF_SYSCHECK(setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one)), kNet, "setsockopt(SO_KEEPALIVE)");
    UF_SYSCHECK(setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle)), kNet, "setsockopt(TCP_KEEPIDLE)");
    UF_SYSCHECK(setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval)), kNet,
                "setsockopt(TCP_KEEPINTVL)");
    UF_SYSCHECK(setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes)), kNet, "setsockopt(TCP_KEEPCNT)");
    UF_SYSCHECK(setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &userTimeoutMs, sizeof(userTimeoutMs)), kNet,
                "setsockopt(TCP_USER_TIMEOUT)");
  }
  return unifabSuccess;
}

std::string peerName(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return "<unknown peer>";
  return formatAddress(reinterpret_cast<sockaddr*>(&address));
}

// ---- accepting side --------------------------------------------------------------------------

class SocketListenComm final : public ListenComm {
 public:
  SocketListenComm(int fd, uint64_t listenId, std::shared_ptr<ProgressEngine> engine,
                   const SocketTransportOptions& options)
      : fd_(fd), listenId_(listenId), engine_(std::move(engine)), options_(options) {}

  ~SocketListenComm() override {
    close(fd_);
    for (const Pending& pending : pending_) close(pending.fd);
    for (auto& entry : groups_) {
      for (int streamFd : entry.second.fds) {
        if (streamFd >= 0) close(streamFd);
      }
    }
  }

  Result accept(std::unique_ptr<RecvComm>* comm) override {
    comm->reset();
    UF_CHECK(acceptPending());
    readHellos();
    dropStale();
    for (auto it = groups_.begin(); it != groups_.end(); ++it) {
      Group& group = it->second;
      if (group.arrived != static_cast<int>(group.fds.size())) continue;
      auto recvComm = std::make_unique<SocketRecvComm>(engine_, group.fds, group.peer, options_.connection);
      groups_.erase(it);  // the comm owns the fds now
      UF_CHECK(recvComm->start());
      UF_INFO(kNet, kLogInit, "accepted a connection from %s with %d stream(s)", recvComm->peer().c_str(),
              recvComm->streamCount());
      *comm = std::move(recvComm);
      return unifabSuccess;
    }
    return unifabSuccess;
  }

 private:
  struct Pending {
    int fd;
    Hello hello;
    size_t received;
    std::chrono::steady_clock::time_point since;
  };
  struct Group {
    std::vector<int> fds;
    int arrived = 0;
    std::string peer;
    std::chrono::steady_clock::time_point since;
  };

  // A socket that never says Hello (a port scanner, a health check) or a connection whose other
  // streams never come (a peer that died while connecting) would hold descriptors for the
  // listener's lifetime: they get UNIFAB_SOCKET_TIMEOUT_S (0: no limit) to introduce themselves.
  void dropStale() {
    if (options_.timeoutS <= 0) return;
    const auto oldest = std::chrono::steady_clock::now() - std::chrono::seconds(options_.timeoutS);
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->since >= oldest) {
        ++it;
        continue;
      }
      UF_WARN(kNet, "dropping a connection from %s that sent no complete Hello in %d s", peerName(it->fd).c_str(),
              options_.timeoutS);
      close(it->fd);
      it = pending_.erase(it);
    }
    for (auto it = groups_.begin(); it != groups_.end();) {
      Group& group = it->second;
      if (group.arrived == static_cast<int>(group.fds.size()) || group.since >= oldest) {
        ++it;
        continue;
      }
      UF_WARN(kNet, "dropping a connection from %s: %d of its %zu streams arrived in %d s", group.peer.c_str(),
              group.arrived, group.fds.size(), options_.timeoutS);
      for (int streamFd : group.fds) {
        if (streamFd >= 0) close(streamFd);
      }
      it = groups_.erase(it);
    }
  }

  Result acceptPending() {
    for (;;) {
      int streamFd = accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (streamFd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return unifabSuccess;
        if (errno == EINTR || errno == ECONNABORTED) continue;
        int err = errno;
        return UF_ERROR(unifabSystemError, kNet, "accept on listen fd %d failed: %s", fd_, strerror(err));
      }
      FdGuard guard(streamFd);
      UF_CHECK(configureStream(streamFd, options_.bufferBytes, options_.timeoutS));
      pending_.push_back(Pending{guard.release(), Hello{}, 0, std::chrono::steady_clock::now()});
    }
  }

  void readHellos() {
    for (size_t i = 0; i < pending_.size();) {
      Pending& pending = pending_[i];
      ssize_t n = recv(pending.fd, reinterpret_cast<char*>(&pending.hello) + pending.received,
                       sizeof(Hello) - pending.received, MSG_DONTWAIT);
      if (n > 0) pending.received += static_cast<size_t>(n);
      bool drop = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
      if (!drop && pending.received == sizeof(Hello)) {
        drop = !admit(pending);
        if (!drop) {
          pending_.erase(pending_.begin() + static_cast<long>(i));
          continue;
        }
      }
      if (drop) {
        close(pending.fd);
        pending_.erase(pending_.begin() + static_cast<long>(i));
        continue;
      }
      ++i;
    }
  }

  // Places a stream whose Hello arrived into its connection's group; false if it is foreign.
  bool admit(const Pending& pending) {
    const Hello& hello = pending.hello;
    bool valid = hello.magic == kWireMagic && hello.version == kWireVersion && hello.listenId == listenId_ &&
                 hello.streamCount >= 1 && hello.streamCount <= kMaxStreams && hello.streamIndex < hello.streamCount;
    if (!valid) {
      UF_WARN(kNet, "dropping a connection from %s that is not a unifab %u peer for this listener",
              peerName(pending.fd).c_str(), static_cast<unsigned>(kWireVersion));
      return false;
    }
    Group& group = groups_[hello.connectionId];
    if (group.fds.empty()) {
      group.fds.assign(hello.streamCount, -1);
      group.peer = peerName(pending.fd);
      group.since = pending.since;
    }
    if (group.fds.size() != hello.streamCount || group.fds[hello.streamIndex] != -1) {
      UF_WARN(kNet, "dropping a duplicate or inconsistent stream %u/%u from %s", hello.streamIndex, hello.streamCount,
              group.peer.c_str());
      return false;
    }
    group.fds[hello.streamIndex] = pending.fd;
    ++group.arrived;
    return true;
  }

  int fd_;
  uint64_t listenId_;
  std::shared_ptr<ProgressEngine> engine_;
  SocketTransportOptions options_;
  std::vector<Pending> pending_;
  std::map<uint64_t, Group> groups_;
};

}  // namespace

// ---- connecting side -------------------------------------------------------------------------

// Named by the handle's connectStage between NCCL's repeated connect() calls, and owned by the
// transport meanwhile (SocketTransport::connecting_).
class Connector {
 public:
  Connector(const ListenHandle& handle, const SocketTransportOptions& options)
      : handle_(handle), options_(options), connectionId_(randomId()) {}

  ~Connector() {
    for (Stream& stream : streams_) {
      if (stream.fd >= 0) close(stream.fd);
    }
  }

  uint64_t listenId() const { return handle_.listenId; }

  Result begin() {
    const std::string peer = target();
    for (int i = 0; i < options_.nStreams; ++i) {
      int fd = ::socket(handle_.address.sa.sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      UF_SYSCHECK(fd, kNet, "socket()");
      streams_.push_back(Stream{fd, false, 0, Hello{}});
      UF_CHECK(configureStream(fd, options_.bufferBytes, options_.timeoutS));
      if (::connect(fd, &handle_.address.sa, handle_.addressLength) != 0 && errno != EINPROGRESS) {
        int err = errno;
        return UF_ERROR(unifabRemoteError, kNet, "connect to %s failed: %s", peer.c_str(), strerror(err));
      }
      Hello& hello = streams_.back().hello;
      hello.magic = kWireMagic;
      hello.version = kWireVersion;
      hello.streamIndex = static_cast<uint16_t>(i);
      hello.streamCount = static_cast<uint16_t>(options_.nStreams);
      hello.connectionId = connectionId_;
      hello.listenId = handle_.listenId;
    }
    return unifabSuccess;
  }

  // Advances every stream without blocking; *ready once all are connected and introduced.
  Result progress(bool* ready) {
    *ready = false;
    bool all = true;
    for (Stream& stream : streams_) {
      if (!stream.connected) {
        pollfd poll{stream.fd, POLLOUT, 0};
        int n = ::poll(&poll, 1, 0);
        if (n == 0) {
          all = false;
          continue;
        }
        int err = 0;
        socklen_t length = sizeof(err);
        if (n < 0 || getsockopt(stream.fd, SOL_SOCKET, SO_ERROR, &err, &length) != 0) err = errno;
        if (err != 0) {
          return UF_ERROR(unifabRemoteError, kNet, "connect to %s failed: %s",
                          target().c_str(), strerror(err));
        }
        stream.connected = true;
      }
      while (stream.helloSent < sizeof(Hello)) {
        ssize_t n = send(stream.fd, reinterpret_cast<const char*>(&stream.hello) + stream.helloSent,
                         sizeof(Hello) - stream.helloSent, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) {
          stream.helloSent += static_cast<size_t>(n);
          continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
        int err = errno;
        return UF_ERROR(unifabRemoteError, kNet, "introducing stream to %s failed: %s",
                        target().c_str(), strerror(err));
      }
      all = all && stream.helloSent == sizeof(Hello);
    }
    *ready = all;
    return unifabSuccess;
  }

  std::vector<int> releaseFds() {
    std::vector<int> fds;
    for (Stream& stream : streams_) {
      fds.push_back(stream.fd);
      stream.fd = -1;
    }
    return fds;
  }

  std::string target() const { return formatAddress(&handle_.address.sa); }

 private:
  struct Stream {
    int fd;
    bool connected;
    size_t helloSent;
    Hello hello;
  };
  ListenHandle handle_;
  SocketTransportOptions options_;
  uint64_t connectionId_;
  std::vector<Stream> streams_;
};

Result SocketTransport::create(const SocketTransportOptions& options, std::unique_ptr<SocketTransport>* transport) {
  std::unique_ptr<SocketTransport> created(new SocketTransport());
  created->options_ = options;
  created->interfaces_ = findInterfaces(options.ifname, options.family, 16);
  if (created->interfaces_.empty()) {
    return UF_ERROR(unifabSystemError, kNet, "no usable network interface (UNIFAB_SOCKET_IFNAME=\"%s\")",
                    options.ifname.c_str());
  }
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  int nThreads = options.nThreads > 0 ? options.nThreads : static_cast<int>(std::clamp(cores / 4, 1u, 8u));
  int busyPollUs = options.busyPollUs;
  // Polling threads only pay off when they do not compete with the application for cores.
  if (busyPollUs < 0) busyPollUs = cores >= 4u * static_cast<unsigned>(nThreads) ? 100 : 0;
  UF_CHECK(ProgressEngine::acquire(nThreads, busyPollUs, &created->engine_));
  for (size_t i = 0; i < created->interfaces_.size(); ++i) {
    const NetInterface& iface = created->interfaces_[i];
    UF_INFO(kNet, kLogInit, "device %zu: %s %s%s%s, %d stream(s) per connection", i, iface.name.c_str(),
            formatAddress(reinterpret_cast<const sockaddr*>(&iface.address)).c_str(),
            iface.pciPath.empty() ? "" : " at ", iface.pciPath.c_str(), options.nStreams);
  }
  *transport = std::move(created);
  return unifabSuccess;
}

Result SocketTransport::checkDevice(int dev, const char* operation) const {
  if (dev < 0 || dev >= deviceCount()) {
    return UF_ERROR(unifabInvalidArgument, kNet, "%s: dev=%d is outside 0..%d", operation, dev, deviceCount() - 1);
  }
  return unifabSuccess;
}

Result SocketTransport::deviceProperties(int dev, DeviceProperties* props) const {
  UF_CHECK(checkDevice(dev, "getProperties"));
  const NetInterface& iface = interfaces_[dev];
  props->name = iface.name;
  props->pciPath = iface.pciPath;
  props->guid = static_cast<uint64_t>(dev);
  props->ptrSupport = kMemoryHost;
  props->speedMbps = options_.speedMbps > 0 ? options_.speedMbps : iface.speedMbps > 0 ? iface.speedMbps : 10000;
  props->port = 0;
  props->latencyUs = 0;
  props->maxComms = kMaxCommsPerDevice;
  props->maxRecvs = options_.connection.maxRecvs;
  props->maxTransferBytes = kMaxTransferBytes;
  return unifabSuccess;
}

Result SocketTransport::listen(int dev, void* handle, std::unique_ptr<ListenComm>* comm) {
  UF_CHECK(checkDevice(dev, "listen"));
  const NetInterface& iface = interfaces_[dev];
  const auto* address = reinterpret_cast<const sockaddr*>(&iface.address);
  FdGuard fd(::socket(address->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  UF_SYSCHECK(fd.get(), kNet, "socket()");
  sockaddr_storage bound = iface.address;
  // Port 0: the kernel picks a free one, which the handle then carries.
  if (bound.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&bound)->sin_port = 0;
  else reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port = 0;
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&bound), iface.addressLength) != 0) {
    int err = errno;
    return UF_ERROR(unifabSystemError, kNet, "bind to %s (%s) failed: %s", formatAddress(address).c_str(),
                    iface.name.c_str(), strerror(err));
  }
  UF_SYSCHECK(::listen(fd.get(), kListenBacklog), kNet, "listen()");
  socklen_t length = iface.addressLength;
  UF_SYSCHECK(getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &length), kNet, "getsockname()");

  ListenHandle listenHandle{};
  listenHandle.magic = kWireMagic;
  listenHandle.version = kWireVersion;
  listenHandle.addressLength = static_cast<uint16_t>(length);
  listenHandle.listenId = randomId();
  memcpy(&listenHandle.address, &bound, length);
  listenHandle.connectStage = nullptr;
  memset(handle, 0, kHandleBytes);
  memcpy(handle, &listenHandle, sizeof(listenHandle));
  UF_TRACE(kNet, kLogInit, "listening on %s", formatAddress(reinterpret_cast<sockaddr*>(&bound)).c_str());
  *comm = std::make_unique<SocketListenComm>(fd.release(), listenHandle.listenId, engine_, options_);
  return unifabSuccess;
}

Result SocketTransport::connect(int dev, void* handle, std::unique_ptr<SendComm>* comm) {
  comm->reset();
  UF_CHECK(checkDevice(dev, "connect"));
  ListenHandle listenHandle;
  memcpy(&listenHandle, handle, sizeof(listenHandle));
  if (listenHandle.magic != kWireMagic || listenHandle.version != kWireVersion) {
    return UF_ERROR(unifabInvalidUsage, kNet,
                    "connect: the handle is not from a unifab socket listener of wire version %u (magic 0x%x, "
                    "version %u); are both ranks using the same plugin?",
                    static_cast<unsigned>(kWireVersion), listenHandle.magic, static_cast<unsigned>(listenHandle.version));
  }
  const int family = listenHandle.address.sa.sa_family;
  if (!(family == AF_INET && listenHandle.addressLength == sizeof(sockaddr_in)) &&
      !(family == AF_INET6 && listenHandle.addressLength == sizeof(sockaddr_in6))) {
    return UF_ERROR(unifabInvalidUsage, kNet,
                    "connect: the handle's address (family %d, %u bytes) is neither IPv4 (%d, %zu) nor IPv6 (%d, %zu)",
                    family, static_cast<unsigned>(listenHandle.addressLength), AF_INET, sizeof(sockaddr_in), AF_INET6,
                    sizeof(sockaddr_in6));
  }
  // Between calls the handle NCCL passes back names the connector, which the transport keeps (so
  // that one NCCL abandons is freed with the transport, and a handle naming no connector of ours
  // is refused instead of followed); during a call it is owned here, and goes back only while the
  // connection is still in progress.
  std::unique_ptr<Connector> connector;
  if (listenHandle.connectStage != nullptr) {
    std::lock_guard<std::mutex> lock(connectingMutex_);
    auto staged = connecting_.find(listenHandle.connectStage);
    // A stale handle can name the address a newer connector now has: it must be for the same listener.
    if (staged == connecting_.end() || staged->second->listenId() != listenHandle.listenId) {
      return UF_ERROR(unifabInvalidUsage, kNet,
                      "connect: the handle names a connection in progress this context does not have (a copy of "
                      "a handle, or one passed to another context); pass NCCL's handle back unchanged");
    }
    connector = std::move(staged->second);
    connecting_.erase(staged);
  }
  auto storeStage = [handle](Connector* stage) {
    memcpy(static_cast<char*>(handle) + offsetof(ListenHandle, connectStage), &stage, sizeof(stage));
  };
  storeStage(nullptr);
  if (!connector) {
    connector = std::make_unique<Connector>(listenHandle, options_);
    UF_CHECK(connector->begin());
  }
  bool ready = false;
  UF_CHECK(connector->progress(&ready));
  if (!ready) {
    Connector* stage = connector.get();
    {
      std::lock_guard<std::mutex> lock(connectingMutex_);
      connecting_.emplace(stage, std::move(connector));
    }
    storeStage(stage);
    return unifabSuccess;
  }
  std::string peer = connector->target();
  std::vector<int> fds = connector->releaseFds();
  connector.reset();
  auto sendComm = std::make_unique<SocketSendComm>(engine_, std::move(fds), peer, options_.connection);
  UF_CHECK(sendComm->start());
  UF_INFO(kNet, kLogInit, "connected to %s with %d stream(s)", peer.c_str(), sendComm->streamCount());
  *comm = std::move(sendComm);
  return unifabSuccess;
}

SocketTransport::~SocketTransport() = default;  // frees the connections NCCL never finished

}  // namespace unifab::net::socket
