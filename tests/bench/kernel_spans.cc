#include "tests/bench/kernel_spans.h"

#include <algorithm>
#include <unordered_map>

namespace unifab::bench {

uint64_t operationSpansUs(std::vector<RecordedKernel> kernels, uint64_t ids, std::vector<double>* spansUs) {
  std::vector<uint64_t> first(ids, UINT64_MAX), last(ids, 0);
  std::sort(kernels.begin(), kernels.end(), [](const RecordedKernel& a, const RecordedKernel& b) { return a.startNs < b.startNs; });
  std::unordered_map<uint32_t, uint64_t> streamEnd;  // latest end so far of each stream's kernels
  for (const RecordedKernel& k : kernels) {
    if (k.startNs == 0 || k.endNs <= k.startNs) continue;
    uint64_t& before = streamEnd[k.stream];
    const uint64_t startNs = std::max(k.startNs, before);
    before = std::max(before, k.endNs);
    if (k.operation == 0 || k.operation > ids) continue;
    const uint64_t i = k.operation - 1;
    first[i] = std::min(first[i], startNs);
    last[i] = std::max(last[i], k.endNs);
  }
  spansUs->assign(ids, 0.0);
  uint64_t empty = 0;
  for (uint64_t i = 0; i < ids; ++i) {
    if (last[i] > first[i]) (*spansUs)[i] = static_cast<double>(last[i] - first[i]) / 1e3;
    else ++empty;
  }
  return empty;
}

}  // namespace unifab::bench
