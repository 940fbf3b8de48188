// The NVLink copy ceiling for a dispatch-shaped exchange, measured in the same run as the
// operation it bounds: every rank pushes `remoteBytes` to each peer while copying `localBytes`
// into its own memory, once with the copy engines and once with an SM copy kernel on N SMs; then
// the peer's rows alone and split grids with two other copies (a whole row in registers, and bulk
// copies through shared memory), to tell whether the copy method or the link sets the rate.
#pragma once

#include <cstddef>
#include <vector>

#include "tests/common/nccl_session.h"

namespace unifab::bench {

struct CopyCeiling {
  double copyEngineUs = 0;  // cudaMemcpyAsync to every peer and to itself, one stream
  double smUs = 0;          // one kernel on `sms` SMs, 16-byte loads and stores, rows interleaved
  double smRemoteOnlyUs = 0;  // the same kernel with the peer's rows alone
  double smLocalOnlyUs = 0;   // ... and with the local rows alone
  double smRemoteOnlyPredicatedUs = 0;  // remote rows alone, every round full width with masked lanes
  double smSplit8PredicatedUs = 0;      // 8 SMs remote, the rest local, masked full rounds
  struct Split {
    int remoteBlocks;  // SMs that copy to the peer; the others copy locally
    double us;
  };
  std::vector<Split> splits;
  struct Variant {
    const char* name;  // how the rows are copied, and on which SMs
    bool remoteOnly;   // the peer's rows alone (no DeepEP-accounted bandwidth)
    double us;
  };
  std::vector<Variant> variants;
};

// Collective over the session's ranks. Times are medians over `iters` after an L2 flush and a
// barrier, the slowest rank. `rowBytes` is the dispatch row size the SM kernel copies at a time;
// `sms` = 0 measures the copy engines alone.
bool measureCopyCeiling(test::NcclSession& session, size_t remoteBytes, size_t localBytes, size_t rowBytes, int sms,
                        int iters, void* flush, size_t flushBytes, CopyCeiling* out);

}  // namespace unifab::bench
