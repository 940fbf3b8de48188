// File descriptors between the processes of a node: a datagram socket of this process in the
// abstract Unix namespace, to which a peer sends a descriptor with a 64-bit key (SCM_RIGHTS), and
// from which this process takes the descriptor of a key when it needs it (the kernel keeps the
// datagrams queued until then, so no thread serves the socket). The pipeline's rendezvous engine
// passes the shareable handles of virtual-memory (cuMem) buffers this way: CUDA exports them as
// descriptors that mean nothing in another process until the kernel duplicates them there.
// Abstract sockets belong to a network namespace: processes in different ones cannot reach each
// other's, which the group's setup finds out with a probe (send with fd = -1).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "plugin/check.h"

namespace unifab::collectives::pp {

class FdChannel {
 public:
  using Deadline = std::chrono::steady_clock::time_point;
  static constexpr size_t kMaxName = 100;  // of sockaddr_un's 108 bytes, after the leading NUL

  // Binds this process's socket to `name` (abstract: nothing appears in the file system).
  static Result create(const std::string& name, std::unique_ptr<FdChannel>* out);
  ~FdChannel();
  FdChannel(const FdChannel&) = delete;
  FdChannel& operator=(const FdChannel&) = delete;

  // Sends a duplicate of `fd` (none for fd = -1: a probe, dropped by the receiver) with `key` to
  // the channel named `peer`, retrying while its queue is full until `deadline`; the caller keeps
  // `fd`.
  Result send(const std::string& peer, uint64_t key, int fd, Deadline deadline);
  // The descriptor sent with `key` (the caller owns it from then on), waiting for it until
  // `deadline`; descriptors of other keys that arrive meanwhile are kept for their own takers, and
  // anything else that arrives (probes, malformed datagrams) is dropped, its descriptors closed.
  Result take(uint64_t key, Deadline deadline, int* fd);

  const std::string& name() const { return name_; }

 private:
  FdChannel() = default;
  // Receives one datagram if one is queued: true with a kept descriptor, false if none was queued.
  Result receiveOne(bool* received);
  int socket_ = -1;
  std::string name_;
  std::map<uint64_t, int> waiting_;  // received, not taken yet
};

}  // namespace unifab::collectives::pp
