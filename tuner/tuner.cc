#include "tuner/tuner.h"

#include <algorithm>
#include <cfloat>
#include <cinttypes>
#include <string>

#include "plugin/log.h"

namespace unifab::tuner {

Tuner::Tuner(uint64_t commId, const CostModel& model, TunerSettings settings)
    : commId_(commId), model_(model), settings_(std::move(settings)) {}

void Tuner::decide(int collective, size_t bytes, int numPipeOps, int regBuff, float* table, int numAlgorithms,
                   int numProtocols, int* channels) const {
  if (!settings_.enabled || table == nullptr || collective < 0 || collective >= kNumCollectives) return;
  if (applyRule(collective, bytes, numPipeOps, regBuff, table, numAlgorithms, numProtocols, channels)) {
    logChoice(collective, bytes, bestEntry(table, numAlgorithms, numProtocols), numProtocols, "a rule",
              channels != nullptr ? *channels : 0);
    return;
  }
  const bool modelled = applyModel(collective, bytes, numPipeOps, table, numAlgorithms, numProtocols);
  int modelChannels = 0;
  const int best = bestEntry(table, numAlgorithms, numProtocols);
  if (modelled && best >= 0 && channels != nullptr) {
    modelChannels = model_.channels(collective, best / numProtocols, best % numProtocols, bytes);
    if (modelChannels > 0) *channels = modelChannels;
  }
  logChoice(collective, bytes, best, numProtocols, modelled ? "the model" : "NCCL's table", modelChannels);
}

int Tuner::bestEntry(const float* table, int numAlgorithms, int numProtocols) {
  int best = -1;
  for (int i = 0; i < numAlgorithms * numProtocols; ++i) {
    if (table[i] >= 0 && (best < 0 || table[i] < table[best])) best = i;
  }
  return best;
}

void Tuner::logChoice(int collective, size_t bytes, int best, int numProtocols, const char* by, int channels) const {
  if (best < 0) return;
  int range = 0;
  while (range < 63 && (bytes >> (range + 1)) != 0) ++range;
  const uint64_t bit = uint64_t{1} << range;
  if ((loggedSizes_[collective].fetch_or(bit, std::memory_order_relaxed) & bit) != 0) return;
  UF_INFO(kTuner, kLogTuning, "comm 0x%" PRIx64 ": %s %zu bytes (first call in [2^%d, 2^%d)) -> %s/%s by %s, %s", commId_,
          collectiveName(collective), bytes, range, range + 1, algorithmName(best / numProtocols),
          protocolName(best % numProtocols), by,
          channels > 0 ? ("channels " + std::to_string(channels)).c_str() : "channels NCCL's");
}

bool Tuner::applyRule(int collective, size_t bytes, int numPipeOps, int regBuff, float* table, int numAlgorithms,
                      int numProtocols, int* channels) const {
  const Topology& topo = model_.topology();
  for (const Rule& rule : settings_.rules) {
    if (!rule.matches(collective, bytes, topo.nNodes, topo.nRanks, numPipeOps, regBuff)) continue;
    if (rule.algorithm >= numAlgorithms || rule.protocol >= numProtocols ||
        table[rule.algorithm * numProtocols + rule.protocol] < 0) {
      // NCCL ruled this combination out for this call; enabling it could crash or corrupt.
      UF_TRACE(kTuner, kLogTuning, "comm 0x%" PRIx64 ": rule at line %d names %s/%s, unusable here", commId_,
               rule.line, algorithmName(rule.algorithm), protocolName(rule.protocol));
      continue;
    }
    table[rule.algorithm * numProtocols + rule.protocol] = 0.0f;
    if (rule.channels > 0 && channels != nullptr) *channels = rule.channels;  // 1..kNcclMaxChannels (rules.cc)
    UF_TRACE(kTuner, kLogTuning, "comm 0x%" PRIx64 ": %s %zu bytes -> %s/%s by rule at line %d", commId_,
             collectiveName(collective), bytes, algorithmName(rule.algorithm), protocolName(rule.protocol), rule.line);
    return true;
  }
  return false;
}

bool Tuner::applyModel(int collective, size_t bytes, int numPipeOps, float* table, int numAlgorithms,
                       int numProtocols) const {
  if (!model_.usable()) return false;
  float estimates[kNumAlgorithms * kNumProtocols];
  int algorithms = numAlgorithms < kNumAlgorithms ? numAlgorithms : kNumAlgorithms;
  int protocols = numProtocols < kNumProtocols ? numProtocols : kNumProtocols;
  bool anyUsable = false;
  for (int a = 0; a < algorithms; ++a) {
    for (int p = 0; p < protocols; ++p) {
      if (table[a * numProtocols + p] < 0) continue;
      // A usable entry the model cannot describe (negative estimate): its estimate and NCCL's
      // would not be comparable, so NCCL's table stays as it is.
      double us = model_.estimateUs(collective, a, p, bytes, numPipeOps);
      if (!(us >= 0)) return false;
      // Bandwidths set absurdly low would overflow a float: the largest one still orders.
      estimates[a * kNumProtocols + p] = static_cast<float>(std::min(us, static_cast<double>(FLT_MAX)));
      anyUsable = true;
    }
  }
  // Entries beyond the model's index range would keep NCCL's values: decline instead.
  for (int a = 0; a < numAlgorithms; ++a) {
    for (int p = 0; p < numProtocols; ++p) {
      if ((a >= algorithms || p >= protocols) && table[a * numProtocols + p] >= 0) return false;
    }
  }
  if (!anyUsable) return false;
  for (int a = 0; a < algorithms; ++a) {
    for (int p = 0; p < protocols; ++p) {
      if (table[a * numProtocols + p] >= 0) table[a * numProtocols + p] = estimates[a * kNumProtocols + p];
    }
  }
  return true;
}

}  // namespace unifab::tuner
