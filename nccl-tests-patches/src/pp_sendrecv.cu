/*
 * pp_sendrecv_perf: unifab's pipeline send/recv (copy engine and stream memory operations, no
 * SM), in the pattern of sendrecv_perf: every rank sends `size` bytes to rank + 1 and receives
 * `size` bytes from rank - 1. The receive runs on a second stream forked from the test's stream
 * and joined back, so that a transfer larger than the receiver's slots never waits behind its own
 * rank's send. Bandwidth as sendrecv_perf counts it (bytes / time, bus = alg). -c checks the
 * received bytes; -G is refused (the chunks are numbered on the host).
 * UNIFAB_PP_ONE_WAY=1 measures one direction instead, as a pipeline stage boundary does and as
 * `unifab-bench pp` does: each even rank sends to the next odd rank, which receives (a last even
 * rank without a partner idles).
 * Environment: UNIFAB_PP_CHUNK_BYTES (0 = 8 MiB), UNIFAB_PP_CHUNKS_IN_FLIGHT (0 = 4),
 * UNIFAB_PP_ONE_WAY (0).
 */
#include "cuda_runtime.h"
#include "common.h"
#include "unifab_tests.h"

namespace {

struct PpState {
  unifabPpGroup_t group;
  cudaStream_t recvStream;
  cudaEvent_t forked, received;
  // Read once: a call of 4 KiB lasts ~17 us of host time, and the environment and the
  // communicator's queries are not what the test measures.
  int rank, nRanks;
  bool oneWay;
};

UnifabPerComm<PpState> ppStates;

testResult_t ppState(ncclComm_t comm, PpState** out) {
  PpState* s = ppStates.find(comm);
  if (s == NULL) {
    s = new PpState();
    unifabPpConfig_t config = UNIFAB_PP_CONFIG_INIT;
    config.chunkBytes = (size_t)unifabTestParam("UNIFAB_PP_CHUNK_BYTES", 0);
    config.chunksInFlight = (int)unifabTestParam("UNIFAB_PP_CHUNKS_IN_FLIGHT", 0);
    UNIFABCHECK(unifabPpCreate(comm, &config, &s->group));
    NCCLCHECK(ncclCommCount(comm, &s->nRanks));
    NCCLCHECK(ncclCommUserRank(comm, &s->rank));
    s->oneWay = unifabTestParam("UNIFAB_PP_ONE_WAY", 0) != 0;
    CUDACHECK(cudaStreamCreateWithFlags(&s->recvStream, cudaStreamNonBlocking));
    CUDACHECK(cudaEventCreateWithFlags(&s->forked, cudaEventDisableTiming));
    CUDACHECK(cudaEventCreateWithFlags(&s->received, cudaEventDisableTiming));
    ppStates.put(comm, s);
  }
  *out = s;
  return testSuccess;
}

}  // namespace

testResult_t PpInitData(struct threadArgs* args, ncclDataType_t type, ncclRedOp_t op, int root, int rep, int in_place) {
  size_t sendcount = args->sendBytes / wordSize(type);
  size_t recvcount = args->expectedBytes / wordSize(type);
  int nranks = args->nProcs * args->nThreads * args->nGpus;
  for (int i = 0; i < args->nGpus; i++) {
    CUDACHECK(cudaSetDevice(args->gpus[i]));
    int rank = unifabTestRank(args, i);
    CUDACHECK(cudaMemset(args->recvbuffs[i], 0, args->expectedBytes));
    void* data = in_place ? args->recvbuffs[i] : args->sendbuffs[i];
    TESTCHECK(InitData(data, sendcount, rank * sendcount, type, ncclSum, rep, 1, 0));
    int peer = (rank - 1 + nranks) % nranks;
    if (unifabTestParam("UNIFAB_PP_ONE_WAY", 0) != 0 && rank % 2 == 0) {
      CUDACHECK(cudaMemset(args->expected[i], 0, args->expectedBytes));  // an even rank only sends
    } else {
      TESTCHECK(InitData(args->expected[i], recvcount, peer * recvcount, type, ncclSum, rep, 1, 0));
    }
    CUDACHECK(cudaDeviceSynchronize());
  }
  args->reportErrors = in_place ? 0 : 1;  // in place cannot hold what is sent and received at once
  return testSuccess;
}

testResult_t PpRunColl(void* sendbuff, size_t sendoffset, void* recvbuff, size_t recvoffset, size_t count,
                       ncclDataType_t type, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream,
                       int deviceImpl) {
  if (deviceImpl != 0) return testNotImplemented;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDACHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    printf("pp_sendrecv_perf: unifab's pipeline send/recv cannot be captured in a CUDA graph (-G)\n");
    return testNotImplemented;
  }
  PpState* s = NULL;
  TESTCHECK(ppState(comm, &s));
  const int nRanks = s->nRanks, rank = s->rank;
  const size_t bytes = count * wordSize(type);
  if (s->oneWay) {
    if (rank % 2 == 0 && rank + 1 < nRanks) {
      UNIFABCHECK(unifabPpSend(s->group, (char*)sendbuff + sendoffset, bytes, rank + 1, stream));
    } else if (rank % 2 == 1) {
      UNIFABCHECK(unifabPpRecv(s->group, (char*)recvbuff + recvoffset, bytes, rank - 1, stream));
    }
    return testSuccess;
  }
  CUDACHECK(cudaEventRecord(s->forked, stream));
  CUDACHECK(cudaStreamWaitEvent(s->recvStream, s->forked, 0));
  UNIFABCHECK(unifabPpSend(s->group, (char*)sendbuff + sendoffset, bytes, (rank + 1) % nRanks, stream));
  UNIFABCHECK(unifabPpRecv(s->group, (char*)recvbuff + recvoffset, bytes, (rank - 1 + nRanks) % nRanks, s->recvStream));
  CUDACHECK(cudaEventRecord(s->received, s->recvStream));
  CUDACHECK(cudaStreamWaitEvent(stream, s->received, 0));
  return testSuccess;
}

struct testColl ppTest = {"PpSendRecv", unifabSameByteCount, PpInitData, unifabBytesPerSecond, PpRunColl};

testResult_t PpRunTest(struct threadArgs* args, int root, ncclDataType_t type, const char* typeName, ncclRedOp_t op,
                       const char* opName) {
  TESTCHECK(unifabRunTest(args, &ppTest, type, typeName, ncclInt8, "int8"));
  // Collective: the group goes before the harness destroys the communicator.
  PpState* s = ppStates.find(args->comms[0]);
  if (s != NULL) {
    UNIFABCHECK(unifabPpDestroy(s->group));
    CUDACHECK(cudaStreamDestroy(s->recvStream));
    CUDACHECK(cudaEventDestroy(s->forked));
    CUDACHECK(cudaEventDestroy(s->received));
    ppStates.put(args->comms[0], NULL);
    delete s;
  }
  return testSuccess;
}

struct testEngine ppEngine = {
  .getBuffSize = unifabGetBuffSize,
  .runTest = PpRunTest,
};

#pragma weak ncclTestEngine=ppEngine
