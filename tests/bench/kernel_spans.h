// The arithmetic of KernelTimer (kernel_timer.h), apart from CUPTI so that it is tested without a
// GPU: from the kernels a recording saw, each operation's span.
#pragma once

#include <cstdint>
#include <vector>

namespace unifab::bench {

struct RecordedKernel {
  uint64_t operation;  // 1..ids, or 0: a kernel of no operation (it still orders its stream)
  uint32_t stream;
  uint64_t startNs, endNs;  // a record of a kernel not yet finished has 0 or end <= start: skipped
};

// spansUs[op - 1] for operations 1..ids: from the first counted start to the last end of the
// operation's kernels, in microseconds, 0 where it has none. A kernel counts from the latest end
// of the kernels that started before it in its stream when that is later than its own start (a
// programmatic dependent launch starts during its predecessor and first waits for it), so that
// in-stream kernel times never overlap. Returns how many operations had no kernel.
uint64_t operationSpansUs(std::vector<RecordedKernel> kernels, uint64_t ids, std::vector<double>* spansUs);

}  // namespace unifab::bench
