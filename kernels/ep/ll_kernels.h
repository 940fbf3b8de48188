// Low-latency expert-parallel dispatch and combine over NVLink (every rank is an LSA peer).
//
// Dispatch: every token goes once to each rank that hosts one of its experts, as a message in the
// receiver's window at a fixed slot [source rank][token], so no sender waits for counts. A message
// is cut into parts of kLlPartValues values, each written by one warp as flagged lines
// (kernels/common/flagged_lines.cuh: each 128-byte line carries the call's epoch, so the sender
// writes no fence and no tag), so that many warps carry one token at once; part 0 also carries the
// token's top-k ids and weights (sent first). Each sender also writes, per 32 tokens, a tagged
// bitmap of the tokens it sends, which tells the receiver which slots stay empty; the receiver
// polls each slot's bitmap word and header lines together and stops at whichever answers. The receiver
// places each message in the region of every local expert it names (rows handed out in arrival
// order by its recvCount, which the send phase clears) and notes the rows for combine.
//
// Combine: the expert side sums each message's expert outputs (in top-k order, weighted) into one
// BF16 partial per (token, rank) and writes it, a part of kLlCombinePartValues values per warp, into
// the token's rank as flagged lines (kernels/common/flagged_lines.cuh): each 128-byte line carries
// 112 bytes of the partial and the call's epoch, so the sender writes no fence and no tag and the
// receiver sums each part as soon as its lines land. The token's rank sums the partials in rank
// order.
//
// Two buffer sets alternate between dispatches (the host picks the set) for what the caller reads
// (the expert-major rows, the counts) and the combine's partials; epochs count the calls of each
// phase on the device, so a captured graph replays with fresh tags and flags. The peers' memory
// that a send writes is reused without any check, because each writer can prove that the last
// reader is done: the dispatch's messages and bitmap words come in kLlGenerations generations
// by epoch, and a combine partial's slot was last read before the receiver's dispatch send that
// this call's dispatch receive waited for (docs/design.md, "Reuse of a set"). So no warp loads
// or stores a word across NVLink only to say a slot is free.
// The set's outputs on this GPU (recvCount among them) are the caller's until the next dispatch
// into the set, which reuses them in stream order.
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/flagged_lines.h"
#include "kernels/ep/ep_types.h"

