#include "net/socket/connection.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

namespace unifab::net::socket {
namespace {

enum class Io { kDone, kWouldBlock, kEof, kError };

// Reads up to `length` bytes; `*got` is what arrived. kDone means the kernel gave everything asked;
// kWouldBlock that it has nothing more right now. A short read already says so, which saves the
// system call that would only return EAGAIN (epoll reports any data that arrives later).
Io readSome(int fd, void* buffer, size_t length, size_t* got, int* err) {
  *got = 0;
  while (*got < length) {
    ssize_t n = recv(fd, static_cast<char*>(buffer) + *got, length - *got, MSG_DONTWAIT);
    if (n > 0) {
      *got += static_cast<size_t>(n);
      if (*got < length) return Io::kWouldBlock;
      continue;
    }
    if (n == 0) return Io::kEof;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return Io::kWouldBlock;
    *err = errno;
    return Io::kError;
  }
  return Io::kDone;
}

// Writes the two-part message [head, body] from byte `*sent` on; updates `*sent`.
Io writeSome(int fd, const void* head, size_t headLength, const void* body, size_t bodyLength, size_t* sent,
             int* err) {
  size_t total = headLength + bodyLength;
  while (*sent < total) {
    iovec parts[2];
    int count = 0;
    if (*sent < headLength) {
      parts[count].iov_base = const_cast<char*>(static_cast<const char*>(head) + *sent);
      parts[count].iov_len = headLength - *sent;
      ++count;
    }
    size_t bodyOffset = *sent > headLength ? *sent - headLength : 0;
    if (bodyLength > bodyOffset) {
      parts[count].iov_base = const_cast<char*>(static_cast<const char*>(body) + bodyOffset);
      parts[count].iov_len = bodyLength - bodyOffset;
      ++count;
    }
    msghdr message{};
    message.msg_iov = parts;
    message.msg_iovlen = static_cast<size_t>(count);
    ssize_t n = sendmsg(fd, &message, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n >= 0) {
      size_t asked = parts[0].iov_len + (count > 1 ? parts[1].iov_len : 0);
      *sent += static_cast<size_t>(n);
      // A short write means the socket buffer is full: EPOLLOUT says when to go on.
      if (static_cast<size_t>(n) < asked) return Io::kWouldBlock;
      continue;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return Io::kWouldBlock;
    *err = errno;
    return Io::kError;
  }
  return Io::kDone;
}

size_t roundUp(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

}  // namespace

// ---- StreamSet -----------------------------------------------------------------------------

StreamSet::StreamSet(std::shared_ptr<ProgressEngine> engine, std::vector<int> fds, std::string peer)
    : engine_(std::move(engine)), fds_(std::move(fds)), peer_(std::move(peer)) {
  for (size_t i = 0; i < fds_.size(); ++i) {
    auto registration = std::make_unique<StreamRegistration>();
    registration->owner = this;
    registration->stream = static_cast<int>(i);
    registration->fd = fds_[i];
    registrations_.push_back(std::move(registration));
  }
}

StreamSet::~StreamSet() { stopStreams(); }

Result StreamSet::start() {
  for (auto& registration : registrations_) UF_CHECK(engine_->add(registration.get()));
  return unifabSuccess;
}

void StreamSet::stopStreams() {
  for (auto& registration : registrations_) engine_->remove(registration.get());
  for (int& fd : fds_) {
    if (fd >= 0) close(fd);
    fd = -1;
  }
}

void StreamSet::fail(Result code, const std::string& message) {
  std::lock_guard<std::mutex> lock(failureMutex_);
  if (failure_.load(std::memory_order_relaxed) != unifabSuccess) return;
  failureMessage_ = message;
  failure_.store(code, std::memory_order_release);
}

Result StreamSet::failureResult(const char* operation) {
  std::string message;
  {
    std::lock_guard<std::mutex> lock(failureMutex_);
    message = failureMessage_;
  }
  return UF_ERROR(static_cast<Result>(failure_.load(std::memory_order_acquire)), kNet,
                  "%s on the connection with %s: %s", operation, peer_.c_str(), message.c_str());
}

Result registerHostMemory(void* data, size_t size, int type, MemoryRegion** region) {
  if (type != kMemoryHost) {
    return UF_ERROR(unifabInvalidArgument, kNet,
                    "regMr type=%d: the socket transport moves host memory only (NCCL_PTR_HOST=1); "
                    "device buffers are staged by NCCL", type);
  }
  if (data == nullptr && size > 0) {
    return UF_ERROR(unifabInvalidArgument, kNet, "regMr data=NULL with size=%zu", size);
  }
  *region = new MemoryRegion{data, size, type};
  return unifabSuccess;
}

// ---- send side -----------------------------------------------------------------------------

namespace {

// Streams a chunk travels on: a function of the receive and buffer it answers, so the receiver
// knows where to look for a small message without being told.
int streamOf(uint64_t sequence, uint32_t slot, size_t chunk, int streams) {
  return static_cast<int>((sequence + slot + chunk) % static_cast<uint64_t>(streams));
}

}  // namespace

SocketSendComm::SocketSendComm(std::shared_ptr<ProgressEngine> engine, std::vector<int> fds, std::string peer,
                               const ConnectionOptions& options)
    : StreamSet(std::move(engine), std::move(fds), std::move(peer)),
      options_(options),
      // NCCL may have kMaxRequestsPerComm receives of up to maxRecvs buffers in flight.
      requests_(static_cast<size_t>(kMaxRequestsPerComm * options.maxRecvs)),
      streams_(static_cast<size_t>(streamCount())) {
  for (auto& request : requests_) {
    request.comm = this;
    freeRequests_.push_back(&request);
  }
}

SocketSendComm::~SocketSendComm() { stopStreams(); }

Result SocketSendComm::isend(const void* data, size_t size, int tag, MemoryRegion* region, Request** request) {
  *request = nullptr;
  if (failed()) return failureResult("isend");
  if (data == nullptr && size > 0) return UF_ERROR(unifabInvalidArgument, kNet, "isend data=NULL with size=%zu", size);
  if (size > kMaxTransferBytes) {
    return UF_ERROR(unifabInvalidArgument, kNet, "isend size=%zu exceeds the transfer limit %zu (maxP2pBytes)", size,
                    kMaxTransferBytes);
  }
  if (region != nullptr && size > 0 &&
      (static_cast<const char*>(data) < static_cast<const char*>(region->base) ||
       static_cast<const char*>(data) + size > static_cast<const char*>(region->base) + region->size)) {
    return UF_ERROR(unifabInvalidArgument, kNet, "isend range [%p, +%zu) lies outside its registration [%p, +%zu)",
                    data, size, region->base, region->size);
  }
  SendRequest* sendRequest = nullptr;
  uint32_t touched = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (freeRequests_.empty()) return unifabSuccess;  // back-pressure: NCCL retries later
    sendRequest = freeRequests_.back();
    freeRequests_.pop_back();
    sendRequest->data = static_cast<const char*>(data);
    sendRequest->size = size;
    sendRequest->tag = tag;
    sendRequest->error.clear();
    sendRequest->chunksLeft.store(0, std::memory_order_relaxed);
    sendRequest->state.store(SendRequest::kWaiting, std::memory_order_release);
    waiting_.push_back(sendRequest);
    touched = matchLocked();
  }
  *request = sendRequest;
  pumpStreams(touched, options_.inlineBytes);
  // The announcement it waits for may already sit unread in stream 0.
  if (sendRequest->state.load(std::memory_order_acquire) == SendRequest::kWaiting) pumpAnnouncements();
  return unifabSuccess;
}

int SocketSendComm::findSlot(const Announced& announced, int tag) {
  // Tags are compared for a single buffer too (as NCCL's IB transport does): NCCL posts matching
  // tags, and a send of another tag landing in that buffer would be silent corruption.
  const ClearToSend& receive = announced.receive;
  bool tagPosted = false;
  for (uint32_t slot = 0; slot < receive.count; ++slot) {
    if (receive.slots[slot].tag != tag) continue;
    tagPosted = true;
    if ((announced.filled & (1u << slot)) == 0) return static_cast<int>(slot);
  }
  return tagPosted ? -1 : -2;
}

uint32_t SocketSendComm::matchLocked() {
  uint32_t touched = 0;
  while (!waiting_.empty() && !announced_.empty()) {
    Announced& head = announced_.front();
    uint32_t full = (1u << head.receive.count) - 1;
    for (auto it = waiting_.begin(); it != waiting_.end() && head.filled != full;) {
      SendRequest* request = *it;
      int slot = findSlot(head, request->tag);
      if (slot == -1) {
        ++it;
        continue;
      }
      it = waiting_.erase(it);
      if (slot == -2) {
        request->error = "send tag " + std::to_string(request->tag) + " matches none of the " +
                         std::to_string(head.receive.count) + " buffers of the peer's grouped receive";
        request->state.store(SendRequest::kFailed, std::memory_order_release);
        continue;
      }
      head.filled |= 1u << slot;
      touched |= startMessageLocked(request, head.receive, static_cast<uint32_t>(slot));
    }
    if (head.filled != full) break;  // the rest wait for this receive's remaining buffers
    announced_.pop_front();
  }
  return touched;
}

uint32_t SocketSendComm::startMessageLocked(SendRequest* request, const ClearToSend& receive, uint32_t slot) {
  ChunkHeader header{};
  header.sequence = receive.sequence;
  header.slot = slot;
  header.messageBytes = request->size;
  uint64_t capacity = receive.slots[slot].capacity;
  int nStreams = static_cast<int>(streams_.size());
  if (request->size > capacity) {
    // Tell the receiver (its request fails too), then fail locally without further references.
    header.flags = kChunkTruncated;
    int stream = streamOf(receive.sequence, slot, 0, nStreams);
    streams_[stream].queue.push_back(Task{nullptr, header, nullptr, 0});
    request->error = "message of " + std::to_string(request->size) + " bytes exceeds the peer's posted buffer of " +
                     std::to_string(capacity) + " bytes";
    request->state.store(SendRequest::kFailed, std::memory_order_release);
    return 1u << stream;
  }
  // Each stream gets at most one chunk of a message, and no chunk is smaller than chunkBytes.
  size_t chunk = std::max(options_.chunkBytes, roundUp((request->size + streams_.size() - 1) / streams_.size(), 4096));
  size_t chunks = request->size == 0 ? 1 : (request->size + chunk - 1) / chunk;
  request->chunksLeft.store(static_cast<uint32_t>(chunks), std::memory_order_relaxed);
  request->state.store(SendRequest::kSending, std::memory_order_release);
  uint32_t touched = 0;
  for (size_t i = 0; i < chunks; ++i) {
    header.offset = i * chunk;
    header.length = request->size == 0 ? 0 : std::min<uint64_t>(chunk, request->size - header.offset);
    header.chunkBytes = chunk;
    int stream = streamOf(receive.sequence, slot, i, nStreams);
    streams_[stream].queue.push_back(Task{request, header, request->data + header.offset, 0});
    touched |= 1u << stream;
  }
  return touched;
}

void SocketSendComm::pumpStreams(uint32_t streams, size_t limit) {
  for (int stream = 0; streams != 0; ++stream, streams >>= 1) {
    if (streams & 1u) pumpWrites(stream, limit);
  }
}

void SocketSendComm::pumpWrites(int stream, size_t limit) {
  Stream& state = streams_[stream];
  for (;;) {
    std::unique_lock<std::mutex> writer(state.writer, std::try_to_lock);
    if (!writer.owns_lock()) return;  // the holder re-checks the queue before it lets go
    Drain outcome = drainWriter(stream, limit);
    bool wantArm = outcome == Drain::kBlocked || outcome == Drain::kDeferred;
    if (wantArm != state.armed && outcome != Drain::kFailed) {
      state.armed = wantArm;
      armWrite(stream, wantArm);
    }
    writer.unlock();
    if (outcome != Drain::kEmpty) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (state.queue.empty()) return;
  }
}

SocketSendComm::Drain SocketSendComm::drainWriter(int stream, size_t limit) {
  Stream& state = streams_[stream];
  for (;;) {
    if (!state.busy) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (state.queue.empty()) return Drain::kEmpty;
      if (state.queue.front().header.length > limit) return Drain::kDeferred;
      state.current = state.queue.front();
      state.queue.pop_front();
      state.busy = true;
    }
    Task& task = state.current;
    int err = 0;
    Io io = writeSome(fd(stream), &task.header, sizeof(task.header), task.payload, task.header.length, &task.sent, &err);
    if (io == Io::kWouldBlock) return Drain::kBlocked;
    if (io == Io::kError) {
      fail(err == EPIPE || err == ECONNRESET ? unifabRemoteError : unifabSystemError,
           std::string("send on stream ") + std::to_string(stream) + " failed: " + strerror(err));
      detach(stream);
      return Drain::kFailed;
    }
    state.busy = false;
    if (task.request != nullptr && task.request->chunksLeft.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      task.request->state.store(SendRequest::kDone, std::memory_order_release);
    }
  }
}

void SocketSendComm::onWritable(int stream) { pumpWrites(stream, SIZE_MAX); }  // a progress thread: any size

void SocketSendComm::onReadable(int stream) {
  if (stream == 0) {
    pumpAnnouncements();
    return;
  }
  // Only stream 0 carries anything towards the sender; other streams report EOF or errors.
  char probe;
  ssize_t n = recv(fd(stream), &probe, 1, MSG_DONTWAIT | MSG_PEEK);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  fail(unifabRemoteError, n == 0 ? "the receiver closed the connection"
                                 : n > 0 ? "unexpected data from the receiver" : strerror(errno));
  detach(stream);
}

void SocketSendComm::pumpAnnouncements() {
  std::unique_lock<std::mutex> reader(announcementReader_, std::try_to_lock);
  if (!reader.owns_lock()) return;
  uint32_t touched = 0;
  for (;;) {
    size_t got = 0;
    int err = 0;
    Io io = readSome(fd(0), reinterpret_cast<char*>(&incoming_) + incomingBytes_, sizeof(incoming_) - incomingBytes_,
                     &got, &err);
    incomingBytes_ += got;
    if (io == Io::kEof || io == Io::kError) {
      fail(unifabRemoteError, io == Io::kEof ? std::string("the receiver closed the connection")
                                             : std::string("receive on stream 0 failed: ") + strerror(err));
      detach(0);
      break;
    }
    if (incomingBytes_ < sizeof(incoming_)) break;  // kWouldBlock with a partial message
    incomingBytes_ = 0;
    // NCCL posts at most kMaxRequestsPerComm receives at a time; more announced ones than that
    // unanswered would be a receiver out of step (and an unbounded queue here).
    size_t unanswered = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      unanswered = announced_.size();
    }
    if (incoming_.count < 1 || incoming_.count > static_cast<uint32_t>(options_.maxRecvs) ||
        incoming_.sequence != expectedSequence_ || unanswered >= static_cast<size_t>(kMaxRequestsPerComm)) {
      fail(unifabRemoteError, "protocol error: announcement #" + std::to_string(incoming_.sequence) + " with " +
                                  std::to_string(incoming_.count) + " buffers, expected #" +
                                  std::to_string(expectedSequence_) + " with at most " +
                                  std::to_string(options_.maxRecvs) + " and " + std::to_string(unanswered) +
                                  " unanswered");
      detach(0);
      break;
    }
    ++expectedSequence_;
    std::lock_guard<std::mutex> lock(mutex_);
    announced_.push_back(Announced{incoming_, 0});
    touched |= matchLocked();
  }
  reader.unlock();
  pumpStreams(touched, options_.inlineBytes);
}

