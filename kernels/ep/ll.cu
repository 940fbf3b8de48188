// Low-latency expert-parallel dispatch and combine (see ll_kernels.h for the protocol).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/common/bf16x8.cuh"
#include "kernels/common/bulk_copy.cuh"
#include "kernels/common/device_sync.cuh"
#include "kernels/common/flagged_lines.cuh"
#include "kernels/common/grid_dependency.cuh"
#include "kernels/ep/fp8_scale.cuh"
#include "kernels/ep/ll_kernels.h"

namespace unifab::kernels::ep {
namespace {

constexpr int kWarp = 32;
constexpr int kWarps = kLlWarpsPerBlock;
constexpr int kThreads = kWarps * kWarp;
constexpr int kVectorsPerLane = (kLlPartValues + kWarp * 8 - 1) / (kWarp * 8);  // 16-byte BF16 vectors of a part per lane
// A sending warp's part stream in shared memory (kernels/ep/ll_kernels.h: llRunLines), at most a
// BF16 part's values, and the line groups that carry it (the header lines are built apart:
// storeHeaderLines); an FP8 part's scales are staged past the largest stream.
constexpr int kPartScales = kLlPartValues / kScaleBlock;
constexpr int kStagedScalesAt = kLlPartValues * 2;
constexpr int kPartStreamBytes = kStagedScalesAt + 8 * 4;
static_assert(kPartScales <= 8, "an FP8 part's scales stage in eight words");
constexpr int kPartSendGroups = (llDataLines(false) + kLinesPerGroup - 1) / kLinesPerGroup;
constexpr int kPartGroups = kLlCombinePartLines / kLinesPerGroup;  // of a combine partial's part
static_assert(kLlCombinePartLines % kLinesPerGroup == 0, "a partial's part is whole line groups");
constexpr int kCombineRowsInFlight = 4;  // expert rows a combining warp loads at once

__device__ __forceinline__ char* at(const LlView& g, int rank, size_t offset) { return g.peerBase[rank] + offset; }
__device__ __forceinline__ size_t setOffset(const LlView& g, int set) {
  return g.layout.setBase + static_cast<size_t>(set) * g.layout.setBytes;
}
__device__ __forceinline__ WaitBounds bounds(const LlView& g) { return {g.error, g.hostError, g.timeoutNs}; }

// A kernel's warps, numbered for each phase: the send phase's items go to the low warps of every
// block and the receive phase's to the high ones, both dealt over the blocks first. So each phase
// spreads over all SMs, and, while the two phases' work fits in the grid's warps, a receiving warp
// polls from the kernel's start instead of after a send item of its own.
__device__ __forceinline__ int sendWarpIndex() { return static_cast<int>(threadIdx.x / kWarp) * gridDim.x + blockIdx.x; }
__device__ __forceinline__ int receiveWarpIndex() {
  return (kWarps - 1 - static_cast<int>(threadIdx.x / kWarp)) * gridDim.x + blockIdx.x;
}

// What a block needs of the call before any of its warps writes: the epochs of the operation's two
// phases and whether the group has timed out. The last kStartWords lanes of the block's last warp
// (a receiving warp, which needs the epochs before anything else) each load one of the words
// (loadStartWord) at the kernel's start and hand them to every warp through shared memory
// (BlockStart): one load per block and word, not one per warp (with 1792 warps at 128 tokens
// reading one line, the blocks had their epochs 0.6 to 3 us after the start).
struct LlEpochs {
  uint64_t send, receive;
  bool timedOut;
};
constexpr int kStartWords = 3;

// The hand-over: the words and an mbarrier that their threads arrive on. Each warp waits
// for it where it first needs the epochs (CallEpochs), not at a block barrier, which held every warp
// until the block's slowest had issued its first loads (a warp with more than four 16-byte loads a
// lane in flight stalls at the next; docs/benchmarks/ep-ll.md, twenty-sixth session): a part warp
// now checks its token's ids, and a combine warp sums its rows, while the epochs are on their way.
struct BlockStart {
  uint64_t word[kStartWords];
  uint64_t arrivals;  // mbarrier: the start words' threads' arrivals complete its phase 0
};

// The threads that load the start words: the block's last ones. Lanes 0-3 of warp 0, a sending warp
// at one token, published them later (+0.3 to +0.5 us on the 1-token dispatch, docs/benchmarks/ep-ll.md).
constexpr int kFirstStartThread = kThreads - kStartWords;

// The whole block, first thing: thread 0 readies the mbarrier (a block barrier where the warps arrive
// together, at the kernel's start).
__device__ __forceinline__ void initBlockStart(BlockStart& start) {
  if (threadIdx.x == 0) barrierInit<kStartWords>(&start.arrivals);
  __syncthreads();
}

// The start words' threads: their word (loadStartWord) in, and their arrival.
__device__ __forceinline__ void publishStartWord(BlockStart& start, uint64_t word) {
  if (threadIdx.x >= kFirstStartThread) {
    start.word[threadIdx.x - kFirstStartThread] = word;
    barrierArrive(&start.arrivals);
  }
}

// A warp's view of the call's epochs, waited for once, where first needed.
struct CallEpochs {
  BlockStart* start;
  LlEpochs e;
  bool known;
};

// Start word `which` (0..kStartWords - 1): the two phases' last epochs, the error word.
__device__ __forceinline__ uint64_t loadStartWord(const LlView& g, const LlOpCounters* c, int which) {
  if (which == 2) return static_cast<uint64_t>(*reinterpret_cast<const volatile int*>(g.error));
  return loadRelaxed(which == 0 ? &c->send[blockIdx.x] : &c->receive[blockIdx.x]);
}

// A kernel's parameters sit in a constant bank that each launch fills anew, so its first reads of
// them miss the constant cache, and a warp waits for each missing line in turn (Nsight Compute on
// the LL kernels, 2026-12-01: 'imc' stalls on six parameter reads in a row at the start). Warp w of
// each block reads a word of the w-th 64-byte line of the view (the last two warps the input's
// first and last fields, given by the caller: the input is at most two lines), so
// that a block fetches all its parameter lines at once; `sink` (shared) keeps the reads, and its
// volatile stores keep them ahead of the kernel's first memory accesses. The view is a
// __grid_constant__ parameter (its address is taken); so is the dispatch's input and not the
// combine's: when both kernels were at 128 registers, the one combination in which ptxas fitted
// both unspilled (the combine has been at ~100 since its 448-value parts and its sums in line
// layout; making its input a __grid_constant__ too is left for a measured change).
constexpr int kConstantLineBytes = 64;
static_assert(sizeof(LlView) <= (kWarps - 2) * kConstantLineBytes, "a warp for each line of the view");
__device__ __forceinline__ void touchParameterLines(const LlView& g, int inputFirst, int inputLast, int* sink) {
  const int warp = static_cast<int>(threadIdx.x / kWarp);
  volatile int* kept = sink;
  if (warp * kConstantLineBytes < static_cast<int>(sizeof(LlView))) {
    kept[warp] = reinterpret_cast<const int*>(&g)[warp * kConstantLineBytes / 4];
  } else if (warp == kWarps - 2) {
    kept[warp] = inputFirst;
  } else if (warp == kWarps - 1) {
    kept[warp] = inputLast;
  }
}

// Tracing (UNIFAB_EP_TRACE): each warp keeps the global timer at each of its points (0: not
// reached) and writes them as its record after its work (traceWarp); block 0 stamps the kernel's
// start.
// `published`: the dispatch's last part's lines stored, the combine's first part's lines stored;
// `arrived`: the dispatch's first message's lines all in, the combine's first partials' lines in;
// `exited`: the warp's last instruction, after the loads it issued at the start have come back (a
// warp does not retire before them); `awaited` (the dispatch's): its first message's routing
// (bitmap word, cleared counts) seen.
// Stamps keep the timer's low 32 bits (differences within a call are far below 4 s). They sit in
// shared memory, written only while tracing: in registers, the kernels (the dispatch at its 128)
// carried them through every path, traced or not. A stamp is taken by the whole warp.
enum LlStamp {
  kStarted, kLoaded, kPublished, kSent, kArrived, kReceived, kExited,            // both operations
  kAwaited, kIdsIn, kValuesIn, kMaskIn, kWordStored, kRowsKnown,                 // the dispatch's further points
  kLlStamps
};
static_assert(kTraceLlCombineStarted - kTraceLlDispatchStarted == kLlStamps, "a trace point for each dispatch stamp");
static_assert(kTracePoints - kTraceLlCombineStarted == kExited + 1, "a trace point for each of the combine's stamps");
__device__ __forceinline__ uint32_t* warpStamps() {
  __shared__ uint32_t stamps[kWarps][kLlStamps];
  return stamps[threadIdx.x / kWarp];
}
__device__ __forceinline__ void clearStamps(const LlView& g) {
  if (g.trace != nullptr && threadIdx.x % kWarp < kLlStamps) warpStamps()[threadIdx.x % kWarp] = 0;
}
// `which` at now(), unless taken already (stampOnce) or whatever it held (stampAgain).
template <typename Now>
__device__ __forceinline__ void stampOnce(const LlView& g, LlStamp which, Now now) {
  if (g.trace == nullptr) return;
  uint32_t* slot = warpStamps() + which;
  if (*slot == 0) {
    const uint32_t at = now();
    __syncwarp();
    *slot = at;
  }
}
template <typename Now>
__device__ __forceinline__ void stampAgain(const LlView& g, LlStamp which, Now now) {
  if (g.trace == nullptr) return;
  const uint32_t at = now();
  __syncwarp();
  warpStamps()[which] = at;
}

__device__ __forceinline__ uint32_t traceNow(const LlView& g) {
  return g.trace != nullptr ? static_cast<uint32_t>(globalTimerNs()) | 1u : 0;  // never 0 when taken
}

// The same, taken once `dependency` is computed (to time the loads behind it); ptxas may still
// issue the timer read a little earlier, so such a stamp is a lower bound.
__device__ __forceinline__ uint32_t traceNowAfter(const LlView& g, uint32_t dependency) {
  if (g.trace == nullptr) return 0;
  uint32_t now;
  asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(now) : "r"(dependency));
  return now | 1u;
}

// The same, kept after the memory accesses before it by the compiler; ptxas may still read the
// timer before they issue, so such a stamp is a lower bound too.
__device__ __forceinline__ uint32_t traceNowIssued(const LlView& g) {
  if (g.trace == nullptr) return 0;
  uint32_t now;
  asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(now)::"memory");
  return now | 1u;
}

