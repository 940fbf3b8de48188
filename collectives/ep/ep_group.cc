#include "collectives/ep/ep_group.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "collectives/common/agreement.h"
#include "collectives/common/cuda_check.h"
#include "collectives/common/device_guard.h"
#include "collectives/common/struct_size.h"
#include "collectives/ep/ep_common.h"
#include "collectives/ep/ll_trace.h"
#include "plugin/params.h"
#include "tuner/ep_policy.h"
#include "tuner/topology.h"

using unifab::collectives::requireStructSize;
using unifab::Result;
using unifab::kLogInit;
namespace kep = unifab::kernels::ep;

// hostCounts copies one count per local expert; a group has at most kMaxExperts of them.
static_assert(sizeof(unifabEpDispatchResult_t::hostRecvRowsPerExpert) / sizeof(int) >= kep::kMaxExperts,
              "hostRecvRowsPerExpert must hold every local expert");

namespace unifab::collectives::ep {
namespace {

constexpr int kMaxExpertAlignment = 128;
constexpr int kMaxTokensPerRank = 1 << 20;

int expertRowCapacity(const unifabEpConfig_t& config, int nRanks) {
  int localExperts = config.numExperts / nRanks;
  return nRanks * config.maxTokensPerRank * std::min(config.topk, localExperts) + localExperts * (kMaxExpertAlignment - 1);
}

}  // namespace

Result validateConfig(const unifabEpConfig_t& config, int nRanks) {
  UF_CHECK(requireStructSize(config, "config", "initialise it with UNIFAB_EP_CONFIG_INIT"));
  if (rawEnum(config.mode) != unifabEpHighThroughput && rawEnum(config.mode) != unifabEpLowLatency) {
    return UF_ERROR(unifabInvalidArgument, kExt, "config->mode=%d is neither unifabEpHighThroughput (0) nor unifabEpLowLatency (1)",
                    rawEnum(config.mode));
  }
  if (nRanks < 1 || nRanks > kep::kMaxRanks) {
    return UF_ERROR(unifabInvalidArgument, kExt, "nRanks=%d (the communicator's ranks) is outside the 1..%d an EP group supports",
                    nRanks, kep::kMaxRanks);
  }
  if (config.numExperts < nRanks || config.numExperts > kep::kMaxExperts || config.numExperts % nRanks != 0) {
    return UF_ERROR(unifabInvalidArgument, kExt, "config->numExperts=%d must be a multiple of the %d ranks in %d..%d",
                    config.numExperts, nRanks, nRanks, kep::kMaxExperts);
  }
  if (config.topk < 1 || config.topk > kep::kMaxTopk || config.topk > config.numExperts) {
    return UF_ERROR(unifabInvalidArgument, kExt, "config->topk=%d is outside 1..min(%d, numExperts=%d)", config.topk,
                    kep::kMaxTopk, config.numExperts);
  }
  if (config.hidden < 128 || config.hidden % 128 != 0 || config.hidden > (1 << 16)) {
    return UF_ERROR(unifabInvalidArgument, kExt,
                    "config->hidden=%d must be a multiple of 128 in 128..65536 (FP8 scales cover 128 values)",
                    config.hidden);
  }
  if (config.maxTokensPerRank < 1 || config.maxTokensPerRank > kMaxTokensPerRank) {
    return UF_ERROR(unifabInvalidArgument, kExt, "config->maxTokensPerRank=%d is outside 1..%d", config.maxTokensPerRank,
                    kMaxTokensPerRank);
  }
  if (config.mode == unifabEpLowLatency && config.maxTokensPerRank > kMaxLowLatencyTokens) {
    return UF_ERROR(unifabInvalidArgument, kExt, "config->maxTokensPerRank=%d: a low-latency group takes at most %d",
                    config.maxTokensPerRank, kMaxLowLatencyTokens);
  }
  if (config.maxSms < 0) return UF_ERROR(unifabInvalidArgument, kExt, "config->maxSms=%d is negative", config.maxSms);
  if (config.programmaticLaunch != 0 && config.programmaticLaunch != 1) {
    return UF_ERROR(unifabInvalidArgument, kExt, "config->programmaticLaunch=%d is neither 0 nor 1", config.programmaticLaunch);
  }
  return unifabSuccess;
}

namespace {

// The most serious error among the bits in `code`: a timeout leaves the group unusable.
const char* errorName(int code) {
  if (code & kep::kErrorCallMismatch) {
    return "ranks made different dispatches (a cached re-dispatch on some ranks only, or of different routings): "
           "every rank must make the same EP calls";
  }
  if (code & kep::kErrorTimeout) {
    return "a peer did not signal within UNIFAB_EP_TIMEOUT_MS (it stopped, or ranks issued different calls)";
  }
  if (code & kep::kErrorBadExpertId) return "a top-k expert id was outside -1..numExperts-1 (it was treated as -1)";
  return "unknown device error";
}

// What each trace point records (kernels/ep/ep_types.h: TracePoint), as the log names it.
const char* const kTraceNames[] = {
    "dispatch: epoch read", "dispatch: top-k entries loaded", "dispatch: masks known (thread 0)", "dispatch: token lists written",
    "dispatch: layout, words sent", "dispatch: peers' start words in", "dispatch: own count words in",
    "dispatch: count words in", "dispatch: receive counts", "dispatch: remote rows written",
    "dispatch: local rows written", "dispatch: peers' rows in", "combine: start handshake", "combine: partials sent",
    "combine: last tokens helped", "combine: tokens reduced", "combine: last block done",
    "LL dispatch: epochs read", "LL dispatch: first part quantized", "LL dispatch: warp's lines stored",
    "LL dispatch: warp's last item done", "LL dispatch: first message's lines in",
    "LL dispatch: warp's rows stored", "LL dispatch: warp's exit", "LL dispatch: first message's header seen",
    "LL dispatch: first part's ids in", "LL dispatch: first part's values in", "LL dispatch: bitmap mask known",
    "LL dispatch: bitmap word stored", "LL dispatch: first message's rows known",
    "LL combine: epochs read",
    "LL combine: first rows summed", "LL combine: warp's first lines stored", "LL combine: warp's last lines stored",
    "LL combine: first partials' lines in", "LL combine: warp's tokens summed", "LL combine: warp's exit"};
static_assert(sizeof(kTraceNames) / sizeof(kTraceNames[0]) == kep::kTracePoints, "a name for every trace point");

double medianUs(std::vector<unsigned long long>& ns) {
  std::sort(ns.begin(), ns.end());
  return ns.empty() ? 0.0 : static_cast<double>(ns[ns.size() / 2]) / 1e3;
}

void logTracePoint(int rank, int point, double meanUs, unsigned long long count, std::vector<unsigned long long>& latest,
                   std::vector<unsigned long long>& earliest) {
  const double last = medianUs(latest), first = medianUs(earliest);
  UF_INFO(kExt, kLogInit,
          "EP trace rank %d: %-30s %9.1f us after the call's start (mean of %llu), latest block %9.1f us, earliest "
          "%9.1f us (medians of %zu calls)", rank, kTraceNames[point], meanUs, count, last, first, latest.size());
}

}  // namespace

RoutingBuffers::~RoutingBuffers() {
  if (memory_ != nullptr) UF_CUDA_WARN(cudaFree(memory_));
}

Result RoutingBuffers::allocate(const kep::GroupView& view) {
  const int n = view.nRanks;
  const int tokens = view.maxTokensPerRank;
  const int capacity = view.layout.recvCapacity;
  return allocateCarved(&memory_, [&](Carver& carve) {
    routing.tokenRanks = carve.take<uint64_t>(tokens);
    routing.tokenSlot = carve.take<int>(static_cast<size_t>(tokens) * n);
    routing.topkIds = carve.take<int>(static_cast<size_t>(tokens) * view.topk);
    routing.topkWeights = carve.take<float>(static_cast<size_t>(tokens) * view.topk);
    routing.sendOffset = carve.take<int>(n);
    routing.sendRows = carve.take<int>(n);
    routing.sendTokens = carve.take<int>(static_cast<size_t>(tokens) * n);
    routing.recvRowsPerRank = carve.take<int>(n);
    routing.recvRowsPerExpert = carve.take<int>(view.numLocalExperts);
    routing.expertOffsets = carve.take<int>(view.numLocalExperts + 1);
    routing.numRecvRows = carve.take<int>(1);
    routing.numExpertRows = carve.take<int>(1);
    routing.expertSlot = carve.take<int>(static_cast<size_t>(capacity) * view.topk);
  });
}

Result RoutingPool::take(bool mayAllocate, std::unique_ptr<RoutingBuffers>* buffers) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!free_.empty()) {
      *buffers = std::move(free_.back());
      free_.pop_back();
      return unifabSuccess;
    }
  }
  if (!mayAllocate) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "every prepared routing is held by a live handle and a capturing stream cannot allocate another: "
                    "destroy unused handles (unifabEpHandleDestroy) before capturing");
  }
  auto created = std::make_unique<RoutingBuffers>();
  UF_CHECK(created->allocate(view_));
  *buffers = std::move(created);
  return unifabSuccess;
}

