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

#include <algorithm>
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

/* Every unifab test sends and receives `count` elements per rank (what -c compares is the receive
 * buffer), nothing in place. */
static inline void unifabSameByteCount(size_t* sendcount, size_t* recvcount, size_t* paramcount,
                                       size_t* sendInplaceOffset, size_t* recvInplaceOffset, size_t count,
                                       size_t eltSize, int nranks) {
  *sendcount = count;
  *recvcount = count;
  *sendInplaceOffset = 0;
  *recvInplaceOffset = 0;
  *paramcount = count;
}

static inline void unifabGetBuffSize(size_t* sendcount, size_t* recvcount, size_t count, int nranks) {
  size_t paramcount, sendInplaceOffset, recvInplaceOffset;
  unifabSameByteCount(sendcount, recvcount, &paramcount, &sendInplaceOffset, &recvInplaceOffset, count, 1, nranks);
}

/* Bytes moved per second, each over one link once: algbw and busbw alike (as sendrecv_perf). */
static inline void unifabBytesPerSecond(size_t count, size_t typesize, double sec, double* algBw, double* busBw,
                                        int nranks) {
  *algBw = (double)(count * typesize) / 1.0E9 / sec;
  *busBw = *algBw;
}

/* What -c expects in GPU i's receive buffer: the harness's data of rank `source` for the first
 * `validBytes` bytes (whole rows or tokens), zeros past them (never written). */
static inline testResult_t unifabExpectRankData(struct threadArgs* args, int i, ncclDataType_t type, int rep,
                                                int source, size_t validBytes) {
  const size_t count = args->expectedBytes / wordSize(type);
  TESTCHECK(InitData(args->expected[i], count, source * count, type, ncclSum, rep, 1, 0));
  if (validBytes < args->expectedBytes) {
    CUDACHECK(cudaMemset((char*)args->expected[i] + validBytes, 0, args->expectedBytes - validBytes));
  }
  return testSuccess;
}

/* A test's runTest: one GPU per thread, then the harness's timing loop with one data type (the
 * given one, or `fallback`) and no reduction. */
static inline testResult_t unifabRunTest(struct threadArgs* args, struct testColl* coll, ncclDataType_t type,
                                         const char* typeName, ncclDataType_t fallback, const char* fallbackName) {
  if (args->nGpus != 1) {
    printf("unifab tests need one GPU per thread or process (-g 1 with -t N, or MPI); got -g %d\n", args->nGpus);
    return testInvalidUsage;
  }
  args->collTest = coll;
  TESTCHECK(TimeTest(args, (int)type != -1 ? type : fallback, (int)type != -1 ? typeName : fallbackName,
                     (ncclRedOp_t)0, "none", -1));
  return testSuccess;
}

/* ---- expert parallelism, shared by moe_dispatch_perf and moe_combine_perf ------------------ */

#include <random>
#include <vector>

/* The group of one communicator and the routing of its tokens. Routing: UNIFAB_EP_ROUTING=0
 * draws top-k distinct experts per token uniformly (the standard benchmark); 1 sends every token
 * to top-k experts of rank + 1 only, so that dispatch moves rank - 1's tokens here in order and
 * combine with identity experts returns every token unchanged: what -c can check. */
struct UnifabEpState {
  unifabEpGroup_t group;
  int hidden, topk, experts, maxTokens;
  bool fp8, lowLatency, shift;
  int64_t* topkIdx;     /* device [maxTokens][topk] */
  float* topkWeights;   /* device [maxTokens][topk], all 1 */
  float* scales;        /* device [maxTokens][hidden/128] (high-throughput FP8 input) */
  double ranksPerToken; /* bytes received per input byte: destination ranks per token, times the
                           wire bytes per input byte (FP8 cast in the low-latency kernel: ~1/2) */
  unifabEpHandle_t handle; /* of the latest dispatch, or NULL */
  int dispatched;          /* tokens of that dispatch; -1: none (or its inputs changed) */
  const void* received;    /* its receive rows (rank-major, or the low-latency expert regions) */
};

static UnifabPerComm<UnifabEpState> unifabEpStates;
static size_t unifabEpMaxBytes = 0;         /* the run's largest size, set by runTest */
static thread_local double unifabEpRanksPerToken = 1.0;  /* this rank's routing (and wire bytes), set by runColl */

/* algbw counts this rank's tokens; busbw every row received (dispatch) or sent back (combine),
 * the rank's own included, as DeepEP counts them. */
static inline void unifabEpGetBw(size_t count, size_t typesize, double sec, double* algBw, double* busBw, int nranks) {
  *algBw = (double)(count * typesize) / 1.0E9 / sec;
  *busBw = *algBw * unifabEpRanksPerToken;
}

