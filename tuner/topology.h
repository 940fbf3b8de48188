// What the cost model knows about a communicator's machine: ranks, nodes, and the bandwidth of
// the two kinds of link a collective crosses. Filled from NCCL's tuner init arguments, NVML
// (NVLink count and generation), the net plugin's reported port speed and UNIFAB_TUNER_*
// overrides; a value that cannot be known stays 0 and makes the model decline.
#pragma once

#include <string>

namespace unifab::tuner {

struct Topology {
  int nRanks = 0;
  int nNodes = 0;
  int ranksPerNode = 0;     // largest NVLink domain; ranks of one node share NVLink
  double nvlinkGBps = 0;    // per GPU and direction; 0 = unknown
  double netGBps = 0;       // per rank and direction; 0 = unknown
  bool networkHostMoved = false;  // the net transport moves every message through host threads
                                  // (unifab's sockets): each channel costs host time per message
  int computeCapability = 0;  // major*10+minor of the local GPU; 0 = unknown

  std::string describe() const;
};

struct NvlinkInfo {
  int activeLinks = 0;
  double perLinkGBps = 0;
  int computeCapability = 0;
};

// NVLink of GPU 0 as NVML reports it (GPUs of a node are alike); false without NVML or GPU.
bool detectNvlink(NvlinkInfo* info);

// Active NVLinks of the GPU at `pciBusId` (as cudaDeviceGetPCIBusId writes it); -1 without NVML
// or without that GPU.
int activeNvlinks(const char* pciBusId);

// What the cost models use for this node's GPUs: NVLink bandwidth per GPU and direction
// (UNIFAB_TUNER_NVLINK_GBPS when set, else active links x per-link rate) and the compute
// capability; 0 where unknown. NVML is asked once per process.
struct LocalGpu {
  double nvlinkGBps = 0;
  int computeCapability = 0;
};
LocalGpu localGpu();

// Per-link bandwidth per direction for a GPU generation, from NVLink's published rates.
double nvlinkPerLinkGBps(int computeCapability);

}  // namespace unifab::tuner
