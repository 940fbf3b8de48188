#include "collectives/pp/pp_group.h"

#include <algorithm>
#include <map>
#include <string>

#include "collectives/common/copy_engine.h"
#include "collectives/common/cuda_check.h"
#include "collectives/common/device_guard.h"
#include "collectives/pp/pp_plan.h"
#include "plugin/params.h"

using unifab::Result;
using unifab::kLogInit;
using unifab::kLogProxy;

namespace unifab::collectives::pp {
namespace {

constexpr size_t kDefaultChunkBytes = size_t{8} << 20;
constexpr int kDefaultSlots = 4;
constexpr size_t kMaxChunkBytes = size_t{1} << 30;
constexpr int kMaxSlots = 64;
constexpr auto kWatchPeriod = std::chrono::milliseconds(1);
constexpr auto kProxySpin = std::chrono::milliseconds(2);  // busy polling of a posted send's receive

}  // namespace

// A stream memory wait blocks the hardware queue it sits in, and with it any other stream the
// driver mapped to that queue: a copy stream queued behind a caller's receive wait that needs
// the peer's copy stream, which is queued behind the peer's receive wait, is a deadlock no stream
// order shows (measured: transfers that hung at random points). Streams of the highest priority
// are queued apart from the callers' default-priority streams.
cudaError_t createUrgentStream(cudaStream_t* stream) {
  int leastPriority = 0, greatestPriority = 0;
  cudaError_t status = cudaDeviceGetStreamPriorityRange(&leastPriority, &greatestPriority);
  if (status != cudaSuccess) return status;
  return cudaStreamCreateWithPriority(stream, cudaStreamNonBlocking, greatestPriority);
}

WaitWatchdog::WaitWatchdog(int device, int64_t timeoutMs) : device_(device), timeout_(timeoutMs) {}

Result WaitWatchdog::start() {
  unifab::collectives::DeviceGuard guard(device_);
  UF_CUDA_CHECK(pp::createUrgentStream(&releaseStream_));
  UF_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&releaseValues_), sizeof(uint64_t) * kReleaseSlots,
                              cudaHostAllocDefault));
  thread_ = std::thread([this] { run(); });
  return unifabSuccess;
}

WaitWatchdog::~WaitWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
  unifab::collectives::DeviceGuard guard(device_);
  for (Watched& w : watched_) {
    UF_CUDA_WARN(cudaEventDestroy(w.reached));
    UF_CUDA_WARN(cudaEventDestroy(w.passed));
  }
  for (cudaEvent_t e : spareEvents_) UF_CUDA_WARN(cudaEventDestroy(e));
  if (releaseStream_ != nullptr) UF_CUDA_WARN(cudaStreamDestroy(releaseStream_));
  if (releaseValues_ != nullptr) UF_CUDA_WARN(cudaFreeHost(releaseValues_));
}

Result WaitWatchdog::takeEvent(cudaEvent_t* event) {
  if (!spareEvents_.empty()) {
    *event = spareEvents_.back();
    spareEvents_.pop_back();
    return unifabSuccess;
  }
  UF_CUDA_CHECK(cudaEventCreateWithFlags(event, cudaEventDisableTiming));
  return unifabSuccess;
}

Result WaitWatchdog::wait(const StreamOps& ops, cudaStream_t stream, uint64_t* flag, uint64_t value, const char* what,
                          int peer) {
  Watched w;
  w.stream = stream;
  w.flag = flag;
  w.value = value;
  w.what = what;
  w.peer = peer;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    UF_CHECK(takeEvent(&w.reached));
    const Result second = takeEvent(&w.passed);
    if (second != unifabSuccess) {
      spareEvents_.push_back(w.reached);
      return second;
    }
  }
  Result posted = unifabSuccess;
  cudaError_t recorded = cudaEventRecord(w.reached, stream);
  if (recorded == cudaSuccess) posted = ops.waitAtLeast(stream, flag, value);
  if (recorded == cudaSuccess && posted == unifabSuccess) recorded = cudaEventRecord(w.passed, stream);
  std::lock_guard<std::mutex> lock(mutex_);
  if (recorded != cudaSuccess || posted != unifabSuccess) {
    spareEvents_.push_back(w.reached);
    spareEvents_.push_back(w.passed);
    UF_CUDA_CHECK(recorded);
    return posted;
  }
  watched_.push_back(w);
  changed_.notify_all();
  return unifabSuccess;
}

