// ncclNetPlugin_v11: NCCL's network table, adapted onto net::Transport. Only argument plumbing,
// ownership of the opaque handles NCCL keeps, and result conversion live here.
#include <cinttypes>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

#include "net/transport.h"
#include "plugin/boundary.h"
#include "plugin/params.h"
#include "unifab/nccl/net_v11.h"

namespace unifab {
namespace {

// net/ restates these so that it needs no NCCL header; the adapter is where both are visible.
static_assert(net::kHandleBytes == NCCL_NET_HANDLE_MAXSIZE, "listen handle size must match NCCL's");
static_assert(net::kMaxRequestsPerComm == NCCL_NET_MAX_REQUESTS, "requests in flight must match NCCL's");
static_assert(net::kMemoryHost == NCCL_PTR_HOST && net::kMemoryCuda == NCCL_PTR_CUDA && net::kMemoryDmaBuf == NCCL_PTR_DMABUF,
              "pointer-support bits must match NCCL's");

// The handle NCCL keeps per communicator between init and finalize.
struct NetContext {
  std::shared_ptr<net::Transport> transport;  // null with UNIFAB_NET_DISABLE=1
};

// The context's transport; an error when the net is disabled (NCCL was told of no devices).
Result transportOf(void* ctx, const char* operation, net::Transport** transport) {
  *transport = static_cast<NetContext*>(ctx)->transport.get();
  if (*transport == nullptr) {
    return UF_ERROR(unifabInvalidUsage, kNet, "%s: UNIFAB_NET_DISABLE=1, so unifab reported no devices", operation);
  }
  return unifabSuccess;
}

// NCCL keeps the name and PCI path pointers of the properties: the strings live as long as the
// library. Devices never change within one load (parameters are read once).
const char* stableString(const std::string& text) {
  static std::mutex mutex;
  static std::deque<std::string> strings;
  std::lock_guard<std::mutex> lock(mutex);
  for (const std::string& known : strings) {
    if (known == text) return known.c_str();
  }
  strings.push_back(text);
  return strings.back().c_str();
}

// Comms travel through NCCL as void*; they are always converted via the common base.
void* toHandle(std::unique_ptr<net::SendComm> comm) { return static_cast<net::Comm*>(comm.release()); }
void* toHandle(std::unique_ptr<net::RecvComm> comm) { return static_cast<net::Comm*>(comm.release()); }
net::Comm* asComm(void* handle) { return static_cast<net::Comm*>(handle); }
net::SendComm* asSendComm(void* handle) { return static_cast<net::SendComm*>(asComm(handle)); }
net::RecvComm* asRecvComm(void* handle) { return static_cast<net::RecvComm*>(asComm(handle)); }

// NCCL passes memory handles as void*[]; the comm reads at most kMaxGroupedRecvs of them.
struct RegionList {
  explicit RegionList(int n, void** handles) {
    for (int i = 0; handles != nullptr && i < n && i < net::kMaxGroupedRecvs; ++i) {
      regions[i] = static_cast<net::MemoryRegion*>(handles[i]);
    }
  }
  net::MemoryRegion* regions[net::kMaxGroupedRecvs] = {};
};

ncclResult_t netInit(void** ctx, uint64_t commId, ncclNetCommConfig_v11_t* /*config*/, ncclDebugLogger_t logFunction,
                     ncclProfilerCallback_t /*profFunction*/) {
  if (logFunction != nullptr) logSetNcclLogger(reinterpret_cast<NcclLogFunction>(logFunction));
  return toNccl(guarded(LogComponent::kNet, "init", [&] {
    if (ctx == nullptr) return UF_ERROR(unifabInvalidArgument, kNet, "init: ctx=NULL");
    *ctx = nullptr;
    auto context = std::make_unique<NetContext>();
    if (params().netDisable) {
      // No transport, no progress threads: NCCL sees no devices and uses its own transports.
      UF_INFO(kNet, kLogInit, "initialized for comm 0x%" PRIx64 " with UNIFAB_NET_DISABLE=1: no devices reported",
              commId);
      *ctx = context.release();
      return unifabSuccess;
    }
    UF_CHECK(net::acquireTransport(&context->transport));
    UF_INFO(kNet, kLogInit, "initialized for comm 0x%" PRIx64 " over the %s transport", commId,
            context->transport->name());
    *ctx = context.release();
    return unifabSuccess;
  }));
}

ncclResult_t netDevices(int* ndev) {
  return toNccl(guarded(LogComponent::kNet, "devices", [&] {
    if (ndev == nullptr) return UF_ERROR(unifabInvalidArgument, kNet, "devices: ndev=NULL");
    *ndev = 0;
    if (params().netDisable) return unifabSuccess;
    std::shared_ptr<net::Transport> transport;
    UF_CHECK(net::acquireTransport(&transport));  // the one the live contexts share
    *ndev = transport->deviceCount();
    return unifabSuccess;
  }));
}

ncclResult_t netGetProperties(int dev, ncclNetProperties_v11_t* props) {
  return toNccl(guarded(LogComponent::kNet, "getProperties", [&] {
    if (props == nullptr) return UF_ERROR(unifabInvalidArgument, kNet, "getProperties: props=NULL");
    std::shared_ptr<net::Transport> transport;
    UF_CHECK(net::acquireTransport(&transport));
    net::DeviceProperties device;
    UF_CHECK(transport->deviceProperties(dev, &device));
    memset(props, 0, sizeof(*props));
    props->name = const_cast<char*>(stableString(device.name));
    props->pciPath = device.pciPath.empty() ? nullptr : const_cast<char*>(stableString(device.pciPath));
    props->guid = device.guid;
    props->ptrSupport = device.ptrSupport;
    props->regIsGlobal = 0;
    props->forceFlush = 0;
    props->speed = device.speedMbps;
    props->port = device.port;
    props->latency = device.latencyUs;
    props->maxComms = device.maxComms;
    props->maxRecvs = device.maxRecvs;
    props->netDeviceType = NCCL_NET_DEVICE_HOST;
    props->netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION;
    props->vProps.ndevs = 1;
    props->vProps.devs[0] = dev;
    props->maxP2pBytes = device.maxTransferBytes;
    props->maxCollBytes = device.maxTransferBytes;
    props->maxMultiRequestSize = 1;
    return unifabSuccess;
  }));
}

ncclResult_t netListen(void* ctx, int dev, void* handle, void** listenComm) {
  return toNccl(guarded(LogComponent::kNet, "listen", [&] {
    if (ctx == nullptr || handle == nullptr || listenComm == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kNet, "listen: ctx, handle and listenComm must not be NULL");
    }
    *listenComm = nullptr;
    net::Transport* transport = nullptr;
    UF_CHECK(transportOf(ctx, "listen", &transport));
    std::unique_ptr<net::ListenComm> comm;
    UF_CHECK(transport->listen(dev, handle, &comm));
    *listenComm = comm.release();
    return unifabSuccess;
  }));
}

ncclResult_t netConnect(void* ctx, int dev, void* handle, void** sendComm, ncclNetDeviceHandle_v11_t** /*devComm*/) {
  return toNccl(guarded(LogComponent::kNet, "connect", [&] {
    if (ctx == nullptr || handle == nullptr || sendComm == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kNet, "connect: ctx, handle and sendComm must not be NULL");
    }
    *sendComm = nullptr;
    net::Transport* transport = nullptr;
    UF_CHECK(transportOf(ctx, "connect", &transport));
    std::unique_ptr<net::SendComm> comm;
    UF_CHECK(transport->connect(dev, handle, &comm));
    if (comm) *sendComm = toHandle(std::move(comm));
    return unifabSuccess;
  }));
}

