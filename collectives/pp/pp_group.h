// Host side of pipeline send/recv: the group's window of receive slots, the chunk counters per
// peer, and the watchdog that bounds every stream wait (stream memory waits cannot time out by
// themselves).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "collectives/common/symmetric.h"
#include "collectives/pp/rendezvous.h"
#include "collectives/pp/stream_ops.h"
#include "unifab/unifab.h"

namespace unifab::collectives::pp {

// A non-blocking stream of the device's highest priority (see pp_group.cc for why).
cudaError_t createUrgentStream(cudaStream_t* stream);

// Releases stream waits that last too long. Each wait is bracketed by two events on its stream:
// the first completes when the stream reaches the wait (the clock starts then, not when the wait
// was posted behind other work), the second when the wait is over. A wait still blocked after the
// timeout gets its awaited value written by the watchdog, so that the stream moves on, and the
// group records a timeout; from then on every reached wait is released at once (the group is
// unusable, and a transfer of many chunks must not take a timeout per chunk). The peer is not
// told: a sender released early may overwrite a slot its late receiver then reads, which is why
// the group refuses every call after a timeout.
class WaitWatchdog {
 public:
  WaitWatchdog(int device, int64_t timeoutMs);
  ~WaitWatchdog();
  WaitWatchdog(const WaitWatchdog&) = delete;
  WaitWatchdog& operator=(const WaitWatchdog&) = delete;

  Result start();
  // Posts "wait until *flag >= value" on `stream`, watched; `what` and `peer` name it in the
  // timeout warning ("send to rank 1: slot freed by").
  Result wait(const StreamOps& ops, cudaStream_t stream, uint64_t* flag, uint64_t value, const char* what, int peer);
  bool timedOut() const { return timedOut_.load(); }

 private:
  struct Watched {
    cudaEvent_t reached = nullptr, passed = nullptr;
    cudaStream_t stream = nullptr;
    uint64_t* flag = nullptr;
    uint64_t value = 0;
    const char* what = "";
    int peer = -1;
    bool reachedSeen = false;
    std::chrono::steady_clock::time_point reachedAt;
  };
  static constexpr int kReleaseSlots = 64;  // pinned values of releases in flight
  static constexpr int kReleasesLogged = 8;  // the first releases each get a warning
  void run();
  Result takeEvent(cudaEvent_t* event);
  void release(Watched& w);

  const int device_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::list<Watched> watched_;
  std::vector<cudaEvent_t> spareEvents_;
  bool stopping_ = false;
  std::atomic<bool> timedOut_{false};
  cudaStream_t releaseStream_ = nullptr;  // non-blocking: never queues behind a stuck stream
  uint64_t* releaseValues_ = nullptr;     // pinned staging of the values written on release (a ring)
  int nextRelease_ = 0;
  int releases_ = 0;
  std::thread thread_;
};

}  // namespace unifab::collectives::pp

// A transfer is matched by its sequence number per (sender, receiver), in posting order. The
// receiver posts where its buffer is (a descriptor in the sender's shared-memory inbox) and, on
// its stream, an interprocess event that says the buffer may be written. The sender's copy runs
// on a stream of its own per peer, once both its caller's stream and the receiver's have reached
// the transfer: straight into the receive buffer when CUDA IPC can map it (one copy-engine copy,
// no SM), else through the receiver's window slots (chunked; the receiver then copies the chunks
// out on its stream, which a GPU does with a kernel). Each side's stream then waits, with a
// stream memory wait the watchdog bounds, for the flag that says its part is done. Sends whose
// receiver has not posted yet are issued by the group's proxy thread.
struct unifabPpGroup {
  static unifab::Result create(ncclComm_t comm, const unifabPpConfig_t& config, unifabPpGroup** out);
  ~unifabPpGroup();

  unifab::Result send(const void* data, size_t bytes, int peer, cudaStream_t stream);
  unifab::Result recv(void* data, size_t bytes, int peer, cudaStream_t stream);
  unifab::Result asyncError() const;

 private:
  struct PendingSend {
    uint64_t sequence;
    const char* data;
    size_t bytes;
    cudaEvent_t reached;  // the caller's stream reached the send
  };
  struct Peer {  // this rank's state towards one LSA peer
    cudaStream_t copyStream = nullptr;       // the sends' copies to this peer, in sequence order
    std::vector<cudaEvent_t> recvEvents;     // interprocess, recorded by our receives from this peer
    std::vector<cudaEvent_t> writableEvents; // the peer's recvEvents for us, opened here
    std::unique_ptr<unifab::collectives::pp::Inbox> inbox;  // the peer's inbox (ours for ourselves)
    std::deque<PendingSend> pending;          // sends not yet issued (their receive not posted)
    uint64_t sentTransfers = 0, receivedTransfers = 0;
    uint64_t sentChunks = 0, receivedChunks = 0;  // through the slots
    bool sameProcess = false;  // driven by another thread of this process: no IPC in between
  };

  unifabPpGroup() = default;
  // The peer's index among this rank's LSA peers, or an error naming why it cannot be reached.
  unifab::Result lsaIndex(int peer, int* index) const;
  unifab::Result checkCall(const void* data, size_t bytes, int peer, cudaStream_t stream, int* index) const;
  unifab::Result exchangeRendezvous();
  // Issues the oldest pending send to LSA peer `to` if its receive is posted; *issued says so.
  unifab::Result issueReady(int to, bool* issued);
  unifab::Result issue(int to, const PendingSend& s, const unifab::collectives::pp::RecvDescriptor& d);
  void proxyLoop();
  unifab::Result takeEvent(cudaEvent_t* event);
  // Byte offsets in every rank's window: chunk slot `slot` of source `source` (LSA index), and the
  // flags: ready[source][slot] (written by the source: that chunk has landed), freed[reader][slot]
  // (written by the reader of our chunks: it has copied them out), transferReady[source] (the
  // source's latest transfer to us is complete), sendDone[peer] (our latest send to the peer is
  // complete), and the rendezvous exchange area of every rank.
  size_t slotOffset(int source, int slot) const;
  size_t readyOffset(int source, int slot) const;
  size_t freedOffset(int reader, int slot) const;
  size_t transferReadyOffset(int source) const;
  size_t sendDoneOffset(int peer) const;
  size_t exchangeOffset() const;
  uint64_t* flag(char* base, size_t offset) const { return reinterpret_cast<uint64_t*>(base + offset); }

  std::shared_ptr<unifab::collectives::DeviceComm> comm_;
  std::unique_ptr<unifab::collectives::SymmetricWindow> window_;
  std::unique_ptr<unifab::collectives::pp::WaitWatchdog> watchdog_;
  const unifab::collectives::pp::StreamOps* ops_ = nullptr;
  size_t chunkBytes_ = 0;
  int slots_ = 0;
  int lsaSize_ = 0;
  int firstLsaRank_ = 0;
  int myIndex_ = 0;
  size_t flagsBase_ = 0;
  bool direct_ = true;  // UNIFAB_PP_DIRECT
  std::unique_ptr<unifab::collectives::pp::Inbox> myInbox_;
  unifab::collectives::pp::BufferExporter exporter_;
  unifab::collectives::pp::BufferImporter importer_;
  mutable std::mutex mutex_;  // everything below and above that calls change, and posting order
  std::vector<Peer> peers_;
  std::vector<cudaEvent_t> spareEvents_;
  std::condition_variable pendingChanged_;
  bool stopping_ = false;
  std::atomic<bool> failed_{false};  // the proxy could not issue a transfer: the group is unusable
  std::thread proxy_;
};
