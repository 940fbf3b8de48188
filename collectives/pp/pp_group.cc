#include "collectives/pp/pp_group.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#include "collectives/common/agreement.h"
#include "collectives/common/copy_engine.h"
#include "collectives/common/cuda_check.h"
#include "collectives/common/device_range.h"
#include "collectives/common/device_guard.h"
#include "collectives/common/struct_size.h"
#include "collectives/pp/pp_plan.h"
#include "plugin/params.h"

using unifab::collectives::requireStructSize;
using unifab::Result;
using unifab::kLogInit;

namespace unifab::collectives::pp {
namespace {

constexpr size_t kDefaultChunkBytes = size_t{8} << 20;
constexpr int kDefaultSlots = 4;
constexpr size_t kMaxChunkBytes = size_t{1} << 30;
constexpr int kMaxSlots = 64;
constexpr auto kWatchPeriod = std::chrono::milliseconds(1);

}  // namespace

WaitWatchdog::WaitWatchdog(int device, int64_t timeoutMs) : device_(device), timeout_(timeoutMs) {}

Result WaitWatchdog::start() {
  unifab::collectives::DeviceGuard guard(device_);
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&releaseStream_, cudaStreamNonBlocking));
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
            "not post its matching call, or its host is blocked posting more work than its streams' command queues "
            "hold); released it%s; the group is unusable and releases its waits from now on",
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

Result unifabPpGroup::create(ncclComm_t comm, const unifabPpConfig_t* given, unifabPpGroup** out) {
  // Only what makes a collective step impossible returns before the first one.
  if (comm == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "comm=NULL");
  const unifab::collectives::NcclRuntime* nccl = nullptr;
  UF_CHECK(unifab::collectives::ncclRuntime(&nccl));
  const bool present = given != nullptr && out != nullptr;
  const unifabPpConfig_t absent{};  // size 0: refused below
  const unifabPpConfig_t& config = given != nullptr ? *given : absent;
  const bool sized = present && config.size >= sizeof(unifabPpConfig_t);
  const size_t chunkBytes = !sized || config.chunkBytes == 0 ? pp::kDefaultChunkBytes : config.chunkBytes;
  const int slots = !sized || config.chunksInFlight == 0 ? pp::kDefaultSlots : config.chunksInFlight;
  const bool rendezvous = unifab::params().ppEngine == "rendezvous";
  auto checkConfig = [&]() -> Result {
    if (!present) {
      return UF_ERROR(unifabInvalidArgument, kExt, "unifabPpCreate: config=%p and group=%p must not be NULL",
                      static_cast<const void*>(given), static_cast<void*>(out));
    }
    // A rank on the wrong current device takes part too (the agreement runs on the communicator's).
    UF_CHECK(unifab::collectives::requireCommDevice(comm));
    UF_CHECK(requireStructSize(config, "config", "initialise it with UNIFAB_PP_CONFIG_INIT"));
    if (chunkBytes % 16 != 0 || chunkBytes > pp::kMaxChunkBytes) {
      return UF_ERROR(unifabInvalidArgument, kExt, "config->chunkBytes=%zu must be a multiple of 16 in 16..%zu (0: %zu)",
                      config.chunkBytes, pp::kMaxChunkBytes, pp::kDefaultChunkBytes);
    }
    if (slots < 1 || slots > pp::kMaxSlots) {
      return UF_ERROR(unifabInvalidArgument, kExt, "config->chunksInFlight=%d is outside 1..%d (0: %d)",
                      config.chunksInFlight, pp::kMaxSlots, pp::kDefaultSlots);
    }
    return unifabSuccess;
  };
  // Every rank learns whether every rank's configuration is valid and the same (the window's
  // layout follows from it, and from the engine) before any goes on.
  const Result checked = checkConfig();
  const int64_t shared[] = {static_cast<int64_t>(chunkBytes), slots, rendezvous ? 1 : 0};
  static const char* const kSharedNames[] = {"chunkBytes", "chunksInFlight", "UNIFAB_PP_ENGINE (1: rendezvous)"};
  const Result agreed = unifab::collectives::agreeAcrossRanks(*nccl, comm, "unifabPpCreate", checked == unifabSuccess,
                                                              shared, kSharedNames, 3);
  if (checked != unifabSuccess) return checked;
  UF_CHECK(agreed);
  std::unique_ptr<unifabPpGroup> group(new unifabPpGroup());
  int device = -1;
  UF_CUDA_CHECK(cudaGetDevice(&device));
  UF_CHECK(unifab::collectives::DeviceComm::acquire(comm, &group->comm_));
  const auto& dc = *group->comm_;
  group->chunkBytes_ = chunkBytes;
  group->slots_ = slots;
  group->lsaSize_ = dc.lsaSize();
  group->firstLsaRank_ = dc.rank() - dc.lsaRank();
  group->myIndex_ = dc.lsaRank();
  group->flagsBase_ = static_cast<size_t>(group->lsaSize_) * slots * chunkBytes;
  group->rendezvous_ = rendezvous;
  const size_t windowBytes = group->namesOffset() + pp::Inbox::kNameBytes * group->lsaSize_;
  group->sentTo_.assign(group->lsaSize_, 0);
  group->receivedFrom_.assign(group->lsaSize_, 0);
  // This rank's own resources (stream memory operations, the watchdog, the inbox) before the
  // window, whose creation (collective) learns whether every rank got them.
  auto setUpLocal = [&]() -> Result {
    UF_CHECK(pp::streamOps(device, &group->ops_));
    group->watchdog_ = std::make_unique<pp::WaitWatchdog>(dc.cudaDevice(), unifab::params().ppTimeoutMs);
    UF_CHECK(group->watchdog_->start());
    if (group->rendezvous_) {
      UF_CHECK(pp::Inbox::create(group->lsaSize_, &group->myInbox_));
      const Result channel = pp::FdChannel::create(pp::channelNameOf(group->myInbox_->name()), &group->myChannel_);
      if (channel != unifabSuccess) {
        UF_WARN(kExt, "PP group: no descriptor channel (%s): virtual-memory buffers of other processes will not be "
                "mapped here", unifabGetLastError());
      }
      group->rendezvousPeers_.resize(group->lsaSize_);
      for (RendezvousPeer& peer : group->rendezvousPeers_) {
        for (std::vector<cudaEvent_t>& ends : peer.callEnds) {
          ends.assign(pp::Inbox::kRing, nullptr);
          for (cudaEvent_t& e : ends) UF_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        }
      }
    }
    return unifabSuccess;
  };
  const Result setUp = setUpLocal();
  const Result windowed =
      unifab::collectives::SymmetricWindow::create(group->comm_, windowBytes, setUp == unifabSuccess,
                                                   "NVLink peers x config->chunksInFlight x config->chunkBytes",
                                                   &group->window_);
  if (setUp != unifabSuccess) return setUp;
  UF_CHECK(windowed);
  if (group->rendezvous_) UF_CHECK(group->setUpRendezvous());
  UF_INFO(kExt, kLogInit, "PP group: rank %d, %d NVLink peers, %s engine, %d slots of %zu KiB per peer (window %zu MiB)",
          dc.rank(), group->lsaSize_, group->rendezvous_ ? "rendezvous" : "slots", slots, chunkBytes >> 10,
          windowBytes >> 20);
  *out = group.release();
  return unifabSuccess;
}

