// Host side of expert parallelism: the group (its window, counters and error word), routing
// handles, and the validation and launch sequence of dispatch and combine.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "collectives/common/device_range.h"
#include "collectives/common/symmetric.h"
#include "kernels/ep/ht_kernels.h"
#include "kernels/ep/ll_kernels.h"
#include "tuner/ep_policy.h"
#include "unifab/unifab.h"

struct unifabEpGroup;

namespace unifab::collectives::ep {

constexpr int kMaxLowLatencyTokens = 1024;

// What a rank can check of a configuration alone (both modes).
Result validateConfig(const unifabEpConfig_t& config, int nRanks);

// Owns the device memory of one routing (kernels::ep::Routing points into it).
class RoutingBuffers {
 public:
  RoutingBuffers() = default;
  ~RoutingBuffers();
  RoutingBuffers(const RoutingBuffers&) = delete;
  RoutingBuffers& operator=(const RoutingBuffers&) = delete;
  Result allocate(const kernels::ep::GroupView& view);
  kernels::ep::Routing routing{};

 private:
  void* memory_ = nullptr;
};

// Routing buffers made ahead of time, so that dispatch allocates nothing in steady state (and can
// be captured in a CUDA graph). Shared by the group and its handles: whichever goes last frees it.
class RoutingPool {
 public:
  explicit RoutingPool(const kernels::ep::GroupView& view) : view_(view) {}
  // A free routing; when none is left, a new one if `mayAllocate`, else an error (a capturing
  // stream cannot take cudaMalloc).
  Result take(bool mayAllocate, std::unique_ptr<RoutingBuffers>* buffers);
  void give(std::unique_ptr<RoutingBuffers> buffers);

 private:
  kernels::ep::GroupView view_;
  std::mutex mutex_;
  std::vector<std::unique_ptr<RoutingBuffers>> free_;
};

}  // namespace unifab::collectives::ep

// The public handle types are these structs.
struct unifabEpHandle {
  ~unifabEpHandle();
  // The group that made it, by its process-unique id: a destroyed group's address may be reused
  // by a newer one, whose buffers a stale handle's routing does not fit.
  uint64_t groupId = 0;
  std::shared_ptr<unifab::collectives::ep::RoutingPool> pool;
  std::unique_ptr<unifab::collectives::ep::RoutingBuffers> buffers;
  int numTokens = 0;
  unifabEpLayout_t layout = unifabEpRankMajor;
  int expertAlignment = 1;
  uint64_t dispatchSequence = 0;  // the group's dispatch that last used this routing; 0: none yet
  uint64_t routingSequence = 0;   // the group's dispatch that computed this routing
  // Low-latency mode: the buffer set of the dispatch and how far its phases got.
  bool lowLatency = false;
  int set = 0;
  bool fp8 = false;
  bool sent = false, received = false, combineSent = false, combineReceived = false;
  uint64_t combineSequence = 0;  // the group's low-latency combine send of this handle; 0: none yet
};

struct unifabEpGroup {
  // Collective. A NULL config or out takes part in the ranks' agreement and is refused there, so
  // that no rank is left waiting; only a NULL comm returns at once.
  static unifab::Result create(ncclComm_t comm, const unifabEpConfig_t* config, unifabEpGroup** out);
  ~unifabEpGroup();

  unifab::Result dispatch(const unifabEpDispatchArgs_t& args, cudaStream_t stream, unifabEpHandle** handle,
                          unifabEpDispatchResult_t* result);
  unifab::Result combine(unifabEpHandle* handle, const unifabEpCombineArgs_t& args, cudaStream_t stream);
  unifab::Result combineInputBuffer(void** buffer, int* maxRows) const;
  unifab::Result asyncError() const;

  // Low-latency mode (ep_ll.cc).
  unifab::Result lowLatencyDispatch(const unifabEpLowLatencyDispatchArgs_t& args, cudaStream_t stream,
                                    unifabEpHandle** handle, unifabEpLowLatencyDispatchResult_t* result);
  unifab::Result lowLatencyCombine(unifabEpHandle* handle, const unifabEpLowLatencyCombineArgs_t& args,
                                   cudaStream_t stream);
  static unifab::Result planLowLatencyLayout(const unifabEpConfig_t& config, int nRanks,
                                             unifab::kernels::ep::LlLayout* layout);
  // unifabInvalidUsage unless this GPU and its links carry the dispatch's and combine's flagged lines safely.
  static unifab::Result requireFlaggedLineLinks(int nRanks);
  // Window bytes of a group of either mode.
  static unifab::Result windowBytes(const unifabEpConfig_t& config, int nRanks, size_t* bytes);