void WaitWatchdog::release(Watched& w) {
  // Posted, not awaited: with few hardware queues the copy may sit behind the stuck stream, and
  // the watchdog must not stop watching the others meanwhile.
  uint64_t* value = releaseValues_ + nextRelease_;
  nextRelease_ = (nextRelease_ + 1) % kReleaseSlots;
  *value = w.value;
  const cudaError_t written = cudaMemcpyAsync(w.flag, value, sizeof(uint64_t), cudaMemcpyHostToDevice, releaseStream_);
  const bool first = !timedOut_.exchange(true);
  if (first) {
    UF_WARN(kExt,
            "pipeline send/recv: %s rank %d (chunk %llu) waited more than UNIFAB_PP_TIMEOUT_MS=%lld ms (the peer did "
            "not post its matching call); released it%s; the group is unusable and releases its waits from now on",
            w.what, w.peer, static_cast<unsigned long long>(w.value), static_cast<long long>(timeout_.count()),
            written == cudaSuccess ? "" : " (the release failed too)");
  } else if (releases_ < kReleasesLogged) {
    UF_WARN(kExt, "pipeline send/recv: released %s rank %d (chunk %llu)%s", w.what, w.peer,
            static_cast<unsigned long long>(w.value), releases_ + 1 == kReleasesLogged ? "; later releases not logged" : "");
  }
  ++releases_;
}

