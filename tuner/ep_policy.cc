#include "tuner/ep_policy.h"

#include <algorithm>
#include <cmath>

namespace unifab::tuner {
namespace {

// What one SM of the EP kernels delivers into a peer, measured on 2 x H200 (a plain copy reaches
// ~45 GB/s; combine's senders, which release a flag per row, ~37). Sizing by the lower rate gives
// 24 SMs for two ranks, where the sweep in docs/benchmarks/ep-ht.md has both operations at their best.
constexpr double kPeerStoreGBpsPerSm = 37.0;
constexpr double kLocalStoreGBpsPerSm = 63.0;
constexpr double kLinkEfficiency = 0.78;
constexpr double kMargin = 1.25;  // SMs also wait on loads and signals
constexpr int kMinSms = 4;
constexpr int kMaxSms = 24;
constexpr double kUnknownLinkGBps = 450.0;  // an NVLink 4 GPU with 18 links

}  // namespace

int epHighThroughputSms(const EpSmQuery& query) {
  double link = (query.nvlinkGBps > 0 ? query.nvlinkGBps : kUnknownLinkGBps) * kLinkEfficiency;
  double needed;
  if (query.nRanks <= 1) {
    needed = link / kLocalStoreGBpsPerSm;  // everything stays local; size it like one link's worth
  } else {
    // The remote share (n-1)/n of the written bytes fills the link; the local share rides along.
    double writtenGBps = link * query.nRanks / (query.nRanks - 1);
    needed = writtenGBps / kPeerStoreGBpsPerSm;
  }
  int sms = static_cast<int>(std::ceil(needed * kMargin));
  sms = std::clamp(sms, kMinSms, kMaxSms);
  if (query.deviceSms > 0) sms = std::min(sms, query.deviceSms);
  return sms;
}

}  // namespace unifab::tuner
