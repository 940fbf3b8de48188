// High-throughput expert-parallel dispatch and combine over NVLink (every rank of the group is an
// LSA peer). Every received byte is written once by the sending GPU, straight into its final
// rank-major row on the receiver: the count exchange that precedes the payload tells each sender
// where its rows start at every destination, and the layout pass tells it the index of each of
// its tokens among those going to one destination. Token order is kept, so the output is
// deterministic. The expert-major layout is a local copy of those rows.
#include <cuda_bf16.h>

#include "kernels/common/bf16x8.cuh"
#include "kernels/common/device_sync.cuh"
#include "kernels/common/warp_copy.cuh"
#include "kernels/ep/ep_trace.cuh"
#include "kernels/ep/ht_kernels.h"

namespace unifab::kernels::ep {
namespace {

constexpr int kCopyThreads = 1024;
// Combine holds two partials' vectors per lane while it sums them: 768 threads leave it 80
// registers (1024 would spill), and 24 warps per SM still keep ~100 KB in flight.
constexpr int kCombineThreads = 768;
constexpr int kWarp = 32;
// The pulling combine keeps 8 vectors of each of a token's two rows in flight per lane (a row read
// over NVLink waits a few microseconds), with 512 threads so that the registers hold them.
// Measured at 24 SMs on 2 x H200 (threads:vectors): 768:4 210 us, 512:8 205, 768:6 211, 512:6
// 215, 384:12 226, 1024:4 204 but spilling.
constexpr int kPullThreads = 512;
constexpr int kPullVectors = 8;

__device__ __forceinline__ char* at(const GroupView& g, int rank, size_t offset) { return g.peerBase[rank] + offset; }

__device__ __forceinline__ WaitBounds bounds(const GroupView& g) { return {g.error, g.hostError, g.timeoutNs}; }

// After a timeout the group's peers are out of step: every later kernel does nothing.
__device__ __forceinline__ bool timedOut(const GroupView& g) { return kernels::timedOut(bounds(g), kErrorTimeout); }

// Exclusive prefix sum of `value` over the block; `total` receives the block's sum.
template <int kThreads>
__device__ int blockExclusiveScan(int value, int* total) {
  __shared__ int warpSums[kThreads / kWarp];
  int lane = threadIdx.x % kWarp;
  int warp = threadIdx.x / kWarp;
  int inclusive = value;
  for (int d = 1; d < kWarp; d *= 2) {
    int other = __shfl_up_sync(0xffffffff, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  if (lane == kWarp - 1) warpSums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int sum = lane < kThreads / kWarp ? warpSums[lane] : 0;
    for (int d = 1; d < kWarp; d *= 2) {
      int other = __shfl_up_sync(0xffffffff, sum, d);
      if (lane >= d) sum += other;
    }
    if (lane < kThreads / kWarp) warpSums[lane] = sum;  // inclusive warp prefixes
  }
  __syncthreads();
  int warpPrefix = warp > 0 ? warpSums[warp - 1] : 0;
  *total = warpSums[kThreads / kWarp - 1];
  __syncthreads();  // warpSums is reused by the next call
  return warpPrefix + inclusive - value;
}

__device__ __forceinline__ int64_t loadExpert(const void* topkIdx, bool is32, size_t index) {
  return is32 ? static_cast<int64_t>(__ldg(static_cast<const int32_t*>(topkIdx) + index))
              : static_cast<int64_t>(__ldg(static_cast<const long long*>(topkIdx) + index));
}

// ---- grid hand-over and peer handshakes ---------------------------------------------------

template <bool kPause, typename Ready>
__device__ __forceinline__ bool waitUntil(const GroupView& g, Ready ready) {
  return waitBounded<kPause>(bounds(g), kErrorTimeout, ready);
}

// Blocks of one kernel are all resident (grid <= SM count, one block per SM), so they can wait
// for each other; the fence after the wait makes what the setter wrote before the word visible.
__device__ __forceinline__ bool waitGo(const GroupView& g, const uint64_t* word, uint64_t epoch) {
  if (!waitUntil<false>(g, [&] { return *reinterpret_cast<const volatile uint64_t*>(word) >= epoch; })) return false;
  __threadfence();
  return true;
}

template <bool kSystemScope = true>
__device__ __forceinline__ bool lastBlockToFinish(const GroupView& g) {
  return kernels::lastBlockToFinish<kSystemScope>(&g.sync->finished);
}

// ---- tracing (UNIFAB_EP_TRACE) ---------------------------------------------------------------

__device__ __forceinline__ void traceStart(const GroupView& g) {
  if (g.trace != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    *reinterpret_cast<volatile uint64_t*>(&g.sync->traceStart) = globalTimerNs();
  }
}

// Thread 0 keeps the time of a trace point in `slot` (shared memory: no registers held), to record
// later with others: recording reads the call's start, a round trip that a phase of a few
// microseconds should not carry each time.
__device__ __forceinline__ void traceStamp(const GroupView& g, uint64_t* slot) {
  if (g.trace != nullptr && threadIdx.x == 0) *slot = globalTimerNs();
}

// Thread 0 of the calling block records `point`, reached now (a block that never waited on block
// 0 may read the previous call's start: tracing is a diagnostic, not a measurement of record).
__device__ __forceinline__ void tracePoint(const GroupView& g, TracePoint point, uint64_t epoch) {
  if (g.trace == nullptr || threadIdx.x != 0) return;
  const uint64_t start = *reinterpret_cast<const volatile uint64_t*>(&g.sync->traceStart);
  traceRecord(g.trace, point, epoch, globalTimerNs() - start);
}

// Which part of the payload a block writes: rows for other ranks cross NVLink, rows for this rank
// stay in HBM. Separate blocks keep the link busy without waiting behind local stores (measured on
// 2 x H200 with 24 SMs: 180 us for a dispatch's bytes split 8 + 16, 200 us interleaved).
struct Role {
  bool remote, local;
  int index, count;  // this block among the blocks of its role
};

// The first `remoteBlocks` blocks take the remote rows (the split is the tuner's, epRemoteBlocks):
// 0 = every row is local; equal to the grid = one block does both.
__device__ __forceinline__ Role blockRole(int remoteBlocks) {
  const int blocks = gridDim.x, b = blockIdx.x;
  if (remoteBlocks <= 0) return {false, true, b, blocks};
  if (remoteBlocks >= blocks) return {true, true, b, blocks};
  if (b < remoteBlocks) return {true, false, b, remoteBlocks};
  return {false, true, b - remoteBlocks, blocks - remoteBlocks};
}

// ---- dispatch -------------------------------------------------------------------------------

// Token range of layout block b: contiguous, so that a block's slots are one prefix.
__device__ __forceinline__ int tokensPerBlock(int numTokens) {
  const int per = (numTokens + gridDim.x - 1) / gridDim.x;
  return per > 0 ? per : 1;
}

// Top-k entries staged in shared memory per pass of the layout: loaded and checked by
// consecutive threads (coalesced: ~2 us, against ~3.5 us for a thread reading its token's entries
// from global memory), then each token's thread takes its own into registers.
constexpr int kLayoutEntries = 8192;
// Top-k entries per thread whose loads are in flight at once (4096 tokens x top-8 on 24 blocks of
// 1024 threads is 1366 entries a block: two per thread).
constexpr int kLayoutLoads = 2;
// Top-k entries of its token a layout thread holds in registers at once: the whole token for
// top-k <= 8, so that its destinations and experts come from independent steps (one dependent
// shared-memory read after another, they cost ~3 us of the layout).
constexpr int kLayoutChunk = 8;

// Until the tagged count word at `word` is of call `epoch` (bounded); *seen gets the word, so that
// reading it costs no second round trip.
__device__ __forceinline__ bool waitTagged(const GroupView& g, const uint64_t* word, uint64_t epoch, uint64_t* seen) {
  return waitUntil<false>(g, [&] { return countWordIsFrom(*seen = loadRelaxed(word), epoch); });
}

// Count words of layout blocks: (s, b, d) = rows that block b of rank s sends to rank d, in every
// rank's window.
__device__ __forceinline__ uint64_t* blockWordsAt(const GroupView& g, int rank, uint64_t epoch) {
  return reinterpret_cast<uint64_t*>(at(g, rank, g.layout.blockWords[wordSet(epoch)]));
}
__device__ __forceinline__ size_t blockWordIndex(const GroupView& g, int s, int b, int d) {
  return (static_cast<size_t>(s) * kMaxBlocks + b) * g.nRanks + d;
}
// (s, b, e) = rows that layout block b of rank s sends to our local expert e, in the owner's window.
__device__ __forceinline__ uint64_t* blockExpertWordsAt(const GroupView& g, int rank, uint64_t epoch) {
  return reinterpret_cast<uint64_t*>(at(g, rank, g.layout.blockExpertWords[wordSet(epoch)]));
}
__device__ __forceinline__ size_t blockExpertWordIndex(const GroupView& g, int s, int b, int e) {
  return (static_cast<size_t>(s) * kMaxBlocks + b) * g.numLocalExperts + e;
}

// Trace stamps of a dispatch block's start and its layout's first pass (traceStamp), recorded
// with the layout's end after one read of the call's start; then when the last of the start words
// and of this rank's count words that the block waits for were seen (the latest waiting thread's
// time, by atomicMax), recorded with the end of the waits.
struct DispatchStamps {
  uint64_t entered, loaded, masked, listed;
  unsigned long long startWordsIn, ownWordsIn;
};

__device__ __forceinline__ void stampLatest(const GroupView& g, unsigned long long* slot) {
  if (g.trace != nullptr) atomicMax(slot, static_cast<unsigned long long>(globalTimerNs()));
}

__device__ __forceinline__ void recordStamps(const GroupView& g, uint64_t epoch, const DispatchStamps& stamps) {
  if (g.trace == nullptr || threadIdx.x != 0) return;
  const uint64_t start = *reinterpret_cast<const volatile uint64_t*>(&g.sync->traceStart);  // one round trip for all
  const uint64_t now = globalTimerNs();
  const TracePoint points[] = {kTraceDispatchEntered, kTraceDispatchIdsLoaded, kTraceDispatchMasked,
                               kTraceDispatchListed, kTraceDispatchLayout};
  const uint64_t at[] = {stamps.entered, stamps.loaded, stamps.masked, stamps.listed, now};
#pragma unroll
  for (int i = 0; i < 5; ++i) {
    if (at[i] != 0) traceRecord(g.trace, points[i], epoch, at[i] - start);
  }
}

// Layout of this block's token range: destination ranks of every token, the block's tokens for
// each destination in order, validated ids and weights kept for combine and cached re-dispatch;
// then the block's rows for each rank go to every rank, and its rows for each expert to the
// expert's owner.
__device__ void layoutBlock(const GroupView& g, const DispatchInput& input, const Routing& r, uint64_t epoch,
                            DispatchStamps& stamps) {
  __shared__ int destCount[kMaxRanks];
  __shared__ int expertCount[kMaxExperts];
  __shared__ int ids[kLayoutEntries];
  for (int i = threadIdx.x; i < g.nRanks; i += blockDim.x) destCount[i] = 0;
  for (int i = threadIdx.x; i < g.numExperts; i += blockDim.x) expertCount[i] = 0;
  const FastDivisor owner = makeFastDivisor(g.numLocalExperts);
  const int per = tokensPerBlock(input.numTokens);
  const int first = blockIdx.x * per;
  const int last = min(input.numTokens, first + per);
  int* lists = g.blockTokens + static_cast<size_t>(blockIdx.x) * per;
  // Per pass: the entries, loaded and checked by consecutive threads; then a thread per token finds
  // its destinations and experts; then one block scan per two destinations gives the token's
  // place in each destination's list.
  const int passTokens = min(kCopyThreads, kLayoutEntries / g.topk);
  for (int base = first; base < last; base += passTokens) {
    const int tokens = min(passTokens, last - base);
    const size_t firstEntry = static_cast<size_t>(base) * g.topk;
    // The counters' zeroing, or the previous pass's ids[] reads and destCount updates, are done.
    __syncthreads();
    // Every load of a thread's entries is issued before any store: the stores to the routing
    // could alias the inputs as far as the compiler knows, and would serialise the round trips.
    const int entries = tokens * g.topk;
    for (int i0 = threadIdx.x; i0 < entries; i0 += kLayoutLoads * blockDim.x) {
      int64_t loaded[kLayoutLoads];
      float weight[kLayoutLoads];
#pragma unroll
      for (int u = 0; u < kLayoutLoads; ++u) {
        const int i = i0 + u * static_cast<int>(blockDim.x);
        loaded[u] = i < entries ? loadExpert(input.topkIdx, input.topkIdxIs32, firstEntry + i) : -1;
        weight[u] = i < entries && input.topkWeights != nullptr ? __ldg(input.topkWeights + firstEntry + i) : 1.0f;
      }
#pragma unroll
      for (int u = 0; u < kLayoutLoads; ++u) {
        const int i = i0 + u * static_cast<int>(blockDim.x);
        if (i >= entries) break;
        int64_t id = loaded[u];
        if (id < -1 || id >= g.numExperts) {
          raiseError(g.error, g.hostError, kErrorBadExpertId);  // treated as masked so the exchange still completes
          id = -1;
        }
        ids[i] = static_cast<int>(id);
        r.topkIds[firstEntry + i] = static_cast<int>(id);
        r.topkWeights[firstEntry + i] = weight[u];
      }
    }
    __syncthreads();
    if (base == first) traceStamp(g, &stamps.loaded);
    const int local = static_cast<int>(threadIdx.x);
    const int t = base + local;
    uint64_t mask = 0;
    if (local < tokens) {
      const int* mine = ids + local * g.topk;
      for (int k0 = 0; k0 < g.topk; k0 += kLayoutChunk) {
        int id[kLayoutChunk];
#pragma unroll
        for (int u = 0; u < kLayoutChunk; ++u) id[u] = k0 + u < g.topk ? mine[k0 + u] : -1;
#pragma unroll
        for (int u = 0; u < kLayoutChunk; ++u) {
          if (id[u] < 0) continue;
          mask |= 1ULL << quotientOf(owner, id[u]);
          // An expert named twice by one token receives it once.
          bool repeated = false;
#pragma unroll
          for (int q = 0; q < u; ++q) repeated = repeated || id[q] == id[u];
          for (int q = 0; q < k0 && !repeated; ++q) repeated = mine[q] == id[u];
          if (!repeated) atomicAdd(&expertCount[id[u]], 1);
        }
      }
      r.tokenRanks[t] = mask;
    }
    if (base == first) traceStamp(g, &stamps.masked);
    // Destinations d and d + 1 in one scan: a pass has at most blockDim tokens, so each count
    // fits 16 bits. destCount is read before the scan's barriers and written after them.
    static_assert(kCopyThreads < (1 << 16), "two 16-bit counts per scanned value");
    for (int d = 0; d < g.nRanks; d += 2) {
      const bool pair = d + 1 < g.nRanks;
      const int bits = static_cast<int>((mask >> d) & (pair ? 3ULL : 1ULL));
      const int before = destCount[d], beforeNext = pair ? destCount[d + 1] : 0;
      int totals = 0;
      const int prefixes = blockExclusiveScan<kCopyThreads>((bits & 1) | ((bits >> 1) << 16), &totals);
      if (bits & 1) lists[static_cast<size_t>(d) * g.blockTokenStride + before + (prefixes & 0xffff)] = t;
      if (bits & 2) lists[static_cast<size_t>(d + 1) * g.blockTokenStride + beforeNext + (prefixes >> 16)] = t;
      if (threadIdx.x == 0) {
        destCount[d] = before + (totals & 0xffff);
        if (pair) destCount[d + 1] = beforeNext + (totals >> 16);
      }
    }
  }
  __syncthreads();
  traceStamp(g, &stamps.listed);
  // The block's rows for every rank, into every rank's window: a rank places its rows after
  // those of the ranks before it there (sourceBefore). Only this GPU's own window needs the fence,
  // which publishes the block's token lists and routing to its other blocks; the peers' words go
  // out without waiting for it (the peers read counts only). Its rows for each expert go to the
  // expert's owner.
  for (int i = threadIdx.x; i < g.nRanks * g.nRanks; i += blockDim.x) {
    const int p = (g.rank + 1 + i / g.nRanks) % g.nRanks, d = i % g.nRanks;  // this GPU's own words last
    if (p == g.rank) fenceAcqRelGpu();
    storeRelaxed(blockWordsAt(g, p, epoch) + blockWordIndex(g, g.rank, blockIdx.x, d), blockWord(epoch, destCount[d], gridDim.x));
  }
  for (int e = threadIdx.x; e < g.numExperts; e += blockDim.x) {
    const int owner = e / g.numLocalExperts;
    storeRelaxed(blockExpertWordsAt(g, owner, epoch) + blockExpertWordIndex(g, g.rank, blockIdx.x, e % g.numLocalExperts),
                 countWord(epoch, expertCount[e]));
  }
}

// True if rank s's start word of this call is the same kind of call as ours; raises the mismatch
// (which ends the group, as a timeout does) if not.
__device__ bool sameCall(const GroupView& g, uint64_t word, bool cached, int routingTag) {
  const bool peerCached = blockWordBlocks(word) == 0;
  if (peerCached == cached && (!cached || blockWordRows(word) == routingTag)) return true;
  raiseError(g.error, g.hostError, kErrorCallMismatch | kErrorTimeout);
  return false;
}

__device__ __forceinline__ uint64_t* dispatchStartAt(const GroupView& g, int rank, uint64_t epoch) {
  return reinterpret_cast<Control*>(at(g, rank, g.layout.control))->dispatchStart[wordSet(epoch)];
}

// Block 0, at the kernel's entry: this rank's start word to every peer (Control::dispatchStart).
__device__ void publishStart(const GroupView& g, uint64_t epoch, bool cached, int routingTag) {
  const uint64_t word = blockWord(epoch, cached ? routingTag : 0, cached ? 0 : static_cast<int>(gridDim.x));
  for (int d = threadIdx.x; d < g.nRanks; d += blockDim.x) {
    if (d != g.rank) storeRelaxed(dispatchStartAt(g, d, epoch) + g.rank, word);
  }
}

// Rank s's start word of this call (a peer's), checked to be the same kind of call as ours; its
// block count goes to *blocks. False on a timeout or a mismatch.
__device__ bool waitStart(const GroupView& g, int s, uint64_t epoch, bool cached, int routingTag, int* blocks) {
  uint64_t word = 0;
  if (!waitTagged(g, dispatchStartAt(g, g.rank, epoch) + s, epoch, &word) || !sameCall(g, word, cached, routingTag)) {
    return false;
  }
  *blocks = blockWordBlocks(word);
  return true;
}

// Waits for what a block needs before its rows: the start word of every peer it writes into, and
// for each destination d of its role, the count words of every block of this rank and of every
// rank whose rows come before ours at d (sourceBefore); a cached dispatch needs the start words
// only. The start words and this rank's words are awaited at once (each wait is a round trip of
// ~1-1.5 us after an L2 flush): thread b < grid takes block b's words, and its rows for the first
// destination of the block's role go to firstRows[b] (shared), so that the rows need no second
// read of them. gridOf[s] receives rank s's block count (0 where not needed). The same answer in every
// thread.
__device__ bool waitBlockWords(const GroupView& g, uint64_t epoch, bool cached, int routingTag, const Role& role,
                               int* gridOf, int* firstRows, DispatchStamps& stamps) {
  int mine = 0;
  const uint64_t* words = blockWordsAt(g, g.rank, epoch);
  auto inRole = [&](int d) { return d == g.rank ? role.local : role.remote; };
  bool ok = true;
  const int s = static_cast<int>(blockDim.x) - 1 - static_cast<int>(threadIdx.x);  // the last threads: start words
  if (s < g.nRanks) {
    gridOf[s] = 0;
    if (s == g.rank) {
      if (!cached) gridOf[s] = gridDim.x;
    } else {
      bool before = false;  // s's rows come before ours at one of our role's destinations
      for (int d = 0; d < g.nRanks && !cached; ++d) {
        before = before || (inRole(d) && sourceBefore(s, g.rank, d, g.nRanks));
      }
      int blocks = 0;
      if (before || role.remote) {
        ok = waitStart(g, s, epoch, cached, routingTag, &blocks);
        stampLatest(g, &stamps.startWordsIn);
      }
      if (before) gridOf[s] = blocks;
    }
  }
  static_assert(kMaxBlocks + kMaxRanks <= kCopyThreads, "the first threads take the blocks, the last the ranks");
  if (!cached && threadIdx.x < gridDim.x) {
    // This rank's blocks published their token lists before their words: acquired here.
    bool first = true;
    for (int k = 0; k < g.nRanks && ok; ++k) {
      const int d = (g.rank + 1 + k) % g.nRanks;  // the rows' order of destinations
      if (!inRole(d)) continue;
      ok = waitUntil<false>(g, [&] {
        const uint64_t word = loadAcquireGpu(words + blockWordIndex(g, g.rank, threadIdx.x, d));
        if (first) mine = blockWordRows(word);
        return countWordIsFrom(word, epoch);
      });
      first = false;
    }
    firstRows[threadIdx.x] = mine;
    stampLatest(g, &stamps.ownWordsIn);
  }
  if (__syncthreads_or(!ok)) return false;
  if (!cached) {
    // The words of the ranks whose rows come first as one list, so that a thread's waits (usually
    // one) are not in series over s.
    int total = 0;
    for (int q = 0; q < g.nRanks; ++q) total += q == g.rank ? 0 : gridOf[q] * g.nRanks;
    if (total == 0) return true;
    for (int j = threadIdx.x; j < total && ok; j += blockDim.x) {
      int q = 0, column = j;
      for (;; ++q) {
        const int span = q == g.rank ? 0 : gridOf[q] * g.nRanks;
        if (column < span) break;
        column -= span;
      }
      const int b = column / g.nRanks, d = column % g.nRanks;
      if (!inRole(d) || !sourceBefore(q, g.rank, d, g.nRanks)) continue;
      uint64_t seen;
      ok = waitTagged(g, words + blockWordIndex(g, q, b, d), epoch, &seen);
    }
    if (__syncthreads_or(!ok)) return false;
  }
  return true;
}

// The last block of an uncached dispatch, before its rows (it writes local rows, which end long
// before the remote ones): what this rank receives from every rank and for each of its experts,
// and the experts' aligned regions, from every block's words. None of it is on the path of the
// remote rows. False on a timeout.
__device__ bool finishReceiveCounts(const GroupView& g, const Routing& r, uint64_t epoch) {
  __shared__ int gridOf[kMaxRanks];
  __shared__ int fromRank[kMaxRanks];
  __shared__ int perExpert[kMaxExperts];
  bool ok = true;
  for (int s = threadIdx.x; s < g.nRanks; s += blockDim.x) fromRank[s] = 0;
  for (int e = threadIdx.x; e < g.numLocalExperts; e += blockDim.x) perExpert[e] = 0;
  // Rows from each rank: every block's word for this rank.
  const uint64_t* words = blockWordsAt(g, g.rank, epoch);
  for (int s = threadIdx.x; s < g.nRanks && ok; s += blockDim.x) {
    gridOf[s] = gridDim.x;
    if (s != g.rank) ok = waitStart(g, s, epoch, false, 0, &gridOf[s]);
  }
  if (__syncthreads_or(!ok)) return false;
  // Every block's words for this rank, per source rank s: its rows (entries 0..G-1 for G blocks),
  // then its rows for each of our experts (entries G.., block-major: the words are one run), with
  // kWordBatch loads in flight per thread before any wait: the words are usually all there, and
  // polling one at a time costs a round trip each.
  const uint64_t* experts = blockExpertWordsAt(g, g.rank, epoch);
  constexpr int kWordBatch = 4;
  for (int s = 0; s < g.nRanks && ok; ++s) {
    const int blocks = gridOf[s];
    const uint64_t* expertRun = experts + blockExpertWordIndex(g, s, 0, 0);
    auto wordAt = [&](int j) {
      return j < blocks ? words + blockWordIndex(g, s, j, g.rank) : expertRun + (j - blocks);
    };
    const int n = blocks * (1 + g.numLocalExperts);
    int rows = 0;
    for (int j0 = threadIdx.x; j0 < n && ok; j0 += kWordBatch * blockDim.x) {
      uint64_t seen[kWordBatch];
#pragma unroll
      for (int u = 0; u < kWordBatch; ++u) {
        const int j = j0 + u * static_cast<int>(blockDim.x);
        seen[u] = j < n ? loadRelaxed(wordAt(j)) : 0;
      }
#pragma unroll
      for (int u = 0; u < kWordBatch; ++u) {
        const int j = j0 + u * static_cast<int>(blockDim.x);
        if (j >= n || !ok) break;
        if (!countWordIsFrom(seen[u], epoch)) ok = waitTagged(g, wordAt(j), epoch, &seen[u]);
        if (!ok) break;
        if (j < blocks) {
          rows += blockWordRows(seen[u]);
        } else if (countOf(seen[u]) != 0) {
          atomicAdd(&perExpert[(j - blocks) % g.numLocalExperts], countOf(seen[u]));
        }
      }
    }
    if (rows != 0) atomicAdd(&fromRank[s], rows);
  }
  if (__syncthreads_or(!ok)) return false;
  const int received = threadIdx.x < g.nRanks ? fromRank[threadIdx.x] : 0;
  if (threadIdx.x < g.nRanks) r.recvRowsPerRank[threadIdx.x] = received;
  int recvRows = 0;
  blockExclusiveScan<kCopyThreads>(received, &recvRows);
  // Expert regions: a thread per local expert (at most kMaxExperts = the block size), its count
  // over source ranks, then the aligned regions' offsets by a block scan.
  static_assert(kMaxExperts <= kCopyThreads, "one thread per local expert");
  const int e = threadIdx.x;
  int aligned = 0;
  if (e < g.numLocalExperts) {
    const int count = perExpert[e];
    r.recvRowsPerExpert[e] = count;
    aligned = (count + r.expertAlignment - 1) / r.expertAlignment * r.expertAlignment;
  }
  int expertRows = 0;
  const int expertOffset = blockExclusiveScan<kCopyThreads>(aligned, &expertRows);
  if (e < g.numLocalExperts) r.expertOffsets[e] = expertOffset;
  if (e == 0) {
    r.expertOffsets[g.numLocalExperts] = expertRows;
    *r.numExpertRows = expertRows;
    *r.numRecvRows = recvRows;
  }
  return true;
}

// What travels with `n` consecutive rows for rank d, the first at `row0`, whose tokens are
// tokens[0..n): FP8 scales, the top-k entries that are d's experts (as d's local ids; others -1
// with weight 0) and the source (rank, token). Each array's rows are one contiguous run at the
// destination, so the run goes out in full lines: written row by row, these few bytes per row
// cost ~6.5 us of a 122 us FP8 dispatch (measured by leaving them out). The runs are written in
// `slices` parts, slice `slice` here: element e of a run is in slice (e / 32) % slices, so that
// the rows' payload copies carry one slice each and hide its load latency.
__device__ __forceinline__ void writeRowsMetadata(const GroupView& g, const DispatchInput& input, const Routing& r,
                                                  int d, size_t row0, int n, const int* tokens, int lane, int slice,
                                                  int slices) {
  const WindowLayout& L = g.layout;
  const bool fp8 = input.dtype == Payload::kFp8;
  const int scalesPerRow = g.hidden / kScaleBlock;
  // Rows of whole 16-byte vectors of scales (hidden a multiple of 512) move as vectors.
  const int scaleWidth = scalesPerRow % 4 == 0 ? 4 : 1;
  const int scaleItems = fp8 ? n * scalesPerRow / scaleWidth : 0;
  float* scales = reinterpret_cast<float*>(at(g, d, L.recvScales)) + row0 * scalesPerRow;
  const int entries = n * g.topk;
  int* topk = reinterpret_cast<int*>(at(g, d, L.recvTopk)) + row0 * g.topk;
  float* weights = reinterpret_cast<float*>(at(g, d, L.recvWeights)) + row0 * g.topk;
  int* source = reinterpret_cast<int*>(at(g, d, L.recvSource)) + row0 * 2;
  const int first = d * g.numLocalExperts;
  const int items = max(max(scaleItems, entries), 2 * n);
  for (int e = slice * kWarp + lane; e < items; e += slices * kWarp) {
    // Every load before any store: a store could alias a later load as far as the compiler knows.
    float4 scale = {};
    if (e < scaleItems) {
      const int perRow = scalesPerRow / scaleWidth;
      const float* from = input.scales + static_cast<size_t>(tokens[e / perRow]) * scalesPerRow + (e % perRow) * scaleWidth;
      if (scaleWidth == 4) scale = __ldg(reinterpret_cast<const float4*>(from));
      else scale.x = __ldg(from);
    }
    // The routing's copy of the top-k entries: a cached re-dispatch has no top-k input of its own.
    int id = -1;
    float weight = 0.0f;
    if (e < entries) {
      const size_t from = static_cast<size_t>(tokens[e / g.topk]) * g.topk + e % g.topk;
      id = __ldcg(r.topkIds + from);
      weight = __ldcg(r.topkWeights + from);
    }
    if (e < scaleItems) {
      if (scaleWidth == 4) reinterpret_cast<float4*>(scales)[e] = scale;
      else scales[e] = scale.x;
    }
    if (e < entries) {
      const bool local = id >= first && id < first + g.numLocalExperts;
      topk[e] = local ? id - first : -1;
      weights[e] = local ? weight : 0.0f;
    }
    if (e < 2 * n) source[e] = e % 2 == 0 ? g.rank : tokens[e / 2];
  }
}

// One kernel per dispatch: block 0's start words at entry, then the layout and count words by
// every block (none when cached), payload by every block, then each block's rows-written count to
// the peers it wrote into, and the last block to finish waits until every peer's rows for this
// rank are in. With peers, some block must have the remote role (epRemoteBlocks): in every call
// the remote blocks wait for every peer's start word, so no peer can begin the call after next
// (and rewrite this call's set of words) before this rank has finished this one.
__global__ void __launch_bounds__(kCopyThreads) dispatchKernel(GroupView g, DispatchInput input, Routing r,
                                                               bool cached, int remoteBlocks) {
  __shared__ uint64_t epochShared;
  __shared__ bool timedOutShared;
  traceStart(g);
  if (threadIdx.x == 0) {
    // Both words in one round trip: after an L2 flush each is a miss to HBM.
    const uint64_t last = g.epochs->dispatch;
    const bool out = timedOut(g);
    epochShared = nextDispatchEpoch(last);
    timedOutShared = out;
  }
  __syncthreads();
  const uint64_t epoch = epochShared;
  if (timedOutShared) return;
  __shared__ DispatchStamps stamps;
  if (g.trace != nullptr && threadIdx.x == 0) stamps = {};
  if (blockIdx.x == 0) publishStart(g, epoch, cached, input.routingTag);
  traceStamp(g, &stamps.entered);
  if (!cached) layoutBlock(g, input, r, epoch, stamps);
  // Every thread's words are out before any thread of the block waits on them: a block's own word
  // is awaited by another of its threads (waitBlockWords), which must not spin ahead of the writer
  // (a forward-progress assumption that tools such as compute-sanitizer need not honour).
  __syncthreads();
  recordStamps(g, epoch, stamps);
  if (g.testStallNs != 0 && blockIdx.x >= gridDim.x / 2) {
    // Tests only: these blocks read their peers' words late, as blocks that start late would.
    const uint64_t until = globalTimerNs() + g.testStallNs;
    while (globalTimerNs() < until) __nanosleep(1000);
  }
  const Role role = blockRole(remoteBlocks);
  __shared__ int gridOf[kMaxRanks];
  __shared__ int firstRows[kMaxBlocks];  // block b's rows for this block's first destination
  // A cached dispatch's local rows need nothing from the peers; everything else does.
  if ((!cached || role.remote) &&
      !waitBlockWords(g, epoch, cached, input.routingTag, role, gridOf, firstRows, stamps)) {
    return;  // never reached the peers' buffers: they time out as well
  }
  if (g.trace != nullptr && threadIdx.x == 0) {
    const uint64_t start = *reinterpret_cast<const volatile uint64_t*>(&g.sync->traceStart);
    const uint64_t now = globalTimerNs();
    if (stamps.startWordsIn != 0) traceRecord(g.trace, kTraceDispatchStartWordsIn, epoch, stamps.startWordsIn - start);
    if (stamps.ownWordsIn != 0) traceRecord(g.trace, kTraceDispatchOwnWordsIn, epoch, stamps.ownWordsIn - start);
    traceRecord(g.trace, kTraceDispatchCountsIn, epoch, now - start);
  }
  if (!cached && blockIdx.x == gridDim.x - 1) {
    if (!finishReceiveCounts(g, r, epoch)) return;
    tracePoint(g, kTraceDispatchReceiveCounts, epoch);
  }

  const int lane = threadIdx.x % kWarp;
  const int warps = role.count * (kCopyThreads / kWarp);
  const int warp = role.index * (kCopyThreads / kWarp) + static_cast<int>(threadIdx.x) / kWarp;
  const int per = tokensPerBlock(input.numTokens);
  // Rows, not tokens, are dealt to the warps: with tokens, a warp's share of rows for a rank is
  // binomial (a dispatch warp has ~16 tokens), and the link idles while the unluckiest warps
  // finish alone. Each warp takes one contiguous run of rows, so that what travels with them is
  // contiguous too. Row j for rank d is this rank's j-th token for d: the layout listed each
  // block's tokens, so j's token is in the list of the last block whose first slot is at or below j.
  __shared__ int firstSlot[kMaxBlocks];
  __shared__ int batchTokens[kCopyThreads];  // a warp's 32 entries: the tokens of its current rows
  int* tokens = batchTokens + (threadIdx.x / kWarp) * kWarp;
  const int payloadBytes = g.hidden * payloadBytesPerValue(input.dtype);
  const uint64_t* words = blockWordsAt(g, g.rank, epoch);
  __shared__ int sentRows[kMaxRanks];  // thread 0's: rows this block writes into each peer
  if (threadIdx.x == 0) {
    for (int d = 0; d < g.nRanks; ++d) sentRows[d] = 0;
  }
  bool firstDestination = true;
  for (int k = 0; k < g.nRanks; ++k) {
    const int d = (g.rank + 1 + k) % g.nRanks;  // every rank starts with a different peer
    if (!(d == g.rank ? role.local : role.remote)) continue;
    const bool wordsSeen = firstDestination;  // by waitBlockWords, in firstRows
    firstDestination = false;
    int rows, sendOffset;
    if (cached) {
      rows = __ldcg(r.sendRows + d);
      sendOffset = __ldcg(r.sendOffset + d);
    } else {
      // This rank's rows for d and each of its blocks' first row.
      const int b = threadIdx.x;
      const int blockRows = b >= gridDim.x ? 0
                            : wordsSeen   ? firstRows[b]
                                          : blockWordRows(loadRelaxed(words + blockWordIndex(g, g.rank, b, d)));
      const int first = blockExclusiveScan<kCopyThreads>(blockRows, &rows);  // its barriers order firstSlot's reuse
      if (b < gridDim.x) firstSlot[b] = first;
      // Then the rows of the ranks that come before ours at d (none at our first destination).
      int lower = 0;
      bool anyBefore = false;
      for (int s = 0; s < g.nRanks; ++s) {
        if (s == g.rank || !sourceBefore(s, g.rank, d, g.nRanks)) continue;
        anyBefore = true;
        for (int q = threadIdx.x; q < gridOf[s]; q += blockDim.x) {
          lower += blockWordRows(loadRelaxed(words + blockWordIndex(g, s, q, d)));
        }
      }
      // The scan's barriers, or one of its own, order the writes of firstSlot before its reads by
      // every warp's row lookups below.
      sendOffset = 0;
      if (anyBefore) blockExclusiveScan<kCopyThreads>(lower, &sendOffset);
      else __syncthreads();
      if (role.index == 0 && threadIdx.x == 0) {  // for combine and cached re-dispatch
        r.sendRows[d] = rows;
        r.sendOffset[d] = sendOffset;
      }
    }
    int* sendTokens = r.sendTokens + static_cast<size_t>(d) * g.maxTokensPerRank;
    const int* blockTokens = g.blockTokens + static_cast<size_t>(d) * g.blockTokenStride;
    char* recvX = at(g, d, g.layout.recvX);
    const int begin = static_cast<int>(static_cast<int64_t>(rows) * warp / warps);
    const int end = static_cast<int>(static_cast<int64_t>(rows) * (warp + 1) / warps);
    if (threadIdx.x == 0 && d != g.rank) {  // warp 0 begins the block's run, the last warp ends it
      const int blockWarps = kCopyThreads / kWarp;
      sentRows[d] = static_cast<int>(static_cast<int64_t>(rows) * (warp + blockWarps) / warps) - begin;
    }
    // 32 rows at a time: lane i finds row i's token first, so that no row waits on a chain of
    // routing loads before its bytes start moving.
    for (int j0 = begin; j0 < end; j0 += kWarp) {
      const int n = min(kWarp, end - j0);
      const int mine = j0 + lane;
      int myToken = 0;
      if (lane < n) {
        if (cached) {
          myToken = __ldcg(sendTokens + mine);
        } else {
          int lo = 0, hi = gridDim.x - 1;  // the last block whose first slot is <= mine
          while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (firstSlot[mid] <= mine) lo = mid; else hi = mid - 1;
          }
          myToken = __ldcg(blockTokens + lo * per + (mine - firstSlot[lo]));
          sendTokens[mine] = myToken;  // for cached re-dispatch
          r.tokenSlot[static_cast<size_t>(myToken) * g.nRanks + d] = mine;  // for combine
        }
      }
      __syncwarp();  // the previous batch's tokens are consumed
      tokens[lane] = myToken;
      __syncwarp();
      const size_t row0 = static_cast<size_t>(sendOffset) + j0;
      for (int i = 0; i < n; ++i) {
        const int t = __shfl_sync(0xffffffff, myToken, i);
        writeRowsMetadata(g, input, r, d, row0, n, tokens, lane, i, n);
        // Rows are packed at the payload's own size: FP8 rows take half of a BF16 row.
        warpCopy(recvX + (row0 + i) * payloadBytes, static_cast<const char*>(input.x) + static_cast<size_t>(t) * payloadBytes,
                 payloadBytes, lane);
      }
    }
  }
  if (g.trace != nullptr) {
    __syncthreads();
    tracePoint(g, role.remote ? kTraceDispatchRemoteDone : kTraceDispatchLocalDone, epoch);
  }
  // Each block tells every peer it wrote into how many rows it wrote there, after one system fence,
  // and the last block of each rank waits until the rows it expects from every peer are in: a
  // block's signal leaves as soon as its own rows are out (with an end counter first, the signal
  // would wait for the rank's slowest block and cost a second system fence).
  __syncthreads();
  if (threadIdx.x == 0 && role.remote) {
    __threadfence_system();
    for (int d = 0; d < g.nRanks; ++d) {
      if (d != g.rank && sentRows[d] != 0) {
        addRelease(reinterpret_cast<Control*>(at(g, d, g.layout.control))->dispatchRowsIn + g.rank,
                   static_cast<uint64_t>(sentRows[d]));
      }
    }
  }
  if (lastBlockToFinish<false>(g)) {
    uint64_t* rowsIn = reinterpret_cast<Control*>(at(g, g.rank, g.layout.control))->dispatchRowsIn;
    bool ok = true;
    for (int s = threadIdx.x; s < g.nRanks; s += blockDim.x) {
      if (s == g.rank) continue;
      // The receive counts of this call (the finalizer's, ordered before us by the end counter)
      // or of the cached routing.
      const uint64_t expected = static_cast<uint64_t>(__ldcg(r.recvRowsPerRank + s));
      ok = waitUntil<false>(g, [&] { return loadAcquire(rowsIn + s) == expected; }) && ok;
      // No peer adds to it again before this rank's next dispatch has started (its start word),
      // which follows this kernel on the stream.
      if (ok) storeRelaxed(rowsIn + s, 0);
    }
    __syncthreads();
    tracePoint(g, kTraceDispatchEnd, epoch);
    if (threadIdx.x == 0) g.epochs->dispatch = epoch;
  }
}

// ---- expert-major expansion -----------------------------------------------------------------

// One block per local expert: its rows in rank-major order, compacted by a block scan.
__global__ void __launch_bounds__(kCopyThreads) expandKernel(GroupView g, Routing r, Payload dtype, ExpertMajorRows out) {
  if (timedOut(g)) return;
  __shared__ int rowIndex[kCopyThreads];
  const int expert = blockIdx.x;
  const int rows = *r.numRecvRows;
  const int base = r.expertOffsets[expert];
  const WindowLayout& L = g.layout;
  const int* recvTopk = reinterpret_cast<const int*>(at(g, g.rank, L.recvTopk));
  const int payloadBytes = g.hidden * payloadBytesPerValue(dtype);
  const int scalesPerRow = g.hidden / kScaleBlock;
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  int placed = 0;
  for (int chunk = 0; chunk < rows; chunk += kCopyThreads) {
    int j = chunk + static_cast<int>(threadIdx.x);
    int k = -1;
    if (j < rows) {
      for (int q = 0; q < g.topk && k < 0; ++q) {
        if (recvTopk[static_cast<size_t>(j) * g.topk + q] == expert) k = q;
      }
    }
    int total = 0;
    int prefix = blockExclusiveScan<kCopyThreads>(k >= 0 ? 1 : 0, &total);
    if (k >= 0) {
      rowIndex[prefix] = j;
      r.expertSlot[static_cast<size_t>(j) * g.topk + k] = base + placed + prefix;
    }
    __syncthreads();
    for (int i = warp; i < total; i += kCopyThreads / kWarp) {
      size_t from = static_cast<size_t>(rowIndex[i]);
      size_t to = static_cast<size_t>(base + placed + i);
      warpCopy(out.x + to * payloadBytes, at(g, g.rank, L.recvX) + from * payloadBytes, payloadBytes, lane);
      if (dtype == Payload::kFp8) {
        const float* s = reinterpret_cast<const float*>(at(g, g.rank, L.recvScales)) + from * scalesPerRow;
        for (int q = lane; q < scalesPerRow; q += kWarp) out.scales[to * scalesPerRow + q] = s[q];
      }
      if (lane < g.topk) {
        out.topk[to * g.topk + lane] = recvTopk[from * g.topk + lane];
        out.weights[to * g.topk + lane] = reinterpret_cast<const float*>(at(g, g.rank, L.recvWeights))[from * g.topk + lane];
      }
      if (lane < 2) out.source[to * 2 + lane] = reinterpret_cast<const int*>(at(g, g.rank, L.recvSource))[from * 2 + lane];
    }
    placed += total;
    __syncthreads();
  }
}

// ---- combine --------------------------------------------------------------------------------

// Vector v (8 BF16 values) of this rank's partial sum for received row j in the expert-major
// layout: the sum of the row's expert outputs in top-k order, weighted or not, in FP32 and rounded
// once. (In the rank-major layout the partial is the expert output row j itself.)
// Out of line, with scalar arguments: the reduction's unrolled loop holds it as a call only.
__device__ __noinline__ int4 expertMajorPartial(const int4* expertOutput, const int* slots, const float* weights,
                                                int topk, bool weighted, int v, int vectors) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k = 0; k < topk; ++k) {
    const int slot = slots[k];
    if (slot < 0) continue;
    float f[8];
    bf16x8ToFloat(__ldg(expertOutput + static_cast<size_t>(slot) * vectors + v), f);
    if (weighted) {
      const float w = weights[k];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = __fmaf_rn(w, f[i], acc[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], f[i]);
    }
  }
  return floatToBf16x8(acc);
}