void SocketSendComm::releaseRequest(SendRequest* request) {
  request->state.store(SendRequest::kFree, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mutex_);
  freeRequests_.push_back(request);
}

Result SendRequest::test(bool* done, int* sizes) {
  *done = false;
  int current = state.load(std::memory_order_acquire);
  if (current == kWaiting) {
    comm->pumpAnnouncements();
    current = state.load(std::memory_order_acquire);
  }
  if (current == kDone) {
    *done = true;
    if (sizes != nullptr) sizes[0] = static_cast<int>(size);
    comm->releaseRequest(this);
    return unifabSuccess;
  }
  if (current == kFailed) {
    // Kept out of the pool: NCCL aborts the communicator after an error.
    return UF_ERROR(unifabInvalidUsage, kNet, "isend to %s failed: %s", comm->peer().c_str(), error.c_str());
  }
  if (current == kFree) return UF_ERROR(unifabInternalError, kNet, "test on a completed send request");
  if (comm->failed()) {
    // The request may have completed just before the connection failed (the peer finished and
    // closed): the failure is published after the completion, so a second look is conclusive.
    if (state.load(std::memory_order_acquire) == kDone) return test(done, sizes);
    return comm->failureResult("isend");
  }
  return unifabSuccess;
}

// ---- receive side --------------------------------------------------------------------------

