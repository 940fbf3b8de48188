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
#include "tests/bench/copy_ceiling.h"
#include "tests/bench/ep_timing.h"
#include "tests/common/test_util.h"
#include "tests/common/ep_device.h"
#include "tests/common/ep_reference.h"
#include "tests/common/nccl_session.h"
#include "unifab/unifab.h"

namespace unifab::bench {
namespace {

struct EpRun {
  int tokens, hidden, topk, experts, sms, iters, warmup;
  bool fp8, expertMajor;
  std::string csv;
  std::string ops;  // comma-separated subset of dispatch,empty,cached,combine,combine-input,nccl,ceiling; empty: all
  bool wants(const char* op) const { return opSelected(ops, op); }
};

bool runEpRank(const EpRun& run, const test::RankEnvironment& env) {
  test::NcclSession session;
  if (!session.init(env)) return false;
  const test::ep::Shape shape = test::ep::makeShape(env.nRanks, run.experts, run.hidden, run.topk, run.tokens);
  // Uniform routing, no masked entries: the standard benchmark shape.
  test::ep::RankInput input = test::ep::makeInput(shape, env.rank, 777, run.fp8, 0, run.tokens);

  unifabEpConfig_t config = test::ep::groupConfig(shape);
  unifabEpGroup_t group = nullptr;
  TEST_UNIFAB_CHECK(unifabEpCreate(session.comm(), &config, &group));

  test::ep::DeviceInput device;
  if (!device.allocate(shape) || !device.upload(input, false, session.stream())) return false;
  void *expertOut = nullptr, *combined = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&combined, static_cast<size_t>(run.tokens) * run.hidden * 2));

  unifabEpDispatchArgs_t args = UNIFAB_EP_DISPATCH_ARGS_INIT;
  args.numTokens = run.tokens;
  args.dtype = run.fp8 ? unifabEpFp8E4M3 : unifabEpBf16;
  args.x = device.x;
  args.scales = device.scales;
  args.topkIdx = device.topk;
  args.topkWeights = device.weights;
  args.layout = run.expertMajor ? unifabEpExpertMajor : unifabEpRankMajor;
  args.numSms = run.sms;
  unifabEpDispatchResult_t result;
  result.size = sizeof(result);
  unifabEpHandle_t handle = nullptr;
  args.hostCounts = 1;
  TEST_UNIFAB_CHECK(unifabEpDispatch(group, &args, session.stream(), &handle, &result));
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
  cargs.numSms = run.sms;
  auto combine = [&]() { return unifabEpCombine(group, handle, &cargs, session.stream()) == unifabSuccess; };
  // The same combine with the expert outputs in the group's combine input (where an expert GEMM
  // would write them), which the other ranks read in place.
  unifabEpCombineArgs_t inputArgs = cargs;
  if (!run.expertMajor) {
    void* combineInput = nullptr;
    TEST_UNIFAB_CHECK(unifabEpCombineInputBuffer(group, &combineInput, nullptr));
    TEST_CUDA_CHECK(test::ep::fillExpertOutputs(static_cast<uint16_t*>(combineInput), run.hidden, result.recvSource,
                                                result.numRecvRows, false, result.expertOffsets,
                                                result.recvRowsPerExpert, run.experts / env.nRanks, env.rank, 5,
                                                result.maxRows, session.stream()));
    inputArgs.expertOutput = combineInput;
  }
  auto combineFromInput = [&]() { return unifabEpCombine(group, handle, &inputArgs, session.stream()) == unifabSuccess; };
  // Where the time goes: the same dispatch with the routing of the first one (no layout), and a
  // dispatch of zero tokens (launch and the two handshakes alone).
  unifabEpDispatchArgs_t cachedArgs = args;
  cachedArgs.cachedHandle = handle;
  cachedArgs.topkIdx = nullptr;
  unifabEpDispatchArgs_t emptyArgs = args;
  emptyArgs.numTokens = 0;
  OpTimes dispatchT, cachedT, emptyT, combineT, combineInputT, ncclT;
  if (run.wants("dispatch") && !timeOp(session, timer, run.iters, run.warmup, dispatchOf(args), &dispatchT)) return false;
  if (run.wants("empty") && !timeOp(session, timer, run.iters, run.warmup, dispatchOf(emptyArgs), &emptyT)) return false;
  // Last before combine: combine needs its handle's dispatch to be the group's latest.
  if (run.wants("cached") && !timeOp(session, timer, run.iters, run.warmup, dispatchOf(cachedArgs), &cachedT)) return false;
  if (!run.wants("cached") && (run.wants("combine") || run.wants("combine-input"))) {
    TEST_UNIFAB_CHECK(unifabEpDispatch(group, &cachedArgs, session.stream(), &handle, &result));
  }
  if (run.wants("combine") && !timeOp(session, timer, run.iters, run.warmup, combine, &combineT)) return false;
  if (!run.expertMajor && run.wants("combine-input") &&
      !timeOp(session, timer, run.iters, run.warmup, combineFromInput, &combineInputT)) {
    return false;
  }
  TEST_UNIFAB_CHECK(unifabEpGetAsyncError(group));