__device__ __forceinline__ void traceKernelStart(const LlView& g) {
  if (g.trace != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    *reinterpret_cast<volatile uint64_t*>(&g.counters->traceStart) = globalTimerNs();
  }
}

// The warp's record (ll_kernels.h: llTraceRecord) of operation `operation`'s kernel (a
// receive-only one or not) in call `epoch`: its first `points` stamps, relative to block 0's
// start. The whole warp, at its end, only while tracing; out of line, so that the kernels' code
// is laid out as without it (inline, it cost the combine 0.3 us untraced, docs/benchmarks/ep-ll.md,
// thirtieth session).
__device__ __noinline__ void traceWarp(const LlView& g, int operation, bool receiveOnly, int points, uint64_t epoch) {
  const int kind = llTraceKind(operation, receiveOnly);
  const int lane = threadIdx.x % kWarp;
  static_assert(kLlStamps + 1 <= kLlTraceRecordWords, "a record holds the epoch and every stamp");
  __syncwarp();  // every lane's stamps stored
  const uint32_t start = static_cast<uint32_t>(*reinterpret_cast<const volatile uint64_t*>(&g.counters->traceStart));
  const int warp = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x / kWarp);
  uint32_t* record = g.trace + llTraceRecord(kind, epoch, warp, g.counterBlocks);
  if (lane == 0) {
    record[0] = static_cast<uint32_t>(epoch);
  } else if (lane <= kLlStamps) {
    // A warp that gets here before block 0 stamped this call's start reads the previous call's
    // start (an inflated time; tracing is a diagnostic), or a wrapped difference, left out.
    const uint32_t at = lane <= points ? warpStamps()[lane - 1] : 0;
    record[lane] = at != 0 && at - start < (1u << 31) ? max(at - start, 1u) : 0;
  }
}

// The call's epochs in epochs.e once the block's start words are in (the first call waits for them,
// bounded by the group's timeout; kStarted notes when): false, in the whole warp, if the
// group has timed out.
__device__ __forceinline__ bool awaitStartWords(const LlView& g, CallEpochs& epochs) {
  uint64_t since = 0;
  for (unsigned polls = 0;; ++polls) {
    if (barrierTryWait(&epochs.start->arrivals, 0)) break;
    if (polls == 0) {
      since = globalTimerNs();
    } else if (globalTimerNs() - since > g.timeoutNs) {
      raiseError(g.error, g.hostError, kErrorTimeout);
      return false;
    }
  }
  const uint64_t* word = epochs.start->word;
  epochs.e = {word[0] + 1, word[1] + 1, (word[2] & kErrorTimeout) != 0};
  epochs.known = true;
  stampAgain(g, kStarted, [&] { return traceNow(g); });
  return !epochs.e.timedOut;
}
__device__ __forceinline__ bool haveEpochs(const LlView& g, CallEpochs& epochs) {
  return epochs.known ? !epochs.e.timedOut : awaitStartWords(g, epochs);
}

// Thread 0 of every block once its epochs are known: the call's epochs of the phases it runs, for
// the next call, into the block's words (LlOpCounters). Plain stores: no block of this call reads
// them again. The last block to arrive used to record them after a fence and a returning atomic,
// in a sending and a receiving warp of every block (0-token dispatch: 4.1 us of kernel time, an
// empty grid 0.9; docs/benchmarks/ep-ll.md, twenty-seventh session).
__device__ __forceinline__ void recordEpochs(const LlView& g, LlOpCounters* c, bool send, bool receive, const LlEpochs& e) {
  if (threadIdx.x != 0) return;
  for (int w = blockIdx.x; w < g.counterBlocks; w += gridDim.x) {
    if (send) c->send[w] = e.send;
    if (receive) c->receive[w] = e.receive;
  }
}

// The slot of rank `source`'s token `token` in rank `rank`, for a send of epoch `epoch`.
__device__ __forceinline__ char* messageAt(const LlView& g, int rank, uint64_t epoch, int source, int token) {
  const size_t generation = epoch % kLlGenerations;
  return at(g, rank, g.layout.messages + generation * g.layout.messageGenerationBytes) +
         (static_cast<size_t>(source) * g.maxTokens + token) * g.layout.messageBytes;
}

// Rank `source`'s bitmap word `word` (tokens 32 word .. 32 word + 31) in rank `rank`, for a send of
// epoch `epoch`.
__device__ __forceinline__ uint64_t* bitWordAt(const LlView& g, int rank, uint64_t epoch, int source, int word) {
  const size_t generation = epoch % kLlGenerations;
  return reinterpret_cast<uint64_t*>(at(g, rank, g.layout.tokenBits)) +
         (generation * g.nRanks + source) * g.layout.bitWords + word;
}

