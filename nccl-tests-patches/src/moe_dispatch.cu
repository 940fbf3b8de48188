/*
 * moe_dispatch_perf: unifab's MoE dispatch on the test's communicator. The size is this rank's
 * input: size / (hidden x bytes per value) tokens (BF16, or FP8 with UNIFAB_EP_FP8=1 in the
 * high-throughput mode; the low-latency mode takes BF16 and casts to FP8 itself). algbw counts the
 * input bytes; busbw counts every received row, own rank included, as DeepEP does (algbw x the
 * routing's average ranks per token).
 * -c: with UNIFAB_EP_ROUTING=1 (every token to rank + 1) in the high-throughput mode, the rows
 * received from rank - 1 are copied into the receive buffer after each dispatch (that copy is
 * then part of the time) and checked; not checked otherwise. -G: both modes can be captured.
 * Environment: UNIFAB_EP_MODE (0 high throughput, 1 low latency), UNIFAB_EP_HIDDEN (7168),
 * UNIFAB_EP_TOPK (8), UNIFAB_EP_EXPERTS (256), UNIFAB_EP_FP8 (0), UNIFAB_EP_ROUTING (0).
 */
#include "cuda_runtime.h"
#include "common.h"
#include "unifab_tests.h"

namespace {

struct DispatchCalls {
  unifabEpHandle_t handle = NULL;
};
UnifabPerComm<DispatchCalls> dispatchCalls;

bool checking(const UnifabEpState* s) { return s->shift && !s->lowLatency; }

}  // namespace

void DispatchGetCollByteCount(size_t* sendcount, size_t* recvcount, size_t* paramcount, size_t* sendInplaceOffset,
                              size_t* recvInplaceOffset, size_t count, size_t eltSize, int nranks) {
  *sendcount = count;
  *recvcount = count;  // what -c compares: rank - 1's tokens
  *sendInplaceOffset = 0;
  *recvInplaceOffset = 0;
  *paramcount = count;
}

testResult_t DispatchInitData(struct threadArgs* args, ncclDataType_t type, ncclRedOp_t op, int root, int rep,
                              int in_place) {
  size_t count = args->sendBytes / wordSize(type);
  int nranks = args->nProcs * args->nThreads * args->nGpus;
  bool check = false;
  for (int i = 0; i < args->nGpus; i++) {
    CUDACHECK(cudaSetDevice(args->gpus[i]));
    int rank = unifabTestRank(args, i);
    UnifabEpState* s = NULL;
    TESTCHECK(unifabEpState(args->comms[i], &s));
    check = checking(s);
    TESTCHECK(InitData(args->sendbuffs[i], count, rank * count, type, ncclSum, rep, 1, 0));
    CUDACHECK(cudaMemset(args->recvbuffs[i], 0, args->expectedBytes));
    int peer = (rank - 1 + nranks) % nranks;
    TESTCHECK(InitData(args->expected[i], count, peer * count, type, ncclSum, rep, 1, 0));
    // Whole tokens only: the bytes past them are never sent.
    const size_t sent = (size_t)unifabEpTokens(s, args->sendBytes) * unifabEpBytesPerToken(s);
    if (sent < args->expectedBytes) CUDACHECK(cudaMemset((char*)args->expected[i] + sent, 0, args->expectedBytes - sent));
    CUDACHECK(cudaDeviceSynchronize());
  }
  args->reportErrors = (check && !in_place) ? 1 : 0;
  return testSuccess;
}

static double dispatchRanksPerToken = 1.0;

void DispatchGetBw(size_t count, size_t typesize, double sec, double* algBw, double* busBw, int nranks) {
  *algBw = (double)(count * typesize) / 1.0E9 / sec;
  *busBw = *algBw * dispatchRanksPerToken;
}

testResult_t DispatchRunColl(void* sendbuff, size_t sendoffset, void* recvbuff, size_t recvoffset, size_t count,
                             ncclDataType_t type, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream,
                             int deviceImpl) {
  if (deviceImpl != 0) return testNotImplemented;
  UnifabEpState* s = NULL;
  TESTCHECK(unifabEpState(comm, &s));
  dispatchRanksPerToken = s->ranksPerToken;
  DispatchCalls* calls = dispatchCalls.find(comm);
  if (calls == NULL) {
    calls = new DispatchCalls();
    dispatchCalls.put(comm, calls);
  }
  const int tokens = unifabEpTokens(s, count * wordSize(type));
  unifabEpDispatchResult_t result;
  unifabEpLowLatencyDispatchResult_t llResult;
  TESTCHECK(unifabEpDispatchOnce(s, (char*)sendbuff + sendoffset, tokens, stream, &calls->handle, &result, &llResult));
  if (checking(s) && tokens > 0) {
    CUDACHECK(cudaMemcpyAsync((char*)recvbuff + recvoffset, result.recvX, (size_t)tokens * unifabEpBytesPerToken(s),
                              cudaMemcpyDeviceToDevice, stream));
  }
  return testSuccess;
}

struct testColl dispatchTest = {"MoeDispatch", DispatchGetCollByteCount, DispatchInitData, DispatchGetBw,
                                DispatchRunColl};

void DispatchGetBuffSize(size_t* sendcount, size_t* recvcount, size_t count, int nranks) {
  size_t paramcount, sendInplaceOffset, recvInplaceOffset;
  DispatchGetCollByteCount(sendcount, recvcount, &paramcount, &sendInplaceOffset, &recvInplaceOffset, count, 1, nranks);
}

testResult_t DispatchRunTest(struct threadArgs* args, int root, ncclDataType_t type, const char* typeName,
                             ncclRedOp_t op, const char* opName) {
  TESTCHECK(unifabTestOneGpuPerThread(args));
  unifabEpMaxBytes = args->maxbytes;
  args->collTest = &dispatchTest;
  TESTCHECK(TimeTest(args, (int)type != -1 ? type : ncclInt8, (int)type != -1 ? typeName : "int8",
                     (ncclRedOp_t)0, "none", -1));
  return testSuccess;
}

struct testEngine dispatchEngine = {
  .getBuffSize = DispatchGetBuffSize,
  .runTest = DispatchRunTest,
};

#pragma weak ncclTestEngine=dispatchEngine
