/*
 * Shared by unifab's nccl-tests perf tests (written for unifab, not part of nccl-tests): the
 * per-communicator state each test keeps between calls, its parameters from the environment, and
 * the checks that turn a unifab failure into a test failure with unifab's message.
 *
 * Run one GPU per thread or per process (-g 1 with -t N, or MPI): the objects these tests create
 * are collective over the communicator, which a single thread driving several GPUs cannot do.
 */
#ifndef UNIFAB_NCCL_TESTS_H_
#define UNIFAB_NCCL_TESTS_H_

#include <mutex>
#include <map>
#include <stdio.h>
#include <stdlib.h>

#include "common.h"
#include "unifab/unifab.h"

#define UNIFABCHECK(cmd) do {                                                        \
  unifabResult_t r_ = (cmd);                                                         \
  if (r_ != unifabSuccess) {                                                         \
    char hostname_[1024];                                                            \
    getHostName(hostname_, 1024);                                                    \
    printf("%s: Test unifab failure %s:%d '%s': %s\n", hostname_, __FILE__, __LINE__,\
           unifabGetErrorString(r_), unifabGetLastError());                          \
    return testNcclError;                                                            \
  }                                                                                  \
} while (0)

/* An integer parameter from the environment, with its default. */
static inline long long unifabTestParam(const char* name, long long fallback) {
  const char* text = getenv(name);
  return text != NULL && text[0] != '\0' ? atoll(text) : fallback;
}

/* One object per communicator (a test's group or table), made on first use by each rank's thread. */
template <typename State>
struct UnifabPerComm {
  std::mutex mutex;
  std::map<ncclComm_t, State*> states;
  State* find(ncclComm_t comm) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = states.find(comm);
    return it == states.end() ? NULL : it->second;
  }
  void put(ncclComm_t comm, State* state) {
    std::lock_guard<std::mutex> lock(mutex);
    states[comm] = state;
  }
};

/* The rank of this thread's first GPU, as the harness numbers them. */
static inline int unifabTestRank(struct threadArgs* args, int gpu) {
  return (args->proc * args->nThreads + args->thread) * args->nGpus + gpu;
}

static inline testResult_t unifabTestOneGpuPerThread(struct threadArgs* args) {
  if (args->nGpus != 1) {
    printf("unifab tests need one GPU per thread or process (-g 1 with -t N, or MPI); got -g %d\n", args->nGpus);
    return testInvalidUsage;
  }
  return testSuccess;
}

#endif
