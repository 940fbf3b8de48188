// The cost model and the tuner's decisions on synthetic topologies (1, 2, 4 and 8 GPUs per node;
// 1, 2 and 16 nodes), with NCCL-like latency constants and NCCL 2.28.9's own.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/unit/log_capture.h"
#include "tuner/ep_policy.h"
#include "tuner/topology.h"
#include "tuner/tuner.h"

using namespace unifab::tuner;

namespace {

constexpr float kIgnore = -1.0f;

LatencyConstants ncclLikeLatencies() {
  LatencyConstants c;
  for (int a = 0; a < kNumAlgorithms; ++a) {
    c.base[a][kLL] = 6.8;
    c.base[a][kLL128] = 14.0;
    c.base[a][kSimple] = 8.4;
    c.hop[kLinkNvlink][a][kLL] = 0.6;
    c.hop[kLinkNvlink][a][kLL128] = 1.25;
    c.hop[kLinkNvlink][a][kSimple] = 4.0;
    c.hop[kLinkPci][a][kLL] = 1.0;
    c.hop[kLinkPci][a][kLL128] = 1.9;
    c.hop[kLinkPci][a][kSimple] = 4.5;
    c.hop[kLinkNet][a][kLL] = 5.0;
    c.hop[kLinkNet][a][kLL128] = 8.5;
    c.hop[kLinkNet][a][kSimple] = 14.0;
  }
  return c;
}

// NCCL 2.28.9's defaults as its tuner init passes them (src/graph/tuning.cc,
// ncclTunerConstantsDefaults), with the LL cap plugin/tuner_v5.cc picks for Hopper.
LatencyConstants nccl2289Latencies(int nodes) {
  LatencyConstants c;
  const double base[kNumAlgorithms][kNumProtocols] = {{6.8, 14.0, 8.4}, {6.6, 14.0, 8.4}, {}, {}, {}, {},
                                                      {8.0, 8.0, 8.0}};
  const double nvlink[kNumAlgorithms][kNumProtocols] = {{.6, 1.25, 4.0}, {.6, 1.9, 3.4}, {0, 0, 3.7}, {0, 0, 2.8},
                                                        {0, 0, 25}, {0, 0, 25}, {0, 0, 4.0}};
  const double net[kNumAlgorithms][kNumProtocols] = {{5.0, 8.5, 14}, {2.7, 4.0, 14.0}, {0, 0, 31}, {0, 0, 30},
                                                     {0, 0, 18}, {0, 0, 20.9}, {0, 0, 14}};
  for (int a = 0; a < kNumAlgorithms; ++a)
    for (int p = 0; p < kNumProtocols; ++p) {
      c.base[a][p] = base[a][p];
      c.hop[kLinkNvlink][a][p] = nvlink[a][p];
      c.hop[kLinkNet][a][p] = net[a][p];
    }
  c.llMaxGBps = nodes <= 1 ? 141.0 : nodes == 2 ? 45.0 : 35.0;  // llMaxBws[Hopper][scale]
  return c;
}

Topology topology(int gpusPerNode, int nodes) {
  Topology t;
  t.nRanks = gpusPerNode * nodes;
  t.nNodes = nodes;
  t.ranksPerNode = gpusPerNode;
  t.nvlinkGBps = 450;
  t.netGBps = 50;
  t.computeCapability = 90;
  return t;
}

// NCCL's table as it arrives: usable entries hold NCCL's estimates, the rest are IGNORE.
struct Table {
  float cell[kNumAlgorithms][kNumProtocols];
  explicit Table(std::vector<int> usableAlgorithms) {
    for (auto& row : cell)
      for (float& value : row) value = kIgnore;
    for (int a : usableAlgorithms)
      for (int p = 0; p < kNumProtocols; ++p) cell[a][p] = 1000.0f + 10.0f * a + p;
  }
  float* data() { return &cell[0][0]; }
  // The usable entry with the lowest cost, as NCCL picks it.
  std::pair<int, int> choice() const {
    std::pair<int, int> best{-1, -1};
    float bestCost = 0;
    for (int a = 0; a < kNumAlgorithms; ++a)
      for (int p = 0; p < kNumProtocols; ++p)
        if (cell[a][p] >= 0 && (best.first < 0 || cell[a][p] < bestCost)) {
          best = {a, p};
          bestCost = cell[a][p];
        }
    return best;
  }
};

std::vector<int> algorithmsNcclOffers(int collective, const Topology& t) {
  if (collective == kAllReduce) return {kTree, kRing};
  if ((collective == kAllGather || collective == kReduceScatter) && t.ranksPerNode == 1) return {kRing, kPat};
  return {kRing};
}

// The (collective, algorithm) pairs docs/tuner.md says the model describes.
bool modelDescribes(int collective, int algorithm) {
  switch (collective) {
    case kAllReduce:
      return algorithm == kRing || algorithm == kTree;
    case kAllGather:
    case kReduceScatter:
      return algorithm == kRing || algorithm == kPat;
    case kBroadcast:
    case kReduce:
      return algorithm == kRing;
    default:
      return false;
  }
}

const std::pair<int, int> kShapes[] = {{1, 2}, {2, 1}, {8, 1}, {1, 16}, {8, 2}, {8, 16}};

// Low-latency EP groups are refused unless NVML reports NVLink on their GPU: a GPU NVML cannot
// find (or no NVML at all, as on CI) must read as unknown, never as linked.
TEST(Topology, NvlinksOfAnUnknownGpuAreUnknown) {
  EXPECT_EQ(unifab::tuner::activeNvlinks("ffff:ff:1f.7"), -1);
  EXPECT_EQ(unifab::tuner::activeNvlinks(""), -1);
}

TEST(CostModel, EstimatesArePositiveFiniteAndGrowWithSize) {
  for (auto [gpus, nodes] : kShapes) {
    CostModel model(topology(gpus, nodes), ncclLikeLatencies());
    ASSERT_TRUE(model.usable());
    for (int coll = 0; coll < kNumCollectives; ++coll) {
      for (int algo = 0; algo < kNumAlgorithms; ++algo) {
        if (!modelDescribes(coll, algo)) {
          EXPECT_LT(model.estimateUs(coll, algo, kSimple, 1024), 0);
          continue;
        }
        for (int proto = 0; proto < kNumProtocols; ++proto) {
          double previous = 0;
          for (size_t bytes = 8; bytes <= (size_t{1} << 30); bytes *= 4) {
            double us = model.estimateUs(coll, algo, proto, bytes);
            ASSERT_TRUE(std::isfinite(us) && us > 0) << collectiveName(coll) << " " << algorithmName(algo);
            EXPECT_GE(us, previous);
            previous = us;
          }
        }
      }
    }
  }
}

TEST(CostModel, BandwidthTermFollowsTheSlowestLink) {
  Topology fast = topology(8, 2);
  Topology slow = fast;
  slow.netGBps = fast.netGBps / 4;
  CostModel a(fast, ncclLikeLatencies()), b(slow, ncclLikeLatencies());
  size_t big = size_t{1} << 30, small = size_t{1} << 20;
  double slopeFast = a.estimateUs(kAllReduce, kRing, kSimple, big) - a.estimateUs(kAllReduce, kRing, kSimple, small);
  double slopeSlow = b.estimateUs(kAllReduce, kRing, kSimple, big) - b.estimateUs(kAllReduce, kRing, kSimple, small);
  EXPECT_NEAR(slopeSlow / slopeFast, 4.0, 1e-6);
  // One node never crosses the network: its speed must not matter.
  CostModel c(topology(8, 1), ncclLikeLatencies());
  Topology oneNodeSlowNet = topology(8, 1);
  oneNodeSlowNet.netGBps = 0.001;
  CostModel d(oneNodeSlowNet, ncclLikeLatencies());
  EXPECT_DOUBLE_EQ(c.estimateUs(kAllGather, kRing, kLL128, big), d.estimateUs(kAllGather, kRing, kLL128, big));
}

// NCCL's LL cap (llMaxBws) binds only where the pattern crosses the network; inside an NVLink
// domain LL runs at its payload fraction (0.5) of the link: Ring-LL moved 164 GB/s on 2 x H200,
// above the Hopper cap of 141 (docs/benchmarks/tuner.md).
TEST(CostModel, NcclLlCapBindsOnlyAcrossTheNetwork) {
  auto slopeUs = [](const CostModel& model, int algorithm, int protocol) {
    return model.estimateUs(kAllReduce, algorithm, protocol, size_t{1} << 30) -
           model.estimateUs(kAllReduce, algorithm, protocol, size_t{1} << 20);
  };
  CostModel inNode(topology(2, 1), nccl2289Latencies(1));
  EXPECT_NEAR(slopeUs(inNode, kRing, kLL) / slopeUs(inNode, kRing, kSimple), 2.0, 1e-6);
  Topology fastNet = topology(1, 2);
  fastNet.netGBps = 400;  // LL at half of 0.8 x 400 would be 160 GB/s: the cap (45) binds
  CostModel acrossNodes(fastNet, nccl2289Latencies(2));
  const double bytes = double((size_t{1} << 30) - (size_t{1} << 20));
  EXPECT_NEAR(slopeUs(acrossNodes, kRing, kLL), bytes / (45.0 * 1e3), 1e-3);
}

// A chain's interior ranks send every byte twice (up, then down) through their own port; with
// two ranks both are ends and the tree moves what the ring moves.
TEST(CostModel, TreeInteriorRanksSendEachByteTwice) {
  for (auto [gpus, nodes] : kShapes) {
    Topology t = topology(gpus, nodes);
    CostModel model(t, ncclLikeLatencies());
    size_t big = size_t{1} << 30, small = size_t{1} << 20;
    auto slope = [&](int algorithm) {
      return model.estimateUs(kAllReduce, algorithm, kSimple, big) -
             model.estimateUs(kAllReduce, algorithm, kSimple, small);
    };
    double tree = slope(kTree), ring = slope(kRing);
    const double n = t.nRanks;
    const double treeBytes = t.nRanks > 2 ? 2.0 : 1.0, ringBytes = 2.0 * (n - 1) / n;
    EXPECT_NEAR(tree / ring, treeBytes / ringBytes / ModelConstants().treeEfficiency, 1e-6) << gpus << "x" << nodes;
  }
}

TEST(CostModel, AggregatedOpsShareTheLaunchLatency) {
  CostModel model(topology(8, 1), ncclLikeLatencies());
  EXPECT_LT(model.estimateUs(kAllReduce, kRing, kLL, 64, 4), model.estimateUs(kAllReduce, kRing, kLL, 64, 1));
}

TEST(CostModel, DeclinesWithoutTheBandwidthOfALinkItCrosses) {
  Topology t = topology(8, 2);
  t.netGBps = 0;
  EXPECT_FALSE(CostModel(t, ncclLikeLatencies()).usable());
  t = topology(8, 1);
  t.nvlinkGBps = 0;
  EXPECT_FALSE(CostModel(t, ncclLikeLatencies()).usable());
  t.netGBps = 0;
  t.ranksPerNode = 1;
  t.nRanks = 1;
  EXPECT_FALSE(CostModel(t, ncclLikeLatencies()).usable()) << "one rank: NCCL never asks, nothing to model";
  EXPECT_TRUE(CostModel(topology(1, 2), ncclLikeLatencies()).usable()) << "one GPU per node needs no NVLink";
}

TEST(Tuner, TouchesOnlyUsableEntriesAndChannelsWhereMeasured) {
  for (auto [gpus, nodes] : kShapes)
  for (bool sockets : {false, true}) {
    Topology t = topology(gpus, nodes);
    t.networkHostMoved = sockets;
    CostModel model(t, ncclLikeLatencies());
    Tuner tuner(1, model, TunerSettings{});
    for (int coll = 0; coll < kNumCollectives; ++coll) {
      for (size_t bytes = 8; bytes <= (size_t{1} << 30); bytes *= 4) {
        Table table(algorithmsNcclOffers(coll, t));
        table.cell[kRing][kLL128] = kIgnore;  // NCCL may rule out single protocols too
        Table before = table;
        int channels = 0;
        tuner.decide(coll, bytes, 1, 0, table.data(), kNumAlgorithms, kNumProtocols, &channels);
        const auto [algorithm, protocol] = table.choice();
        if (nodes > 1 && sockets) {
          EXPECT_GE(channels, 1) << collectiveName(coll) << " " << bytes;
        } else if (nodes == 1 && algorithm == kRing && protocol == kLL) {
          EXPECT_EQ(channels, model.nvlinkLlChannels(coll, algorithm, protocol, bytes)) << "ring LL inside a node";
        } else {
          EXPECT_EQ(channels, 0) << "other patterns in a node, or a network not measured: NCCL's count stands";
        }
        bool changed = false;
        for (int a = 0; a < kNumAlgorithms; ++a)
          for (int p = 0; p < kNumProtocols; ++p) {
            if (before.cell[a][p] < 0) {
              EXPECT_EQ(table.cell[a][p], kIgnore) << "an IGNORE entry was enabled";
            } else {
              EXPECT_GE(table.cell[a][p], 0.0f);
              changed = changed || table.cell[a][p] != before.cell[a][p];
            }
          }
        EXPECT_TRUE(changed) << collectiveName(coll) << " " << bytes;
      }
    }
  }
}

// Over unifab's sockets a channel per 2 MiB of the busiest rank's wire bytes, at least two, one
// where a ring step carries less than 128 KiB (never for a chain, whose channel keeps one
// connection busy where a ring's keeps two): two channels beat eight by up to 2x from 256 KiB to
// 2 MiB per rank, eight won from 16 MiB, and one beat two at 4, 32 and 128 KiB of all-reduce (two
// steps of 64 KiB), two beat one at all-gather 256 KiB (one step of 128 KiB). Other networks keep
// NCCL's count.
TEST(CostModel, NetworkChannelsFollowTheWireBytesPerRank) {
  Topology sockets = topology(1, 2);
  sockets.networkHostMoved = true;
  CostModel twoNodes(sockets, nccl2289Latencies(2));
  const size_t kMiB = size_t{1} << 20;
  EXPECT_EQ(twoNodes.networkChannels(kAllReduce, kRing, 8), 1);
  EXPECT_EQ(twoNodes.networkChannels(kAllReduce, kRing, 4 << 10), 1) << "latency-bound: one connection";
  EXPECT_EQ(twoNodes.networkChannels(kAllReduce, kRing, 32 << 10), 1) << "measured: one 60 us, two 79";
  EXPECT_EQ(twoNodes.networkChannels(kAllReduce, kRing, 128 << 10), 1) << "measured: one 112.9 us, two 123.8";
  EXPECT_EQ(twoNodes.networkChannels(kAllReduce, kRing, 256 << 10), 2) << "two steps of 128 KiB";
  EXPECT_EQ(twoNodes.networkChannels(kAllGather, kRing, 128 << 10), 1) << "all-gather: half on the wire, one step";
  EXPECT_EQ(twoNodes.networkChannels(kAllGather, kRing, 256 << 10), 2) << "measured: two 90 us, one 99";
  // Broadcast, 5 repetitions each (thirteenth run): Ring-LL on two channels 11.0 / 12.3 / 14.8 / 20.3
  // us at 8 / 16 / 32 / 64 KiB against one's 12.0 / 14.0 / 19.2 / 32.0; Simple 21.1 against 38.7 at 64 KiB.
  for (size_t bytes : {size_t{8} << 10, size_t{32} << 10, size_t{64} << 10, size_t{128} << 10}) {
    EXPECT_EQ(twoNodes.networkChannels(kBroadcast, kRing, bytes), 2) << bytes << " B: a chain keeps one connection busy";
    EXPECT_EQ(twoNodes.networkChannels(kReduce, kRing, bytes), 2) << bytes << " B";
  }
  EXPECT_EQ(twoNodes.networkChannels(kBroadcast, kRing, 16 * kMiB), 8) << "bandwidth-bound: as a ring of the wire bytes";
  EXPECT_EQ(twoNodes.networkChannels(kAllReduce, kRing, 2 * kMiB), 2);   // 2 MiB on the wire
  EXPECT_EQ(twoNodes.networkChannels(kAllReduce, kRing, 16 * kMiB), 8);  // all-reduce: 2(n-1)/n = 1
  EXPECT_EQ(twoNodes.networkChannels(kAllGather, kRing, 16 * kMiB), 4);  // all-gather: (n-1)/n
  EXPECT_EQ(twoNodes.networkChannels(kAllReduce, kRing, size_t{1} << 40), 64) << "NCCL's MAXCHANNELS";
  EXPECT_EQ(CostModel(topology(8, 1), nccl2289Latencies(1)).networkChannels(kAllReduce, kRing, 16 * kMiB), 0)
      << "one node: NCCL's count";
  EXPECT_EQ(twoNodes.networkChannels(kAllReduce, kCollnetDirect, 16 * kMiB), 0) << "a pattern the model lacks";
  EXPECT_EQ(CostModel(topology(1, 2), nccl2289Latencies(2)).networkChannels(kAllReduce, kRing, 16 * kMiB), 0)
      << "a network other than unifab's sockets: not measured, NCCL's count";
  Tuner tuner(1, twoNodes, TunerSettings{});
  Table table(algorithmsNcclOffers(kAllReduce, sockets));
  int channels = 0;
  tuner.decide(kAllReduce, 128 * kMiB, 1, 0, table.data(), kNumAlgorithms, kNumProtocols, &channels);
  EXPECT_EQ(channels, 64);
}

// Over unifab's sockets LL moves a third of Simple's payload rate (fitted: 0.31-0.35), so the
// LL/Simple crossover of an all-reduce across two nodes falls between 32 and 128 KiB, where the
// ninth run measured it (~54 KiB); over another network NCCL's half stands and LL keeps 128 KiB.
TEST(CostModel, LlCostsMoreAcrossHostMovedNetworks) {
  Topology sockets = topology(1, 2);
  sockets.netGBps = 10;  // the sweep's --socket-speed-mbps 80000
  sockets.networkHostMoved = true;
  Topology rdma = sockets;
  rdma.networkHostMoved = false;
  const CostModel overSockets(sockets, nccl2289Latencies(2));
  const CostModel overRdma(rdma, nccl2289Latencies(2));
  for (int algorithm : {kRing, kTree}) {
    EXPECT_LT(overSockets.estimateUs(kAllReduce, algorithm, kLL, 32 << 10),
              overSockets.estimateUs(kAllReduce, algorithm, kSimple, 32 << 10)) << algorithmName(algorithm);
    EXPECT_GT(overSockets.estimateUs(kAllReduce, algorithm, kLL, 128 << 10),
              overSockets.estimateUs(kAllReduce, algorithm, kSimple, 128 << 10)) << algorithmName(algorithm);
    EXPECT_LT(overRdma.estimateUs(kAllReduce, algorithm, kLL, 128 << 10),
              overRdma.estimateUs(kAllReduce, algorithm, kSimple, 128 << 10)) << algorithmName(algorithm);
  }
  // Inside a node the sockets carry nothing: LL's estimate does not depend on them.
  Topology node = topology(8, 1);
  Topology nodeWithSockets = node;
  nodeWithSockets.networkHostMoved = true;
  EXPECT_EQ(CostModel(node, nccl2289Latencies(1)).estimateUs(kAllReduce, kRing, kLL, 1 << 20),
            CostModel(nodeWithSockets, nccl2289Latencies(1)).estimateUs(kAllReduce, kRing, kLL, 1 << 20));
}

TEST(Tuner, LeavesTheTableAloneWhenAUsableEntryIsOutsideTheModel) {
  Tuner tuner(1, CostModel(topology(8, 1), ncclLikeLatencies()), TunerSettings{});
  Table table({kTree, kRing, kNvls});
  Table before = table;
  int channels = 0;
  tuner.decide(kAllReduce, 1 << 20, 1, 0, table.data(), kNumAlgorithms, kNumProtocols, &channels);
  EXPECT_EQ(memcmp(&table, &before, sizeof(Table)), 0);
}

TEST(Tuner, LeavesTheTableAloneWhenUnsureOrDisabled) {
  Topology unknown = topology(1, 2);
  unknown.netGBps = 0;
  Tuner unsure(1, CostModel(unknown, ncclLikeLatencies()), TunerSettings{});
  TunerSettings off;
  off.enabled = false;
  Tuner disabled(1, CostModel(topology(1, 2), ncclLikeLatencies()), off);
  for (const Tuner* tuner : {&unsure, &disabled}) {
    Table table({kTree, kRing});
    Table before = table;
    int channels = 0;
    tuner->decide(kAllReduce, 4096, 1, 0, table.data(), kNumAlgorithms, kNumProtocols, &channels);
    EXPECT_EQ(memcmp(&table, &before, sizeof(Table)), 0);
  }
}

TEST(Tuner, PicksLowLatencyForTinyAndSimpleForHugeMessages) {
  for (auto [gpus, nodes] : kShapes) {
    Topology t = topology(gpus, nodes);
    Tuner tuner(1, CostModel(t, ncclLikeLatencies()), TunerSettings{});
    int channels = 0;
    Table tiny({kTree, kRing});
    tuner.decide(kAllReduce, 8, 1, 0, tiny.data(), kNumAlgorithms, kNumProtocols, &channels);
    EXPECT_EQ(tiny.choice().second, kLL) << gpus << "x" << nodes;
    Table huge({kTree, kRing});
    tuner.decide(kAllReduce, size_t{1} << 30, 1, 0, huge.data(), kNumAlgorithms, kNumProtocols, &channels);
    EXPECT_EQ(huge.choice().second, kSimple) << gpus << "x" << nodes;
    // Two ranks move the same bytes either way; the ring pipelines better.
    if (t.nRanks == 2) {
      EXPECT_EQ(huge.choice().first, kRing);
    }
  }
}

// The protocols the x4 graph-timed sweep of all four ops over NVLink measured best, or within 5 %
// of the best, at NCCL's default build of 24 channels on 2 x H200 (docs/benchmarks/tuner.md, eighth
// run; sizes as NCCL passes them to the tuner). Where two protocols are within 5 % of each other
// either is right and the size is left out; reduce-scatter at 4 MiB is the model's one miss (it
// picks LL128, 23.7 us, where LL ran 22.1; all-gather's LL ran 26.7 there against LL128's 20.9,
// and the model does not tell the two apart).
TEST(Tuner, TwoH200RanksFollowTheMeasuredProtocolsOfEveryOp) {
  Tuner tuner(1, CostModel(topology(2, 1), nccl2289Latencies(1)), TunerSettings{});
  const size_t kKiB = 1024, kMiB = kKiB * kKiB;
  struct Expected {
    int collective;
    size_t bytes;
    int protocol;
  };
  std::vector<Expected> expected;
  for (int collective : {kBroadcast, kAllGather, kReduceScatter, kAllReduce}) {
    for (size_t bytes = 16; bytes <= kMiB; bytes *= 4) expected.push_back({collective, bytes, kLL});
    for (size_t bytes = 64 * kMiB; bytes <= 1024 * kMiB; bytes *= 4) expected.push_back({collective, bytes, kSimple});
  }
  expected.insert(expected.end(), {
      {kAllReduce, 4 * kMiB, kLL128},       // 30.4 us; Simple 33.2, LL 37.7
      {kAllReduce, 16 * kMiB, kSimple},     // 78.3; LL128 84.9
      {kBroadcast, 2 * kMiB, kLL128},       // 16.9-17.0 on 32 channels (ninth and tenth runs); LL-24 17.5
      {kBroadcast, 4 * kMiB, kLL128},       // 23.9; Simple 24.7, LL 29.7
      {kBroadcast, 16 * kMiB, kSimple},     // 61.1; LL128 62.9
      {kAllGather, 2 * kMiB, kLL},          // 14.0 on 32 channels; LL128 15.1
      {kAllGather, 4 * kMiB, kLL128},       // 20.9; Simple 26.0, LL 26.7
      {kReduceScatter, 2 * kMiB, kLL},      // 13.2 on 32 channels; LL128 17.4
      {kReduceScatter, 16 * kMiB, kSimple}, // 51.4; LL128 56.4
  });
  for (const Expected& e : expected) {
    Table table(algorithmsNcclOffers(e.collective, topology(2, 1)));
    int channels = 0;
    tuner.decide(e.collective, e.bytes, 1, 0, table.data(), kNumAlgorithms, kNumProtocols, &channels);
    EXPECT_EQ(table.choice(), std::make_pair(static_cast<int>(kRing), e.protocol))
        << collectiveName(e.collective) << " " << e.bytes << " bytes";
  }
}

// Ring LL inside an NVLink domain spreads over a channel per 2 KiB of wire bytes from 16 KiB on
// (NCCL caps the count at the channels it built): ring broadcasts ran 5.2 us on 8 channels at
// 16 KiB where NCCL's 2 took 5.7, and 5.5 on 24 at 64 KiB where NCCL's 8 took 6.0. Below 16 KiB,
// for the other protocols, for tree and across nodes, NCCL's count stands.
TEST(CostModel, NvlinkLlChannelsFollowTheWireBytesPerRank) {
  CostModel inside(topology(2, 1), nccl2289Latencies(1));
  EXPECT_EQ(inside.nvlinkLlChannels(kBroadcast, kRing, kLL, 8 << 10), 0);
  EXPECT_EQ(inside.nvlinkLlChannels(kBroadcast, kRing, kLL, 16 << 10), 8);
  EXPECT_EQ(inside.nvlinkLlChannels(kBroadcast, kRing, kLL, 64 << 10), 32);
  EXPECT_EQ(inside.nvlinkLlChannels(kAllGather, kRing, kLL, 16 << 10), 0) << "all-gather: half on the wire";
  EXPECT_EQ(inside.nvlinkLlChannels(kAllGather, kRing, kLL, 64 << 10), 16);
  EXPECT_EQ(inside.nvlinkLlChannels(kAllReduce, kRing, kLL, 16 << 10), 8);  // 2(n-1)/n = 1
  EXPECT_EQ(inside.nvlinkLlChannels(kAllReduce, kRing, kLL, size_t{1} << 30), 64) << "NCCL's MAXCHANNELS";
  EXPECT_EQ(inside.nvlinkLlChannels(kAllReduce, kRing, kLL128, 1 << 20), 0);
  EXPECT_EQ(inside.nvlinkLlChannels(kAllReduce, kRing, kSimple, 1 << 20), 0);
  EXPECT_EQ(inside.nvlinkLlChannels(kAllReduce, kTree, kLL, 1 << 20), 0);
  EXPECT_EQ(CostModel(topology(8, 2), nccl2289Latencies(2)).nvlinkLlChannels(kAllReduce, kRing, kLL, 1 << 20), 0)
      << "across nodes";
  for (int gpus : {4, 8}) {
    EXPECT_EQ(CostModel(topology(gpus, 1), nccl2289Latencies(1)).nvlinkLlChannels(kAllReduce, kRing, kLL, 1 << 20), 0)
        << gpus << " ranks: NCCL's per-channel threshold grows with them, not measured";
  }
  EXPECT_EQ(inside.channels(kBroadcast, kRing, kLL, 64 << 10), 32);
  Tuner tuner(1, inside, TunerSettings{});
  Table table(algorithmsNcclOffers(kBroadcast, topology(2, 1)));
  int channels = 0;
  tuner.decide(kBroadcast, 64 << 10, 1, 0, table.data(), kNumAlgorithms, kNumProtocols, &channels);
  EXPECT_EQ(table.choice(), std::make_pair(static_cast<int>(kRing), static_cast<int>(kLL)));
  EXPECT_EQ(channels, 32);
}

// Reduce-scatter's ring LL128 inside a node moves less than the other ops': at 4 MiB on two H200
// its LL won, where all-gather's and all-reduce's LL128 did (eighth run).
TEST(CostModel, ReduceScatterLl128MovesLessOnNvlinkRings) {
  for (double nvlinkGBps : {450.0, 478.0, 500.0}) {
    Topology t = topology(2, 1);
    t.nvlinkGBps = nvlinkGBps;
    CostModel model(t, nccl2289Latencies(1));
    const size_t bytes = size_t{4} << 20;
    EXPECT_LT(model.estimateUs(kReduceScatter, kRing, kLL, bytes), model.estimateUs(kReduceScatter, kRing, kLL128, bytes))
        << nvlinkGBps;
    EXPECT_LT(model.estimateUs(kAllGather, kRing, kLL128, bytes), model.estimateUs(kAllGather, kRing, kLL, bytes))
        << nvlinkGBps;
    EXPECT_LT(model.estimateUs(kAllReduce, kRing, kLL128, bytes), model.estimateUs(kAllReduce, kRing, kLL, bytes))
        << nvlinkGBps;
    EXPECT_LT(model.estimateUs(kAllReduce, kRing, kLL128, bytes), model.estimateUs(kAllReduce, kRing, kSimple, bytes))
        << nvlinkGBps;
  }
}

// LL128's NVLink corrections were measured on rings inside one node: they move nothing else.
TEST(CostModel, Ll128CorrectionsOnlyOnNvlinkRings) {
  ModelConstants without;
  without.nvlinkLl128BaseUs = 0;
  without.nvlinkLl128Efficiency = without.protocolEfficiency[kLL128];
  const ModelConstants with;
  const size_t bytes = size_t{4} << 20;
  CostModel inside(topology(2, 1), nccl2289Latencies(1), with), insideWithout(topology(2, 1), nccl2289Latencies(1), without);
  EXPECT_LT(inside.estimateUs(kAllReduce, kRing, kLL128, 8), insideWithout.estimateUs(kAllReduce, kRing, kLL128, 8));
  EXPECT_GT(inside.estimateUs(kAllReduce, kRing, kLL128, size_t{1} << 30),
            insideWithout.estimateUs(kAllReduce, kRing, kLL128, size_t{1} << 30));
  EXPECT_DOUBLE_EQ(inside.estimateUs(kAllReduce, kTree, kLL128, bytes), insideWithout.estimateUs(kAllReduce, kTree, kLL128, bytes));
  EXPECT_DOUBLE_EQ(inside.estimateUs(kAllReduce, kRing, kSimple, bytes), insideWithout.estimateUs(kAllReduce, kRing, kSimple, bytes));
  for (auto [gpus, nodes] : {std::pair{1, 2}, std::pair{8, 2}}) {
    CostModel across(topology(gpus, nodes), nccl2289Latencies(nodes), with);
    CostModel acrossWithout(topology(gpus, nodes), nccl2289Latencies(nodes), without);
    EXPECT_DOUBLE_EQ(across.estimateUs(kAllReduce, kRing, kLL128, bytes), acrossWithout.estimateUs(kAllReduce, kRing, kLL128, bytes))
        << gpus << "x" << nodes;
  }
  // Aggregated ops share the corrected base, which never goes below zero: with a correction larger
  // than NCCL's base, one op and 64 aggregated ones cost the same (no base left to share).
  ModelConstants beyond;
  beyond.nvlinkLl128BaseUs = -100;
  CostModel floored(topology(2, 1), nccl2289Latencies(1), beyond);
  EXPECT_GT(floored.estimateUs(kBroadcast, kRing, kLL128, 8, 1), 0);
  EXPECT_DOUBLE_EQ(floored.estimateUs(kBroadcast, kRing, kLL128, 8, 1), floored.estimateUs(kBroadcast, kRing, kLL128, 8, 64));
}

// Simple's later start is an NVLink measurement: it moves estimates inside a node only.
TEST(CostModel, SimpleStartsLaterOnlyInsideANode) {
  ModelConstants without;
  without.nvlinkSimpleStartUs = 0;
  const ModelConstants with;
  const size_t bytes = size_t{1} << 20;
  CostModel inside(topology(2, 1), nccl2289Latencies(1), with), insideWithout(topology(2, 1), nccl2289Latencies(1), without);
  EXPECT_NEAR(inside.estimateUs(kBroadcast, kRing, kSimple, bytes) - insideWithout.estimateUs(kBroadcast, kRing, kSimple, bytes),
              with.nvlinkSimpleStartUs, 1e-9);
  EXPECT_DOUBLE_EQ(inside.estimateUs(kBroadcast, kRing, kLL, bytes), insideWithout.estimateUs(kBroadcast, kRing, kLL, bytes));
  for (auto [gpus, nodes] : {std::pair{1, 2}, std::pair{8, 2}}) {
    CostModel across(topology(gpus, nodes), nccl2289Latencies(nodes), with);
    CostModel acrossWithout(topology(gpus, nodes), nccl2289Latencies(nodes), without);
    EXPECT_DOUBLE_EQ(across.estimateUs(kAllReduce, kRing, kSimple, bytes),
                     acrossWithout.estimateUs(kAllReduce, kRing, kSimple, bytes))
        << gpus << "x" << nodes;
  }
}

// Inside one NVLink node the ring carries bandwidth-bound all-reduces, as in NCCL's own model: a
// chain's interior ranks send twice what a ring's ranks send.
TEST(Tuner, RingCarriesBandwidthBoundAllReduceInsideANode) {
  for (int gpus : {4, 8}) {
    Tuner tuner(1, CostModel(topology(gpus, 1), nccl2289Latencies(1)), TunerSettings{});
    for (size_t bytes = size_t{256} << 10; bytes <= (size_t{1} << 30); bytes *= 8) {
      Table table({kTree, kRing});
      int channels = 0;
      tuner.decide(kAllReduce, bytes, 1, 0, table.data(), kNumAlgorithms, kNumProtocols, &channels);
      EXPECT_EQ(table.choice().first, kRing) << gpus << " GPUs, " << bytes << " bytes";
    }
  }
}

// With NCCL_DEBUG_SUBSYS=TUNING a run shows what the tuner chose: one INFO line per collective and
// power-of-two size range per communicator, not one per call.
TEST(Tuner, LogsEachSizeRangesChoiceOnce) {
  unifab::test::LogCapture log;
  Tuner tuner(7, CostModel(topology(2, 1), nccl2289Latencies(1)), TunerSettings{});
  for (size_t bytes : {size_t{4096}, size_t{4096}, size_t{5000}, size_t{8192}, size_t{2} << 20}) {
    Table table({kTree, kRing});
    int channels = 0;
    tuner.decide(kAllReduce, bytes, 1, 0, table.data(), kNumAlgorithms, kNumProtocols, &channels);
  }
  EXPECT_EQ(log.count(unifab::LogLevel::kInfo, "allreduce 4096 bytes (first call in [2^12, 2^13)) -> ring/ll by the model"), 1);
  EXPECT_EQ(log.count(unifab::LogLevel::kInfo, "allreduce 5000 bytes"), 0);
  EXPECT_EQ(log.count(unifab::LogLevel::kInfo, "allreduce 8192 bytes (first call in [2^13, 2^14))"), 1);
  EXPECT_EQ(log.count(unifab::LogLevel::kInfo, "allreduce 2097152 bytes (first call in [2^21, 2^22)) -> ring/ll"), 1);
  EXPECT_EQ(log.count(unifab::LogLevel::kInfo, "comm 0x7: allreduce"), 3);
}

TEST(Tuner, TreeWinsLatencyBoundAllReduceAcrossManyNodes) {
  Topology t = topology(8, 16);
  Tuner tuner(1, CostModel(t, ncclLikeLatencies()), TunerSettings{});
  Table table({kTree, kRing});
  int channels = 0;
  tuner.decide(kAllReduce, 4096, 1, 0, table.data(), kNumAlgorithms, kNumProtocols, &channels);
  EXPECT_EQ(table.choice().first, kTree) << "log-depth tree against a 256-hop ring";
}

TEST(Tuner, RuleForcesItsEntryAndChannels) {
  TunerSettings settings;
  Rule rule;
  rule.collective = kAllReduce;
  rule.minBytes = 1024;
  rule.maxBytes = 1 << 20;
  rule.algorithm = kTree;
  rule.protocol = kLL128;
  rule.channels = 6;
  rule.nNodes = 2;
  settings.rules.push_back(rule);
  Tuner tuner(1, CostModel(topology(1, 2), ncclLikeLatencies()), settings);
  Table table({kTree, kRing});
  int channels = 0;
  tuner.decide(kAllReduce, 4096, 1, 0, table.data(), kNumAlgorithms, kNumProtocols, &channels);
  EXPECT_EQ(table.choice(), std::make_pair(static_cast<int>(kTree), static_cast<int>(kLL128)));
  EXPECT_EQ(channels, 6);
  // Outside its size range the model decides and channels stay NCCL's.
  Table other({kTree, kRing});
  channels = 0;
  tuner.decide(kAllReduce, 8 << 20, 1, 0, other.data(), kNumAlgorithms, kNumProtocols, &channels);
  EXPECT_EQ(channels, 0);
  Tuner ruleless(1, CostModel(topology(1, 2), ncclLikeLatencies()), TunerSettings());
  Table modelOnly({kTree, kRing});
  ruleless.decide(kAllReduce, 8 << 20, 1, 0, modelOnly.data(), kNumAlgorithms, kNumProtocols, &channels);
  EXPECT_EQ(other.choice(), modelOnly.choice()) << "outside the rule's range the model alone decides";
}

TEST(Tuner, RuleNamingAnUnusableEntryFallsBackToTheModel) {
  TunerSettings settings;
  Rule rule;
  rule.collective = kAllReduce;
  rule.maxBytes = INT64_MAX;
  rule.algorithm = kRing;
  rule.protocol = kLL128;
  rule.channels = 3;
  settings.rules.push_back(rule);
  Tuner tuner(1, CostModel(topology(1, 2), ncclLikeLatencies()), settings);
  Table table({kTree, kRing});
  table.cell[kRing][kLL128] = kIgnore;
  int channels = 0;
  tuner.decide(kAllReduce, 4096, 1, 0, table.data(), kNumAlgorithms, kNumProtocols, &channels);
  EXPECT_EQ(table.cell[kRing][kLL128], kIgnore);
  EXPECT_EQ(channels, 0) << "the model's choice, not the rule's 3 channels";
}

// The one-rule files `unifab-bench tune-sweep --force tuner` writes per configuration.
TEST(Rules, ParsesTheSweepsForcingRule) {
  Rule rule;
  bool isRule = false;
  std::string error;
  ASSERT_TRUE(parseRuleLine("reducescatter,0,1024G,ring,ll128,32,-1,-1", &rule, &isRule, &error)) << error;
  EXPECT_TRUE(isRule);
  EXPECT_EQ(rule.collective, kReduceScatter);
  EXPECT_EQ(rule.maxBytes, int64_t{1024} << 30);
  EXPECT_EQ(rule.algorithm, kRing);
  EXPECT_EQ(rule.protocol, kLL128);
  EXPECT_EQ(rule.channels, 32);
  EXPECT_TRUE(rule.matches(kReduceScatter, size_t{1} << 30, 1, 2, 1, 0));
}

TEST(Rules, ParsesNcclExampleFormat) {
  Rule rule;
  bool isRule = false;
  std::string error;
  ASSERT_TRUE(parseRuleLine("allreduce,0,65536,tree,ll,4,1,-1", &rule, &isRule, &error)) << error;
  EXPECT_TRUE(isRule);
  EXPECT_EQ(rule.collective, kAllReduce);
  EXPECT_EQ(rule.maxBytes, 65536);
  EXPECT_EQ(rule.algorithm, kTree);
  EXPECT_EQ(rule.protocol, kLL);
  EXPECT_EQ(rule.channels, 4);
  EXPECT_EQ(rule.nNodes, 1);
  EXPECT_EQ(rule.nRanks, -1);
  ASSERT_TRUE(parseRuleLine(" AllGather , 1M , 1G , RING , Simple , -1 , -1 , 8 , 2 , 0  # comment", &rule, &isRule, &error))
      << error;
  EXPECT_EQ(rule.minBytes, 1 << 20);
  EXPECT_EQ(rule.maxBytes, int64_t{1} << 30);
  EXPECT_EQ(rule.numPipeOps, 2);
  EXPECT_EQ(rule.regBuff, 0);
  ASSERT_TRUE(parseRuleLine("   # only a comment", &rule, &isRule, &error));
  EXPECT_FALSE(isRule);
  ASSERT_TRUE(parseRuleLine("", &rule, &isRule, &error));
  EXPECT_FALSE(isRule);
}

TEST(Rules, RejectsMalformedLinesWithAReason) {
  const char* bad[] = {
      "allreduce,0,100,ring,simple,-1,-1",              // too few fields
      "allreduce,0,100,ring,simple,-1,-1,-1,1,0,9",     // too many
      "alltoall,0,100,ring,simple,-1,-1,-1",            // not a tuner collective
      "allreduce,200,100,ring,simple,-1,-1,-1",         // min > max
      "allreduce,x,100,ring,simple,-1,-1,-1",           // not a size
      "allreduce,0,100,butterfly,simple,-1,-1,-1",      // unknown algorithm
      "allreduce,0,100,ring,fast,-1,-1,-1",             // unknown protocol
      "allreduce,0,100,ring,simple,0,-1,-1",            // zero channels
      "allreduce,0,100,ring,simple,-1,-1,-1,1,2",       // regBuff beyond 0/1
  };
  for (const char* line : bad) {
    Rule rule;
    bool isRule = true;
    std::string error;
    EXPECT_FALSE(parseRuleLine(line, &rule, &isRule, &error)) << line;
    EXPECT_FALSE(error.empty()) << line;
  }
}

TEST(Rules, FileWithBadLinesWarnsAndKeepsTheGoodOnes) {
  unifab::test::LogCapture log;
  std::string path = ::testing::TempDir() + "/unifab_rules.conf";
  FILE* file = fopen(path.c_str(), "w");
  ASSERT_NE(file, nullptr);
  fputs("# rules\nallreduce,0,1024,tree,ll,-1,-1,-1\nnot,a,rule\n\nbroadcast,0,1G,ring,simple,2,-1,-1\n", file);
  fclose(file);
  std::vector<Rule> rules = loadRules(path);
  ASSERT_EQ(rules.size(), 2u);
  EXPECT_EQ(rules[0].line, 2);
  EXPECT_EQ(rules[1].line, 5);
  EXPECT_TRUE(log.warned(path + ":3:"));
  EXPECT_TRUE(loadRules(path + ".missing").empty());
  EXPECT_TRUE(log.warned("is not a readable regular file"));
}

// A directory or a file with no valid rule says so instead of leaving the model alone quietly;
// a line far longer than any rule stops the reading.
TEST(Rules, UnusableFilesWarn) {
  unifab::test::LogCapture log;
  EXPECT_TRUE(loadRules(::testing::TempDir()).empty());
  EXPECT_TRUE(log.warned("is not a readable regular file"));
  std::string path = ::testing::TempDir() + "/unifab_rules_none.conf";
  FILE* file = fopen(path.c_str(), "w");
  ASSERT_NE(file, nullptr);
  fputs("# only comments\nallreduce,0,1G,ring\n", file);
  fclose(file);
  EXPECT_TRUE(loadRules(path).empty());
  EXPECT_TRUE(log.warned("holds no valid rule"));
  file = fopen(path.c_str(), "w");
  ASSERT_NE(file, nullptr);
  fputs("allreduce,0,1G,ring,ll,-1,-1,-1\n", file);
  fputs((std::string(5000, 'x') + "\nbroadcast,0,1G,ring,ll,-1,-1,-1\n").c_str(), file);
  fclose(file);
  EXPECT_EQ(loadRules(path).size(), 1u);
  EXPECT_TRUE(log.warned("the rest of the file is ignored"));
}

// Channels beyond NCCL's 64 would wrap in NCCL's 8-bit field (256 becomes 0: a division by
// zero); NCCL's example files end their last range at 2^64 - 1, which means no limit.
TEST(Rules, ChannelsStayWithinNcclsAndHugeMaxBytesMeansNoLimit) {
  Rule rule;
  bool isRule = false;
  std::string error;
  EXPECT_FALSE(parseRuleLine("allreduce,0,1G,ring,simple,256,-1,-1", &rule, &isRule, &error));
  EXPECT_NE(error.find("1..64"), std::string::npos) << error;
  EXPECT_FALSE(parseRuleLine("allreduce,0,1G,ring,simple,65,-1,-1", &rule, &isRule, &error));
  ASSERT_TRUE(parseRuleLine("allreduce,0,1G,ring,simple,64,-1,-1", &rule, &isRule, &error)) << error;
  EXPECT_EQ(rule.channels, 64);
  ASSERT_TRUE(parseRuleLine("allreduce,1M,18446744073709551615,ring,simple,-1,-1,-1", &rule, &isRule, &error)) << error;
  EXPECT_EQ(rule.maxBytes, INT64_MAX);
  EXPECT_FALSE(parseRuleLine("allreduce,1M,99999999999999999999G,ring,simple,-1,-1,-1", &rule, &isRule, &error));
  // A leading zero is decimal: 016 ranks are sixteen, not fourteen.
  ASSERT_TRUE(parseRuleLine("allreduce,0,1G,ring,simple,-1,-1,016", &rule, &isRule, &error)) << error;
  EXPECT_EQ(rule.nRanks, 16);
}

TEST(Rules, MatchingHonoursEveryCondition) {
  Rule rule;
  rule.collective = kAllGather;
  rule.minBytes = 100;
  rule.maxBytes = 200;
  rule.nNodes = 2;
  rule.nRanks = 16;
  rule.numPipeOps = 1;
  rule.regBuff = 1;
  EXPECT_TRUE(rule.matches(kAllGather, 150, 2, 16, 1, 1));
  EXPECT_FALSE(rule.matches(kAllReduce, 150, 2, 16, 1, 1));
  EXPECT_FALSE(rule.matches(kAllGather, 99, 2, 16, 1, 1));
  EXPECT_FALSE(rule.matches(kAllGather, 201, 2, 16, 1, 1));
  EXPECT_FALSE(rule.matches(kAllGather, 150, 1, 16, 1, 1));
  EXPECT_FALSE(rule.matches(kAllGather, 150, 2, 8, 1, 1));
  EXPECT_FALSE(rule.matches(kAllGather, 150, 2, 16, 2, 1));
  EXPECT_FALSE(rule.matches(kAllGather, 150, 2, 16, 1, 0));
}

}  // namespace

