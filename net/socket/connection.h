// Send and receive sides of one socket-transport connection (see wire.h for the protocol).
//
// Who does the socket I/O: every stream has a reader role and a writer role, each a mutex taken
// with try_lock. The progress threads take them when epoll reports the socket ready; the thread
// that posts or tests a request (NCCL's proxy thread) takes them too, for headers and payloads
// up to `inlineBytes`, so small messages cross without waking another thread. A writer that
// leaves work behind arms EPOLLOUT; one that drained its queue re-checks it after letting go, so
// work queued by a thread that lost the try_lock race is never stranded. Reads need no such care:
// epoll reports readable data until someone consumes it.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "net/socket/progress.h"
#include "net/socket/wire.h"
#include "net/transport.h"

namespace unifab::net::socket {

struct ConnectionOptions {
  int maxRecvs = kMaxGroupedRecvs;  // grouped receive limit announced to NCCL
  size_t chunkBytes = 128 * 1024;   // smallest striping unit
  size_t inlineBytes = 64 * 1024;   // largest payload the posting/testing thread moves itself
};

// What both sides share: the streams, their registration with the progress engine, and the
// connection's failure state. A failure is sticky: every pending and later request reports it.
class StreamSet : public StreamOwner {
 public:
  StreamSet(std::shared_ptr<ProgressEngine> engine, std::vector<int> fds, std::string peer);
  virtual ~StreamSet();
  StreamSet(const StreamSet&) = delete;
  StreamSet& operator=(const StreamSet&) = delete;

  Result start();  // registers every stream with the progress engine
  void onEngineFailure(const char* why) override { fail(unifabSystemError, std::string("socket progress thread: ") + why); }
  int streamCount() const { return static_cast<int>(fds_.size()); }
  const std::string& peer() const { return peer_; }
  bool failed() const { return failure_.load(std::memory_order_acquire) != unifabSuccess; }
  // Reports the connection's failure as a fresh error of the caller's operation.
  Result failureResult(const char* operation);

 protected:
  // Records the first failure of the connection (later ones are dropped).
  void fail(Result code, const std::string& message);
  // Closes the streams: waits until no progress thread uses them, then closes the fds.
  void stopStreams();
  void armWrite(int stream, bool enabled) { engine_->setWriteInterest(registrations_[stream].get(), enabled); }
  void detach(int stream) { engine_->detach(registrations_[stream].get()); }
  void requestWrite(int stream) { engine_->requestWrite(registrations_[stream].get()); }
  bool progressThreadsPoll() const { return engine_->polls(); }
  int fd(int stream) const { return fds_[stream]; }

 private:
  std::shared_ptr<ProgressEngine> engine_;
  std::vector<int> fds_;
  std::vector<std::unique_ptr<StreamRegistration>> registrations_;
  std::string peer_;
  std::atomic<int> failure_{unifabSuccess};
  std::mutex failureMutex_;
  std::string failureMessage_;
};

// Registration record shared by both sides: the socket transport needs nothing but the range.
Result registerHostMemory(void* data, size_t size, int type, MemoryRegion** region);

// Memory registration of both comm kinds: host memory only, nothing to pin.
template <typename CommInterface>
class HostMemoryComm : public CommInterface {
 public:
  Result registerMemory(void* data, size_t size, int type, MemoryRegion** region) override {
    return registerHostMemory(data, size, type, region);
  }
  Result deregisterMemory(MemoryRegion* region) override {
    delete region;
    return unifabSuccess;
  }
};

class SocketSendComm;

struct SendRequest final : Request {
  enum State : int { kFree, kWaiting, kSending, kDone, kFailed };
  SocketSendComm* comm = nullptr;
  const char* data = nullptr;
  size_t size = 0;
  int tag = 0;
  std::atomic<int> state{kFree};
  std::atomic<uint32_t> chunksLeft{0};
  std::string error;  // for kFailed, written before the state is published
  Result test(bool* done, int* sizes) override;
};

class SocketSendComm final : public HostMemoryComm<SendComm>, public StreamSet {
 public:
  SocketSendComm(std::shared_ptr<ProgressEngine> engine, std::vector<int> fds, std::string peer,
                 const ConnectionOptions& options);
  ~SocketSendComm() override;

  Result isend(const void* data, size_t size, int tag, MemoryRegion* region, Request** request) override;

  void onReadable(int stream) override;
  void onWritable(int stream) override;

 private:
  friend struct SendRequest;
  struct Task {
    SendRequest* request;  // null for a truncation notice
    ChunkHeader header;
    const char* payload;
    size_t sent;  // bytes of header + payload written so far
  };
  struct Stream {
    std::deque<Task> queue;  // guarded by mutex_
    std::mutex writer;       // the writer role; guards the fields below
    bool armed = false;
    bool busy = false;
    Task current{};
  };
  struct Announced {
    ClearToSend receive;
    uint32_t filled;  // bit per slot already matched to a send
  };
  enum class Drain { kEmpty, kBlocked, kDeferred, kFailed };

