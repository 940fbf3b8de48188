// Low-latency EP dispatch and combine against the CPU reference, one process per GPU under
// unifab-launch. Every case draws fresh inputs (token counts 1, 32, 128 or the maximum, differing
// per rank; masked and repeated top-k entries), poisons both buffer sets and the combine output,
// and checks bit for bit: every expert's count, each row's source, payload bytes (BF16, or the
// FP8 cast with its scales, plain or UE8M0), and combine's sums in their fixed order. Rows of an
// expert arrive in any order, so each is matched to its (source rank, token). Also: the phases
// run separately with a kernel between them, several layers captured in one CUDA graph and
// replayed with fresh inputs, and the calls the group must refuse.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <utility>
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

struct Layer {
  DeviceInput input;
  uint16_t* expertOut = nullptr;
  uint16_t* combined = nullptr;
  ~Layer() {
    cudaFree(expertOut);
    cudaFree(combined);
  }
};

struct Case {
  bool fp8 = true;
  bool ue8m0 = false;
  bool weighted = true;
  bool int32Ids = false;
  bool split = false;
  int numSms = 0;
};

// Inputs of every rank for one layer: the reference sees repeated top-k entries as masked, the
// GPU gets the repeats (a later slot naming the same expert again).
struct LayerInputs {
  std::vector<RankInput> reference;
  RankInput mine;  // what this rank uploads
};

LayerInputs makeLayer(const Shape& shape, int rank, uint64_t seed, const std::vector<int>& tokens) {
  LayerInputs layer;
  for (int r = 0; r < shape.nRanks; ++r) layer.reference.push_back(makeInput(shape, r, seed, false, 10, tokens[r]));
  layer.mine = layer.reference[rank];
  for (int r = 0; r < shape.nRanks; ++r) {
    RankInput& ref = layer.reference[r];
    for (int t = 0; t < ref.numTokens && shape.topk > 1; t += 5) {
      int64_t* ids = &ref.topk[static_cast<size_t>(t) * shape.topk];
      if (ids[0] < 0) continue;
      if (r == rank) layer.mine.topk[static_cast<size_t>(t) * shape.topk + 1] = ids[0];
      ids[1] = -1;
    }
  }
  return layer;
}

std::vector<int> tokenCounts(const Shape& shape, int variant) {
  const int choices[] = {1, 32, 128, shape.maxTokens};
  std::vector<int> tokens;
  for (int r = 0; r < shape.nRanks; ++r) tokens.push_back(std::min(shape.maxTokens, choices[(variant + r) % 4]));
  return tokens;
}

// Both sets' receive arrays, known from two empty dispatches at the start.
struct Sets {
  unifabEpLowLatencyDispatchResult_t set[2];
};

bool poison(NcclSession& session, const Shape& shape, const Sets& sets) {
  const size_t rows = static_cast<size_t>(shape.localExperts()) * shape.nRanks * shape.maxTokens;
  for (const auto& r : sets.set) {
    TEST_CUDA_CHECK(cudaMemsetAsync(r.recvX, 0xff, rows * shape.hidden * 2, session.stream()));
    TEST_CUDA_CHECK(cudaMemsetAsync(r.recvScales, 0xff, rows * (shape.hidden / 128) * sizeof(float), session.stream()));
    TEST_CUDA_CHECK(cudaMemsetAsync(r.recvSource, 0xee, rows * 2 * sizeof(int), session.stream()));
    TEST_CUDA_CHECK(cudaMemsetAsync(r.recvCount, 0xee, shape.localExperts() * sizeof(int), session.stream()));
  }
  return session.barrier(true);
}