void RoutingPool::give(std::unique_ptr<RoutingBuffers> buffers) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(std::move(buffers));
}

}  // namespace unifab::collectives::ep

using unifab::collectives::ep::RoutingBuffers;
using unifab::collectives::ep::rawEnum;

unifabEpHandle::~unifabEpHandle() {
  if (pool && buffers) pool->give(std::move(buffers));
}

Result unifabEpGroup::planLayout(const unifabEpConfig_t& config, int nRanks, kep::WindowLayout* layout) {
  UF_CHECK(unifab::collectives::ep::validateConfig(config, nRanks));
  kep::WindowLayout L{};
  L.recvCapacity = nRanks * config.maxTokensPerRank;
  L.rowBytes = config.hidden * 2;
  const size_t cap = static_cast<size_t>(L.recvCapacity);
  unifab::collectives::ep::Carver window(nullptr);  // offsets only: the window is allocated by NCCL
  L.control = window.reserve(sizeof(kep::Control));
  for (int set = 0; set < 2; ++set) {
    L.blockWords[set] = window.reserve(sizeof(uint64_t) * static_cast<size_t>(nRanks) * kep::kMaxBlocks * nRanks);
    L.blockExpertWords[set] =
        window.reserve(sizeof(uint64_t) * static_cast<size_t>(nRanks) * kep::kMaxBlocks * (config.numExperts / nRanks));
  }
  L.recvX = window.reserve(cap * L.rowBytes);
  L.recvScales = window.reserve(sizeof(float) * cap * (config.hidden / kep::kScaleBlock));
  L.recvTopk = window.reserve(sizeof(int) * cap * config.topk);
  L.recvWeights = window.reserve(sizeof(float) * cap * config.topk);
  L.recvSource = window.reserve(sizeof(int) * cap * 2);
  L.combineX = window.reserve(static_cast<size_t>(nRanks) * config.maxTokensPerRank * config.hidden * 2);
  L.combineWeights = window.reserve(sizeof(float) * static_cast<size_t>(nRanks) * config.maxTokensPerRank * config.topk);
  L.combineFlags = window.reserve(sizeof(uint64_t) * static_cast<size_t>(nRanks) * config.maxTokensPerRank);
  // The combine input shares the partials' region (both are recvCapacity rows): a combine either
  // pushes partials into the peers' regions or reads the rows in place there, on every rank alike,
  // and each kind ends only once the region has been read (pushed partials reduced; rows read by
  // every peer, combineRead), before the next call may write it.
  L.combineIn = L.combineX;
  L.total = window.used();
  *layout = L;
  return unifabSuccess;
}

