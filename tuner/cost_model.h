// An alpha-beta cost model of NCCL's collective algorithms and protocols:
//   time = alpha(algorithm, protocol, topology) + bytes * busFactor(collective, algorithm, ranks)
//                                                 / bandwidth(link, protocol, algorithm).
// alpha takes NCCL's own per-algorithm base and per-hop link latencies (passed to the tuner at
// init), counting the hops a pattern makes inside a node (NVLink) and across nodes (network);
// bandwidth is the slowest link the pattern crosses, derated by the protocol's payload fraction
// and the algorithm's pipelining efficiency. The model covers what it can reason about (Ring and
// Tree all-reduce, Ring and PAT all-gather/reduce-scatter, Ring broadcast/reduce) and declines
// the rest, so the tuner never mixes its estimates with NCCL's.
#pragma once

#include <cstddef>

#include "tuner/topology.h"

namespace unifab::tuner {

// Indices as NCCL's tuner interface numbers them.
enum Collective : int { kBroadcast = 0, kReduce = 1, kAllGather = 2, kReduceScatter = 3, kAllReduce = 4, kNumCollectives = 5 };
enum Algorithm : int { kTree = 0, kRing = 1, kCollnetDirect = 2, kCollnetChain = 3, kNvls = 4, kNvlsTree = 5, kPat = 6, kNumAlgorithms = 7 };
enum Protocol : int { kLL = 0, kLL128 = 1, kSimple = 2, kNumProtocols = 3 };
enum Link : int { kLinkNvlink = 0, kLinkPci = 1, kLinkNet = 2, kNumLinks = 3 };

// NCCL's MAXCHANNELS: no collective runs on more, and NCCL keeps a collective's channel count in
// a signed 8-bit field, so a larger count from a tuner would wrap (256 to 0: a division by zero).
constexpr int kNcclMaxChannels = 64;

const char* collectiveName(int collective);
const char* algorithmName(int algorithm);
const char* protocolName(int protocol);

// NCCL's latency constants in microseconds (ncclTunerConstants: baseLatencies, hwLatencies).
struct LatencyConstants {
  double base[kNumAlgorithms][kNumProtocols] = {};
  double hop[kNumLinks][kNumAlgorithms][kNumProtocols] = {};
  double llMaxGBps = 0;  // NCCL's cap on LL bandwidth for this GPU generation and scale, applied
                         // only to patterns that cross the network; 0 = none
};

// Documented efficiency constants (docs/tuner.md). They are the same on every machine today;
// the constructor takes them so that calibration against measurements (issue 6) can replace them.
struct ModelConstants {
  double protocolEfficiency[kNumProtocols] = {0.5, 120.0 / 128.0, 1.0};  // payload per byte on the wire
  double linkEfficiency = 0.8;       // achievable fraction of nominal link bandwidth
  double treeEfficiency = 0.9;       // tree pipelines up and down the same links
  double patEfficiency = 0.85;       // PAT's log-step exchange of growing blocks
  // Simple starts later than NCCL's latency constants say, relative to LL, where a pattern stays
  // on NVLink: fits of the graph-timed 2 x H200 sweep (docs/benchmarks/tuner.md, sixth run) give
  // Simple's start minus LL's as 3.3 us (broadcast), 6.1 (all-gather) and 5.7 (all-reduce) more
  // than the constants; with 3 us added the model's LL/Simple crossovers land within 5 % of the
  // fitted ones for all three (2.7 against 2.6 MB, 5.5 against 5.6, 3.7 against 3.9), while
  // all-gather's and all-reduce's larger excess is LL's slower two-way rate, which the model's
  // single link rate leaves out. Without it broadcast 2 MiB ran Simple, 8.8 % behind LL.
  double nvlinkSimpleStartUs = 3.0;
  // LL128 on NVLink starts earlier and moves less than NCCL's constants and its 120/128 payload
  // fraction say. Fits of the x4 graph-timed 2 x H200 sweep (docs/benchmarks/tuner.md, eighth run;
  // 24 channels, 4 and 16 MiB) put LL128's start at 10.5-12.8 us for one- and two-step rings, where
  // NCCL's base and hop latencies give 15.9-17.8, and its rate per wire byte at 0.83-0.93 of
  // Simple's in all four ops. Without them the model never chose LL128, and NCCL's LL or Simple ran
  // 9 % (all-reduce) and 28 % (all-gather) behind Ring-LL128-24 at 4 MiB. The start correction
  // shifts NCCL's base latency, so aggregated ops share it like the rest of the base.
  double nvlinkLl128BaseUs = -5.0;
  double nvlinkLl128Efficiency = 0.85;
  // Reduce-scatter's LL128 on those rings moves less again: at 4 MiB on 24 channels it ran 23.6 us
  // where all-gather's ran 20.9 (1.13x: 0.85 / 1.13 = 0.75), and lost to LL (22.2, 6 % ahead)
  // while all-gather's LL lost to LL128 by 28 % (eighth run). At 0.75 the model's two estimates tie;
  // 0.70 keeps LL ahead at 4 MiB for NVLink rates of 450-500 GB/s (H200: 18 x 26.6), with
  // all-gather, all-reduce (whose ring LL128 won at 4 MiB) and broadcast on LL128 as before.
  double nvlinkLl128ReduceScatterEfficiency = 0.70;
  // LL inside an NVLink domain of two ranks: NCCL gives LL one channel per ~8 KiB of nBytes there
  // (2 channels at 16 KiB, 8 at 64 KiB), where the sweep's ring broadcasts ran 0.5 us faster on 8
  // channels at 16 KiB and on 24 at 64 KiB (5.2 against 5.7 us, 5.5 against 6.0). From
  // nvlinkLlSpreadBytes of wire bytes per rank the model asks for a channel per
  // nvlinkLlBytesPerChannel; NCCL caps the count at the channels it built. Below, NCCL's count
  // stands (one or two channels, as fast). With more ranks NCCL's per-channel threshold grows and
  // a ring step carries nBytes / nRanks: not measured, so NCCL's count stands there.
  double nvlinkLlBytesPerChannel = 2.0 * 1024;
  double nvlinkLlSpreadBytes = 16.0 * 1024;
  // Over unifab's sockets each channel is a connection of its own, with per-message costs in
  // NCCL's proxy and the transport: a channel earns its place once it carries this much of a
  // rank's wire bytes. Measured (docs/benchmarks/tuner.md, fifth run): 2 channels beat 8 by up to
  // 2x from 32 KiB to 2 MiB per rank, 8 beat 2 from 16 MiB.
  double netBytesPerChannel = 2.0 * 1024 * 1024;
  int minNetChannels = 2;            // the fewest measured fastest from 32 KiB to 2 MiB
  // Below this many wire bytes per ring step (a rank's wire bytes over the pattern's sequential
  // hops: the message each step hands on) an operation is latency-bound and one connection carries
  // it: a second adds its own messages. Measured: 4 KiB all-reduce 40 us on one channel, 50 on two
  // (fifth run); 32 KiB one channel 60 us against two's 79 (all-reduce) and 37 against 47
  // (all-gather) in the seventh run; all-reduce 128 KiB (two steps of 64 KiB on two nodes) 112.9
  // against 123.8 in the tenth; two as fast or faster from 128 KiB per step (all-gather 256 KiB, one
  // step of 128 KiB: 90 against 99; all-reduce 512 KiB, steps of 256 KiB: 236.6 against 259.5-312.9).
  double netOneChannelStepBytes = 128.0 * 1024;
  // LL's rate per payload byte, as a fraction of Simple's, where a pattern crosses a network whose
  // transport moves every message through host threads: LL's small slices each pay the proxy's and
  // the transport's per-message costs, so it moves far less than half of Simple's bytes. Fitted on
  // unifab's sockets, all-reduce over 2 nodes between 32 and 128-256 KiB (docs/benchmarks/tuner.md):
  // 0.31 (one channel) and 0.34 (two) in the ninth run, 0.35 (two) in the fifth; with NCCL's 0.5
  // the model kept LL at 128 KiB, 21.5 % behind Simple on one channel.
  double hostMovedNetLlRate = 0.33;
};

class CostModel {
 public:
  CostModel(const Topology& topology, const LatencyConstants& latency, const ModelConstants& constants = {});