// Received row j came from another rank: its partial sum goes to that rank's slot for this rank.
// Returns the flag that tells that rank the row has landed (the caller publishes it).
__device__ __forceinline__ uint64_t* sendPartial(const GroupView& g, const Routing& r, const CombineInput& in, size_t j,
                                           int s, int t, uint64_t epoch, int lane) {
  const WindowLayout& L = g.layout;
  const int rowBytes = g.hidden * 2;
  const int vectors = rowBytes / 16;
  const float* weights = reinterpret_cast<const float*>(at(g, g.rank, L.recvWeights));
  const size_t slot = static_cast<size_t>(g.rank) * g.maxTokensPerRank + t;
  char* dst = at(g, s, L.combineX) + slot * rowBytes;
  if (!in.expertMajor) {
    warpCopy(dst, static_cast<const char*>(in.expertOutput) + j * rowBytes, rowBytes, lane);
  } else {
    for (int v = lane; v < vectors; v += kWarp) {
      reinterpret_cast<int4*>(dst)[v] =
          expertMajorPartial(static_cast<const int4*>(in.expertOutput), r.expertSlot + j * g.topk,
                             weights + j * g.topk, g.topk, in.weighted, v, vectors);
    }
  }
  if (lane < g.topk) reinterpret_cast<float*>(at(g, s, L.combineWeights))[slot * g.topk + lane] = weights[j * g.topk + lane];
  return reinterpret_cast<uint64_t*>(at(g, s, L.combineFlags)) + slot;
}