SocketRecvComm::SocketRecvComm(std::shared_ptr<ProgressEngine> engine, std::vector<int> fds, std::string peer,
                               const ConnectionOptions& options)
    : StreamSet(std::move(engine), std::move(fds), std::move(peer)),
      options_(options),
      requests_(kMaxRequestsPerComm),
      streams_(static_cast<size_t>(streamCount())) {
  for (auto& request : requests_) request.comm = this;
}

SocketRecvComm::~SocketRecvComm() { stopStreams(); }

Result SocketRecvComm::irecv(int n, void* const* data, const size_t* sizes, const int* tags,
                             MemoryRegion* const* regions, Request** request) {
  *request = nullptr;
  if (failed()) return failureResult("irecv");
  if (n < 1 || n > options_.maxRecvs) {
    return UF_ERROR(unifabInvalidArgument, kNet, "irecv n=%d is outside 1..maxRecvs=%d", n, options_.maxRecvs);
  }
  for (int i = 0; i < n; ++i) {
    if (data[i] == nullptr && sizes[i] > 0) {
      return UF_ERROR(unifabInvalidArgument, kNet, "irecv data[%d]=NULL with sizes[%d]=%zu", i, i, sizes[i]);
    }
    if (sizes[i] > kMaxTransferBytes) {
      return UF_ERROR(unifabInvalidArgument, kNet, "irecv sizes[%d]=%zu exceeds the transfer limit %zu (maxP2pBytes)",
                      i, sizes[i], kMaxTransferBytes);
    }
  }
  uint64_t sequence = nextSequence_;
  RecvRequest& slot = requests_[sequence % kMaxRequestsPerComm];
  if (slot.state.load(std::memory_order_acquire) != RecvRequest::kFree) return unifabSuccess;  // back-pressure

  ClearToSend announcement{};
  announcement.sequence = sequence;
  announcement.count = static_cast<uint32_t>(n);
  slot.count = n;
  slot.totalCapacity = 0;
  slot.error.clear();
  slot.errorClaimed.store(false, std::memory_order_relaxed);
  slot.slotsDone.store(0, std::memory_order_relaxed);
  for (int i = 0; i < n; ++i) {
    slot.buffers[i] = static_cast<char*>(data[i]);
    slot.capacity[i] = sizes[i];
    slot.totalCapacity += sizes[i];
    slot.received[i].store(0, std::memory_order_relaxed);
    slot.messageBytes[i].store(RecvRequest::kUnsetBytes, std::memory_order_relaxed);
    slot.chunkBytes[i].store(0, std::memory_order_relaxed);
    slot.chunksSeen[i].store(0, std::memory_order_relaxed);
    announcement.slots[i].tag = tags[i];
    announcement.slots[i].capacity = sizes[i];
  }
  slot.state.store(RecvRequest::kPosted, std::memory_order_relaxed);
  // Readers accept chunks for this slot only once they see its sequence.
  slot.sequence.store(sequence, std::memory_order_release);
  ++nextSequence_;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    announcements_.push_back(announcement);
  }
  *request = &slot;
  // Polling progress threads send the announcement at no cost to NCCL's proxy thread; sleeping
  // ones would first have to be woken, which costs more than writing it here.
  if (progressThreadsPoll()) {
    requestWrite(0);
  } else {
    pumpAnnouncements();
  }
  return unifabSuccess;
}

