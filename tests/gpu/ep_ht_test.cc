// High-throughput EP dispatch and combine against the CPU reference, one process per GPU under
// unifab-launch (1 or more ranks). Every case draws fresh random inputs (uneven token counts per
// rank, masked top-k entries), poisons the outputs, and checks bit for bit: payload bytes, FP8
// scales, local expert ids, weights, sources, counts, and combine's sums in their fixed order.
// Also: combine from the group's combine input (read in place by the peers), cached re-dispatch
// with new payloads, dispatch + experts + combine (both ways) captured in one CUDA graph and
// replayed with fresh inputs, and pulling and pushing combines back to back with no host
// synchronisation and one rank held back.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/common/check_tally.h"
#include "tests/common/device_data.h"
#include "tests/common/ep_device.h"
#include "tests/common/ep_reference.h"
#include "tests/common/nccl_session.h"
#include "unifab/unifab.h"

using namespace unifab::test;
using namespace unifab::test::ep;

namespace {





// Poisons every output array of the group (all ranks) so unwritten rows cannot pass.
bool poison(NcclSession& session, const unifabEpDispatchResult_t& r, const Shape& shape) {
  size_t rows = static_cast<size_t>(r.maxRows);
  TEST_CUDA_CHECK(cudaMemsetAsync(r.recvX, 0xff, rows * shape.hidden * 2, session.stream()));
  if (r.recvScales != nullptr) TEST_CUDA_CHECK(cudaMemsetAsync(r.recvScales, 0xff, rows * (shape.hidden / 128) * 4, session.stream()));
  TEST_CUDA_CHECK(cudaMemsetAsync(r.recvTopkIdx, 0xee, rows * shape.topk * 4, session.stream()));
  TEST_CUDA_CHECK(cudaMemsetAsync(r.recvTopkWeights, 0xff, rows * shape.topk * 4, session.stream()));
  TEST_CUDA_CHECK(cudaMemsetAsync(r.recvSource, 0xee, rows * 2 * 4, session.stream()));
  return session.barrier(true);  // no rank dispatches into memory another rank still poisons
}

struct Outputs {
  std::vector<uint8_t> x;
  std::vector<float> scales;
  std::vector<int> topk;
  std::vector<float> weights;
  std::vector<int> source;
  int rows = 0;
  std::vector<int> perExpert;
  std::vector<int> perRank;
  std::vector<int> offsets;
};

bool fetch(const unifabEpDispatchResult_t& r, const Shape& shape, bool fp8, cudaStream_t stream, Outputs* o) {
  std::vector<int> rows;
  if (!download(&rows, r.numRecvRows, 1, stream)) return false;
  o->rows = rows[0];
  if (o->rows < 0 || o->rows > r.maxRows) {
    check(false, "numRecvRows=" + std::to_string(o->rows) + " outside 0.." + std::to_string(r.maxRows));
    return false;
  }
  size_t n = static_cast<size_t>(o->rows);
  size_t valueBytes = fp8 ? 1 : 2;
  return download(&o->x, r.recvX, n * shape.hidden * valueBytes, stream) &&
         (!fp8 || download(&o->scales, r.recvScales, n * (shape.hidden / 128), stream)) &&
         download(&o->topk, r.recvTopkIdx, n * shape.topk, stream) && download(&o->weights, r.recvTopkWeights, n * shape.topk, stream) &&
         download(&o->source, r.recvSource, n * 2, stream) &&
         download(&o->perExpert, r.recvRowsPerExpert, shape.localExperts(), stream) &&
         download(&o->perRank, r.recvRowsPerRank, shape.nRanks, stream) &&
         download(&o->offsets, r.expertOffsets, shape.localExperts() + 1, stream);
}

// Compares output row `got` with the expected row of rank-major index `j`.
void compareRow(const Shape& shape, const std::vector<RankInput>& inputs, const Received& expect, const Outputs& o,
                size_t got, int j, const std::string& what) {
  const Row& row = expect.rankMajor[j];
  const RankInput& in = inputs[row.sourceRank];
  bool ok = o.source[2 * got] == row.sourceRank && o.source[2 * got + 1] == row.sourceToken;
  size_t rowBytes = static_cast<size_t>(shape.hidden) * (in.fp8 ? 1 : 2);
  ok = ok && memcmp(&o.x[got * rowBytes], &in.x[static_cast<size_t>(row.sourceToken) * rowBytes], rowBytes) == 0;
  if (in.fp8) {
    size_t per = shape.hidden / 128;
    ok = ok && memcmp(&o.scales[got * per], &in.scales[static_cast<size_t>(row.sourceToken) * per], per * 4) == 0;
  }
  for (int k = 0; k < shape.topk; ++k) {
    ok = ok && o.topk[got * shape.topk + k] == row.localTopk[k];
    ok = ok && memcmp(&o.weights[got * shape.topk + k], &row.localWeights[k], 4) == 0;
  }
  if (!ok) check(false, what + ": row " + std::to_string(got) + " (source " + std::to_string(row.sourceRank) + ":" +
                            std::to_string(row.sourceToken) + ") differs");
}

bool verifyDispatch(const Shape& shape, const std::vector<RankInput>& inputs, int rank, bool expertMajor, int alignment,
                    const Outputs& o, const std::string& what) {
  Received expect = expectedReceive(shape, inputs, rank, alignment);
  int failedBefore = tally().failed;
  check(o.perExpert == expect.rowsPerExpert, what + ": per-expert counts");
  check(o.perRank == expect.rowsPerRank, what + ": per-source-rank counts");
  if (!expertMajor) {
    check(o.rows == static_cast<int>(expect.rankMajor.size()),
          what + ": " + std::to_string(o.rows) + " rows, expected " + std::to_string(expect.rankMajor.size()));
    if (tally().failed != failedBefore) return true;
    for (size_t j = 0; j < expect.rankMajor.size(); ++j) compareRow(shape, inputs, expect, o, j, static_cast<int>(j), what);
  } else {
    check(o.offsets == expect.expertOffsets, what + ": expert offsets");
    check(o.rows == expect.expertOffsets.back(),
          what + ": " + std::to_string(o.rows) + " expert-major rows, expected " + std::to_string(expect.expertOffsets.back()));
    if (tally().failed != failedBefore) return true;
    for (size_t p = 0; p < expect.expertRows.size(); ++p) {
      if (expect.expertRows[p] >= 0) compareRow(shape, inputs, expect, o, p, expect.expertRows[p], what);
    }
  }
  if (tally().failed == failedBefore) ++tally().passed;
  return true;
}

bool verifyCombine(const Shape& shape, const std::vector<RankInput>& inputs, int rank, bool expertMajor, bool weighted,
                   uint64_t outputSeed, const void* combinedX, const float* combinedWeights, cudaStream_t stream,
                   const std::string& what) {
  std::vector<uint16_t> expected;
  std::vector<float> expectedWeights;
  expectedCombine(shape, inputs, rank, expertMajor, weighted, outputSeed, &expected, &expectedWeights);
  std::vector<uint16_t> got;
  std::vector<float> gotWeights;
  if (!download(&got, combinedX, expected.size(), stream) || !download(&gotWeights, combinedWeights, expectedWeights.size(), stream)) {
    return false;
  }
  size_t bad = 0;
  for (size_t i = 0; i < expected.size(); ++i) bad += got[i] != expected[i] ? 1 : 0;
  check(bad == 0, what + ": " + std::to_string(bad) + " of " + std::to_string(expected.size()) + " combined values differ");
  check(memcmp(gotWeights.data(), expectedWeights.data(), expectedWeights.size() * 4) == 0, what + ": combined weights");
  return true;
}

struct Case {
  Shape shape;
  bool fp8;
  bool expertMajor;
  int alignment;
  bool int32Ids;
  bool hostCounts;
  bool weighted;
  int numSms;  // 0: the group's choice; 1..3 exercise one block doing both roles and small splits
  bool unevenSms;  // dispatch: rank r runs numSms + r blocks (the count words carry each rank's)
};

// One dispatch on the session's stream, waited for, with the group's asynchronous error checked.
bool dispatchAndWait(NcclSession& session, unifabEpGroup_t group, const unifabEpDispatchArgs_t& args,
                     unifabEpHandle_t* handle, unifabEpDispatchResult_t* result) {
  result->size = sizeof(*result);
  TEST_UNIFAB_CHECK(unifabEpDispatch(group, &args, session.stream(), handle, result));
  TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  TEST_UNIFAB_CHECK(unifabEpGetAsyncError(group));
  return true;
}

std::string describe(const Case& c) {
  char text[200];
  snprintf(text, sizeof(text), "E%d H%d top-%d %s %s%s SMs %d%s", c.shape.numExperts, c.shape.hidden, c.shape.topk,
           c.fp8 ? "fp8" : "bf16", c.expertMajor ? "expert-major/" : "rank-major",
           c.expertMajor ? std::to_string(c.alignment).c_str() : "", c.numSms, c.unevenSms ? " + rank" : "");
  return text;
}

struct Buffers {
  DeviceInput input;
  uint16_t* expertOut = nullptr;
  uint16_t* combined = nullptr;
  float* combinedWeights = nullptr;
};

bool runCase(NcclSession& session, unifabEpGroup_t group, const Case& c, uint64_t seed, Buffers& b,
             unifabEpDispatchResult_t* last) {
  const Shape& shape = c.shape;
  const std::string what = describe(c) + " seed " + std::to_string(seed);
  std::vector<RankInput> inputs;
  for (int r = 0; r < shape.nRanks; ++r) inputs.push_back(makeInput(shape, r, seed, c.fp8, 10));
  const RankInput& mine = inputs[session.rank()];
  if (!b.input.upload(mine, c.int32Ids, session.stream())) return false;
  if (!poison(session, *last, shape)) return false;

  unifabEpDispatchArgs_t args = UNIFAB_EP_DISPATCH_ARGS_INIT;
  args.numTokens = mine.numTokens;
  args.dtype = c.fp8 ? unifabEpFp8E4M3 : unifabEpBf16;
  args.x = b.input.x;
  args.scales = b.input.scales;
  args.topkIdx = b.input.topk;
  args.topkIdxType = c.int32Ids ? unifabEpIndexInt32 : unifabEpIndexInt64;
  args.topkWeights = b.input.weights;
  args.layout = c.expertMajor ? unifabEpExpertMajor : unifabEpRankMajor;
  args.expertAlignment = c.alignment;
  args.hostCounts = c.hostCounts ? 1 : 0;
  args.numSms = c.numSms + (c.unevenSms ? session.rank() : 0);
  unifabEpHandle_t handle = nullptr;
  unifabEpDispatchResult_t result;
  if (!dispatchAndWait(session, group, args, &handle, &result)) return false;
  *last = result;
  Outputs o;
  if (!fetch(result, shape, c.fp8, session.stream(), &o)) return false;
  verifyDispatch(shape, inputs, session.rank(), c.expertMajor, c.alignment, o, what);
  if (c.hostCounts) {
    check(result.hostNumRecvRows == o.rows, what + ": host row count");
    bool same = true;
    for (int e = 0; e < shape.localExperts(); ++e) same = same && result.hostRecvRowsPerExpert[e] == o.perExpert[e];
    check(same, what + ": host per-expert counts");
  }

  // Experts, then combine back.
  uint64_t outputSeed = seed * 7 + 3;
  TEST_CUDA_CHECK(fillExpertOutputs(b.expertOut, shape.hidden, result.recvSource, result.numRecvRows, c.expertMajor,
                                    result.expertOffsets, result.recvRowsPerExpert, shape.localExperts(), session.rank(),
                                    outputSeed, result.maxRows, session.stream()));
  TEST_CUDA_CHECK(cudaMemsetAsync(b.combined, 0xff, static_cast<size_t>(shape.maxTokens) * shape.hidden * 2, session.stream()));
  TEST_CUDA_CHECK(cudaMemsetAsync(b.combinedWeights, 0xff, static_cast<size_t>(shape.maxTokens) * shape.topk * 4, session.stream()));
  unifabEpCombineArgs_t cargs = UNIFAB_EP_COMBINE_ARGS_INIT;
  cargs.expertOutput = b.expertOut;
  cargs.weighted = c.weighted ? 1 : 0;
  cargs.combinedX = b.combined;
  cargs.combinedWeights = b.combinedWeights;
  cargs.numSms = c.numSms == 0 ? 2 : 0;  // a different split from the dispatch's
  TEST_UNIFAB_CHECK(unifabEpCombine(group, handle, &cargs, session.stream()));
  TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  TEST_UNIFAB_CHECK(unifabEpGetAsyncError(group));
  verifyCombine(shape, inputs, session.rank(), c.expertMajor, c.weighted && c.expertMajor, outputSeed, b.combined,
                b.combinedWeights, session.stream(), what + " combine");
  if (!c.expertMajor) {
    // The same combine again from the group's combine input, which the peers read in place.
    void* combineInput = nullptr;
    int inputRows = 0;
    TEST_UNIFAB_CHECK(unifabEpCombineInputBuffer(group, &combineInput, &inputRows));
    check(inputRows >= result.maxRows, what + ": combine input holds " + std::to_string(inputRows) + " rows, fewer than " +
                                           std::to_string(result.maxRows));
    const uint64_t pullSeed = outputSeed + 1;
    TEST_CUDA_CHECK(fillExpertOutputs(static_cast<uint16_t*>(combineInput), shape.hidden, result.recvSource,
                                      result.numRecvRows, false, result.expertOffsets, result.recvRowsPerExpert,
                                      shape.localExperts(), session.rank(), pullSeed, result.maxRows, session.stream()));
    TEST_CUDA_CHECK(cudaMemsetAsync(b.combined, 0xff, static_cast<size_t>(shape.maxTokens) * shape.hidden * 2, session.stream()));
    TEST_CUDA_CHECK(cudaMemsetAsync(b.combinedWeights, 0xff, static_cast<size_t>(shape.maxTokens) * shape.topk * 4, session.stream()));
    cargs.expertOutput = combineInput;
    cargs.numSms = c.numSms;
    TEST_UNIFAB_CHECK(unifabEpCombine(group, handle, &cargs, session.stream()));
    TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
    TEST_UNIFAB_CHECK(unifabEpGetAsyncError(group));
    verifyCombine(shape, inputs, session.rank(), false, false, pullSeed, b.combined, b.combinedWeights,
                  session.stream(), what + " combine from the combine input");
  }

  // Cached re-dispatch: same routing, new payload values.
  std::vector<RankInput> again;
  for (int r = 0; r < shape.nRanks; ++r) {
    RankInput fresh = makeInput(shape, r, seed + 1000003, c.fp8, 10, inputs[r].numTokens);
    fresh.topk = inputs[r].topk;
    fresh.weights = inputs[r].weights;
    again.push_back(fresh);
  }
  if (!b.input.upload(again[session.rank()], c.int32Ids, session.stream())) return false;
  if (!poison(session, *last, shape)) return false;
  args.cachedHandle = handle;
  args.topkIdx = nullptr;
  args.hostCounts = 0;
  // The routing does not depend on the block count, nor on the peers' counts.
  args.numSms = (c.numSms == 3 ? 0 : 3) + (c.unevenSms ? session.rank() : 0);
  unifabEpHandle_t same = nullptr;
  TEST_UNIFAB_CHECK(unifabEpDispatch(group, &args, session.stream(), &same, &result));
  TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  TEST_UNIFAB_CHECK(unifabEpGetAsyncError(group));
  check(same == handle, what + ": cached dispatch returns its handle");
  if (!fetch(result, shape, c.fp8, session.stream(), &o)) return false;
  verifyDispatch(shape, again, session.rank(), c.expertMajor, c.alignment, o, what + " cached");
  TEST_UNIFAB_CHECK(unifabEpHandleDestroy(handle));
  return true;
}

// Dispatch arguments for `numTokens` BF16 tokens of `input` with their top-k ids and weights.
unifabEpDispatchArgs_t bf16DispatchArgs(const DeviceInput& input, int numTokens) {
  unifabEpDispatchArgs_t args = UNIFAB_EP_DISPATCH_ARGS_INIT;
  args.numTokens = numTokens;
  args.x = input.x;
  args.topkIdx = input.topk;
  args.topkWeights = input.weights;
  return args;
}

// dispatch -> experts -> combine captured once, replayed with fresh inputs of the same size.
bool runGraph(NcclSession& session, unifabEpGroup_t group, const Shape& shape, Buffers& b, int replays,
              bool fromCombineInput, unifabEpDispatchResult_t* last) {
  uint16_t* expertOut = b.expertOut;
  if (fromCombineInput) {
    void* combineInput = nullptr;
    TEST_UNIFAB_CHECK(unifabEpCombineInputBuffer(group, &combineInput, nullptr));
    expertOut = static_cast<uint16_t*>(combineInput);
  }
  const int tokens = shape.maxTokens / 2 + session.rank();  // uneven, fixed for the graph
  std::vector<RankInput> inputs;
  for (int r = 0; r < shape.nRanks; ++r) inputs.push_back(makeInput(shape, r, 4242, false, 10, shape.maxTokens / 2 + r));
  if (!b.input.upload(inputs[session.rank()], false, session.stream())) return false;
  if (!session.barrier(true)) return false;
  unifabEpDispatchArgs_t args = bf16DispatchArgs(b.input, tokens);
  unifabEpCombineArgs_t cargs = UNIFAB_EP_COMBINE_ARGS_INIT;
  cargs.expertOutput = b.expertOut;
  cargs.combinedX = b.combined;
  cargs.combinedWeights = b.combinedWeights;
  unifabEpHandle_t handle = nullptr;
  unifabEpDispatchResult_t result;
  result.size = sizeof(result);
  const uint64_t outputSeed = 99;
  cargs.expertOutput = expertOut;
  cudaGraph_t graph = nullptr;
  TEST_CUDA_CHECK(cudaStreamBeginCapture(session.stream(), cudaStreamCaptureModeGlobal));
  unifabResult_t dispatched = unifabEpDispatch(group, &args, session.stream(), &handle, &result);
  cudaError_t filled = dispatched == unifabSuccess
                           ? fillExpertOutputs(expertOut, shape.hidden, result.recvSource, result.numRecvRows, false,
                                               result.expertOffsets, result.recvRowsPerExpert, shape.localExperts(),
                                               session.rank(), outputSeed, result.maxRows, session.stream())
                           : cudaSuccess;
  unifabResult_t combined = dispatched == unifabSuccess ? unifabEpCombine(group, handle, &cargs, session.stream()) : dispatched;
  TEST_CUDA_CHECK(cudaStreamEndCapture(session.stream(), &graph));
  TEST_UNIFAB_CHECK(dispatched);
  TEST_CUDA_CHECK(filled);
  TEST_UNIFAB_CHECK(combined);
  cudaGraphExec_t exec = nullptr;
  TEST_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < replays; ++replay) {
    std::vector<RankInput> fresh;
    for (int r = 0; r < shape.nRanks; ++r) fresh.push_back(makeInput(shape, r, 5000 + replay, false, 10, shape.maxTokens / 2 + r));
    if (!b.input.upload(fresh[session.rank()], false, session.stream())) return false;
    if (!poison(session, result, shape)) return false;
    TEST_CUDA_CHECK(cudaMemsetAsync(b.combined, 0xff, static_cast<size_t>(shape.maxTokens) * shape.hidden * 2, session.stream()));
    TEST_CUDA_CHECK(cudaMemsetAsync(b.combinedWeights, 0xff, static_cast<size_t>(shape.maxTokens) * shape.topk * 4, session.stream()));
    TEST_CUDA_CHECK(cudaGraphLaunch(exec, session.stream()));
    TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
    TEST_UNIFAB_CHECK(unifabEpGetAsyncError(group));
    Outputs o;
    if (!fetch(result, shape, false, session.stream(), &o)) return false;
    std::string what = std::string(fromCombineInput ? "combine-input " : "") + "graph replay " + std::to_string(replay);
    verifyDispatch(shape, fresh, session.rank(), false, 1, o, what);
    verifyCombine(shape, fresh, session.rank(), false, false, outputSeed, b.combined, b.combinedWeights,
                  session.stream(), what + " combine");
  }
  *last = result;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  TEST_UNIFAB_CHECK(unifabEpHandleDestroy(handle));
  return true;
}

