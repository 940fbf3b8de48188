// Plain data shared by the host side of expert parallelism (collectives/ep) and its kernels:
// where each array lives in the symmetric window, and what a kernel needs to reach peers. The
// window has the same layout on every rank, so one offset names the same array everywhere.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/fast_divisor.h"
#include "kernels/common/host_device.h"

namespace unifab::kernels::ep {

constexpr int kMaxRanks = 64;        // ranks of one EP group (one bit each in a token's rank mask)
constexpr int kMaxTopk = 32;
constexpr int kMaxExperts = 1024;    // global experts
constexpr int kScaleBlock = 128;     // FP8 values per float scale
constexpr int kMaxBlocks = 256;      // blocks of one EP kernel (at most one per SM)

// Per-rank control words in the window. Every word is written by one peer and read by its owner.
// The combine words are epochs (call counts): they only grow and never need resetting. The
// dispatch's rows-in words are row counts that the owner zeroes at the end of each call; its
// start words are tagged with their call's epoch, as the count words are.
struct Control {
  // Rank s started dispatch #epoch (so its receive buffers are free), written at the kernel's entry
  // in the set wordSet(epoch): blockWord(epoch, routing tag if cached else 0, s's block count if
  // uncached else 0), so that a peer's rows wait for no layout of s's unless they are placed after
  // s's rows.
  uint64_t dispatchStart[2][kMaxRanks];
  uint64_t dispatchRowsIn[kMaxRanks];  // rows of the current dispatch that source s's blocks finished writing
                                      // into us (each adds its own after a system fence); 0 between calls
  uint64_t combineDone[kMaxRanks];     // rank s ended combine #epoch (its partial buffers are free)
  uint64_t combineReady[kMaxRanks];    // rank s's combine input holds combine #epoch's rows
  uint64_t combineRead[kMaxRanks];     // rank s finished reading our combine input for combine #epoch
};

// Byte offsets into the window (identical on all ranks) and the sizes they were made for.
struct WindowLayout {
  size_t control;        // Control
  // Two sets of count words, used by alternate dispatches (wordSet): a rank may start its next
  // dispatch, whose layout writes words into every peer, while a peer's blocks still read the
  // words of the current one (the end of a dispatch waits for the peers' rows, not their readers).
  size_t blockWords[2];  // uint64 [nRanks][kMaxBlocks][nRanks]: (s, b, d) = rows that layout block b of rank s
                         // sends to rank d, tagged (blockWord)
  size_t blockExpertWords[2]; // uint64 [nRanks][kMaxBlocks][numLocalExperts]: (s, b, e) = rows that layout block
                              // b of rank s sends to our expert e, tagged (countWord)
  size_t recvX;          // [recvCapacity][rowBytes]: rank-major received payloads
  size_t recvScales;     // float [recvCapacity][hidden / kScaleBlock]
  size_t recvTopk;       // int [recvCapacity][topk]: local expert ids, -1 elsewhere
  size_t recvWeights;    // float [recvCapacity][topk]
  size_t recvSource;     // int [recvCapacity][2]: (source rank, source token)
  size_t combineX;       // bf16 [nRanks][maxTokens][hidden]: partial sums from each rank
  size_t combineWeights; // float [nRanks][maxTokens][topk]
  size_t combineFlags;   // uint64 [nRanks][maxTokens]: combine epoch whose partial from rank s for token t landed
  size_t combineIn;      // bf16 [recvCapacity][hidden]: expert outputs the peers read (unifabEpCombineInputBuffer);
                         // the same region as combineX (a combine uses one or the other on every rank)
  size_t total;
  int recvCapacity;      // nRanks * maxTokensPerRank
  int rowBytes;          // hidden * 2: the largest payload row (BF16)
};


// Rank-major received rows are grouped by source rank, starting at the receiver's next rank:
// at rank d, source d+1 comes first and d itself last (cyclically; unifabEpLayout_t). A sender's
// rows at d wait only for the counts of the sources before it there: with two ranks, none.
UNIFAB_HOST_DEVICE inline int sourcePosition(int source, int receiver, int nRanks) {
  return (source - receiver - 1 + nRanks) % nRanks;
}
// True if source a's rows come before source b's at `receiver`.
UNIFAB_HOST_DEVICE inline bool sourceBefore(int a, int b, int receiver, int nRanks) {
  return sourcePosition(a, receiver, nRanks) < sourcePosition(b, receiver, nRanks);
}

// Owner rank of an expert id is quotientOf(makeFastDivisor(localExperts), id) (the layouts make
// one per top-k entry): exact for every id below kMaxExperts and any split of them.
static_assert(static_cast<uint64_t>(kMaxExperts) * kMaxExperts < (1ULL << 32), "fastDivisorCovers for expert owners");

// A count word carries the low 32 bits of its dispatch's epoch in its high half and the count in
// its low half, so one relaxed 64-bit store is both the data and its arrival flag: the start of a
// dispatch needs no fence. (A word not rewritten for exactly 2^32 calls would pass as current: at
// one dispatch every 22 us that is ~26 hours of back-to-back calls. The dispatch skips epochs
// whose low half is 0 (nextDispatchEpoch), so at least the never-written words cannot pass.)
// The set of count words dispatch `epoch` uses. Consecutive dispatches take different sets: the
// epoch skips only from a low half of 0xffffffff to 2 (nextDispatchEpoch), an odd step.
UNIFAB_HOST_DEVICE inline int wordSet(uint64_t epoch) { return static_cast<int>(epoch & 1); }

// The epoch after `last`: count words carry the epoch's low 32 bits, and a low half of 0 would
// match a word never written (the window starts zeroed), so it is skipped, by 3 to keep wordSet
// alternating.
UNIFAB_HOST_DEVICE inline uint64_t nextDispatchEpoch(uint64_t last) {
  return static_cast<uint32_t>(last + 1) == 0 ? last + 3 : last + 1;
}

UNIFAB_HOST_DEVICE inline uint64_t countWord(uint64_t epoch, int count) {
  return (epoch << 32) | static_cast<uint32_t>(count);
}
UNIFAB_HOST_DEVICE inline bool countWordIsFrom(uint64_t word, uint64_t epoch) {
  return static_cast<uint32_t>(word >> 32) == static_cast<uint32_t>(epoch);
}
UNIFAB_HOST_DEVICE inline int countOf(uint64_t word) { return static_cast<int>(static_cast<uint32_t>(word)); }

// A layout block's word also carries how many blocks its rank's dispatch runs (ranks may run
// different numbers): 9 bits for up to kMaxBlocks, then 23 for the rows (at most 2^20 tokens).
constexpr int kBlockWordRowBits = 23;
UNIFAB_HOST_DEVICE inline uint64_t blockWord(uint64_t epoch, int rows, int blocks) {
  return (epoch << 32) | (static_cast<uint64_t>(blocks) << kBlockWordRowBits) | static_cast<uint32_t>(rows);
}
UNIFAB_HOST_DEVICE inline int blockWordRows(uint64_t word) {
  return static_cast<int>(word & ((1u << kBlockWordRowBits) - 1));
}
UNIFAB_HOST_DEVICE inline int blockWordBlocks(uint64_t word) {
  return static_cast<int>((word >> kBlockWordRowBits) & 0x1ff);
}
static_assert(kMaxBlocks < (1 << (32 - kBlockWordRowBits)), "a block count fits its field");

// Call counters of this rank (device memory). All ranks run the same sequence of calls, so the
// n-th exchange, dispatch and combine carry the same epoch everywhere.
struct Epochs {
  uint64_t dispatch;
  uint64_t combine;
};

// Hand-over between the blocks of one kernel (device memory, this GPU only). The counters return
// to zero within each call; the go word takes the call's epoch, so it never needs resetting.
// After a timeout they may not (blocks that give up never count in), which is harmless while a
// timeout ends the group for good.
struct GridSync {
  unsigned finished;       // blocks done with their share of the payload
  uint64_t combineGo;      // block 0 finished the start handshake of combine #value
  uint64_t traceStart;     // global timer when block 0 started the current call (tracing only)
};

// Phase ends recorded when tracing (GroupView::trace): sums over calls of nanoseconds since the
// call's start (block 0's kernel entry), and the number of recordings of each point; then, per
// call (kTraceCalls slots by epoch), the latest recording of each point: the block that ends a
// phase last decides the call's time, and a mean over blocks and over warm-up calls hides it.
enum TracePoint : int {
  kTraceDispatchEntered = 0,  // each block: the epoch read (block start skew plus one round trip)
  kTraceDispatchIdsLoaded,    // each layout block: its first pass's top-k entries loaded and checked
  kTraceDispatchMasked,       // each layout block: its first pass's tokens' destination masks known (thread 0)
  kTraceDispatchListed,       // each layout block: its token lists written, before the fence and its words
  kTraceDispatchLayout,       // each block: its layout done and its count words sent
  kTraceDispatchStartWordsIn, // each block that waits for start words: the last of them seen
  kTraceDispatchOwnWordsIn,   // each uncached block: the last of its own rank's count words it needs seen
  kTraceDispatchCountsIn,     // each block that waits: the start and count words it needs are in
  kTraceDispatchReceiveCounts,// last block: receive counts and expert regions done (before its rows)
  kTraceDispatchRemoteDone,   // each remote block: its rows written
  kTraceDispatchLocalDone,    // each local block: its rows written
  kTraceDispatchEnd,          // last block: every peer's rows for this rank are in
  kTraceCombineStarted,       // block 0: start handshake complete
  kTraceCombineSent,          // each remote block: its partials sent
  kTraceCombineHelped,        // each remote block: its share of the last tokens reduced
  kTraceCombineReduced,       // each reducing block: its tokens reduced
  kTraceCombineEnd,           // last block to finish
  // Low-latency kernels (each warp writes its own record after its work, so that recording adds
  // no round trip to the phases it measures: kernels/ep/ll_kernels.h, llTraceRecord):
  kTraceLlDispatchStarted,    // each warp: the call's epochs in, where it first needed them (its first inputs were issued before)
  kTraceLlDispatchLoaded,     // each sending warp: its first part's inputs arrived (quantized)
  kTraceLlDispatchLinesStored,  // each sending warp: its last part's lines stored
  kTraceLlDispatchSent,       // each sending warp: its last item (part or bitmap word) done
  kTraceLlDispatchLinesIn,    // each receiving warp: its first message's lines all in
  kTraceLlDispatchReceived,   // each receiving warp: its last message's rows stored (issued)
  kTraceLlDispatchExited,     // each warp: its end, once the loads it issued first are back
  kTraceLlDispatchRouted,     // each receiving warp: its first message's header lines and cleared counts seen
  kTraceLlDispatchIdsIn,      // each sending warp: its first part's top-k entries in and checked
  kTraceLlDispatchValuesIn,   // each sending warp: its first part's values in (before the cast)
  kTraceLlDispatchMaskIn,     // each bitmap warp: its first word's token ranks known
  kTraceLlDispatchWordStored, // each bitmap warp: its first word stored to every rank
  kTraceLlDispatchRowsKnown,  // each receiving warp: its first message's rows known (after its first values poll)
  kTraceLlCombineStarted,
  kTraceLlCombineLoaded,      // each sending warp: its first item's expert rows summed
  kTraceLlCombineStored,      // each sending warp: its first part's lines stored
  kTraceLlCombineSent,        // each sending warp: its last part's lines stored
  kTraceLlCombineLinesIn,     // each receiving warp: its first token's first partials all in
  kTraceLlCombineReceived,
  kTraceLlCombineExited,      // each warp: its end, once the loads it issued first are back
  kTracePoints
};
constexpr int kTraceCalls = 256;
constexpr int kTraceWords = 2 * kTracePoints + 2 * kTraceCalls * kTracePoints;

// Everything a kernel needs to address the group's memory.
struct GroupView {
  int rank;
  int nRanks;
  int numExperts;
  int numLocalExperts;
  int hidden;
  int topk;
  int maxTokensPerRank;
  WindowLayout layout;
  char* peerBase[kMaxRanks];  // window base of every rank as this GPU addresses it (own included)
  Epochs* epochs;
  GridSync* sync;
  int* blockTokens;           // [nRanks][blockTokenStride]: layout block b's tokens for rank d from b * (its
                              // token count) on, in token order (a dispatch's slot j finds its token here)
  int blockTokenStride;       // maxTokensPerRank + maxBlocks
  int maxBlocks;              // the most blocks a kernel of the group runs (the GPU's SM count)
  unsigned long long* trace;  // [kTraceWords] (sums, counts, latest and ~earliest per call) or null: UNIFAB_EP_TRACE
  int* error;                 // device memory: read by every kernel, so it must not cross PCIe
  int* hostError;             // host-mapped mirror, written only when an error is raised
  uint64_t timeoutNs;
  uint64_t testStallNs;       // UNIFAB_EP_TEST_STALL_US (tests only): late dispatch blocks; 0 = none
};

// Error bits of GroupView::error. Bits, not a first-wins code: a bad expert id leaves the group
// usable, and a timeout after it must still stop every later kernel.
enum ErrorCode : int {
  kErrorNone = 0,
  kErrorTimeout = 1 << 0,      // a peer did not signal within the timeout
  kErrorBadExpertId = 1 << 1,  // a top-k id outside -1..numExperts-1 (treated as -1)
  kErrorCallMismatch = 1 << 2, // ranks made different dispatches (cached on some only, or of other
                               // routings); raised with kErrorTimeout, which ends the group
};

// Routing of one dispatch, kept by its handle for combine and cached re-dispatch (device memory).
struct Routing {
  int numTokens;
  uint64_t* tokenRanks;      // [maxTokens]: bit r = token goes to rank r
  int* tokenSlot;            // [maxTokens][nRanks]: index among this rank's tokens for that destination
                             // (valid where the token's rank bit is set)
  int* sendRows;             // [nRanks]: rows this rank sends to each rank
  int* sendTokens;           // [nRanks][maxTokens]: token of each of those rows, in slot order
  int* topkIds;              // [maxTokens][topk]: validated global expert ids (cached re-dispatch needs them)
  float* topkWeights;        // [maxTokens][topk]
  int* sendOffset;           // [nRanks]: first row this rank writes at each destination
  int* recvRowsPerRank;      // [nRanks]
  int* recvRowsPerExpert;    // [numLocalExperts]
  int* expertOffsets;        // [numLocalExperts + 1] (aligned)
  int* numRecvRows;          // [1] rank-major rows
  int* numExpertRows;        // [1] expert-major rows including padding
  int* expertSlot;           // [recvCapacity][topk]: expert-major row of (rank-major row, k), -1
  int expertAlignment;
};

}  // namespace unifab::kernels::ep