// The lines of rank `source`'s combine partial for token `token` (of rank `rank`).
__device__ __forceinline__ char* partialAt(const LlView& g, int rank, int set, int source, int token) {
  return at(g, rank, setOffset(g, set) + g.layout.partials) +
         (static_cast<size_t>(source) * g.maxTokens + token) * g.layout.partialBytes;
}

// The k-th top-k entry of token t as given (-1 for k >= topk).
__device__ __forceinline__ int64_t loadExpertId(const LlView& g, const LlDispatchInput& in, int t, int k) {
  if (k >= g.topk) return -1;
  const size_t index = static_cast<size_t>(t) * g.topk + k;
  return in.topkIdxIs32 ? static_cast<int64_t>(static_cast<const int32_t*>(in.topkIdx)[index])
                        : static_cast<const int64_t*>(in.topkIdx)[index];
}

// Lane k < topk holds the token's k-th entry: the expert as validated (an id outside
// -1..numExperts-1 raises the error and counts as -1; an expert named again at a later slot counts
// once, at its first slot).
__device__ __forceinline__ int validExpert(const LlView& g, int64_t raw, int lane) {
  int id = -1;
  if (lane < g.topk) {
    if (raw < -1 || raw >= g.numExperts) {
      raiseError(g.error, g.hostError, kErrorBadExpertId);
    } else {
      id = static_cast<int>(raw);
    }
  }
  const unsigned same = __match_any_sync(0xffffffff, id);
  const unsigned below = (1u << lane) - 1;
  if (id >= 0 && (same & below) != 0) id = -1;
  return id;
}

// The ranks that token t (< numTokens, else none) goes to, for one lane alone: eight entries'
// loads in flight at a time.
__device__ __forceinline__ uint64_t tokenRankMask(const LlView& g, const LlDispatchInput& in, int t) {
  uint64_t mask = 0;
  if (t >= in.numTokens) return mask;
  for (int k0 = 0; k0 < g.topk; k0 += 8) {
    int64_t raw[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) raw[k] = loadExpertId(g, in, t, k0 + k);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if (raw[k] >= 0 && raw[k] < g.numExperts) mask |= 1ULL << quotientOf(g.localExperts, static_cast<int>(raw[k]));
    }
  }
  return mask;
}

// The ranks of the warp's token (every lane gets the mask).
__device__ __forceinline__ uint64_t ranksOf(const LlView& g, int id) {
  const uint64_t bit = id >= 0 ? 1ULL << quotientOf(g.localExperts, id) : 0;
  const unsigned lo = __reduce_or_sync(0xffffffff, static_cast<unsigned>(bit));
  const unsigned hi = __reduce_or_sync(0xffffffff, static_cast<unsigned>(bit >> 32));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// e4m3 of 8 values with scale `inverse` applied (saturating, round to nearest even).
__device__ __forceinline__ uint2 toFp8x8(const float* v, float inverse) {
  uint32_t word[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    const __nv_fp8x2_storage_t pair =
        __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(v[i], inverse), __fmul_rn(v[i + 1], inverse)), __NV_SATFINITE, __NV_E4M3);
    word[i / 4] |= static_cast<uint32_t>(pair) << (16 * ((i / 2) % 2));
  }
  return make_uint2(word[0], word[1]);
}

// ---- dispatch ---------------------------------------------------------------------------------

// A warp's inputs for one message part (item = token * parts + part): the part's BF16 values, and
// lane k < topk's raw top-k entry and weight of the token. A warp's first part is loaded before
// the call's epochs are known, in the same round trip.
struct PartInput {
  int4 raw[kVectorsPerLane];
  int64_t id;
  float weight;
};

__device__ __forceinline__ void loadPart(const LlView& g, const LlDispatchInput& in, int item, int lane, PartInput& part) {
  const int t = quotientOf(g.parts, item), first = (item - t * g.parts.divisor) * kLlPartValues;
  const int partValues = min(kLlPartValues, g.hidden - first);
  const int4* src = reinterpret_cast<const int4*>(static_cast<const __nv_bfloat16*>(in.x) + static_cast<size_t>(t) * g.hidden + first);
#pragma unroll
  for (int i = 0; i < kVectorsPerLane; ++i) {
    part.raw[i] = i * 256 + lane * 8 < partValues ? __ldg(src + i * kWarp + lane) : int4{0, 0, 0, 0};
  }
  part.id = loadExpertId(g, in, t, lane);
  part.weight = lane < g.topk && in.topkWeights != nullptr ? in.topkWeights[static_cast<size_t>(t) * g.topk + lane] : 1.0f;
}

// The send phase's items: the message parts (token * parts + part), then the bitmap words, so that
// while the grid has a warp for each, no part's warp first stores and checks a bitmap word (the
// receiver needs both; a word's warp has nothing to load but the token's top-k entries).
__device__ __forceinline__ int dispatchMessageItems(const LlView& g, const LlDispatchInput& in) {
  return in.numTokens * llParts(g.hidden);
}
// The first bitmap word of warp `warp` of `warps` (>= bitWords: none).
__device__ __forceinline__ int firstBitWord(int messageItems, int warp, int warps) {
  const int item = warp >= messageItems ? warp : warp + (messageItems - warp + warps - 1) / warps * warps;
  return item - messageItems;
}

// The header lines of token t's message (ll_kernels.h: lane k's piece carries top-k entry k, its
// id and weight) stored at `headerAt` of its slot in every rank of `ranks`, for the send of epoch
// `epoch` (the lines' flag): each lane stores the entry it holds, so that neither side moves
// entries between lanes. The whole warp calls this (one store per line).
__device__ void storeHeaderLines(const LlView& g, int t, uint64_t ranks, size_t headerAt, int id, float weight,
                                 uint64_t epoch, int lane) {
  LineRun<1> header;
  header.lo[0] = static_cast<uint64_t>(__float_as_uint(weight)) << 32 | static_cast<unsigned>(id);
  header.hi[0] = lane % 8 == kFlagPiece ? epoch : 0;
  for (uint64_t m = ranks; m != 0; m &= m - 1) {
    const int d = __ffsll(static_cast<long long>(m)) - 1;
    header.storeLines(messageAt(g, d, epoch, g.rank, t) + headerAt, 0, llHeaderLines(g.topk), lane);
  }
}