// Rows a sender warp writes before it publishes their flags: each publication waits for the
// warp's NVLink writes to complete, so one per row would idle the warp for a round trip per row.
// Measured at 24 SMs with 8-10 senders on 2 x H200: 1 row 226-236 us, 2 rows 211-220, 4 rows
// 218-234, 8 rows 235-265 (later flags hold the reducers back more than the fences cost).
constexpr int kFlagBatch = 2;

// Lane i < pending holds the flag of the warp's i-th unpublished row: after the system fence
// (every lane's, after the warp barrier) each writes its flag; the reducers' acquire pairs with it.
__device__ __forceinline__ void publishFlags(uint64_t* flag, int pending, uint64_t epoch, int lane) {
  __syncwarp();
  __threadfence_system();
  if (lane < pending) asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(epoch) : "memory");
}

// Waits for a partial's flag: relaxed polls with a growing pause (hundreds of waiting warps share
// the memory system with the ones reducing), then one system-scope acquire of the flag, after
// which the partial's bytes are visible.
__device__ __forceinline__ bool waitPartial(const GroupView& g, const uint64_t* flag, uint64_t epoch) {
  if (!waitUntil<true>(g, [&] { return *reinterpret_cast<const volatile uint64_t*>(flag) >= epoch; })) return false;
  return loadAcquire(flag) >= epoch;
}