void WaitWatchdog::run() {
  // The watchdog's event queries must not disturb a CUDA graph another thread captures.
  cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
  if (cudaSetDevice(device_) != cudaSuccess || cudaThreadExchangeStreamCaptureMode(&relaxed) != cudaSuccess) {
    UF_WARN(kExt, "pipeline send/recv watchdog: cannot use CUDA device %d; waits are not bounded", device_);
    return;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  std::vector<cudaStream_t> notReached;
  while (!stopping_) {
    if (watched_.empty()) {
      changed_.wait(lock, [this] { return stopping_ || !watched_.empty(); });
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    notReached.clear();
    for (auto it = watched_.begin(); it != watched_.end();) {
      // A stream's waits are in posting order: past one it has not reached, it has reached none.
      if (std::find(notReached.begin(), notReached.end(), it->stream) != notReached.end()) {
        ++it;
        continue;
      }
      if (cudaEventQuery(it->passed) == cudaSuccess) {
        spareEvents_.push_back(it->reached);
        spareEvents_.push_back(it->passed);
        it = watched_.erase(it);
        continue;
      }
      if (!it->reachedSeen && cudaEventQuery(it->reached) == cudaSuccess) {
        it->reachedSeen = true;
        it->reachedAt = now;
      }
      if (!it->reachedSeen) {
        notReached.push_back(it->stream);
      } else if (timedOut_ || now - it->reachedAt > timeout_) {
        release(*it);
        it->reachedAt = now + timeout_;  // once more later, should this release not land
      }
      ++it;
    }
    changed_.wait_for(lock, kWatchPeriod);
  }
}

}  // namespace unifab::collectives::pp

namespace pp = unifab::collectives::pp;
using unifab::collectives::copyEngineCopy;

namespace {

// Per rank in the window's exchange area: the inbox name (which names the process too), then the
// interprocess event handles of its receives from each LSA peer ([peer][ring]).
size_t exchangeBytesPerRank(int lsaSize) {
  return pp::Inbox::kNameBytes + sizeof(cudaIpcEventHandle_t) * static_cast<size_t>(lsaSize) * pp::Inbox::kRing;
}

// The groups of this process by inbox name: a peer driven by another thread of this process (one
// GPU per thread) shares its events and buffers directly, since CUDA IPC refuses to open a handle
// in the process that made it.
std::mutex g_groupsMutex;
std::map<std::string, unifabPpGroup*> g_groups;

}  // namespace

Result unifabPpGroup::create(ncclComm_t comm, const unifabPpConfig_t& config, unifabPpGroup** out) {
  if (comm == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "comm=NULL");
  if (config.size < sizeof(unifabPpConfig_t)) {
    return UF_ERROR(unifabInvalidArgument, kExt, "config->size=%zu, expected %zu: initialise it with UNIFAB_PP_CONFIG_INIT",
                    config.size, sizeof(unifabPpConfig_t));
  }
  const size_t chunkBytes = config.chunkBytes == 0 ? pp::kDefaultChunkBytes : config.chunkBytes;
  const int slots = config.chunksInFlight == 0 ? pp::kDefaultSlots : config.chunksInFlight;
  if (chunkBytes % 16 != 0 || chunkBytes > pp::kMaxChunkBytes) {
    return UF_ERROR(unifabInvalidArgument, kExt, "config->chunkBytes=%zu must be a multiple of 16 in 16..%zu (0: %zu)",
                    config.chunkBytes, pp::kMaxChunkBytes, pp::kDefaultChunkBytes);
  }
  if (slots < 1 || slots > pp::kMaxSlots) {
    return UF_ERROR(unifabInvalidArgument, kExt, "config->chunksInFlight=%d is outside 1..%d (0: %d)",
                    config.chunksInFlight, pp::kMaxSlots, pp::kDefaultSlots);
  }
  std::unique_ptr<unifabPpGroup> group(new unifabPpGroup());
  // What this rank can check alone comes before the collective steps: a rank that failed between
  // them would leave its peers waiting in NCCL.
  UF_CHECK(unifab::collectives::requireCommDevice(comm));
  int device = -1;
  UF_CUDA_CHECK(cudaGetDevice(&device));
  UF_CHECK(pp::streamOps(device, &group->ops_));
  UF_CHECK(unifab::collectives::DeviceComm::acquire(comm, &group->comm_));
  const auto& dc = *group->comm_;
  group->chunkBytes_ = chunkBytes;
  group->slots_ = slots;
  group->lsaSize_ = dc.lsaSize();
  group->firstLsaRank_ = dc.rank() - dc.lsaRank();
  group->myIndex_ = dc.lsaRank();
  group->direct_ = unifab::params().ppDirect;
  group->flagsBase_ = static_cast<size_t>(group->lsaSize_) * slots * chunkBytes;
  const size_t windowBytes = group->exchangeOffset() + exchangeBytesPerRank(group->lsaSize_) * group->lsaSize_;
  group->peers_.resize(group->lsaSize_);
  // Local resources before the collective window creation: a rank must not fail between the
  // collective steps.
  group->watchdog_ = std::make_unique<pp::WaitWatchdog>(dc.cudaDevice(), unifab::params().ppTimeoutMs);
  UF_CHECK(group->watchdog_->start());
  UF_CHECK(pp::Inbox::create(group->lsaSize_, &group->myInbox_));
  for (Peer& peer : group->peers_) {
    UF_CUDA_CHECK(pp::createUrgentStream(&peer.copyStream));
    peer.recvEvents.assign(pp::Inbox::kRing, nullptr);
    for (cudaEvent_t& e : peer.recvEvents) {
      UF_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess));
    }
  }
  UF_CHECK(unifab::collectives::SymmetricWindow::create(group->comm_, windowBytes, &group->window_));
  UF_CHECK(group->exchangeRendezvous());
  group->proxy_ = std::thread([g = group.get()] { g->proxyLoop(); });
  UF_INFO(kExt, kLogInit, "PP group: rank %d, %d NVLink peers, %s; %d slots of %zu KiB per peer (window %zu MiB)",
          dc.rank(), group->lsaSize_, group->direct_ ? "direct writes into mappable receive buffers" : "always through the slots",
          slots, chunkBytes >> 10, windowBytes >> 20);
  *out = group.release();
  return unifabSuccess;
}