// Checks the receive buffers of `r` against what every rank sent.
bool verifyDispatch(const Shape& shape, const std::vector<RankInput>& inputs, int rank, const Case& c,
                    const unifabEpLowLatencyDispatchResult_t& r, cudaStream_t stream, const std::string& what) {
  const int local = shape.localExperts();
  const int64_t first = static_cast<int64_t>(rank) * local;
  const size_t rowBytes = static_cast<size_t>(shape.hidden) * (c.fp8 ? 1 : 2);
  const int scalesPerRow = shape.hidden / 128;
  std::vector<int> counts;
  if (!download(&counts, r.recvCount, local, stream)) return false;
  std::vector<uint8_t> expected(rowBytes);
  std::vector<float> expectedScales(scalesPerRow);
  bool countsOk = true, sourcesOk = true, payloadOk = true, scalesOk = true;
  for (int e = 0; e < local; ++e) {
    std::set<std::pair<int, int>> want;
    for (int s = 0; s < shape.nRanks; ++s) {
      for (int t = 0; t < inputs[s].numTokens; ++t) {
        for (int k = 0; k < shape.topk; ++k) {
          if (inputs[s].topk[static_cast<size_t>(t) * shape.topk + k] == first + e) want.insert({s, t});
        }
      }
    }
    if (counts[e] != static_cast<int>(want.size())) {
      if (countsOk) check(false, what + ": expert " + std::to_string(e) + " count " + std::to_string(counts[e]) +
                                     ", expected " + std::to_string(want.size()));
      countsOk = false;
      continue;
    }
    const size_t base = static_cast<size_t>(e) * r.expertStride;
    std::vector<int> source;
    std::vector<uint8_t> x;
    std::vector<float> scales;
    if (!download(&source, r.recvSource + base * 2, want.size() * 2, stream)) return false;
    if (!download(&x, static_cast<const char*>(r.recvX) + base * rowBytes, want.size() * rowBytes, stream)) return false;
    if (c.fp8 && !download(&scales, r.recvScales + base * scalesPerRow, want.size() * scalesPerRow, stream)) return false;
    for (size_t i = 0; i < want.size(); ++i) {
      const std::pair<int, int> from{source[2 * i], source[2 * i + 1]};
      if (want.erase(from) != 1) {
        sourcesOk = false;
        continue;
      }
      const uint16_t* bf16 = reinterpret_cast<const uint16_t*>(inputs[from.first].x.data()) +
                             static_cast<size_t>(from.second) * shape.hidden;
      if (c.fp8) {
        castToFp8(bf16, shape.hidden, c.ue8m0, expected.data(), expectedScales.data());
        scalesOk = scalesOk && memcmp(expectedScales.data(), &scales[i * scalesPerRow], scalesPerRow * sizeof(float)) == 0;
      } else {
        memcpy(expected.data(), bf16, rowBytes);
      }
      payloadOk = payloadOk && memcmp(expected.data(), &x[i * rowBytes], rowBytes) == 0;
    }
  }
  if (countsOk) check(true, what + ": per-expert counts");
  check(sourcesOk, what + ": every row's source is one expected for its expert, once");
  check(payloadOk, what + ": payload bytes");
  if (c.fp8) check(scalesOk, what + ": FP8 scales");
  return true;
}

bool verifyCombine(const Shape& shape, const std::vector<RankInput>& inputs, int rank, bool weighted, uint64_t seed,
                   const uint16_t* combined, cudaStream_t stream, const std::string& what) {
  std::vector<uint16_t> want;
  std::vector<float> unusedWeights;
  expectedCombine(shape, inputs, rank, true, weighted, seed, &want, &unusedWeights);
  std::vector<uint16_t> got;
  if (!download(&got, combined, want.size(), stream)) return false;
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) bad += got[i] != want[i] ? 1 : 0;
  check(bad == 0, what + ": " + std::to_string(bad) + " of " + std::to_string(want.size()) + " combined values differ");
  return true;
}

bool allocateLayer(const Shape& shape, Layer* layer) {
  if (!layer->input.allocate(shape)) return false;
  const size_t rows = static_cast<size_t>(shape.localExperts()) * shape.nRanks * shape.maxTokens;
  TEST_CUDA_CHECK(cudaMalloc(&layer->expertOut, rows * shape.hidden * 2));
  TEST_CUDA_CHECK(cudaMalloc(&layer->combined, static_cast<size_t>(shape.maxTokens) * shape.hidden * 2));
  return true;
}

unifabEpLowLatencyDispatchArgs_t dispatchArgs(const Layer& layer, int tokens, const Case& c) {
  unifabEpLowLatencyDispatchArgs_t args = UNIFAB_EP_LL_DISPATCH_ARGS_INIT;
  args.numTokens = tokens;
  args.x = layer.input.x;
  args.topkIdx = layer.input.topk;
  args.topkIdxType = c.int32Ids ? unifabEpIndexInt32 : unifabEpIndexInt64;
  args.topkWeights = layer.input.weights;
  args.dtype = c.fp8 ? unifabEpFp8E4M3 : unifabEpBf16;
  args.ue8m0Scales = c.ue8m0 ? 1 : 0;
  args.numSms = c.numSms;
  return args;
}