// Token t's combined row and weights: its partials summed over its ranks (`mask`) in ascending
// rank order in FP32 and rounded once, and its top-k weights summed the same way. `partial(s, v)`
// is vector v (8 BF16 values; zeros past the row) of rank s's partial, `weight(s, k)` its weight k.
// kUnrollV vectors per lane are loaded before any is summed; with kTwoAtOnce, a token of at most
// two ranks (every token with two ranks) has both rows' vectors in flight at once.
template <bool kTwoAtOnce, int kUnrollV, int kTwoVectors, typename Partial, typename Weight>
__device__ __forceinline__ void sumPartials(const GroupView& g, const CombineInput& in, int t, uint64_t mask, int lane,
                                            Partial partial, Weight weight) {
  const int vectors = g.hidden * 2 / 16;
  int4* out = reinterpret_cast<int4*>(in.combinedX) + static_cast<size_t>(t) * vectors;
  if (kTwoAtOnce && __popcll(mask) <= 2) {
    // No accumulator to hold; the sum is the same (0 + a) + b as the general path.
    const int first = mask != 0 ? __ffsll(static_cast<long long>(mask)) - 1 : -1;
    const uint64_t rest = mask != 0 ? mask & (mask - 1) : 0;
    const int second = rest != 0 ? __ffsll(static_cast<long long>(rest)) - 1 : -1;
    for (int v0 = lane; v0 < vectors; v0 += kTwoVectors * kWarp) {
      int4 a[kTwoVectors], b[kTwoVectors];
#pragma unroll
      for (int u = 0; u < kTwoVectors; ++u) {
        a[u] = first >= 0 ? partial(first, v0 + u * kWarp) : int4{0, 0, 0, 0};
        b[u] = second >= 0 ? partial(second, v0 + u * kWarp) : int4{0, 0, 0, 0};
      }
#pragma unroll
      for (int u = 0; u < kTwoVectors; ++u) {
        const int v = v0 + u * kWarp;
        if (v >= vectors) continue;
        float fa[8], fb[8];
        bf16x8ToFloat(a[u], fa);
        bf16x8ToFloat(b[u], fb);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          fa[i] = __fadd_rn(0.0f, first >= 0 ? fa[i] : 0.0f);
          if (second >= 0) fa[i] = __fadd_rn(fa[i], fb[i]);
        }
        out[v] = floatToBf16x8(fa);
      }
    }
  } else {
    for (int v0 = lane; v0 < vectors; v0 += kUnrollV * kWarp) {
      float acc[kUnrollV][8];
#pragma unroll
      for (int u = 0; u < kUnrollV; ++u) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
      }
      for (uint64_t m = mask; m != 0; m &= m - 1) {
        const int s = __ffsll(static_cast<long long>(m)) - 1;
        int4 loaded[kUnrollV];
#pragma unroll
        for (int u = 0; u < kUnrollV; ++u) loaded[u] = partial(s, v0 + u * kWarp);
#pragma unroll
        for (int u = 0; u < kUnrollV; ++u) {
          float f[8];
          bf16x8ToFloat(loaded[u], f);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[u][i] = __fadd_rn(acc[u][i], f[i]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnrollV; ++u) {
        const int v = v0 + u * kWarp;
        if (v < vectors) out[v] = floatToBf16x8(acc[u]);
      }
    }
  }
  if (in.combinedWeights != nullptr && lane < g.topk) {
    float sum = 0.0f;
    for (uint64_t m = mask; m != 0; m &= m - 1) sum = __fadd_rn(sum, weight(__ffsll(static_cast<long long>(m)) - 1, lane));
    in.combinedWeights[static_cast<size_t>(t) * g.topk + lane] = sum;
  }
}

