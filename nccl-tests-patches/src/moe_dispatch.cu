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

testResult_t DispatchInitData(struct threadArgs* args, ncclDataType_t type, ncclRedOp_t op, int root, int rep,
                              int in_place) {
  return unifabEpInitData(args, type, rep, in_place, -1);
}

testResult_t DispatchRunColl(void* sendbuff, size_t sendoffset, void* recvbuff, size_t recvoffset, size_t count,
                             ncclDataType_t type, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream,
                             int deviceImpl) {
  if (deviceImpl != 0) return testNotImplemented;
  UnifabEpState* s = NULL;
  TESTCHECK(unifabEpState(comm, &s));
  unifabEpRanksPerToken = s->ranksPerToken;
  const int tokens = unifabEpTokens(s, count * wordSize(type));
  TESTCHECK(unifabEpDispatchOnce(s, (char*)sendbuff + sendoffset, tokens, stream));
  if (unifabEpChecking(s) && tokens > 0) {
    CUDACHECK(cudaMemcpyAsync((char*)recvbuff + recvoffset, s->received, (size_t)tokens * unifabEpBytesPerToken(s),
                              cudaMemcpyDeviceToDevice, stream));
  }
  return testSuccess;
}

struct testColl dispatchTest = {"MoeDispatch", unifabSameByteCount, DispatchInitData, unifabEpGetBw,
                                DispatchRunColl};

testResult_t DispatchRunTest(struct threadArgs* args, int root, ncclDataType_t type, const char* typeName,
                             ncclRedOp_t op, const char* opName) {
  unifabEpMaxBytes = args->maxbytes;
  TESTCHECK(unifabRunTest(args, &dispatchTest, type, typeName, ncclInt8, "int8"));
  return unifabEpRelease(args->comms[0]);
}

struct testEngine dispatchEngine = {
  .getBuffSize = unifabGetBuffSize,
  .runTest = DispatchRunTest,
};

#pragma weak ncclTestEngine=dispatchEngine
