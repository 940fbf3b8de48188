/*
 * pp_sendrecv_perf: unifab's pipeline send/recv (copy engine and stream memory operations, no
 * SM), in the pattern of sendrecv_perf: every rank sends `size` bytes to rank + 1 and receives
 * `size` bytes from rank - 1. The receive runs on a second stream forked from the test's stream
 * and joined back, so that a transfer larger than the receiver's slots never waits behind its own
 * rank's send. Bandwidth as sendrecv_perf counts it (bytes / time, bus = alg). -c checks the
 * received bytes; -G is refused (the chunks are numbered on the host).
 * Environment: UNIFAB_PP_CHUNK_BYTES (0 = 8 MiB), UNIFAB_PP_CHUNKS_IN_FLIGHT (0 = 4).
 */
#include "cuda_runtime.h"
#include "common.h"
#include "unifab_tests.h"

namespace {

struct PpState {
  unifabPpGroup_t group;
  cudaStream_t recvStream;
  cudaEvent_t forked, received;
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
    CUDACHECK(cudaStreamCreateWithFlags(&s->recvStream, cudaStreamNonBlocking));
    CUDACHECK(cudaEventCreateWithFlags(&s->forked, cudaEventDisableTiming));
    CUDACHECK(cudaEventCreateWithFlags(&s->received, cudaEventDisableTiming));
    ppStates.put(comm, s);
  }
  *out = s;
  return testSuccess;
}

}  // namespace

void PpGetCollByteCount(size_t* sendcount, size_t* recvcount, size_t* paramcount, size_t* sendInplaceOffset,
                        size_t* recvInplaceOffset, size_t count, size_t eltSize, int nranks) {
  *sendcount = count;
  *recvcount = count;
  *sendInplaceOffset = 0;
  *recvInplaceOffset = 0;
  *paramcount = *sendcount;
}

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
    TESTCHECK(InitData(args->expected[i], recvcount, peer * recvcount, type, ncclSum, rep, 1, 0));
    CUDACHECK(cudaDeviceSynchronize());
  }
  args->reportErrors = in_place ? 0 : 1;  // in place cannot hold what is sent and received at once
  return testSuccess;
}

void PpGetBw(size_t count, size_t typesize, double sec, double* algBw, double* busBw, int nranks) {
  *algBw = (double)(count * typesize) / 1.0E9 / sec;
  *busBw = *algBw;
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
  int nRanks, rank;
  NCCLCHECK(ncclCommCount(comm, &nRanks));
  NCCLCHECK(ncclCommUserRank(comm, &rank));
  const size_t bytes = count * wordSize(type);
  CUDACHECK(cudaEventRecord(s->forked, stream));
  CUDACHECK(cudaStreamWaitEvent(s->recvStream, s->forked, 0));
  UNIFABCHECK(unifabPpSend(s->group, (char*)sendbuff + sendoffset, bytes, (rank + 1) % nRanks, stream));
  UNIFABCHECK(unifabPpRecv(s->group, (char*)recvbuff + recvoffset, bytes, (rank - 1 + nRanks) % nRanks, s->recvStream));
  CUDACHECK(cudaEventRecord(s->received, s->recvStream));
  CUDACHECK(cudaStreamWaitEvent(stream, s->received, 0));
  return testSuccess;
}

struct testColl ppTest = {"PpSendRecv", PpGetCollByteCount, PpInitData, PpGetBw, PpRunColl};

void PpGetBuffSize(size_t* sendcount, size_t* recvcount, size_t count, int nranks) {
  size_t paramcount, sendInplaceOffset, recvInplaceOffset;
  PpGetCollByteCount(sendcount, recvcount, &paramcount, &sendInplaceOffset, &recvInplaceOffset, count, 1, nranks);
}

testResult_t PpRunTest(struct threadArgs* args, int root, ncclDataType_t type, const char* typeName, ncclRedOp_t op,
                       const char* opName) {
  TESTCHECK(unifabTestOneGpuPerThread(args));
  args->collTest = &ppTest;
  // Bytes move as they are: one type, no reduction.
  TESTCHECK(TimeTest(args, (int)type != -1 ? type : ncclInt8, (int)type != -1 ? typeName : "int8",
                     (ncclRedOp_t)0, "none", -1));
  return testSuccess;
}

struct testEngine ppEngine = {
  .getBuffSize = PpGetBuffSize,
  .runTest = PpRunTest,
};

#pragma weak ncclTestEngine=ppEngine