Result SocketRecvComm::iflush(int n, void* const* data, const int* sizes, MemoryRegion* const* regions,
                              Request** request) {
  // Data lands in host memory through recv(); it is visible once the request completed.
  *request = nullptr;
  if (n < 1 || n > options_.maxRecvs) {
    return UF_ERROR(unifabInvalidArgument, kNet, "iflush n=%d is outside 1..maxRecvs=%d", n, options_.maxRecvs);
  }
  return unifabSuccess;
}

void SocketRecvComm::pumpAnnouncements() {
  for (;;) {
    std::unique_lock<std::mutex> writer(announcementWriter_, std::try_to_lock);
    if (!writer.owns_lock()) return;  // the holder re-checks the queue before it lets go
    bool drained = false;
    bool blocked = false;
    for (;;) {
      if (outgoingCount_ == 0) {
        std::lock_guard<std::mutex> lock(mutex_);
        while (outgoingCount_ < kAnnouncementBatch && !announcements_.empty()) {
          outgoing_[outgoingCount_++] = announcements_.front();
          announcements_.pop_front();
        }
        outgoingSent_ = 0;
        if (outgoingCount_ == 0) {
          drained = true;
          break;
        }
      }
      int err = 0;
      Io io = writeSome(fd(0), outgoing_, outgoingCount_ * sizeof(ClearToSend), nullptr, 0, &outgoingSent_, &err);
      if (io == Io::kWouldBlock) {
        blocked = true;
        break;
      }
      if (io == Io::kError) {
        fail(err == EPIPE || err == ECONNRESET ? unifabRemoteError : unifabSystemError,
             std::string("announcing a receive failed: ") + strerror(err));
        detach(0);
        return;
      }
      outgoingCount_ = 0;
    }
    if (blocked != announcementArmed_) {
      announcementArmed_ = blocked;
      armWrite(0, blocked);
    }
    writer.unlock();
    if (!drained) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (announcements_.empty()) return;
  }
}

