// Named checks of the GPU test programs: each check counts as passed or failed (the first 20
// failures are printed, with the rank when one is set), and the program ends by printing
// "N passed, M failed" and returning non-zero on any failure.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <vector>

#include <unistd.h>

#include "tests/common/nccl_session.h"  // TEST_CUDA_CHECK
#include "unifab/unifab.h"

// Fails the calling bool function when a unifab call fails, with unifab's own message.
#define TEST_UNIFAB_CHECK(call)                                                                        \
  do {                                                                                                 \
    unifabResult_t unifab_r_ = (call);                                                                 \
    if (unifab_r_ != unifabSuccess) {                                                                  \
      fprintf(stderr, "%s:%d: %s failed: %s: %s\n", __FILE__, __LINE__, #call,                         \
              unifabGetErrorString(unifab_r_), unifabGetLastError());                                  \
      return false;                                                                                    \
    }                                                                                                  \
  } while (0)

namespace unifab::test {

struct CheckTally {
  int passed = 0;
  int failed = 0;
  int rank = -1;  // printed with each failure when >= 0
};

inline CheckTally& tally() {
  static CheckTally counts;
  return counts;
}

inline void check(bool ok, const std::string& what) {
  CheckTally& t = tally();
  if (ok) {
    ++t.passed;
    return;
  }
  if (++t.failed <= 20) {
    if (t.rank >= 0) printf("rank %d: FAIL %s\n", t.rank, what.c_str());
    else printf("FAIL %s\n", what.c_str());
  }
}

// Prints the tally and returns the program's exit status.
inline int finishChecks() {
  const CheckTally& t = tally();
  if (t.rank >= 0) printf("rank %d: %d passed, %d failed\n", t.rank, t.passed, t.failed);
  else printf("%d passed, %d failed\n", t.passed, t.failed);
  return t.failed == 0 ? 0 : 1;
}

// Ends a rank that cannot go on at once, without tearing anything down: its peers may wait in a
// collective step (a barrier, a group's destruction) that this rank will not reach, and the
// launcher stops them once this rank has failed.
[[noreturn]] inline void abandonRank(const std::string& where) {
  printf("rank %d: aborted%s%s\n", tally().rank, where.empty() ? "" : " ", where.c_str());
  fflush(stdout);
  _exit(1);
}

// Copies `count` elements from the device and waits for them.
template <typename T>
bool download(std::vector<T>* host, const void* device, size_t count, cudaStream_t stream) {
  host->resize(count);
  if (count == 0) return true;
  TEST_CUDA_CHECK(cudaMemcpyAsync(host->data(), device, count * sizeof(T), cudaMemcpyDeviceToHost, stream));
  TEST_CUDA_CHECK(cudaStreamSynchronize(stream));
  return true;
}

}  // namespace unifab::test
