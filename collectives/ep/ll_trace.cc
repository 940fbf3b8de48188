#include "collectives/ep/ll_trace.h"

#include <algorithm>

#include "kernels/ep/ll_kernels.h"

namespace kep = unifab::kernels::ep;

namespace unifab::collectives::ep {

std::vector<LlTracePointSummary> summarizeLlTrace(const std::vector<uint32_t>& records, int maxBlocks) {
  std::vector<LlTracePointSummary> points;
  if (maxBlocks < 1 || records.size() < kep::llTraceWords(maxBlocks)) return points;
  const int warps = maxBlocks * kep::kLlWarpsPerBlock;
  const int firstPoint[2] = {kep::kTraceLlDispatchStarted, kep::kTraceLlCombineStarted};
  const int stamps[2] = {kep::kTraceLlCombineStarted - kep::kTraceLlDispatchStarted,
                         kep::kTracePoints - kep::kTraceLlCombineStarted};
  for (int op = 0; op < 2; ++op) {
    for (int i = 0; i < stamps[op]; ++i) {
      LlTracePointSummary summary{firstPoint[op] + i, 0, 0.0, {}, {}};
      unsigned long long sum = 0;
      for (int c = 0; c < 2 * kep::kLlTraceCalls; ++c) {
        const int kind = kep::llTraceKind(op, c >= kep::kLlTraceCalls);
        const uint32_t* slot = records.data() + kep::llTraceRecord(kind, static_cast<uint64_t>(c % kep::kLlTraceCalls), 0, maxBlocks);
        // Epochs only grow, so the slot's call is its newest (a wrapped 32-bit epoch, after four
        // billion calls, is left out until the slot is rewritten).
        uint32_t newest = 0;
        for (int w = 0; w < warps; ++w) newest = std::max(newest, slot[static_cast<size_t>(w) * kep::kLlTraceRecordWords]);
        if (newest == 0) continue;
        unsigned long long latest = 0, earliest = ~0ULL;
        for (int w = 0; w < warps; ++w) {
          const uint32_t* record = slot + static_cast<size_t>(w) * kep::kLlTraceRecordWords;
          const uint32_t at = record[1 + i];
          if (record[0] != newest || at == 0) continue;
          sum += at;
          ++summary.count;
          latest = std::max<unsigned long long>(latest, at);
          earliest = std::min<unsigned long long>(earliest, at);
        }
        if (latest != 0) {
          summary.latestNs.push_back(latest);
          summary.earliestNs.push_back(earliest);
        }
      }
      if (summary.count == 0) continue;
      summary.meanNs = static_cast<double>(sum) / static_cast<double>(summary.count);
      points.push_back(std::move(summary));
    }
  }
  return points;
}

}  // namespace unifab::collectives::ep