void SocketRecvComm::onWritable(int stream) {
  if (stream == 0) pumpAnnouncements();
}

bool SocketRecvComm::beginChunk(Stream& stream) {
  const ChunkHeader& header = stream.header;
  RecvRequest& request = requests_[header.sequence % kMaxRequestsPerComm];
  const int state = request.state.load(std::memory_order_relaxed);
  // A receive whose other buffer was too small has failed, but the chunks of its other buffers
  // were sent in good faith and are taken (within bounds) rather than failing the connection.
  bool known = request.sequence.load(std::memory_order_acquire) == header.sequence &&
               (state == RecvRequest::kPosted || state == RecvRequest::kFailed);
  if (!known || header.slot >= static_cast<uint32_t>(request.count)) {
    fail(unifabRemoteError, "protocol error: chunk for receive #" + std::to_string(header.sequence) + " buffer " +
                                std::to_string(header.slot) + ", which is not posted");
    return false;
  }
  const uint32_t slot = header.slot;
  const uint64_t capacity = request.capacity[slot];
  if (header.flags & kChunkTruncated) {
    // Several buffers of one receive can be too small, their notices read by different threads.
    if (!request.errorClaimed.exchange(true, std::memory_order_acq_rel)) {
      request.error = "the peer's message of " + std::to_string(header.messageBytes) + " bytes is larger than buffer " +
                      std::to_string(slot) + " (" + std::to_string(capacity) + " bytes)";
      request.state.store(RecvRequest::kFailed, std::memory_order_release);
    }
    return true;
  }
  const uint64_t total = header.messageBytes;
  if (total > capacity) {
    fail(unifabRemoteError, "protocol error: a message of " + std::to_string(total) + " bytes for a buffer of " +
                                std::to_string(capacity) + " bytes, not marked truncated");
    return false;
  }
  // Chunks must tile the message exactly as the sender cuts it (wire.h): then no chunk writes
  // outside it, none repeats or overlaps another, and the byte count completes the buffer only
  // when every byte has arrived.
  uint64_t index = 0;
  bool tiles = false;
  if (total == 0) {
    tiles = header.offset == 0 && header.length == 0;
  } else if (header.chunkBytes > 0 && header.offset < total && header.offset % header.chunkBytes == 0) {
    index = header.offset / header.chunkBytes;
    tiles = header.length == std::min(header.chunkBytes, total - header.offset) && index < 64;
  }
  uint64_t firstTotal = RecvRequest::kUnsetBytes;
  uint64_t firstChunkBytes = 0;
  const uint64_t bit = uint64_t{1} << index;
  std::string problem;
  if (!tiles) {
    problem = "chunk [" + std::to_string(header.offset) + ", +" + std::to_string(header.length) + ") in pieces of " +
              std::to_string(header.chunkBytes) + " does not cut a message of " + std::to_string(total) + " bytes";
  } else if (!request.messageBytes[slot].compare_exchange_strong(firstTotal, total, std::memory_order_acq_rel) &&
             firstTotal != total) {
    problem = "chunks of one message name " + std::to_string(firstTotal) + " and " + std::to_string(total) + " bytes";
  } else if (total > 0 &&
             !request.chunkBytes[slot].compare_exchange_strong(firstChunkBytes, header.chunkBytes,
                                                                std::memory_order_acq_rel) &&
             firstChunkBytes != header.chunkBytes) {
    problem = "chunks of one message are cut in pieces of " + std::to_string(firstChunkBytes) + " and " +
              std::to_string(header.chunkBytes) + " bytes";
  } else if (request.chunksSeen[slot].fetch_or(bit, std::memory_order_acq_rel) & bit) {
    problem = "the chunk at offset " + std::to_string(header.offset) + " arrived twice";
  }
  if (!problem.empty()) {
    fail(unifabRemoteError, "protocol error in receive #" + std::to_string(header.sequence) + " buffer " +
                                std::to_string(slot) + ": " + problem);
    return false;
  }
  if (header.length == 0) {
    finishChunk(&request, slot, 0);
    return true;
  }
  stream.inPayload = true;
  stream.target = &request;
  stream.destination = request.buffers[slot] + header.offset;
  stream.remaining = header.length;
  return true;
}

