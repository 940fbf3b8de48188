// Host side of the low-latency EP mode: the window layout, the group's device memory, and the
// validation and launch of each phase (kernels/ep/ll_kernels.h has the protocol).
#include <algorithm>
#include <memory>

#include "collectives/common/cuda_check.h"
#include "collectives/common/struct_size.h"
#include "collectives/ep/ep_common.h"
#include "collectives/ep/ep_group.h"
#include "plugin/params.h"
#include "tuner/ep_policy.h"
#include "tuner/topology.h"

using unifab::collectives::requireStructSize;
using unifab::Result;
using unifab::kLogInit;
using unifab::collectives::ep::aligned16;
using unifab::collectives::ep::rawEnum;
namespace kep = unifab::kernels::ep;

namespace {

bool validPhase(int phase) {
  return phase == unifabEpSendAndReceive || phase == unifabEpSendOnly || phase == unifabEpReceiveOnly;
}

}  // namespace

Result unifabEpGroup::planLowLatencyLayout(const unifabEpConfig_t& config, int nRanks, kep::LlLayout* layout) {
  UF_CHECK(unifab::collectives::ep::validateConfig(config, nRanks));
  if (config.mode != unifabEpLowLatency) {
    return UF_ERROR(unifabInternalError, kExt, "planLowLatencyLayout called for mode %d", rawEnum(config.mode));
  }
  kep::LlLayout L{};
  const size_t tokens = static_cast<size_t>(config.maxTokensPerRank);
  L.bitWords = static_cast<int>((tokens + 31) / 32);
  // A message: a run of flagged lines (kernels/ep/ll_kernels.h: llRunLines).
  const int runLines = std::max(kep::llRunLines(false, config.topk, config.hidden), kep::llRunLines(true, config.topk, config.hidden));
  L.messageBytes = runLines * unifab::kernels::kLineBytes;

  L.messageGenerationBytes = static_cast<size_t>(L.messageBytes) * nRanks * tokens;
  unifab::collectives::ep::Carver set(nullptr);
  L.partialBytes = kep::llCombineParts(config.hidden) * kep::kLlCombinePartLines * unifab::kernels::kLineBytes;
  L.partials = set.reserve(static_cast<size_t>(L.partialBytes) * nRanks * tokens);
  L.setBytes = set.used();

  // Messages and bitmap words in generations by epoch, partials in the dispatch's set: what makes
  // each reusable without a check (kernels/ep/ll_kernels.h).
  unifab::collectives::ep::Carver window(nullptr);
  L.tokenBits = window.reserve(sizeof(uint64_t) * kep::kLlGenerations * nRanks * L.bitWords);
  L.messages = window.reserve(L.messageGenerationBytes * kep::kLlGenerations);
  L.setBase = window.reserve(L.setBytes * kep::kLlSets);
  L.total = window.used();
  *layout = L;
  return unifabSuccess;
}

// The dispatch's and the combine's flagged lines (neither writes a fence or a tag) need a GPU and
// links that deliver a warp's 128-byte line store whole: verified on Hopper over NVLink (NCCL's
// LL128 protocol relies on the same). Peer writes over PCIe promise no such thing, so a group
// elsewhere is refused rather than left to read torn lines.
Result unifabEpGroup::requireFlaggedLineLinks(int nRanks) {
  int device = 0;
  int major = 0;
  UF_CUDA_CHECK(cudaGetDevice(&device));
  UF_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major != 9) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "low-latency EP needs a Hopper GPU (sm_90, where NVLink delivers the dispatch's and combine's "
                    "128-byte flagged lines whole); GPU %d is sm_%dx",
                    device, major);
  }
  if (nRanks == 1) return unifabSuccess;
  char busId[32] = {};
  UF_CUDA_CHECK(cudaDeviceGetPCIBusId(busId, sizeof(busId), device));
  const int links = unifab::tuner::activeNvlinks(busId);
  if (links <= 0) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "low-latency EP needs NVLink between its ranks (the dispatch's and combine's 128-byte flagged "
                    "lines are not delivered whole over PCIe); GPU %s has %s",
                    busId, links == 0 ? "no active NVLink" : "an NVLink state NVML could not report");
  }
  return unifabSuccess;
}