// Combines of one dispatch issued back to back with no host synchronisation, one rank held back
// on the GPU before each fill: pull, pull, push, pull; then (after the host waits for the new
// payload's upload on this rank only) a cached re-dispatch. A peer that read
// a combine input before its rank filled it or after the next fill, a fill over rows a peer was
// still reading, or a push into the combine input while it was read, shows as a wrong sum in one
// of the four outputs (each with its own expert outputs) or a wrong row in the re-dispatch.
bool runUnsyncedSequence(NcclSession& session, unifabEpGroup_t group, const Shape& shape, Buffers& b,
                         unifabEpDispatchResult_t* last) {
  const uint64_t seed = 8080 + static_cast<uint64_t>(shape.hidden);
  std::vector<RankInput> inputs;
  for (int r = 0; r < shape.nRanks; ++r) inputs.push_back(makeInput(shape, r, seed, false, 10));
  const RankInput& mine = inputs[session.rank()];
  if (!b.input.upload(mine, false, session.stream())) return false;
  if (!poison(session, *last, shape)) return false;
  unifabEpDispatchArgs_t args = bf16DispatchArgs(b.input, mine.numTokens);
  unifabEpHandle_t handle = nullptr;
  unifabEpDispatchResult_t result;
  result.size = sizeof(result);
  TEST_UNIFAB_CHECK(unifabEpDispatch(group, &args, session.stream(), &handle, &result));
  *last = result;
  void* combineInput = nullptr;
  TEST_UNIFAB_CHECK(unifabEpCombineInputBuffer(group, &combineInput, nullptr));
  constexpr int kCombines = 4;
  const bool pulls[kCombines] = {true, true, false, true};
  const size_t outBytes = static_cast<size_t>(shape.maxTokens) * shape.hidden * 2;
  const size_t weightBytes = static_cast<size_t>(shape.maxTokens) * shape.topk * 4;
  std::vector<void*> outs(kCombines, nullptr), weights(kCombines, nullptr);
  for (int i = 0; i < kCombines; ++i) {
    TEST_CUDA_CHECK(cudaMalloc(&outs[i], outBytes));
    TEST_CUDA_CHECK(cudaMalloc(&weights[i], weightBytes));
  }
  for (int i = 0; i < kCombines; ++i) {
    if (session.rank() == i % shape.nRanks) TEST_CUDA_CHECK(spinOnDevice(200000, session.stream()));
    uint16_t* rows = pulls[i] ? static_cast<uint16_t*>(combineInput) : b.expertOut;
    TEST_CUDA_CHECK(fillExpertOutputs(rows, shape.hidden, result.recvSource, result.numRecvRows, false,
                                      result.expertOffsets, result.recvRowsPerExpert, shape.localExperts(),
                                      session.rank(), seed + i, result.maxRows, session.stream()));
    TEST_CUDA_CHECK(cudaMemsetAsync(outs[i], 0xff, outBytes, session.stream()));
    TEST_CUDA_CHECK(cudaMemsetAsync(weights[i], 0xff, weightBytes, session.stream()));
    unifabEpCombineArgs_t cargs = UNIFAB_EP_COMBINE_ARGS_INIT;
    cargs.expertOutput = rows;
    cargs.combinedX = outs[i];
    cargs.combinedWeights = static_cast<float*>(weights[i]);
    TEST_UNIFAB_CHECK(unifabEpCombine(group, handle, &cargs, session.stream()));
  }
  // Cached re-dispatch with new payloads: the peers may still be combining.
  std::vector<RankInput> again;
  for (int r = 0; r < shape.nRanks; ++r) {
    RankInput fresh = makeInput(shape, r, seed + 1000003, false, 10, inputs[r].numTokens);
    fresh.topk = inputs[r].topk;
    fresh.weights = inputs[r].weights;
    again.push_back(fresh);
  }
  if (!b.input.upload(again[session.rank()], false, session.stream())) return false;
  args.cachedHandle = handle;
  args.topkIdx = nullptr;
  unifabEpHandle_t same = nullptr;
  TEST_UNIFAB_CHECK(unifabEpDispatch(group, &args, session.stream(), &same, &result));
  TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  TEST_UNIFAB_CHECK(unifabEpGetAsyncError(group));
  for (int i = 0; i < kCombines; ++i) {
    verifyCombine(shape, inputs, session.rank(), false, false, seed + i, outs[i], static_cast<float*>(weights[i]),
                  session.stream(), std::string("unsynchronised ") + (pulls[i] ? "pull" : "push") + " combine " +
                                        std::to_string(i));
    cudaFree(outs[i]);
    cudaFree(weights[i]);
  }
  Outputs o;
  if (!fetch(result, shape, false, session.stream(), &o)) return false;
  verifyDispatch(shape, again, session.rank(), false, 1, o, "cached dispatch behind unsynchronised combines");
  TEST_UNIFAB_CHECK(unifabEpHandleDestroy(handle));
  return true;
}

