// Device memory of every rank, opened by every other rank through CUDA IPC (handles gathered
// through NCCL): what the benchmarks' plain copy and gather kernels read and write across NVLink.
#pragma once

#include <cstddef>
#include <vector>

#include "tests/common/nccl_session.h"

namespace unifab::bench {

class PeerBuffer {
 public:
  PeerBuffer() = default;
  ~PeerBuffer();
  PeerBuffer(const PeerBuffer&) = delete;
  PeerBuffer& operator=(const PeerBuffer&) = delete;

  // Collective: `bytes` (at least 256, as IPC needs an allocation) on every rank.
  bool open(test::NcclSession& session, size_t bytes);
  char* local() const { return local_; }
  char* peer(int rank) const { return peers_[static_cast<size_t>(rank)]; }  // null for this rank

 private:
  char* local_ = nullptr;
  std::vector<char*> peers_;
};

}  // namespace unifab::bench