  // NCCL's grouped send/recv all-to-all moving this rank's dispatch rows to the same ranks.
  const size_t rowBytes = static_cast<size_t>(run.hidden) * (run.fp8 ? 1 : 2) + (run.fp8 ? run.hidden / 128 * 4 : 0);
  std::vector<size_t> sendBytes(env.nRanks, 0), recvBytes(env.nRanks, 0);
  const int local = run.experts / env.nRanks;
  for (int t = 0; t < run.tokens; ++t) {
    uint64_t mask = 0;
    for (int k = 0; k < run.topk; ++k) {
      int64_t e = input.topk[static_cast<size_t>(t) * run.topk + k];
      if (e >= 0) mask |= 1ULL << (e / local);
    }
    for (int d = 0; d < env.nRanks; ++d) sendBytes[d] += ((mask >> d) & 1) * rowBytes;
  }
  // What each peer sends here is what the dispatch received from it.
  for (int d = 0; d < env.nRanks; ++d) recvBytes[d] = static_cast<size_t>(perRank[d]) * rowBytes;
  size_t maxBytes = static_cast<size_t>(run.tokens) * rowBytes;
  char *a2aSend = nullptr, *a2aRecv = nullptr;
  TEST_CUDA_CHECK(cudaMalloc(&a2aSend, maxBytes * env.nRanks));
  TEST_CUDA_CHECK(cudaMalloc(&a2aRecv, maxBytes * env.nRanks));
  auto alltoall = [&]() { return session.exchange(a2aSend, a2aRecv, maxBytes, sendBytes.data(), recvBytes.data()); };
  if (run.wants("nccl") && !timeOp(session, timer, run.iters, run.warmup, alltoall, &ncclT)) return false;
  TEST_CUDA_CHECK(cudaFree(a2aSend));
  TEST_CUDA_CHECK(cudaFree(a2aRecv));

  // The same received bytes moved by plain copies: what NVLink and the SMs allow for this exchange.
  const int ceilingSms = run.sms > 0 ? run.sms : 24;
  CopyCeiling ceiling;
  if (run.wants("ceiling") && !measureCopyCeiling(session, static_cast<size_t>(remoteRows) * rowBytes,
                          static_cast<size_t>(perRank[env.rank]) * rowBytes, rowBytes, ceilingSms, run.iters,
                          timer.flush, timer.flushBytes, &ceiling)) {
    return false;
  }

