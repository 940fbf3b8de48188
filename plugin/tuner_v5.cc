// ncclTunerPlugin_v5: NCCL's tuner table, adapted onto tuner::Tuner. Gathers what the model
// needs from NCCL's init arguments, NVML, the net transport and the UNIFAB_TUNER_* parameters.
#include <cinttypes>
#include <memory>

#include "net/transport.h"
#include "plugin/boundary.h"
#include "plugin/params.h"
#include "tuner/tuner.h"
#include "unifab/nccl/tuner_v5.h"

namespace unifab {
namespace {

static_assert(NCCL_ALGO_RING == tuner::kRing && NCCL_ALGO_TREE == tuner::kTree && NCCL_ALGO_PAT == tuner::kPat,
              "algorithm indices must match NCCL's");
static_assert(NCCL_PROTO_LL == tuner::kLL && NCCL_PROTO_LL128 == tuner::kLL128 && NCCL_PROTO_SIMPLE == tuner::kSimple,
              "protocol indices must match NCCL's");
static_assert(NCCL_HW_NVLINK == tuner::kLinkNvlink && NCCL_HW_NET == tuner::kLinkNet, "link indices must match");
// The adapter walks NCCL's cost table and latency arrays with the tuner's bounds.
static_assert(NCCL_NUM_ALGORITHMS_V5 == tuner::kNumAlgorithms && NCCL_NUM_PROTOCOLS_V5 == tuner::kNumProtocols &&
                  NCCL_NUM_HW_LINKS_V5 == tuner::kNumLinks,
              "array bounds must match NCCL's");
static_assert(static_cast<int>(ncclFuncAllReduce) == tuner::kAllReduce && static_cast<int>(ncclFuncBroadcast) == tuner::kBroadcast &&
                  static_cast<int>(ncclFuncAllGather) == tuner::kAllGather,
              "collective indices must match NCCL's");

int compcapIndex(int computeCapability) {
  if (computeCapability >= 100) return 3;
  if (computeCapability >= 90) return 2;
  if (computeCapability >= 80) return 1;
  if (computeCapability >= 70) return 0;
  return -1;
}

int scaleIndex(int nNodes) { return nNodes <= 1 ? 0 : nNodes == 2 ? 1 : 2; }

tuner::Topology buildTopology(size_t nRanks, size_t nNodes, const ncclNvlDomainInfo_v5_t* nvl) {
  const Params& p = params();
  tuner::Topology topo;
  topo.nRanks = static_cast<int>(nRanks);
  topo.nNodes = static_cast<int>(nNodes);
  topo.ranksPerNode = nvl != nullptr && nvl->maxRanksPerNvlDomain > 0
                          ? nvl->maxRanksPerNvlDomain
                          : static_cast<int>(nNodes > 0 ? (nRanks + nNodes - 1) / nNodes : nRanks);
  const tuner::LocalGpu gpu = tuner::localGpu();
  topo.computeCapability = gpu.computeCapability;
  topo.nvlinkGBps = gpu.nvlinkGBps;
  const net::LiveTransport live = net::liveTransport();
  if (p.tunerNetGbps > 0) {
    topo.netGBps = p.tunerNetGbps;
  } else if (live.speedMbps > 0) {
    topo.netGBps = live.speedMbps / 8000.0;
  }
  topo.networkHostMoved = live.hostMovesPayload;
  return topo;
}

ncclResult_t tunerInit(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction,
                       ncclNvlDomainInfo_v5_t* nvlDomainInfo, ncclTunerConstants_v5_t* constants) {
  if (logFunction != nullptr) logSetNcclLogger(reinterpret_cast<NcclLogFunction>(logFunction));
  return toNccl(guarded(LogComponent::kTuner, "tuner init", [&] {
    if (ctx == nullptr) return UF_ERROR(unifabInvalidArgument, kTuner, "init: ctx=NULL");
    *ctx = nullptr;
    const Params& p = params();
    tuner::Topology topo = buildTopology(nRanks, nNodes, nvlDomainInfo);
    tuner::LatencyConstants latency;
    if (constants != nullptr) {
      for (int a = 0; a < tuner::kNumAlgorithms; ++a) {
        for (int pr = 0; pr < tuner::kNumProtocols; ++pr) {
          latency.base[a][pr] = constants->baseLatencies[a][pr];
          for (int link = 0; link < tuner::kNumLinks; ++link) latency.hop[link][a][pr] = constants->hwLatencies[link][a][pr];
        }
      }
      int cc = compcapIndex(topo.computeCapability);
      if (cc >= 0) latency.llMaxGBps = constants->llMaxBws[cc][scaleIndex(topo.nNodes)];
    }
    tuner::TunerSettings settings;
    settings.enabled = p.tunerEnable;
    if (!p.tunerConfig.empty()) settings.rules = tuner::loadRules(p.tunerConfig);
    auto created = std::make_unique<tuner::Tuner>(commId, tuner::CostModel(topo, latency), std::move(settings));
    UF_INFO(kTuner, kLogInit, "comm 0x%" PRIx64 ": %s; cost model %s%s", commId, topo.describe().c_str(),
            !p.tunerEnable ? "disabled (UNIFAB_TUNER_ENABLE=0)"
            : created->model().usable() ? "active"
                                        : "inactive (link bandwidth unknown; set UNIFAB_TUNER_NVLINK_GBPS/NET_GBPS)",
            p.tunerConfig.empty() ? "" : ", rules from UNIFAB_TUNER_CONFIG");
    *ctx = created.release();
    return unifabSuccess;
  }));
}

ncclResult_t tunerGetCollInfo(void* ctx, ncclFunc_t collType, size_t nBytes, int numPipeOps, float** collCostTable,
                              int numAlgo, int numProto, int regBuff, int* nChannels) {
  // NCCL treats an error here as fatal for the collective: whatever happens, answer success and
  // at worst leave the table as NCCL filled it.
  guarded(LogComponent::kTuner, "getCollInfo", [&] {
    if (ctx == nullptr || collCostTable == nullptr) return unifabSuccess;
    static_cast<const tuner::Tuner*>(ctx)->decide(static_cast<int>(collType), nBytes, numPipeOps, regBuff,
                                                  reinterpret_cast<float*>(collCostTable), numAlgo, numProto,
                                                  nChannels);
    return unifabSuccess;
  });
  return ncclSuccess;
}

ncclResult_t tunerFinalize(void* ctx) {
  delete static_cast<tuner::Tuner*>(ctx);
  return ncclSuccess;
}

}  // namespace
}  // namespace unifab

extern "C" {
extern UNIFAB_API const ncclTuner_v5_t ncclTunerPlugin_v5;

const ncclTuner_v5_t ncclTunerPlugin_v5 = {
    "unifab",
    unifab::tunerInit,
    unifab::tunerGetCollInfo,
    unifab::tunerFinalize,
};
}