// The send phase of the warp `warp` of `warps`. `part` (loadPart: its first item's if that is a
// part) and `bitmapMask` (tokenRankMask: its first item's if that is a bitmap word) were loaded
// with the epochs. Nothing is checked before a slot or a bitmap word is written: both are in the
// send's generation (kLlGenerations), whose last reader is done. Release words per message
// slot, loaded by the sender with its inputs and stored across NVLink by its receivers, cost the
// dispatch 0.5 / 1.0 / 0.6 us at 1 / 32 / 128 tokens on one GPU (docs/benchmarks/ep-ll.md,
// thirtieth session).
__device__ void dispatchSend(const LlView& g, const LlDispatchInput& in, int set, CallEpochs& epochs, int warp, int warps,
                             uint64_t bitmapMask, PartInput& part, char* staging) {
  const int lane = threadIdx.x % kWarp;
  const LlEpochs& e = epochs.e;  // valid once haveEpochs: each path waits for it before its first write
  const LlSetLocal& local = g.sets[set];

  // Message parts: one warp per (token, part).
  const int parts = llParts(g.hidden);
  const int messageItems = dispatchMessageItems(g, in);
  // This rank's receive phase counts rows into the set's recvCount, which holds the counts of the
  // set's previous dispatch (the caller's until this call) until the grid's last warp clears it,
  // after its own items: it has none unless the parts and bitmap words reach 16 x gridDim.x (a
  // kernel capped at the GPU's SMs, or a send-only one).
  const auto clearCounts = [&] {
    if (warp != warps - 1 || !haveEpochs(g, epochs)) return;
    for (int x = lane; x < g.numLocalExperts; x += kWarp) local.recvCount[x] = 0;
    __syncwarp();
    if (lane == 0) {
      fenceAcqRelGpu();
      storeRelaxed(&g.counters->countsCleared[set], e.send);
    }
  };
  for (int item = warp; item < messageItems; item += warps) {
    const int t = quotientOf(g.parts, item), p = item - t * parts;
    if (item != warp) loadPart(g, in, item, lane, part);
    const int first = p * kLlPartValues;
    const int partValues = min(kLlPartValues, g.hidden - first);
    const int id = validExpert(g, part.id, lane);
    const uint64_t ranks = ranksOf(g, id);
    stampOnce(g, kIdsIn, [&] { return traceNowAfter(g, static_cast<uint32_t>(ranks)); });
    if (ranks == 0) continue;
    if (!haveEpochs(g, epochs)) return;
    const int dataLines = llDataLines(in.fp8);
    const size_t headerAt = static_cast<size_t>(parts) * dataLines * kLineBytes;
    // Part 0 sends the header lines first, before its values are cast, so that the receiver hands
    // out the token's rows while the values are on their way.
    if (p == 0) storeHeaderLines(g, t, ranks, headerAt, id, part.weight, e.send, lane);
    stampOnce(g, kValuesIn, [&] { return traceNowAfter(g, part.raw[0].x + part.raw[kVectorsPerLane - 1].w); });
    uint2 quantized[kVectorsPerLane];
    float scale[kVectorsPerLane];
    if (in.fp8) {
      // Stage by stage over the part's vectors, so that their chains overlap: the amaxes (a scale
      // block is 128 values: 16 lanes), their shuffles, the scales, the casts.
      float amax[kVectorsPerLane];
#pragma unroll
      for (int i = 0; i < kVectorsPerLane; ++i) {
        float v[8];
        bf16x8ToFloat(part.raw[i], v);
        amax[i] = fmaxf(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))),
                        fmaxf(fmaxf(fabsf(v[4]), fabsf(v[5])), fmaxf(fabsf(v[6]), fabsf(v[7]))));
      }
#pragma unroll
      for (int offset = 8; offset > 0; offset /= 2) {
#pragma unroll
        for (int i = 0; i < kVectorsPerLane; ++i) amax[i] = fmaxf(amax[i], __shfl_xor_sync(0xffffffff, amax[i], offset));
      }
      Fp8Scale block[kVectorsPerLane];
      bool fast = true;
#pragma unroll
      for (int i = 0; i < kVectorsPerLane; ++i) {
        block[i] = fp8ScaleFast(amax[i], in.ue8m0);
        fast = fast && fp8ScaleFastApplies(amax[i]);
      }
      if (!fast) {
#pragma unroll
        for (int i = 0; i < kVectorsPerLane; ++i) block[i] = fp8ScaleExact(amax[i], in.ue8m0);
      }
#pragma unroll
      for (int i = 0; i < kVectorsPerLane; ++i) {
        float v[8];
        bf16x8ToFloat(part.raw[i], v);
        scale[i] = block[i].scale;
        quantized[i] = toFp8x8(v, block[i].inverse);
      }
    }
    stampOnce(g, kLoaded, [&] { return traceNowAfter(g, in.fp8 ? quantized[0].x : part.raw[0].x + part.raw[0].w); });
    // The part's stream in the warp's staging buffer (ll_kernels.h): values and zeros up to a
    // whole part's; FP8's scales apart (lanes 0 and 16 of vector i hold blocks 2i and
    // 2i + 1; blocks past the part get 0), each put into its line's flag piece.
    __syncwarp();  // the previous item's stream has been staged into lines
    const int dataBytes = partValues * (in.fp8 ? 1 : 2);
    float* stagedScales = reinterpret_cast<float*>(staging + kStagedScalesAt);
#pragma unroll
    for (int i = 0; i < kVectorsPerLane; ++i) {
      const int value = i * 256 + lane * 8;
      if (value < partValues) {
        if (in.fp8) {
          *reinterpret_cast<uint2*>(staging + value) = quantized[i];
        } else {
          *reinterpret_cast<int4*>(staging + value * 2) = part.raw[i];
        }
      }
      if (in.fp8 && lane % 16 == 0) stagedScales[value / kScaleBlock] = value < partValues ? scale[i] : 0.0f;
    }
    // The last part of a row whose hidden is not a whole number of parts.
    for (int w = dataBytes / 4 + lane; w < llPartBytes(in.fp8) / 4; w += kWarp) reinterpret_cast<int*>(staging)[w] = 0;
    __syncwarp();
    LineRun<kPartSendGroups> run;
    run.stage(staging, llPartBytes(in.fp8), e.send, lane);
    if (in.fp8) run.setSpare([&](int line) { return line < kPartScales ? static_cast<uint64_t>(__float_as_uint(stagedScales[line])) : 0; }, lane);
    // Each line carries its flag: no fence, no tag.
    const size_t dataAt = static_cast<size_t>(p) * dataLines * kLineBytes;
    for (uint64_t m = ranks; m != 0; m &= m - 1) {
      const int d = __ffsll(static_cast<long long>(m)) - 1;
      run.storeLines(messageAt(g, d, e.send, g.rank, t) + dataAt, 0, dataLines, lane);
    }
    stampAgain(g, kPublished, [&] { return traceNowIssued(g); });
  }

  // What each rank should expect: one tagged bitmap word per 32 tokens (all of maxTokens, so
  // that a receiver need not know how many tokens this rank has), in the send's generation; and
  // where each token went, for the combine (tokenRanks).
  const int preloadedWord = warp >= messageItems ? warp - messageItems : -1;
  for (int c = firstBitWord(messageItems, warp, warps); c < g.layout.bitWords; c += warps) {
    const int t = c * kWarp + lane;
    const uint64_t mask = c == preloadedWord ? bitmapMask : tokenRankMask(g, in, t);
    stampOnce(g, kMaskIn, [&] { return traceNowAfter(g, __reduce_or_sync(0xffffffff, static_cast<unsigned>(mask))); });
    if (t < g.maxTokens) local.tokenRanks[t] = mask;
    if (!haveEpochs(g, epochs)) return;
    for (int d = 0; d < g.nRanks; ++d) {
      const unsigned bits = __ballot_sync(0xffffffff, (mask >> d) & 1ULL);
      if (lane == d % kWarp) storeRelaxed(bitWordAt(g, d, e.send, g.rank, c), countWord(e.send, static_cast<int>(bits)));
    }
    stampOnce(g, kWordStored, [&] { return traceNowIssued(g); });
  }
  clearCounts();
}

// Line groups (4 lines, a 16-byte piece of one line per lane) of a message's values a receiving
// warp holds at once: an FP8 row of hidden 7168, half a BF16 one. As the parts' value lines come
// first in the run, group q's pieces lie at one offset (512 q) from the lane's piece of group 0 and
// land at one offset (448 q) from the lane's vector in the row, as main's unflagged message did.
constexpr int kReceiveGroupsPerLane = 16;
static_assert(kLlPartValues % (kLinesPerGroup * kLinePayloadBytes) == 0, "an FP8 part's values fill whole line groups");
static_assert(llDataLines(true) == 8, "an FP8 part's line b carries its scale b: b = line % 8");
static_assert(llHeaderLines(kMaxTopk) <= kLinesPerGroup, "the header is one line group");
// A chunk's FP8 lines and their scale slots (one a line, the eighth of each part unused).
constexpr int kChunkScales = kReceiveGroupsPerLane * kLinesPerGroup;
static_assert(kChunkScales % kWarp == 0 && kChunkScales * 4 <= kPartStreamBytes, "a chunk's scales stage in the warp's buffer");