unifabPpGroup::~unifabPpGroup() {
  if (comm_) {
    trace_.log(comm_->rank());
    unifab::collectives::DeviceGuard guard(comm_->cudaDevice());
    UF_CUDA_WARN(cudaDeviceSynchronize());  // transfers of the group still use its window
    importer_.closeAll();
    for (RendezvousPeer& peer : rendezvousPeers_) {
      for (std::vector<cudaEvent_t>& ends : peer.callEnds) {
        for (cudaEvent_t e : ends) {
          if (e != nullptr) UF_CUDA_WARN(cudaEventDestroy(e));
        }
      }
    }
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

size_t unifabPpGroup::reachedOffset(int side, int peer, uint64_t sequence) const {
  const size_t slotFlags = static_cast<size_t>(2 * lsaSize_) * slots_;
  return flagsBase_ + sizeof(uint64_t) * (slotFlags + (static_cast<size_t>(side) * lsaSize_ + peer) * pp::Inbox::kRing +
                                          (sequence - 1) % pp::Inbox::kRing);
}

size_t unifabPpGroup::servedOffset(int side, int peer, uint64_t sequence) const {
  return reachedOffset(side, peer, sequence) + sizeof(uint64_t) * 2 * lsaSize_ * pp::Inbox::kRing;
}

size_t unifabPpGroup::namesOffset() const { return reachedOffset(0, 0, 1) + sizeof(uint64_t) * 4 * lsaSize_ * pp::Inbox::kRing; }

// Every rank publishes its inbox name in its window; after a barrier each opens its peers'.
Result unifabPpGroup::setUpRendezvous() {
  char name[pp::Inbox::kNameBytes] = {};
  snprintf(name, sizeof(name), "%s", myInbox_->name());
  const Result published = [&]() -> Result {
    UF_CUDA_CHECK(cudaMemcpy(window_->localBase() + namesOffset() + pp::Inbox::kNameBytes * myIndex_, name,
                             sizeof(name), cudaMemcpyHostToDevice));
    UF_CUDA_CHECK(cudaDeviceSynchronize());  // landed before the peers read it, after the agreement
    return unifabSuccess;
  }();
  const Result allPublished = unifab::collectives::agreeAcrossRanks(
      comm_->nccl(), comm_->comm(), "unifabPpCreate (publishing the inboxes)", published == unifabSuccess);
  if (published != unifabSuccess) return published;
  UF_CHECK(allPublished);
  const std::string myProcess = pp::Inbox::processOf(myInbox_->name());
  auto openPeers = [&]() -> Result {
    for (int p = 0; p < lsaSize_; ++p) {
      if (p == myIndex_) continue;  // a rank's transfers to itself take the slots
      char theirs[pp::Inbox::kNameBytes];
      UF_CUDA_CHECK(cudaMemcpy(theirs, window_->peerBases()[p] + namesOffset() + pp::Inbox::kNameBytes * p,
                               sizeof(theirs), cudaMemcpyDeviceToHost));
      theirs[sizeof(theirs) - 1] = '\0';
      RendezvousPeer& peer = rendezvousPeers_[p];
      UF_CHECK(pp::Inbox::open(theirs, lsaSize_, &peer.inbox));
      peer.channel = pp::channelNameOf(theirs);
      peer.sameProcess = pp::Inbox::processOf(theirs) == myProcess;
    }
    return unifabSuccess;
  };
  const Result opened = openPeers();
  // Descriptor channels in use only if every rank reaches every other process's (abstract sockets
  // belong to a network namespace); else no rank posts virtual-memory buffers as mappable.
  int64_t unreachable = opened == unifabSuccess && myChannel_ != nullptr ? 0 : 1;
  if (unreachable == 0) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    for (int p = 0; p < lsaSize_ && unreachable == 0; ++p) {
      if (p == myIndex_ || rendezvousPeers_[p].sameProcess) continue;
      if (myChannel_->send(rendezvousPeers_[p].channel, 0, -1, deadline) != unifabSuccess) unreachable = 1;
    }
  }
  UF_CHECK(unifab::collectives::allRanksMax(comm_->nccl(), comm_->comm(), &unreachable, 1));
  if (unreachable != 0 && myChannel_ != nullptr) {
    UF_INFO(kExt, kLogInit, "PP group: a rank cannot reach another's descriptor channel; virtual-memory buffers are "
            "moved by their own side");
    myChannel_.reset();
  }
  // Everybody has every inbox open, and the names can go; or a rank could not open one, and every
  // rank learns it here instead of waiting for it.
  const Result allOpened = unifab::collectives::agreeAcrossRanks(comm_->nccl(), comm_->comm(),
                                                                 "unifabPpCreate (opening the peers' inboxes)",
                                                                 opened == unifabSuccess);
  if (opened != unifabSuccess) return opened;
  UF_CHECK(allOpened);
  myInbox_->unlink();
  return unifabSuccess;
}

// One call of either side. The sequence is taken under the group's lock; the waits on the host
// (for this ring position's previous call to end, for the other side's previous use of the
// rendezvous entry) happen outside it, so that another thread's call can make the progress waited
// for; the stream operations are posted under it again.
Result unifabPpGroup::rendezvousCall(int side, void* data, size_t bytes, int to, cudaStream_t stream,
                                     CallClock& clock) {
  using Step = pp::HostTrace::Step;
  const int peerRank = firstLsaRank_ + to;
  const char* call = side == pp::kSendSide ? "send" : "recv";
  RendezvousPeer& peer = rendezvousPeers_[to];
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t sequence = ++peer.transfers[side];
  pp::Posting mine{};
  mine.bytes = bytes;
  mine.address = reinterpret_cast<uintptr_t>(data);
  pp::RendezvousEntry& entry = side == pp::kSendSide ? peer.inbox->entry(myIndex_, sequence) : myInbox_->entry(to, sequence);
  // A call that finds the peer's posting comes second whatever happens meanwhile (a posting is
  // never withdrawn): its own buffer is never described to the peer, so it is not described at all
  // (a description asks the driver about the pointer, a few microseconds).
  const bool certainlySecond = pp::postedAlone(entry, sequence, 1 - side);
  if (!peer.sameProcess && !certainlySecond) {  // threads share addresses
    UF_CHECK(exporter_.describe(data, bytes, myChannel_ != nullptr, &mine));
  }
  clock.lap(Step::kDescribe);
  // A buffer the peer's process cannot map (a stream-ordered pool, a buffer across two cuMem
  // mappings) is moved by this side's copy engine: this call waits for the peer's posting and
  // comes second.
  const bool mayBeFirst = bytes == 0 || peer.sameProcess || certainlySecond || mine.mappable != 0;
  cudaEvent_t previous = peer.callEnds[side][(sequence - 1) % pp::Inbox::kRing];
  lock.unlock();
  // Flags are rings of kRing per peer: the call that last used this position must have ended on
  // its stream before this one posts a flag there.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(unifab::params().ppTimeoutMs);
  auto waitHost = [&](const auto& done, const char* what) -> Result {
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) {
        return UF_ERROR(unifabTimeout, kExt, "pipeline %s %llu with rank %d: %s within UNIFAB_PP_TIMEOUT_MS "
                        "(at most %d transfers per direction may be in flight)", call,
                        static_cast<unsigned long long>(sequence), peerRank, what, pp::Inbox::kRing);
      }
      std::this_thread::yield();
    }
    return unifabSuccess;
  };
  cudaError_t queried = cudaSuccess;
  UF_CHECK(waitHost([&] { queried = cudaEventQuery(previous); return queried != cudaErrorNotReady; },
                    "the call that used the same flags has not ended"));
  UF_CUDA_CHECK(queried);
  clock.lap(Step::kRingWait);
  pp::Arrival arrival = pp::Arrival::kBusy;
  pp::Posting first{};  // the other side's posting, when this call is second
  UF_CHECK(waitHost([&] { arrival = pp::arrive(entry, sequence, pp::Inbox::kRing, side, mine, &first, mayBeFirst);
                          return arrival != pp::Arrival::kBusy; },
                    mayBeFirst ? "the peer has not posted the transfer that used the same rendezvous entry"
                               : "another process cannot map this buffer (a stream-ordered pool, or virtual memory "
                                 "that no single mapping holds or whose handle cannot be passed), so this call waits for "
                                 "the peer's matching call to be posted (if that buffer cannot be mapped either, allocate "
                                 "one of the two with cudaMalloc or ncclMemAlloc, or use UNIFAB_PP_ENGINE=slots)"));
  clock.lap(Step::kArrive);
  // Outside the group's lock, which another thread's call of this process may need meanwhile: the
  // handle of a buffer the peer will map goes to its channel (the peer waits for it), and a second
  // call maps the first side's buffer (waiting for its handle if it is virtual memory).
  if (arrival == pp::Arrival::kFirst && bytes > 0 && !peer.sameProcess) {
    UF_CHECK(exporter_.deliver(mine, myChannel_.get(), peer.channel, myIndex_, deadline));
  }
  char* mappedFirst = nullptr;
  if (arrival == pp::Arrival::kSecond && bytes > 0 && !peer.sameProcess && first.mappable != 0 && first.bytes == bytes) {
    UF_CHECK(importer_.map(to, first, myChannel_.get(), deadline, &mappedFirst));
  }
  clock.lap(Step::kHandles);
  lock.lock();
  char* local = window_->localBase();
  char* theirs = window_->peerBases()[to];
  const int other = 1 - side;
  if (arrival == pp::Arrival::kFirst) {
    // Tell the other side's stream that ours has reached the transfer (the buffer is ready to be
    // read, or to be written), then wait for it to have moved the data.
    UF_CHECK(ops_->write(stream, reinterpret_cast<uint64_t*>(theirs + reachedOffset(side, myIndex_, sequence)), sequence));
    UF_CHECK(watchdog_->wait(*ops_, stream, reinterpret_cast<uint64_t*>(local + servedOffset(side, to, sequence)), sequence,
                             side == pp::kSendSide ? "send: the matching receive of" : "recv: the matching send of",
                             peerRank));
  } else {
    if (first.bytes != bytes) {
      return UF_ERROR(unifabInvalidUsage, kExt, "pipeline %s %llu with rank %d: %zu bytes here, %llu bytes there "
                      "(matched calls must move the same bytes); rank %d's call will time out",
                      call, static_cast<unsigned long long>(sequence), peerRank, bytes,
                      static_cast<unsigned long long>(first.bytes), peerRank);
    }
    char* firstData = reinterpret_cast<char*>(first.address);
    if (bytes > 0 && peer.sameProcess && !peer.peerAccess) {
      // Another thread's GPU in this process: its buffer is addressable as it is once peer access
      // from this GPU is on.
      cudaPointerAttributes attributes{};
      UF_CUDA_CHECK(cudaPointerGetAttributes(&attributes, firstData));
      const cudaError_t enabled = cudaDeviceEnablePeerAccess(attributes.device, 0);
      if (enabled == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
      } else {
        UF_CUDA_CHECK(enabled);
      }
      peer.peerAccess = true;
    }
    if (bytes > 0 && !peer.sameProcess) {
      if (first.mappable == 0) {
        // A call with an unmappable buffer never comes first (mayBeFirst), so this is a peer that
        // does not follow that protocol.
        return UF_ERROR(unifabInternalError, kExt, "pipeline %s %llu with rank %d: rank %d came first with a buffer "
                        "this process cannot map (do both ranks load the same unifab build?); its call will time out",
                        call, static_cast<unsigned long long>(sequence), peerRank, peerRank);
      }
      firstData = mappedFirst;
    }
    UF_CHECK(watchdog_->wait(*ops_, stream, reinterpret_cast<uint64_t*>(local + reachedOffset(other, to, sequence)),
                             sequence, side == pp::kSendSide ? "send: the receive buffer of" : "recv: the send buffer of",
                             peerRank));
    if (bytes > 0) {
      // A peer copy either way (the send buffer into the peer's receive buffer, or the peer's send
      // buffer into ours): the copy engine of this GPU.
      UF_CHECK(side == pp::kSendSide ? unifab::collectives::copyEngineCopy(firstData, data, bytes, stream)
                                     : unifab::collectives::copyEngineCopy(data, firstData, bytes, stream));
    }
    UF_CHECK(ops_->write(stream, reinterpret_cast<uint64_t*>(theirs + servedOffset(other, myIndex_, sequence)), sequence));
  }
  UF_CUDA_CHECK(cudaEventRecord(previous, stream));
  clock.lap(Step::kStreamOps);
  clock.finish(side, arrival == pp::Arrival::kFirst ? pp::HostTrace::kFirst : pp::HostTrace::kSecond);
  return unifabSuccess;
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
  const bool throughSlots = !rendezvous_ || *index == myIndex_;
  if (throughSlots && pp::chunkCount(bytes, chunkBytes_) > pp::kMaxChunksPerCall) {
    return UF_ERROR(unifabInvalidArgument, kExt,
                    "bytes=%zu needs %zu chunks of the group's %zu-byte slots; a call takes at most %zu (%zu bytes): "
                    "split the transfer or create the group with a larger chunkBytes",
                    bytes, pp::chunkCount(bytes, chunkBytes_), chunkBytes_, pp::kMaxChunksPerCall,
                    pp::kMaxChunksPerCall * chunkBytes_);
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  UF_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "pipeline send/recv cannot be captured in a CUDA graph: chunks are numbered on the host");
  }
  UF_CHECK(unifab::collectives::checkStreamDevice(stream, comm_->cudaDevice()));
  // Before the call is numbered or paired: a bad range found by the copy would leave the peer's
  // matching call waiting for the watchdog.
  UF_CHECK(checkedRanges_.check(data, bytes, comm_->cudaDevice(), "data"));
  return unifabSuccess;
}

