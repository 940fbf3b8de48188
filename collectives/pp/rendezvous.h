// The rendezvous of one pipeline transfer between two processes of a node, and the mapping of
// the application's buffers that lets either side copy straight from the send buffer into the
// receive buffer with its copy engine (a peer copy: no SM).
//
// Whichever of the two calls is posted second moves the data, on its own stream, once the first
// caller's stream has reached the transfer (a flag that stream writes into the second one's
// window); the first caller's stream waits for a flag the second one's stream writes back. Every
// stream memory wait is thus on a flag another process (or another GPU) writes, never one that a
// stream of the same GPU must produce: a wait blocks the hardware queue it sits in, and a stream
// of the same GPU that the driver queued behind it would never run (measured with a per-peer copy
// stream: transfers that hung at random points).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "collectives/pp/fd_channel.h"
#include "collectives/pp/rendezvous_protocol.h"
#include "plugin/check.h"

namespace unifab::collectives::pp {

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "Posting::allocation holds a cudaIpcMemHandle_t");

// The rendezvous entries of every transfer towards this rank ([sender][ring]), in POSIX shared
// memory of this node: the owner creates it, its peers open it by name, and the owner unlinks the
// name once everybody has it open.
class Inbox {
 public:
  static constexpr int kRing = 64;
  static constexpr size_t kNameBytes = 64;

  static Result create(int peers, std::unique_ptr<Inbox>* out);
  static Result open(const char* name, int peers, std::unique_ptr<Inbox>* out);
  ~Inbox();
  Inbox(const Inbox&) = delete;
  Inbox& operator=(const Inbox&) = delete;

  const char* name() const { return name_.c_str(); }
  // The part of an inbox name that identifies the process that made it.
  static std::string processOf(const char* name);
  void unlink();
  RendezvousEntry& entry(int sender, uint64_t sequence);

 private:
  Inbox() = default;
  static size_t bytesFor(int peers);
  std::string name_;
  bool owner_ = false;
  int peers_ = 0;
  void* memory_ = nullptr;
  size_t bytes_ = 0;
};

// The FdChannel name of the group member whose inbox is `inboxName` (unique on the node as it is).
std::string channelNameOf(const char* inboxName);

// Describes `data` for the other side: its address, and how another process maps its allocation:
// legacy CUDA IPC (cudaMalloc), or, where this process's group can pass descriptors
// (`haveChannel`), for virtual memory whose allocation allows POSIX descriptors (cuMemCreate,
// ncclMemAlloc, PyTorch's expandable segments) and that one mapping holds whole, its shareable
// handle. mappable = 0 for the rest (stream-ordered pools, a buffer across two mappings, a handle
// the driver would not export). Called only by a call that may come first (one that finds the
// peer's posting comes second and needs no description). A virtual-memory mapping's attributes are
// queried once per buffer id, which the driver never reuses within a process (as the legacy IPC
// handles kept by buffer id rely on), and its handle is exported once then (and closed) to learn
// that the driver will (a failed export is not remembered). deliver() exports it again and sends
// it only when the call came first, and only the first time for that peer (so a buffer's first
// call that comes first pays two exports): an export of a large allocation costs about a
// millisecond, and a call that may come first but comes second (the usual case for the side that
// starts a little later) must not pay it each time; a descriptor kept open would keep a freed
// allocation alive.
// Thread-safe.
class BufferExporter {
 public:
  Result describe(const void* data, size_t bytes, bool haveChannel, Posting* out);
  Result deliver(const Posting& mine, FdChannel* channel, const std::string& peerChannel, int poster,
                 FdChannel::Deadline deadline);

 private:
  std::mutex mutex_;
  // What describe() needs of a virtual-memory mapping, queried once per buffer id.
  struct VmmMapping {
    bool shareable;  // POSIX descriptors allowed and exported once, not a stream-ordered pool's, a block id
    uint64_t blockId;
    uintptr_t base;
    size_t bytes;
  };
  std::map<uint64_t, cudaIpcMemHandle_t> handles_;   // by buffer id
  std::map<uint64_t, VmmMapping> mappings_;          // by buffer id
  std::set<std::pair<std::string, uint64_t>> sent_;  // (peer channel, memory block id) whose handle went out
  // Handles being exported and sent, outside the lock (a send may wait for room in the peer's
  // queue while this process's other calls go on); a second thread's first call with the same
  // buffer waits for that one instead of sending a second descriptor.
  std::set<std::pair<std::string, uint64_t>> sending_;
  std::condition_variable sendingDone_;
};

// The peers' allocations this GPU has mapped, by (peer, kind, id): legacy IPC handles opened, or
// shared virtual-memory handles (taken from this rank's FdChannel) mapped into address ranges of
// this process with access for this GPU. Like legacy IPC mappings, they keep the peer's memory
// allocated until closeAll, which the owner calls only after its transfers are complete (at the
// group's destruction). Thread-safe.
class BufferImporter {
 public:
  ~BufferImporter();
  Result map(int peer, const Posting& p, FdChannel* channel, FdChannel::Deadline deadline, char** data);
  void closeAll();

 private:
  struct Mapping {
    char* base;
    size_t bytes;  // 0: a legacy IPC mapping; else a reserved, mapped range
  };
  std::mutex mutex_;
  std::map<std::tuple<int, uint32_t, uint64_t>, Mapping> mapped_;
};

}  // namespace unifab::collectives::pp