void SocketRecvComm::finishChunk(RecvRequest* request, uint32_t slot, uint64_t length) {
  uint64_t total = request->received[slot].fetch_add(length, std::memory_order_acq_rel) + length;
  if (total != request->messageBytes[slot].load(std::memory_order_relaxed)) return;
  if (request->slotsDone.fetch_add(1, std::memory_order_acq_rel) + 1 == request->count) {
    // Not over a failure another buffer of this receive reported.
    int posted = RecvRequest::kPosted;
    request->state.compare_exchange_strong(posted, RecvRequest::kDone, std::memory_order_acq_rel);
  }
}

void SocketRecvComm::onReadable(int stream) { pumpReads(stream, SIZE_MAX); }  // a progress thread: any size

bool SocketRecvComm::consumeStaged(Stream& stream) {
  char* staging = stream.staging.get();
  while (stream.stagedBegin < stream.stagedEnd) {
    size_t staged = stream.stagedEnd - stream.stagedBegin;
    if (!stream.inPayload) {
      if (staged < sizeof(ChunkHeader)) break;  // a partial header waits for the rest
      memcpy(&stream.header, staging + stream.stagedBegin, sizeof(ChunkHeader));
      stream.stagedBegin += sizeof(ChunkHeader);
      if (!beginChunk(stream)) return false;
      continue;
    }
    size_t take = static_cast<size_t>(std::min<uint64_t>(stream.remaining, staged));
    memcpy(stream.destination, staging + stream.stagedBegin, take);
    stream.destination += take;
    stream.remaining -= take;
    stream.stagedBegin += take;
    if (stream.remaining == 0) {
      stream.inPayload = false;
      finishChunk(stream.target, stream.header.slot, stream.header.length);
    }
  }
  // Keep a partial header at the front so the next read completes it.
  size_t left = stream.stagedEnd - stream.stagedBegin;
  if (left > 0 && stream.stagedBegin > 0) memmove(staging, staging + stream.stagedBegin, left);
  stream.stagedBegin = 0;
  stream.stagedEnd = left;
  return true;
}

