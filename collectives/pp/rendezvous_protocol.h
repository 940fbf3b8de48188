// How the two calls of one pipeline transfer meet, apart from CUDA so that it can be tested
// anywhere: each side posts its buffer in a shared entry and learns whether it came first (the
// other side will move the data) or second (it moves the data itself, reading the first posting).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace unifab::collectives::pp {

constexpr size_t kIpcHandleBytes = 64;

// How another process maps a posted buffer's allocation.
enum PostingKind : uint32_t {
  kNotMappable = 0,  // it cannot: the other side moves the data
  kLegacyIpc = 1,    // `allocation` holds its cudaIpcMemHandle_t
  kSharedHandle = 2  // virtual memory (cuMem): its handle came as a descriptor over the FdChannel,
                     // keyed by handleKey(poster, bufferId = the physical allocation's memory block
                     // id); map `mappingBytes` of it
};

// One side's buffer of a transfer, as the other side needs it.
struct Posting {
  uint64_t bytes;
  uint64_t address;    // as the posting process addresses it (used by threads of that process)
  uint64_t bufferId;   // its allocation (CU_POINTER_ATTRIBUTE_BUFFER_ID; MEMORY_BLOCK_ID for kSharedHandle)
  uint64_t offset;     // into that allocation
  uint32_t mappable;   // 1: another process can map it (kind != kNotMappable)
  uint32_t kind;       // PostingKind
  uint64_t mappingBytes;
  unsigned char allocation[kIpcHandleBytes];  // a cudaIpcMemHandle_t
};

// The FdChannel key of buffer `bufferId` of the group member `poster` (its index among the ranks
// of the node): buffer ids are unique only within a process.
inline uint64_t handleKey(int poster, uint64_t bufferId) {
  return (static_cast<uint64_t>(poster) << 48) ^ (bufferId & ((uint64_t{1} << 48) - 1));
}

constexpr int kSendSide = 0, kRecvSide = 1;

// One transfer's meeting point in shared memory. `state` = sequence * 4 + the sides that have
// posted it (bit 1 << side); the postings are written before the side's bit (release).
struct RendezvousEntry {
  std::atomic<uint64_t> state;
  Posting side[2];
};

enum class Arrival {
  kFirst,   // posted first: the other side will move the data
  kSecond,  // posted second: this side moves the data, described by the other's posting
  kBusy     // the entry still holds transfer sequence - ring, not posted by both yet: retry later
};

// Posts `mine` as `side` of transfer `sequence` (1-based) in `entry`, which serves every `ring`-th
// transfer of this sender and receiver; when second, copies the first side's posting to *theirs
// before marking the transfer met (from then on the first side may reuse the entry). A side whose
// buffer the other cannot reach (mayBeFirst = false) never claims the entry: it stays kBusy until
// the other side has posted, and then comes second. Safe between processes: the entry lives in
// shared memory and std::atomic<uint64_t> is lock-free.
inline Arrival arrive(RendezvousEntry& entry, uint64_t sequence, uint64_t ring, int side, const Posting& mine,
                      Posting* theirs, bool mayBeFirst = true) {
  const uint64_t mineBit = uint64_t{1} << side, theirBit = uint64_t{1} << (1 - side);
  const uint64_t free = sequence > ring ? (sequence - ring) * 4 + 3 : 0;
  uint64_t state = entry.state.load(std::memory_order_acquire);
  if (state == free && mayBeFirst) {
    // Only this side writes its own posting; the other side reads it after the bit below.
    entry.side[side] = mine;
    if (entry.state.compare_exchange_strong(state, sequence * 4 + mineBit, std::memory_order_acq_rel,
                                            std::memory_order_acquire)) {
      return Arrival::kFirst;
    }
    // The other side claimed the entry for this transfer in between: `state` holds its claim.
  }
  if (state == sequence * 4 + theirBit) {
    *theirs = entry.side[1 - side];
    entry.state.store(sequence * 4 + 3, std::memory_order_release);
    return Arrival::kSecond;
  }
  return Arrival::kBusy;
}

// Whether `side` alone has posted transfer `sequence` in `entry`: then the other side will come
// second, whatever it does meanwhile (a posting is never withdrawn).
inline bool postedAlone(const RendezvousEntry& entry, uint64_t sequence, int side) {
  return entry.state.load(std::memory_order_acquire) == sequence * 4 + (uint64_t{1} << side);
}

static_assert(std::atomic<uint64_t>::is_always_lock_free, "the rendezvous state is shared between processes");

}  // namespace unifab::collectives::pp