// Token t of this rank, once the partials its other ranks pushed have landed: those partials and
// this rank's own, computed in place from the expert outputs (in the expert-major layout a call
// per vector, so that layout takes one vector at a time).
template <bool kExpertMajor>
__device__ __forceinline__ void reduceToken(const GroupView& g, const Routing& r, const CombineInput& in, int t,
                                           uint64_t mask, size_t ownRow, uint64_t epoch, int lane) {
  const WindowLayout& L = g.layout;
  const int vectors = g.hidden * 2 / 16;
  const int4* partials = reinterpret_cast<const int4*>(at(g, g.rank, L.combineX));
  const float* partialWeights = reinterpret_cast<const float*>(at(g, g.rank, L.combineWeights));
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(at(g, g.rank, L.combineFlags));
  const float* ownWeights = reinterpret_cast<const float*>(at(g, g.rank, L.recvWeights));
  const uint64_t own = 1ULL << g.rank;
  for (uint64_t m = mask & ~own; m != 0; m &= m - 1) {
    const int s = __ffsll(static_cast<long long>(m)) - 1;
    if (!waitPartial(g, flags + static_cast<size_t>(s) * g.maxTokensPerRank + t, epoch)) return;
  }
  const int4* ownOutput = static_cast<const int4*>(in.expertOutput) + ownRow * vectors;  // rank-major only
  auto partial = [&](int s, int v) {
    if (v >= vectors) return int4{0, 0, 0, 0};
    if (s != g.rank) return __ldcg(partials + (static_cast<size_t>(s) * g.maxTokensPerRank + t) * vectors + v);
    if (!kExpertMajor) return __ldg(ownOutput + v);
    return expertMajorPartial(static_cast<const int4*>(in.expertOutput), r.expertSlot + ownRow * g.topk,
                              ownWeights + ownRow * g.topk, g.topk, in.weighted, v, vectors);
  };
  auto weight = [&](int s, int k) {
    return s == g.rank ? ownWeights[ownRow * g.topk + k]
                       : __ldcg(partialWeights + (static_cast<size_t>(s) * g.maxTokensPerRank + t) * g.topk + k);
  };
  sumPartials<!kExpertMajor, kExpertMajor ? 1 : 2, 4>(g, in, t, mask, lane, partial, weight);
}