// The warps that read one message together, each storing its share of the message's rows, each in
// another block: one warp storing a message's ~4 rows of 7 KB took ~0.3 us a row on the 1-token
// path (docs/benchmarks/ep-ll.md, twenty-second session), and a team within one SM gained half
// of what one spread over SMs did. As many as the warps that the kernel's send items
// (`sendWarps`) leave idle allow over the slots, up to kLlReceiveTeamMax (kWarps is a multiple of
// each size): members also poll, and polling warps beside sending ones slowed a 128-token
// dispatch by 0.6 us. Gives log2 of the size: a receiving warp whose send item came first (every
// warp, at 128 tokens) goes through the team's arithmetic with its data already there, so that
// arithmetic is shifts, not divisions by a runtime size.
static_assert(kWarps % kLlReceiveTeamMax == 0 && kLlReceiveTeamMax == 4, "a block's warps make whole teams");
__device__ __forceinline__ int receiveTeamShift(int slots, int sendWarps) {
  const int spare = static_cast<int>(gridDim.x) * kWarps - sendWarps;
  return spare >= 4 * slots ? 2 : spare >= 2 * slots ? 1 : 0;
}

// The receive phase: a team of warps per message slot (source rank, token; receiveTeamShift), the
// slots in token order and dealt over the blocks first, so that a few messages still spread over
// many SMs. A team polls its slot's bitmap word and header lines together (awaitSlot); once the
// header lines are flagged (they are sent first) each member hands out its share of the message's
// rows (the set's recvCount of each local expert it names, once this rank's send phase has cleared
// them; a member with none stops there), polls the message's first kReceiveGroupsPerLane groups of
// value lines while its row atomics are in flight, and notes the rows for combine; once every line
// carries the call's epoch, the values and scales are in the warp's registers, and it stores the
// lines into each of its rows. A row of more groups (BF16 above hidden 3584, FP8 above 7168) polls
// and stores its further chunks the same way.
__device__ void dispatchReceive(const LlView& g, const LlDispatchInput& in, int set, uint64_t epoch, float* scaleStage,
                                int sendWarps) {
  const int lane = threadIdx.x % kWarp;
  const int slots = g.nRanks * g.maxTokens;
  const int teamShift = receiveTeamShift(slots, sendWarps);
  const int team = 1 << teamShift;
  const int fromTop = kWarps - 1 - static_cast<int>(threadIdx.x / kWarp);
  const int member = fromTop & (team - 1);
  const LlSetLocal& local = g.sets[set];
  const int valueBytes = in.fp8 ? 1 : 2;
  const size_t rowBytes = static_cast<size_t>(g.hidden) * valueBytes;
  const int vectors = static_cast<int>(rowBytes / 16);
  const int scalesPerRow = g.hidden / kScaleBlock;
  const int firstExpert = g.rank * g.numLocalExperts;
  // Lane l moves piece l % 8 of line l / 8 of each group: row vector 28 q + laneVector of value
  // group q, unless it is the flag's piece, which holds the line's FP8 scale.
  constexpr int kPieces = kLinePayloadBytes / 16;  // row vectors a line
  constexpr int kGroupVectors = kLinesPerGroup * kPieces;
  constexpr int kGroupPieces = kLinesPerGroup * kLineBytes / 16;
  const int groups = llParts(g.hidden) * llDataLines(in.fp8) / kLinesPerGroup;
  const int headerLines = llHeaderLines(g.topk);
  const int laneLine = lane / 8;
  const int laneVector = laneLine * kPieces + lane % 8;
  const bool flagLane = lane % 8 == kFlagPiece;
  auto flagOf = [](const int4& piece) {
    return static_cast<uint64_t>(static_cast<unsigned>(piece.w)) << 32 | static_cast<unsigned>(piece.z);
  };
  int4 v[kReceiveGroupsPerLane];
  int4 header;
  // Loads groups q0 .. q0 + kReceiveGroupsPerLane - 1 until every line carries the epoch: false in
  // every lane on timeout or after another wait of the group timed out.
  auto poll = [&](const int4* lanePiece, int q0) {
    WarpDeadline deadline;
    for (unsigned polls = 0;; ++polls) {
#pragma unroll
      for (int i = 0; i < kReceiveGroupsPerLane; ++i) loadPieceIf(q0 + i < groups, lanePiece + (q0 + i) * kGroupPieces, v[i]);
      bool values = true;
      if (flagLane) {
#pragma unroll
        for (int i = 0; i < kReceiveGroupsPerLane; ++i) values = values && (q0 + i >= groups || flagOf(v[i]) == epoch);
      }
      if (__all_sync(0xffffffff, values)) return true;
      if (deadline.expired(bounds(g), kErrorTimeout, polls, lane)) return false;
    }
  };
  // What a slot holds this call, from one poll loop over its bitmap word, its header lines (part 0
  // sends them before any values) and, until seen, the counts cleared by this rank's send phase
  // (the acquire last: it orders only the row atomics that follow): no message (the word says so),
  // a message (its header lines carry the epoch and the counts are cleared, whatever the word), or
  // a failed wait. When the header was polled only once the word had been seen, a 1-token message
  // took one more round trip to its first rows (docs/benchmarks/ep-ll.md, twenty-fifth session).
  enum SlotState { kNoMessage, kMessage, kWaitFailed };
  bool countsCleared = false;
  const bool headerLane = laneLine < headerLines;
  auto awaitSlot = [&](const uint64_t* bitsWord, const int4* headerPiece, int t) {
    WarpDeadline deadline;
    PollPause pause;
    for (unsigned polls = 0;; ++polls) {
      const uint64_t word = loadRelaxed(bitsWord);
      loadPieceIf(headerLane, headerPiece, header);
      if (!countsCleared) countsCleared = loadAcquireGpu(&g.counters->countsCleared[set]) == epoch;
      const bool noMessage = countWordIsFrom(word, epoch) && ((static_cast<unsigned>(countOf(word)) >> (t % kWarp)) & 1u) == 0;
      if (__all_sync(0xffffffff, noMessage)) return kNoMessage;
      const bool flagged = !(headerLane && flagLane) || flagOf(header) == epoch;
      if (__all_sync(0xffffffff, flagged && countsCleared)) return kMessage;
      if (deadline.expired(bounds(g), kErrorTimeout, polls, lane)) return kWaitFailed;
      pause.sleep();
    }
  };
  // Team (k, b) (slot n = k gridDim + b, in token order) is warp k team + j of block b + j gridDim / team.
  const int blocks = static_cast<int>(gridDim.x);
  int home = static_cast<int>(blockIdx.x) - member * (blocks >> teamShift);
  if (home < 0) home += blocks;
  const int stride = blocks * (kWarps >> teamShift);
  for (int n = (fromTop >> teamShift) * blocks + home; n < slots; n += stride) {
    const int t = quotientOf(g.ranks, n), s = n - t * g.nRanks;
    const int slot = s * g.maxTokens + t;
    const uint64_t* bitsWord = bitWordAt(g, g.rank, epoch, s, t / kWarp);  // of the send this receive completes
    const int4* lanePiece = reinterpret_cast<const int4*>(messageAt(g, g.rank, epoch, s, t) + laneLine * kLineBytes + lane % 8 * 16);
    const SlotState state = awaitSlot(bitsWord, lanePiece + groups * kGroupPieces, t);
    if (state == kWaitFailed) return;
    int* rowOf = local.rowOf + static_cast<size_t>(slot) * g.topk;
    if (state == kNoMessage) {
      // No message: combine skips the slot.
      if (member == 0 && lane < g.topk) rowOf[lane] = -1;
      continue;
    }
    stampOnce(g, kAwaited, [&] { return traceNow(g); });
    // Lane k < topk: the row of the message's k-th expert if it is ours (-1 otherwise), handed out
    // from the header. The message's local experts are dealt over the team in top-k order: each
    // member hands out and stores its own rows; member 0 also notes the weights and the experts
    // that are not ours. The row atomics' answers are used only after the first chunk's poll, so
    // that their round trip and the poll's overlap.
    const int id = header.x;  // lane k < topk: entry k (ll_kernels.h)
    const float weight = __int_as_float(header.y);
    const bool ours = lane < g.topk && id >= firstExpert && id < firstExpert + g.numLocalExperts;
    const unsigned oursMask = __ballot_sync(0xffffffff, ours);
    const bool mine = ours && (__popc(oursMask & ((1u << lane) - 1)) & (team - 1)) == member;  // team: a power of two
    const int e = mine ? id - firstExpert : 0;
    const int claimed = mine ? atomicAdd(local.recvCount + e, 1) : 0;
    const unsigned targets = __ballot_sync(0xffffffff, mine);
    if (member == 0 && lane < g.topk) local.weightOf[static_cast<size_t>(slot) * g.topk + lane] = weight;
    if (targets != 0 && !poll(lanePiece, 0)) return;
    const int row = mine ? e * g.expertStride + claimed : -1;
    if (mine) {
      local.recvSource[static_cast<size_t>(row) * 2] = s;
      local.recvSource[static_cast<size_t>(row) * 2 + 1] = t;
    }
    if (mine || (member == 0 && lane < g.topk && !ours)) rowOf[lane] = row;
    stampOnce(g, kRowsKnown, [&] { return traceNowAfter(g, __reduce_or_sync(0xffffffff, static_cast<unsigned>(row))); });
    if (targets != 0) stampOnce(g, kArrived, [&] { return traceNow(g); });
    for (int q0 = 0; targets != 0 && q0 < groups; q0 += kReceiveGroupsPerLane) {
      if (q0 != 0 && !poll(lanePiece, q0)) return;
      // The chunk's FP8 scales, from the flag pieces of its lines (line l of the chunk: scale
      // l % 8 of its part l / 8) through shared memory to lanes in scale order, so that each row
      // takes them in whole stores.
      float scale[kChunkScales / kWarp];
      const int firstScale = q0 * kLinesPerGroup / 8 * kPartScales;
      if (in.fp8) {
        __syncwarp();  // the previous chunk's scales read
        if (flagLane) {
#pragma unroll
          for (int i = 0; i < kReceiveGroupsPerLane; ++i) scaleStage[i * kLinesPerGroup + laneLine] = __int_as_float(v[i].x);
        }
        __syncwarp();
#pragma unroll
        for (int r = 0; r < kChunkScales / kWarp; ++r) {
          const int j = r * kWarp + lane;
          scale[r] = j < kChunkScales - kChunkScales / 8 ? scaleStage[j / kPartScales * 8 + j % kPartScales] : 0.0f;
        }
      }
      // A chunk that lies whole inside the row (each one of hidden 7168, FP8 or BF16) stores its
      // groups under the flag-lane test alone: the per-group bounds, kept as predicates across the
      // loop over the rows, cost more instructions than the stores (2026-12-01).
      const bool wholeChunk = (q0 + kReceiveGroupsPerLane) * kGroupVectors <= vectors;
      for (unsigned m = targets; m != 0; m &= m - 1) {
        const size_t to = static_cast<size_t>(__shfl_sync(0xffffffff, row, __ffs(m) - 1));
        int4* out = reinterpret_cast<int4*>(local.recvX + to * rowBytes) + laneVector;
        if (wholeChunk) {
          if (!flagLane) {
#pragma unroll
            for (int i = 0; i < kReceiveGroupsPerLane; ++i) out[(q0 + i) * kGroupVectors] = v[i];
          }
        } else {
#pragma unroll
          for (int i = 0; i < kReceiveGroupsPerLane; ++i) {
            const int q = q0 + i;
            if (!flagLane && q * kGroupVectors + laneVector < vectors) out[q * kGroupVectors] = v[i];
          }
        }
        if (in.fp8) {
          float* scalesOut = local.recvScales + to * scalesPerRow + firstScale;
#pragma unroll
          for (int r = 0; r < kChunkScales / kWarp; ++r) {
            const int j = r * kWarp + lane;
            if (j < kChunkScales - kChunkScales / 8 && firstScale + j < scalesPerRow) scalesOut[j] = scale[r];
          }
        }
      }
    }
    stampAgain(g, kReceived, [&] { return traceNowIssued(g); });
  }
}