  printf("rank %d: %d rows received (%d remote)%s\n", env.rank, rankMajorRows, remoteRows,
         run.expertMajor ? (", " + std::to_string(rows) + " expert-major rows").c_str() : "");
  if (env.rank == 0) {
    const double dispatchBytes = static_cast<double>(rankMajorRows) * rowBytes;
    const double remoteDispatchBytes = static_cast<double>(remoteRows) * rowBytes;
    const double combineBytes = static_cast<double>(rankMajorRows) * run.hidden * 2;
    const double remoteCombineBytes = static_cast<double>(remoteRows) * run.hidden * 2;
    const int sms = run.sms > 0 ? run.sms : -1;
    printf("# unifab-bench ep ht: %d ranks, %d tokens/rank, hidden %d, top-%d, %d experts, %s dispatch, %s, SMs %s\n",
           env.nRanks, run.tokens, run.hidden, run.topk, run.experts, run.fp8 ? "FP8" : "BF16",
           run.expertMajor ? "expert-major" : "rank-major", sms > 0 ? std::to_string(sms).c_str() : "auto");
    printf("# median of %d after %d warm-up, L2 flushed, slowest rank; GB/s = 1e9 B/s; b2b = per call of %d in a row"
           " (median of %d runs); host = time inside the call\n", run.iters, run.warmup, backToBackCalls(), kBackToBackRuns);
    printf("# %-30s %10s %12s %12s %10s %10s\n", "op", "time(us)", "DeepEP GB/s", "NVLink GB/s", "b2b(us)", "host(us)");
    auto row = [&](const char* name, const OpTimes& t, double bytes, double remote) {
      if (t.us <= 0) return;  // not run (--ops)
      printf("  %-30s %10.1f %12.1f %12.1f %10.1f %10.1f\n", name, t.us, bytes / (t.us * 1e3), remote / (t.us * 1e3),
             t.backToBackUs, t.hostUs);
    };
    row("dispatch", dispatchT, dispatchBytes, remoteDispatchBytes);
    row("dispatch, cached", cachedT, dispatchBytes, remoteDispatchBytes);
    if (emptyT.us > 0) printf("  %-30s %10.1f %12s %12s %10.1f %10.1f\n", "dispatch, 0 tokens", emptyT.us, "-", "-", emptyT.backToBackUs,
           emptyT.hostUs);
    row("combine", combineT, combineBytes, remoteCombineBytes);
    row("combine from combine input", combineInputT, combineBytes, remoteCombineBytes);
    row("nccl send/recv a2a", ncclT, dispatchBytes, remoteDispatchBytes);
    if (ceiling.copyEngineUs > 0) printf("  %-30s %10.1f %12.1f %12.1f\n", "copy ceiling, copy engines", ceiling.copyEngineUs,
           dispatchBytes / (ceiling.copyEngineUs * 1e3), remoteDispatchBytes / (ceiling.copyEngineUs * 1e3));
    if (ceiling.smUs > 0) {
      const std::string name = "copy ceiling, " + std::to_string(ceilingSms) + " SMs";
      printf("  %-30s %10.1f %12.1f %12.1f\n", name.c_str(), ceiling.smUs, dispatchBytes / (ceiling.smUs * 1e3),
             remoteDispatchBytes / (ceiling.smUs * 1e3));
      printf("  %-30s %10.1f %12s %12.1f\n", "  remote rows only", ceiling.smRemoteOnlyUs, "-",
             remoteDispatchBytes / (ceiling.smRemoteOnlyUs * 1e3));
      printf("  %-30s %10.1f %12s %12s\n", "  local rows only", ceiling.smLocalOnlyUs, "-", "-");
      printf("  %-30s %10.1f %12s %12.1f\n", "  remote only, masked rounds", ceiling.smRemoteOnlyPredicatedUs, "-",
             remoteDispatchBytes / (ceiling.smRemoteOnlyPredicatedUs * 1e3));
      if (ceiling.smSplit8PredicatedUs > 0) {
        printf("  %-30s %10.1f %12.1f %12.1f\n", "  split 8, masked rounds", ceiling.smSplit8PredicatedUs,
               dispatchBytes / (ceiling.smSplit8PredicatedUs * 1e3), remoteDispatchBytes / (ceiling.smSplit8PredicatedUs * 1e3));
      }
      for (const CopyCeiling::Variant& v : ceiling.variants) {
        const std::string label = std::string("  ") + v.name;
        char deepEp[32] = "-";
        if (!v.remoteOnly) snprintf(deepEp, sizeof deepEp, "%.1f", dispatchBytes / (v.us * 1e3));
        printf("  %-30s %10.1f %12s %12.1f\n", label.c_str(), v.us, deepEp, remoteDispatchBytes / (v.us * 1e3));
      }
      for (const CopyCeiling::Split& split : ceiling.splits) {
        const std::string label = "  split " + std::to_string(split.remoteBlocks) + " remote SMs";
        printf("  %-30s %10.1f %12.1f %12.1f\n", label.c_str(), split.us, dispatchBytes / (split.us * 1e3),
               remoteDispatchBytes / (split.us * 1e3));
      }
    }
    if (!run.csv.empty()) {
      FILE* f = fopen(run.csv.c_str(), "w");
      if (f != nullptr) {
        fprintf(f, "op,ranks,tokens,hidden,topk,experts,dtype,layout,sms,time_us,deepep_gbs,nvlink_gbs,b2b_us,host_us\n");
        const char* dtype = run.fp8 ? "fp8" : "bf16";
        const char* layout = run.expertMajor ? "expert" : "rank";
        auto csvRow = [&](const char* op, int opSms, const OpTimes& t, double bytes, double remote) {
          if (t.us <= 0) return;
          fprintf(f, "%s,%d,%d,%d,%d,%d,%s,%s,%d,%.2f,%.2f,%.2f,%.2f,%.2f\n", op, env.nRanks, run.tokens, run.hidden,
                  run.topk, run.experts, dtype, layout, opSms, t.us, bytes / (t.us * 1e3), remote / (t.us * 1e3),
                  t.backToBackUs, t.hostUs);
        };
        csvRow("dispatch", run.sms, dispatchT, dispatchBytes, remoteDispatchBytes);
        csvRow("dispatch_cached", run.sms, cachedT, dispatchBytes, remoteDispatchBytes);
        csvRow("combine", run.sms, combineT, combineBytes, remoteCombineBytes);
        csvRow("combine_input", run.sms, combineInputT, combineBytes, remoteCombineBytes);
        csvRow("nccl_a2a", 0, ncclT, dispatchBytes, remoteDispatchBytes);
        OpTimes ce{ceiling.copyEngineUs, 0, 0}, sm{ceiling.smUs, 0, 0};
        csvRow("copy_engine_ceiling", 0, ce, dispatchBytes, remoteDispatchBytes);
        if (ceiling.smUs > 0) csvRow("sm_copy_ceiling", ceilingSms, sm, dispatchBytes, remoteDispatchBytes);
        fclose(f);
      }
    }
  }
  // Per rank, in rank order: its own median and the bytes it received itself (the table above is the
  // slowest rank's time over rank 0's bytes). The bracket keeps these lines out of the ab step's
  // row filter (tests/run-gpu.sh).
  const double ownDispatchBytes = static_cast<double>(rankMajorRows) * rowBytes;
  const double ownRemoteBytes = static_cast<double>(remoteRows) * rowBytes;
  const double ownCombineBytes = static_cast<double>(rankMajorRows) * run.hidden * 2;
  const double ownRemoteCombineBytes = static_cast<double>(remoteRows) * run.hidden * 2;
  for (int r = 0; r < env.nRanks; ++r) {
    if (r == env.rank) {
      std::string text = "# rank " + std::to_string(r) + ": its own median time(us), DeepEP GB/s and NVLink GB/s over the rows"
                         " it received (" + std::to_string(rankMajorRows) + ", " + std::to_string(remoteRows) + " remote)\n";
      auto line = [&](const char* name, const OpTimes& t, double bytes, double remote) {
        if (t.ownUs <= 0) return;
        char buffer[160];
        snprintf(buffer, sizeof buffer, "  [rank %d] %-26s %10.1f %12.1f %12.1f\n", r, name, t.ownUs, bytes / (t.ownUs * 1e3),
                 remote / (t.ownUs * 1e3));
        text += buffer;
      };
      line("dispatch", dispatchT, ownDispatchBytes, ownRemoteBytes);
      line("dispatch, cached", cachedT, ownDispatchBytes, ownRemoteBytes);
      line("combine", combineT, ownCombineBytes, ownRemoteCombineBytes);
      line("combine from combine input", combineInputT, ownCombineBytes, ownRemoteCombineBytes);
      line("nccl send/recv a2a", ncclT, ownDispatchBytes, ownRemoteBytes);
      fputs(text.c_str(), stdout);
      fflush(stdout);
    }
    if (!session.barrier(true)) return false;
  }
  TEST_UNIFAB_CHECK(unifabEpHandleDestroy(handle));
  TEST_UNIFAB_CHECK(unifabEpDestroy(group));
  return true;
}

}  // namespace