Result unifabPpGroup::send(const void* data, size_t bytes, int peer, cudaStream_t stream) {
  CallClock clock(trace_);
  int to = 0;
  UF_CHECK(checkCall(data, bytes, peer, stream, &to));
  unifab::collectives::DeviceGuard guard(comm_->cudaDevice());
  clock.lap(pp::HostTrace::kCheck);
  const Result sent = rendezvous_ && to != myIndex_
                          ? rendezvousCall(pp::kSendSide, const_cast<void*>(data), bytes, to, stream, clock)
                          : slotSend(data, bytes, to, stream, clock);
  return sent == unifabSuccess ? sent : failedMidway(sent, "send", peer);
}

Result unifabPpGroup::recv(void* data, size_t bytes, int peer, cudaStream_t stream) {
  CallClock clock(trace_);
  int from = 0;
  UF_CHECK(checkCall(data, bytes, peer, stream, &from));
  unifab::collectives::DeviceGuard guard(comm_->cudaDevice());
  clock.lap(pp::HostTrace::kCheck);
  const Result received = rendezvous_ && from != myIndex_ ? rendezvousCall(pp::kRecvSide, data, bytes, from, stream, clock)
                                                         : slotRecv(data, bytes, from, stream, clock);
  return received == unifabSuccess ? received : failedMidway(received, "recv", peer);
}