// The EP SM budget and its split between NVLink and local work, as measured best on 2 x H200
// (docs/benchmarks/ep-ht.md): 24 SMs for two ranks; 8 of them write remote dispatch rows, 9 send
// combine partials.
TEST(EpPolicy, TwoRankH200SplitsAsMeasured) {
  unifab::tuner::EpSmQuery query;
  query.nRanks = 2;
  query.deviceSms = 132;
  query.nvlinkGBps = 450;
  EXPECT_EQ(unifab::tuner::epHighThroughputSms(query), 24);
  using unifab::tuner::EpOp;
  EXPECT_EQ(unifab::tuner::epRemoteBlocks(EpOp::kDispatch, 2, 24), 8);
  EXPECT_EQ(unifab::tuner::epRemoteBlocks(EpOp::kCombine, 2, 24), 9);
  EXPECT_EQ(unifab::tuner::epRemoteBlocks(EpOp::kCombine, 2, 12), 6);
}

TEST(EpPolicy, EveryBlockCountLeavesWorkForBothRoles) {
  using unifab::tuner::EpOp;
  for (EpOp op : {EpOp::kDispatch, EpOp::kCombine}) {
    EXPECT_EQ(unifab::tuner::epRemoteBlocks(op, 1, 24), 0);  // one rank: every row is local
    EXPECT_EQ(unifab::tuner::epRemoteBlocks(op, 2, 1), 1);   // one block does both
    for (int ranks : {2, 4, 8, 64}) {
      for (int blocks = 2; blocks <= 132; ++blocks) {
        const int remote = unifab::tuner::epRemoteBlocks(op, ranks, blocks);
        EXPECT_GE(remote, 1) << ranks << " ranks, " << blocks << " blocks";
        EXPECT_LE(remote, blocks - 1) << ranks << " ranks, " << blocks << " blocks";
      }
    }
  }
}

// Low latency: one warp per message part while the SMs last (128 tokens x 7 parts on 16-warp
// blocks: 56 blocks), never more blocks than SMs, never none.
TEST(EpPolicy, LowLatencyBlocksGiveEveryPartAWarp) {
  EXPECT_EQ(unifab::tuner::epLowLatencyBlocks(128 * 7, 16, 132), 56);
  EXPECT_EQ(unifab::tuner::epLowLatencyBlocks(2 * 1024 * 7, 16, 132), 132);
  EXPECT_EQ(unifab::tuner::epLowLatencyBlocks(0, 16, 132), 1);
  EXPECT_EQ(unifab::tuner::epLowLatencyBlocks(1, 16, 132), 1);
  EXPECT_EQ(unifab::tuner::epLowLatencyBlocks(17, 16, 132), 2);
}
