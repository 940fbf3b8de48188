// The version-neutral network transport interface. plugin/ adapts NCCL's ncclNet tables (v11 now,
// v12 later) onto it; net/socket, and later net/ucx and net/verbs, implement it. Nothing here
// knows about NCCL's structs or about MoE.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "plugin/check.h"

namespace unifab::net {

constexpr int kMaxRequestsPerComm = 32;  // NCCL_NET_MAX_REQUESTS: in flight on one comm
constexpr int kMaxGroupedRecvs = 8;      // buffers one grouped receive may carry
constexpr size_t kHandleBytes = 128;     // NCCL_NET_HANDLE_MAXSIZE
// Largest message one request may carry: NCCL's test() reports completed sizes as int, so the
// transports promise (maxP2pBytes) and enforce this bound.
constexpr size_t kMaxTransferBytes = size_t{1} << 30;

enum MemoryTypeBits : int { kMemoryHost = 0x1, kMemoryCuda = 0x2, kMemoryDmaBuf = 0x4 };

struct DeviceProperties {
  std::string name;
  std::string pciPath;  // empty: not a PCI device (loopback, virtual)
  uint64_t guid = 0;
  int ptrSupport = kMemoryHost;
  int speedMbps = 0;
  int port = 0;
  float latencyUs = 0;
  int maxComms = 0;
  int maxRecvs = 1;
  size_t maxTransferBytes = 0;
};

// An in-flight send, receive or flush. It belongs to its comm and dies when test() reports done.
class Request {
 public:
  virtual ~Request() = default;
  // Non-blocking. On done, `sizes` (if not null) receives the byte count of each buffer, and the
  // request must not be used again. A failed peer or transfer yields an error, never a hang.
  virtual Result test(bool* done, int* sizes) = 0;
};

// A memory registration; the socket transport only records the range.
struct MemoryRegion {
  void* base = nullptr;
  size_t size = 0;
  int type = kMemoryHost;
};

class Comm {
 public:
  virtual ~Comm() = default;  // closes the connection; outstanding requests are abandoned
  virtual Result registerMemory(void* data, size_t size, int type, MemoryRegion** region) = 0;
  virtual Result deregisterMemory(MemoryRegion* region) = 0;
};

class SendComm : public Comm {
 public:
  // *request is null when the comm has no room for another request yet (retry later).
  virtual Result isend(const void* data, size_t size, int tag, MemoryRegion* region, Request** request) = 0;
};

class RecvComm : public Comm {
 public:
  // One request completed by `n` messages; with n > 1 each message lands in the buffer whose tag
  // equals the message's tag. Buffers may be larger than the messages.
  virtual Result irecv(int n, void* const* data, const size_t* sizes, const int* tags,
                       MemoryRegion* const* regions, Request** request) = 0;
  // Makes received device data visible to the GPU; *request is null when nothing is needed.
  virtual Result iflush(int n, void* const* data, const int* sizes, MemoryRegion* const* regions,
                        Request** request) = 0;
};

class ListenComm {
 public:
  virtual ~ListenComm() = default;
  // Non-blocking; *comm stays null until a connecting peer has fully arrived.
  virtual Result accept(std::unique_ptr<RecvComm>* comm) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // True when every message passes through host threads of this transport (sockets): each extra
  // connection, and so each extra NCCL channel, then costs host time per message.
  virtual bool hostMovesPayload() const = 0;
  virtual int deviceCount() const = 0;
  virtual Result deviceProperties(int dev, DeviceProperties* props) const = 0;
  // Writes at most kHandleBytes into `handle` for the peer's connect().
  virtual Result listen(int dev, void* handle, std::unique_ptr<ListenComm>* comm) = 0;
  // Non-blocking: *comm stays null until connected; `handle` carries the progress between calls.
  virtual Result connect(int dev, void* handle, std::unique_ptr<SendComm>* comm) = 0;
};

// The process-wide transport selected by UNIFAB_NET_TRANSPORT, created on first use and shared by
// every NCCL communicator; it goes away when the last holder releases it.
Result acquireTransport(std::shared_ptr<Transport>* transport);

// The transport NCCL is using in this process, as the tuner sees it: its fastest port speed
// (Mbit/s) and hostMovesPayload(); 0 and false when no communicator holds one. Never creates a
// transport.
struct LiveTransport {
  int speedMbps = 0;
  bool hostMovesPayload = false;
};
LiveTransport liveTransport();

}  // namespace unifab::net