Result unifabEpGroup::windowBytes(const unifabEpConfig_t& config, int nRanks, size_t* bytes) {
  UF_CHECK(unifab::collectives::ep::validateConfig(config, nRanks));
  if (config.mode == unifabEpLowLatency) {
    kep::LlLayout layout;
    UF_CHECK(planLowLatencyLayout(config, nRanks, &layout));
    *bytes = unifab::collectives::SymmetricWindow::registeredBytes(layout.total);
  } else {
    kep::WindowLayout layout;
    UF_CHECK(planLayout(config, nRanks, &layout));
    *bytes = unifab::collectives::SymmetricWindow::registeredBytes(layout.total);
  }
  return unifabSuccess;
}

Result unifabEpGroup::initLowLatency(const kep::LlLayout& layout) {
  const auto& dc = *comm_;
  kep::LlView& v = llView_;
  v.rank = dc.rank();
  v.nRanks = dc.nRanks();
  v.numExperts = config_.numExperts;
  v.numLocalExperts = config_.numExperts / dc.nRanks();
  v.hidden = config_.hidden;
  v.topk = config_.topk;
  v.maxTokens = config_.maxTokensPerRank;
  v.expertStride = v.nRanks * v.maxTokens;
  v.counterBlocks = deviceSms_;  // every call's blocks: at most smsFor(), itself at most deviceSms_ (validateSms)
  v.localExperts = unifab::kernels::makeFastDivisor(v.numLocalExperts);
  v.ranks = unifab::kernels::makeFastDivisor(v.nRanks);
  v.parts = unifab::kernels::makeFastDivisor(kep::llParts(v.hidden));
  v.combineParts = unifab::kernels::makeFastDivisor(kep::llCombineParts(v.hidden));
  // The largest dividend of each (expert ids; slots; message parts; partial parts), within the
  // bound of its exactness, which the config's limits keep (collectives/ep/ep_group.cc).
  const uint64_t allSlots = static_cast<uint64_t>(v.nRanks) * v.maxTokens;
  const bool covered = fastDivisorCovers(v.localExperts, v.numExperts) && fastDivisorCovers(v.ranks, allSlots) &&
                       fastDivisorCovers(v.parts, static_cast<uint64_t>(v.maxTokens) * kep::llParts(v.hidden)) &&
                       fastDivisorCovers(v.combineParts, allSlots * kep::llCombineParts(v.hidden));
  if (!covered) {
    return UF_ERROR(unifabInternalError, kExt, "EP low-latency divisors inexact for %d ranks, %d tokens, hidden %d, %d experts",
                    v.nRanks, v.maxTokens, v.hidden, v.numExperts);
  }
  v.layout = layout;
  v.timeoutNs = static_cast<uint64_t>(unifab::params().epTimeoutMs) * 1000000ULL;
  UF_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&v.hostError), hostError_, 0));

  const size_t expertRows = static_cast<size_t>(v.numLocalExperts) * v.expertStride;
  const size_t slots = static_cast<size_t>(v.nRanks) * v.maxTokens;
  UF_CHECK(unifab::collectives::ep::allocateCarved(&deviceMemory_, [&](unifab::collectives::ep::Carver& carve) {
    v.counters = carve.take<kep::LlCounters>(1);
    v.error = carve.take<int>(1);
    for (kep::LlSetLocal& set : v.sets) {
      set.recvX = carve.take<char>(expertRows * v.hidden * 2);
      set.recvScales = carve.take<float>(expertRows * (v.hidden / kep::kScaleBlock));
      set.recvSource = carve.take<int>(expertRows * 2);
      set.recvCount = carve.take<int>(v.numLocalExperts);
      set.rowOf = carve.take<int>(slots * v.topk);
      set.weightOf = carve.take<float>(slots * v.topk);
      set.tokenRanks = carve.take<uint64_t>(v.maxTokens);
    }
    v.trace = unifab::params().epTrace ? carve.take<uint32_t>(kep::llTraceWords(v.counterBlocks)) : nullptr;
  }));
  defaultSms_ = config_.maxSms > 0 ? std::min(config_.maxSms, deviceSms_) : deviceSms_;
  return unifabSuccess;
}

