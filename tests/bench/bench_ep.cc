// unifab-bench ep --mode ht: high-throughput dispatch and combine, one process per GPU, against
// NCCL's grouped send/recv all-to-all moving the same bytes. Times are CUDA events around one
// call, after an L2 flush and a barrier, median over --iters; the table takes the slowest rank.
// Bandwidth as DeepEP counts it (every received row, the rank's own tokens included: payload
// plus FP8 scales) and NVLink-only (rows from other ranks).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/bench/bench_common.h"
#include "tests/common/ep_device.h"
#include "tests/common/ep_reference.h"
#include "tests/common/nccl_session.h"
#include "unifab/unifab.h"

namespace unifab::bench {
namespace {

#define BENCH_EP_CHECK(call)                                                                         \
  do {                                                                                               \
    unifabResult_t r_ = (call);                                                                      \
    if (r_ != unifabSuccess) {                                                                       \
      fprintf(stderr, "%s failed: %s: %s\n", #call, unifabGetErrorString(r_), unifabGetLastError()); \
      return false;                                                                                  \
    }                                                                                                \
  } while (0)

struct EpRun {
  int tokens, hidden, topk, experts, sms, iters, warmup;
  bool fp8, expertMajor;
  std::string csv;
};

struct Timer {
  cudaEvent_t start = nullptr, stop = nullptr;
  void* flush = nullptr;
  size_t flushBytes = size_t{256} << 20;
};

// Median time (us) of `op` over the run's iterations, each after an L2 flush and a barrier.
template <typename Op>
bool timeOp(test::NcclSession& session, Timer& timer, int* scratch, const EpRun& run, Op op, double* medianUs) {
  for (int i = 0; i < run.warmup; ++i) {
    if (!op()) return false;
  }
  std::vector<double> samples;
  for (int i = 0; i < run.iters; ++i) {
    TEST_CUDA_CHECK(cudaMemsetAsync(timer.flush, i & 0xff, timer.flushBytes, session.stream()));
    TEST_NCCL_CHECK(ncclAllReduce(scratch, scratch, 1, ncclInt32, ncclSum, session.comm(), session.stream()));
    TEST_CUDA_CHECK(cudaEventRecord(timer.start, session.stream()));
    if (!op()) return false;
    TEST_CUDA_CHECK(cudaEventRecord(timer.stop, session.stream()));
    TEST_CUDA_CHECK(cudaEventSynchronize(timer.stop));
    float ms = 0;
    TEST_CUDA_CHECK(cudaEventElapsedTime(&ms, timer.start, timer.stop));
    samples.push_back(ms * 1000.0);
  }
  *medianUs = median(samples);
  return true;
}

bool slowest(test::NcclSession& session, double* value) {
  double* device = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&device, sizeof(double)));
  TEST_CUDA_CHECK(cudaMemcpy(device, value, sizeof(double), cudaMemcpyHostToDevice));
  TEST_NCCL_CHECK(ncclAllReduce(device, device, 1, ncclFloat64, ncclMax, session.comm(), session.stream()));
  TEST_CUDA_CHECK(cudaMemcpyAsync(value, device, sizeof(double), cudaMemcpyDeviceToHost, session.stream()));
  TEST_CUDA_CHECK(cudaStreamSynchronize(session.stream()));
  cudaFree(device);
  return true;
}

bool runEpRank(const EpRun& run, const test::RankEnvironment& env) {
  test::NcclSession session;
  if (!session.init(env)) return false;
  test::ep::Shape shape;
  shape.nRanks = env.nRanks;
  shape.numExperts = run.experts;
  shape.hidden = run.hidden;
  shape.topk = run.topk;
  shape.maxTokens = run.tokens;
  // Uniform routing, no masked entries: the standard benchmark shape.
  test::ep::RankInput input = test::ep::makeInput(shape, env.rank, 777, run.fp8, 0, run.tokens);

  unifabEpConfig_t config = test::ep::groupConfig(shape);
  unifabEpGroup_t group = nullptr;
  BENCH_EP_CHECK(unifabEpCreate(session.comm(), &config, &group));

  void *x = nullptr, *topk = nullptr, *expertOut = nullptr, *combined = nullptr;
  float *scales = nullptr, *weights = nullptr;
  int* scratch = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&x, input.x.size()));
  TEST_CUDA_CHECK(cudaMalloc(&scales, input.scales.size() * sizeof(float) + 16));
  TEST_CUDA_CHECK(cudaMalloc(&topk, input.topk.size() * sizeof(int64_t)));
  TEST_CUDA_CHECK(cudaMalloc(&weights, input.weights.size() * sizeof(float)));
  TEST_CUDA_CHECK(cudaMalloc(&combined, static_cast<size_t>(run.tokens) * run.hidden * 2));
  TEST_CUDA_CHECK(cudaMalloc(&scratch, sizeof(int)));
  TEST_CUDA_CHECK(cudaMemset(scratch, 0, sizeof(int)));
  TEST_CUDA_CHECK(cudaMemcpy(x, input.x.data(), input.x.size(), cudaMemcpyHostToDevice));
  if (run.fp8) TEST_CUDA_CHECK(cudaMemcpy(scales, input.scales.data(), input.scales.size() * 4, cudaMemcpyHostToDevice));
  TEST_CUDA_CHECK(cudaMemcpy(topk, input.topk.data(), input.topk.size() * 8, cudaMemcpyHostToDevice));
  TEST_CUDA_CHECK(cudaMemcpy(weights, input.weights.data(), input.weights.size() * 4, cudaMemcpyHostToDevice));

  unifabEpDispatchArgs_t args = UNIFAB_EP_DISPATCH_ARGS_INIT;
  args.numTokens = run.tokens;
  args.dtype = run.fp8 ? unifabEpFp8E4M3 : unifabEpBf16;
  args.x = x;
  args.scales = scales;
  args.topkIdx = topk;
  args.topkWeights = weights;
  args.layout = run.expertMajor ? unifabEpExpertMajor : unifabEpRankMajor;
  args.numSms = run.sms;
  unifabEpDispatchResult_t result;
  result.size = sizeof(result);
  unifabEpHandle_t handle = nullptr;
  args.hostCounts = 1;
  BENCH_EP_CHECK(unifabEpDispatch(group, &args, session.stream(), &handle, &result));
  args.hostCounts = 0;
  std::vector<int> perRank(env.nRanks);
  TEST_CUDA_CHECK(cudaMemcpy(perRank.data(), result.recvRowsPerRank, sizeof(int) * env.nRanks, cudaMemcpyDeviceToHost));
  const int rows = result.hostNumRecvRows;
  int rankMajorRows = 0;
  for (int v : perRank) rankMajorRows += v;
  const int remoteRows = rankMajorRows - perRank[env.rank];
  TEST_CUDA_CHECK(cudaMalloc(&expertOut, static_cast<size_t>(result.maxRows) * run.hidden * 2));
  TEST_CUDA_CHECK(test::ep::fillExpertOutputs(static_cast<uint16_t*>(expertOut), run.hidden, result.recvSource,
                                              result.numRecvRows, run.expertMajor, result.expertOffsets,
                                              result.recvRowsPerExpert, run.experts / env.nRanks, env.rank, 5,
                                              result.maxRows, session.stream()));

  Timer timer;
  TEST_CUDA_CHECK(cudaEventCreate(&timer.start));
  TEST_CUDA_CHECK(cudaEventCreate(&timer.stop));
  TEST_CUDA_CHECK(cudaMalloc(&timer.flush, timer.flushBytes));

  double dispatchUs = 0, combineUs = 0, ncclUs = 0;
  // One timed dispatch with `a`; a fresh routing handle is released at once, a cached one is the
  // caller's and stays.
  auto dispatchOf = [&](const unifabEpDispatchArgs_t& a) {
    return [&, call = &a]() {
      unifabEpHandle_t h = nullptr;
      unifabEpDispatchResult_t r;
      r.size = sizeof(r);
      if (unifabEpDispatch(group, call, session.stream(), &h, &r) != unifabSuccess) return false;
      return call->cachedHandle != nullptr || unifabEpHandleDestroy(h) == unifabSuccess;
    };
  };
  unifabEpCombineArgs_t cargs = UNIFAB_EP_COMBINE_ARGS_INIT;
  cargs.expertOutput = expertOut;
  cargs.combinedX = combined;
  auto combine = [&]() { return unifabEpCombine(group, handle, &cargs, session.stream()) == unifabSuccess; };
  // Where the time goes: the same dispatch with the routing of the first one (no layout and no
  // count exchange), and a dispatch of zero tokens (launches and the two exchanges alone).
  unifabEpDispatchArgs_t cachedArgs = args;
  cachedArgs.cachedHandle = handle;
  cachedArgs.topkIdx = nullptr;
  unifabEpDispatchArgs_t emptyArgs = args;
  emptyArgs.numTokens = 0;
  auto dispatch = dispatchOf(args);
  auto dispatchCached = dispatchOf(cachedArgs);
  auto dispatchEmpty = dispatchOf(emptyArgs);
  double cachedUs = 0, emptyUs = 0;
  if (!timeOp(session, timer, scratch, run, dispatch, &dispatchUs)) return false;
  if (!timeOp(session, timer, scratch, run, dispatchCached, &cachedUs)) return false;
  if (!timeOp(session, timer, scratch, run, dispatchEmpty, &emptyUs)) return false;
  if (!timeOp(session, timer, scratch, run, combine, &combineUs)) return false;
  BENCH_EP_CHECK(unifabEpGetAsyncError(group));

  // NCCL's grouped send/recv all-to-all moving this rank's dispatch rows to the same ranks.
  const size_t rowBytes = static_cast<size_t>(run.hidden) * (run.fp8 ? 1 : 2) + (run.fp8 ? run.hidden / 128 * 4 : 0);
  std::vector<size_t> sendRows(env.nRanks, 0);
  const int local = run.experts / env.nRanks;
  for (int t = 0; t < run.tokens; ++t) {
    uint64_t mask = 0;
    for (int k = 0; k < run.topk; ++k) {
      int64_t e = input.topk[static_cast<size_t>(t) * run.topk + k];
      if (e >= 0) mask |= 1ULL << (e / local);
    }
    for (int d = 0; d < env.nRanks; ++d) sendRows[d] += (mask >> d) & 1;
  }
  size_t maxBytes = static_cast<size_t>(run.tokens) * rowBytes;
  char *a2aSend = nullptr, *a2aRecv = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&a2aSend, maxBytes * env.nRanks));
  TEST_CUDA_CHECK(cudaMalloc(&a2aRecv, maxBytes * env.nRanks));
  auto alltoall = [&]() {
    if (ncclGroupStart() != ncclSuccess) return false;
    for (int d = 0; d < env.nRanks; ++d) {
      // Symmetric uniform routing: each rank receives from d about what it sends to d.
      if (ncclSend(a2aSend + d * maxBytes, sendRows[d] * rowBytes, ncclChar, d, session.comm(), session.stream()) != ncclSuccess) return false;
      if (ncclRecv(a2aRecv + d * maxBytes, sendRows[d] * rowBytes, ncclChar, d, session.comm(), session.stream()) != ncclSuccess) return false;
    }
    return ncclGroupEnd() == ncclSuccess;
  };
  if (!timeOp(session, timer, scratch, run, alltoall, &ncclUs)) return false;

  double localDispatch = dispatchUs, localCombine = combineUs, localNccl = ncclUs;
  if (!slowest(session, &dispatchUs) || !slowest(session, &combineUs) || !slowest(session, &ncclUs) ||
      !slowest(session, &cachedUs) || !slowest(session, &emptyUs)) {
    return false;
  }
  const double dispatchBytes = static_cast<double>(rankMajorRows) * rowBytes;
  const double remoteDispatchBytes = static_cast<double>(remoteRows) * rowBytes;
  const double combineBytes = static_cast<double>(rankMajorRows) * run.hidden * 2;
  const double remoteCombineBytes = static_cast<double>(remoteRows) * run.hidden * 2;
  printf("rank %d: dispatch %.1f us, combine %.1f us, NCCL all-to-all %.1f us; %d rows received (%d remote)%s\n",
         env.rank, localDispatch, localCombine, localNccl, rankMajorRows, remoteRows,
         run.expertMajor ? (", " + std::to_string(rows) + " expert-major rows").c_str() : "");
  if (env.rank == 0) {
    int sms = run.sms > 0 ? run.sms : -1;
    printf("# unifab-bench ep ht: %d ranks, %d tokens/rank, hidden %d, top-%d, %d experts, %s dispatch, %s, SMs %s\n",
           env.nRanks, run.tokens, run.hidden, run.topk, run.experts, run.fp8 ? "FP8" : "BF16",
           run.expertMajor ? "expert-major" : "rank-major", sms > 0 ? std::to_string(sms).c_str() : "auto");
    printf("# median of %d after %d warm-up, L2 flushed, slowest rank; GB/s = 1e9 B/s\n", run.iters, run.warmup);
    printf("# %-22s %12s %16s %16s\n", "op", "time(us)", "DeepEP GB/s", "NVLink GB/s");
    printf("  %-22s %12.1f %16.1f %16.1f\n", "dispatch", dispatchUs, dispatchBytes / (dispatchUs * 1e3),
           remoteDispatchBytes / (dispatchUs * 1e3));
    printf("  %-22s %12.1f %16.1f %16.1f\n", "dispatch, cached", cachedUs, dispatchBytes / (cachedUs * 1e3),
           remoteDispatchBytes / (cachedUs * 1e3));
    printf("  %-22s %12.1f %16s %16s\n", "dispatch, 0 tokens", emptyUs, "-", "-");
    printf("  %-22s %12.1f %16.1f %16.1f\n", "combine", combineUs, combineBytes / (combineUs * 1e3),
           remoteCombineBytes / (combineUs * 1e3));
    printf("  %-22s %12.1f %16.1f %16.1f\n", "nccl send/recv a2a", ncclUs, dispatchBytes / (ncclUs * 1e3),
           remoteDispatchBytes / (ncclUs * 1e3));
    if (!run.csv.empty()) {
      FILE* f = fopen(run.csv.c_str(), "w");
      if (f != nullptr) {
        fprintf(f, "op,ranks,tokens,hidden,topk,experts,dtype,layout,sms,time_us,deepep_gbs,nvlink_gbs\n");
        const char* dtype = run.fp8 ? "fp8" : "bf16";
        const char* layout = run.expertMajor ? "expert" : "rank";
        fprintf(f, "dispatch,%d,%d,%d,%d,%d,%s,%s,%d,%.2f,%.2f,%.2f\n", env.nRanks, run.tokens, run.hidden, run.topk,
                run.experts, dtype, layout, run.sms, dispatchUs, dispatchBytes / (dispatchUs * 1e3),
                remoteDispatchBytes / (dispatchUs * 1e3));
        fprintf(f, "combine,%d,%d,%d,%d,%d,%s,%s,%d,%.2f,%.2f,%.2f\n", env.nRanks, run.tokens, run.hidden, run.topk,
                run.experts, dtype, layout, run.sms, combineUs, combineBytes / (combineUs * 1e3),
                remoteCombineBytes / (combineUs * 1e3));
        fprintf(f, "nccl_a2a,%d,%d,%d,%d,%d,%s,%s,%d,%.2f,%.2f,%.2f\n", env.nRanks, run.tokens, run.hidden, run.topk,
                run.experts, dtype, layout, 0, ncclUs, dispatchBytes / (ncclUs * 1e3), remoteDispatchBytes / (ncclUs * 1e3));
        fclose(f);
      }
    }
  }
  BENCH_EP_CHECK(unifabEpHandleDestroy(handle));
  BENCH_EP_CHECK(unifabEpDestroy(group));
  return true;
}

}  // namespace

