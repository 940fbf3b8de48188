// GPU side of the expert-parallel tests: expert outputs generated in place from the dispatch's
// own row metadata (so a captured graph can hold dispatch, "experts" and combine).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "tests/common/ep_reference.h"
#include "unifab/unifab.h"

namespace unifab::test::ep {

// Row p of `out` (hidden BF16 values) gets expertOutputBits(seed, rank, source of p, expert of p);
// expert-major padding rows get NaN, which combine must never read.
cudaError_t fillExpertOutputs(uint16_t* out, int hidden, const int* source, const int* numRows, bool expertMajor,
                              const int* expertOffsets, const int* rowsPerExpert, int localExperts, int rank,
                              uint64_t seed, int maxRows, cudaStream_t stream);

// The group configuration a test or benchmark shape asks for (mode and SM cap at their defaults).
inline unifabEpConfig_t groupConfig(const Shape& shape) {
  unifabEpConfig_t config = UNIFAB_EP_CONFIG_INIT;
  config.numExperts = shape.numExperts;
  config.maxTokensPerRank = shape.maxTokens;
  config.hidden = shape.hidden;
  config.topk = shape.topk;
  return config;
}

}  // namespace unifab::test::ep