Result unifabPpGroup::failedMidway(Result failure, const char* call, int peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (broken_.load() == unifabSuccess) {
    const char* why = unifab::lastErrorMessage();
    brokenMessage_ = std::string(call) + " with rank " + std::to_string(peer) + ": " + (why != nullptr ? why : "");
    broken_.store(failure);
  }
  return failure;
}

Result unifabPpGroup::slotSend(const void* data, size_t bytes, int to, cudaStream_t stream, CallClock& clock) {
  const int peer = firstLsaRank_ + to;
  std::lock_guard<std::mutex> lock(mutex_);
  char* mine = window_->peerBases()[myIndex_];
  char* theirs = window_->peerBases()[to];
  for (const pp::Chunk& c : pp::planChunks(bytes, chunkBytes_, slots_, sentTo_[to])) {
    if (c.reuseAfter > 0) {
      // The peer has copied out the chunk that last used this slot.
      UF_CHECK(watchdog_->wait(*ops_, stream, reinterpret_cast<uint64_t*>(mine + freedOffset(to, c.slot)), c.reuseAfter,
                               "send: slot freed by", peer));
    }
    UF_CHECK(unifab::collectives::copyEngineCopy(theirs + slotOffset(myIndex_, c.slot),
                                                 static_cast<const char*>(data) + c.offset, c.bytes, stream));
    UF_CHECK(ops_->write(stream, reinterpret_cast<uint64_t*>(theirs + readyOffset(myIndex_, c.slot)), c.sequence));
    sentTo_[to] = c.sequence;
  }
  clock.lap(pp::HostTrace::kStreamOps);
  clock.finish(pp::kSendSide, pp::HostTrace::kSlots);
  return unifabSuccess;
}