// One dispatch -> experts -> combine round, both phases at once or split around a kernel.
bool runCase(NcclSession& session, unifabEpGroup_t group, const Shape& shape, const Sets& sets, Layer& layer,
             const Case& c, uint64_t seed, const std::vector<int>& tokens, const std::string& what) {
  LayerInputs in = makeLayer(shape, session.rank(), seed, tokens);
  if (!layer.input.upload(in.mine, c.int32Ids, session.stream())) return false;
  if (!poison(session, shape, sets)) return false;
  unifabEpLowLatencyDispatchArgs_t args = dispatchArgs(layer, tokens[session.rank()], c);
  args.phase = c.split ? unifabEpSendOnly : unifabEpSendAndReceive;
  unifabEpHandle_t handle = nullptr;
  unifabEpLowLatencyDispatchResult_t result;
  result.size = sizeof(result);
  TEST_UNIFAB_CHECK(unifabEpLowLatencyDispatch(group, &args, session.stream(), &handle, &result));
  if (c.split) {
    TEST_CUDA_CHECK(spinOnDevice(20000, session.stream()));  // the caller's work between the phases
    args.phase = unifabEpReceiveOnly;
    TEST_UNIFAB_CHECK(unifabEpLowLatencyDispatch(group, &args, session.stream(), &handle, nullptr));
  }
  TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  TEST_UNIFAB_CHECK(unifabEpGetAsyncError(group));
  if (!verifyDispatch(shape, in.reference, session.rank(), c, result, session.stream(), what)) return false;

  const uint64_t outputSeed = seed * 7 + 3;
  TEST_CUDA_CHECK(fillLowLatencyExpertOutputs(layer.expertOut, shape.hidden, result.recvSource, result.recvCount,
                                              result.expertStride, shape.localExperts(), session.rank(), outputSeed,
                                              session.stream()));
  TEST_CUDA_CHECK(cudaMemsetAsync(layer.combined, 0xff, static_cast<size_t>(shape.maxTokens) * shape.hidden * 2, session.stream()));
  unifabEpLowLatencyCombineArgs_t cargs = UNIFAB_EP_LL_COMBINE_ARGS_INIT;
  cargs.expertOutput = layer.expertOut;
  cargs.weighted = c.weighted ? 1 : 0;
  cargs.combinedX = layer.combined;
  cargs.numSms = c.numSms;
  cargs.phase = c.split ? unifabEpSendOnly : unifabEpSendAndReceive;
  TEST_UNIFAB_CHECK(unifabEpLowLatencyCombine(group, handle, &cargs, session.stream()));
  if (c.split) {
    TEST_CUDA_CHECK(spinOnDevice(20000, session.stream()));
    cargs.phase = unifabEpReceiveOnly;
    TEST_UNIFAB_CHECK(unifabEpLowLatencyCombine(group, handle, &cargs, session.stream()));
  }
  TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  TEST_UNIFAB_CHECK(unifabEpGetAsyncError(group));
  if (!verifyCombine(shape, in.reference, session.rank(), c.weighted, outputSeed, layer.combined, session.stream(),
                     what + " combine")) {
    return false;
  }
  TEST_UNIFAB_CHECK(unifabEpHandleDestroy(handle));
  return true;
}

