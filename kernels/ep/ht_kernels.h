// Host entry points of the high-throughput expert-parallel kernels. One dispatch is one kernel
//   layout -> count exchange -> payload -> rows-landed wait   [-> expert-major expansion]
// and one combine is one kernel, either
//   start handshake -> partial sums sent to the tokens' ranks -> reduction as they land -> end word
// or, from the ranks' combine inputs,
//   ready handshake -> every rank's rows read where they lie and reduced -> read handshake.
// Each launch returns the CUDA launch status; device-side failures go to GroupView::error.
#pragma once

#include <cuda_runtime.h>

#include "kernels/ep/ep_types.h"

namespace unifab::kernels::ep {

enum class Payload : int { kBf16 = 0, kFp8 = 1 };

UNIFAB_HOST_DEVICE inline int payloadBytesPerValue(Payload dtype) { return dtype == Payload::kFp8 ? 1 : 2; }

struct DispatchInput {
  int numTokens;
  Payload dtype;
  const void* x;            // [numTokens][hidden]
  const float* scales;      // FP8: [numTokens][hidden / kScaleBlock]
  const void* topkIdx;      // [numTokens][topk]
  bool topkIdxIs32;
  const float* topkWeights; // [numTokens][topk] or null (weights 1)
  int routingTag;           // cached re-dispatch: names the routing (the same on every rank); 0 otherwise
};

// Expert-major copy of the received rows (device memory of the group, not the window).
struct ExpertMajorRows {
  char* x;
  float* scales;
  int* topk;
  float* weights;
  int* source;
  int capacity;
};

struct CombineInput {
  const void* expertOutput;  // BF16 rows in the dispatch's output layout
  bool expertMajor;
  bool weighted;
  void* combinedX;           // [numTokens][hidden] BF16
  float* combinedWeights;    // [numTokens][topk] or null
  bool pull;                 // expertOutput is this rank's combine input (WindowLayout::combineIn, rank-major):
                             // every rank reads the rows it needs from the others' inputs
};

// One dispatch, one kernel on `numBlocks` SMs (at most GroupView::maxBlocks): the layout of the
// tokens (skipped when `cached`: the routing holds it), the exchange of counts with every rank,
// every token written once into each destination rank's receive rows (the first `remoteBlocks`
// blocks write the rows for other ranks; 0: none, numBlocks: one block does both), and a wait
// until every peer's rows for this rank have landed.
cudaError_t launchDispatch(const GroupView& group, const DispatchInput& input, const Routing& routing, bool cached,
                           int numBlocks, int remoteBlocks, cudaStream_t stream);
// Rank-major rows -> expert-major rows (one per (token, local expert)), aligned expert regions.
cudaError_t launchExpand(const GroupView& group, const Routing& routing, Payload dtype, const ExpertMajorRows& rows,
                         cudaStream_t stream);
// One combine, one kernel: the first `remoteBlocks` blocks push partial sums to the tokens' ranks,
// the others reduce this rank's tokens as the partials land; or, with CombineInput::pull, every
// block reduces, reading the other ranks' rows out of their combine inputs (remoteBlocks unused).
cudaError_t launchCombine(const GroupView& group, const Routing& routing, const CombineInput& input, int numBlocks,
                          int remoteBlocks, cudaStream_t stream);

}  // namespace unifab::kernels::ep
