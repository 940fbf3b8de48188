// What lets a sender write straight into a receive buffer the application allocated on another
// GPU: the receiver tells the sender, host to host, where the buffer is (a shared-memory inbox of
// descriptors per sender), and the sender maps that allocation once (legacy CUDA IPC, cached by
// the allocation's buffer id). A copy issued by the sending GPU into the mapping runs on its copy
// engines; a copy between two buffers of one GPU would run on SMs, which is why pipeline
// send/recv avoids the bounce through its own window whenever the receive buffer can be mapped.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "plugin/check.h"

namespace unifab::collectives::pp {

// One receive as the receiver posted it, read by the sender's host. Written in place in shared
// memory: the payload first, then `sequence` with release order.
struct RecvDescriptor {
  std::atomic<uint64_t> sequence;  // the transfer (1-based, per sender and receiver) described
  uint32_t direct;                 // 1: write into the buffer below; 0: through the receive slots
  uint32_t reserved;
  uint64_t bytes;
  uint64_t bufferId;               // the receiver's allocation (CU_POINTER_ATTRIBUTE_BUFFER_ID)
  uint64_t offset;                 // of the receive buffer in that allocation
  uint64_t address;                // the receive buffer as the receiver addresses it (a send to oneself)
  cudaIpcMemHandle_t allocation;
};

// The descriptors a rank's LSA peers post for it, as a ring per peer, plus how far this rank has
// taken each ring (so that a peer never overwrites an entry not yet taken). POSIX shared memory
// of this node: the owner creates it, peers open it by name, and the owner unlinks the name once
// everybody has it open.
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
  RecvDescriptor& entry(int peer, uint64_t sequence);
  std::atomic<uint64_t>& taken(int peer);

 private:
  Inbox() = default;
  static size_t bytesFor(int peers);
  std::string name_;
  bool owner_ = false;
  int peers_ = 0;
  void* memory_ = nullptr;
  size_t bytes_ = 0;
};

// Where `data` lies for legacy CUDA IPC: its allocation's handle, id and offset. *mappable is
// false for memory that IPC cannot share (stream-ordered pools, virtual memory management,
// ncclMemAlloc); the caller then bounces through its window.
class BufferExporter {
 public:
  Result describe(const void* data, RecvDescriptor* out, bool* mappable);

 private:
  std::map<uint64_t, cudaIpcMemHandle_t> handles_;  // by buffer id
};

// The peers' allocations this GPU has mapped, by (peer, buffer id). Closed on destruction, which
// the owner does only after its transfers are complete.
class BufferImporter {
 public:
  ~BufferImporter();
  Result map(int peer, const RecvDescriptor& d, char** base);
  size_t size() const { return mapped_.size(); }
  void closeAll();

 private:
  std::map<std::pair<int, uint64_t>, char*> mapped_;
};

}  // namespace unifab::collectives::pp