namespace unifab::kernels::ep {

constexpr int kLlPartValues = 7 * kScaleBlock;  // values per message part (one warp): whole lines in either dtype
constexpr int kLlSets = 2;
// Generations of the dispatch's messages and bitmap words in every receiver: a send of epoch e
// writes generation e % kLlGenerations. Four, because a send of epoch e runs after this rank's
// receive of e - 2 (at most kLlSets sends await their receive), which saw every rank's send of
// e - 2, which ran after that rank's receive of e - 4: the last reader of generation e % 4 is
// done, so nothing a send writes needs a release word (ll.cu, dispatchSend).
constexpr int kLlGenerations = 4;
constexpr int kLlWarpsPerBlock = 16;  // a phase of a few hundred parts spreads over many SMs
constexpr int kLlReceiveTeamMax = 4;  // warps that read one dispatch message together (ll.cu: receiveTeamShift)

UNIFAB_HOST_DEVICE inline int llParts(int hidden) { return (hidden + kLlPartValues - 1) / kLlPartValues; }
// A dispatch message travels as one run of flagged lines: first every part's values (FP8 or BF16,
// zero-padded to kLlPartValues: llDataLines lines a part, in part order), so that row vector j
// (16 bytes) lies in line j / 7 of the run like a row in a message without flags, then the token's
// top-k entries (llHeaderLines lines): entry k, its id (int32) and weight (float), in the lower 8
// bytes of piece k % 8 of header line k / 8, the piece that lane k of a warp moves. An FP8 part's
// scale of block b (a float per 128 values) rides in the spare lower half of its line b's flag
// piece, so that a receiver holding a line holds its scale. Part p's warp writes its value lines;
// part 0's warp writes the header lines first, before it casts its values, so that the receiver
// hands out the token's rows while the values are on their way.
UNIFAB_HOST_DEVICE constexpr int llDataLines(bool fp8) { return kLlPartValues * (fp8 ? 1 : 2) / kLinePayloadBytes; }
UNIFAB_HOST_DEVICE constexpr int llHeaderLines(int topk) { return (topk + kLinePieces - 1) / kLinePieces; }
UNIFAB_HOST_DEVICE inline int llRunLines(bool fp8, int topk, int hidden) { return llParts(hidden) * llDataLines(fp8) + llHeaderLines(topk); }
// The bytes of a part's values, zero-padded to a whole part (its stream, before the lines).
UNIFAB_HOST_DEVICE constexpr int llPartBytes(bool fp8) { return kLlPartValues * (fp8 ? 1 : 2); }
static_assert(kLlPartValues % kScaleBlock == 0 && kLlPartValues / kScaleBlock <= llDataLines(true), "an FP8 part's scales have a line each");
static_assert(kLlPartValues % kLinePayloadBytes == 0, "a part's FP8 values fill whole lines");

// Values per part of a combine partial (one warp): its BF16 payload fills kLlCombinePartLines lines.
// Half a dispatch part: a combining warp's path per expert row is what a 1-token combine waits
// for, so a part is made small enough for two vectors a lane and four rows' loads in flight.
constexpr int kLlCombinePartValues = 7 * kScaleBlock / 2;
constexpr int kLlCombinePartLines = linesFor(kLlCombinePartValues * 2);
static_assert(kLlCombinePartValues * 2 % kLinePayloadBytes == 0, "a partial's part fills whole lines");
UNIFAB_HOST_DEVICE constexpr int llCombineParts(int hidden) { return (hidden + kLlCombinePartValues - 1) / kLlCombinePartValues; }
// Values of part p of a partial (the last part may be short; hidden is a multiple of kScaleBlock).
UNIFAB_HOST_DEVICE constexpr int llCombinePartValues(int hidden, int p) {
  return hidden - p * kLlCombinePartValues < kLlCombinePartValues ? hidden - p * kLlCombinePartValues : kLlCombinePartValues;
}

// Byte offsets into the window (identical on every rank); set b's partials start at
// setBase + b * setBytes + partials.
struct LlLayout {
  size_t tokenBits;     // uint64 [kLlGenerations][nRanks][bitWords]: tagged bitmaps of the tokens
                        //   rank s sends us, generation e % kLlGenerations for the send of epoch e
  size_t messages;      // [kLlGenerations][nRanks][maxTokens][messageBytes]: slot of (source rank,
                        //   token) for the send of epoch e in generation e % kLlGenerations, a run
                        //   of llRunLines flagged lines
  size_t messageGenerationBytes;  // nRanks * maxTokens * messageBytes
  size_t setBase;
  size_t setBytes;
  size_t partials;      // relative to set b's start (setBase + b * setBytes): [nRanks][maxTokens]
                        //   [partialBytes], the lines of rank d's combine partial for our token t
  size_t total;
  int bitWords;         // ceil(maxTokens / 32)
  int messageBytes;     // sized for the larger of the two dtypes' runs
  int partialBytes;     // llCombineParts(hidden) runs of kLlCombinePartLines lines
};

// Per-set arrays in ordinary device memory (this GPU only).
struct LlSetLocal {
  char* recvX;          // [numLocalExperts][expertStride][hidden * bytes per value]
  float* recvScales;    // [numLocalExperts][expertStride][hidden / kScaleBlock]
  int* recvSource;      // [numLocalExperts][expertStride][2]
  int* recvCount;       // [numLocalExperts]: also the counter that hands out rows, cleared by the
                        //   send phase of each dispatch into the set (LlCounters::countsCleared)
  int* rowOf;           // [nRanks][maxTokens][topk]: row (e * expertStride + i) of message (s, t)'s
                        //   k-th expert, -1 where that expert is not ours or there is no message
  float* weightOf;      // [nRanks][maxTokens][topk]
  uint64_t* tokenRanks; // [maxTokens]: ranks each of this rank's tokens went to
};

// Device-side call counters of one operation: the epoch of the last call of each phase, one word
// per block. Block b of a call reads word b and writes
// the call's epochs into words b, b + gridDim, ... below LlView::counterBlocks, so that every word
// a later grid reads holds the same epoch whatever the grids' sizes, and no block waits for the
// others: no fence, no atomic, nothing at the kernel's end (the next call reads them after this
// grid is done, in stream order or past griddepcontrol.wait).
struct LlOpCounters {
  uint64_t send[kMaxBlocks], receive[kMaxBlocks];
};

struct LlCounters {
  LlOpCounters dispatch, combine;
  uint64_t countsCleared[kLlSets];  // epoch of the dispatch whose send phase cleared the set's recvCount
  uint64_t traceStart;   // global timer when block 0 started the running kernel (tracing only)
};

// A kernel parameter. What every warp reads first comes first and the peers' bases last, so that a
// call's first reads of its parameters touch as few constant-cache lines as they can
// (kernels/ep/ll.cu: touchParameterLines).
struct LlView {
  LlCounters* counters;
  int* error;
  uint32_t* trace;      // llTraceWords(counterBlocks) words or null: UNIFAB_EP_TRACE (LlTraceRecord)
  int rank, nRanks, numExperts, numLocalExperts, hidden, topk, maxTokens;
  int expertStride;     // nRanks * maxTokens rows per local expert
  int counterBlocks;    // LlOpCounters words each call advances: no grid of the group has more blocks
  // The kernels' divisors (kernels/common/fast_divisor.h): experts a rank, ranks, parts of a
  // message (llParts) and of a partial (llCombineParts).
  FastDivisor localExperts, ranks, parts, combineParts;
  LlLayout layout;
  int* hostError;
  uint64_t timeoutNs;
  LlSetLocal sets[kLlSets];
  char* peerBase[kMaxRanks];
};

// UNIFAB_EP_TRACE: each warp of a kernel writes one record of kLlTraceRecordWords words with plain
// stores (no atomics: 2,000 warps recording into a few shared counters slowed the traced call by
// microseconds), at [kind (llTraceKind)][epoch % kLlTraceCalls][block * kLlWarpsPerBlock + warp]:
// word 0 the call's epoch (low 32 bits; a record whose epoch is not its slot's newest is an older
// call's), word 1 + i its i-th stamp in nanoseconds after block 0's start, 0 if the warp did not
// reach it (the host sums them up: collectives/ep/ll_trace.cc).
constexpr int kLlTraceCalls = 64;
constexpr int kLlTraceRecordWords = 16;
constexpr int kLlTraceKinds = 4;
// A send-only kernel and the receive-only kernel that completes it share their epoch, so each kind
// of kernel has records of its own: the dispatch's (operation 0) or the combine's (1), with a send
// phase or receive-only.
UNIFAB_HOST_DEVICE inline int llTraceKind(int operation, bool receiveOnly) { return 2 * operation + (receiveOnly ? 1 : 0); }
UNIFAB_HOST_DEVICE inline size_t llTraceRecord(int kind, uint64_t epoch, int warp, int maxBlocks) {
  return ((static_cast<size_t>(kind) * kLlTraceCalls + epoch % kLlTraceCalls) * maxBlocks * kLlWarpsPerBlock + warp) *
         kLlTraceRecordWords;
}
UNIFAB_HOST_DEVICE inline size_t llTraceWords(int maxBlocks) { return llTraceRecord(kLlTraceKinds, 0, 0, maxBlocks); }

struct LlDispatchInput {
  int numTokens;
  const void* x;             // [numTokens][hidden] BF16
  const void* topkIdx;
  bool topkIdxIs32;
  const float* topkWeights;  // or null: 1
  bool fp8;
  bool ue8m0;
};

struct LlCombineInput {
  int numTokens;             // of the dispatch (this rank's tokens)
  const void* expertOutput;  // BF16 [numLocalExperts][expertStride][hidden]
  bool weighted;
  void* combinedX;           // [numTokens][hidden] BF16
};

struct LlLaunch {
  int set;            // the buffer set of the dispatch (and of its combine)
  bool send, receive;  // the phases this kernel runs
  int numBlocks;
  bool programmatic;  // a programmatic dependent launch (kernels/common/grid_dependency.cuh)
  cudaStream_t stream;
};

// One kernel: the send phase and/or the receive phase of a dispatch into set `launch.set`.
cudaError_t launchLlDispatch(const LlView& view, const LlDispatchInput& input, const LlLaunch& launch);
// One kernel: the send phase and/or the receive phase of the combine of the dispatch in `launch.set`.
cudaError_t launchLlCombine(const LlView& view, const LlCombineInput& input, const LlLaunch& launch);

}  // namespace unifab::kernels::ep