Result unifabEpGroup::validateLowLatencyDispatch(const unifabEpLowLatencyDispatchArgs_t& a, cudaStream_t stream,
                                                 unifabEpHandle* receiving) const {
  UF_CHECK(requireStructSize(a, "args", "initialise it with UNIFAB_EP_LL_DISPATCH_ARGS_INIT"));
  if (!validPhase(rawEnum(a.phase))) {
    return UF_ERROR(unifabInvalidArgument, kExt, "phase=%d is not a unifabEpPhase_t value (0..2)", rawEnum(a.phase));
  }
  UF_CHECK(validateSms(a.numSms));
  bool capturing = false;
  UF_CHECK(checkStream(stream, &capturing));
  if (a.phase == unifabEpReceiveOnly) {
    if (receiving == nullptr || !isLiveHandle(receiving) || receiving->groupId != id_ || !receiving->lowLatency ||
        !receiving->sent ||
        receiving->received) {
      return UF_ERROR(unifabInvalidArgument, kExt,
                      "a receive-only dispatch needs *handle from a send-only low-latency dispatch on this group whose "
                      "receive phase has not run");
    }
    if (receiving->dispatchSequence != llDispatchReceives_ + 1) {
      return UF_ERROR(unifabInvalidUsage, kExt,
                      "receive phases complete sends in their order: this handle's send is #%llu, the next to "
                      "receive is #%llu", static_cast<unsigned long long>(receiving->dispatchSequence),
                      static_cast<unsigned long long>(llDispatchReceives_ + 1));
    }
    return unifabSuccess;
  }
  if (a.numTokens < 0 || a.numTokens > config_.maxTokensPerRank) {
    return UF_ERROR(unifabInvalidArgument, kExt, "numTokens=%d is outside 0..maxTokensPerRank=%d", a.numTokens,
                    config_.maxTokensPerRank);
  }
  if (rawEnum(a.dtype) != unifabEpBf16 && rawEnum(a.dtype) != unifabEpFp8E4M3) {
    return UF_ERROR(unifabInvalidArgument, kExt, "dtype=%d is neither unifabEpBf16 nor unifabEpFp8E4M3", rawEnum(a.dtype));
  }
  if (rawEnum(a.topkIdxType) != unifabEpIndexInt64 && rawEnum(a.topkIdxType) != unifabEpIndexInt32) {
    return UF_ERROR(unifabInvalidArgument, kExt, "topkIdxType=%d is neither int64 (0) nor int32 (1)", rawEnum(a.topkIdxType));
  }
  if (a.numTokens > 0) {
    if (a.x == nullptr || !aligned16(a.x)) {
      return UF_ERROR(unifabInvalidArgument, kExt, "x=%p must be a non-NULL BF16 device pointer aligned to 16 bytes", a.x);
    }
    if (a.topkIdx == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "topkIdx=NULL with numTokens=%d", a.numTokens);
    UF_CHECK(unifab::collectives::ep::checkTopkAlignment(a.topkIdx, a.topkIdxType == unifabEpIndexInt32 ? 4 : 8,
                                                          a.topkWeights));
    const int device = comm_->cudaDevice();
    const size_t entries = static_cast<size_t>(a.numTokens) * config_.topk;
    UF_CHECK(checkedRanges_.check(a.x, static_cast<size_t>(a.numTokens) * config_.hidden * 2, device, "x"));
    UF_CHECK(checkedRanges_.check(a.topkIdx, entries * (a.topkIdxType == unifabEpIndexInt32 ? 4 : 8), device, "topkIdx"));
    if (a.topkWeights != nullptr) UF_CHECK(checkedRanges_.check(a.topkWeights, entries * sizeof(float), device, "topkWeights"));
  }
  // The two sets hold the latest two dispatches: a send that would reuse a set whose receive
  // phase never ran would leave that dispatch's receive waiting for overwritten data.
  if (llDispatchSends_ >= llDispatchReceives_ + kep::kLlSets) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "%d low-latency dispatches await their receive phase: complete one before the next send",
                    kep::kLlSets);
  }
  // The set this send reuses holds the routing a pending combine receive still reads.
  const uint64_t pending = llCombinePending_[llDispatchSends_ % kep::kLlSets];
  if (pending != 0) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "the combine of dispatch #%llu awaits its receive phase and reads the buffers this send would "
                    "reuse: complete it (phase unifabEpReceiveOnly) first", static_cast<unsigned long long>(pending));
  }
  // Receive phases complete sends in order, so a call that receives its own send cannot run while
  // an earlier send awaits its receive (it would wait for data it never reads).
  if (rawEnum(a.phase) == unifabEpSendAndReceive && llDispatchSends_ != llDispatchReceives_) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "dispatch #%llu awaits its receive phase: complete it (phase unifabEpReceiveOnly) before a "
                    "send-and-receive dispatch", static_cast<unsigned long long>(llDispatchReceives_ + 1));
  }
  return unifabSuccess;
}