Result unifabEpGroup::create(ncclComm_t comm, const unifabEpConfig_t* given, unifabEpGroup** out) {
  // Only what makes a collective step impossible returns before the first one.
  if (comm == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "comm=NULL");
  const bool present = given != nullptr && out != nullptr;
  const unifabEpConfig_t absent{};  // size 0: every check below refuses it
  const unifabEpConfig_t& config = given != nullptr ? *given : absent;
  const unifab::collectives::NcclRuntime* nccl = nullptr;
  UF_CHECK(unifab::collectives::ncclRuntime(&nccl));
  int nRanks = 0;
  UF_NCCL_CHECK(nccl->commCount(comm, &nRanks), comm);
  // Every rank learns whether every rank's configuration was valid, and the same, before any
  // rank goes further: a rank that returned alone would leave its peers waiting in NCCL, and
  // windows sized differently would let peers write past each other's.
  const bool sized = present && config.size >= sizeof(unifabEpConfig_t);
  const bool lowLatency = sized && rawEnum(config.mode) == unifabEpLowLatency;  // any bit pattern may be there
  kep::WindowLayout layout{};
  kep::LlLayout llLayout{};
  // A rank on the wrong current device takes part too (the agreement runs on the communicator's).
  const Result onDevice = unifab::collectives::requireCommDevice(comm);
  const Result linesCarried = lowLatency && onDevice == unifabSuccess ? requireFlaggedLineLinks(nRanks) : unifabSuccess;
  const Result planned =
      !present ? UF_ERROR(unifabInvalidArgument, kExt, "unifabEpCreate: config=%p and group=%p must not be NULL",
                          static_cast<const void*>(given), static_cast<void*>(out))
      : onDevice != unifabSuccess     ? onDevice
      : linesCarried != unifabSuccess ? linesCarried
      : lowLatency                    ? planLowLatencyLayout(config, nRanks, &llLayout)
                                      : planLayout(config, nRanks, &layout);
  const int64_t shared[] = {sized ? rawEnum(config.mode) : -1, sized ? config.numExperts : -1,
                            sized ? config.maxTokensPerRank : -1, sized ? config.hidden : -1, sized ? config.topk : -1};
  static const char* const kSharedNames[] = {"mode", "numExperts", "maxTokensPerRank", "hidden", "topk"};
  const Result agreed = unifab::collectives::agreeAcrossRanks(*nccl, comm, "unifabEpCreate", planned == unifabSuccess,
                                                              shared, kSharedNames, 5);
  if (planned != unifabSuccess) return planned;
  UF_CHECK(agreed);

  std::unique_ptr<unifabEpGroup> group(new unifabEpGroup());
  UF_CHECK(unifab::collectives::DeviceComm::acquire(comm, &group->comm_));
  const auto& dc = *group->comm_;
  if (dc.lsaSize() != dc.nRanks()) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "EP in this version needs every rank in one NVLink domain: %d of %d ranks are LSA peers (the "
                    "network path is not implemented yet)", dc.lsaSize(), dc.nRanks());
  }
  group->config_ = config;
  // This rank's own memory comes first; the window's creation (collective) learns whether every
  // rank got its own before any registers.
  auto allocate = [&]() -> Result {
    UF_CHECK(group->initDeviceState());
    return lowLatency ? group->initLowLatency(llLayout) : group->initHighThroughput(layout);
  };
  const Result allocated = allocate();
  const Result windowed = unifab::collectives::SymmetricWindow::create(
      group->comm_, lowLatency ? llLayout.total : layout.total, allocated == unifabSuccess,
      "config->maxTokensPerRank, hidden, topk and numExperts (unifabEpBufferSize)", &group->window_);
  if (allocated != unifabSuccess) return allocated;
  UF_CHECK(windowed);
  for (int r = 0; r < dc.nRanks(); ++r) {
    if (lowLatency) {
      group->llView_.peerBase[r] = group->window_->peerBases()[r];
    } else {
      group->view_.peerBase[r] = group->window_->peerBases()[r];
    }
  }
  if (lowLatency) {
    UF_INFO(kExt, kLogInit,
            "EP low-latency group: %d ranks, %d experts (%d per rank), hidden %d, top-%d, %d tokens per rank; window "
            "%zu MiB, receive rows %zu per set; up to %d SMs per call", dc.nRanks(), config.numExperts,
            config.numExperts / dc.nRanks(), config.hidden, config.topk, config.maxTokensPerRank, llLayout.total >> 20,
            static_cast<size_t>(group->llView_.numLocalExperts) * group->llView_.expertStride, group->defaultSms_);
  } else {
    UF_INFO(kExt, kLogInit,
            "EP group: %d ranks, %d experts (%d per rank), hidden %d, top-%d, %d tokens per rank; window %zu MiB, "
            "expert-major rows %d; %d SMs per call", dc.nRanks(), config.numExperts, config.numExperts / dc.nRanks(),
            config.hidden, config.topk, config.maxTokensPerRank, layout.total >> 20, group->expertRows_.capacity,
            group->defaultSms_);
  }
  *out = group.release();
  return unifabSuccess;
}

Result unifabEpGroup::initDeviceState() {
  UF_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&hostError_), sizeof(int), cudaHostAllocMapped));
  *hostError_ = 0;
  UF_CUDA_CHECK(cudaDeviceGetAttribute(&deviceSms_, cudaDevAttrMultiProcessorCount, comm_->cudaDevice()));
  // validateSms keeps every call's block count at or below it.
  deviceSms_ = std::min(deviceSms_, kep::kMaxBlocks);
  return unifabSuccess;
}