// One dispatch kernel runs the send phase, the receive phase or both. Each warp loads its first
// inputs while its block's last warp loads the call's epochs (BlockStart), in one round trip; each
// block records the call's epochs for the next call (recordEpochs), without a barrier between the
// phases (the per-expert counts are complete when every block is done).
__global__ void __launch_bounds__(kThreads, 1) llDispatchKernel(int set, bool send, bool receive,
                                                                const __grid_constant__ LlDispatchInput in,
                                                                const __grid_constant__ LlView g) {
  __shared__ BlockStart blockStart;
  initBlockStart(blockStart);
  __shared__ int parameterSink[kWarps];
  touchParameterLines(g, in.numTokens, in.ue8m0, parameterSink);
  waitForPrerequisiteGrid();
  allowDependentLaunch();
  const int lane = threadIdx.x % kWarp;
  const int warp = sendWarpIndex();
  const int warps = gridDim.x * kWarps;
  LlOpCounters* counters = &g.counters->dispatch;
  traceKernelStart(g);
  clearStamps(g);
  // Per warp: the part stream it sends, then the scales of the rows it receives.
  __shared__ alignas(16) char partStreams[kWarps][kPartStreamBytes];
  const uint64_t startWord = threadIdx.x >= kFirstStartThread ? loadStartWord(g, counters, threadIdx.x - kFirstStartThread) : 0;
  uint64_t bitmapMask = 0;
  PartInput part;
  const int messageItems = dispatchMessageItems(g, in);
  if (send) {
    if (warp < messageItems) {
      // The inputs first, as for a later item (dispatchSend).
      loadPart(g, in, warp, lane, part);
    } else if (warp - messageItems < g.layout.bitWords) {
      bitmapMask = tokenRankMask(g, in, (warp - messageItems) * kWarp + lane);
    }
  }
  publishStartWord(blockStart, startWord);
  CallEpochs epochs{&blockStart, {}, false};
  if (send) {
    dispatchSend(g, in, set, epochs, warp, warps, bitmapMask, part, partStreams[threadIdx.x / kWarp]);
    if (warp < messageItems + g.layout.bitWords) stampAgain(g, kSent, [&] { return traceNow(g); });
  }
  if (!haveEpochs(g, epochs)) return;
  recordEpochs(g, counters, send, receive, epochs.e);
  if (receive) {
    dispatchReceive(g, in, set, epochs.e.receive, reinterpret_cast<float*>(partStreams[threadIdx.x / kWarp]),
                    send ? messageItems + g.layout.bitWords : 0);
  }
  stampAgain(g, kExited, [&] { return traceNowAfter(g, static_cast<uint32_t>(bitmapMask)); });
  if (g.trace != nullptr) traceWarp(g, 0, !send, kLlStamps, send ? epochs.e.send : epochs.e.receive);
}

