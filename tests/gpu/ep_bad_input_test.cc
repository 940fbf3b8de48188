// Bad input to EP dispatch and combine on a live group: every case must return its result code,
// with a message naming the argument, before anything is launched (the poisoned receive rows stay
// poisoned), and leave the group usable. Expert ids out of range are found on the GPU and
// reported through unifabEpGetAsyncError. Run on one rank (a second visible GPU adds the
// wrong-device cases).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tests/common/check_tally.h"
#include "tests/common/ep_device.h"
#include "tests/common/ep_reference.h"
#include "tests/common/nccl_session.h"
#include "unifab/unifab.h"

using namespace unifab::test;
using namespace unifab::test::ep;

namespace {

// The call returns `expected` and the library's last error names `mentions`.
void expectError(unifabResult_t got, unifabResult_t expected, const char* mentions, const std::string& what) {
  const char* message = unifabGetLastError();
  check(got == expected, what + ": returns " + unifabGetErrorString(expected) + " (got " + unifabGetErrorString(got) + ")");
  check(message != nullptr && strstr(message, mentions) != nullptr,
        what + ": message names '" + mentions + "' (got '" + (message ? message : "") + "')");
}

bool run(NcclSession& session) {
  const Shape shape = makeShape(session.nRanks(), 16, 2048, 4, 64);
  unifabEpConfig_t config = groupConfig(shape);
  unifabEpGroup_t group = nullptr;
  TEST_UNIFAB_CHECK(unifabEpCreate(session.comm(), &config, &group));
  DeviceInput input;
  if (!input.allocate(shape)) return false;
  RankInput data = makeInput(shape, session.rank(), 99, false, 10, shape.maxTokens);
  if (!input.upload(data, false, session.stream())) return false;
  cudaStream_t stream = session.stream();

  unifabEpDispatchArgs_t good = UNIFAB_EP_DISPATCH_ARGS_INIT;
  good.numTokens = data.numTokens;
  good.x = input.x;
  good.topkIdx = input.topk;
  good.topkWeights = input.weights;
  unifabEpDispatchResult_t result;
  result.size = sizeof(result);
  unifabEpHandle_t handle = nullptr;
  TEST_UNIFAB_CHECK(unifabEpDispatch(group, &good, stream, &handle, &result));
  TEST_CUDA_CHECK(cudaStreamSynchronize(stream));
  // Every later kernel of a dispatch would rewrite these rows: poison them and check at the end.
  const size_t rowsBytes = static_cast<size_t>(result.maxRows) * shape.hidden * 2;
  TEST_CUDA_CHECK(cudaMemset(result.recvX, 0x5a, rowsBytes));

  auto dispatchWith = [&](const std::function<void(unifabEpDispatchArgs_t&)>& edit, cudaStream_t s = nullptr) {
    unifabEpDispatchArgs_t a = good;
    edit(a);
    unifabEpHandle_t h = nullptr;
    unifabEpDispatchResult_t r;
    r.size = sizeof(r);
    unifabResult_t code = unifabEpDispatch(group, &a, s != nullptr ? s : stream, &h, &r);
    if (code == unifabSuccess) unifabEpHandleDestroy(h);
    return code;
  };
  int mine = 0, deviceSms = 0;
  TEST_CUDA_CHECK(cudaGetDevice(&mine));
  TEST_CUDA_CHECK(cudaDeviceGetAttribute(&deviceSms, cudaDevAttrMultiProcessorCount, mine));

  expectError(dispatchWith([](auto& a) { a.size = 8; }), unifabInvalidArgument, "args->size", "dispatch args->size");
  expectError(dispatchWith([&](auto& a) { a.numTokens = shape.maxTokens + 1; }), unifabInvalidArgument, "numTokens",
              "more tokens than the group was created for");
  expectError(dispatchWith([](auto& a) { a.numTokens = -1; }), unifabInvalidArgument, "numTokens", "negative numTokens");
  expectError(dispatchWith([](auto& a) { a.x = nullptr; }), unifabInvalidArgument, "x=", "null x");
  expectError(dispatchWith([&](auto& a) { a.x = static_cast<char*>(input.x) + 8; }), unifabInvalidArgument, "aligned",
              "misaligned x");
  expectError(dispatchWith([](auto& a) { std::memset(&a.dtype, 0x7, sizeof(a.dtype)); }), unifabInvalidArgument, "dtype",
              "unknown dtype");
  expectError(dispatchWith([](auto& a) {
                a.dtype = unifabEpFp8E4M3;
                a.scales = nullptr;
              }),
              unifabInvalidArgument, "scales", "FP8 without scales");
  expectError(dispatchWith([](auto& a) { a.topkIdx = nullptr; }), unifabInvalidArgument, "topkIdx", "null topkIdx");
  // A misaligned id or weight load would fault the context (and time out every peer).
  expectError(dispatchWith([](auto& a) {
                a.topkIdxType = unifabEpIndexInt64;
                a.topkIdx = static_cast<const char*>(a.topkIdx) + 4;
              }),
              unifabInvalidArgument, "topkIdx", "int64 ids 4 bytes off");
  expectError(dispatchWith([](auto& a) {
                a.topkWeights = reinterpret_cast<const float*>(reinterpret_cast<const char*>(a.topkWeights) + 2);
              }),
              unifabInvalidArgument, "topkWeights", "weights 2 bytes off");
  expectError(dispatchWith([](auto& a) { std::memset(&a.topkIdxType, 0x5, sizeof(a.topkIdxType)); }),
              unifabInvalidArgument, "topkIdxType", "unknown topkIdxType");
  expectError(dispatchWith([](auto& a) { std::memset(&a.layout, 0x9, sizeof(a.layout)); }), unifabInvalidArgument,
              "layout", "unknown layout");
  expectError(dispatchWith([](auto& a) {
                a.layout = unifabEpExpertMajor;
                a.expertAlignment = 0;
              }),
              unifabInvalidArgument, "expertAlignment", "expert alignment 0");
  expectError(dispatchWith([](auto& a) {
                a.layout = unifabEpExpertMajor;
                a.expertAlignment = 1000;
              }),
              unifabInvalidArgument, "expertAlignment", "expert alignment above the bound");
  expectError(dispatchWith([](auto& a) { a.numSms = -1; }), unifabInvalidArgument, "numSms", "negative numSms");
  expectError(dispatchWith([&](auto& a) { a.numSms = deviceSms + 1; }), unifabInvalidArgument, "numSms",
              "numSms above the GPU's SMs");
  // Memory the kernel could not read (it would fault the context): host memory, or an allocation
  // shorter than numTokens x hidden.
  std::vector<int4> hostX(static_cast<size_t>(shape.maxTokens) * shape.hidden * 2 / sizeof(int4));
  expectError(dispatchWith([&](auto& a) { a.x = hostX.data(); }), unifabInvalidArgument, "not device memory",
              "x in host memory");
  void* shortX = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&shortX, 256));
  expectError(dispatchWith([&](auto& a) { a.x = shortX; }), unifabInvalidArgument, "past the end",
              "x shorter than numTokens x hidden");
  TEST_CUDA_CHECK(cudaFree(shortX));
  expectError(dispatchWith([&](auto& a) {
                a.cachedHandle = handle;
                a.numTokens = data.numTokens - 1;
              }),
              unifabInvalidArgument, "cachedHandle", "cached handle with another token count");
  {
    unifabEpDispatchResult_t small;
    small.size = 4;
    unifabEpHandle_t h = nullptr;
    expectError(unifabEpDispatch(group, &good, stream, &h, &small), unifabInvalidArgument, "result->size",
                "result->size");
  }
  {
    // hostCounts waits for the GPU: not allowed while capturing (checked before capture ends).
    cudaStream_t capture;
    TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&capture, cudaStreamNonBlocking));
    TEST_CUDA_CHECK(cudaStreamBeginCapture(capture, cudaStreamCaptureModeThreadLocal));
    unifabResult_t code = dispatchWith([](auto& a) { a.hostCounts = 1; }, capture);
    cudaGraph_t graph = nullptr;
    TEST_CUDA_CHECK(cudaStreamEndCapture(capture, &graph));
    if (graph != nullptr) TEST_CUDA_CHECK(cudaGraphDestroy(graph));
    TEST_CUDA_CHECK(cudaStreamDestroy(capture));
    expectError(code, unifabInvalidUsage, "hostCounts", "hostCounts on a capturing stream");
  }
  int devices = 0;
  TEST_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices > 1) {
    const int other = (mine + 1) % devices;
    cudaStream_t foreign;
    TEST_CUDA_CHECK(cudaSetDevice(other));
    TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&foreign, cudaStreamNonBlocking));
    // With the other device current, the group's own stream is refused too.
    expectError(dispatchWith([](auto&) {}), unifabInvalidUsage, "current CUDA device", "another current device");
    TEST_CUDA_CHECK(cudaSetDevice(mine));
    expectError(dispatchWith([](auto&) {}, foreign), unifabInvalidArgument, "stream", "a stream of another device");
    TEST_CUDA_CHECK(cudaSetDevice(other));
    TEST_CUDA_CHECK(cudaStreamDestroy(foreign));
    TEST_CUDA_CHECK(cudaSetDevice(mine));
  } else {
    printf("one visible GPU: the wrong-device cases are not run\n");
  }

  // Combine.
  void* expertOut = nullptr;
  void* combined = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&expertOut, rowsBytes));
  TEST_CUDA_CHECK(cudaMalloc(&combined, static_cast<size_t>(shape.maxTokens) * shape.hidden * 2 + 16));
  unifabEpCombineArgs_t cgood = UNIFAB_EP_COMBINE_ARGS_INIT;
  cgood.expertOutput = expertOut;
  cgood.combinedX = combined;
  auto combineWith = [&](const std::function<void(unifabEpCombineArgs_t&)>& edit, unifabEpHandle_t h) {
    unifabEpCombineArgs_t a = cgood;
    edit(a);
    return unifabEpCombine(group, h, &a, stream);
  };
  expectError(combineWith([](auto& a) { a.size = 8; }, handle), unifabInvalidArgument, "args->size", "combine args->size");
  expectError(combineWith([](auto& a) { a.expertOutput = nullptr; }, handle), unifabInvalidArgument, "expertOutput",
              "null expertOutput");
  expectError(combineWith([&](auto& a) { a.combinedX = static_cast<char*>(combined) + 4; }, handle),
              unifabInvalidArgument, "combinedX", "misaligned combinedX");
  expectError(combineWith([&](auto& a) { a.numSms = deviceSms + 1; }, handle), unifabInvalidArgument, "numSms",
              "combine numSms above the GPU's SMs");
  expectError(combineWith([&](auto& a) { a.combinedWeights = reinterpret_cast<float*>(static_cast<char*>(combined) + 2); },
                          handle),
              unifabInvalidArgument, "combinedWeights", "combinedWeights 2 bytes off");
  expectError(combineWith([](auto&) {}, nullptr), unifabInvalidArgument, "handle", "combine without a handle");
  std::vector<int4> hostCombined(static_cast<size_t>(shape.maxTokens) * shape.hidden * 2 / sizeof(int4));
  expectError(combineWith([&](auto& a) { a.combinedX = hostCombined.data(); }, handle), unifabInvalidArgument,
              "not device memory", "combinedX in host memory");

  // Nothing above launched: the receive rows are still poisoned.
  TEST_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<unsigned char> rows(rowsBytes);
  TEST_CUDA_CHECK(cudaMemcpy(rows.data(), result.recvX, rowsBytes, cudaMemcpyDeviceToHost));
  bool untouched = true;
  for (unsigned char b : rows) untouched = untouched && b == 0x5a;
  check(untouched, "refused calls launched nothing (receive rows still poisoned)");
  check(unifabEpGetAsyncError(group) == unifabSuccess, "refused calls leave no device error");

  // The group still works.
  unifabEpHandle_t again = nullptr;
  check(unifabEpDispatch(group, &good, stream, &again, &result) == unifabSuccess, "dispatch after refusals");
  check(unifabEpCombine(group, again, &cgood, stream) == unifabSuccess, "combine after refusals");
  TEST_CUDA_CHECK(cudaStreamSynchronize(stream));
  check(unifabEpGetAsyncError(group) == unifabSuccess, "dispatch and combine after refusals succeed on the GPU");
  TEST_UNIFAB_CHECK(unifabEpHandleDestroy(again));
  TEST_UNIFAB_CHECK(unifabEpHandleDestroy(handle));
  // A destroyed handle is refused, not read after its free: destroyed again, or combined.
  expectError(unifabEpHandleDestroy(handle), unifabInvalidArgument, "not a live handle", "a handle destroyed twice");
  expectError(unifabEpCombine(group, handle, &cgood, stream), unifabInvalidArgument, "handle",
              "a combine with a destroyed handle");

  // The combine input holds rank-major rows: an expert-major dispatch cannot combine from it.
  void* combineInput = nullptr;
  TEST_UNIFAB_CHECK(unifabEpCombineInputBuffer(group, &combineInput, nullptr));
  unifabEpDispatchArgs_t expertMajor = good;
  expertMajor.layout = unifabEpExpertMajor;
  unifabEpHandle_t byExpert = nullptr;
  check(unifabEpDispatch(group, &expertMajor, stream, &byExpert, &result) == unifabSuccess, "expert-major dispatch");
  expectError(combineWith([&](auto& a) { a.expertOutput = combineInput; }, byExpert), unifabInvalidUsage,
              "expert-major", "combine input with an expert-major dispatch");
  // Inside the combine input but not at its start, or outputs in the window: refused.
  char* insideInput = static_cast<char*>(combineInput) + static_cast<size_t>(shape.hidden) * 2;
  expectError(combineWith([&](auto& a) { a.expertOutput = insideInput; }, byExpert), unifabInvalidArgument,
              "expertOutput", "expertOutput inside the window");
  expectError(combineWith([&](auto& a) { a.combinedX = combineInput; }, byExpert), unifabInvalidArgument,
              "combinedX", "combinedX inside the window");
  expectError(combineWith([&](auto& a) { a.combinedWeights = static_cast<float*>(combineInput); }, byExpert),
              unifabInvalidArgument, "combinedWeights", "combinedWeights inside the window");
  TEST_CUDA_CHECK(cudaStreamSynchronize(stream));
  check(unifabEpGetAsyncError(group) == unifabSuccess, "the refused combine leaves the group usable");
  TEST_UNIFAB_CHECK(unifabEpHandleDestroy(byExpert));
  expectError(unifabEpCombineInputBuffer(group, nullptr, nullptr), unifabInvalidArgument, "buffer",
              "combine input without a buffer pointer");

  // An expert id out of range is found on the GPU: reported, and every later call returns it.
  std::vector<int64_t> ids = data.topk;
  ids[3] = shape.numExperts;  // one past the last expert
  TEST_CUDA_CHECK(cudaMemcpy(input.topk, ids.data(), ids.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  unifabEpHandle_t bad = nullptr;
  check(unifabEpDispatch(group, &good, stream, &bad, &result) == unifabSuccess, "a bad id is not seen before launch");
  TEST_CUDA_CHECK(cudaStreamSynchronize(stream));
  expectError(unifabEpGetAsyncError(group), unifabInvalidArgument, "top-k", "bad expert id reported");
  unifabEpHandle_t later = nullptr;
  expectError(unifabEpDispatch(group, &good, stream, &later, &result), unifabInvalidArgument, "top-k",
              "later calls return the bad-id error");
  TEST_UNIFAB_CHECK(unifabEpHandleDestroy(bad));
  TEST_UNIFAB_CHECK(unifabEpDestroy(group));
  // A destroyed group is refused, not read after its free: used, or destroyed again.
  unifabEpHandle_t afterDestroy = nullptr;
  expectError(unifabEpDispatch(group, &good, stream, &afterDestroy, &result), unifabInvalidArgument,
              "destroyed or never created", "a dispatch on a destroyed group");
  expectError(unifabEpDestroy(group), unifabInvalidArgument, "destroyed already", "a group destroyed twice");
  // A NULL config or group takes part in the ranks' agreement and is refused there (one rank here;
  // ep_refusal_test.cc --mismatch has one rank of two pass NULL).
  unifabEpGroup_t none = nullptr;
  expectError(unifabEpCreate(session.comm(), nullptr, &none), unifabInvalidArgument, "config=",
              "create with a NULL config");
  expectError(unifabEpCreate(session.comm(), &config, nullptr), unifabInvalidArgument, "group=",
              "create with a NULL group pointer");

  // A handle outlives its group: a newer group (which the allocator may place at the same address)
  // refuses it, for cached re-dispatch and for combine.
  if (!input.upload(data, false, stream)) return false;
  unifabEpGroup_t first = nullptr, second = nullptr;
  TEST_UNIFAB_CHECK(unifabEpCreate(session.comm(), &config, &first));
  unifabEpHandle_t stale = nullptr;
  TEST_UNIFAB_CHECK(unifabEpDispatch(first, &good, stream, &stale, &result));
  TEST_CUDA_CHECK(cudaStreamSynchronize(stream));
  TEST_UNIFAB_CHECK(unifabEpDestroy(first));
  TEST_UNIFAB_CHECK(unifabEpCreate(session.comm(), &config, &second));
  unifabEpHandle_t fresh = nullptr;
  TEST_UNIFAB_CHECK(unifabEpDispatch(second, &good, stream, &fresh, &result));  // sequence numbers alike
  unifabEpDispatchArgs_t cachedStale = good;
  cachedStale.cachedHandle = stale;
  cachedStale.topkIdx = nullptr;
  unifabEpHandle_t unused = nullptr;
  expectError(unifabEpDispatch(second, &cachedStale, stream, &unused, &result), unifabInvalidArgument, "cachedHandle",
              "cached re-dispatch with the handle of a destroyed group");
  unifabEpCombineArgs_t staleCombine = cgood;
  expectError(unifabEpCombine(second, stale, &staleCombine, stream), unifabInvalidArgument, "handle",
              "combine with the handle of a destroyed group");
  TEST_CUDA_CHECK(cudaStreamSynchronize(stream));
  check(unifabEpGetAsyncError(second) == unifabSuccess, "the refused stale handle leaves the new group usable");
  TEST_UNIFAB_CHECK(unifabEpHandleDestroy(stale));
  TEST_UNIFAB_CHECK(unifabEpHandleDestroy(fresh));
  TEST_UNIFAB_CHECK(unifabEpDestroy(second));
  TEST_CUDA_CHECK(cudaFree(expertOut));
  TEST_CUDA_CHECK(cudaFree(combined));
  return true;
}

}  // namespace

int main() {
  RankEnvironment env = rankEnvironment();
  NcclSession session;
  if (!session.init(env)) return session.skipped() ? kSkipExitCode : 1;
  if (!run(session)) {
    printf("aborted\n");
    return 1;
  }
  return finishChecks();
}
