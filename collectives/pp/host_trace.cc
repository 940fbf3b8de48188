#include "collectives/pp/host_trace.h"

#include "collectives/pp/rendezvous_protocol.h"
#include "plugin/log.h"

namespace unifab::collectives::pp {

double HostTrace::meanUs(int side, Way way, Step step) const {
  const uint64_t n = calls(side, way);
  return n == 0 ? 0.0 : static_cast<double>(ns_[side][way][step].load(std::memory_order_relaxed)) / 1e3 / static_cast<double>(n);
}

void HostTrace::log(int rank) const {
  if (!enabled_) return;
  static const char* const kWayNames[kWays] = {"rendezvous, posted first", "rendezvous, posted second", "slots"};
  for (int side = 0; side < 2; ++side) {
    for (int way = 0; way < kWays; ++way) {
      const uint64_t n = calls(side, static_cast<Way>(way));
      if (n == 0) continue;
      double us[kSteps];
      double total = 0.0;
      for (int s = 0; s < kSteps; ++s) {
        us[s] = meanUs(side, static_cast<Way>(way), static_cast<Step>(s));
        total += us[s];
      }
      UF_INFO(kExt, unifab::kLogP2p,
              "PP trace: rank %d %s, %s, %llu calls, host us per call: check %.1f, describe %.1f, ring wait %.1f, "
              "arrive %.1f, handles %.1f, stream ops %.1f, total %.1f",
              rank, side == kSendSide ? "send" : "recv", kWayNames[way], static_cast<unsigned long long>(n),
              us[kCheck], us[kDescribe], us[kRingWait], us[kArrive], us[kHandles], us[kStreamOps], total);
    }
  }
}

}  // namespace unifab::collectives::pp