// ---- combine ----------------------------------------------------------------------------------

// One warp's FP32 sum of a part of this GPU's BF16 expert rows, added one row at a time in the
// caller's order (every row of a batch is loaded before any is added), held as the partial's lines
// will carry it: lane l sums the 16-byte vector that it stores as its piece of group i's line
// (flagged_lines.cuh: payload byte 112 L + 16 (l % 8) of line L = 4 i + l / 8; flag lanes none),
// so that the sum goes into its lines from registers, not through shared memory.
static_assert(kPartGroups * (kWarp - kWarp / 8) * 8 >= kLlCombinePartValues, "a partial's part fits its lanes' pieces");
struct PartSum {
  float acc[kPartGroups][8];
  int partVectors;  // 16-byte vectors in this part (the last part of a row may be short)
  int lane;

  __device__ PartSum(int vectors, int laneIndex) : partVectors(vectors), lane(laneIndex) {
#pragma unroll
    for (int i = 0; i < kPartGroups; ++i) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
    }
  }

  // The part's vector that lane `lane` holds for group i, or -1.
  __device__ int vectorOf(int i) const {
    const int v = pieceOffset(i, lane) / 16;
    return lane % 8 != kFlagPiece && v < partVectors ? v : -1;
  }

  // acc = fma(weight[r], row r, acc) when weighted, acc + row r otherwise, for the first `count`
  // of `rows` in order, all their loads in flight together.
  __device__ void add(const int4* const (&rows)[kCombineRowsInFlight], const float (&weights)[kCombineRowsInFlight],
                      int count, bool weighted) {
    int4 loaded[kCombineRowsInFlight][kPartGroups];
#pragma unroll
    for (int r = 0; r < kCombineRowsInFlight; ++r) {
#pragma unroll
      for (int i = 0; i < kPartGroups; ++i) {
        const int v = vectorOf(i);
        loaded[r][i] = r < count && v >= 0 ? __ldg(rows[r] + v) : int4{0, 0, 0, 0};
      }
    }
#pragma unroll
    for (int r = 0; r < kCombineRowsInFlight; ++r) {
      if (r >= count) break;
#pragma unroll
      for (int i = 0; i < kPartGroups; ++i) {
        float f[8];
        bf16x8ToFloat(loaded[r][i], f);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = weighted ? __fmaf_rn(weights[r], f[j], acc[i][j]) : __fadd_rn(acc[i][j], f[j]);
      }
    }
  }

  // The sum as BF16 into the partial's lines, `flag` in each flag lane's upper half (pieces past
  // the part zero).
  __device__ void toLines(LineRun<kPartGroups>& run, uint64_t flag) const {
#pragma unroll
    for (int i = 0; i < kPartGroups; ++i) {
      const int4 packed = vectorOf(i) >= 0 ? floatToBf16x8(acc[i]) : int4{0, 0, 0, 0};
      run.lo[i] = static_cast<uint64_t>(static_cast<unsigned>(packed.y)) << 32 | static_cast<unsigned>(packed.x);
      run.hi[i] = lane % 8 == kFlagPiece ? flag : static_cast<uint64_t>(static_cast<unsigned>(packed.w)) << 32 | static_cast<unsigned>(packed.z);
    }
  }
};

// Lane k < topk: the row and weight of slot `slot`'s k-th expert (row -1: not ours, or no message).
__device__ __forceinline__ void loadRowOf(const LlView& g, const LlCombineInput& in, int set, int slot, int lane, int& row,
                                          float& weight) {
  row = -1;
  weight = 0.0f;
  if (lane < g.topk) {
    row = __ldcg(g.sets[set].rowOf + static_cast<size_t>(slot) * g.topk + lane);
    weight = in.weighted ? __ldcg(g.sets[set].weightOf + static_cast<size_t>(slot) * g.topk + lane) : 1.0f;
  }
}

// Combine send item `item`: part p of the partial for slot (source rank s, token t), `slot` its index
// in the dispatch's per-slot arrays. Token-major: the items of every source's first tokens, the
// only ones a call with fewer than maxTokens fills, come first, so that while they fit in the
// grid's warps each warp has at most one (source-major, with two ranks, the second source's
// tokens past the first few fell to warps that had one of the first source's already).
struct CombineItem {
  int slot, s, t, p;
};
__device__ __forceinline__ CombineItem combineItemOf(const LlView& g, int item) {
  const int pair = quotientOf(g.combineParts, item);  // t * nRanks + s
  const int t = quotientOf(g.ranks, pair), s = pair - t * g.nRanks;
  return {s * g.maxTokens + t, s, t, item - pair * llCombineParts(g.hidden)};
}

// The send phase of warp `warp` of `warps`: items (combineItemOf) in order. The first item's
// `firstRow` / `firstWeight` (loadRowOf) were loaded with the epochs.
// A partial's slot needs no release word: its receiver has read what this rank last wrote there
// before this call can run. That was the combine of the dispatch before last, which used the same
// set: the receiver had issued its receive phase before its dispatch send that reused the set (the
// host refuses that send otherwise), so in its stream the receive completed before that send's
// kernel stored its bitmap words; this rank's receive of the same dispatch waited for those words,
// and this call's send comes after that receive (a handle's combine needs its dispatch received).
// Checking across NVLink cost the 1-token combine 0.5 us and the 0-token one 1.0 (two GPUs,
// docs/benchmarks/ep-ll.md, twenty-ninth session).
__device__ void combineSend(const LlView& g, const LlCombineInput& in, int set, CallEpochs& epochs, int warp, int warps,
                            int firstRow, float firstWeight) {
  const int lane = threadIdx.x % kWarp;
  const LlEpochs& e = epochs.e;  // valid once haveEpochs: waited for after the rows are summed
  const int parts = llCombineParts(g.hidden);
  const int vectors = g.hidden / 8;
  const int items = g.nRanks * g.maxTokens * parts;
  for (int item = warp; item < items; item += warps) {
    const auto [slot, s, t, p] = combineItemOf(g, item);
    int row = firstRow;
    float weight = firstWeight;
    if (item != warp) loadRowOf(g, in, set, slot, lane, row, weight);
    const unsigned rows = __ballot_sync(0xffffffff, row >= 0);
    if (rows == 0) continue;
    const int firstVector = p * kLlCombinePartValues / 8;
    PartSum sum(min(kLlCombinePartValues, g.hidden - p * kLlCombinePartValues) / 8, lane);
    // Top-k slot order: the sum's order is fixed. kCombineRowsInFlight rows' loads at a time; each
    // lane computes its own row's address once, and a batch takes the addresses by shuffle.
    const int4* rowPart = static_cast<const int4*>(in.expertOutput) + firstVector + static_cast<size_t>(max(row, 0)) * vectors;
    for (unsigned m = rows; m != 0;) {
      const int4* batch[kCombineRowsInFlight];
      float weights[kCombineRowsInFlight];
      int count = 0;
#pragma unroll
      for (int r = 0; r < kCombineRowsInFlight; ++r) {
        batch[r] = nullptr;
        weights[r] = 0.0f;
        if (m == 0) continue;
        const int k = __ffs(m) - 1;
        m &= m - 1;
        batch[r] = reinterpret_cast<const int4*>(__shfl_sync(0xffffffff, reinterpret_cast<unsigned long long>(rowPart), k));
        weights[r] = __shfl_sync(0xffffffff, weight, k);
        count = r + 1;
      }
      sum.add(batch, weights, count, in.weighted);
    }
    stampOnce(g, kLoaded, [&] { return traceNowAfter(g, __float_as_uint(sum.acc[0][0])); });
    const int lines = linesFor(llCombinePartValues(g.hidden, p) * 2);
    if (!haveEpochs(g, epochs)) return;
    LineRun<kPartGroups> run;
    sum.toLines(run, e.send);
    run.store(partialAt(g, s, set, g.rank, t) + static_cast<size_t>(p) * kLlCombinePartLines * kLineBytes, lines, lane);
    stampOnce(g, kPublished, [&] { return traceNow(g); });
  }
}

