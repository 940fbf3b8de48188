// Host side of pipeline send/recv: the group's window of receive slots, the chunk counters per
// peer, and the watchdog that bounds every stream wait (stream memory waits cannot time out by
// themselves).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/common/device_range.h"
#include "collectives/common/symmetric.h"
#include "collectives/pp/host_trace.h"
#include "collectives/pp/rendezvous.h"
#include "collectives/pp/stream_ops.h"
#include "plugin/params.h"
#include "unifab/unifab.h"

namespace unifab::collectives::pp {

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

// Two engines (UNIFAB_PP_ENGINE). "rendezvous" (the default, rendezvous.h): the call posted second
// copies straight from the send buffer into the receive buffer, one copy-engine copy; a call whose
// buffer CUDA IPC cannot map waits to be the second. "slots": the sender's copy engine moves each
// chunk into a slot of the receiver's window and the receiver copies it out on its stream (a
// same-GPU copy, on SMs with this driver); a rank's transfers to itself always take this way.
struct unifabPpGroup {
  // Collective; a NULL config or out is refused in the ranks' agreement (as unifabEpGroup::create).
  static unifab::Result create(ncclComm_t comm, const unifabPpConfig_t* config, unifabPpGroup** out);
  ~unifabPpGroup();

  unifab::Result send(const void* data, size_t bytes, int peer, cudaStream_t stream);
  unifab::Result recv(void* data, size_t bytes, int peer, cudaStream_t stream);
  unifab::Result asyncError() const;

 private:
  struct RendezvousPeer {  // this rank's rendezvous state towards one LSA peer
    std::unique_ptr<unifab::collectives::pp::Inbox> inbox;  // the peer's (its receives from us)
    std::string channel;       // the peer's FdChannel (its name; the handles of our buffers go there)
    bool sameProcess = false;  // driven by another thread of this process: no IPC in between
    bool peerAccess = false;   // same process: peer access to its GPU enabled
    uint64_t transfers[2] = {0, 0};  // [side]: calls posted so far
    std::vector<cudaEvent_t> callEnds[2];  // [side][ring]: recorded at the end of each call
  };

  unifabPpGroup() = default;
  // The peer's index among this rank's LSA peers, or an error naming why it cannot be reached.
  unifab::Result lsaIndex(int peer, int* index) const;
  unifab::Result checkCall(const void* data, size_t bytes, int peer, cudaStream_t stream, int* index) const;
  using CallClock = unifab::collectives::pp::HostTrace::Call;
  unifab::Result slotSend(const void* data, size_t bytes, int to, cudaStream_t stream, CallClock& clock);
  unifab::Result slotRecv(void* data, size_t bytes, int from, cudaStream_t stream, CallClock& clock);
  unifab::Result setUpRendezvous();
  unifab::Result rendezvousCall(int side, void* data, size_t bytes, int peer, cudaStream_t stream, CallClock& clock);
  // A call that failed after it was numbered (or posted a chunk) leaves its peer's matching call out
  // of step: the group records the first such failure and refuses every later call with it.
  unifab::Result failedMidway(unifab::Result failure, const char* call, int peer);
  // Byte offsets in every rank's window: chunk slot `slot` of source `source` (LSA index), and the
  // flags: ready[source][slot] (written by the source: that chunk has landed) and
  // freed[reader][slot] (written by the reader of our chunks: it has copied them out). Rendezvous:
  // reached[side][peer][ring] (written by `peer`: its `side` call of that transfer has reached its
  // stream) and served[side][peer][ring] (written by `peer`: it has moved the data of our `side`
  // call), then every rank's inbox name.
  size_t slotOffset(int source, int slot) const;
  size_t readyOffset(int source, int slot) const;
  size_t freedOffset(int reader, int slot) const;
  size_t reachedOffset(int side, int peer, uint64_t sequence) const;
  size_t servedOffset(int side, int peer, uint64_t sequence) const;
  size_t namesOffset() const;

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
  bool rendezvous_ = false;
  mutable std::mutex mutex_;         // the counters below, and the order of posted operations
  std::vector<uint64_t> sentTo_;     // chunks sent to each LSA peer so far
  std::vector<uint64_t> receivedFrom_;
  std::unique_ptr<unifab::collectives::pp::Inbox> myInbox_;
  // Where the peers send the handles of their virtual-memory buffers; null where this process could
  // not open one (those buffers are then moved by their own side, as unmappable ones).
  std::unique_ptr<unifab::collectives::pp::FdChannel> myChannel_;
  std::vector<RendezvousPeer> rendezvousPeers_;
  unifab::collectives::pp::BufferExporter exporter_;
  unifab::collectives::pp::BufferImporter importer_;
  // A pipeline loop sends the same buffers call after call: each is asked of the driver once.
  mutable unifab::collectives::CheckedRanges checkedRanges_;
  unifab::collectives::pp::HostTrace trace_{unifab::params().ppTrace};  // UNIFAB_PP_TRACE
  std::atomic<int> broken_{unifabSuccess};  // failedMidway's first code
  std::string brokenMessage_;               // and its message (under mutex_)
};