// Token t of this rank, reading every rank's expert output row of it where it lies: this rank's in
// its own combine input, each other rank's in that rank's, over NVLink (row `firstPeerRow` for the
// lowest other rank of the token, found by the caller ahead of time; any further rank's here).
__device__ __forceinline__ void pullToken(const GroupView& g, const Routing& r, const CombineInput& in,
                                          const int* sendOffset, int t, uint64_t mask, int ownRow, int firstPeerRow,
                                          int lane) {
  const WindowLayout& L = g.layout;
  const int vectors = g.hidden * 2 / 16;
  const uint64_t others = mask & ~(1ULL << g.rank);
  const int firstPeer = others != 0 ? __ffsll(static_cast<long long>(others)) - 1 : -1;
  auto rowAt = [&](int s) {
    if (s == g.rank) return ownRow;
    if (s == firstPeer) return firstPeerRow;
    return sendOffset[s] + __ldcg(r.tokenSlot + static_cast<size_t>(t) * g.nRanks + s);
  };
  auto partial = [&](int s, int v) {
    if (v >= vectors) return int4{0, 0, 0, 0};
    const int4* rows = reinterpret_cast<const int4*>(at(g, s, L.combineIn));
    return __ldcg(rows + static_cast<size_t>(rowAt(s)) * vectors + v);
  };
  auto weight = [&](int s, int k) {
    return __ldcg(reinterpret_cast<const float*>(at(g, s, L.recvWeights)) + static_cast<size_t>(rowAt(s)) * g.topk + k);
  };
  sumPartials<true, 2, kPullVectors>(g, in, t, mask, lane, partial, weight);
}