void SocketRecvComm::pumpReads(int index, size_t limit) {
  Stream& stream = streams_[index];
  std::unique_lock<std::mutex> reader(stream.reader, std::try_to_lock);
  if (!reader.owns_lock() || stream.eof) return;
  for (;;) {
    if (!consumeStaged(stream)) {
      detach(index);
      return;
    }
    size_t got = 0;
    int err = 0;
    Io io;
    if (stream.inPayload && stream.remaining > kStagingBytes) {
      // A large payload is left to the progress thread; epoll keeps reporting the data.
      if (stream.header.length > limit) return;
      io = readSome(fd(index), stream.destination, stream.remaining, &got, &err);
      stream.destination += got;
      stream.remaining -= got;
      if (stream.remaining == 0) {
        stream.inPayload = false;
        finishChunk(stream.target, stream.header.slot, stream.header.length);
      }
    } else {
      io = readSome(fd(index), stream.staging.get() + stream.stagedEnd, kStagingBytes - stream.stagedEnd, &got, &err);
      stream.stagedEnd += got;
    }
    if (io == Io::kDone) continue;
    // Whatever arrived before the socket ran dry, ended or failed is placed first.
    if (!consumeStaged(stream)) {
      detach(index);
      return;
    }
    if (io == Io::kWouldBlock) return;
    if (io == Io::kEof) {
      onEndOfStream(index);
      return;
    }
    fail(err == ECONNRESET ? unifabRemoteError : unifabSystemError,
         std::string("receive on stream ") + std::to_string(index) + " failed: " + strerror(err));
    detach(index);
    return;
  }
}

