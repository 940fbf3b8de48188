// Small helpers every test family uses: a hash for reproducible data, a monotonic clock, and the
// items of a comma-separated list (options and environment variables).
#pragma once

#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#if defined(__CUDACC__)
#define UNIFAB_TEST_HD __host__ __device__ __forceinline__
#else
#define UNIFAB_TEST_HD inline
#endif

namespace unifab::test {

// What a test exits with when this machine cannot run it (ctest's SKIP_RETURN_CODE for the gpu
// label): e.g. two ranks of one host but one GPU, which NCCL refuses.
constexpr int kSkipExitCode = 77;

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

// The comma-separated items of `text`, empty ones kept ("a,,b" has three; "" has none), so that a
// caller can refuse them.
inline std::vector<std::string> commaItems(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream list(text);
  for (std::string item; std::getline(list, item, ',');) items.push_back(item);
  return items;
}

}  // namespace unifab::test
