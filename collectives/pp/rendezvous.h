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
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

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

// Describes `data` for the other side: its address, and for legacy CUDA IPC its allocation's
// handle, id and offset (mappable = 0 for memory IPC cannot share: stream-ordered pools, virtual
// memory management, ncclMemAlloc).
class BufferExporter {
 public:
  Result describe(const void* data, size_t bytes, Posting* out);

 private:
  std::map<uint64_t, cudaIpcMemHandle_t> handles_;  // by buffer id
};

// The peers' allocations this GPU has mapped, by (peer, buffer id). Closed on destruction, which
// the owner does only after its transfers are complete.
class BufferImporter {
 public:
  ~BufferImporter();
  Result map(int peer, const Posting& p, char** data);
  void closeAll();

 private:
  std::map<std::pair<int, uint64_t>, char*> mapped_;
};

}  // namespace unifab::collectives::pp
