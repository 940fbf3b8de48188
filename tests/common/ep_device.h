// GPU side of the expert-parallel tests: expert outputs generated in place from the dispatch's
// own row metadata (so a captured graph can hold dispatch, "experts" and combine).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "tests/common/check_tally.h"
#include "tests/common/ep_reference.h"
#include "unifab/unifab.h"

namespace unifab::test::ep {

// Device copies of one rank's input, sized for a shape's maxTokens.
class DeviceInput {
 public:
  DeviceInput() = default;
  ~DeviceInput();
  DeviceInput(const DeviceInput&) = delete;
  DeviceInput& operator=(const DeviceInput&) = delete;

  bool allocate(const Shape& shape);
  // Copies `in` (expert ids as int32 when int32Ids) and waits for the copies.
  bool upload(const RankInput& in, bool int32Ids, cudaStream_t stream);

  void* x = nullptr;
  float* scales = nullptr;
  void* topk = nullptr;
  float* weights = nullptr;

 private:
  std::vector<int32_t> ids32_;
};

// Row p of `out` (hidden BF16 values) gets expertOutputBits(seed, rank, source of p, expert of p);
// expert-major padding rows get NaN, which combine must never read.
cudaError_t fillExpertOutputs(uint16_t* out, int hidden, const int* source, const int* numRows, bool expertMajor,
                              const int* expertOffsets, const int* rowsPerExpert, int localExperts, int rank,
                              uint64_t seed, int maxRows, cudaStream_t stream);

// Low-latency layout: row p = e * stride + i of `out` gets expertOutputBits(seed, rank, source of p,
// e, .) for i < recvCount[e], NaN past it.
cudaError_t fillLowLatencyExpertOutputs(uint16_t* out, int hidden, const int* source, const int* recvCount, int stride,
                                        int localExperts, int rank, uint64_t seed, cudaStream_t stream);

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