  // unifabEpHandleDestroy: refuses a low-latency handle whose send phase (of its dispatch or its
  // combine) awaits its receive while its group lives, since the group's later phases wait for that
  // receive in order; otherwise deletes it.
  static unifab::Result destroyHandle(unifabEpHandle* handle);

  // Window bytes for `config` on `nRanks` ranks, and the offsets of every array.
  static unifab::Result planLayout(const unifabEpConfig_t& config, int nRanks, unifab::kernels::ep::WindowLayout* layout);

 private:
  unifab::Result validateDispatch(const unifabEpDispatchArgs_t& args, cudaStream_t stream, bool* capturing) const;
  // The stream is on the group's device (as is the current device); reports whether it captures.
  unifab::Result checkStream(cudaStream_t stream, bool* capturing) const;
  unifab::Result validateSms(int numSms) const;
  unifab::Result validateIdsOnHost(const unifabEpDispatchArgs_t& args, cudaStream_t stream) const;
  int smsFor(int requested) const;
  // The tuner's split of `blocks` into blocks that write into peers and the others, unless
  // UNIFAB_EP_{DISPATCH,COMBINE}_SENDERS chooses it.
  int remoteBlocksFor(unifab::tuner::EpOp op, int blocks) const;
  // This rank's own memory, before the window (whose peer bases create fills in): the error word
  // and SM count both modes use, then each mode's.
  unifab::Result initDeviceState();
  unifab::Result initHighThroughput(const unifab::kernels::ep::WindowLayout& layout);
  unifab::Result initLowLatency(const unifab::kernels::ep::LlLayout& layout);
  unifab::Result validateLowLatencyDispatch(const unifabEpLowLatencyDispatchArgs_t& a, cudaStream_t stream,
                                            unifabEpHandle* receiving) const;
  void logTrace(const unsigned long long* deviceTrace, int rank) const;  // UNIFAB_EP_TRACE: phase ends over the group's calls
  void logLowLatencyTrace() const;  // the same from the low-latency kernels' per-warp records

  std::shared_ptr<unifab::collectives::DeviceComm> comm_;
  std::unique_ptr<unifab::collectives::SymmetricWindow> window_;
  std::shared_ptr<unifab::collectives::ep::RoutingPool> pool_;
  unifabEpConfig_t config_{};
  unifab::kernels::ep::GroupView view_{};
  unifab::kernels::ep::ExpertMajorRows expertRows_{};
  void* deviceMemory_ = nullptr;   // epochs, the error word and expert-major rows
  int* hostError_ = nullptr;       // mapped mirror of the error word (view_.hostError), written on failure
  int* hostCounts_ = nullptr;      // pinned staging for hostCounts
  // The caller's buffers seen to be this GPU's memory, large enough (a host pointer or another
  // GPU's memory would fault the kernel and, with it, the context).
  mutable unifab::collectives::CheckedRanges checkedRanges_;
  int defaultSms_ = 0;
  int deviceSms_ = 0;
  // Dispatches issued on the group. The window and the expert-major rows hold the latest one
  // only, so combine accepts only the handle of that dispatch.
  uint64_t dispatchCount_ = 0;
  const uint64_t id_ = nextGroupId();  // what handles name this group by (unifabEpHandle::groupId)
  static uint64_t nextGroupId();
  static bool alive(uint64_t id);  // a group with this id exists (created, not yet destroyed)
  // The handles dispatches have handed out and nobody destroyed yet: a destroyed handle passed
  // again (destroyed twice, or used after its destroy) is refused instead of read after its free.
  // (An address a newer handle reuses passes; its group and sequence checks still apply.)
  static void rememberHandle(const unifabEpHandle* handle);
  static bool isLiveHandle(const unifabEpHandle* handle);
  static bool forgetHandle(const unifabEpHandle* handle);

  // Low-latency mode: the kernels' view, and the phases issued so far (the n-th send uses buffer
  // set n % 2; receive phases complete sends in their order).
  unifab::kernels::ep::LlView llView_{};
  uint64_t llDispatchSends_ = 0, llDispatchReceives_ = 0, llCombineSends_ = 0, llCombineReceives_ = 0;
  // Per buffer set: the dispatch whose combine was sent and awaits its receive (0: none). That
  // receive reads the set's routing, so no send may reuse the set before it runs.
  uint64_t llCombinePending_[unifab::kernels::ep::kLlSets] = {};
};