Result unifabEpGroup::initHighThroughput(const kep::WindowLayout& layout) {
  const auto& dc = *comm_;
  const unifabEpConfig_t& config = config_;

  kep::GroupView& v = view_;
  v.rank = dc.rank();
  v.nRanks = dc.nRanks();
  v.numExperts = config.numExperts;
  v.numLocalExperts = config.numExperts / dc.nRanks();
  v.hidden = config.hidden;
  v.topk = config.topk;
  v.maxTokensPerRank = config.maxTokensPerRank;
  v.layout = layout;
  v.timeoutNs = static_cast<uint64_t>(unifab::params().epTimeoutMs) * 1000000ULL;
  v.testStallNs = static_cast<uint64_t>(unifab::params().epTestStallUs) * 1000ULL;
  v.maxBlocks = deviceSms_;

  // Counters and the expert-major copy live in ordinary device memory: only this GPU touches them.
  const int expertCapacity = unifab::collectives::ep::expertRowCapacity(config, dc.nRanks());
  const size_t cap = static_cast<size_t>(expertCapacity);
  kep::ExpertMajorRows& rows = expertRows_;
  UF_CHECK(unifab::collectives::ep::allocateCarved(&deviceMemory_, [&](unifab::collectives::ep::Carver& carve) {
    v.epochs = carve.take<kep::Epochs>(1);
    v.sync = carve.take<kep::GridSync>(1);
    v.blockTokenStride = v.maxTokensPerRank + v.maxBlocks;
    v.blockTokens = carve.take<int>(static_cast<size_t>(v.nRanks) * v.blockTokenStride);
    v.error = carve.take<int>(1);
    v.trace = unifab::params().epTrace ? carve.take<unsigned long long>(kep::kTraceWords) : nullptr;
    rows.x = carve.take<char>(cap * layout.rowBytes);
    rows.scales = carve.take<float>(cap * (config.hidden / kep::kScaleBlock));
    rows.topk = carve.take<int>(cap * config.topk);
    rows.weights = carve.take<float>(cap * config.topk);
    rows.source = carve.take<int>(cap * 2);
  }));
  expertRows_.capacity = expertCapacity;

  UF_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&v.hostError), hostError_, 0));
  UF_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&hostCounts_), sizeof(int) * (kep::kMaxExperts + 1),
                              cudaHostAllocDefault));

  unifab::tuner::EpSmQuery query;
  query.nRanks = dc.nRanks();
  query.deviceSms = deviceSms_;
  query.nvlinkGBps = unifab::tuner::localGpu().nvlinkGBps;
  defaultSms_ = unifab::tuner::epHighThroughputSms(query);
  // A few routings made now: handles in use at once rarely exceed this, and beyond it the next
  // dispatch allocates (outside graph capture). The pool sizes them from the view, whose peer
  // bases the window fills in later.
  constexpr int kPreparedRoutings = 4;
  pool_ = std::make_shared<unifab::collectives::ep::RoutingPool>(v);
  for (int i = 0; i < kPreparedRoutings; ++i) {
    auto buffers = std::make_unique<RoutingBuffers>();
    UF_CHECK(buffers->allocate(v));
    pool_->give(std::move(buffers));
  }
  if (config.maxSms > 0) defaultSms_ = std::min(defaultSms_, config.maxSms);
  return unifabSuccess;
}

namespace unifab::collectives::ep {

Result checkTopkAlignment(const void* topkIdx, size_t idBytes, const float* topkWeights) {
  if (topkIdx != nullptr && !alignedTo(topkIdx, idBytes)) {
    return UF_ERROR(unifabInvalidArgument, kExt, "topkIdx=%p must be aligned to its %zu-byte ids", topkIdx, idBytes);
  }
  if (topkWeights != nullptr && !alignedTo(topkWeights, sizeof(float))) {
    return UF_ERROR(unifabInvalidArgument, kExt, "topkWeights=%p must be aligned to 4 bytes (floats)",
                    static_cast<const void*>(topkWeights));
  }
  return unifabSuccess;
}

}  // namespace unifab::collectives::ep

namespace {

// The ids of the groups that exist: a handle may outlive its group. Never destroyed, so that a
// group or handle freed by another static's destructor at exit still finds them.
std::mutex& liveGroupsMutex() {
  static auto* m = new std::mutex;
  return *m;
}
std::unordered_set<uint64_t>& liveGroups() {
  static auto* ids = new std::unordered_set<uint64_t>;
  return *ids;
}
std::unordered_set<const unifabEpHandle*>& liveHandles() {  // under liveGroupsMutex
  static auto* handles = new std::unordered_set<const unifabEpHandle*>;
  return *handles;
}

}  // namespace

uint64_t unifabEpGroup::nextGroupId() {
  static std::atomic<uint64_t> last{0};
  const uint64_t id = last.fetch_add(1, std::memory_order_relaxed) + 1;
  std::lock_guard<std::mutex> lock(liveGroupsMutex());
  liveGroups().insert(id);
  return id;
}

bool unifabEpGroup::alive(uint64_t id) {
  std::lock_guard<std::mutex> lock(liveGroupsMutex());
  return liveGroups().count(id) != 0;
}

void unifabEpGroup::rememberHandle(const unifabEpHandle* handle) {
  std::lock_guard<std::mutex> lock(liveGroupsMutex());
  liveHandles().insert(handle);
}

bool unifabEpGroup::isLiveHandle(const unifabEpHandle* handle) {
  std::lock_guard<std::mutex> lock(liveGroupsMutex());
  return liveHandles().count(handle) != 0;
}

bool unifabEpGroup::forgetHandle(const unifabEpHandle* handle) {
  std::lock_guard<std::mutex> lock(liveGroupsMutex());
  return liveHandles().erase(handle) != 0;
}

Result unifabEpGroup::destroyHandle(unifabEpHandle* handle) {
  if (handle == nullptr) return unifabSuccess;
  if (!isLiveHandle(handle)) {
    return UF_ERROR(unifabInvalidArgument, kExt,
                    "handle=%p is not a live handle: destroyed already, or not from a dispatch", static_cast<void*>(handle));
  }
  if (handle->lowLatency && alive(handle->groupId)) {
    if (handle->sent && !handle->received) {
      return UF_ERROR(unifabInvalidUsage, kExt,
                      "the handle's low-latency dispatch (#%llu) awaits its receive phase, which every later receive "
                      "follows: run it (phase unifabEpReceiveOnly) before destroying the handle, or destroy the group",
                      static_cast<unsigned long long>(handle->dispatchSequence));
    }
    if (handle->combineSent && !handle->combineReceived) {
      return UF_ERROR(unifabInvalidUsage, kExt,
                      "the handle's low-latency combine (#%llu) awaits its receive phase, which every later receive "
                      "follows: run it (phase unifabEpReceiveOnly) before destroying the handle, or destroy the group",
                      static_cast<unsigned long long>(handle->combineSequence));
    }
  }
  // Of two threads destroying one handle, only the one that takes it out of the live set frees it.
  if (!forgetHandle(handle)) {
    return UF_ERROR(unifabInvalidArgument, kExt, "handle=%p was destroyed meanwhile by another call",
                    static_cast<void*>(handle));
  }
  delete handle;
  return unifabSuccess;
}

