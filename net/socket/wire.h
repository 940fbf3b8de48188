// On-the-wire formats of the socket transport. Both ends speak the same wire version (the
// listen handle and every Hello carry kWireVersion, bumped whenever a format below changes);
// all integers are in host order, since NCCL's peers share the handle
// format anyway and mixed-endian clusters are not a target.
//
// A connection is `nStreams` TCP sockets from the sender to the receiver. Protocol:
//  1. each connecting socket first writes a Hello;
//  2. the receiver announces every posted receive (in posting order) with a ClearToSend on
//     stream 0, naming a sequence number, the buffer tags and capacities;
//  3. the sender matches its sends to announced buffers (FIFO; tags pick the buffer in a grouped
//     receive) and writes each message as one or more chunks, each a ChunkHeader followed by
//     `length` payload bytes, spread over the streams. Every chunk names its receive and offset,
//     so streams are independent of each other and a receiver can place data as it arrives.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdint>

#include "net/transport.h"

namespace unifab::net::socket {

constexpr uint32_t kWireMagic = 0x75664e54;  // "ufNT"
constexpr uint16_t kWireVersion = 2;  // 2: ChunkHeader carries chunkBytes
constexpr int kMaxStreams = 16;

// What listen() writes into NCCL's 128-byte handle. The connector keeps its in-progress state in
// the same buffer (NCCL passes the handle back on every connect call), in `connectStage`.
struct ListenHandle {
  uint32_t magic;
  uint16_t version;
  uint16_t addressLength;
  uint64_t listenId;  // random: a stale or foreign handle is refused
  union {
    sockaddr sa;
    sockaddr_in in4;
    sockaddr_in6 in6;
  } address;
  void* connectStage;  // set by the connecting side only
};
static_assert(sizeof(ListenHandle) <= kHandleBytes, "listen handle must fit NCCL's handle");

struct Hello {
  uint32_t magic;
  uint16_t version;
  uint16_t streamIndex;
  uint16_t streamCount;
  uint16_t reserved;
  uint32_t reserved2;
  uint64_t connectionId;  // random per connect(): groups the streams of one connection
  uint64_t listenId;
};
static_assert(sizeof(Hello) == 32, "Hello layout");

struct ClearToSendSlot {
  int32_t tag;
  uint32_t reserved;
  uint64_t capacity;  // bytes the posted buffer can take
};

struct ClearToSend {
  uint64_t sequence;  // receive number on this connection, from 0
  uint32_t count;     // buffers in this (grouped) receive, 1..kMaxGroupedRecvs
  uint32_t reserved;
  ClearToSendSlot slots[kMaxGroupedRecvs];
};
static_assert(sizeof(ClearToSend) == 16 + 16 * kMaxGroupedRecvs, "ClearToSend layout");

enum ChunkFlags : uint32_t {
  kChunkTruncated = 0x1,  // the message was larger than the posted buffer: both sides fail
};

struct ChunkHeader {
  uint64_t sequence;      // the ClearToSend this chunk answers
  uint32_t slot;          // which buffer of that receive
  uint32_t flags;         // ChunkFlags
  uint64_t messageBytes;  // total size of the message this chunk belongs to
  uint64_t offset;        // of this chunk within the message
  uint64_t length;        // payload bytes following this header
  // The sender cuts a message into chunks of chunkBytes at multiples of it, the last one shorter
  // (an empty message: one empty chunk), so the receiver can check that chunks tile the message.
  uint64_t chunkBytes;
};
static_assert(sizeof(ChunkHeader) == 48, "ChunkHeader layout");

}  // namespace unifab::net::socket