static inline size_t unifabEpBytesPerToken(const UnifabEpState* s) {
  return (size_t)s->hidden * (s->fp8 && !s->lowLatency ? 1 : 2);
}

static inline testResult_t unifabEpState(ncclComm_t comm, UnifabEpState** out) {
  UnifabEpState* s = unifabEpStates.find(comm);
  if (s != NULL) {
    *out = s;
    return testSuccess;
  }
  s = new UnifabEpState();
  s->handle = NULL;
  s->dispatched = -1;
  s->received = NULL;
  s->hidden = (int)unifabTestParam("UNIFAB_EP_HIDDEN", 7168);
  s->topk = (int)unifabTestParam("UNIFAB_EP_TOPK", 8);
  s->experts = (int)unifabTestParam("UNIFAB_EP_EXPERTS", 256);
  s->fp8 = unifabTestParam("UNIFAB_EP_FP8", 0) != 0;
  s->lowLatency = unifabTestParam("UNIFAB_EP_MODE", 0) == 1;
  s->shift = unifabTestParam("UNIFAB_EP_ROUTING", 0) == 1;
  s->maxTokens = (int)std::max<size_t>(unifabEpMaxBytes / unifabEpBytesPerToken(s), 1);
  if (s->lowLatency && s->maxTokens > 1024) {
    printf("unifab EP tests: the low-latency mode takes at most 1024 tokens per rank; sizes above %zu bytes send "
           "only their first 1024 tokens\n", (size_t)1024 * unifabEpBytesPerToken(s));
    s->maxTokens = 1024;
  }
  int nRanks, rank;
  NCCLCHECK(ncclCommCount(comm, &nRanks));
  NCCLCHECK(ncclCommUserRank(comm, &rank));
  unifabEpConfig_t config = UNIFAB_EP_CONFIG_INIT;
  config.mode = s->lowLatency ? unifabEpLowLatency : unifabEpHighThroughput;
  config.numExperts = s->experts;
  config.maxTokensPerRank = s->maxTokens;
  config.hidden = s->hidden;
  config.topk = s->topk;
  UNIFABCHECK(unifabEpCreate(comm, &config, &s->group));
  const int local = s->experts / nRanks;
  std::vector<int64_t> ids((size_t)s->maxTokens * s->topk);
  std::mt19937_64 random(777 + rank);
  for (int t = 0; t < s->maxTokens; ++t) {
    for (int k = 0; k < s->topk; ++k) {
      int64_t e;
      bool taken;
      do {
        e = s->shift ? (int64_t)((rank + 1) % nRanks) * local + (int64_t)(random() % (uint64_t)local)
                     : (int64_t)(random() % (uint64_t)s->experts);
        taken = false;
        for (int q = 0; q < k; ++q) taken = taken || ids[(size_t)t * s->topk + q] == e;
      } while (taken && s->topk <= (s->shift ? local : s->experts));
      ids[(size_t)t * s->topk + k] = e;
    }
  }
  long long destinations = 0;
  for (int t = 0; t < s->maxTokens; ++t) {
    uint64_t mask = 0;
    for (int k = 0; k < s->topk; ++k) mask |= 1ULL << (ids[(size_t)t * s->topk + k] / local);
    destinations += __builtin_popcountll(mask);
  }
  s->ranksPerToken = (double)destinations / s->maxTokens;
  if (s->lowLatency && s->fp8) s->ranksPerToken *= (s->hidden + s->hidden / 128 * 4.0) / (2.0 * s->hidden);
  std::vector<float> ones((size_t)s->maxTokens * s->topk, 1.0f);
  std::vector<float> scales((size_t)s->maxTokens * (s->hidden / 128), 1.0f);
  CUDACHECK(cudaMalloc(&s->topkIdx, sizeof(int64_t) * ids.size()));
  CUDACHECK(cudaMalloc(&s->topkWeights, sizeof(float) * ones.size()));
  CUDACHECK(cudaMalloc(&s->scales, sizeof(float) * scales.size()));
  CUDACHECK(cudaMemcpy(s->topkIdx, ids.data(), sizeof(int64_t) * ids.size(), cudaMemcpyHostToDevice));
  CUDACHECK(cudaMemcpy(s->topkWeights, ones.data(), sizeof(float) * ones.size(), cudaMemcpyHostToDevice));
  CUDACHECK(cudaMemcpy(s->scales, scales.data(), sizeof(float) * scales.size(), cudaMemcpyHostToDevice));
  unifabEpStates.put(comm, s);
  *out = s;
  return testSuccess;
}