unifabEpGroup::~unifabEpGroup() {
  {
    std::lock_guard<std::mutex> lock(liveGroupsMutex());
    liveGroups().erase(id_);
  }
  std::unique_ptr<unifab::collectives::DeviceGuard> onDevice;
  if (comm_) {
    onDevice = std::make_unique<unifab::collectives::DeviceGuard>(comm_->cudaDevice());
    UF_CUDA_WARN(cudaDeviceSynchronize());  // outstanding kernels of the group still use its memory
  }
  if (view_.trace != nullptr) logTrace(view_.trace, view_.rank);
  if (llView_.trace != nullptr) logLowLatencyTrace();
  if (deviceMemory_ != nullptr) UF_CUDA_WARN(cudaFree(deviceMemory_));
  if (hostError_ != nullptr) UF_CUDA_WARN(cudaFreeHost(hostError_));
  if (hostCounts_ != nullptr) UF_CUDA_WARN(cudaFreeHost(hostCounts_));
  window_.reset();  // collective deregistration
}

void unifabEpGroup::logTrace(const unsigned long long* deviceTrace, int rank) const {
  std::vector<unsigned long long> trace(kep::kTraceWords);
  if (cudaMemcpy(trace.data(), deviceTrace, trace.size() * sizeof(trace[0]), cudaMemcpyDeviceToHost) != cudaSuccess) {
    UF_WARN(kExt, "EP trace: could not read the trace buffer: %s", cudaGetErrorString(cudaGetLastError()));
    return;
  }
  for (int p = 0; p < kep::kTracePoints; ++p) {
    const unsigned long long count = trace[kep::kTracePoints + p];
    if (count == 0) continue;
    // Per call, the latest block's recording and (as its complement) the earliest one's.
    std::vector<unsigned long long> latest, earliest;
    for (int c = 0; c < kep::kTraceCalls; ++c) {
      const size_t slot = 2 * kep::kTracePoints + static_cast<size_t>(c) * kep::kTracePoints + p;
      if (trace[slot] != 0) latest.push_back(trace[slot]);
      const unsigned long long first = trace[static_cast<size_t>(kep::kTraceCalls) * kep::kTracePoints + slot];
      if (first != 0) earliest.push_back(~first);
    }
    unifab::collectives::ep::logTracePoint(rank, p, static_cast<double>(trace[p]) / count / 1e3, count, latest, earliest);
  }
}

// The warps' records (kernels/ep/ll_kernels.h: llTraceRecord) summed up (ll_trace.h) and logged
// as logTrace logs the high-throughput kernels' counters.
void unifabEpGroup::logLowLatencyTrace() const {
  std::vector<uint32_t> records(kep::llTraceWords(llView_.counterBlocks));
  if (cudaMemcpy(records.data(), llView_.trace, records.size() * sizeof(records[0]), cudaMemcpyDeviceToHost) !=
      cudaSuccess) {
    UF_WARN(kExt, "EP trace: could not read the low-latency trace records: %s", cudaGetErrorString(cudaGetLastError()));
    return;
  }
  for (auto& p : unifab::collectives::ep::summarizeLlTrace(records, llView_.counterBlocks)) {
    unifab::collectives::ep::logTracePoint(llView_.rank, p.point, p.meanNs / 1e3, p.count, p.latestNs, p.earliestNs);
  }
}

Result unifabEpGroup::combineInputBuffer(void** buffer, int* maxRows) const {
  if (config_.mode != unifabEpHighThroughput) {
    return UF_ERROR(unifabInvalidUsage, kExt, "the combine input belongs to high-throughput groups; this one is low latency");
  }
  *buffer = window_->localBase() + view_.layout.combineIn;
  if (maxRows != nullptr) *maxRows = view_.layout.recvCapacity;
  return unifabSuccess;
}

Result unifabEpGroup::asyncError() const {
  int code = *reinterpret_cast<volatile int*>(hostError_);
  if (code == kep::kErrorNone) return unifabSuccess;
  const unifabResult_t result = (code & kep::kErrorCallMismatch) != 0 ? unifabInvalidUsage
                                : (code & kep::kErrorTimeout) != 0  ? unifabTimeout
                                                                    : unifabInvalidArgument;
  return UF_ERROR(result, kExt,
                  "an earlier EP call on rank %d failed on the GPU: %s", comm_->rank(), unifab::collectives::ep::errorName(code));
}

Result unifabEpGroup::checkStream(cudaStream_t stream, bool* capturing) const {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  UF_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  *capturing = capture != cudaStreamCaptureStatusNone;
  int device = comm_->cudaDevice();
  // Querying a capturing stream's device is not allowed; the current-device check below still is.
  if (capture == cudaStreamCaptureStatusNone) UF_CUDA_CHECK(cudaStreamGetDevice(stream, &device));
  if (device != comm_->cudaDevice()) {
    return UF_ERROR(unifabInvalidArgument, kExt, "stream belongs to CUDA device %d, the group to device %d", device,
                    comm_->cudaDevice());
  }
  int current = -1;
  UF_CUDA_CHECK(cudaGetDevice(&current));
  if (current != comm_->cudaDevice()) {
    return UF_ERROR(unifabInvalidUsage, kExt, "the current CUDA device is %d, the group's is %d", current,
                    comm_->cudaDevice());
  }
  return unifabSuccess;
}

int unifabEpGroup::smsFor(int requested) const { return requested > 0 ? requested : defaultSms_; }

int unifabEpGroup::remoteBlocksFor(unifab::tuner::EpOp op, int blocks) const {
  int remote = unifab::tuner::epRemoteBlocks(op, view_.nRanks, blocks);
  const int64_t chosen =
      op == unifab::tuner::EpOp::kDispatch ? unifab::params().epDispatchSenders : unifab::params().epCombineSenders;
  if (chosen > 0 && remote > 0 && blocks > 1) remote = static_cast<int>(std::min<int64_t>(chosen, blocks - 1));
  // Never 0 with peers: the dispatch's word sets are reused safely only because its remote blocks
  // wait for every peer's start word in every call (kernels/ep/ht.cu, dispatchKernel).
  if (view_.nRanks > 1 && blocks > 0) remote = std::max(remote, 1);
  return remote;
}