// Every rank publishes its inbox name and its receive events in its window; after a barrier each
// opens its peers' (a failure past the first barrier leaves the peers to time out in the next
// collective step, as any NCCL failure midway through setup would).
Result unifabPpGroup::exchangeRendezvous() {
  const size_t perRank = exchangeBytesPerRank(lsaSize_);
  std::vector<char> mine(perRank, 0);
  snprintf(mine.data(), pp::Inbox::kNameBytes, "%s", myInbox_->name());
  auto* handles = reinterpret_cast<cudaIpcEventHandle_t*>(mine.data() + pp::Inbox::kNameBytes);
  for (int p = 0; p < lsaSize_; ++p) {
    for (int k = 0; k < pp::Inbox::kRing; ++k) {
      UF_CUDA_CHECK(cudaIpcGetEventHandle(&handles[p * pp::Inbox::kRing + k], peers_[p].recvEvents[k]));
    }
  }
  char* local = window_->localBase();
  UF_CUDA_CHECK(cudaMemcpy(local + exchangeOffset() + perRank * myIndex_, mine.data(), perRank, cudaMemcpyHostToDevice));
  {
    std::lock_guard<std::mutex> lock(g_groupsMutex);
    g_groups[myInbox_->name()] = this;
  }
  UF_CHECK(comm_->barrier());
  const std::string myProcess = pp::Inbox::processOf(myInbox_->name());
  std::vector<char> theirs(perRank);
  for (int p = 0; p < lsaSize_; ++p) {
    Peer& peer = peers_[p];
    if (p == myIndex_) {
      UF_CHECK(pp::Inbox::open(myInbox_->name(), lsaSize_, &peer.inbox));
      peer.writableEvents = peer.recvEvents;  // our own receives' events, used as they are
      continue;
    }
    UF_CUDA_CHECK(cudaMemcpy(theirs.data(), window_->peerBases()[p] + exchangeOffset() + perRank * p, perRank,
                             cudaMemcpyDeviceToHost));
    theirs[pp::Inbox::kNameBytes - 1] = '\0';
    UF_CHECK(pp::Inbox::open(theirs.data(), lsaSize_, &peer.inbox));
    if (pp::Inbox::processOf(theirs.data()) == myProcess) {
      unifabPpGroup* other = nullptr;
      {
        std::lock_guard<std::mutex> lock(g_groupsMutex);
        auto found = g_groups.find(theirs.data());
        if (found != g_groups.end()) other = found->second;
      }
      if (other == nullptr) {
        return UF_ERROR(unifabInternalError, kExt, "rank %d's pipeline group shares this process but is not registered",
                        firstLsaRank_ + p);
      }
      peer.sameProcess = true;
      peer.writableEvents = other->peers_[myIndex_].recvEvents;
      // Copies between two GPUs of one process go straight over NVLink once peer access is on.
      const cudaError_t enabled = cudaDeviceEnablePeerAccess(other->comm_->cudaDevice(), 0);
      if (enabled == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();
      else UF_CUDA_CHECK(enabled);
      continue;
    }
    const auto* peerHandles = reinterpret_cast<const cudaIpcEventHandle_t*>(theirs.data() + pp::Inbox::kNameBytes);
    peer.writableEvents.assign(pp::Inbox::kRing, nullptr);
    for (int k = 0; k < pp::Inbox::kRing; ++k) {
      UF_CUDA_CHECK(cudaIpcOpenEventHandle(&peer.writableEvents[k], peerHandles[myIndex_ * pp::Inbox::kRing + k]));
    }
  }
  UF_CHECK(comm_->barrier());  // everybody has every inbox open: the names can go
  myInbox_->unlink();
  return unifabSuccess;
}

unifabPpGroup::~unifabPpGroup() {
  if (myInbox_) {
    std::lock_guard<std::mutex> lock(g_groupsMutex);
    g_groups.erase(myInbox_->name());
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  pendingChanged_.notify_all();
  if (proxy_.joinable()) proxy_.join();
  if (comm_) {
    unifab::collectives::DeviceGuard guard(comm_->cudaDevice());
    UF_CUDA_WARN(cudaDeviceSynchronize());  // transfers of the group still use its window
    importer_.closeAll();
    for (int p = 0; p < static_cast<int>(peers_.size()); ++p) {
      Peer& peer = peers_[p];
      for (const PendingSend& s : peer.pending) UF_CUDA_WARN(cudaEventDestroy(s.reached));
      if (p != myIndex_ && !peer.sameProcess) {
        for (cudaEvent_t e : peer.writableEvents) {
          if (e != nullptr) UF_CUDA_WARN(cudaEventDestroy(e));
        }
      }
      for (cudaEvent_t e : peer.recvEvents) {
        if (e != nullptr) UF_CUDA_WARN(cudaEventDestroy(e));
      }
      if (peer.copyStream != nullptr) UF_CUDA_WARN(cudaStreamDestroy(peer.copyStream));
    }
    for (cudaEvent_t e : spareEvents_) UF_CUDA_WARN(cudaEventDestroy(e));
  }
  watchdog_.reset();
  window_.reset();  // collective deregistration
}

size_t unifabPpGroup::slotOffset(int source, int slot) const {
  return (static_cast<size_t>(source) * slots_ + slot) * chunkBytes_;
}

size_t unifabPpGroup::readyOffset(int source, int slot) const {
  return flagsBase_ + sizeof(uint64_t) * (static_cast<size_t>(source) * slots_ + slot);
}

size_t unifabPpGroup::freedOffset(int reader, int slot) const {
  return flagsBase_ + sizeof(uint64_t) * (static_cast<size_t>(lsaSize_ + reader) * slots_ + slot);
}

size_t unifabPpGroup::transferReadyOffset(int source) const {
  return flagsBase_ + sizeof(uint64_t) * (static_cast<size_t>(2 * lsaSize_) * slots_ + source);
}

size_t unifabPpGroup::sendDoneOffset(int peer) const {
  return flagsBase_ + sizeof(uint64_t) * (static_cast<size_t>(2 * lsaSize_) * slots_ + lsaSize_ + peer);
}

size_t unifabPpGroup::exchangeOffset() const {
  return flagsBase_ + sizeof(uint64_t) * (static_cast<size_t>(2 * lsaSize_) * slots_ + 2 * lsaSize_);
}

Result unifabPpGroup::lsaIndex(int peer, int* index) const {
  if (peer < 0 || peer >= comm_->nRanks()) {
    return UF_ERROR(unifabInvalidArgument, kExt, "peer=%d is outside 0..%d", peer, comm_->nRanks() - 1);
  }
  if (peer < firstLsaRank_ || peer >= firstLsaRank_ + lsaSize_) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "peer=%d is not in this rank's NVLink (LSA) domain (ranks %d..%d): pipeline send/recv over the "
                    "network is not implemented yet", peer, firstLsaRank_, firstLsaRank_ + lsaSize_ - 1);
  }
  *index = peer - firstLsaRank_;
  return unifabSuccess;
}

