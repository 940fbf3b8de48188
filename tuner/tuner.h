// The tuner proper: per communicator, decide each collective's algorithm and protocol by writing
// NCCL's cost table. A matching rule (UNIFAB_TUNER_CONFIG) forces its entry; otherwise the cost
// model's estimates replace NCCL's for every usable entry, provided the model covers them all.
// Whenever the tuner is unsure it leaves the table as NCCL filled it.
#pragma once

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
  // never touched. `*channels` is written only by a rule that names a channel count.
  void decide(int collective, size_t bytes, int numPipeOps, int regBuff, float* table, int numAlgorithms,
              int numProtocols, int* channels) const;

  const CostModel& model() const { return model_; }

 private:
  bool applyRule(int collective, size_t bytes, int numPipeOps, int regBuff, float* table, int numAlgorithms,
                 int numProtocols, int* channels) const;
  bool applyModel(int collective, size_t bytes, int numPipeOps, float* table, int numAlgorithms,
                  int numProtocols) const;

  uint64_t commId_;
  CostModel model_;
  TunerSettings settings_;
};

}  // namespace unifab::tuner
