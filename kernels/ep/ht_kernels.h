// Host entry points of the high-throughput expert-parallel kernels. One dispatch is
//   layout -> count exchange -> payload -> done signal [-> expert-major expansion]
// and one combine is
//   partial sums sent to the tokens' ranks -> done signal -> reduction over ranks.
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
};

// Destination ranks and per-destination slots of every token; per-rank and per-expert counts.
cudaError_t launchLayout(const GroupView& group, const DispatchInput& input, const Routing& routing,
                         cudaStream_t stream);
// Publishes this rank's counts to every rank and derives offsets and receive counts (expert
// regions aligned to routing.expertAlignment).
cudaError_t launchCountExchange(const GroupView& group, const Routing& routing, cudaStream_t stream);
// Writes every token once into each destination rank's receive rows.
cudaError_t launchDispatchPayload(const GroupView& group, const DispatchInput& input, const Routing& routing,
                                  int numBlocks, cudaStream_t stream);
enum class Phase : int { kDispatch = 0, kCombine = 1 };
// Tells every rank that this rank's writes of the phase are complete and waits for all of theirs.
cudaError_t launchPhaseBarrier(const GroupView& group, Phase phase, cudaStream_t stream);
// Rank-major rows -> expert-major rows (one per (token, local expert)), aligned expert regions.
cudaError_t launchExpand(const GroupView& group, const Routing& routing, Payload dtype, const ExpertMajorRows& rows,
                         cudaStream_t stream);
cudaError_t launchCombineSend(const GroupView& group, const Routing& routing, const CombineInput& input,
                              const ExpertMajorRows& rows, int numBlocks, cudaStream_t stream);
cudaError_t launchCombineReduce(const GroupView& group, const Routing& routing, const CombineInput& input,
                                int numBlocks, cudaStream_t stream);

}  // namespace unifab::kernels::ep