Result unifabPpGroup::checkCall(const void* data, size_t bytes, int peer, cudaStream_t stream, int* index) const {
  UF_CHECK(asyncError());
  UF_CHECK(lsaIndex(peer, index));
  if (bytes > 0 && data == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "data=NULL with bytes=%zu", bytes);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  UF_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "pipeline send/recv cannot be captured in a CUDA graph: chunks are numbered on the host");
  }
  int device = -1;
  UF_CUDA_CHECK(cudaStreamGetDevice(stream, &device));
  if (device != comm_->cudaDevice()) {
    return UF_ERROR(unifabInvalidArgument, kExt, "stream belongs to CUDA device %d, the group to device %d", device,
                    comm_->cudaDevice());
  }
  return unifabSuccess;
}

Result unifabPpGroup::takeEvent(cudaEvent_t* event) {
  if (!spareEvents_.empty()) {
    *event = spareEvents_.back();
    spareEvents_.pop_back();
    return unifabSuccess;
  }
  UF_CUDA_CHECK(cudaEventCreateWithFlags(event, cudaEventDisableTiming));
  return unifabSuccess;
}

Result unifabPpGroup::send(const void* data, size_t bytes, int peer, cudaStream_t stream) {
  int to = 0;
  UF_CHECK(checkCall(data, bytes, peer, stream, &to));
  unifab::collectives::DeviceGuard guard(comm_->cudaDevice());
  std::lock_guard<std::mutex> lock(mutex_);
  Peer& p = peers_[to];
  PendingSend s{p.sentTransfers + 1, static_cast<const char*>(data), bytes, nullptr};
  UF_CHECK(takeEvent(&s.reached));
  UF_CUDA_CHECK(cudaEventRecord(s.reached, stream));
  // The caller's stream goes on once the copy stream has finished this transfer.
  UF_CHECK(watchdog_->wait(*ops_, stream, flag(window_->localBase(), sendDoneOffset(to)), s.sequence,
                           "send: completion of the transfer to", peer));
  p.sentTransfers = s.sequence;
  p.pending.push_back(s);
  bool issued = false;
  UF_CHECK(issueReady(to, &issued));
  if (!p.pending.empty()) pendingChanged_.notify_all();  // the proxy issues it once the receive is posted
  return unifabSuccess;
}

