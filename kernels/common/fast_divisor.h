// Division by a divisor fixed for a kernel's lifetime (a group's rank count, parts a row, experts a
// rank) as one multiply-high: a '/' or '%' by a runtime value is ~20 dependent instructions, and
// the low-latency kernels take several on a 1-token call's path before their first loads.
//
// The magic is ceil(2^32 / d) = (2^32 + r) / d with 0 <= r < d; the high half of n * magic is
// n / d + n r / (2^32 d), whose floor is n / d's while n r < 2^32: n (d - 1) < 2^32 suffices
// (fastDivisorCovers).
#pragma once

#include <cstdint>

#include "kernels/common/host_device.h"

namespace unifab::kernels {

struct FastDivisor {
  int divisor;     // >= 1
  uint32_t magic;  // ceil(2^32 / divisor); 0 for a divisor of 1 (n / 1 = n)
};

UNIFAB_HOST_DEVICE inline FastDivisor makeFastDivisor(int divisor) {
  return {divisor, divisor <= 1 ? 0u : 0xFFFFFFFFu / static_cast<uint32_t>(divisor) + 1u};
}

// Whether every dividend in [0, largest] divides exactly.
UNIFAB_HOST_DEVICE inline bool fastDivisorCovers(const FastDivisor& d, uint64_t largest) {
  return d.divisor >= 1 && largest * static_cast<uint64_t>(d.divisor - 1) < (1ULL << 32);
}

// n / d for 0 <= n within fastDivisorCovers' bound (n % d is then n - quotientOf(d, n) * d, as the
// kernels write it with the divisor they hold).
UNIFAB_HOST_DEVICE inline int quotientOf(const FastDivisor& d, int n) {
#if defined(__CUDA_ARCH__)
  return d.magic == 0 ? n : static_cast<int>(__umulhi(static_cast<uint32_t>(n), d.magic));
#else
  return d.magic == 0 ? n : static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(n)) * d.magic) >> 32);
#endif
}

}  // namespace unifab::kernels
