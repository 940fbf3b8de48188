// The tuner proper: per communicator, decide each collective's algorithm and protocol by writing
// NCCL's cost table. A matching rule (UNIFAB_TUNER_CONFIG) forces its entry; otherwise the cost
// model's estimates replace NCCL's for every usable entry, provided the model covers them all.
// Whenever the tuner is unsure it leaves the table as NCCL filled it.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "tuner/cost_model.h"
#include "tuner/rules.h"

namespace unifab::tuner {

struct TunerSettings {
  bool enabled = true;
  std::vector<Rule> rules;
};

class Tuner {
 public:
  Tuner(uint64_t commId, const CostModel& model, TunerSettings settings);

  // `table` is NCCL's float[numAlgorithms][numProtocols]; negative entries are unusable and are
  // never touched. `*channels` is written by a rule that names a channel count, and by the model
  // where the chosen pattern crosses unifab's sockets or is a ring LL between the two ranks of an
  // NVLink domain (CostModel::channels).
  void decide(int collective, size_t bytes, int numPipeOps, int regBuff, float* table, int numAlgorithms,
              int numProtocols, int* channels) const;

  const CostModel& model() const { return model_; }

 private:
  bool applyRule(int collective, size_t bytes, int numPipeOps, int regBuff, float* table, int numAlgorithms,
                 int numProtocols, int* channels) const;
  bool applyModel(int collective, size_t bytes, int numPipeOps, float* table, int numAlgorithms,
                  int numProtocols) const;
  // Index of the cheapest usable entry of `table`, or -1.
  static int bestEntry(const float* table, int numAlgorithms, int numProtocols);
  // INFO (NCCL_DEBUG_SUBSYS=TUNING): the entry the table now favours (`best`, from bestEntry), once
  // per collective and power-of-two size range per communicator, so that a run shows what was
  // chosen without a line per call.
  void logChoice(int collective, size_t bytes, int best, int numProtocols, const char* by, int channels) const;

  uint64_t commId_;
  CostModel model_;
  TunerSettings settings_;
  mutable std::array<std::atomic<uint64_t>, kNumCollectives> loggedSizes_{};  // bit k: a size in [2^k, 2^(k+1))
};

}  // namespace unifab::tuner