int runEp(Args& args, const char* self) {
  EpRun run;
  std::string mode = args.value("--mode", "ht");
  run.tokens = atoi(args.value("--tokens", "4096").c_str());
  run.hidden = atoi(args.value("--hidden", "7168").c_str());
  run.topk = atoi(args.value("--topk", "8").c_str());
  run.experts = atoi(args.value("--experts", "256").c_str());
  run.sms = atoi(args.value("--sms", "0").c_str());
  run.iters = atoi(args.value("--iters", "30").c_str());
  run.warmup = atoi(args.value("--warmup", "5").c_str());
  run.fp8 = args.value("--dtype", "bf16") == "fp8";
  run.expertMajor = args.value("--layout", "rank") == "expert";
  run.csv = args.value("--csv", "");
  std::string ranksText = args.value("--nranks", "0");
  if (!args.leftovers().empty()) {
    fprintf(stderr, "unifab-bench ep: unknown argument '%s'\n", args.leftovers()[0].c_str());
    return 2;
  }
  if (mode != "ht") {
    fprintf(stderr, "unifab-bench ep: --mode %s is not built yet (ht is)\n", mode.c_str());
    return 2;
  }
  test::RankEnvironment env = test::rankEnvironment();
  if (env.launched) return runEpRank(run, env) ? 0 : 1;
  int nRanks = atoi(ranksText.c_str());
  if (nRanks <= 0 && (cudaGetDeviceCount(&nRanks) != cudaSuccess || nRanks < 1)) {
    fprintf(stderr, "unifab-bench ep: no CUDA device\n");
    return 1;
  }
  test::LaunchOptions launch;
  launch.nRanks = nRanks;
  launch.environment.push_back(std::string("NCCL_NVLS_ENABLE=") + (getenv("NCCL_NVLS_ENABLE") ? getenv("NCCL_NVLS_ENABLE") : "0"));
  if (getenv("NCCL_SOCKET_IFNAME") == nullptr) launch.environment.push_back("NCCL_SOCKET_IFNAME=lo");
  std::vector<std::string> argv = {self, "ep"};
  for (const std::string& item : args.items) argv.push_back(item);
  return test::launchRanks(launch, argv);
}

}  // namespace unifab::bench
