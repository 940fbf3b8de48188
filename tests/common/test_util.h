// Small helpers every test family uses: a hash for reproducible data and a monotonic clock.
#pragma once

#include <chrono>
#include <cstdint>

#if defined(__CUDACC__)
#define UNIFAB_TEST_HD __host__ __device__ __forceinline__
#else
#define UNIFAB_TEST_HD inline
#endif

namespace unifab::test {

// splitmix64: cheap and well mixed, so (seed, index) -> value needs no stored table and the
// host and the GPU compute the same data.
UNIFAB_TEST_HD uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Seconds on the steady clock, for deadlines.
inline double nowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace unifab::test