void SocketRecvComm::onEndOfStream(int index) {
  Stream& stream = streams_[index];
  stream.eof = true;
  detach(index);
  if (stream.inPayload || stream.stagedEnd != stream.stagedBegin) {
    fail(unifabRemoteError, "the sender closed the connection in the middle of a message");
    return;
  }
  // Data may still be queued on other streams: only when every stream ended can no posted
  // receive complete any more.
  if (streamsAtEof_.fetch_add(1, std::memory_order_acq_rel) + 1 == streamCount()) {
    fail(unifabRemoteError, "the sender closed the connection");
  }
}

Result RecvRequest::test(bool* done, int* sizes) {
  *done = false;
  int current = state.load(std::memory_order_acquire);
  if (current == kPosted && totalCapacity <= comm->options_.inlineBytes && !comm->failed()) {
    // Small messages arrive in one chunk on a known stream: read it here rather than wait for a
    // progress thread to wake up.
    uint64_t seq = sequence.load(std::memory_order_relaxed);
    for (int slot = 0; slot < count; ++slot) {
      comm->pumpReads(streamOf(seq, static_cast<uint32_t>(slot), 0, comm->streamCount()), comm->options_.inlineBytes);
    }
    current = state.load(std::memory_order_acquire);
  }
  if (current == kDone) {
    *done = true;
    if (sizes != nullptr) {
      for (int i = 0; i < count; ++i) sizes[i] = static_cast<int>(messageBytes[i].load(std::memory_order_relaxed));
    }
    sequence.store(~0ULL, std::memory_order_relaxed);
    state.store(kFree, std::memory_order_release);
    return unifabSuccess;
  }
  if (current == kFailed) {
    return UF_ERROR(unifabInvalidUsage, kNet, "irecv from %s failed: %s", comm->peer().c_str(), error.c_str());
  }
  if (current == kFree) return UF_ERROR(unifabInternalError, kNet, "test on a completed receive request");
  if (comm->failed()) {
    // The last chunk and the sender's close can be processed between the two looks above; the
    // failure is published after the completion, so a second look is conclusive.
    if (state.load(std::memory_order_acquire) == kDone) return test(done, sizes);
    return comm->failureResult("irecv");
  }
  return unifabSuccess;
}

}  // namespace unifab::net::socket