// Ranks that make different dispatches: rank 0 re-dispatches a routing (cached) while the others
// dispatch anew. Every rank must report it (unifabInvalidUsage) instead of writing rows at offsets
// its peers did not plan for. The group is unusable afterwards, as after a timeout.
bool runCallMismatch(NcclSession& session, const Shape& shape) {
  unifabEpConfig_t config = groupConfig(shape);
  unifabEpGroup_t group = nullptr;
  TEST_UNIFAB_CHECK(unifabEpCreate(session.comm(), &config, &group));
  DeviceInput input;
  if (!input.allocate(shape)) return false;
  const RankInput mine = makeInput(shape, session.rank(), 4242, false, 10);
  if (!input.upload(mine, false, session.stream())) return false;
  unifabEpDispatchArgs_t args = bf16DispatchArgs(input, mine.numTokens);
  unifabEpHandle_t handle = nullptr;
  unifabEpDispatchResult_t result;
  if (!dispatchAndWait(session, group, args, &handle, &result)) return false;
  unifabEpHandle_t second = nullptr;
  if (session.rank() == 0) {
    args.cachedHandle = handle;
    args.topkIdx = nullptr;
  }
  TEST_UNIFAB_CHECK(unifabEpDispatch(group, &args, session.stream(), &second, &result));
  TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  const unifabResult_t reported = unifabEpGetAsyncError(group);
  check(reported == unifabInvalidUsage, "a cached re-dispatch on rank 0 only is reported on rank " +
                                            std::to_string(session.rank()) + " as invalid usage (got " +
                                            std::to_string(static_cast<int>(reported)) + ")");
  if (second != handle) TEST_UNIFAB_CHECK(unifabEpHandleDestroy(second));
  TEST_UNIFAB_CHECK(unifabEpHandleDestroy(handle));
  TEST_UNIFAB_CHECK(unifabEpDestroy(group));
  return true;
}