Result unifabPpGroup::issueReady(int to, bool* issued) {
  Peer& p = peers_[to];
  *issued = false;
  if (p.pending.empty()) return unifabSuccess;
  const PendingSend s = p.pending.front();
  pp::RecvDescriptor& d = myInbox_->entry(to, s.sequence);
  if (d.sequence.load(std::memory_order_acquire) != s.sequence) return unifabSuccess;
  p.pending.pop_front();
  *issued = true;
  const Result r = issue(to, s, d);
  spareEvents_.push_back(s.reached);
  if (r != unifabSuccess) failed_ = true;
  return r;
}

Result unifabPpGroup::issue(int to, const PendingSend& s, const pp::RecvDescriptor& d) {
  Peer& p = peers_[to];
  const int peerRank = firstLsaRank_ + to;
  if (d.bytes != s.bytes) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "pipeline transfer %llu to rank %d: the send has %zu bytes, the matching receive %llu",
                    static_cast<unsigned long long>(s.sequence), peerRank, s.bytes,
                    static_cast<unsigned long long>(d.bytes));
  }
  cudaStream_t cs = p.copyStream;
  // Both streams have reached the transfer: the data is ready, the receive buffer writable.
  UF_CUDA_CHECK(cudaStreamWaitEvent(cs, s.reached, 0));
  UF_CUDA_CHECK(cudaStreamWaitEvent(cs, p.writableEvents[(s.sequence - 1) % pp::Inbox::kRing], 0));
  const bool direct = d.direct != 0;
  const uint64_t offset = d.offset;
  char* base = reinterpret_cast<char*>(d.address);
  if (direct && s.bytes > 0 && to != myIndex_ && !p.sameProcess) {
    UF_CHECK(importer_.map(to, d, &base));
    base += offset;
  }
  // The receiver may now reuse this ring entry and its event (a later record does not change a
  // wait already enqueued).
  myInbox_->taken(to).store(s.sequence, std::memory_order_release);
  char* theirs = window_->peerBases()[to];
  if (direct) {
    if (s.bytes > 0) UF_CHECK(copyEngineCopy(base, s.data, s.bytes, cs));
  } else {
    for (const pp::Chunk& c : pp::planChunks(s.bytes, chunkBytes_, slots_, p.sentChunks)) {
      if (c.reuseAfter > 0) {
        // The peer has copied out the chunk that last used this slot.
        UF_CHECK(watchdog_->wait(*ops_, cs, flag(window_->localBase(), freedOffset(to, c.slot)), c.reuseAfter,
                                 "send: slot freed by", peerRank));
      }
      UF_CHECK(copyEngineCopy(theirs + slotOffset(myIndex_, c.slot), s.data + c.offset, c.bytes, cs));
      UF_CHECK(ops_->write(cs, flag(theirs, readyOffset(myIndex_, c.slot)), c.sequence));
      p.sentChunks = c.sequence;
    }
  }
  UF_CHECK(ops_->write(cs, flag(theirs, transferReadyOffset(myIndex_)), s.sequence));
  UF_CHECK(ops_->write(cs, flag(window_->localBase(), sendDoneOffset(to)), s.sequence));
  UF_INFO(kExt, kLogProxy, "PP: transfer %llu to rank %d issued (%zu bytes, %s)",
          static_cast<unsigned long long>(s.sequence), peerRank, s.bytes, direct ? "direct" : "through the slots");
  return unifabSuccess;
}