Result unifabPpGroup::slotRecv(void* data, size_t bytes, int from, cudaStream_t stream, CallClock& clock) {
  const int peer = firstLsaRank_ + from;
  std::lock_guard<std::mutex> lock(mutex_);
  char* mine = window_->peerBases()[myIndex_];
  char* theirs = window_->peerBases()[from];
  for (const pp::Chunk& c : pp::planChunks(bytes, chunkBytes_, slots_, receivedFrom_[from])) {
    UF_CHECK(watchdog_->wait(*ops_, stream, reinterpret_cast<uint64_t*>(mine + readyOffset(from, c.slot)), c.sequence,
                             "recv: chunk sent by", peer));
    UF_CHECK(unifab::collectives::copyEngineCopy(static_cast<char*>(data) + c.offset, mine + slotOffset(from, c.slot),
                                                 c.bytes, stream));
    // The sender may now reuse the slot.
    UF_CHECK(ops_->write(stream, reinterpret_cast<uint64_t*>(theirs + freedOffset(myIndex_, c.slot)), c.sequence));
    receivedFrom_[from] = c.sequence;
  }
  clock.lap(pp::HostTrace::kStreamOps);
  clock.finish(pp::kRecvSide, pp::HostTrace::kSlots);
  return unifabSuccess;
}

Result unifabPpGroup::asyncError() const {
  if (const int broken = broken_.load(); broken != unifabSuccess) {
    std::lock_guard<std::mutex> lock(mutex_);
    return UF_ERROR(static_cast<Result>(broken), kExt,
                    "an earlier pipeline call failed after it was numbered, so its peer's matching call is out of "
                    "step and the group is unusable (%s)", brokenMessage_.c_str());
  }
  if (watchdog_ && watchdog_->timedOut()) {
    return UF_ERROR(unifabTimeout, kExt,
                    "an earlier pipeline send/recv on rank %d waited longer than UNIFAB_PP_TIMEOUT_MS for its peer: "
                    "the group is unusable", comm_->rank());
  }
  return unifabSuccess;
}