  // True if the model knows the bandwidth of every link this communicator crosses.
  bool usable() const;
  // Estimated microseconds for `bytes` (NCCL's nBytes for this collective), or < 0 if not covered.
  double estimateUs(int collective, int algorithm, int protocol, size_t bytes, int numPipeOps = 1) const;
  // Channels for a pattern that crosses a network whose transport moves every message through
  // host threads (Topology::networkHostMoved: unifab's sockets, where it was measured): one per
  // netBytesPerChannel of the busiest rank's wire bytes, at least minNetChannels, one where a ring
  // step carries less than netOneChannelStepBytes (a ring's; a chain's floor stays two). It replaces NCCL's own count (at most 64; NCCL caps ring and tree at the channels it built).
  // 0, keeping NCCL's count, inside one node, over any other transport (not measured), and for
  // patterns the model does not cover.
  int networkChannels(int collective, int algorithm, size_t bytes) const;
  // Channels for a ring LL pattern between two ranks of one NVLink domain: one per
  // nvlinkLlBytesPerChannel of the busiest rank's wire bytes from nvlinkLlSpreadBytes on; 0
  // (NCCL's count) below, for other protocols and algorithms, for more ranks and across nodes.
  int nvlinkLlChannels(int collective, int algorithm, int protocol, size_t bytes) const;
  // The channel count the tuner hands NCCL for the chosen entry: networkChannels where it applies,
  // else nvlinkLlChannels; 0 keeps NCCL's.
  int channels(int collective, int algorithm, int protocol, size_t bytes) const;

  const Topology& topology() const { return topology_; }

 private:
  struct Pattern {
    double busFactor;  // bytes crossing the bottleneck link per byte of nBytes
    double intraHops;  // sequential NVLink hops
    double interHops;  // sequential network hops
    double efficiency; // algorithm's pipelining efficiency
  };
  bool pattern(int collective, int algorithm, Pattern* out) const;
  double bottleneckGBps() const;
  // A channel per `bytesPerChannel` of `wireBytes`, at least `fewest`, at most NCCL's most.
  static int channelsFor(double wireBytes, double bytesPerChannel, double fewest);

  Topology topology_;
  LatencyConstants latency_;
  ModelConstants constants_;
};

}  // namespace unifab::tuner