void unifabPpGroup::proxyLoop() {
  if (cudaSetDevice(comm_->cudaDevice()) != cudaSuccess) {
    UF_WARN(kExt, "pipeline send/recv proxy: cannot use CUDA device %d; sends posted before their receive "
                  "will not be issued", comm_->cudaDevice());
    return;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  auto pollingSince = std::chrono::steady_clock::now();
  bool polling = false;
  while (!stopping_) {
    bool waiting = false, progressed = false;
    for (int to = 0; to < lsaSize_; ++to) {
      bool issued = true;
      while (issued) {
        const Result r = issueReady(to, &issued);
        progressed = progressed || issued;
        if (r != unifabSuccess) {
          UF_WARN(kExt, "pipeline send/recv: issuing a send failed (%s); the group is unusable",
                  unifab::lastErrorMessage());
        }
      }
      waiting = waiting || !peers_[to].pending.empty();
    }
    if (waiting) {
      // The receive is posted by another process: poll its inbox entry, spinning for a while (a
      // transfer's latency includes this poll), then every 20 us.
      const auto now = std::chrono::steady_clock::now();
      if (!polling || progressed) pollingSince = now;
      polling = true;
      lock.unlock();
      if (now - pollingSince < pp::kProxySpin) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      lock.lock();
    } else {
      polling = false;
      pendingChanged_.wait(lock);
    }
  }
}

Result unifabPpGroup::recv(void* data, size_t bytes, int peer, cudaStream_t stream) {
  int from = 0;
  UF_CHECK(checkCall(data, bytes, peer, stream, &from));
  unifab::collectives::DeviceGuard guard(comm_->cudaDevice());
  std::unique_lock<std::mutex> lock(mutex_);
  Peer& p = peers_[from];
  // The sender must have taken the descriptor that last used this ring entry.
  std::atomic<uint64_t>& taken = p.inbox->taken(myIndex_);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(unifab::params().ppTimeoutMs);
  uint64_t sequence = 0;
  for (;;) {
    sequence = p.receivedTransfers + 1;
    if (sequence <= pp::Inbox::kRing || taken.load(std::memory_order_acquire) >= sequence - pp::Inbox::kRing) break;
    if (std::chrono::steady_clock::now() > deadline) {
      return UF_ERROR(unifabTimeout, kExt,
                      "pipeline receive %llu from rank %d: rank %d has not posted send %llu within "
                      "UNIFAB_PP_TIMEOUT_MS (at most %d receives may wait for their sends)",
                      static_cast<unsigned long long>(sequence), peer, peer,
                      static_cast<unsigned long long>(sequence - pp::Inbox::kRing), pp::Inbox::kRing);
    }
    lock.unlock();  // our own proxy may be the one to take it (a send to ourselves)
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    lock.lock();
  }
  pp::RecvDescriptor posted{};
  bool mappable = false;
  if (direct_ && bytes > 0 && from != myIndex_ && !p.sameProcess) UF_CHECK(exporter_.describe(data, &posted, &mappable));
  const bool direct = bytes == 0 || mappable || (direct_ && (from == myIndex_ || p.sameProcess));
  // The buffer is writable once the stream gets here.
  UF_CUDA_CHECK(cudaEventRecord(p.recvEvents[(sequence - 1) % pp::Inbox::kRing], stream));
  pp::RecvDescriptor& entry = p.inbox->entry(myIndex_, sequence);
  entry.direct = direct ? 1 : 0;
  entry.bytes = bytes;
  entry.bufferId = posted.bufferId;
  entry.offset = posted.offset;
  entry.address = reinterpret_cast<uintptr_t>(data);
  entry.allocation = posted.allocation;
  entry.sequence.store(sequence, std::memory_order_release);
  UF_INFO(kExt, kLogProxy, "PP: receive %llu from rank %d posted (%zu bytes, %s)", static_cast<unsigned long long>(sequence),
          peer, bytes, direct ? "direct" : "through the slots");
  p.receivedTransfers = sequence;
  pendingChanged_.notify_all();
  char* mine = window_->localBase();
  if (!direct) {
    char* theirs = window_->peerBases()[from];
    for (const pp::Chunk& c : pp::planChunks(bytes, chunkBytes_, slots_, p.receivedChunks)) {
      UF_CHECK(watchdog_->wait(*ops_, stream, flag(mine, readyOffset(from, c.slot)), c.sequence,
                               "recv: chunk sent by", peer));
      UF_CHECK(copyEngineCopy(static_cast<char*>(data) + c.offset, mine + slotOffset(from, c.slot), c.bytes, stream));
      // The sender may now reuse the slot.
      UF_CHECK(ops_->write(stream, flag(theirs, freedOffset(myIndex_, c.slot)), c.sequence));
      p.receivedChunks = c.sequence;
    }
  }
  UF_CHECK(watchdog_->wait(*ops_, stream, flag(mine, transferReadyOffset(from)), sequence,
                           "recv: the transfer sent by", peer));
  return unifabSuccess;
}

Result unifabPpGroup::asyncError() const {
  if (watchdog_ && watchdog_->timedOut()) {
    return UF_ERROR(unifabTimeout, kExt,
                    "an earlier pipeline send/recv on rank %d waited longer than UNIFAB_PP_TIMEOUT_MS for its peer: "
                    "the group is unusable", comm_->rank());
  }
  if (failed_) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "an earlier pipeline send on rank %d could not be issued (see the warning logged then): the "
                    "group is unusable", comm_->rank());
  }
  return unifabSuccess;
}