// One combine, one kernel, pipelined per token. Block 0 checks that every rank has ended its
// previous combine (their partial buffers are free); remote blocks then push partial sums to the
// tokens' ranks, each row followed by its flag, and reduce a few of the last tokens; the other
// blocks reduce this rank's other tokens as their partials land, computing this rank's own
// partial in place instead of copying it.
__global__ void __launch_bounds__(kCombineThreads) combineKernel(GroupView g, Routing r, CombineInput in,
                                                                   int remoteBlocks) {
  __shared__ uint64_t epochShared;
  traceStart(g);
  if (threadIdx.x == 0) epochShared = g.epochs->combine + 1;
  __syncthreads();
  const uint64_t epoch = epochShared;
  if (timedOut(g)) return;
  if (blockIdx.x == 0) {
    // A peer's partial buffers are free once its previous combine has ended: it says so as it ends,
    // so this wait usually finds the word written instead of paying a round trip with the peer.
    if (threadIdx.x < g.nRanks) {
      waitEpoch(reinterpret_cast<const uint64_t*>(at(g, g.rank, g.layout.control + offsetof(Control, combineDone))) +
                    threadIdx.x,
                epoch - 1, g.timeoutNs, g.error, g.hostError, kErrorTimeout);
    }
    __syncthreads();
    tracePoint(g, kTraceCombineStarted, epoch);
    if (threadIdx.x == 0) {
      __threadfence();
      *reinterpret_cast<volatile uint64_t*>(&g.sync->combineGo) = epoch;
    }
  }
  const Role role = blockRole(remoteBlocks);
  int ownFirst = 0;  // received rows are grouped by source rank: this rank's own rows are one range
  for (int s = 0; s < g.nRanks; ++s) ownFirst += sourceBefore(s, g.rank, g.rank, g.nRanks) ? r.recvRowsPerRank[s] : 0;
  const int lane = threadIdx.x % kWarp;
  const int warpInBlock = static_cast<int>(threadIdx.x) / kWarp;
  const int warps = role.count * (kCombineThreads / kWarp);
  // With separate sender blocks, each sender warp reduces one of the last tokens once its sends are
  // done (at most 1 in 16 tokens): the reducers alone trailed the last partial by ~14 us, behind
  // on tokens whose partials land as the sends end.
  const bool split = remoteBlocks > 0 && remoteBlocks < static_cast<int>(gridDim.x);
  const int helperTokens = split ? min(remoteBlocks * (kCombineThreads / kWarp), r.numTokens / 16) : 0;
  const int reducerTokens = r.numTokens - helperTokens;
  if (role.remote) {
    if (threadIdx.x == 0) waitGo(g, &g.sync->combineGo, epoch);
    __syncthreads();
    if (timedOut(g)) return;
    const int ownRows = r.recvRowsPerRank[g.rank];
    const int rows = *r.numRecvRows - ownRows;
    const int* source = reinterpret_cast<const int*>(at(g, g.rank, g.layout.recvSource));
    // Rows in ascending order over the warps (the reducers wait in token order), 32 at a time per
    // warp with lane k looking up row k's source first.
    for (int i0 = role.index * (kCombineThreads / kWarp) + warpInBlock; i0 < rows; i0 += warps * kWarp) {
      const int mine = i0 + lane * warps;
      int mySource = 0, myToken = 0;
      if (mine < rows) {
        const size_t j = static_cast<size_t>(mine < ownFirst ? mine : mine + ownRows);
        mySource = source[j * 2];
        myToken = source[j * 2 + 1];
      }
      uint64_t* pendingFlag = nullptr;
      int pending = 0;
      for (int k = 0; k < kWarp; ++k) {
        const int i = i0 + k * warps;
        if (i >= rows) break;
        const int s = __shfl_sync(0xffffffff, mySource, k);
        const int t = __shfl_sync(0xffffffff, myToken, k);
        uint64_t* flag = sendPartial(g, r, in, static_cast<size_t>(i < ownFirst ? i : i + ownRows), s, t, epoch, lane);
        if (lane == pending) pendingFlag = flag;
        if (++pending == kFlagBatch) {
          publishFlags(pendingFlag, pending, epoch, lane);
          pending = 0;
        }
      }
      if (pending > 0) publishFlags(pendingFlag, pending, epoch, lane);
    }
    if (g.trace != nullptr) {
      __syncthreads();
      tracePoint(g, kTraceCombineSent, epoch);
    }
    if (!role.local) {
      // Then one of the last tokens each (their partials land last, as these sends end).
      const int h = role.index * (kCombineThreads / kWarp) + warpInBlock;
      if (h < helperTokens) {
        const int t = reducerTokens + h;
        const uint64_t mask = __ldcg(r.tokenRanks + t);
        const size_t ownRow = (mask >> g.rank) & 1ULL
                                  ? ownFirst + __ldcg(r.tokenSlot + static_cast<size_t>(t) * g.nRanks + g.rank) : 0;
        if (in.expertMajor) reduceToken<true>(g, r, in, t, mask, ownRow, epoch, lane);
        else reduceToken<false>(g, r, in, t, mask, ownRow, epoch, lane);
      }
      if (g.trace != nullptr) {
        __syncthreads();
        tracePoint(g, kTraceCombineHelped, epoch);
      }
    }
  }
  if (role.local) {
    // Tokens 32 at a time per warp: lane k looks up token k's ranks and own row first.
    for (int t0 = role.index * (kCombineThreads / kWarp) + warpInBlock; t0 < reducerTokens; t0 += warps * kWarp) {
      const int mine = t0 + lane * warps;
      uint64_t myMask = 0;
      int myOwnRow = 0;
      if (mine < reducerTokens) {
        myMask = __ldcg(r.tokenRanks + mine);
        if ((myMask >> g.rank) & 1ULL) myOwnRow = ownFirst + __ldcg(r.tokenSlot + static_cast<size_t>(mine) * g.nRanks + g.rank);
      }
      for (int k = 0; k < kWarp; ++k) {
        const int t = t0 + k * warps;
        if (t >= reducerTokens) break;
        const uint64_t mask = __shfl_sync(0xffffffff, myMask, k);
        const size_t ownRow = static_cast<size_t>(__shfl_sync(0xffffffff, myOwnRow, k));
        if (in.expertMajor) reduceToken<true>(g, r, in, t, mask, ownRow, epoch, lane);
        else reduceToken<false>(g, r, in, t, mask, ownRow, epoch, lane);
      }
    }
    if (g.trace != nullptr) {
      __syncthreads();
      tracePoint(g, kTraceCombineReduced, epoch);
    }
  }
  if (lastBlockToFinish(g)) {
    // Every block's reads of this rank's partials are done (the system fence of lastBlockToFinish
    // orders them before): each peer may write its next combine's partials here.
    if (threadIdx.x < g.nRanks) {
      storeRelease(reinterpret_cast<uint64_t*>(at(g, threadIdx.x, g.layout.control + offsetof(Control, combineDone))) +
                       g.rank,
                   epoch);
    }
    tracePoint(g, kTraceCombineEnd, epoch);
    if (threadIdx.x == 0) g.epochs->combine = epoch;
  }
}

