// Deterministic test values for expert-parallel tests, computable on the host (reference) and on
// the GPU (expert outputs generated in place, also inside captured CUDA graphs).
#pragma once

#include <cstdint>
#include <cstring>

#include "tests/common/test_util.h"

#define EP_TEST_HD UNIFAB_TEST_HD

namespace unifab::test::ep {

using unifab::test::mix64;

EP_TEST_HD uint32_t floatBits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

// Round to nearest even, as __float2bfloat16_rn (finite inputs).
EP_TEST_HD uint16_t floatToBf16Bits(float value) {
  uint32_t bits = floatBits(value);
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// A finite BF16 value in [-2.44, 2.44] from a hash.
EP_TEST_HD uint16_t finiteBf16(uint64_t h) {
  float value = static_cast<float>(static_cast<int>(h % 20001) - 10000) / 4096.0f;
  return floatToBf16Bits(value);
}

// Expert output of the row (sourceRank, sourceToken) on `rank` for local `expert` (-1: the
// rank-major row), value `element`.
EP_TEST_HD uint16_t expertOutputBits(uint64_t seed, int rank, int sourceRank, int sourceToken, int expert, int element) {
  uint64_t h = mix64(seed ^ mix64(static_cast<uint64_t>(rank) * 1000003ULL + static_cast<uint64_t>(sourceRank)) ^
                     mix64(static_cast<uint64_t>(sourceToken) * 7919ULL + static_cast<uint64_t>(expert + 1)) ^
                     mix64(static_cast<uint64_t>(element)));
  return finiteBf16(h);
}

}  // namespace unifab::test::ep