Result unifabEpGroup::lowLatencyDispatch(const unifabEpLowLatencyDispatchArgs_t& a, cudaStream_t stream,
                                         unifabEpHandle** handleOut, unifabEpLowLatencyDispatchResult_t* out) {
  if (config_.mode != unifabEpLowLatency) {
    return UF_ERROR(unifabInvalidUsage, kExt, "the group was created for high throughput: use unifabEpDispatch");
  }
  UF_CHECK(asyncError());
  const bool receiveOnly = a.size >= sizeof(a) && rawEnum(a.phase) == unifabEpReceiveOnly;
  UF_CHECK(validateLowLatencyDispatch(a, stream, receiveOnly ? *handleOut : nullptr));
  if (!receiveOnly && out == nullptr) return UF_ERROR(unifabInvalidArgument, kExt, "result=NULL for a send phase");
  if (out != nullptr) UF_CHECK(requireStructSize(*out, "result", "set it to the struct's size"));
  const kep::LlView& v = llView_;
  const int parts = kep::llParts(v.hidden);
  std::unique_ptr<unifabEpHandle> created;
  unifabEpHandle* h = receiveOnly ? *handleOut : nullptr;
  if (!receiveOnly) {
    created = std::make_unique<unifabEpHandle>();
    h = created.get();
    h->groupId = id_;
    h->lowLatency = true;
    h->set = static_cast<int>(llDispatchSends_ % kep::kLlSets);
    h->fp8 = a.dtype == unifabEpFp8E4M3;
    h->numTokens = a.numTokens;
    h->dispatchSequence = llDispatchSends_ + 1;
  }
  const bool send = !receiveOnly;
  const bool receive = a.phase != unifabEpSendOnly;
  kep::LlDispatchInput input{};
  input.numTokens = h->numTokens;
  input.x = a.x;
  input.topkIdx = a.topkIdx;
  input.topkIdxIs32 = a.topkIdxType == unifabEpIndexInt32;
  input.topkWeights = a.topkWeights;
  input.fp8 = h->fp8;
  input.ue8m0 = a.ue8m0Scales != 0;
  // A send warp per message part and per bitmap word (kernels/ep/ll.cu: dispatchMessageItems).
  const int items = std::max(send ? h->numTokens * parts + v.layout.bitWords : 0, receive ? v.nRanks * v.maxTokens * parts : 0);
  const int blocks = unifab::tuner::epLowLatencyBlocks(items, kep::kLlWarpsPerBlock, smsFor(a.numSms));
  UF_CUDA_CHECK(kep::launchLlDispatch(v, input, {h->set, send, receive, blocks, config_.programmaticLaunch != 0, stream}));
  if (send) {
    ++llDispatchSends_;
    h->sent = true;
  }
  if (receive) {
    ++llDispatchReceives_;
    h->received = true;
  }
  if (out != nullptr) {
    const kep::LlSetLocal& set = v.sets[h->set];
    out->recvX = set.recvX;
    out->recvScales = h->fp8 ? set.recvScales : nullptr;
    out->recvSource = set.recvSource;
    out->recvCount = set.recvCount;
    out->expertStride = v.expertStride;
  }
  if (created) {
    rememberHandle(created.get());
    *handleOut = created.release();
  }
  return unifabSuccess;
}

