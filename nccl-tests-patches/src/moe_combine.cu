/*
 * moe_combine_perf: unifab's MoE combine on the test's communicator, with identity experts (each
 * expert's output row is the row it received, BF16). The size is this rank's tokens, BF16:
 * size / (hidden x 2) tokens. High-throughput mode: each call is one combine of the latest
 * dispatch of that size (the first call at a new size dispatches first, and that dispatch is part
 * of its time: use enough iterations, -n, for it not to matter). Low-latency mode: each call is a
 * dispatch and its combine (a combine completes one dispatch only). algbw counts the output
 * bytes; busbw every row sent back, own rank included (algbw x the routing's ranks per token).
 * -c: with UNIFAB_EP_ROUTING=1 in the high-throughput mode every token comes back unchanged and
 * is checked; not checked otherwise. Environment as moe_dispatch_perf (BF16 only), and
 * UNIFAB_EP_COMBINE_INPUT=1 (high throughput): the expert outputs sit in the group's combine input,
 * which the other ranks read in place (unifabEpCombineInputBuffer).
 */
#include "cuda_runtime.h"
#include "common.h"
#include "unifab_tests.h"

testResult_t CombineInitData(struct threadArgs* args, ncclDataType_t type, ncclRedOp_t op, int root, int rep,
                             int in_place) {
  return unifabEpInitData(args, type, rep, in_place, 0);
}

testResult_t CombineRunColl(void* sendbuff, size_t sendoffset, void* recvbuff, size_t recvoffset, size_t count,
                            ncclDataType_t type, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream,
                            int deviceImpl) {
  if (deviceImpl != 0) return testNotImplemented;
  UnifabEpState* s = NULL;
  TESTCHECK(unifabEpState(comm, &s));
  if (s->fp8) {
    printf("moe_combine_perf: combine returns BF16 expert outputs: unset UNIFAB_EP_FP8\n");
    return testInvalidUsage;
  }
  unifabEpRanksPerToken = s->ranksPerToken;
  const int tokens = unifabEpTokens(s, count * wordSize(type));
  // The harness moves its buffers between calls; combine reads none of them, so only a new size
  // (or new data, for -c) needs a new dispatch. A low-latency combine completes one dispatch only.
  const bool freshDispatch = s->lowLatency || s->dispatched != tokens;
  if (freshDispatch) TESTCHECK(unifabEpDispatchOnce(s, (char*)sendbuff + sendoffset, tokens, stream));
  if (s->lowLatency) {
    unifabEpLowLatencyCombineArgs_t a = UNIFAB_EP_LL_COMBINE_ARGS_INIT;
    a.expertOutput = s->received;
    a.weighted = 0;
    a.combinedX = (char*)recvbuff + recvoffset;
    UNIFABCHECK(unifabEpLowLatencyCombine(s->group, s->handle, &a, stream));
  } else {
    unifabEpCombineArgs_t a = UNIFAB_EP_COMBINE_ARGS_INIT;
    a.expertOutput = s->received;
    if (unifabTestParam("UNIFAB_EP_COMBINE_INPUT", 0) != 0) {
      /* The identity experts' outputs go to the group's combine input, which the peers read in
       * place (where an expert GEMM would write them): copied once per dispatch, outside combine. */
      void* input = NULL;
      int rows = 0;
      UNIFABCHECK(unifabEpCombineInputBuffer(s->group, &input, &rows));
      if (freshDispatch) {
        CUDACHECK(cudaMemcpyAsync(input, s->received, (size_t)rows * s->hidden * 2, cudaMemcpyDeviceToDevice, stream));
      }
      a.expertOutput = input;
    }
    a.weighted = 0;
    a.combinedX = (char*)recvbuff + recvoffset;
    UNIFABCHECK(unifabEpCombine(s->group, s->handle, &a, stream));
  }
  return testSuccess;
}

struct testColl combineTest = {"MoeCombine", unifabSameByteCount, CombineInitData, unifabEpGetBw, CombineRunColl};

testResult_t CombineRunTest(struct threadArgs* args, int root, ncclDataType_t type, const char* typeName,
                            ncclRedOp_t op, const char* opName) {
  // Tokens and expert outputs are BF16 whatever -d says: other data read as BF16 can hold NaNs,
  // which the sum would not return bit for bit.
  if ((int)type != -1 && type != ncclBfloat16) {
    printf("moe_combine_perf: runs on bfloat16 data only (-d bfloat16 or -d all)\n");
    return testSuccess;
  }
  unifabEpMaxBytes = args->maxbytes;
  TESTCHECK(unifabRunTest(args, &combineTest, ncclBfloat16, "bfloat16", ncclBfloat16, "bfloat16"));
  return unifabEpRelease(args->comms[0]);
}

struct testEngine combineEngine = {
  .getBuffSize = unifabGetBuffSize,
  .runTest = CombineRunTest,
};

#pragma weak ncclTestEngine=combineEngine