int runEpLowLatency(Args& args, const char* self);  // bench_ep_ll.cc

int runEp(Args& args, const char* self) {
  std::string mode = args.value("--mode", "ht");
  if (mode == "ll") return runEpLowLatency(args, self);
  EpRun run;
  run.tokens = atoi(args.value("--tokens", "4096").c_str());
  run.hidden = atoi(args.value("--hidden", "7168").c_str());
  run.topk = atoi(args.value("--topk", "8").c_str());
  run.experts = atoi(args.value("--experts", "256").c_str());
  run.sms = atoi(args.value("--sms", "0").c_str());
  run.iters = atoi(args.value("--iters", "30").c_str());
  run.warmup = atoi(args.value("--warmup", "5").c_str());
  const std::string dtype = args.value("--dtype", "bf16");
  const std::string layout = args.value("--layout", "rank");
  run.fp8 = dtype == "fp8";
  run.expertMajor = layout == "expert";
  run.csv = args.value("--csv", "");
  run.ops = args.value("--ops", "");
  std::string ranksText = args.value("--nranks", "0");
  if (!parseBackToBack(args, "ep")) return 2;
  if (!args.leftovers().empty()) {
    fprintf(stderr, "unifab-bench ep: unknown argument '%s'\n", args.leftovers()[0].c_str());
    return 2;
  }
  if ((dtype != "bf16" && dtype != "fp8") || (layout != "rank" && layout != "expert")) {
    fprintf(stderr, "unifab-bench ep: --dtype is bf16 or fp8 (got %s), --layout rank or expert (got %s)\n",
                    dtype.c_str(), layout.c_str());
    return 2;
  }
  if (mode != "ht") {
    fprintf(stderr, "unifab-bench ep: --mode is ht or ll (got %s)\n", mode.c_str());
    return 2;
  }
  test::RankEnvironment env = test::rankEnvironment();
  if (env.launched) return runEpRank(run, env) ? 0 : 1;
  return relaunchPerGpu(self, "ep", args, atoi(ranksText.c_str()), {});
}

}  // namespace unifab::bench