ncclResult_t netAccept(void* listenComm, void** recvComm, ncclNetDeviceHandle_v11_t** /*devComm*/) {
  return toNccl(guarded(LogComponent::kNet, "accept", [&] {
    if (listenComm == nullptr || recvComm == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kNet, "accept: listenComm and recvComm must not be NULL");
    }
    *recvComm = nullptr;
    std::unique_ptr<net::RecvComm> comm;
    UF_CHECK(static_cast<net::ListenComm*>(listenComm)->accept(&comm));
    if (comm) *recvComm = toHandle(std::move(comm));
    return unifabSuccess;
  }));
}

ncclResult_t netRegMr(void* comm, void* data, size_t size, int type, void** mhandle) {
  return toNccl(guarded(LogComponent::kNet, "regMr", [&] {
    if (comm == nullptr || mhandle == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kNet, "regMr: comm and mhandle must not be NULL");
    }
    net::MemoryRegion* region = nullptr;
    UF_CHECK(asComm(comm)->registerMemory(data, size, type, &region));
    *mhandle = region;
    return unifabSuccess;
  }));
}

ncclResult_t netRegMrDmaBuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd, void** mhandle) {
  return toNccl(UF_ERROR(unifabInvalidUsage, kNet,
                         "regMrDmaBuf(fd=%d): this transport does not advertise NCCL_PTR_DMABUF", fd));
}

ncclResult_t netDeregMr(void* comm, void* mhandle) {
  return toNccl(guarded(LogComponent::kNet, "deregMr", [&] {
    if (comm == nullptr) return UF_ERROR(unifabInvalidArgument, kNet, "deregMr: comm=NULL");
    return asComm(comm)->deregisterMemory(static_cast<net::MemoryRegion*>(mhandle));
  }));
}

