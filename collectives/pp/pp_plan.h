// The bookkeeping of pipeline send/recv, apart from CUDA so that it can be tested anywhere: a
// transfer is cut into chunks of at most the slot size; the n-th chunk (1-based) between two ranks
// in one direction goes through receive slot (n - 1) % slots and is announced by writing n; the
// sender may reuse a slot for chunk n once the receiver has written n - slots back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace unifab::collectives::pp {

struct Chunk {
  size_t offset;      // into the caller's buffer
  size_t bytes;
  uint64_t sequence;  // 1-based, per (peer, direction)
  int slot;
  uint64_t reuseAfter;  // the receiver must have released this sequence before the slot is written; 0: none
};

// A call posts about five stream commands per chunk on the caller's stream, and the driver's
// command queue of a stream is finite: once it is full, the posting call blocks the host until
// the GPU drains it. A send that fills it before its peer's receive is posted, while the peer's
// host is likewise blocked in its own send, never returns (measured: a 64 MiB transfer in 64 KiB
// chunks, 1025 of them, stopped both ranks). Calls are therefore held to a number of chunks that
// was measured to post without blocking (1 GiB in 8 MiB chunks).
constexpr size_t kMaxChunksPerCall = 128;

// Written so that it cannot wrap: (bytes + slotBytes - 1) / slotBytes is 0 for bytes near SIZE_MAX,
// which would pass the per-call bound.
inline size_t chunkCount(size_t bytes, size_t slotBytes) { return bytes / slotBytes + (bytes % slotBytes != 0); }

// Chunks of a `bytes`-byte transfer that follows `sent` earlier chunks in the same direction.
inline std::vector<Chunk> planChunks(size_t bytes, size_t slotBytes, int slots, uint64_t sent) {
  std::vector<Chunk> chunks;
  for (size_t offset = 0; offset < bytes; offset += chunks.back().bytes) {  // no wrap near SIZE_MAX
    Chunk c;
    c.offset = offset;
    c.bytes = bytes - offset < slotBytes ? bytes - offset : slotBytes;
    c.sequence = sent + chunks.size() + 1;
    c.slot = static_cast<int>((c.sequence - 1) % static_cast<uint64_t>(slots));
    c.reuseAfter = c.sequence > static_cast<uint64_t>(slots) ? c.sequence - static_cast<uint64_t>(slots) : 0;
    chunks.push_back(c);
  }
  return chunks;
}

}  // namespace unifab::collectives::pp
