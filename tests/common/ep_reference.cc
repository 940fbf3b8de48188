#include "tests/common/ep_reference.h"

#include "tests/common/ep_values.h"

#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

namespace unifab::test::ep {
namespace {

// A finite FP8 e4m3 byte (e4m3 has no infinities; 0x7f and 0xff are NaN).
uint8_t finiteFp8(uint64_t h) {
  uint8_t byte = static_cast<uint8_t>(h);
  if ((byte & 0x7f) == 0x7f) byte = static_cast<uint8_t>(byte & 0xfe);
  return byte;
}

}  // namespace

float bf16ToFloat(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  memcpy(&value, &wide, sizeof(value));
  return value;
}

RankInput makeInput(const Shape& shape, int rank, uint64_t seed, bool fp8, int maskPercent, int tokens) {
  std::mt19937_64 random(mix64(seed * 131 + static_cast<uint64_t>(rank)));
  RankInput in;
  in.fp8 = fp8;
  int low = shape.maxTokens / 4;
  in.numTokens = low + static_cast<int>(random() % static_cast<uint64_t>(shape.maxTokens - low + 1));
  if (tokens >= 0) in.numTokens = tokens;
  const size_t values = static_cast<size_t>(in.numTokens) * shape.hidden;
  in.x.resize(values * (fp8 ? 1 : 2));
  if (fp8) {
    for (size_t i = 0; i < values; ++i) in.x[i] = finiteFp8(random());
    in.scales.resize(static_cast<size_t>(in.numTokens) * (shape.hidden / 128));
    for (float& s : in.scales) s = static_cast<float>(random() % 1000 + 1) / 256.0f;
  } else {
    uint16_t* out = reinterpret_cast<uint16_t*>(in.x.data());
    for (size_t i = 0; i < values; ++i) out[i] = finiteBf16(random());
  }
  in.topk.assign(static_cast<size_t>(in.numTokens) * shape.topk, -1);
  in.weights.assign(static_cast<size_t>(in.numTokens) * shape.topk, 0.0f);
  for (int t = 0; t < in.numTokens; ++t) {
    for (int k = 0; k < shape.topk; ++k) {
      in.weights[static_cast<size_t>(t) * shape.topk + k] = static_cast<float>(random() % 1024) / 1024.0f;
      if (static_cast<int>(random() % 100) < maskPercent) continue;
      // Distinct experts per token, as routers produce.
      for (;;) {
        int64_t e = static_cast<int64_t>(random() % static_cast<uint64_t>(shape.numExperts));
        bool taken = false;
        for (int q = 0; q < k; ++q) taken = taken || in.topk[static_cast<size_t>(t) * shape.topk + q] == e;
        if (!taken) {
          in.topk[static_cast<size_t>(t) * shape.topk + k] = e;
          break;
        }
      }
    }
  }
  return in;
}

Received expectedReceive(const Shape& shape, const std::vector<RankInput>& inputs, int rank, int alignment) {
  Received out;
  const int local = shape.localExperts();
  const int64_t first = static_cast<int64_t>(rank) * local;
  out.rowsPerRank.assign(shape.nRanks, 0);
  for (int i = 1; i <= shape.nRanks; ++i) {
    const int s = (rank + i) % shape.nRanks;  // the documented order: the next rank first, this one last
    const RankInput& in = inputs[s];
    for (int t = 0; t < in.numTokens; ++t) {
      Row row;
      row.sourceRank = s;
      row.sourceToken = t;
      bool mine = false;
      for (int k = 0; k < shape.topk; ++k) {
        int64_t e = in.topk[static_cast<size_t>(t) * shape.topk + k];
        bool here = e >= first && e < first + local;
        row.localTopk.push_back(here ? static_cast<int>(e - first) : -1);
        row.localWeights.push_back(here ? in.weights[static_cast<size_t>(t) * shape.topk + k] : 0.0f);
        mine = mine || here;
      }
      if (mine) {
        out.rankMajor.push_back(row);
        ++out.rowsPerRank[s];
      }
    }
  }
  out.rowsPerExpert.assign(local, 0);
  out.expertOffsets.assign(local + 1, 0);
  for (int e = 0; e < local; ++e) {
    for (const Row& row : out.rankMajor) {
      for (int id : row.localTopk) out.rowsPerExpert[e] += id == e ? 1 : 0;
    }
    out.expertOffsets[e + 1] = out.expertOffsets[e] + (out.rowsPerExpert[e] + alignment - 1) / alignment * alignment;
  }
  out.expertRows.assign(out.expertOffsets[local], -1);
  for (int e = 0; e < local; ++e) {
    int next = out.expertOffsets[e];
    for (size_t j = 0; j < out.rankMajor.size(); ++j) {
      for (int id : out.rankMajor[j].localTopk) {
        if (id == e) out.expertRows[next++] = static_cast<int>(j);
      }
    }
  }
  return out;
}

void expectedCombine(const Shape& shape, const std::vector<RankInput>& inputs, int rank, bool expertMajor,
                     bool weighted, uint64_t outputSeed, std::vector<uint16_t>* combined,
                     std::vector<float>* combinedWeights) {
  const RankInput& in = inputs[rank];
  const int local = shape.localExperts();
  combined->assign(static_cast<size_t>(in.numTokens) * shape.hidden, 0);
  combinedWeights->assign(static_cast<size_t>(in.numTokens) * shape.topk, 0.0f);
  std::vector<float> partial(shape.hidden);
  std::vector<float> total(shape.hidden);
  for (int t = 0; t < in.numTokens; ++t) {
    const int64_t* ids = &in.topk[static_cast<size_t>(t) * shape.topk];
    const float* weights = &in.weights[static_cast<size_t>(t) * shape.topk];
    std::fill(total.begin(), total.end(), 0.0f);
    for (int r = 0; r < shape.nRanks; ++r) {
      const int64_t first = static_cast<int64_t>(r) * local;
      bool reaches = false;
      for (int k = 0; k < shape.topk; ++k) reaches = reaches || (ids[k] >= first && ids[k] < first + local);
      if (!reaches) continue;
      for (int i = 0; i < shape.hidden; ++i) {
        float acc = 0.0f;
        if (!expertMajor) {
          acc = bf16ToFloat(expertOutputBits(outputSeed, r, rank, t, -1, i));
        } else {
          for (int k = 0; k < shape.topk; ++k) {
            if (ids[k] < first || ids[k] >= first + local) continue;
            float y = bf16ToFloat(expertOutputBits(outputSeed, r, rank, t, static_cast<int>(ids[k] - first), i));
            acc = weighted ? std::fma(weights[k], y, acc) : acc + y;
          }
        }
        partial[i] = bf16ToFloat(floatToBf16Bits(acc));  // each rank sends its partial sum as BF16
        total[i] = total[i] + partial[i];
      }
      for (int k = 0; k < shape.topk; ++k) {
        bool here = ids[k] >= first && ids[k] < first + local;
        float& w = (*combinedWeights)[static_cast<size_t>(t) * shape.topk + k];
        w = w + (here ? weights[k] : 0.0f);
      }
    }
    for (int i = 0; i < shape.hidden; ++i) (*combined)[static_cast<size_t>(t) * shape.hidden + i] = floatToBf16Bits(total[i]);
  }
}

void castToFp8(const uint16_t* bf16, int hidden, bool ue8m0, uint8_t* values, float* scales) {
  for (int block = 0; block < hidden / 128; ++block) {
    float amax = 0.0f;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(bf16ToFloat(bf16[block * 128 + i])));
    float scale = std::max(amax, 1e-4f) / 448.0f;
    if (ue8m0) {
      uint32_t bits = floatBits(scale);
      if ((bits & 0x7fffffu) != 0) bits = (bits & 0xff800000u) + 0x800000u;
      memcpy(&scale, &bits, sizeof(scale));
    }
    scales[block] = scale;
    const float inverse = 1.0f / scale;
    for (int i = 0; i < 128; ++i) {
      const float v = bf16ToFloat(bf16[block * 128 + i]) * inverse;
      values[block * 128 + i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
    }
  }
}

}  // namespace unifab::test::ep