ncclResult_t netIsend(void* sendComm, void* data, size_t size, int tag, void* mhandle, void* /*phandle*/,
                      void** request) {
  return toNccl(guarded(LogComponent::kNet, "isend", [&] {
    if (sendComm == nullptr || request == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kNet, "isend: sendComm and request must not be NULL");
    }
    net::Request* sent = nullptr;
    Result result = asSendComm(sendComm)->isend(data, size, tag, static_cast<net::MemoryRegion*>(mhandle), &sent);
    *request = sent;
    return result;
  }));
}

ncclResult_t netIrecv(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                      void** /*phandles*/, void** request) {
  return toNccl(guarded(LogComponent::kNet, "irecv", [&] {
    if (recvComm == nullptr || request == nullptr || data == nullptr || sizes == nullptr || tags == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kNet, "irecv: recvComm, data, sizes, tags and request must not be NULL");
    }
    // NCCL may have pre-stored NCCL_NET_OPTIONAL_RECV_COMPLETION in *request; a real request or
    // NULL (retry) always replaces it.
    net::Request* received = nullptr;
    RegionList list(n, mhandles);
    Result result = asRecvComm(recvComm)->irecv(n, data, sizes, tags, list.regions, &received);
    *request = received;
    return result;
  }));
}

ncclResult_t netIflush(void* recvComm, int n, void** data, int* sizes, void** mhandles, void** request) {
  return toNccl(guarded(LogComponent::kNet, "iflush", [&] {
    if (recvComm == nullptr || request == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kNet, "iflush: recvComm and request must not be NULL");
    }
    net::Request* flush = nullptr;
    RegionList list(n, mhandles);
    Result result = asRecvComm(recvComm)->iflush(n, data, sizes, list.regions, &flush);
    *request = flush;
    return result;
  }));
}

ncclResult_t netTest(void* request, int* done, int* sizes) {
  return toNccl(guarded(LogComponent::kNet, "test", [&] {
    if (request == nullptr || done == nullptr) {
      return UF_ERROR(unifabInvalidArgument, kNet, "test: request and done must not be NULL");
    }
    bool finished = false;
    Result result = static_cast<net::Request*>(request)->test(&finished, sizes);
    *done = finished ? 1 : 0;
    return result;
  }));
}

// closeSend and closeRecv: both comm kinds are deleted through their common base.
ncclResult_t netCloseComm(void* comm) {
  return toNccl(guarded(LogComponent::kNet, "close", [&] {
    delete asComm(comm);
    return unifabSuccess;
  }));
}

ncclResult_t netCloseListen(void* listenComm) {
  return toNccl(guarded(LogComponent::kNet, "closeListen", [&] {
    delete static_cast<net::ListenComm*>(listenComm);
    return unifabSuccess;
  }));
}

ncclResult_t netFinalize(void* ctx) {
  return toNccl(guarded(LogComponent::kNet, "finalize", [&] {
    delete static_cast<NetContext*>(ctx);
    return unifabSuccess;
  }));
}

ncclResult_t netSetNetAttr(void* ctx, ncclNetAttr_v11_t* attr) {
  // Hints about concurrent peers and flows; the socket transport sizes itself from parameters.
  if (attr != nullptr) {
    UF_TRACE(kNet, kLogNet, "setNetAttr: op %u algo %u proto %u, send peers %d..%d", attr->op, attr->algo,
             attr->proto, attr->sendCommAttr.minConcurrentPeers, attr->sendCommAttr.maxConcurrentPeers);
  }
  return ncclSuccess;
}

}  // namespace
}  // namespace unifab

extern "C" {
extern UNIFAB_API const ncclNet_v11_t ncclNetPlugin_v11;

const ncclNet_v11_t ncclNetPlugin_v11 = {
    "unifab",
    unifab::netInit,
    unifab::netDevices,
    unifab::netGetProperties,
    unifab::netListen,
    unifab::netConnect,
    unifab::netAccept,
    unifab::netRegMr,
    unifab::netRegMrDmaBuf,
    unifab::netDeregMr,
    unifab::netIsend,
    unifab::netIrecv,
    unifab::netIflush,
    unifab::netTest,
    unifab::netCloseComm,
    unifab::netCloseComm,
    unifab::netCloseListen,
    nullptr,  // getDeviceMr: device-offload (UNPACK) plugins only
    nullptr,  // irecvConsumed: device-offload plugins only
    nullptr,  // makeVDevice: NIC fusion is not offered
    unifab::netFinalize,
    unifab::netSetNetAttr,
};
}