Result unifabEpGroup::lowLatencyCombine(unifabEpHandle* h, const unifabEpLowLatencyCombineArgs_t& a,
                                        cudaStream_t stream) {
  if (config_.mode != unifabEpLowLatency) {
    return UF_ERROR(unifabInvalidUsage, kExt, "the group was created for high throughput: use unifabEpCombine");
  }
  UF_CHECK(asyncError());
  UF_CHECK(requireStructSize(a, "args", "initialise it with UNIFAB_EP_LL_COMBINE_ARGS_INIT"));
  if (h == nullptr || !isLiveHandle(h) || h->groupId != id_ || !h->lowLatency) {
    return UF_ERROR(unifabInvalidArgument, kExt, "handle does not come from a low-latency dispatch on this group");
  }
  if (!validPhase(rawEnum(a.phase))) {
    return UF_ERROR(unifabInvalidArgument, kExt, "phase=%d is not a unifabEpPhase_t value (0..2)", rawEnum(a.phase));
  }
  if (!h->received) {
    return UF_ERROR(unifabInvalidUsage, kExt, "the handle's dispatch has not run its receive phase");
  }
  // The handle's set is reused by the dispatch after next (its send writes the set's token ranks).
  if (h->dispatchSequence + kep::kLlSets <= llDispatchSends_) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "the handle's dispatch (#%llu) is no longer one of the latest %d (#%llu is): its buffers are reused",
                    static_cast<unsigned long long>(h->dispatchSequence), kep::kLlSets,
                    static_cast<unsigned long long>(llDispatchSends_));
  }
  const bool send = a.phase != unifabEpReceiveOnly;
  const bool receive = a.phase != unifabEpSendOnly;
  if (send && h->combineSent) return UF_ERROR(unifabInvalidUsage, kExt, "the handle's combine was already sent");
  if (send && receive && llCombineSends_ != llCombineReceives_) {
    return UF_ERROR(unifabInvalidUsage, kExt,
                    "combine #%llu awaits its receive phase: complete it (phase unifabEpReceiveOnly) before a "
                    "send-and-receive combine", static_cast<unsigned long long>(llCombineReceives_ + 1));
  }
  if (!send && (!h->combineSent || h->combineReceived)) {
    return UF_ERROR(unifabInvalidUsage, kExt, "a receive-only combine needs a handle whose combine was sent, not received");
  }
  if (!send && h->combineSequence != llCombineReceives_ + 1) {
    return UF_ERROR(unifabInvalidUsage, kExt, "receive phases complete combine sends in their order (this is #%llu, next #%llu)",
                    static_cast<unsigned long long>(h->combineSequence),
                    static_cast<unsigned long long>(llCombineReceives_ + 1));
  }
  if (send && (a.expertOutput == nullptr || !aligned16(a.expertOutput))) {
    return UF_ERROR(unifabInvalidArgument, kExt, "expertOutput=%p must be a non-NULL device pointer aligned to 16 bytes",
                    a.expertOutput);
  }
  if (receive && h->numTokens > 0 && (a.combinedX == nullptr || !aligned16(a.combinedX))) {
    return UF_ERROR(unifabInvalidArgument, kExt, "combinedX=%p must be a non-NULL device pointer aligned to 16 bytes",
                    a.combinedX);
  }
  UF_CHECK(validateSms(a.numSms));
  bool capturing = false;
  UF_CHECK(checkStream(stream, &capturing));
  const kep::LlView& v = llView_;
  const int device = comm_->cudaDevice();
  if (send) {
    // [numLocalExperts * expertStride, hidden], read at any row a dispatch may have filled.
    const size_t rows = static_cast<size_t>(v.numLocalExperts) * v.expertStride;
    UF_CHECK(checkedRanges_.check(a.expertOutput, rows * v.hidden * 2, device, "expertOutput"));
  }
  if (receive) UF_CHECK(checkedRanges_.check(a.combinedX, static_cast<size_t>(h->numTokens) * v.hidden * 2, device, "combinedX"));
  const int parts = kep::llCombineParts(v.hidden);
  kep::LlCombineInput input{};
  input.numTokens = h->numTokens;
  input.expertOutput = a.expertOutput;
  input.weighted = a.weighted != 0;
  input.combinedX = a.combinedX;
  const int items = std::max(send ? v.nRanks * v.maxTokens * parts : 0, receive ? h->numTokens * parts : 0);
  const int blocks = unifab::tuner::epLowLatencyBlocks(items, kep::kLlWarpsPerBlock, smsFor(a.numSms));
  UF_CUDA_CHECK(kep::launchLlCombine(v, input, {h->set, send, receive, blocks, config_.programmaticLaunch != 0, stream}));
  if (send) {
    h->combineSent = true;
    h->combineSequence = ++llCombineSends_;
    if (!receive) llCombinePending_[h->set] = h->dispatchSequence;
  }
  if (receive) {
    h->combineReceived = true;
    ++llCombineReceives_;
    llCombinePending_[h->set] = 0;
  }
  return unifabSuccess;
}