// Back-to-back dispatches while one rank's blocks read their peers' count words late (run with
// UNIFAB_EP_TEST_STALL_US set on rank 1 only): rank 1 sends no rows, so rank 0's dispatches end
// without waiting for rank 1 and its next ones write their count words while rank 1's late blocks
// still read the previous call's. Each call must still see its own words (no timeout), and the
// last call's rows must be right.
bool runLateBlocks(NcclSession& session, const Shape& shape) {
  unifabEpConfig_t config = groupConfig(shape);
  unifabEpGroup_t group = nullptr;
  TEST_UNIFAB_CHECK(unifabEpCreate(session.comm(), &config, &group));
  auto tokensOf = [&](int rank) { return rank == 0 ? shape.maxTokens / 2 : 0; };
  std::vector<RankInput> first, last;
  for (int r = 0; r < shape.nRanks; ++r) {
    first.push_back(makeInput(shape, r, 5151, false, 10, tokensOf(r)));
    last.push_back(makeInput(shape, r, 6262, false, 10, tokensOf(r)));
  }
  DeviceInput firstInput, lastInput;
  if (!firstInput.allocate(shape) || !lastInput.allocate(shape)) return false;
  if (!firstInput.upload(first[session.rank()], false, session.stream()) ||
      !lastInput.upload(last[session.rank()], false, session.stream())) {
    return false;
  }
  if (!session.barrier(true)) return false;
  // Uncached twice, a cached re-dispatch, then uncached with other inputs: no host synchronisation.
  unifabEpDispatchArgs_t args = bf16DispatchArgs(firstInput, tokensOf(session.rank()));
  unifabEpDispatchResult_t result;
  result.size = sizeof(result);
  unifabEpHandle_t handles[3] = {};
  TEST_UNIFAB_CHECK(unifabEpDispatch(group, &args, session.stream(), &handles[0], &result));
  TEST_UNIFAB_CHECK(unifabEpDispatch(group, &args, session.stream(), &handles[1], &result));
  unifabEpDispatchArgs_t cached = args;
  cached.cachedHandle = handles[1];
  cached.topkIdx = nullptr;
  unifabEpHandle_t same = nullptr;
  TEST_UNIFAB_CHECK(unifabEpDispatch(group, &cached, session.stream(), &same, &result));
  unifabEpDispatchArgs_t other = bf16DispatchArgs(lastInput, tokensOf(session.rank()));
  TEST_UNIFAB_CHECK(unifabEpDispatch(group, &other, session.stream(), &handles[2], &result));
  TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  const unifabResult_t reported = unifabEpGetAsyncError(group);
  check(reported == unifabSuccess, "back-to-back dispatches with late blocks on rank 1 end without an error on rank " +
                                       std::to_string(session.rank()) + " (got " +
                                       std::to_string(static_cast<int>(reported)) + ")");
  Outputs o;
  if (reported == unifabSuccess) {
    if (!fetch(result, shape, false, session.stream(), &o)) return false;
    verifyDispatch(shape, last, session.rank(), false, 1, o, "the last of back-to-back dispatches with late blocks");
  }
  for (unifabEpHandle_t handle : handles) TEST_UNIFAB_CHECK(unifabEpHandleDestroy(handle));
  TEST_UNIFAB_CHECK(unifabEpDestroy(group));
  return true;
}