Result unifabEpGroup::validateSms(int numSms) const {
  const int cap = config_.maxSms > 0 ? std::min(config_.maxSms, deviceSms_) : deviceSms_;
  if (numSms < 0 || numSms > cap) {
    return UF_ERROR(unifabInvalidArgument, kExt, "numSms=%d is outside 0..%d (0: the group's choice)", numSms, cap);
  }
  return unifabSuccess;
}

Result unifabEpGroup::validateDispatch(const unifabEpDispatchArgs_t& a, cudaStream_t stream, bool* capturing) const {
  UF_CHECK(requireStructSize(a, "args", "initialise it with UNIFAB_EP_DISPATCH_ARGS_INIT"));
  if (a.numTokens < 0 || a.numTokens > config_.maxTokensPerRank) {
    return UF_ERROR(unifabInvalidArgument, kExt, "numTokens=%d is outside 0..maxTokensPerRank=%d", a.numTokens,
                    config_.maxTokensPerRank);
  }
  if (rawEnum(a.dtype) != unifabEpBf16 && rawEnum(a.dtype) != unifabEpFp8E4M3) {
    return UF_ERROR(unifabInvalidArgument, kExt, "dtype=%d is neither unifabEpBf16 nor unifabEpFp8E4M3", rawEnum(a.dtype));
  }
  if (a.numTokens > 0 && (a.x == nullptr || !unifab::collectives::ep::aligned16(a.x))) {
    return UF_ERROR(unifabInvalidArgument, kExt, "x=%p must be a non-NULL device pointer aligned to 16 bytes", a.x);
  }
  if (a.dtype == unifabEpFp8E4M3 && a.numTokens > 0 && (a.scales == nullptr || !unifab::collectives::ep::aligned16(a.scales))) {
    return UF_ERROR(unifabInvalidArgument, kExt, "FP8 dispatch needs scales (got %p) aligned to 16 bytes: one float per 128 values",
                    static_cast<const void*>(a.scales));
  }
  if (a.cachedHandle == nullptr && a.numTokens > 0 && a.topkIdx == nullptr) {
    return UF_ERROR(unifabInvalidArgument, kExt, "topkIdx=NULL without a cachedHandle");
  }
  if (rawEnum(a.topkIdxType) != unifabEpIndexInt64 && rawEnum(a.topkIdxType) != unifabEpIndexInt32) {
    return UF_ERROR(unifabInvalidArgument, kExt, "topkIdxType=%d is neither int64 (0) nor int32 (1)", rawEnum(a.topkIdxType));
  }
  UF_CHECK(unifab::collectives::ep::checkTopkAlignment(a.topkIdx, a.topkIdxType == unifabEpIndexInt32 ? 4 : 8,
                                                        a.topkWeights));
  if (rawEnum(a.layout) != unifabEpRankMajor && rawEnum(a.layout) != unifabEpExpertMajor) {
    return UF_ERROR(unifabInvalidArgument, kExt, "layout=%d is neither rank-major (0) nor expert-major (1)", rawEnum(a.layout));
  }
  if (a.layout == unifabEpExpertMajor &&
      (a.expertAlignment < 1 || a.expertAlignment > unifab::collectives::ep::kMaxExpertAlignment)) {
    return UF_ERROR(unifabInvalidArgument, kExt, "expertAlignment=%d is outside 1..%d", a.expertAlignment,
                    unifab::collectives::ep::kMaxExpertAlignment);
  }
  UF_CHECK(validateSms(a.numSms));
  UF_CHECK(checkStream(stream, capturing));
  {
    const int device = comm_->cudaDevice();
    const size_t tokens = static_cast<size_t>(a.numTokens);
    const size_t values = tokens * config_.hidden;
    const size_t entries = tokens * config_.topk;
    UF_CHECK(checkedRanges_.check(a.x, values * (a.dtype == unifabEpFp8E4M3 ? 1 : 2), device, "x"));
    if (a.dtype == unifabEpFp8E4M3) {
      UF_CHECK(checkedRanges_.check(a.scales, sizeof(float) * (values / kep::kScaleBlock), device, "scales"));
    }
    if (a.topkIdx != nullptr && a.cachedHandle == nullptr) {  // ignored with a cached handle
      UF_CHECK(checkedRanges_.check(a.topkIdx, entries * (a.topkIdxType == unifabEpIndexInt32 ? 4 : 8), device, "topkIdx"));
    }
    if (a.topkWeights != nullptr) UF_CHECK(checkedRanges_.check(a.topkWeights, entries * sizeof(float), device, "topkWeights"));
  }
  if (*capturing && (a.hostCounts != 0 || unifab::params().epValidateOnHost)) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "hostCounts=1 (or UNIFAB_EP_VALIDATE=1) waits for the GPU, which a capturing stream cannot do");
  }
  if (a.cachedHandle != nullptr) {
    const unifabEpHandle* h = a.cachedHandle;
    if (!isLiveHandle(h)) {
      return UF_ERROR(unifabInvalidArgument, kExt, "cachedHandle=%p is not a live handle (destroyed, or not from a "
                      "dispatch)", static_cast<const void*>(h));
    }
    if (h->groupId != id_ || h->dispatchSequence == 0) {
      return UF_ERROR(unifabInvalidArgument, kExt, "cachedHandle does not come from a dispatch on this group");
    }
    if (h->numTokens != a.numTokens || h->layout != a.layout ||
        (a.layout == unifabEpExpertMajor && h->expertAlignment != a.expertAlignment)) {
      return UF_ERROR(unifabInvalidArgument, kExt,
                      "cachedHandle routed %d tokens in layout %d (alignment %d); this call has %d tokens, layout %d "
                      "(alignment %d)", h->numTokens, static_cast<int>(h->layout), h->expertAlignment, a.numTokens,
                      static_cast<int>(a.layout), a.expertAlignment);
    }
  }
  return unifabSuccess;
}

