// The TCP socket transport: runs on any host, uses several streams per connection and a shared
// epoll progress engine.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "net/socket/connection.h"
#include "net/socket/interfaces.h"
#include "net/transport.h"

namespace unifab::net::socket {

struct SocketTransportOptions {
  std::string ifname;
  SocketFamily family = SocketFamily::kAny;
  int nStreams = 4;
  int nThreads = 0;     // progress threads; 0: a quarter of the cores, 1..8
  int busyPollUs = -1;  // -1: 100 us where each thread has 4 cores to itself, else 0
  int speedMbps = 0;  // 0: per interface from sysfs, 10000 if unknown
  int64_t bufferBytes = 0;
  int timeoutS = 120;  // unacknowledged seconds before a stream fails (keepalive, TCP_USER_TIMEOUT); 0: kernel's
  ConnectionOptions connection;
};

class Connector;  // a connection in progress (socket_transport.cc)

class SocketTransport final : public Transport {
 public:
  static Result create(const SocketTransportOptions& options, std::unique_ptr<SocketTransport>* transport);
  ~SocketTransport() override;

  const char* name() const override { return "socket"; }
  bool hostMovesPayload() const override { return true; }
  int deviceCount() const override { return static_cast<int>(interfaces_.size()); }
  Result deviceProperties(int dev, DeviceProperties* props) const override;
  Result listen(int dev, void* handle, std::unique_ptr<ListenComm>* comm) override;
  Result connect(int dev, void* handle, std::unique_ptr<SendComm>* comm) override;

 private:
  SocketTransport() = default;
  Result checkDevice(int dev, const char* operation) const;

  SocketTransportOptions options_;
  std::vector<NetInterface> interfaces_;
  std::shared_ptr<ProgressEngine> engine_;
  std::mutex connectingMutex_;
  std::unordered_map<void*, std::unique_ptr<Connector>> connecting_;  // by the handle's connectStage
};

}  // namespace unifab::net::socket