// One combine from the ranks' combine inputs (CombineInput::pull), one kernel and no sender: each
// rank says its input is written, then every warp of every block sums tokens of this rank,
// reading their rows out of the other ranks' inputs over NVLink (so the link carries each row
// once, read rather than written, and every SM reduces). The kernel ends only once every rank has
// finished reading this rank's input, so that the caller may rewrite it after the call.
__global__ void __launch_bounds__(kPullThreads) combinePullKernel(GroupView g, Routing r, CombineInput in) {
  __shared__ uint64_t epochShared;
  __shared__ int sendOffset[kMaxRanks];
  traceStart(g);
  if (threadIdx.x == 0) epochShared = g.epochs->combine + 1;
  for (int d = threadIdx.x; d < g.nRanks; d += blockDim.x) sendOffset[d] = __ldcg(r.sendOffset + d);
  __syncthreads();
  const uint64_t epoch = epochShared;
  if (timedOut(g)) return;
  const uint64_t* ready = reinterpret_cast<const uint64_t*>(at(g, g.rank, g.layout.control + offsetof(Control, combineReady)));
  if (threadIdx.x < g.nRanks) {
    const int d = threadIdx.x;
    if (blockIdx.x == 0) {
      // Our input was written by earlier work of this stream; the fence publishes it with the word.
      __threadfence_system();
      storeRelease(reinterpret_cast<uint64_t*>(at(g, d, g.layout.control + offsetof(Control, combineReady))) + g.rank,
                   epoch);
    }
    // Every block watches the words itself: no hand-over from block 0 on the way to the payload.
    waitEpoch(ready + d, epoch, g.timeoutNs, g.error, g.hostError, kErrorTimeout);
  }
  __syncthreads();
  if (blockIdx.x == 0) tracePoint(g, kTraceCombineStarted, epoch);
  if (timedOut(g)) return;
  int ownFirst = 0;  // received rows are grouped by source rank: this rank's own rows are one range
  for (int s = 0; s < g.nRanks; ++s) ownFirst += sourceBefore(s, g.rank, g.rank, g.nRanks) ? r.recvRowsPerRank[s] : 0;
  const int lane = threadIdx.x % kWarp;
  const int warps = gridDim.x * (kPullThreads / kWarp);
  // Tokens 32 at a time per warp: lane k looks up token k's ranks and rows first.
  for (int t0 = blockIdx.x * (kPullThreads / kWarp) + static_cast<int>(threadIdx.x) / kWarp; t0 < r.numTokens;
       t0 += warps * kWarp) {
    const int mine = t0 + lane * warps;
    uint64_t myMask = 0;
    int myOwnRow = 0, myPeerRow = 0;
    if (mine < r.numTokens) {
      myMask = __ldcg(r.tokenRanks + mine);
      const uint64_t others = myMask & ~(1ULL << g.rank);
      if ((myMask >> g.rank) & 1ULL) myOwnRow = ownFirst + __ldcg(r.tokenSlot + static_cast<size_t>(mine) * g.nRanks + g.rank);
      if (others != 0) {
        const int peer = __ffsll(static_cast<long long>(others)) - 1;
        myPeerRow = sendOffset[peer] + __ldcg(r.tokenSlot + static_cast<size_t>(mine) * g.nRanks + peer);
      }
    }
    for (int k = 0; k < kWarp; ++k) {
      const int t = t0 + k * warps;
      if (t >= r.numTokens) break;
      pullToken(g, r, in, sendOffset, t, __shfl_sync(0xffffffff, myMask, k), __shfl_sync(0xffffffff, myOwnRow, k),
                __shfl_sync(0xffffffff, myPeerRow, k), lane);
    }
  }
  if (g.trace != nullptr) {
    __syncthreads();
    tracePoint(g, kTraceCombineReduced, epoch);
  }
  if (lastBlockToFinish(g)) {
    // Every block's reads of the peers' inputs are done (lastBlockToFinish's system fence): tell
    // each rank, and wait until every rank has read ours. Only then combineDone: a pushing
    // combine that follows writes its partials into this same region (WindowLayout::combineIn).
    const size_t control = g.layout.control;
    if (threadIdx.x < g.nRanks) {
      const int d = threadIdx.x;
      storeRelease(reinterpret_cast<uint64_t*>(at(g, d, control + offsetof(Control, combineRead))) + g.rank, epoch);
      waitEpoch(reinterpret_cast<const uint64_t*>(at(g, g.rank, control + offsetof(Control, combineRead))) + d, epoch,
                g.timeoutNs, g.error, g.hostError, kErrorTimeout);
    }
    __syncthreads();
    if (threadIdx.x < g.nRanks) {
      storeRelease(reinterpret_cast<uint64_t*>(at(g, threadIdx.x, control + offsetof(Control, combineDone))) + g.rank,
                   epoch);
    }
    __syncthreads();
    tracePoint(g, kTraceCombineEnd, epoch);
    if (threadIdx.x == 0) g.epochs->combine = epoch;
  }
}

}  // namespace

cudaError_t launchDispatch(const GroupView& group, const DispatchInput& input, const Routing& routing, bool cached,
                           int numBlocks, int remoteBlocks, cudaStream_t stream) {
  dispatchKernel<<<numBlocks, kCopyThreads, 0, stream>>>(group, input, routing, cached, remoteBlocks);
  return cudaGetLastError();
}

cudaError_t launchExpand(const GroupView& group, const Routing& routing, Payload dtype, const ExpertMajorRows& rows,
                         cudaStream_t stream) {
  expandKernel<<<group.numLocalExperts, kCopyThreads, 0, stream>>>(group, routing, dtype, rows);
  return cudaGetLastError();
}

cudaError_t launchCombine(const GroupView& group, const Routing& routing, const CombineInput& input, int numBlocks,
                          int remoteBlocks, cudaStream_t stream) {
  if (input.pull) {
    combinePullKernel<<<numBlocks, kPullThreads, 0, stream>>>(group, routing, input);
    return cudaGetLastError();
  }
  combineKernel<<<numBlocks, kCombineThreads, 0, stream>>>(group, routing, input, remoteBlocks);
  return cudaGetLastError();
}

}  // namespace unifab::kernels::ep