// `layers` rounds of dispatch -> experts -> combine captured in one graph (an odd count makes a
// set serve two dispatches in a row across replays), replayed with fresh inputs every time.
bool runGraph(NcclSession& session, unifabEpGroup_t group, const Shape& shape, int layers, int replays) {
  std::vector<Layer> stack(layers);
  for (Layer& layer : stack) {
    if (!allocateLayer(shape, &layer)) return false;
  }
  Case c;
  std::vector<unifabEpHandle_t> handles(layers, nullptr);
  std::vector<unifabEpLowLatencyDispatchResult_t> results(layers);
  std::vector<std::vector<int>> tokens;
  for (int l = 0; l < layers; ++l) tokens.push_back(tokenCounts(shape, l + 1));
  if (!session.barrier(true)) return false;
  cudaGraph_t graph = nullptr;
  TEST_CUDA_CHECK(cudaStreamBeginCapture(session.stream(), cudaStreamCaptureModeGlobal));
  unifabResult_t status = unifabSuccess;
  cudaError_t filled = cudaSuccess;
  for (int l = 0; l < layers && status == unifabSuccess && filled == cudaSuccess; ++l) {
    Case layerCase = c;
    layerCase.fp8 = l % 2 == 0;
    unifabEpLowLatencyDispatchArgs_t args = dispatchArgs(stack[l], tokens[l][session.rank()], layerCase);
    results[l].size = sizeof(results[l]);
    status = unifabEpLowLatencyDispatch(group, &args, session.stream(), &handles[l], &results[l]);
    if (status != unifabSuccess) break;
    filled = fillLowLatencyExpertOutputs(stack[l].expertOut, shape.hidden, results[l].recvSource, results[l].recvCount,
                                         results[l].expertStride, shape.localExperts(), session.rank(), 77 + l,
                                         session.stream());
    unifabEpLowLatencyCombineArgs_t cargs = UNIFAB_EP_LL_COMBINE_ARGS_INIT;
    cargs.expertOutput = stack[l].expertOut;
    cargs.combinedX = stack[l].combined;
    if (filled == cudaSuccess) status = unifabEpLowLatencyCombine(group, handles[l], &cargs, session.stream());
  }
  TEST_CUDA_CHECK(cudaStreamEndCapture(session.stream(), &graph));
  TEST_UNIFAB_CHECK(status);
  TEST_CUDA_CHECK(filled);
  cudaGraphExec_t exec = nullptr;
  TEST_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < replays; ++replay) {
    std::vector<LayerInputs> inputs;
    for (int l = 0; l < layers; ++l) {
      inputs.push_back(makeLayer(shape, session.rank(), 90000 + replay * 16 + l, tokens[l]));
      if (!stack[l].input.upload(inputs[l].mine, false, session.stream())) return false;
      TEST_CUDA_CHECK(cudaMemsetAsync(stack[l].combined, 0xff, static_cast<size_t>(shape.maxTokens) * shape.hidden * 2,
                                      session.stream()));
    }
    if (!session.barrier(true)) return false;
    TEST_CUDA_CHECK(cudaGraphLaunch(exec, session.stream()));
    TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
    TEST_UNIFAB_CHECK(unifabEpGetAsyncError(group));
    for (int l = 0; l < layers; ++l) {
      const std::string what = "graph replay " + std::to_string(replay) + " layer " + std::to_string(l);
      // The last layer's receive buffers are still intact (the earlier ones' set was reused).
      if (l == layers - 1 || l == layers - 2) {
        Case layerCase = c;
        layerCase.fp8 = l % 2 == 0;
        if (!verifyDispatch(shape, inputs[l].reference, session.rank(), layerCase, results[l], session.stream(), what)) return false;
      }
      if (!verifyCombine(shape, inputs[l].reference, session.rank(), true, 77 + l, stack[l].combined, session.stream(),
                         what + " combine")) {
        return false;
      }
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (unifabEpHandle_t h : handles) TEST_UNIFAB_CHECK(unifabEpHandleDestroy(h));
  return true;
}

// Calls the group refuses before launching anything; the group stays usable.
bool runRefusals(NcclSession& session, unifabEpGroup_t group, const Shape& shape, Layer& layer) {
  Case c;
  unifabEpLowLatencyDispatchArgs_t args = dispatchArgs(layer, 0, c);
  unifabEpLowLatencyDispatchResult_t result;
  result.size = sizeof(result);
  unifabEpDispatchArgs_t ht = UNIFAB_EP_DISPATCH_ARGS_INIT;
  unifabEpDispatchResult_t htResult;
  htResult.size = sizeof(htResult);
  unifabEpHandle_t h = nullptr;
  check(unifabEpDispatch(group, &ht, session.stream(), &h, &htResult) == unifabInvalidUsage,
        "a high-throughput dispatch on a low-latency group is refused");
  args.numTokens = shape.maxTokens + 1;
  check(unifabEpLowLatencyDispatch(group, &args, session.stream(), &h, &result) == unifabInvalidArgument,
        "numTokens above maxTokensPerRank is refused");
  args.numTokens = 0;
  args.phase = unifabEpReceiveOnly;
  h = nullptr;
  check(unifabEpLowLatencyDispatch(group, &args, session.stream(), &h, &result) == unifabInvalidArgument,
        "a receive-only dispatch without a sent handle is refused");
  // Two sends await their receive: a third send is refused; receives must follow send order.
  args.phase = unifabEpSendOnly;
  unifabEpHandle_t first = nullptr, second = nullptr, third = nullptr;
  TEST_UNIFAB_CHECK(unifabEpLowLatencyDispatch(group, &args, session.stream(), &first, &result));
  TEST_UNIFAB_CHECK(unifabEpLowLatencyDispatch(group, &args, session.stream(), &second, &result));
  check(unifabEpLowLatencyDispatch(group, &args, session.stream(), &third, &result) == unifabInvalidUsage,
        "a third send before any receive is refused");
  args.phase = unifabEpReceiveOnly;
  check(unifabEpLowLatencyDispatch(group, &args, session.stream(), &second, nullptr) == unifabInvalidUsage,
        "receives out of send order are refused");
  unifabEpLowLatencyCombineArgs_t cargs = UNIFAB_EP_LL_COMBINE_ARGS_INIT;
  cargs.expertOutput = layer.expertOut;
  cargs.combinedX = layer.combined;
  check(unifabEpLowLatencyCombine(group, first, &cargs, session.stream()) == unifabInvalidUsage,
        "combine before the dispatch's receive phase is refused");
  TEST_UNIFAB_CHECK(unifabEpLowLatencyDispatch(group, &args, session.stream(), &first, nullptr));
  args.phase = unifabEpSendAndReceive;
  check(unifabEpLowLatencyDispatch(group, &args, session.stream(), &third, &result) == unifabInvalidUsage,
        "a send-and-receive dispatch while a send awaits its receive is refused");
  args.phase = unifabEpReceiveOnly;
  TEST_UNIFAB_CHECK(unifabEpLowLatencyDispatch(group, &args, session.stream(), &second, nullptr));
  // A third dispatch reuses the first one's set: its combine is then refused.
  args.phase = unifabEpSendAndReceive;
  TEST_UNIFAB_CHECK(unifabEpLowLatencyDispatch(group, &args, session.stream(), &third, &result));
  check(unifabEpLowLatencyCombine(group, first, &cargs, session.stream()) == unifabInvalidUsage,
        "combine of a dispatch whose buffers were reused is refused");
  cargs.expertOutput = nullptr;
  check(unifabEpLowLatencyCombine(group, second, &cargs, session.stream()) == unifabInvalidArgument,
        "combine without expert outputs is refused");
  cargs.expertOutput = layer.expertOut;
  cargs.phase = unifabEpSendOnly;
  TEST_UNIFAB_CHECK(unifabEpLowLatencyCombine(group, second, &cargs, session.stream()));
  cargs.phase = unifabEpSendAndReceive;
  check(unifabEpLowLatencyCombine(group, third, &cargs, session.stream()) == unifabInvalidUsage,
        "a send-and-receive combine while a combine awaits its receive is refused");
  cargs.phase = unifabEpReceiveOnly;
  TEST_UNIFAB_CHECK(unifabEpLowLatencyCombine(group, second, &cargs, session.stream()));
  // A send that would reuse the set of a dispatch whose combine awaits its receive is refused (that
  // receive reads the set's routing), and the receive still completes afterwards.
  cargs.phase = unifabEpSendOnly;
  TEST_UNIFAB_CHECK(unifabEpLowLatencyCombine(group, third, &cargs, session.stream()));
  args.phase = unifabEpSendAndReceive;
  unifabEpHandle_t fourth = nullptr, fifth = nullptr, pending = nullptr;
  TEST_UNIFAB_CHECK(unifabEpLowLatencyDispatch(group, &args, session.stream(), &fourth, &result));  // the other set
  check(unifabEpLowLatencyDispatch(group, &args, session.stream(), &fifth, &result) == unifabInvalidUsage,
        "a send reusing the set of a dispatch whose combine awaits its receive is refused");
  cargs.phase = unifabEpReceiveOnly;
  TEST_UNIFAB_CHECK(unifabEpLowLatencyCombine(group, third, &cargs, session.stream()));
  TEST_UNIFAB_CHECK(unifabEpLowLatencyDispatch(group, &args, session.stream(), &fifth, &result));
  // A handle whose send awaits its receive cannot be destroyed while the group lives.
  args.phase = unifabEpSendOnly;
  TEST_UNIFAB_CHECK(unifabEpLowLatencyDispatch(group, &args, session.stream(), &pending, &result));
  check(unifabEpHandleDestroy(pending) == unifabInvalidUsage,
        "destroying a handle whose dispatch awaits its receive phase is refused");
  args.phase = unifabEpReceiveOnly;
  TEST_UNIFAB_CHECK(unifabEpLowLatencyDispatch(group, &args, session.stream(), &pending, nullptr));
  TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  check(unifabEpGetAsyncError(group) == unifabSuccess, "refused calls leave the group usable");
  for (unifabEpHandle_t handle : {first, second, third, fourth, fifth, pending}) {
    TEST_UNIFAB_CHECK(unifabEpHandleDestroy(handle));
  }
  return true;
}

bool runShape(NcclSession& session, const Shape& shape, bool programmatic, int iterations, int layers, int replays) {
  unifabEpConfig_t config = groupConfig(shape);
  config.mode = unifabEpLowLatency;
  config.programmaticLaunch = programmatic ? 1 : 0;
  unifabEpGroup_t group = nullptr;
  TEST_UNIFAB_CHECK(unifabEpCreate(session.comm(), &config, &group));
  Layer layer;
  if (!allocateLayer(shape, &layer)) return false;
  // Two empty dispatches reveal both sets' buffers (the n-th send uses set n % 2).
  Sets sets;
  for (auto& r : sets.set) {
    unifabEpLowLatencyDispatchArgs_t args = dispatchArgs(layer, 0, Case{});
    r.size = sizeof(r);
    unifabEpHandle_t h = nullptr;
    TEST_UNIFAB_CHECK(unifabEpLowLatencyDispatch(group, &args, session.stream(), &h, &r));
    TEST_UNIFAB_CHECK(unifabEpHandleDestroy(h));
  }
  if (!runRefusals(session, group, shape, layer)) return false;
  for (int i = 0; i < iterations; ++i) {
    static const int kSms[] = {0, 1, 3, 0, 8};
    Case c;
    c.fp8 = i % 2 == 0;
    c.ue8m0 = i % 4 == 2;
    c.weighted = i % 3 != 1;
    c.int32Ids = i % 5 == 3;
    c.split = i % 3 == 2;
    c.numSms = kSms[i % 5];
    const uint64_t seed = 1000 * static_cast<uint64_t>(shape.numExperts) + 31 * static_cast<uint64_t>(i) + shape.hidden;
    const std::string what = "E" + std::to_string(shape.numExperts) + " H" + std::to_string(shape.hidden) + " top-" +
                             std::to_string(shape.topk) + " case " + std::to_string(i) + (c.fp8 ? " fp8" : " bf16") +
                             (c.ue8m0 ? " ue8m0" : "") + (c.split ? " split" : "") + " sms " + std::to_string(c.numSms);
    if (!runCase(session, group, shape, sets, layer, c, seed, tokenCounts(shape, i), what)) return false;
  }
  if (replays > 0 && !runGraph(session, group, shape, layers, replays)) return false;
  TEST_UNIFAB_CHECK(unifabEpDestroy(group));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  RankEnvironment env = rankEnvironment();
  int iterations = 8, layers = 3, replays = 20;
  bool full = false, quick = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--iterations" && i + 1 < argc) iterations = atoi(argv[++i]);
    else if (arg == "--replays" && i + 1 < argc) replays = atoi(argv[++i]);
    else if (arg == "--layers" && i + 1 < argc) layers = atoi(argv[++i]);
    else if (arg == "--full") full = true;    // every experts x hidden combination
    else if (arg == "--quick") quick = true;  // one small shape
    else {
      fprintf(stderr, "usage: %s [--iterations N] [--replays N] [--layers N] [--full | --quick]\n", argv[0]);
      return 2;
    }
  }
  tally().rank = env.rank;
  NcclSession session;
  if (!session.init(env)) return session.skipped() ? kSkipExitCode : 1;
  struct ShapeSpec {
    int experts, hidden, topk, tokens;
    bool programmatic = true;  // the group's programmaticLaunch (the default); one shape runs in plain stream order
  };
  // Top-32 puts the message's header on three lines, top-16 on two; hidden 9216 takes a second
  // chunk of 16 line groups in FP8 (its scales from 56 on) and three in BF16.
  std::vector<ShapeSpec> shapes = {{16, 2048, 4, 64}, {64, 4096, 6, 128, false}, {256, 7168, 8, 128}, {64, 4096, 32, 48},
                                   {64, 9216, 16, 64}};
  if (quick) shapes = {{64, 2048, 6, 64}};
  if (full) {
    shapes.clear();
    for (int experts : {16, 64, 256}) {
      for (int hidden : {2048, 4096, 7168}) shapes.push_back({experts, hidden, 8, 160});
    }
  }
  for (const ShapeSpec& spec : shapes) {
    const Shape shape = makeShape(session.nRanks(), spec.experts, spec.hidden, spec.topk, spec.tokens);
    if (!runShape(session, shape, spec.programmatic, iterations, layers, replays)) {
      printf("rank %d: aborted in shape E%d H%d top-%d%s\n", env.rank, spec.experts, spec.hidden, spec.topk,
             spec.programmatic ? "" : " (plain stream order)");
      return 1;
    }
  }
  return finishChecks();
}