/* Collective: the group of `comm`, once the test's timing loop is over (before the harness
 * destroys the communicator). */
static inline testResult_t unifabEpRelease(ncclComm_t comm) {
  UnifabEpState* s = unifabEpStates.find(comm);
  if (s == NULL) return testSuccess;
  if (s->handle != NULL) UNIFABCHECK(unifabEpHandleDestroy(s->handle));
  UNIFABCHECK(unifabEpDestroy(s->group));
  CUDACHECK(cudaFree(s->topkIdx));
  CUDACHECK(cudaFree(s->topkWeights));
  CUDACHECK(cudaFree(s->scales));
  unifabEpStates.put(comm, NULL);
  delete s;
  return testSuccess;
}

/* Tokens of a `bytes`-byte input (whole tokens, at most the group's maximum). */
static inline int unifabEpTokens(const UnifabEpState* s, size_t bytes) {
  return (int)std::min<size_t>(bytes / unifabEpBytesPerToken(s), (size_t)s->maxTokens);
}

/* -c can check the routing that sends every token to rank + 1 (high throughput only). */
static inline bool unifabEpChecking(const UnifabEpState* s) { return s->shift && !s->lowLatency; }

/* Both MoE tests' InitData: the harness's data of this rank as input, zeroed receive buffers, and
 * as expected data the whole tokens of rank + `sourceShift` (dispatch: -1, rank - 1's tokens
 * arrive; combine: 0, every token returns as it left). New inputs drop the latest dispatch. */
static inline testResult_t unifabEpInitData(struct threadArgs* args, ncclDataType_t type, int rep, int in_place,
                                            int sourceShift) {
  const size_t count = args->sendBytes / wordSize(type);
  const int nranks = args->nProcs * args->nThreads * args->nGpus;
  bool check = false;
  for (int i = 0; i < args->nGpus; i++) {
    CUDACHECK(cudaSetDevice(args->gpus[i]));
    const int rank = unifabTestRank(args, i);
    UnifabEpState* s = NULL;
    TESTCHECK(unifabEpState(args->comms[i], &s));
    check = unifabEpChecking(s);
    TESTCHECK(InitData(args->sendbuffs[i], count, rank * count, type, ncclSum, rep, 1, 0));
    CUDACHECK(cudaMemset(args->recvbuffs[i], 0, args->expectedBytes));
    /* Whole tokens only: the bytes past them are never sent. */
    TESTCHECK(unifabExpectRankData(args, i, type, rep, (rank + sourceShift + nranks) % nranks,
                                   (size_t)unifabEpTokens(s, args->sendBytes) * unifabEpBytesPerToken(s)));
    s->dispatched = -1;
    CUDACHECK(cudaDeviceSynchronize());
  }
  args->reportErrors = (check && !in_place) ? 1 : 0;
  return testSuccess;
}

/* One dispatch of `tokens` tokens of `x`, which becomes the state's latest (the previous handle
 * is released). */
static inline testResult_t unifabEpDispatchOnce(UnifabEpState* s, const void* x, int tokens, cudaStream_t stream) {
  if (s->handle != NULL) UNIFABCHECK(unifabEpHandleDestroy(s->handle));
  s->handle = NULL;
  s->dispatched = -1;
  if (s->lowLatency) {
    unifabEpLowLatencyDispatchArgs_t a = UNIFAB_EP_LL_DISPATCH_ARGS_INIT;
    a.numTokens = tokens;
    a.x = x;
    a.topkIdx = s->topkIdx;
    a.topkWeights = s->topkWeights;
    a.dtype = s->fp8 ? unifabEpFp8E4M3 : unifabEpBf16;
    unifabEpLowLatencyDispatchResult_t result;
    result.size = sizeof(result);
    UNIFABCHECK(unifabEpLowLatencyDispatch(s->group, &a, stream, &s->handle, &result));
    s->received = result.recvX;
  } else {
    unifabEpDispatchArgs_t a = UNIFAB_EP_DISPATCH_ARGS_INIT;
    a.numTokens = tokens;
    a.dtype = s->fp8 ? unifabEpFp8E4M3 : unifabEpBf16;
    a.x = x;
    a.scales = s->scales;
    a.topkIdx = s->topkIdx;
    a.topkWeights = s->topkWeights;
    unifabEpDispatchResult_t result;
    result.size = sizeof(result);
    UNIFABCHECK(unifabEpDispatch(s->group, &a, stream, &s->handle, &result));
    s->received = result.recvX;
  }
  s->dispatched = tokens;
  return testSuccess;
}

#endif