bool runShape(NcclSession& session, Shape shape, int iterations, int replays) {
  unifabEpConfig_t config = groupConfig(shape);
  unifabEpGroup_t group = nullptr;
  TEST_UNIFAB_CHECK(unifabEpCreate(session.comm(), &config, &group));
  Buffers b;
  if (!b.input.allocate(shape)) return false;
  unifabEpDispatchResult_t probe;
  probe.size = sizeof(probe);
  {
    // An empty dispatch reveals where the outputs live, so every real one can be poisoned first.
    unifabEpDispatchArgs_t args = UNIFAB_EP_DISPATCH_ARGS_INIT;
    args.x = b.input.x;
    args.topkIdx = b.input.topk;
    unifabEpHandle_t handle = nullptr;
    TEST_UNIFAB_CHECK(unifabEpDispatch(group, &args, session.stream(), &handle, &probe));
    // The buffers now hold the second dispatch: combine refuses the first one's handle, before
    // launching anything, and the group stays usable.
    unifabEpHandle_t newer = nullptr;
    unifabEpDispatchResult_t again;
    again.size = sizeof(again);
    TEST_UNIFAB_CHECK(unifabEpDispatch(group, &args, session.stream(), &newer, &again));
    unifabEpCombineArgs_t stale = UNIFAB_EP_COMBINE_ARGS_INIT;
    stale.expertOutput = b.input.x;
    check(unifabEpCombine(group, handle, &stale, session.stream()) == unifabInvalidUsage,
          "combine with the handle of an earlier dispatch is refused");
    TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
    check(unifabEpGetAsyncError(group) == unifabSuccess, "a refused combine leaves the group usable");
    TEST_UNIFAB_CHECK(unifabEpHandleDestroy(handle));
    TEST_UNIFAB_CHECK(unifabEpHandleDestroy(newer));
  }
  size_t expertRows = static_cast<size_t>(shape.nRanks) * shape.maxTokens * std::min(shape.topk, shape.localExperts()) +
                      static_cast<size_t>(shape.localExperts()) * 128;
  TEST_CUDA_CHECK(cudaMalloc(&b.expertOut, expertRows * shape.hidden * 2));
  TEST_CUDA_CHECK(cudaMalloc(&b.combined, static_cast<size_t>(shape.maxTokens) * shape.hidden * 2));
  TEST_CUDA_CHECK(cudaMalloc(&b.combinedWeights, static_cast<size_t>(shape.maxTokens) * shape.topk * 4));
  unifabEpDispatchResult_t last = probe;
  unifabEpDispatchResult_t lastExpert = probe;
  bool knowExpert = false;
  for (int i = 0; i < iterations; ++i) {
    static const int kSms[] = {0, 1, 2, 3, 5};
    Case c{shape, i % 2 == 1, i % 4 >= 2, (i % 3 == 0) ? 1 : (i % 3 == 1 ? 8 : 64), i % 5 == 1, i % 7 == 0, i % 2 == 0,
           kSms[i % 5], i % 5 == 4};
    uint64_t seed = 1000 * static_cast<uint64_t>(shape.numExperts) + 17 * static_cast<uint64_t>(i) + shape.hidden;
    unifabEpDispatchResult_t& previous = c.expertMajor ? lastExpert : last;
    if (c.expertMajor && !knowExpert) previous = last;  // the rank-major arrays are poisoned instead
    if (!runCase(session, group, c, seed, b, &previous)) return false;
    if (c.expertMajor) knowExpert = true;
  }
  for (bool fromCombineInput : {false, true}) {
    if (replays > 0 && !runGraph(session, group, shape, b, replays, fromCombineInput, &last)) return false;
  }
  if (!runUnsyncedSequence(session, group, shape, b, &last)) return false;
  cudaFree(b.expertOut);
  cudaFree(b.combined);
  cudaFree(b.combinedWeights);
  TEST_UNIFAB_CHECK(unifabEpDestroy(group));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  RankEnvironment env = rankEnvironment();
  int iterations = 8;
  int replays = 5;
  bool quick = false, full = false, lateBlocks = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--iterations" && i + 1 < argc) iterations = atoi(argv[++i]);
    else if (arg == "--replays" && i + 1 < argc) replays = atoi(argv[++i]);
    else if (arg == "--quick") quick = true;  // one small shape, for compute-sanitizer runs
    else if (arg == "--full") full = true;    // every hidden x top-k x experts combination
    else if (arg == "--late-blocks") lateBlocks = true;  // only runLateBlocks (2 ranks)
    else {
      fprintf(stderr, "usage: %s [--iterations N] [--replays N] [--quick | --full | --late-blocks]\n", argv[0]);
      return 2;
    }
  }
  tally().rank = env.rank;
  NcclSession session;
  if (!session.init(env)) return session.skipped() ? kSkipExitCode : 1;
  if (lateBlocks) {
    if (session.nRanks() < 2 || !runLateBlocks(session, makeShape(session.nRanks(), 64, 2048, 6, 128))) {
      printf("rank %d: aborted in the late-blocks check (needs 2 ranks)\n", env.rank);
      return 1;
    }
    return finishChecks();
  }
  struct ShapeSpec {
    int experts, hidden, topk, tokens;
  };
  // Top-12 takes the layout's second chunk of entries (kLayoutChunk = 8 in registers).
  std::vector<ShapeSpec> shapes = {{16, 2048, 1, 96}, {64, 4096, 6, 128}, {256, 7168, 8, 128}, {256, 2048, 8, 256},
                                   {64, 2048, 12, 96}};
  if (quick) shapes = {{64, 2048, 6, 64}};
  if (full) {
    shapes.clear();
    for (int experts : {16, 64, 256}) {
      for (int hidden : {2048, 4096, 7168}) {
        for (int topk : {1, 6, 8}) shapes.push_back({experts, hidden, topk, 160});
      }
    }
  }
  for (const ShapeSpec& spec : shapes) {
    const Shape shape = makeShape(session.nRanks(), spec.experts, spec.hidden, spec.topk, spec.tokens);
    if (!runShape(session, shape, iterations, replays)) {
      printf("rank %d: aborted in shape E%d H%d top-%d\n", env.rank, spec.experts, spec.hidden, spec.topk);
      return 1;
    }
  }
  // Last: it leaves its group unusable (and compute-sanitizer runs are kept to matched calls).
  if (session.nRanks() > 1 && !quick &&
      !runCallMismatch(session, makeShape(session.nRanks(), shapes[0].experts, shapes[0].hidden, shapes[0].topk,
                                          shapes[0].tokens))) {
    printf("rank %d: aborted in the call-mismatch check\n", env.rank);
    return 1;
  }
  return finishChecks();
}