Result unifabEpGroup::validateIdsOnHost(const unifabEpDispatchArgs_t& a, cudaStream_t stream) const {
  size_t count = static_cast<size_t>(a.numTokens) * config_.topk;
  size_t width = a.topkIdxType == unifabEpIndexInt32 ? 4 : 8;
  std::vector<unsigned char> ids(count * width);
  UF_CUDA_CHECK(cudaMemcpyAsync(ids.data(), a.topkIdx, ids.size(), cudaMemcpyDeviceToHost, stream));
  UF_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (size_t i = 0; i < count; ++i) {
    int64_t id = width == 4 ? static_cast<int64_t>(reinterpret_cast<const int32_t*>(ids.data())[i])
                            : reinterpret_cast<const int64_t*>(ids.data())[i];
    if (id < -1 || id >= config_.numExperts) {
      return UF_ERROR(unifabInvalidArgument, kExt, "topkIdx[%zu][%zu]=%lld is outside -1..numExperts-1=%d", i / config_.topk,
                      i % config_.topk, static_cast<long long>(id), config_.numExperts - 1);
    }
  }
  return unifabSuccess;
}

Result unifabEpGroup::dispatch(const unifabEpDispatchArgs_t& a, cudaStream_t stream, unifabEpHandle** handleOut,
                               unifabEpDispatchResult_t* out) {
  if (config_.mode != unifabEpHighThroughput) {
    return UF_ERROR(unifabInvalidUsage, kExt, "the group was created for low latency: use unifabEpLowLatencyDispatch");
  }
  UF_CHECK(asyncError());
  bool capturing = false;
  UF_CHECK(validateDispatch(a, stream, &capturing));
  UF_CHECK(requireStructSize(*out, "result", "set it to the struct's size"));
  const bool cached = a.cachedHandle != nullptr;
  if (!cached && a.numTokens > 0 && unifab::params().epValidateOnHost) UF_CHECK(validateIdsOnHost(a, stream));

  std::unique_ptr<unifabEpHandle> created;
  unifabEpHandle* handle = a.cachedHandle;
  if (!cached) {
    created.reset(new unifabEpHandle());
    created->groupId = id_;
    created->pool = pool_;
    UF_CHECK(pool_->take(!capturing, &created->buffers));
    handle = created.get();
  }
  kep::Routing& r = handle->buffers->routing;
  r.numTokens = a.numTokens;
  r.expertAlignment = a.layout == unifabEpExpertMajor ? a.expertAlignment : 1;

  kep::DispatchInput input{};
  input.numTokens = a.numTokens;
  input.dtype = a.dtype == unifabEpFp8E4M3 ? kep::Payload::kFp8 : kep::Payload::kBf16;
  input.x = a.x;
  input.scales = a.scales;
  input.topkIdx = a.topkIdx;
  input.topkIdxIs32 = a.topkIdxType == unifabEpIndexInt32;
  input.topkWeights = a.topkWeights;
  // The routing's own dispatch, as every rank numbers it (they make the same calls): a cached
  // re-dispatch tells its peers which routing it reuses. 23 bits, never 0.
  input.routingTag = cached ? static_cast<int>(handle->routingSequence % ((1u << kep::kBlockWordRowBits) - 1)) + 1 : 0;

  const int blocks = smsFor(a.numSms);
  UF_CUDA_CHECK(kep::launchDispatch(view_, input, r, cached, blocks,
                                    remoteBlocksFor(unifab::tuner::EpOp::kDispatch, blocks), stream));
  const bool expertMajor = a.layout == unifabEpExpertMajor;
  if (expertMajor) {
    UF_CUDA_CHECK(cudaMemsetAsync(r.expertSlot, 0xff, sizeof(int) * view_.layout.recvCapacity * view_.topk, stream));
    UF_CUDA_CHECK(kep::launchExpand(view_, r, input.dtype, expertRows_, stream));
  }

  char* base = window_->localBase();
  const kep::WindowLayout& L = view_.layout;
  out->recvX = expertMajor ? static_cast<void*>(expertRows_.x) : base + L.recvX;
  out->recvScales = a.dtype != unifabEpFp8E4M3 ? nullptr
                    : expertMajor             ? expertRows_.scales
                                              : reinterpret_cast<float*>(base + L.recvScales);
  out->recvTopkIdx = expertMajor ? expertRows_.topk : reinterpret_cast<int*>(base + L.recvTopk);
  out->recvTopkWeights = expertMajor ? expertRows_.weights : reinterpret_cast<float*>(base + L.recvWeights);
  out->recvSource = expertMajor ? expertRows_.source : reinterpret_cast<int*>(base + L.recvSource);
  out->numRecvRows = expertMajor ? r.numExpertRows : r.numRecvRows;
  out->recvRowsPerRank = r.recvRowsPerRank;
  out->recvRowsPerExpert = r.recvRowsPerExpert;
  out->expertOffsets = r.expertOffsets;
  out->maxRows = expertMajor ? expertRows_.capacity : L.recvCapacity;
  out->hostNumRecvRows = -1;

  handle->numTokens = a.numTokens;
  handle->layout = a.layout;
  handle->expertAlignment = r.expertAlignment;
  handle->dispatchSequence = ++dispatchCount_;
  if (!cached) handle->routingSequence = handle->dispatchSequence;
  if (a.hostCounts != 0) {
    UF_CUDA_CHECK(cudaMemcpyAsync(hostCounts_, out->numRecvRows, sizeof(int), cudaMemcpyDeviceToHost, stream));
    UF_CUDA_CHECK(cudaMemcpyAsync(hostCounts_ + 1, r.recvRowsPerExpert, sizeof(int) * view_.numLocalExperts,
                                  cudaMemcpyDeviceToHost, stream));
    UF_CUDA_CHECK(cudaStreamSynchronize(stream));
    UF_CHECK(asyncError());
    out->hostNumRecvRows = hostCounts_[0];
    for (int e = 0; e < view_.numLocalExperts; ++e) out->hostRecvRowsPerExpert[e] = hostCounts_[1 + e];
  }
  if (created) {
    rememberHandle(created.get());
    *handleOut = created.release();
  } else {
    *handleOut = handle;
  }
  return unifabSuccess;
}

