#include "tuner/cost_model.h"

#include <algorithm>
#include <cmath>

namespace unifab::tuner {
namespace {

double ceilLog2(int value) { return value <= 1 ? 0.0 : std::ceil(std::log2(static_cast<double>(value))); }

}  // namespace

const char* collectiveName(int collective) {
  static const char* const kNames[] = {"broadcast", "reduce", "allgather", "reducescatter", "allreduce"};
  return collective >= 0 && collective < kNumCollectives ? kNames[collective] : "unknown";
}

const char* algorithmName(int algorithm) {
  static const char* const kNames[] = {"tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat"};
  return algorithm >= 0 && algorithm < kNumAlgorithms ? kNames[algorithm] : "unknown";
}

const char* protocolName(int protocol) {
  static const char* const kNames[] = {"ll", "ll128", "simple"};
  return protocol >= 0 && protocol < kNumProtocols ? kNames[protocol] : "unknown";
}

CostModel::CostModel(const Topology& topology, const LatencyConstants& latency, const ModelConstants& constants)
    : topology_(topology), latency_(latency), constants_(constants) {}

bool CostModel::usable() const {
  if (topology_.nRanks < 2 || topology_.nNodes < 1 || topology_.ranksPerNode < 1) return false;
  if (topology_.ranksPerNode > 1 && topology_.nvlinkGBps <= 0) return false;
  if (topology_.nNodes > 1 && topology_.netGBps <= 0) return false;
  return true;
}

double CostModel::bottleneckGBps() const {
  double slowest = 1e300;
  if (topology_.ranksPerNode > 1) slowest = std::min(slowest, topology_.nvlinkGBps);
  if (topology_.nNodes > 1) slowest = std::min(slowest, topology_.netGBps);
  return slowest * constants_.linkEfficiency;
}

bool CostModel::pattern(int collective, int algorithm, Pattern* out) const {
  const double n = topology_.nRanks;
  const int nodes = topology_.nNodes;
  // A ring visits every node once per lap: nodes/n of its hops cross the network.
  const double interFraction = nodes > 1 ? static_cast<double>(nodes) / n : 0.0;
  auto ring = [&](double steps, double busFactor) {
    *out = Pattern{busFactor, steps * (1.0 - interFraction), steps * interFraction, 1.0};
    return true;
  };
  switch (collective) {
    case kAllReduce:
      if (algorithm == kRing) return ring(2.0 * (n - 1), 2.0 * (n - 1) / n);
      if (algorithm == kTree) {
        // A chain inside each node, a tree across nodes; reduce goes up, broadcast comes down.
        // Every rank but the two ends of a chain sends each byte twice through its own port, up
        // to its parent and down to its children, so the busiest rank moves 2 nBytes (NCCL's own
        // model counts the same: tree bandwidth x 0.5). With two ranks both are ends: nBytes.
        const double busFactor = topology_.nRanks > 2 ? 2.0 : 1.0;
        *out = Pattern{busFactor, 2.0 * (topology_.ranksPerNode - 1), 2.0 * ceilLog2(nodes), constants_.treeEfficiency};
        return true;
      }
      return false;
    case kAllGather:
    case kReduceScatter:
      if (algorithm == kRing) return ring(n - 1, (n - 1) / n);
      if (algorithm == kPat) {
        double steps = ceilLog2(topology_.nRanks);
        *out = Pattern{(n - 1) / n, nodes > 1 ? 0.0 : steps, nodes > 1 ? steps : 0.0, constants_.patEfficiency};
        return true;
      }
      return false;
    case kBroadcast:
    case kReduce:
      if (algorithm == kRing) return ring(n - 1, 1.0);
      return false;
    default:
      return false;
  }
}

int CostModel::networkChannels(int collective, int algorithm, size_t bytes) const {
  Pattern p{};
  if (topology_.nNodes < 2 || !topology_.networkHostMoved || !usable() || !pattern(collective, algorithm, &p)) {
    return 0;
  }
  const double wireBytes = static_cast<double>(bytes) * p.busFactor;
  const double stepBytes = wireBytes / std::max(1.0, p.intraHops + p.interHops);
  // A ring keeps two connections of each rank busy on one channel (it sends to the next rank while
  // it receives from the previous); a chain (broadcast, reduce) keeps one, the sender's or the
  // receiver's, so its latency-bound floor is two channels: the same two connections at work.
  const bool chain = collective == kBroadcast || collective == kReduce;
  const double fewest = stepBytes < constants_.netOneChannelStepBytes && !chain
                            ? 1.0
                            : std::max(1, constants_.minNetChannels);
  return channelsFor(wireBytes, constants_.netBytesPerChannel, fewest);
}

int CostModel::channelsFor(double wireBytes, double bytesPerChannel, double fewest) {
  const double wanted = std::ceil(wireBytes / std::max(1.0, bytesPerChannel));
  return static_cast<int>(std::clamp(wanted, fewest, static_cast<double>(kNcclMaxChannels)));
}

int CostModel::nvlinkLlChannels(int collective, int algorithm, int protocol, size_t bytes) const {
  Pattern p{};
  if (protocol != kLL || algorithm != kRing || topology_.nNodes != 1 || topology_.nRanks != 2 || !usable() ||
      !pattern(collective, algorithm, &p)) {
    return 0;
  }
  const double wireBytes = static_cast<double>(bytes) * p.busFactor;
  if (wireBytes < constants_.nvlinkLlSpreadBytes) return 0;
  return channelsFor(wireBytes, constants_.nvlinkLlBytesPerChannel, 1.0);
}

int CostModel::channels(int collective, int algorithm, int protocol, size_t bytes) const {
  const int network = networkChannels(collective, algorithm, bytes);
  return network > 0 ? network : nvlinkLlChannels(collective, algorithm, protocol, bytes);
}

double CostModel::estimateUs(int collective, int algorithm, int protocol, size_t bytes, int numPipeOps) const {
  if (protocol < 0 || protocol >= kNumProtocols || !usable()) return -1.0;
  Pattern p{};
  if (!pattern(collective, algorithm, &p)) return -1.0;
  // Simple's and LL128's NVLink corrections were measured inside one node only; across nodes the
  // network's own hops dominate.
  const bool nvlinkOnly = p.intraHops > 0 && p.interHops == 0;
  // LL128's was measured on rings; NCCL's tree ran LL128 slower than the ring at every size.
  const bool nvlinkRingLl128 = protocol == kLL128 && algorithm == kRing && nvlinkOnly;
  double base = latency_.base[algorithm][protocol];
  if (nvlinkRingLl128) base = std::max(0.0, base + constants_.nvlinkLl128BaseUs);
  // Ops aggregated in one group share a launch: the base latency is paid once for all of them.
  double alpha = base / std::max(1, numPipeOps) + p.intraHops * latency_.hop[kLinkNvlink][algorithm][protocol] +
                 p.interHops * latency_.hop[kLinkNet][algorithm][protocol];
  if (protocol == kSimple && nvlinkOnly) alpha += constants_.nvlinkSimpleStartUs;
  const bool hostMovedLl = protocol == kLL && p.interHops > 0 && topology_.networkHostMoved;
  const double ll128 = collective == kReduceScatter ? constants_.nvlinkLl128ReduceScatterEfficiency
                                                    : constants_.nvlinkLl128Efficiency;
  const double payload = nvlinkRingLl128 ? ll128
                         : hostMovedLl   ? constants_.protocolEfficiency[kSimple] * constants_.hostMovedNetLlRate
                                         : constants_.protocolEfficiency[protocol];
  double bandwidth = bottleneckGBps() * payload * p.efficiency;
  // NCCL's llMaxBws caps LL where the pattern crosses the network. Inside an NVLink domain LL is
  // bound by its payload fraction of the link (protocolEfficiency) instead: NCCL's Hopper cap
  // (141 GB/s) is below what Ring-LL moved on 2 x H200 (161-164 GB/s on 32 channels from 256 KiB
  // to 128 MiB, half of Ring-Simple's 313), and with it the model handed 2 MiB all-reduces to
  // Simple, 27 % slower than Ring-LL (docs/benchmarks/tuner.md).
  if (protocol == kLL && latency_.llMaxGBps > 0 && topology_.nNodes > 1) {
    bandwidth = std::min(bandwidth, latency_.llMaxGBps);
  }
  // bytes / (GB/s) is nanoseconds; the table is in microseconds.
  return alpha + static_cast<double>(bytes) * p.busFactor / (bandwidth * 1e3);
}

}  // namespace unifab::tuner