  // Matches waiting sends to announced receives; returns the streams that got new chunks.
  uint32_t matchLocked();
  // Slot of `announced` the request fills, or -1 to wait for a later receive, or -2 if the
  // grouped receive has no buffer with this tag at all (a usage error).
  static int findSlot(const Announced& announced, int tag);
  uint32_t startMessageLocked(SendRequest* request, const ClearToSend& receive, uint32_t slot);
  // Writes queued chunks of `stream` if this thread can take the writer role, leaving payloads
  // above `limit` bytes to the progress thread (which passes SIZE_MAX; inlineBytes = 0: headers
  // and empty messages only).
  void pumpWrites(int stream, size_t limit);
  void pumpStreams(uint32_t streams, size_t limit);
  Drain drainWriter(int stream, size_t limit);
  // Reads announcements from stream 0 if this thread can take its reader role.
  void pumpAnnouncements();
  void releaseRequest(SendRequest* request);

  ConnectionOptions options_;
  std::mutex mutex_;  // guards the request pool, waiting_, announced_ and the stream queues
  std::vector<SendRequest> requests_;
  std::vector<SendRequest*> freeRequests_;
  std::deque<SendRequest*> waiting_;  // posted, not yet matched to a receive
  std::deque<Announced> announced_;   // receives the peer announced, oldest first
  std::vector<Stream> streams_;
  // Stream 0's reader role and its partial announcement.
  std::mutex announcementReader_;
  ClearToSend incoming_{};
  size_t incomingBytes_ = 0;
  uint64_t expectedSequence_ = 0;
};

class SocketRecvComm;

struct RecvRequest final : Request {
  enum State : int { kFree, kPosted, kDone, kFailed };
  SocketRecvComm* comm = nullptr;
  int count = 0;
  size_t totalCapacity = 0;
  char* buffers[kMaxGroupedRecvs] = {};
  uint64_t capacity[kMaxGroupedRecvs] = {};
  std::atomic<uint64_t> sequence{~0ULL};
  static constexpr uint64_t kUnsetBytes = ~0ULL;  // messageBytes before a buffer's first chunk
  std::atomic<uint64_t> messageBytes[kMaxGroupedRecvs] = {};
  std::atomic<uint64_t> chunkBytes[kMaxGroupedRecvs] = {};  // 0 before the first chunk
  std::atomic<uint64_t> chunksSeen[kMaxGroupedRecvs] = {};  // bit i: the chunk at i * chunkBytes
  std::atomic<uint64_t> received[kMaxGroupedRecvs] = {};
  std::atomic<int> slotsDone{0};
  std::atomic<int> state{kFree};
  std::atomic<bool> errorClaimed{false};  // the one writer of `error`
  std::string error;  // for kFailed, written before the state says so
  Result test(bool* done, int* sizes) override;
};

class SocketRecvComm final : public HostMemoryComm<RecvComm>, public StreamSet {
 public:
  SocketRecvComm(std::shared_ptr<ProgressEngine> engine, std::vector<int> fds, std::string peer,
                 const ConnectionOptions& options);
  ~SocketRecvComm() override;

  Result irecv(int n, void* const* data, const size_t* sizes, const int* tags, MemoryRegion* const* regions,
               Request** request) override;
  Result iflush(int n, void* const* data, const int* sizes, MemoryRegion* const* regions, Request** request) override;

  void onReadable(int stream) override;
  void onWritable(int stream) override;

 private:
  friend struct RecvRequest;
  // Headers and small payloads are read in one system call into `staging`, then copied into
  // place; payloads larger than the staging area are received straight into the posted buffer.
  static constexpr size_t kStagingBytes = 8192;
  struct Stream {
    std::mutex reader;  // the reader role; guards the fields below
    ChunkHeader header{};
    RecvRequest* target = nullptr;
    char* destination = nullptr;
    uint64_t remaining = 0;
    bool inPayload = false;
    bool eof = false;
    std::unique_ptr<char[]> staging{new char[kStagingBytes]};
    size_t stagedBegin = 0;
    size_t stagedEnd = 0;
  };

  // Reads chunks of `stream` if this thread can take the reader role, stopping before a payload
  // larger than `limit`, which it leaves to the progress thread (which passes SIZE_MAX).
  void pumpReads(int stream, size_t limit);
  // Places the staged bytes: headers start chunks, payload bytes go to their destination.
  // False (with the connection failed) on a protocol error.
  bool consumeStaged(Stream& stream);
  // Validates a complete chunk header; false (with the connection failed) on a protocol error.
  bool beginChunk(Stream& stream);
  void finishChunk(RecvRequest* request, uint32_t slot, uint64_t length);
  void onEndOfStream(int stream);
  // Writes queued announcements on stream 0 if this thread can take its writer role.
  void pumpAnnouncements();

  ConnectionOptions options_;
  std::vector<RecvRequest> requests_;  // ring indexed by sequence % kMaxRequestsPerComm
  uint64_t nextSequence_ = 0;          // the posting thread only
  std::vector<Stream> streams_;
  std::atomic<int> streamsAtEof_{0};
  std::mutex mutex_;  // guards announcements_
  std::deque<ClearToSend> announcements_;
  // Stream 0's writer role and the announcements being written, several per system call.
  static constexpr size_t kAnnouncementBatch = 8;
  std::mutex announcementWriter_;
  bool announcementArmed_ = false;
  ClearToSend outgoing_[kAnnouncementBatch] = {};
  size_t outgoingCount_ = 0;
  size_t outgoingSent_ = 0;
};

}  // namespace unifab::net::socket
