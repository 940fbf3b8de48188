// The low-latency kernels' trace records (kernels/ep/ll_kernels.h: llTraceRecord) summed up per
// trace point, apart from the group so that the arithmetic is tested without a GPU.
#pragma once

#include <cstdint>
#include <vector>

namespace unifab::collectives::ep {

struct LlTracePointSummary {
  int point;                                  // kernels/ep/ep_types.h: TracePoint
  unsigned long long count;                   // records that reached it, over all calls
  double meanNs;                              // their mean time after the call's start
  std::vector<unsigned long long> latestNs;   // per call: the latest record's time
  std::vector<unsigned long long> earliestNs; // per call: the earliest record's time
};

// `records`: the group's whole record buffer (llTraceWords(maxBlocks) words). A kernel's records
// (a send-only and a receive-only kernel of one call count as two) are those of its slot's newest
// epoch (older calls' records of warps its grid did not have are left out); a stamp of 0 is a
// point the warp did not reach. Points no record reached are left out.
std::vector<LlTracePointSummary> summarizeLlTrace(const std::vector<uint32_t>& records, int maxBlocks);

}  // namespace unifab::collectives::ep