// The receive phase of warp `warp` of `warps`: items (token, part); `firstRanks` is the first
// item's token's ranks, loaded with the epochs. The partials of two ranks are polled at once.
__device__ void combineReceive(const LlView& g, const LlCombineInput& in, int set, uint64_t epoch, int warp, int warps,
                               uint64_t firstRanks) {
  const int lane = threadIdx.x % kWarp;
  const LlSetLocal& local = g.sets[set];
  const int parts = llCombineParts(g.hidden);
  const size_t partOffset = static_cast<size_t>(kLlCombinePartLines) * kLineBytes;
  for (int item = warp; item < in.numTokens * parts; item += warps) {
    const int t = quotientOf(g.combineParts, item);
    const int p = item - t * parts;
    const uint64_t ranks = item == warp ? firstRanks : __ldcg(local.tokenRanks + t);
    const int payloadBytes = llCombinePartValues(g.hidden, p) * 2;
    const int lines = linesFor(payloadBytes);
    float acc[kPartGroups][8];
#pragma unroll
    for (int i = 0; i < kPartGroups; ++i) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
    }
    // Ascending rank order: the sum's order is fixed.
    for (uint64_t m = ranks; m != 0;) {
      const int first = __ffsll(static_cast<long long>(m)) - 1;
      m &= m - 1;
      const int second = m != 0 ? __ffsll(static_cast<long long>(m)) - 1 : -1;
      if (m != 0) m &= m - 1;
      const char* firstRun = partialAt(g, g.rank, set, first, t) + p * partOffset;
      const char* secondRun = second >= 0 ? partialAt(g, g.rank, set, second, t) + p * partOffset : firstRun;
      LineRun<2 * kPartGroups> both;  // groups [0, kPartGroups) of the first rank, then of the second
      const bool ok = both.load(
          [&](int i, int& groupLines) {
            const bool ofSecond = i >= kPartGroups;
            const int group = ofSecond ? i - kPartGroups : i;
            groupLines = ofSecond && second < 0 ? 0 : min(max(lines - group * kLinesPerGroup, 0), kLinesPerGroup);
            return (ofSecond ? secondRun : firstRun) + group * kLinesPerGroup * kLineBytes;
          },
          epoch, lane, bounds(g), kErrorTimeout);
      if (!ok) return;
      stampOnce(g, kArrived, [&] { return traceNow(g); });
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (r == 1 && second < 0) break;
#pragma unroll
        for (int i = 0; i < kPartGroups; ++i) {
          float f[8];
          const uint64_t lo = both.lo[r * kPartGroups + i], hi = both.hi[r * kPartGroups + i];
          bf16x8ToFloat(make_int4(static_cast<int>(lo), static_cast<int>(lo >> 32), static_cast<int>(hi), static_cast<int>(hi >> 32)), f);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[i][j] = __fadd_rn(acc[i][j], f[j]);
        }
      }
    }
    char* out = static_cast<char*>(in.combinedX) + (static_cast<size_t>(t) * g.hidden + static_cast<size_t>(p) * kLlCombinePartValues) * 2;
#pragma unroll
    for (int i = 0; i < kPartGroups; ++i) {
      const int offset = pieceOffset(i, lane);
      if (lane % 8 != kFlagPiece && offset < payloadBytes) *reinterpret_cast<int4*>(out + offset) = floatToBf16x8(acc[i]);
    }
    stampAgain(g, kReceived, [&] { return traceNow(g); });
  }
}

// One combine kernel runs the send phase, the receive phase or both, started as the dispatch
// kernel is.
__global__ void __launch_bounds__(kThreads, 1) llCombineKernel(int set, bool send, bool receive,
                                                               LlCombineInput in,
                                                               const __grid_constant__ LlView g) {
  __shared__ BlockStart blockStart;
  initBlockStart(blockStart);
  __shared__ int parameterSink[kWarps];
  touchParameterLines(g, in.numTokens, in.combinedX != nullptr, parameterSink);
  waitForPrerequisiteGrid();
  allowDependentLaunch();
  const int lane = threadIdx.x % kWarp;
  const int warp = sendWarpIndex(), receiveWarp = receiveWarpIndex();
  const int warps = gridDim.x * kWarps;
  const int parts = llCombineParts(g.hidden);
  LlOpCounters* counters = &g.counters->combine;
  traceKernelStart(g);
  clearStamps(g);
  const uint64_t startWord = threadIdx.x >= kFirstStartThread ? loadStartWord(g, counters, threadIdx.x - kFirstStartThread) : 0;
  uint64_t firstRanks = 0;
  int firstRow = -1;
  float firstWeight = 0.0f;
  if (send && warp < g.nRanks * g.maxTokens * parts) {
    const CombineItem first = combineItemOf(g, warp);
    loadRowOf(g, in, set, first.slot, lane, firstRow, firstWeight);
  }
  if (receive && receiveWarp < in.numTokens * parts) firstRanks = __ldcg(g.sets[set].tokenRanks + quotientOf(g.combineParts, receiveWarp));
  publishStartWord(blockStart, startWord);
  CallEpochs epochs{&blockStart, {}, false};
  if (send) {
    combineSend(g, in, set, epochs, warp, warps, firstRow, firstWeight);
    if (warp < g.nRanks * g.maxTokens * parts) stampAgain(g, kSent, [&] { return traceNow(g); });
  }
  if (!haveEpochs(g, epochs)) return;
  recordEpochs(g, counters, send, receive, epochs.e);
  if (receive) combineReceive(g, in, set, epochs.e.receive, receiveWarp, warps, firstRanks);
  stampAgain(g, kExited, [&] { return traceNowAfter(g, static_cast<uint32_t>(firstRanks)); });
  if (g.trace != nullptr) traceWarp(g, 1, !send, kExited + 1, send ? epochs.e.send : epochs.e.receive);
}

// Both kernels start with the parameter reads alone, then wait for the stream's previous kernel
// (grid_dependency.cuh), so either may be a programmatic dependent launch.
template <typename Input>
cudaError_t launchLl(void (*kernel)(int, bool, bool, Input, LlView), const LlView& view, const Input& input,
                     const LlLaunch& launch) {
  // A block past the counters' words would read an epoch no call wrote (LlOpCounters).
  if (launch.numBlocks < 1 || launch.numBlocks > view.counterBlocks) return cudaErrorInvalidConfiguration;
  return launchMaybeDependent(kernel, dim3(static_cast<unsigned>(launch.numBlocks)), dim3(kThreads), 0, launch.stream,
                              launch.programmatic, launch.set, launch.send, launch.receive, input, view);
}

}  // namespace

cudaError_t launchLlDispatch(const LlView& view, const LlDispatchInput& input, const LlLaunch& launch) {
  return launchLl(llDispatchKernel, view, input, launch);
}

cudaError_t launchLlCombine(const LlView& view, const LlCombineInput& input, const LlLaunch& launch) {
  return launchLl(llCombineKernel, view, input, launch);
}

}  // namespace unifab::kernels::ep
