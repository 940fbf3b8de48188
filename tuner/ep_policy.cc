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
// Plain copies measured per SM on H200 (GB/s): into a peer over NVLink, and within HBM; and the
// SMs that already saturate one GPU's NVLink (8 SMs push ~330 GB/s, as fast as 16 or 24).
constexpr double kRemoteCopyGBpsPerSm = 45.0;
constexpr double kLocalCopyGBpsPerSm = 39.0;
constexpr int kSmsToSaturateNvlink = 8;
// Combine's senders publish a flag every few rows and its reducers need as many SMs as it can
// spare: 9 senders of 24 SMs measured best on 2 x H200 (216 us; 10 and 11 sent sooner but left
// the reducers behind, 234 and 242 us).
constexpr int kCombineSenderSms = 9;
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

int epRemoteBlocks(EpOp op, int nRanks, int blocks) {
  if (nRanks <= 1 || blocks <= 0) return 0;
  if (blocks == 1) return 1;
  // The share that makes both parts finish together ((n-1)/n of the bytes are remote), capped
  // where more remote SMs stop paying, at least one block each.
  const double remoteTime = (nRanks - 1) / kRemoteCopyGBpsPerSm;
  const double localTime = 1.0 / kLocalCopyGBpsPerSm;
  int remote = static_cast<int>(std::lround(blocks * remoteTime / (remoteTime + localTime)));
  remote = std::min(remote, op == EpOp::kDispatch ? kSmsToSaturateNvlink : kCombineSenderSms);
  return std::clamp(remote, 1, blocks - 1);
}

int epLowLatencyBlocks(int warpItems, int warpsPerBlock, int deviceSms) {
  if (warpsPerBlock <= 0) return 1;
  const int blocks = (std::max(warpItems, 1) + warpsPerBlock - 1) / warpsPerBlock;
  return std::clamp(blocks, 1, std::max(deviceSms, 1));
}

}  // namespace unifab::tuner
