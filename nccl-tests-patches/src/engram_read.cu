/*
 * engram_read_perf: unifab's Engram fetch. Every rank holds a table of rows; each rank fetches
 * `size` bytes of whole rows held by rank + 1 (size / row bytes rows; sizes below one row fetch
 * nothing). Rows are read in order (checkable with -c: they are rank + 1's data) or, with
 * UNIFAB_ENGRAM_RANDOM=1, in a random order (no check). Bandwidth = fetched bytes / time.
 * Environment: UNIFAB_ENGRAM_ROW_BYTES (14336), UNIFAB_ENGRAM_ENGINE (0 auto, 1 copy engine,
 * 2 gather kernel), UNIFAB_ENGRAM_SMS (gather kernel SMs, 0 = 4), UNIFAB_ENGRAM_RANDOM (0).
 */
#include <algorithm>
#include <random>
#include <vector>

#include "cuda_runtime.h"
#include "common.h"
#include "unifab_tests.h"

namespace {

struct EngramState {
  unifabEngramTable_t table;
  size_t rowBytes;
  int64_t rowsPerRank;
  int64_t* deviceIds;            // [rowsPerRank]: the ids of rank + 1's rows, in fetch order
  std::vector<int64_t> hostIds;  // the same, for the copy engine
};

UnifabPerComm<EngramState> engramStates;
size_t g_maxBytes = 0;  // the largest size of the run, set by the test before its first call

testResult_t engramState(ncclComm_t comm, EngramState** out) {
  EngramState* s = engramStates.find(comm);
  if (s == NULL) {
    s = new EngramState();
    s->rowBytes = (size_t)unifabTestParam("UNIFAB_ENGRAM_ROW_BYTES", 14336);
    s->rowsPerRank = (int64_t)std::max<size_t>(g_maxBytes / s->rowBytes, 1);
    unifabEngramConfig_t config = UNIFAB_ENGRAM_CONFIG_INIT;
    config.rowBytes = s->rowBytes;
    config.rowsPerRank = s->rowsPerRank;
    UNIFABCHECK(unifabEngramCreate(comm, &config, &s->table));
    int nRanks, rank;
    NCCLCHECK(ncclCommCount(comm, &nRanks));
    NCCLCHECK(ncclCommUserRank(comm, &rank));
    const int64_t base = (int64_t)((rank + 1) % nRanks) * s->rowsPerRank;
    s->hostIds.resize((size_t)s->rowsPerRank);
    for (int64_t i = 0; i < s->rowsPerRank; ++i) s->hostIds[(size_t)i] = base + i;
    if (unifabTestParam("UNIFAB_ENGRAM_RANDOM", 0) != 0) {
      std::mt19937_64 random(12345 + rank);
      std::shuffle(s->hostIds.begin(), s->hostIds.end(), random);
    }
    CUDACHECK(cudaMalloc(&s->deviceIds, sizeof(int64_t) * s->hostIds.size()));
    CUDACHECK(cudaMemcpy(s->deviceIds, s->hostIds.data(), sizeof(int64_t) * s->hostIds.size(), cudaMemcpyHostToDevice));
    engramStates.put(comm, s);
  }
  *out = s;
  return testSuccess;
}

}  // namespace

testResult_t EngramInitData(struct threadArgs* args, ncclDataType_t type, ncclRedOp_t op, int root, int rep,
                            int in_place) {
  size_t count = args->expectedBytes / wordSize(type);
  int nranks = args->nProcs * args->nThreads * args->nGpus;
  for (int i = 0; i < args->nGpus; i++) {
    CUDACHECK(cudaSetDevice(args->gpus[i]));
    int rank = unifabTestRank(args, i);
    EngramState* s = NULL;
    TESTCHECK(engramState(args->comms[i], &s));
    // This rank's table: its send buffer's pattern, as many whole rows as the size holds.
    const int64_t rows = std::min<int64_t>((int64_t)(args->sendBytes / s->rowBytes), s->rowsPerRank);
    TESTCHECK(InitData(args->sendbuffs[i], count, rank * count, type, ncclSum, rep, 1, 0));
    CUDACHECK(cudaDeviceSynchronize());  // InitData's kernel runs on another stream than the write
    UNIFABCHECK(unifabEngramWrite(s->table, 0, rows, args->sendbuffs[i], NULL, args->streams[i]));
    CUDACHECK(cudaMemset(args->recvbuffs[i], 0, args->expectedBytes));
    // What rank + 1 wrote, in order; the bytes past the last whole row stay zero.
    TESTCHECK(unifabExpectRankData(args, i, type, rep, (rank + 1) % nranks, (size_t)rows * s->rowBytes));
    CUDACHECK(cudaDeviceSynchronize());
  }
  Barrier(args);  // every table is written before anyone reads
  args->reportErrors = (in_place || unifabTestParam("UNIFAB_ENGRAM_RANDOM", 0) != 0) ? 0 : 1;
  return testSuccess;
}

testResult_t EngramRunColl(void* sendbuff, size_t sendoffset, void* recvbuff, size_t recvoffset, size_t count,
                           ncclDataType_t type, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream,
                           int deviceImpl) {
  if (deviceImpl != 0) return testNotImplemented;
  EngramState* s = NULL;
  TESTCHECK(engramState(comm, &s));
  const size_t rows = std::min<size_t>(count * wordSize(type) / s->rowBytes, (size_t)s->rowsPerRank);
  if (rows == 0) return testSuccess;
  unifabEngramFetchArgs_t args = UNIFAB_ENGRAM_FETCH_ARGS_INIT;
  args.engine = (unifabEngramEngine_t)unifabTestParam("UNIFAB_ENGRAM_ENGINE", 0);
  const bool copyEngine = args.engine == unifabEngramCopyEngine ||
                          (args.engine == unifabEngramAuto && s->rowBytes >= (32 << 10));
  args.rowIds = copyEngine ? (const void*)s->hostIds.data() : (const void*)s->deviceIds;
  args.hostRowIds = copyEngine ? 1 : 0;
  args.numRows = rows;
  args.out = (char*)recvbuff + recvoffset;
  args.maxSms = (int)unifabTestParam("UNIFAB_ENGRAM_SMS", 0);
  unifabEngramFetch_t fetch = NULL;
  UNIFABCHECK(unifabEngramFetchIssue(s->table, &args, stream, &fetch));
  UNIFABCHECK(unifabEngramWait(fetch, stream, NULL));
  return testSuccess;
}

struct testColl engramTest = {"EngramRead", unifabSameByteCount, EngramInitData, unifabBytesPerSecond, EngramRunColl};

testResult_t EngramRunTest(struct threadArgs* args, int root, ncclDataType_t type, const char* typeName,
                           ncclRedOp_t op, const char* opName) {
  g_maxBytes = args->maxbytes;
  TESTCHECK(unifabRunTest(args, &engramTest, type, typeName, ncclInt8, "int8"));
  // Collective: the table goes before the harness destroys the communicator.
  EngramState* s = engramStates.find(args->comms[0]);
  if (s != NULL) {
    UNIFABCHECK(unifabEngramDestroy(s->table));
    CUDACHECK(cudaFree(s->deviceIds));
    engramStates.put(args->comms[0], NULL);
    delete s;
  }
  return testSuccess;
}

struct testEngine engramEngine = {
  .getBuffSize = unifabGetBuffSize,
  .runTest = EngramRunTest,
};

#pragma weak ncclTestEngine=engramEngine