Result unifabEpGroup::combine(unifabEpHandle* handle, const unifabEpCombineArgs_t& a, cudaStream_t stream) {
  if (config_.mode != unifabEpHighThroughput) {
    return UF_ERROR(unifabInvalidUsage, kExt, "the group was created for low latency: use unifabEpLowLatencyCombine");
  }
  UF_CHECK(asyncError());
  if (handle == nullptr || !isLiveHandle(handle) || handle->groupId != id_ || handle->dispatchSequence == 0) {
    return UF_ERROR(unifabInvalidArgument, kExt, "handle does not come from a dispatch on this group");
  }
  if (handle->dispatchSequence != dispatchCount_) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "handle is from dispatch #%llu but the group's buffers hold dispatch #%llu: combine must follow "
                    "its own dispatch (re-dispatch with cachedHandle to reuse a routing)",
                    static_cast<unsigned long long>(handle->dispatchSequence),
                    static_cast<unsigned long long>(dispatchCount_));
  }
  UF_CHECK(requireStructSize(a, "args", "initialise it with UNIFAB_EP_COMBINE_ARGS_INIT"));
  if (a.expertOutput == nullptr || !unifab::collectives::ep::aligned16(a.expertOutput)) {
    return UF_ERROR(unifabInvalidArgument, kExt, "expertOutput=%p must be a non-NULL device pointer aligned to 16 bytes",
                    a.expertOutput);
  }
  if (handle->numTokens > 0 && (a.combinedX == nullptr || !unifab::collectives::ep::aligned16(a.combinedX))) {
    return UF_ERROR(unifabInvalidArgument, kExt, "combinedX=%p must be a non-NULL device pointer aligned to 16 bytes",
                    a.combinedX);
  }
  if (a.combinedWeights != nullptr && !unifab::collectives::alignedTo(a.combinedWeights, sizeof(float))) {
    return UF_ERROR(unifabInvalidArgument, kExt, "combinedWeights=%p must be aligned to 4 bytes (floats)",
                    static_cast<const void*>(a.combinedWeights));
  }
  UF_CHECK(validateSms(a.numSms));
  bool capturing = false;
  UF_CHECK(checkStream(stream, &capturing));
  {
    // The expert outputs' row count is on the device; at least a row must be this GPU's memory.
    const int device = comm_->cudaDevice();
    const size_t tokens = static_cast<size_t>(handle->numTokens);
    UF_CHECK(checkedRanges_.check(a.expertOutput, static_cast<size_t>(config_.hidden) * 2, device, "expertOutput"));
    UF_CHECK(checkedRanges_.check(a.combinedX, tokens * config_.hidden * 2, device, "combinedX"));
    if (a.combinedWeights != nullptr) {
      UF_CHECK(checkedRanges_.check(a.combinedWeights, tokens * config_.topk * sizeof(float), device, "combinedWeights"));
    }
  }
  // Rows in the group's combine input are read by the peers where they lie: every rank must
  // pass its combine input, or none (a rank pulling from one that pushes waits for a ready word
  // that never comes, and both time out).
  const void* combineIn = window_->localBase() + view_.layout.combineIn;
  const bool pull = a.expertOutput == combineIn;
  if (pull && handle->layout != unifabEpRankMajor) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "expertOutput is the group's combine input, which holds rank-major rows, but the handle's dispatch "
                    "was expert-major: combine expert-major rows from another buffer");
  }
  // During a combine the peers write this rank's combine regions (pushed partials, their weights
  // and flags; the last regions of the window) or read them (the combine input): expert outputs
  // elsewhere in those regions would race with them. (Expert outputs in the dispatch's receive
  // rows, e.g. identity experts, are fine: no peer touches them during a combine.) The combine's
  // own outputs have no place anywhere in the window.
  const char* windowBegin = window_->localBase();
  const char* windowEnd = windowBegin + view_.layout.total;
  // The outputs' whole ranges (they are exactly numTokens rows); the expert output only where it
  // starts, since the rows it holds are known on the GPU alone and a bound would refuse a buffer
  // that merely sits below the window.
  using unifab::collectives::overlaps;
  const size_t combinedXBytes = static_cast<size_t>(config_.hidden) * 2 * static_cast<size_t>(handle->numTokens);
  const size_t combinedWeightsBytes = sizeof(float) * static_cast<size_t>(handle->numTokens) * config_.topk;
  if (!pull && overlaps(a.expertOutput, 1, windowBegin + view_.layout.combineX, windowEnd)) {
    return UF_ERROR(unifabInvalidArgument, kExt,
                    "expertOutput=%p lies in the group's combine regions [%p, %p) but is not the combine input (%p) "
                    "itself: pass the combine input, or a buffer the peers do not write", a.expertOutput,
                    static_cast<const void*>(windowBegin + view_.layout.combineX), static_cast<const void*>(windowEnd),
                    combineIn);
  }
  if (overlaps(a.combinedX, combinedXBytes, windowBegin, windowEnd) ||
      overlaps(a.combinedWeights, combinedWeightsBytes, windowBegin, windowEnd)) {
    return UF_ERROR(unifabInvalidArgument, kExt,
                    "combinedX=%p / combinedWeights=%p: the outputs must lie outside the group's window [%p, %p), "
                    "which the peers write and read during the combine", a.combinedX,
                    static_cast<const void*>(a.combinedWeights), static_cast<const void*>(windowBegin),
                    static_cast<const void*>(windowEnd));
  }
  kep::CombineInput input{};
  input.pull = pull;
  input.expertOutput = a.expertOutput;
  input.expertMajor = handle->layout == unifabEpExpertMajor;
  input.weighted = a.weighted != 0;
  input.combinedX = a.combinedX;
  input.combinedWeights = a.combinedWeights;
  const kep::Routing& r = handle->buffers->routing;
  const int blocks = smsFor(a.numSms);
  UF_CUDA_CHECK(kep::launchCombine(view_, r, input, blocks, remoteBlocksFor(unifab::tuner::EpOp::kCombine, blocks),
                                   stream));
  return unifabSuccess;
}
