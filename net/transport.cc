#include "net/transport.h"

#include <mutex>

#include "net/socket/socket_transport.h"
#include "plugin/params.h"

namespace unifab::net {
namespace {

std::mutex g_transportMutex;
std::weak_ptr<Transport> g_transport;

Result createSelected(std::shared_ptr<Transport>* transport) {
  const Params& p = params();
  if (p.netTransport == "socket") {
    socket::SocketTransportOptions options;
    options.ifname = p.socketIfname;
    options.family = p.socketFamily;
    options.nStreams = p.socketNStreams;
    options.nThreads = p.socketNThreads;
    options.busyPollUs = p.socketBusyPollUs;
    options.speedMbps = p.socketSpeedMbps;
    options.bufferBytes = p.socketBufferBytes;
    options.timeoutS = p.socketTimeoutS;
    options.connection.maxRecvs = p.socketMaxRecvs;
    options.connection.chunkBytes = static_cast<size_t>(p.socketChunkBytes);
    options.connection.inlineBytes = static_cast<size_t>(p.socketInlineBytes);
    std::unique_ptr<socket::SocketTransport> created;
    UF_CHECK(socket::SocketTransport::create(options, &created));
    *transport = std::move(created);
    return unifabSuccess;
  }
  return UF_ERROR(unifabInvalidUsage, kNet, "UNIFAB_NET_TRANSPORT=%s is not built into this library",
                  p.netTransport.c_str());
}

}  // namespace

Result acquireTransport(std::shared_ptr<Transport>* transport) {
  std::lock_guard<std::mutex> lock(g_transportMutex);
  std::shared_ptr<Transport> existing = g_transport.lock();
  if (!existing) {
    UF_CHECK(createSelected(&existing));
    g_transport = existing;
  }
  *transport = std::move(existing);
  return unifabSuccess;
}

LiveTransport liveTransport() {
  std::shared_ptr<Transport> live;
  {
    std::lock_guard<std::mutex> lock(g_transportMutex);
    live = g_transport.lock();
  }
  LiveTransport described;
  if (!live) return described;
  described.hostMovesPayload = live->hostMovesPayload();
  for (int dev = 0; dev < live->deviceCount(); ++dev) {
    DeviceProperties props;
    if (live->deviceProperties(dev, &props) == unifabSuccess && props.speedMbps > described.speedMbps) {
      described.speedMbps = props.speedMbps;
    }
  }
  return described;
}

}  // namespace unifab::net
