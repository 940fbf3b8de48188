// CPU reference of expert-parallel dispatch and combine, and the deterministic inputs both sides
// use: every rank can generate every rank's tokens from (seed, rank), so each rank computes what
// it must receive and what combine must return without any communication.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace unifab::test::ep {

struct Shape {
  int nRanks = 1;
  int numExperts = 0;
  int hidden = 0;
  int topk = 0;
  int maxTokens = 0;
  int localExperts() const { return numExperts / nRanks; }
};

inline Shape makeShape(int nRanks, int numExperts, int hidden, int topk, int maxTokens) {
  Shape shape;
  shape.nRanks = nRanks;
  shape.numExperts = numExperts;
  shape.hidden = hidden;
  shape.topk = topk;
  shape.maxTokens = maxTokens;
  return shape;
}

struct RankInput {
  int numTokens = 0;
  bool fp8 = false;
  std::vector<uint8_t> x;        // numTokens rows of hidden values (2 or 1 bytes each)
  std::vector<float> scales;     // FP8: numTokens x hidden/128
  std::vector<int64_t> topk;     // numTokens x topk, -1 masked, distinct otherwise
  std::vector<float> weights;    // numTokens x topk
};

// Token counts vary per rank (uneven) in [maxTokens/4, maxTokens] unless `tokens` >= 0 fixes
// them; about `maskPercent`% of the top-k entries are -1.
RankInput makeInput(const Shape& shape, int rank, uint64_t seed, bool fp8, int maskPercent, int tokens = -1);

// One received row.
struct Row {
  int sourceRank = 0;
  int sourceToken = 0;
  std::vector<int> localTopk;      // topk entries, -1 for other ranks' experts
  std::vector<float> localWeights; // 0 for other ranks' experts
};

struct Received {
  std::vector<Row> rankMajor;              // rows by source rank from the receiver's next rank (rank + 1, ...,
                                           // wrapping; its own last), each source's in token order
  std::vector<int> rowsPerRank;            // per source rank
  std::vector<int> rowsPerExpert;          // per local expert
  std::vector<int> expertOffsets;          // aligned starts, size localExperts + 1
  std::vector<int> expertRows;             // expert-major position -> rank-major row, -1 = padding
};

// What `rank` receives from all ranks' inputs, and its expert-major arrangement.
Received expectedReceive(const Shape& shape, const std::vector<RankInput>& inputs, int rank, int alignment);

// Expert outputs come from expertOutputBits (ep_values.h), the same function the GPU fills them with.

// Combine result of `rank`'s tokens: hidden BF16 values per token, and the combined weights.
void expectedCombine(const Shape& shape, const std::vector<RankInput>& inputs, int rank, bool expertMajor,
                     bool weighted, uint64_t outputSeed, std::vector<uint16_t>* combined,
                     std::vector<float>* combinedWeights);

float bf16ToFloat(uint16_t bits);

// The low-latency dispatch's FP8 cast of one token: per 128 values, scale = max(amax, 1e-4) / 448
// (rounded up to a power of two with ue8m0), value = e4m3(x * (1 / scale)), saturating.
void castToFp8(const uint16_t* bf16, int hidden, bool ue8m0, uint8_t* values, float* scales);

}  // namespace unifab::test::ep
